"""Accelerator specs used by the runtime and memory cost models.

Sources: vendor datasheets (NVIDIA A100/H100/H200/L40S, AMD MI300X). FLOP/s are dense
(no 2:4 sparsity); ``fp32_flops_per_s`` is the non-tensor-core (vector) fp32 rate.
``memory_bytes`` is the capacity a process can see (what ``torch.cuda.get_device_properties``
reports, slightly below the marketing size where ECC/driver reservations apply).
Host link is effective one-direction PCIe throughput (gen4 x16 ~25 GB/s, gen5 x16 ~50 GB/s).

Collective links are per GPU, one direction, as NCCL's bus bandwidth sees them:
``interconnect_bytes_per_s`` inside a node of ``gpus_per_node`` GPUs (NVLink: A100 NVLink3 600 GB/s
and H100/H200 NVLink4 900 GB/s bidirectional per GPU, so 300 and 450 GB/s; MI300X Infinity Fabric
7 x 64 GB/s = 448 GB/s; L40S has no NVLink and goes through PCIe gen4), ``network_bytes_per_s``
between nodes (one InfiniBand NIC per GPU: HDR 200 Gb/s = 25 GB/s on DGX A100, NDR 400 Gb/s =
50 GB/s on DGX H100/H200 and MI300X platforms; 100 Gb/s Ethernet = 12.5 GB/s for L40S servers).
The cpu entry stands for gloo over shared memory on one host.

A *device profile* (``memplan calibrate``) is a JSON file with a measured :class:`DeviceSpec`:
``{"format": "memplan-device-profile/1", "device": {DeviceSpec fields}, "measured": {...}}``.
Its rates are stored as peaks, i.e. the measured achieved rate divided by the runtime model's
efficiency, so that the roofline predicts the measured rate back. Wherever a device name is
accepted, a path to such a file is too (:func:`get_device`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

GiB = 1024**3


def _host_memory_bytes() -> int:
    """This machine's physical RAM (what `--gpu cpu` can hold); 64 GiB where the OS does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return 64 * GiB


MiB = 1024**2


@dataclass(frozen=True)
class DeviceSpec:
    """Peak rates and capacity of one device."""

    name: str
    memory_bytes: int
    bf16_flops_per_s: float
    fp32_flops_per_s: float
    hbm_bytes_per_s: float
    host_link_bytes_per_s: float
    disk_bytes_per_s: float
    is_cuda: bool
    interconnect_bytes_per_s: float = 10e9
    network_bytes_per_s: float = 12.5e9
    gpus_per_node: int = 8
    attention_flops_per_s: float = 0.0  # fused attention's peak rate in the compute dtype; 0: the matmul rate
    # Host seconds activation checkpointing adds: a selective policy's dispatch mode per op it sees
    # and pass (forward and recompute), and a plain checkpoint per op it replays, beyond running the
    # op (saved-tensor hooks, the replay's bookkeeping). Measured by `memplan calibrate`; 0 in the
    # presets, and not counted on CUDA, where the host queues kernels ahead of the device
    # (costmodels.runtime.checkpoint_host_s).
    selective_op_overhead_s: float = 0.0
    replay_op_overhead_s: float = 0.0
    # Measured rates of single ops that do not run at the matmul rate or the memory bandwidth (CPU
    # convolutions, transcendental activations, norms), by aten overload name as the trace writes it
    # ("aten.gelu.default"): FLOP/s of compute-bound ops and seconds per output element of
    # elementwise ones. Measured by `memplan calibrate`; empty in the presets.
    op_flops_per_s: tuple[tuple[str, float], ...] = ()
    op_s_per_element: tuple[tuple[str, float], ...] = ()
    # What picks the attention kernel (costmodels.attention): the GPU architecture ("sm90" for
    # compute capability 9.0, "gfx942" on ROCm; "" on a CPU, and on a CUDA device taken as sm80)
    # and the cuDNN runtime version torch reports (torch.backends.cudnn.version(), e.g. 91002;
    # 0 where unknown: then cuDNN attention is never preferred).
    arch: str = ""
    cudnn_version: int = 0

    def __post_init__(self) -> None:
        for name in ("op_flops_per_s", "op_s_per_element"):  # a profile's JSON object or pairs
            value = getattr(self, name)
            pairs = value.items() if isinstance(value, dict) else value
            object.__setattr__(self, name, tuple(sorted((str(k), float(v)) for k, v in pairs)))

    @cached_property
    def _flops_rates(self) -> dict[str, float]:
        return dict(self.op_flops_per_s)

    @cached_property
    def _element_times(self) -> dict[str, float]:
        return dict(self.op_s_per_element)

    def measured_flops_per_s(self, name: str, variant: str = "") -> float | None:
        """The measured FLOP/s of op `name` ("name[variant]" first, e.g. its approximate=tanh
        kernel), None where it was not measured."""
        return self._flops_rates.get(f"{name}[{variant}]", self._flops_rates.get(name))

    def seconds_per_element(self, name: str, variant: str = "") -> float:
        """The measured seconds per output element of op `name` (as measured_flops_per_s looks it
        up); 0 where it was not measured."""
        return self._element_times.get(f"{name}[{variant}]", self._element_times.get(name, 0.0))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["op_flops_per_s"] = dict(self.op_flops_per_s)
        out["op_s_per_element"] = dict(self.op_s_per_element)
        return out


