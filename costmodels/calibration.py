"""Measure this machine's op throughput and transfer rates, and turn them into a :class:`DeviceSpec`.

Each figure is the best of a few timed repeats after a warm-up (the fastest run is the least
disturbed by other processes): matmul FLOP/s (fp32 and bf16), fused attention FLOP/s (the compute
dtype's matmul rate is used where the device has no fused kernel), pointwise bandwidth (an
out-of-place add reads two operands and writes one), host link (device -> pinned host on CUDA,
memcpy on CPU), and disk write (fsync'ed) and read (after dropping the file from the page cache).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

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
    repeats: int = 3


FULL = CalibrationSizes()
QUICK = CalibrationSizes(
    matmul_n=128,
    attention_seq=64,
    attention_heads=2,
    pointwise_elems=2**16,
    transfer_bytes=2**18,
    disk_bytes=2**20,
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
    wall_s: float
    device: DeviceSpec

    def measured(self) -> dict[str, float]:
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
    )
    return Calibration(fp32, bf16, attention, pointwise, host, write, read, time.perf_counter() - t0, spec)
