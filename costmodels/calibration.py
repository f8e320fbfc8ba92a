"""Measure this machine's op throughput and transfer rates, and turn them into a :class:`DeviceSpec`.

Each figure is the best of a few timed repeats after a warm-up (the fastest run is the least
disturbed by other processes): matmul FLOP/s (fp32 and bf16), fused attention FLOP/s (the compute
dtype's matmul rate is used where the device has no fused kernel), pointwise bandwidth (an
out-of-place add reads two operands and writes one), host link (device -> pinned host on CUDA,
memcpy on CPU), disk write (fsync'ed) and read (after dropping the file from the page cache), and
the host time a selective-checkpoint policy adds per op and pass (a small attention-and-MLP chain,
forward and backward, under torch's selective checkpoint with a policy that numbers each op's calls
as memplan's does and saves every output, so nothing is recomputed; against the same chain plain).

Ops that run neither at the matmul rate nor at the pointwise bandwidth are measured one by one,
called as the aten overloads the trace records: convolution forward and backward (FLOP/s, FLOPs as
costmodels.flops counts them) and transcendental activations, softmax and norms (seconds per output
element). On a GPU they mostly come out at the roofline; on a CPU GELU or BatchNorm can take several
times their bytes' worth.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from costmodels.flops import op_flops
from costmodels.hardware import DeviceSpec, get_device
from costmodels.runtime import BANDWIDTH_EFFICIENCY, COMPUTE_EFFICIENCY

__all__ = ["CalibrationSizes", "QUICK", "FULL", "Calibration", "calibrate"]


@dataclass(frozen=True)
class CalibrationSizes:
    """Problem sizes of the measurements (FULL keeps the whole run under about 20 s)."""

    matmul_n: int = 1024
    attention_seq: int = 512
    attention_heads: int = 8
    pointwise_elems: int = 16 * 2**20
    transfer_bytes: int = 64 * 2**20
    disk_bytes: int = 128 * 2**20
    elementwise_elems: int = 2**21
    conv_shape: tuple[int, int, int] = (16, 64, 32)  # batch, channels in and out, image side
    repeats: int = 3


FULL = CalibrationSizes()
QUICK = CalibrationSizes(
    matmul_n=128,
    attention_seq=64,
    attention_heads=2,
    pointwise_elems=2**16,
    transfer_bytes=2**18,
    disk_bytes=2**20,
    elementwise_elems=2**12,
    conv_shape=(2, 8, 8),
    repeats=2,
)


@dataclass(frozen=True)
class Calibration:
    """Measured achieved rates (per second) and the device spec derived from them."""

    fp32_matmul_flops_per_s: float
    bf16_matmul_flops_per_s: float
    attention_flops_per_s: float
    pointwise_bytes_per_s: float
    host_link_bytes_per_s: float
    disk_write_bytes_per_s: float
    disk_read_bytes_per_s: float
    selective_op_overhead_s: float
    op_flops_per_s: dict[str, float]
    op_s_per_element: dict[str, float]
    wall_s: float
    device: DeviceSpec

    def measured(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("device")
        return out

    def to_dict(self) -> dict:
        return {**self.measured(), "device": self.device.to_dict()}


def _best_s(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _matmul_flops(n: int, dtype: torch.dtype, device: torch.device, repeats: int, sync) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _best_s(lambda: torch.mm(a, b), repeats, sync)


def _attention_flops(sizes: CalibrationSizes, dtype: torch.dtype, device: torch.device, sync) -> float:
    b, h, s, d = 2, sizes.attention_heads, sizes.attention_seq, 64
    q, k, v = (torch.randn(b, h, s, d, device=device).to(dtype) for _ in range(3))
    flops = 4 * b * h * s * s * d  # QK^T and PV, counted without the causal mask as costmodels.flops does
    return flops / _best_s(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), sizes.repeats, sync)


def _pointwise_bytes_per_s(n: int, device: torch.device, repeats: int, sync) -> float:
    a, b, out = (torch.empty(n, device=device).fill_(1.0) for _ in range(3))
    return 3 * 4 * n / _best_s(lambda: torch.add(a, b, out=out), repeats, sync)


def _chain(x: torch.Tensor, weights: list[torch.Tensor], heads: int) -> torch.Tensor:
    """Two attention-and-MLP layers: the op mix (views, matmuls, attention, pointwise, reductions)
    of the blocks memplan checkpoints, at a size where the ops cost little beside their dispatch."""
    b, s, d = x.shape
    for _ in range(2):
        q, k, v = (F.linear(x, w).view(b, s, heads, d // heads).transpose(1, 2) for w in weights[:3])
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + F.linear(a, weights[3])
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        x = x + F.linear(F.silu(F.linear(x, weights[4])) * x, weights[5])
    return x


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _NumberingPolicy:
    """Saves every output, numbering each op's calls per pass as memplan's keep policy does."""

    def __init__(self) -> None:
        self.calls: dict[tuple[bool, str], int] = {}

    def __call__(self, ctx, func, *args, **kwargs) -> CheckpointPolicy:
        key = (bool(ctx.is_recompute), str(func))
        self.calls[key] = self.calls.get(key, 0) + 1
        return CheckpointPolicy.MUST_SAVE


def _selective_op_overhead_s(repeats: int, device: torch.device, sync) -> float:
    g = torch.Generator(device="cpu").manual_seed(0)
    weights = [torch.randn(32, 32, generator=g).to(device).requires_grad_() for _ in range(6)]
    x = torch.randn(2, 8, 32, generator=g).to(device).requires_grad_()
    with _CountOps() as counter:
        _chain(x, weights, 4)

    def plain() -> None:
        _chain(x, weights, 4).sum().backward()

    def selective() -> None:
        context = lambda: create_selective_checkpoint_contexts(_NumberingPolicy())  # noqa: E731
        checkpoint(_chain, x, weights, 4, use_reentrant=False, context_fn=context).sum().backward()

    reps = max(5, 3 * repeats)
    added = _best_s(selective, reps, sync) - _best_s(plain, reps, sync)
    return max(0.0, added / (2 * counter.ops))  # each op passes the policy twice: forward and recompute


_ELEMENTWISE_WIDTH = 1024  # last dimension of the elementwise probes (softmax and LayerNorm rows)


def _elementwise_calls(n: int, device: torch.device) -> dict[str, Callable[[], object]]:
    """Op name -> a call of it on about `n` elements (rows of 1024; NCHW with 64 channels for BatchNorm)."""
    aten = torch.ops.aten
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = max(1, n // _ELEMENTWISE_WIDTH)
    x, dy = (torch.randn(rows, _ELEMENTWISE_WIDTH, generator=g).to(device) for _ in range(2))
    w, b = torch.ones(_ELEMENTWISE_WIDTH, device=device), torch.zeros(_ELEMENTWISE_WIDTH, device=device)
    y = aten._softmax.default(x, -1, False)
    _, mean, rstd = aten.native_layer_norm.default(x, [_ELEMENTWISE_WIDTH], w, b, 1e-5)
    side = max(1, int((n // 64) ** 0.5) // 2)
    images, dimages = (torch.randn(4, 64, side, side, generator=g).to(device) for _ in range(2))
    cw, cb = torch.ones(64, device=device), torch.zeros(64, device=device)
    rm, rv = torch.zeros(64, device=device), torch.ones(64, device=device)
    _, bn_mean, bn_invstd = aten.native_batch_norm.default(images, cw, cb, rm.clone(), rv.clone(), True, 0.1, 1e-5)
    return {
        "aten.gelu.default": lambda: aten.gelu.default(x),
        "aten.gelu_backward.default": lambda: aten.gelu_backward.default(dy, x),
        "aten.gelu.default[approximate=tanh]": lambda: aten.gelu.default(x, approximate="tanh"),
        "aten.gelu_backward.default[approximate=tanh]": lambda: aten.gelu_backward.default(dy, x, approximate="tanh"),
        "aten.silu.default": lambda: aten.silu.default(x),
        "aten.silu_backward.default": lambda: aten.silu_backward.default(dy, x),
        "aten.sigmoid.default": lambda: aten.sigmoid.default(x),
        "aten.tanh.default": lambda: aten.tanh.default(x),
        "aten.exp.default": lambda: aten.exp.default(x),
        "aten._softmax.default": lambda: aten._softmax.default(x, -1, False),
        "aten._softmax_backward_data.default": lambda: aten._softmax_backward_data.default(dy, y, -1, x.dtype),
        "aten.native_layer_norm.default": lambda: aten.native_layer_norm.default(x, [_ELEMENTWISE_WIDTH], w, b, 1e-5),
        "aten.native_layer_norm_backward.default": lambda: aten.native_layer_norm_backward.default(
            dy, x, [_ELEMENTWISE_WIDTH], mean, rstd, w, b, [True, True, True]
        ),
        "aten.native_batch_norm.default": lambda: aten.native_batch_norm.default(
            images, cw, cb, rm, rv, True, 0.1, 1e-5
        ),
        "aten.native_batch_norm_backward.default": lambda: aten.native_batch_norm_backward.default(
            dimages, images, cw, rm, rv, bn_mean, bn_invstd, True, 1e-5, [True, True, True]
        ),
    }


def _elementwise_s_per_element(n: int, device: torch.device, repeats: int, sync) -> dict[str, float]:
    out = {}
    for name, call in _elementwise_calls(n, device).items():
        result = call()
        first = result[0] if isinstance(result, tuple) else result
        out[name] = _best_s(call, repeats, sync) / first.numel()
    return out


def _conv_flops_per_s(shape: tuple[int, int, int], device: torch.device, repeats: int, sync) -> dict[str, float]:
    aten = torch.ops.aten
    batch, channels, side = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch, channels, side, side, generator=g).to(device)
    w = torch.randn(channels, channels, 3, 3, generator=g).to(device)
    geometry = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    forward_args = (x, w, None, *geometry)
    y = aten.convolution.default(*forward_args)
    backward_args = (torch.randn_like(y), x, w, [0], *geometry, [True, True, False])
    out = {}
    for op, args in ((aten.convolution.default, forward_args), (aten.convolution_backward.default, backward_args)):
        flops = op_flops(op, args, {}, op(*args))
        out[str(op)] = flops / _best_s(lambda op=op, args=args: op(*args), repeats, sync)
    return out


def _host_link_bytes_per_s(nbytes: int, device: torch.device, repeats: int, sync) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    return nbytes / _best_s(lambda: dst.copy_(src, non_blocking=device.type == "cuda"), repeats, sync)


def _disk_bytes_per_s(nbytes: int, folder: str | None) -> tuple[float, float]:
    data = os.urandom(min(nbytes, 2**20)) * max(1, nbytes // 2**20)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        path = os.path.join(tmp, "calibrate.bin")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        write_s = time.perf_counter() - t0
        with open(path, "rb") as f:
            if hasattr(os, "posix_fadvise"):  # read from the disk, not the page cache
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            while f.read(2**24):
                pass
            read_s = time.perf_counter() - t0
    return len(data) / max(write_s, 1e-9), len(data) / max(read_s, 1e-9)


def calibrate(
    sizes: CalibrationSizes = FULL, device: str | None = None, disk_folder: str | None = None, name: str | None = None
) -> Calibration:
    """Measure this machine (`device`: "cuda" or "cpu"; default cuda when available) and derive a
    DeviceSpec whose roofline reproduces the measured rates. Memory capacity and collective links
    are not measured: capacity is the GPU's total memory or the host's RAM, links come from the cpu
    preset."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    fp32 = _matmul_flops(sizes.matmul_n, torch.float32, dev, sizes.repeats, sync)
    # CPUs without bf16 matrix units run bf16 matmuls ~100x slower than fp32: a quarter of the size
    bf16 = _matmul_flops(
        sizes.matmul_n if dev.type == "cuda" else max(64, sizes.matmul_n // 4), torch.bfloat16, dev, sizes.repeats, sync
    )
    compute_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    attention = _attention_flops(sizes, compute_dtype, dev, sync)
    pointwise = _pointwise_bytes_per_s(sizes.pointwise_elems, dev, sizes.repeats, sync)
    host = _host_link_bytes_per_s(sizes.transfer_bytes, dev, sizes.repeats, sync)
    write, read = _disk_bytes_per_s(sizes.disk_bytes, disk_folder)
    dispatch = _selective_op_overhead_s(sizes.repeats, dev, sync)
    elementwise = _elementwise_s_per_element(sizes.elementwise_elems, dev, sizes.repeats, sync)
    conv = _conv_flops_per_s(sizes.conv_shape, dev, sizes.repeats, sync)
    base = get_device("cpu")
    if dev.type == "cuda":
        memory = torch.cuda.get_device_properties(dev).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    spec = DeviceSpec(
        name=name or (torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu-calibrated"),
        memory_bytes=int(memory),
        bf16_flops_per_s=bf16 / COMPUTE_EFFICIENCY,
        fp32_flops_per_s=fp32 / COMPUTE_EFFICIENCY,
        hbm_bytes_per_s=pointwise / BANDWIDTH_EFFICIENCY,
        host_link_bytes_per_s=host,
        disk_bytes_per_s=min(write, read),
        is_cuda=dev.type == "cuda",
        interconnect_bytes_per_s=base.interconnect_bytes_per_s,
        network_bytes_per_s=base.network_bytes_per_s,
        gpus_per_node=1 if dev.type != "cuda" else torch.cuda.device_count(),
        attention_flops_per_s=attention / COMPUTE_EFFICIENCY,
        selective_op_overhead_s=dispatch,
        op_flops_per_s=conv,
        op_s_per_element=elementwise,
    )
    return Calibration(
        fp32, bf16, attention, pointwise, host, write, read, dispatch, conv, elementwise, time.perf_counter() - t0, spec
    )
