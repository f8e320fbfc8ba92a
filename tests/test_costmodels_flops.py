import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from costmodels import op_bytes_accessed, op_flops

aten = torch.ops.aten


class Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, kwargs or {}, out))
        return out


def test_mm_matches_flop_counter_mode():
    a, b = torch.randn(32, 64), torch.randn(64, 16)
    out = torch.mm(a, b)
    assert op_flops(aten.mm.default, (a, b), {}, out) == 2 * 32 * 64 * 16


def test_meta_tensors_and_conv():
    x = torch.empty(2, 3, 16, 16, device="meta")
    w = torch.empty(8, 3, 3, 3, device="meta")
    out = torch.nn.functional.conv2d(x, w)
    args = (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    assert op_flops(aten.convolution.default, args, {}, out) == 2 * 2 * 8 * 14 * 14 * 3 * 9


def test_model_total_matches_flop_counter_for_matmuls():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    with FlopCounterMode(display=False) as fc:
        model(x)
    with Record() as rec:
        model(x)
    mm_ops = {aten.addmm.default, aten.mm.default}
    ours = sum(op_flops(f, a, k, o) for f, a, k, o in rec.calls if f in mm_ops)
    assert ours == fc.get_total_flops()


def test_views_factories_and_elementwise():
    x = torch.randn(4, 5)
    assert op_flops(aten.view.default, (x, [20]), {}, x.view(20)) == 0
    assert op_flops(aten.t.default, (x,), {}, x.t()) == 0
    assert op_flops(aten.expand.default, (x[:1], [4, 5]), {}, x[:1].expand(4, 5)) == 0
    assert op_flops(aten._unsafe_view.default, (x, [20]), {}, x.reshape(20)) == 0
    assert op_flops(aten.zeros_like.default, (x,), {}, torch.zeros_like(x)) == 0
    assert op_flops(aten.empty.memory_format, ([4, 5],), {}, torch.empty(4, 5)) == 0
    assert op_flops(aten.add.Tensor, (x, x), {}, x + x) == 20
    assert op_flops(aten.add_.Tensor, (x, x), {}, x) == 20  # in-place still computes
    assert op_flops(aten.sum.default, (x,), {}, x.sum()) == 1
    assert op_flops(aten.eq.Tensor, (x, x), {}, x == x) == 0  # non-floating output


def test_never_raises():
    x = torch.randn(3)
    assert op_flops(aten.mm.default, ("garbage",), {}, x) == 3  # formula fails -> fallback
    assert op_flops(object(), None, None, None) == 0
    assert op_flops(lambda: None, (x,), {}, [x, (x, 1)]) == 6  # unknown op: output elements
    assert op_flops(lambda: None, (), {}, x) == 0  # no tensor inputs: a factory


def test_bytes_accessed():
    a, b = torch.randn(8, 4), torch.randn(4, 2, dtype=torch.float32)
    out = a @ b
    assert op_bytes_accessed((a, b), out) == (32 + 8 + 16) * 4
    h = torch.empty(10, dtype=torch.bfloat16, device="meta")
    assert op_bytes_accessed((h, 2.0), [h]) == 20  # same tensor counted once
