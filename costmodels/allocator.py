"""Model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp).

Requests are rounded up to 512 B; requests <= 1 MiB use the small pool (2 MiB segments), larger
ones the large pool (20 MiB segments below 10 MiB, else rounded up to 2 MiB). A request takes the
smallest free block of its pool that fits (best fit), which is split when the remainder is
>= 512 B (small pool) or > 1 MiB (large pool); freed blocks coalesce with free neighbours in the
same segment. Segments are never released (no empty_cache within a step). Not modelled: streams,
max_split_size_mb, roundup_power2_divisions, garbage collection and OOM retries.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

kMinBlockSize = 512
kSmallSize = 1 << 20
kSmallBuffer = 2 << 20
kLargeBuffer = 20 << 20
kMinLargeAlloc = 10 << 20
kRoundLarge = 2 << 20


def round_size(nbytes: int) -> int:
    """CUDACachingAllocator round_size: at least 512, rounded up to a multiple of 512 (0 -> 512)."""
    if nbytes < 0:
        raise ValueError(f"invalid size {nbytes}; expected bytes >= 0")
    if nbytes < kMinBlockSize:
        return kMinBlockSize
    return kMinBlockSize * -(-nbytes // kMinBlockSize)


def segment_size(nbytes: int) -> int:
    """CUDACachingAllocator get_allocation_size: size of the new segment (cudaMalloc) for a request."""
    if nbytes <= kSmallSize:
        return kSmallBuffer
    if nbytes < kMinLargeAlloc:
        return kLargeBuffer
    return kRoundLarge * -(-nbytes // kRoundLarge)


@dataclass(frozen=True)
class AllocatorEstimate:
    """Allocated/reserved bytes at the end of the events and their peaks."""

    allocated_bytes: int
    reserved_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    fragmentation_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Pool:
    """Free blocks of one pool: sorted (size, addr) list plus start/end maps for coalescing."""

    __slots__ = ("free", "by_start", "by_end")

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []
        self.by_start: dict[int, int] = {}
        self.by_end: dict[int, int] = {}

    def add(self, addr: int, size: int) -> None:
        insort(self.free, (size, addr))
        self.by_start[addr] = size
        self.by_end[addr + size] = addr

    def remove(self, addr: int, size: int) -> None:
        i = bisect_left(self.free, (size, addr))
        del self.free[i]
        del self.by_start[addr]
        del self.by_end[addr + size]

    def release(self, addr: int, size: int) -> None:
        """Return a block, merging with free neighbours (segments are separated by address gaps)."""
        nxt = self.by_start.get(addr + size)
        if nxt is not None:
            self.remove(addr + size, nxt)
            size += nxt
        prev = self.by_end.get(addr)
        if prev is not None:
            psize = self.by_start[prev]
            self.remove(prev, psize)
            addr, size = prev, size + psize
        self.add(addr, size)


def _simulate_expandable(events: Iterable[tuple[int, int]]) -> AllocatorEstimate:
    """expandable_segments:True maps pages on demand (2 MiB small pool, 20 MiB large pool) into one
    growing segment per pool, so reserved ~= peak rounded allocated bytes per pool rounded up to
    pages. Estimate: ignores holes left inside the mapped range."""
    live: dict[int, tuple[bool, int]] = {}
    alloc = {True: 0, False: 0}
    reserved = {True: 0, False: 0}
    page = {True: kSmallBuffer, False: kLargeBuffer}
    cur = peak = peak_res = 0
    for tid, nbytes in events:
        if nbytes > 0:
            rs, small = _check_alloc(tid, nbytes, live)
            live[tid] = (small, rs)
            alloc[small] += rs
            cur += rs
            need = page[small] * -(-alloc[small] // page[small])
            reserved[small] = max(reserved[small], need)
            peak = max(peak, cur)
            peak_res = max(peak_res, reserved[True] + reserved[False])
        else:
            _check_free(tid, nbytes, live)
            small, rs = live.pop(tid)
            alloc[small] -= rs
            cur -= rs
    res = reserved[True] + reserved[False]
    return AllocatorEstimate(cur, res, peak, peak_res, peak_res - peak)


def _check_alloc(tid: int, nbytes: int, live: dict) -> tuple[int, bool]:
    """(rounded size, small pool?) of a new allocation; ValueError if the id is already live."""
    if tid in live:
        raise ValueError(f"tensor id {tid!r} allocated twice; free it first (nbytes 0)")
    rs = round_size(nbytes)
    return rs, rs <= kSmallSize


def _check_free(tid: int, nbytes: int, live: dict) -> None:
    if nbytes < 0:
        raise ValueError(f"invalid event size {nbytes}; expected > 0 (alloc) or 0 (free)")
    if tid not in live:
        raise ValueError(f"free of unknown tensor id {tid!r}; expected a live allocation id")


def simulate_allocator(events: Iterable[tuple[int, int]], expandable_segments: bool = False) -> AllocatorEstimate:
    """Replay (tensor_id, nbytes) events, nbytes > 0 allocates and 0 frees that id."""
    if expandable_segments:
        return _simulate_expandable(events)
    pools = {True: _Pool(), False: _Pool()}
    live: dict[int, tuple[bool, int, int]] = {}
    next_base = 0
    allocated = reserved = peak_alloc = peak_res = 0
    for tid, nbytes in events:
        if nbytes > 0:
            rs, small = _check_alloc(tid, nbytes, live)
            pool = pools[small]
            i = bisect_left(pool.free, (rs, -1))
            if i < len(pool.free):
                size, addr = pool.free[i]
                pool.remove(addr, size)
            else:
                size, addr = segment_size(rs), next_base
                next_base += size + kRoundLarge  # gap: blocks never coalesce across segments
                reserved += size
                peak_res = max(peak_res, reserved)
            remaining = size - rs
            if (remaining >= kMinBlockSize) if small else (remaining > kSmallSize):
                pool.add(addr + rs, remaining)
                size = rs
            live[tid] = (small, addr, size)
            allocated += size
            peak_alloc = max(peak_alloc, allocated)
        else:
            _check_free(tid, nbytes, live)
            small, addr, size = live.pop(tid)
            pools[small].release(addr, size)
            allocated -= size
    return AllocatorEstimate(allocated, reserved, peak_alloc, peak_res, peak_res - peak_alloc)


def fragmentation_headroom(estimate: AllocatorEstimate) -> float:
    """Fraction of peak reserved memory not covered by peak allocated memory."""
    if estimate.peak_reserved_bytes == 0:
        return 0.0
    return estimate.fragmentation_bytes / estimate.peak_reserved_bytes
