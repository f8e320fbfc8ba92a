"""Measure this machine's op throughput and transfer rates, and turn them into a :class:`DeviceSpec`.

Every timed figure is a probe: one call, timed after a warm-up. The probes run round-robin for a few
rounds of a few repeats each, and each keeps its fastest call (the least disturbed by other
processes): a burst of other work then spoils one round of every probe rather than every sample of
one figure. The figures: matmul FLOP/s (fp32 and bf16), fused attention FLOP/s (on q, k, v as models
pass them, heads transposed out of (batch, seq, heads, dim); the compute dtype's matmul rate is used
where the device has no fused kernel), pointwise bandwidth (an out-of-place add reads two operands
and writes one), host link (device -> pinned host on CUDA, memcpy on CPU), and the host time of
activation checkpointing:
- per op and pass of a selective-checkpoint policy: a chain of attention-and-MLP layers with
  activations of a training step's size, forward and backward, under torch's selective checkpoint
  with a policy that numbers each op's calls as memplan's does and saves every output, so nothing is
  recomputed; against the same chain plain;
- per op a plain checkpoint replays, beyond running it: the chain at a size where its ops cost only
  their dispatch, checkpointed, against the chain plain plus one forward without autograd.
Disk write (fsync'ed) and read (after dropping the file from the page cache) are timed once.

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
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from costmodels.flops import op_flops
from costmodels.hardware import DeviceSpec, get_device
from costmodels.runtime import BANDWIDTH_EFFICIENCY, COMPUTE_EFFICIENCY
from memplan_compat import TorchDispatchMode

__all__ = ["CalibrationSizes", "QUICK", "FULL", "Calibration", "calibrate"]


@dataclass(frozen=True)
class CalibrationSizes:
    """Problem sizes and repeats of the measurements (FULL keeps the whole run under about 20 s)."""

    matmul_n: int = 1024
    attention_seq: int = 512
    attention_heads: int = 8
    pointwise_elems: int = 16 * 2**20
    transfer_bytes: int = 64 * 2**20
    disk_bytes: int = 128 * 2**20
    elementwise_elems: int = 2**21
    conv_shape: tuple[int, int, int] = (16, 64, 32)  # batch, channels in and out, image side
    chain_shape: tuple[int, int, int] = (4, 512, 256)  # batch, sequence, width of the selective probe
    repeats: int = 3  # timed calls per probe and round
    rounds: int = 5  # round-robin passes over the probes


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
    chain_shape=(2, 8, 32),
    repeats=2,
    rounds=1,
)
_DISPATCH_CHAIN = (2, 8, 32)  # small enough that the chain's ops cost only their dispatch


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
    replay_op_overhead_s: float
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


@dataclass(frozen=True)
class _Probe:
    """One timed call and the work it does (FLOPs, bytes or elements): its figure is work / seconds."""

    call: Callable[[], object]
    work: float = 1.0


def _best_times_s(probes: dict[str, _Probe], rounds: int, repeats: int, sync: Callable[[], None]) -> dict[str, float]:
    """Each probe's fastest call over `rounds` round-robin passes of `repeats` calls (after one warm-up call each)."""
    for p in probes.values():
        p.call()
    sync()
    best = dict.fromkeys(probes, float("inf"))
    for _ in range(rounds):
        for key, p in probes.items():
            for _ in range(repeats):
                t0 = time.perf_counter()
                p.call()
                sync()
                best[key] = min(best[key], time.perf_counter() - t0)
    return {k: max(v, 1e-9) for k, v in best.items()}


def _matmul(n: int, dtype: torch.dtype, device: torch.device) -> _Probe:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return _Probe(lambda: torch.mm(a, b), 2 * n**3)


def _attention(sizes: CalibrationSizes, dtype: torch.dtype, device: torch.device) -> _Probe:
    b, h, s, d = 2, sizes.attention_heads, sizes.attention_seq, 64
    q, k, v = (torch.randn(b, s, h, d, device=device).to(dtype).transpose(1, 2) for _ in range(3))
    flops = 4 * b * h * s * s * d  # QK^T and PV, counted without the causal mask as costmodels.flops does
    return _Probe(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), flops)


def _pointwise(n: int, device: torch.device) -> _Probe:
    a, b, out = (torch.empty(n, device=device).fill_(1.0) for _ in range(3))
    return _Probe(lambda: torch.add(a, b, out=out), 3 * 4 * n)


def _host_link(nbytes: int, device: torch.device) -> _Probe:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    return _Probe(lambda: dst.copy_(src, non_blocking=device.type == "cuda"), nbytes)


def _chain(x: torch.Tensor, weights: list[torch.Tensor], heads: int) -> torch.Tensor:
    """Two attention-and-MLP layers: the op mix (views, matmuls, attention, pointwise, reductions)
    of the blocks memplan checkpoints."""
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


