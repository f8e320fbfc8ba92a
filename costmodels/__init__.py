"""Cost models for memplan: hardware specs, FLOPs, runtime, model-state memory, CUDA allocator.

This package is standalone: it imports nothing from ``planner``.
"""

from importlib import import_module

# Public names and the modules that define them, imported on first use (PEP 562): importing
# costmodels.hardware (the CLI's --help) does not import torch through costmodels.flops.
_EXPORTS = {
    **dict.fromkeys(
        (
            "AllocatorEstimate",
            "fragmentation_headroom",
            "kLargeBuffer",
            "kMinBlockSize",
            "kMinLargeAlloc",
            "kRoundLarge",
            "kSmallBuffer",
            "kSmallSize",
            "round_size",
            "segment_size",
            "simulate_allocator",
        ),
        "costmodels.allocator",
    ),
    **dict.fromkeys(("op_bytes_accessed", "op_flops"), "costmodels.flops"),
    **dict.fromkeys(("DEVICES", "DeviceSpec", "get_device"), "costmodels.hardware"),
    **dict.fromkeys(
        (
            "DTYPE_BYTES",
            "OPTIMIZERS",
            "PRECISIONS",
            "ModelStates",
            "Precision",
            "check_optimizer",
            "dtype_bytes",
            "get_precision",
            "model_state_bytes",
            "optimizer_state_bytes",
            "optimizer_step_temporary_bytes",
        ),
        "costmodels.memory",
    ),
    **dict.fromkeys(("collective_time_s", "op_time_s", "transfer_time_s"), "costmodels.runtime"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'costmodels' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