DEVICES: dict[str, DeviceSpec] = {
    # This machine's RAM; a modest server CPU: ~2 TFLOP/s bf16 (AMX/AVX-512), DDR5 ~50 GB/s;
    # host link = memory bandwidth.
    "cpu": DeviceSpec("cpu", _host_memory_bytes(), 2e12, 1e12, 50e9, 50e9, 2e9, False, 10e9, 12.5e9, 1),
    # A100 SXM4 40GB: 312 TFLOP/s bf16, 19.5 TFLOP/s fp32, 1555 GB/s HBM2, PCIe gen4.
    "a100-40gb": DeviceSpec(
        "a100-40gb", 40 * GiB, 312e12, 19.5e12, 1.555e12, 25e9, 3e9, True, 300e9, 25e9, arch="sm80"
    ),
    # A100 SXM4 80GB: 80 GiB HBM2e, 2039 GB/s.
    "a100-80gb": DeviceSpec(
        "a100-80gb", 80 * GiB, 312e12, 19.5e12, 2.039e12, 25e9, 3e9, True, 300e9, 25e9, arch="sm80"
    ),
    # H100 SXM5 80GB: torch reports ~79.2 GiB; 989.4 TFLOP/s bf16 dense, 66.9 fp32, 3.35 TB/s, PCIe gen5.
    "h100-80gb": DeviceSpec(
        "h100-80gb", 85_031_714_816, 989.4e12, 66.9e12, 3.35e12, 50e9, 3e9, True, 450e9, 50e9, arch="sm90"
    ),
    # H200 SXM 141GB HBM3e: ~139.8 GiB usable, same compute as H100, 4.8 TB/s.
    "h200": DeviceSpec("h200", 150_110_011_392, 989.4e12, 66.9e12, 4.8e12, 50e9, 3e9, True, 450e9, 50e9, arch="sm90"),
    # L40S 48GB GDDR6 (46068 MiB visible): 362 TFLOP/s bf16 dense, 91.6 fp32, 864 GB/s, PCIe gen4.
    "l40s": DeviceSpec("l40s", 46068 * MiB, 362e12, 91.6e12, 864e9, 25e9, 3e9, True, 25e9, 12.5e9, arch="sm89"),
    # MI300X 192GB HBM3: 1307.4 TFLOP/s bf16 dense, 163.4 fp32, 5.3 TB/s, PCIe gen5 (ROCm exposes torch.cuda).
    "mi300x": DeviceSpec("mi300x", 192 * GiB, 1307.4e12, 163.4e12, 5.3e12, 50e9, 3e9, True, 448e9, 50e9, arch="gfx942"),
}


