"""Roofline op-time and transfer-time estimates.

op time = max(flops / (0.7 * peak FLOP/s), bytes / (0.8 * HBM bandwidth)) + launch overhead.
The 0.7 / 0.8 efficiencies are typical achieved fractions for large matmuls and streaming
kernels (cf. MLPerf/Megatron MFU reports); launch overhead is 5 us on CUDA, 2 us on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from costmodels.hardware import DeviceSpec

COMPUTE_EFFICIENCY = 0.7
BANDWIDTH_EFFICIENCY = 0.8
CUDA_LAUNCH_OVERHEAD_S = 5e-6
CPU_LAUNCH_OVERHEAD_S = 2e-6
TRANSFER_TARGETS = ("cpu", "disk")

_HALF_DTYPES = (torch.bfloat16, torch.float16)


def peak_flops_per_s(dtype: torch.dtype, device: DeviceSpec) -> float:
    """bf16 tensor-core rate for bf16/fp16, the fp32 rate otherwise."""
    return device.bf16_flops_per_s if dtype in _HALF_DTYPES else device.fp32_flops_per_s


def op_time_s(
    flops: int,
    bytes_accessed: int,
    dtype: torch.dtype,
    device: DeviceSpec,
    attention: bool = False,
    name: str = "",
    elements: int = 0,
    variant: str = "",
) -> float:
    """Roofline time of one op in seconds (see module docstring). A calibrated profile refines it by
    op `name` and `variant`: `attention` ops run at its attention rate, ops it measured run at their
    own FLOP/s, and an elementwise op takes at least its measured seconds per output element times
    `elements`."""
    if flops < 0 or bytes_accessed < 0 or elements < 0:
        raise ValueError("flops, bytes_accessed and elements must be >= 0")
    measured = device.measured_flops_per_s(name, variant)
    if measured is not None:
        compute = flops / measured
    else:
        rate = (
            device.attention_flops_per_s
            if attention and device.attention_flops_per_s > 0
            else peak_flops_per_s(dtype, device)
        )
        compute = flops / (COMPUTE_EFFICIENCY * rate)
    memory = bytes_accessed / (BANDWIDTH_EFFICIENCY * device.hbm_bytes_per_s)
    elementwise = elements * device.seconds_per_element(name, variant)
    overhead = CUDA_LAUNCH_OVERHEAD_S if device.is_cuda else CPU_LAUNCH_OVERHEAD_S
    return max(compute, memory, elementwise) + overhead


@dataclass(frozen=True)
class CheckpointHost:
    """Host seconds activation checkpointing adds to a step: a selective policy per op and pass, a
    plain checkpoint per op it replays (beyond the op's own time)."""

    selective_op_s: float = 0.0
    replay_op_s: float = 0.0


def checkpoint_host_s(device: DeviceSpec) -> CheckpointHost:
    """What checkpointing's Python adds on `device`: in line with the ops on a CPU; nothing on CUDA,
    where the host runs ahead of the kernels and it is hidden."""
    if device.is_cuda:
        return CheckpointHost()
    return CheckpointHost(device.selective_op_overhead_s, device.replay_op_overhead_s)


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


COLLECTIVE_EFFICIENCY = 0.8  # achieved fraction of the link's bus bandwidth (NCCL all-gather/reduce-scatter)


def collective_link_bytes_per_s(world_size: int, device: DeviceSpec, stride: int = 1) -> float:
    """Per-GPU bandwidth a ring collective over `world_size` GPUs `stride` ranks apart sees (a data
    parallel group over tensor-parallel ranks is strided by tp): the in-node interconnect while the
    group spans one node, else the slower of it and the network (the ring crosses nodes)."""
    if world_size * stride <= device.gpus_per_node:
        return device.interconnect_bytes_per_s
    return min(device.interconnect_bytes_per_s, device.network_bytes_per_s)


def collective_time_s(unsharded_bytes: int, world_size: int, device: DeviceSpec, stride: int = 1) -> float:
    """Seconds of a ring all-gather or reduce-scatter of a tensor of `unsharded_bytes` over
    `world_size` ranks `stride` apart: each rank sends and receives (n - 1) / n of it (Patarasuk &
    Yuan's ring bound, as in NCCL's bus-bandwidth convention). Latency terms are left out: they
    matter only for small messages."""
    if unsharded_bytes < 0 or world_size < 1:
        raise ValueError("unsharded_bytes must be >= 0 and world_size >= 1")
    if world_size == 1:
        return 0.0
    moved = unsharded_bytes * (world_size - 1) / world_size
    return moved / (COLLECTIVE_EFFICIENCY * collective_link_bytes_per_s(world_size, device, stride))
