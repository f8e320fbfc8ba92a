"""Cost models for memplan: hardware specs, FLOPs, runtime, model-state memory, CUDA allocator.

This package is standalone: it imports nothing from ``planner``.
"""

from costmodels.allocator import (
    AllocatorEstimate,
    fragmentation_headroom,
    kLargeBuffer,
    kMinBlockSize,
    kMinLargeAlloc,
    kRoundLarge,
    kSmallBuffer,
    kSmallSize,
    round_size,
    segment_size,
    simulate_allocator,
)
from costmodels.flops import op_bytes_accessed, op_flops
from costmodels.hardware import DEVICES, DeviceSpec, get_device
from costmodels.memory import (
    DTYPE_BYTES,
    OPTIMIZERS,
    PRECISIONS,
    ModelStates,
    Precision,
    check_optimizer,
    dtype_bytes,
    get_precision,
    model_state_bytes,
    optimizer_state_bytes,
    optimizer_step_temporary_bytes,
)
from costmodels.runtime import collective_time_s, op_time_s, transfer_time_s

__all__ = [
    "AllocatorEstimate",
    "DEVICES",
    "DTYPE_BYTES",
    "DeviceSpec",
    "collective_time_s",
    "ModelStates",
    "OPTIMIZERS",
    "PRECISIONS",
    "Precision",
    "check_optimizer",
    "dtype_bytes",
    "fragmentation_headroom",
    "get_device",
    "get_precision",
    "kLargeBuffer",
    "kMinBlockSize",
    "kMinLargeAlloc",
    "kRoundLarge",
    "kSmallBuffer",
    "kSmallSize",
    "model_state_bytes",
    "op_bytes_accessed",
    "op_flops",
    "op_time_s",
    "optimizer_state_bytes",
    "optimizer_step_temporary_bytes",
    "round_size",
    "segment_size",
    "simulate_allocator",
    "transfer_time_s",
]