PROFILE_FORMAT = "memplan-device-profile/1"


def is_profile_path(name: str) -> bool:
    """Whether a device name is a path to a device profile rather than a preset name."""
    return isinstance(name, str) and (name.endswith(".json") or "/" in name)


def profile_dict(device: DeviceSpec, measured: dict[str, float]) -> dict[str, Any]:
    """The JSON content of a device profile."""
    return {"format": PROFILE_FORMAT, "device": device.to_dict(), "measured": dict(measured)}


PROFILE_MAX_BYTES = 2**20
"""Largest device profile read (a profile is a few hundred bytes; /dev/zero must not hang)."""


def _bounded_number(text: str) -> float:
    value = float(text) if len(text) <= 40 else math.inf
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]!r} is out of range")
    return value


def _bounded_int(text: str) -> int:
    _bounded_number(text)
    return int(text)


def _read_profile_json(path: str) -> Any:
    with open(path, "rb") as f:
        raw = f.read(PROFILE_MAX_BYTES + 1)
    if len(raw) > PROFILE_MAX_BYTES:
        raise ValueError(f"larger than {PROFILE_MAX_BYTES} bytes")
    try:
        return json.loads(
            raw.decode("utf-8"), parse_int=_bounded_int, parse_float=_bounded_number, parse_constant=_bounded_number
        )
    except RecursionError:
        raise ValueError("nested too deep") from None


@lru_cache(maxsize=32)
def _load_profile(path: str, mtime_ns: int) -> DeviceSpec:
    try:
        data = _read_profile_json(path)
        if data.get("format") != PROFILE_FORMAT:
            raise KeyError("format")
        known = {f.name for f in fields(DeviceSpec)}
        spec = DeviceSpec(**{k: v for k, v in data["device"].items() if k in known})
    except (ValueError, OSError, KeyError, TypeError, AttributeError) as exc:  # bad JSON, bounds, layout
        raise ValueError(
            f"{path} is not a memplan device profile ({str(exc)[:200]}); write one with memplan calibrate --out FILE"
        ) from None
    if (
        min(
            spec.bf16_flops_per_s,
            spec.fp32_flops_per_s,
            spec.hbm_bytes_per_s,
            spec.host_link_bytes_per_s,
            spec.disk_bytes_per_s,
            spec.memory_bytes,
        )
        <= 0
    ):
        raise ValueError(f"device profile {path} has a non-positive rate or capacity; re-run memplan calibrate")
    per_op_s = [spec.selective_op_overhead_s, spec.replay_op_overhead_s, *(v for _, v in spec.op_s_per_element)]
    if any(not 0 <= v < 1 for v in per_op_s):
        raise ValueError(f"device profile {path} has a per-op time outside [0, 1) s; re-run memplan calibrate")
    if any(v <= 0 for _, v in spec.op_flops_per_s):
        raise ValueError(f"device profile {path} has a non-positive op rate; re-run memplan calibrate")
    return spec


def load_device_profile(path: str | Path) -> DeviceSpec:
    """The DeviceSpec of a device profile file (ValueError with what to do when it is not one)."""
    p = Path(path)
    try:
        mtime = p.stat().st_mtime_ns
    except OSError:
        raise ValueError(f"device profile {path} does not exist; write one with memplan calibrate --out FILE") from None
    return _load_profile(str(p.resolve()), mtime)


def get_device(name: str) -> DeviceSpec:
    """Look up a device by name, case-insensitively, or load a device profile from a JSON path."""
    if is_profile_path(name):
        return load_device_profile(name)
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in DEVICES:
        raise ValueError(f"unknown gpu {name!r}; choose one of: {', '.join(DEVICES)}, or a device profile .json")
    return DEVICES[key]
