"""What a CUDA allocator snapshot says: its report dataclasses, and advice on fragmentation and allocator settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "Allocation",
    "AllocatorSettings",
    "PoolSummary",
    "SnapshotReport",
    "TraceSummary",
    "allocator_advice",
]

# Advice thresholds (fractions of reserved memory / of free memory).
FRAGMENTATION_RATIO_HIGH = 0.5


FREE_SHARE_NOTABLE = 0.10


SPLIT_SHARE_HIGH = 0.10


@dataclass(frozen=True)
class Allocation:
    """One live (``active_allocated``) block, with its innermost frames."""

    size: int
    requested_size: int
    frames: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "requested_size": self.requested_size,
            "frames": list(self.frames),
        }


@dataclass(frozen=True)
class PoolSummary:
    """Segments of one allocator pool (``small`` < 1 MiB blocks, ``large`` otherwise)."""

    pool: str
    segments: int
    reserved_bytes: int
    allocated_bytes: int
    free_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "segments": self.segments,
            "reserved_bytes": self.reserved_bytes,
            "allocated_bytes": self.allocated_bytes,
            "free_bytes": self.free_bytes,
        }


@dataclass(frozen=True)
class AllocatorSettings:
    """Allocator configuration recorded in the snapshot (None when not recorded)."""

    alloc_conf: str | None
    expandable_segments: bool | None
    max_split_size_bytes: int | None
    garbage_collection_threshold: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "alloc_conf": self.alloc_conf,
            "expandable_segments": self.expandable_segments,
            "max_split_size_bytes": self.max_split_size_bytes,
            "garbage_collection_threshold": self.garbage_collection_threshold,
        }


@dataclass(frozen=True)
class TraceSummary:
    """Counts of allocator trace events (recorded with ``_record_memory_history``)."""

    num_entries: int
    counts: tuple[tuple[str, int], ...]
    has_oom: bool
    last_oom_requested_bytes: int | None
    last_oom_device_free_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_entries": self.num_entries,
            "counts": dict(self.counts),
            "has_oom": self.has_oom,
            "last_oom_requested_bytes": self.last_oom_requested_bytes,
            "last_oom_device_free_bytes": self.last_oom_device_free_bytes,
        }


@dataclass(frozen=True)
class SnapshotReport:
    """Figures derived from one snapshot.

    ``requested_bytes`` covers ``active_allocated`` blocks only, so
    ``allocated_bytes - requested_bytes`` is the allocator's rounding overhead.
    ``inactive_split_bytes`` is free memory inside segments that also hold live
    blocks: it cannot be returned to CUDA and only fits requests of its size.
    """

    format: str
    reserved_bytes: int
    allocated_bytes: int
    requested_bytes: int
    pending_free_bytes: int
    free_bytes: int
    largest_free_block_bytes: int
    inactive_split_bytes: int
    fragmentation_ratio: float
    num_segments: int
    num_blocks: int
    devices: tuple[int, ...]
    segments_by_pool: tuple[PoolSummary, ...]
    expandable_segments: bool
    allocator_settings: AllocatorSettings
    top_allocations: tuple[Allocation, ...]
    device_trace_summary: TraceSummary | None
    advice: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "reserved_bytes": self.reserved_bytes,
            "allocated_bytes": self.allocated_bytes,
            "requested_bytes": self.requested_bytes,
            "pending_free_bytes": self.pending_free_bytes,
            "free_bytes": self.free_bytes,
            "largest_free_block_bytes": self.largest_free_block_bytes,
            "inactive_split_bytes": self.inactive_split_bytes,
            "fragmentation_ratio": self.fragmentation_ratio,
            "num_segments": self.num_segments,
            "num_blocks": self.num_blocks,
            "devices": list(self.devices),
            "segments_by_pool": {p.pool: p.to_dict() for p in self.segments_by_pool},
            "expandable_segments": self.expandable_segments,
            "allocator_settings": self.allocator_settings.to_dict(),
            "top_allocations": [a.to_dict() for a in self.top_allocations],
            "device_trace_summary": (
                None if self.device_trace_summary is None else self.device_trace_summary.to_dict()
            ),
            "advice": list(self.advice),
        }


def _mib(n: int) -> str:
    return f"{n / 1024**2:.1f} MiB"


def allocator_advice(
    *,
    reserved: int,
    free: int,
    largest_free: int,
    split: int,
    ratio: float,
    expandable: bool,
    settings: AllocatorSettings,
    traces: TraceSummary | None,
) -> tuple[str, ...]:
    out: list[str] = []
    fragmented = reserved > 0 and free >= FREE_SHARE_NOTABLE * reserved and ratio >= FRAGMENTATION_RATIO_HIGH
    split_heavy = reserved > 0 and split >= SPLIT_SHARE_HIGH * reserved
    if fragmented and not expandable:
        out.append(
            f"free cached memory is fragmented ({_mib(free)} free, largest block "
            f"{_mib(largest_free)}, ratio {ratio:.2f}): set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so segments grow instead of splitting"
        )
    if split_heavy and not expandable:
        alt = (
            "lower max_split_size_mb"
            if settings.max_split_size_bytes is not None
            else "set max_split_size_mb:<MiB> to stop large blocks from being split"
        )
        out.append(
            f"{_mib(split)} is free but stuck inside partly used segments: use "
            f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or {alt}"
        )
    if expandable and (settings.max_split_size_bytes is not None or settings.garbage_collection_threshold):
        out.append(
            "expandable_segments:True is combined with max_split_size_mb or "
            "garbage_collection_threshold: they are rarely needed with expandable segments and "
            "before PyTorch 2.5 the combination could assert near OOM (pytorch#134338); drop them"
        )
    if settings.garbage_collection_threshold:
        out.append(
            "garbage_collection_threshold only acts when a memory fraction is set: call "
            "torch.cuda.set_per_process_memory_fraction(...) or drop the option"
        )
    if traces is not None and traces.has_oom and not expandable and (fragmented or split_heavy):
        out.append(
            "the trace records an OOM while cached memory was fragmented: "
            "expandable_segments:True is the first thing to try"
        )
    return tuple(out)
