"""Roofline op-time and transfer-time estimates.

op time = max(flops / (0.7 * peak FLOP/s), bytes / (0.8 * HBM bandwidth)) + launch overhead.
The 0.7 / 0.8 efficiencies are typical achieved fractions for large matmuls and streaming
kernels (cf. MLPerf/Megatron MFU reports); launch overhead is 5 us on CUDA, 2 us on CPU.
"""

from __future__ import annotations

import torch

from costmodels.hardware import DeviceSpec

COMPUTE_EFFICIENCY = 0.7
BANDWIDTH_EFFICIENCY = 0.8
CUDA_LAUNCH_OVERHEAD_S = 5e-6
CPU_LAUNCH_OVERHEAD_S = 2e-6
TRANSFER_TARGETS = ("cpu", "disk")

_HALF_DTYPES = (torch.bfloat16, torch.float16)


def peak_flops(dtype: torch.dtype, device: DeviceSpec) -> float:
    """bf16 tensor-core rate for bf16/fp16, the fp32 rate otherwise."""
    return device.bf16_flops if dtype in _HALF_DTYPES else device.fp32_flops


def op_time_s(flops: int, bytes_accessed: int, dtype: torch.dtype, device: DeviceSpec) -> float:
    """Roofline time of one op in seconds (see module docstring)."""
    if flops < 0 or bytes_accessed < 0:
        raise ValueError("flops and bytes_accessed must be >= 0")
    compute = flops / (COMPUTE_EFFICIENCY * peak_flops(dtype, device))
    memory = bytes_accessed / (BANDWIDTH_EFFICIENCY * device.hbm_bytes_per_s)
    overhead = CUDA_LAUNCH_OVERHEAD_S if device.is_cuda else CPU_LAUNCH_OVERHEAD_S
    return max(compute, memory) + overhead


def transfer_time_s(nbytes: int, device: DeviceSpec, target: str) -> float:
    """Seconds to move nbytes device->target: host link for 'cpu', min(host link, disk) for 'disk'."""
    if nbytes < 0:
        raise ValueError("nbytes must be >= 0")
    if target == "cpu":
        bandwidth = device.host_link_bytes_per_s
    elif target == "disk":
        bandwidth = min(device.host_link_bytes_per_s, device.disk_bytes_per_s)
    else:
        raise ValueError(f"unknown transfer target {target!r}; choose one of: {', '.join(TRANSFER_TARGETS)}")
    return nbytes / bandwidth