class _ChainRuns:
    """The chain at one shape, run plain, checkpointed (plainly or selectively) and forward only."""

    def __init__(self, shape: tuple[int, int, int], device: torch.device) -> None:
        batch, seq, width = shape
        g = torch.Generator(device="cpu").manual_seed(0)
        self.weights = [torch.randn(width, width, generator=g).to(device).requires_grad_() for _ in range(6)]
        self.x = torch.randn(batch, seq, width, generator=g).to(device).requires_grad_()
        with _CountOps() as counter:
            self._forward()
        self.ops = counter.ops

    def _forward(self) -> torch.Tensor:
        return _chain(self.x, self.weights, 4)

    def plain(self) -> None:
        self._forward().sum().backward()

    def forward_only(self) -> None:
        with torch.no_grad():
            self._forward()

    def checkpointed(self) -> None:
        checkpoint(self._forward, use_reentrant=False).sum().backward()

    def selective(self) -> None:
        context = lambda: create_selective_checkpoint_contexts(_NumberingPolicy())  # noqa: E731
        checkpoint(self._forward, use_reentrant=False, context_fn=context).sum().backward()


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


def _elementwise(n: int, device: torch.device) -> dict[str, _Probe]:
    """Op name -> its probe; the figure is output elements per second."""
    out = {}
    for name, call in _elementwise_calls(n, device).items():
        result = call()
        first = result[0] if isinstance(result, tuple) else result
        out[name] = _Probe(call, first.numel())
    return out


def _convolutions(shape: tuple[int, int, int], device: torch.device) -> dict[str, _Probe]:
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
        out[str(op)] = _Probe(lambda op=op, args=args: op(*args), op_flops(op, args, {}, op(*args)))
    return out


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


def _arch(dev: torch.device) -> str:
    """The architecture the attention rule reads: "sm90", a ROCm "gfx942", "" on a CPU."""
    if dev.type != "cuda":
        return ""
    props = torch.cuda.get_device_properties(dev)
    if torch.version.hip:
        return str(props.gcnArchName).split(":")[0]
    return f"sm{props.major}{props.minor}"


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
    # CPUs without bf16 matrix units run bf16 matmuls ~100x slower than fp32: a quarter of the size
    bf16_n = sizes.matmul_n if dev.type == "cuda" else max(64, sizes.matmul_n // 4)
    compute_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    selective, dispatch = _ChainRuns(sizes.chain_shape, dev), _ChainRuns(_DISPATCH_CHAIN, dev)
    elementwise, convolutions = _elementwise(sizes.elementwise_elems, dev), _convolutions(sizes.conv_shape, dev)
    probes = {
        "fp32": _matmul(sizes.matmul_n, torch.float32, dev),
        "bf16": _matmul(bf16_n, torch.bfloat16, dev),
        "attention": _attention(sizes, compute_dtype, dev),
        "pointwise": _pointwise(sizes.pointwise_elems, dev),
        "host": _host_link(sizes.transfer_bytes, dev),
        "selective plain": _Probe(selective.plain),
        "selective": _Probe(selective.selective),
        "dispatch plain": _Probe(dispatch.plain),
        "dispatch forward": _Probe(dispatch.forward_only),
        "dispatch checkpointed": _Probe(dispatch.checkpointed),
        **elementwise,
        **convolutions,
    }
    best_s = _best_times_s(probes, sizes.rounds, sizes.repeats, sync)
    rate = {k: p.work / best_s[k] for k, p in probes.items()}
    # every op passes a selective policy twice (forward and recompute); nothing is recomputed
    selective_op_s = max(0.0, (best_s["selective"] - best_s["selective plain"]) / (2 * selective.ops))
    replayed_s = best_s["dispatch checkpointed"] - best_s["dispatch plain"] - best_s["dispatch forward"]
    replay_op_s = max(0.0, replayed_s / dispatch.ops)
    write, read = _disk_bytes_per_s(sizes.disk_bytes, disk_folder)
    per_element = {k: 1 / rate[k] for k in elementwise}
    conv = {k: rate[k] for k in convolutions}
    base = get_device("cpu")
    if dev.type == "cuda":
        memory = torch.cuda.get_device_properties(dev).total_memory
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    spec = DeviceSpec(
        name=name or (torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu-calibrated"),
        memory_bytes=int(memory),
        bf16_flops_per_s=rate["bf16"] / COMPUTE_EFFICIENCY,
        fp32_flops_per_s=rate["fp32"] / COMPUTE_EFFICIENCY,
        hbm_bytes_per_s=rate["pointwise"] / BANDWIDTH_EFFICIENCY,
        host_link_bytes_per_s=rate["host"],
        disk_bytes_per_s=min(write, read),
        is_cuda=dev.type == "cuda",
        interconnect_bytes_per_s=base.interconnect_bytes_per_s,
        network_bytes_per_s=base.network_bytes_per_s,
        gpus_per_node=1 if dev.type != "cuda" else torch.cuda.device_count(),
        attention_flops_per_s=rate["attention"] / COMPUTE_EFFICIENCY,
        selective_op_overhead_s=selective_op_s,
        replay_op_overhead_s=replay_op_s,
        op_flops_per_s=conv,
        op_s_per_element=per_element,
        arch=_arch(dev),
        cudnn_version=int(torch.backends.cudnn.version() or 0) if dev.type == "cuda" else 0,
    )
    return Calibration(
        rate["fp32"],
        rate["bf16"],
        rate["attention"],
        rate["pointwise"],
        rate["host"],
        write,
        read,
        selective_op_s,
        replay_op_s,
        conv,
        per_element,
        time.perf_counter() - t0,
        spec,
    )
