import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from costmodels import (
    OPTIMIZERS,
    PRECISIONS,
    ModelStates,
    check_optimizer,
    dtype_bytes,
    get_precision,
    model_state_bytes,
    optimizer_state_bytes,
    optimizer_step_temporary_bytes,
)


class LiveStorages(TorchDispatchMode):
    """Peak bytes of storages created inside the mode and still alive."""

    def __init__(self):
        super().__init__()
        self.live, self.cur, self.peak = {}, 0, 0

    def _free(self, key, n):
        if self.live.pop(key, None) is not None:
            self.cur -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                k, n = s.data_ptr(), s.nbytes()
                if n == 0 or k in inputs or k in self.live:
                    continue
                self.live[k] = n
                self.cur += n
                self.peak = max(self.peak, self.cur)
                weakref.finalize(s, self._free, k, n)
        return out


def make_opt(name, params, foreach):
    if name == "adamw":
        return torch.optim.AdamW(params, foreach=foreach)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=foreach)
    return torch.optim.Adafactor(params, foreach=foreach)


def run_step(name, shapes, dtype, foreach):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]
    opt = make_opt(name, params, foreach)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # initialises the states
    for p in params:
        p.grad = torch.randn_like(p)
    mode = LiveStorages()
    with mode:
        opt.step()
    states = sum(v.untyped_storage().nbytes() for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    return mode.peak, states


SHAPE_SETS = [
    [(64, 32), (1000,), (16, 8, 4), (300, 7), (5,)],
    [(7,), (128, 128), (33, 65), (2, 3, 40, 9), (4096,), (1, 1)],
    [(300,), (10, 10)],
]


@pytest.mark.parametrize("name", ["adamw", "sgd", "adafactor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("shapes", SHAPE_SETS)
def test_formulas_match_real_optimizer_step(name, dtype, foreach, shapes):
    peak, states = run_step(name, shapes, dtype, foreach)
    assert optimizer_step_temporary_bytes(shapes, dtype, name, foreach) == peak
    assert optimizer_state_bytes(shapes, dtype, name) == states


def test_adamw_single_tensor_is_about_twice_largest():
    shapes = [(1024, 1024), (8,)]
    assert optimizer_step_temporary_bytes(shapes, torch.float32, "adamw", False) == 2 * 4 * 2**20 + 0
    assert optimizer_step_temporary_bytes(shapes, torch.float32, "adamw", True) == 4 * (2**20 + 8)
    assert optimizer_step_temporary_bytes(shapes, torch.float32, "adamw-8bit", True) == 4 * 2**20
    assert optimizer_step_temporary_bytes(shapes, torch.float32, "none", False) == 0
    assert optimizer_step_temporary_bytes([], torch.float32, "adamw", False) == 0


def llama70b_shapes():
    h, inter, layers, kv, vocab = 8192, 28672, 80, 1024, 128256
    layer = [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter), (h,), (h,)]
    return [(vocab, h)] + layer * layers + [(h,), (vocab, h)]


def test_llama70b_bf16_mixed_adamw_16_bytes_per_param():
    shapes = llama70b_shapes()
    ms = model_state_bytes(shapes, get_precision("bf16-mixed"), "adamw")
    assert ms.num_parameters == pytest.approx(70.55e9, rel=1e-3)
    assert ms.parameter == ms.gradient == 4 * ms.num_parameters
    assert ms.total / ms.num_parameters == pytest.approx(16, rel=1e-3)
    eight = optimizer_state_bytes(shapes, torch.float32, "adamw-8bit")
    assert eight / ms.num_parameters == pytest.approx(2, rel=0.02)
    z3 = model_state_bytes(shapes, get_precision("bf16-mixed"), "adamw", zero_stage=3, dp=32)
    for field in ("parameter", "gradient", "optimizer", "optimizer_step_temporary"):
        assert getattr(z3, field) == pytest.approx(getattr(ms, field) / 32, abs=1)
    assert z3.num_parameters == ms.num_parameters


def test_zero_stages_and_to_dict():
    shapes = [(100, 10)]
    p = get_precision("bf16")
    base = model_state_bytes(shapes, p, "sgd")
    assert (base.parameter, base.gradient, base.optimizer) == (2000, 2000, 2000)
    z1 = model_state_bytes(shapes, p, "sgd", zero_stage=1, dp=4)
    assert (z1.parameter, z1.gradient, z1.optimizer) == (2000, 2000, 500)
    z2 = model_state_bytes(shapes, p, "sgd", zero_stage=2, dp=4)
    assert (z2.parameter, z2.gradient, z2.optimizer) == (2000, 500, 500)
    assert model_state_bytes(shapes, p, "sgd", zero_stage=3, dp=1) == base
    d = z2.to_dict()
    assert d["total"] == z2.total == 3000 and ModelStates(**{k: v for k, v in d.items() if k != "total"}) == z2
    assert model_state_bytes(shapes, p, "none").optimizer == 0
    with pytest.raises(ValueError, match="zero_stage"):
        model_state_bytes(shapes, p, "sgd", zero_stage=4)
    with pytest.raises(ValueError, match="dp"):
        model_state_bytes(shapes, p, "sgd", dp=0)


def test_precisions_and_names():
    assert set(PRECISIONS) == {"fp32", "bf16", "bf16-mixed", "fp16-mixed"}
    assert get_precision("fp16-mixed").autocast_dtype is torch.float16
    assert get_precision("bf16").param_dtype is torch.bfloat16 and get_precision("bf16").autocast_dtype is None
    assert get_precision("bf16-mixed").to_dict() == {
        "name": "bf16-mixed",
        "param_dtype": "float32",
        "autocast_dtype": "bfloat16",
    }
    with pytest.raises(ValueError, match="choose one of: fp32, bf16"):
        get_precision("fp8")
    assert OPTIMIZERS == ("adamw", "adamw-8bit", "sgd", "adafactor", "none")
    assert check_optimizer("sgd") == "sgd"
    with pytest.raises(ValueError, match="choose one of: adamw"):
        check_optimizer("lion")
    assert dtype_bytes(torch.bfloat16) == 2 and dtype_bytes(torch.float64) == 8


def test_adamw_8bit_small_tensors_keep_fp32_states():
    assert optimizer_state_bytes([(100,)], torch.float32, "adamw-8bit") == 800
    assert optimizer_state_bytes([(4096,)], torch.float32, "adamw-8bit") == 2 * (4096 + 4 * 16)
