"""Safe reader and analyser for CUDA caching-allocator memory snapshots.

Reads the pickle written by ``torch.cuda.memory._dump_snapshot(path)`` without
executing anything: a whitelisting pure-Python unpickler refuses every global,
persistent id and object-building opcode, so only plain data (dict/list/tuple/
set/str/bytes/int/float/bool/None) can be loaded. It is about 5x slower than
``pickle.loads`` (roughly 2-3 s per 25 MB) in exchange for bounded memory on
hostile input.

Layout (``torch.cuda.memory._snapshot()``, torch >= 2.1)::

    {"segments": [Segment], "device_traces": [[TraceEntry]],
     "allocator_settings": {...}, ...}
    Segment = {"device", "address", "total_size", "allocated_size", "active_size",
               "requested_size", "stream", "segment_type": "small"|"large",
               "segment_pool_id", "is_expandable", "frames", "blocks": [Block]}
    Block = {"address", "size", "requested_size",
             "state": "active_allocated"|"active_pending_free"|"inactive",
             "frames": [{"filename", "line", "name"}]}
    TraceEntry = {"action", "addr" | "device_free", "size", "stream", "frames", ...}

Older snapshots are a bare list of segments whose blocks may lack
``requested_size`` and carry ``history: [{"addr", "real_size", "frames"}]``.
Unknown keys are ignored.
"""

from __future__ import annotations

import gc
import io
import pickle
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.analysis.snapshot_advice import (
    Allocation,
    AllocatorSettings,
    PoolSummary,
    SnapshotReport,
    TraceSummary,
    allocator_advice,
)
from planner.analysis.unpickler import PickleBudget, PlainDataUnpickler, RefusedPickle
from planner.safe_io import clean, read_bounded

__all__ = [
    "analyze_snapshot",
    "load_snapshot_bytes",
    "read_snapshot",
]

DEFAULT_MAX_BYTES = 1024**3
"""Refuse snapshot files larger than this unless the caller raises the limit (the reader also
keeps a memory, element and time budget proportional to the file size: see unpickler.py)."""
MAX_SIZE_BYTES = 2**63
"""Sizes, addresses and devices at or above this are refused (the allocator stores int64)."""

TOP_ALLOCATIONS = 10
MAX_FRAMES = 10


_HOW_TO_WRITE = "write one with torch.cuda.memory._dump_snapshot(path)"
_BLOCK_STATES = {
    "active_allocated": "allocated",
    "active_pending_free": "pending_free",
    "active_awaiting_free": "pending_free",  # spelling used in torch's docstring
    "inactive": "inactive",
}
# Same omissions as torch.cuda._memory_viz._frame_filter (interpreter/dispatcher noise).
_OMIT_FUNCTIONS = (
    "unwind::unwind",
    "CapturedTraceback::gather",
    "gather_with_cpp",
    "_start",
    "__libc_start_main",
    "PyEval_",
    "PyObject_",
    "PyFunction_",
)
_OMIT_FILENAMES = (
    "core/boxing",
    "/Register",
    "/Redispatch",
    "pythonrun.c",
    "Modules/main.c",
    "Objects/call.c",
    "Objects/methodobject.c",
    "pycore_ceval.h",
    "ceval.c",
    "cpython/abstract.h",
)


# --------------------------------------------------------------------------- data


# --------------------------------------------------------------------------- loading


def _unpickle(data: bytes) -> object:
    gc_was_enabled = gc.isenabled()
    gc.disable()  # plain data has no cycles worth collecting; GC passes over millions of new dicts cost 2x time
    try:
        return PlainDataUnpickler(io.BytesIO(data), PickleBudget.for_input(len(data))).load()
    except RefusedPickle:
        raise
    except ValueError as exc:
        raise ValueError(f"not a CUDA memory snapshot: {_one_line(exc)}; {_HOW_TO_WRITE}") from exc
    except (
        pickle.UnpicklingError,
        EOFError,
        TypeError,
        KeyError,
        IndexError,
        AttributeError,
        OverflowError,
        MemoryError,
        struct.error,
    ) as exc:
        raise ValueError(
            f"not a CUDA memory snapshot: {type(exc).__name__}: {_one_line(exc)}; {_HOW_TO_WRITE}"
        ) from exc
    finally:
        if gc_was_enabled:
            gc.enable()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:200] or type(exc).__name__


def load_snapshot_bytes(data: bytes) -> SnapshotReport:
    """Analyse a snapshot given as the raw bytes of its pickle."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"snapshot data must be bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise ValueError(f"not a CUDA memory snapshot: the data is empty; {_HOW_TO_WRITE}")
    return analyze_snapshot(_unpickle(bytes(data)))


def read_snapshot(path: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> SnapshotReport:
    """Read and analyse a snapshot file written by ``torch.cuda.memory._dump_snapshot``."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"snapshot file {clean(p)!r} does not exist; check the path")
    if p.is_file() and p.stat().st_size > max_bytes:  # refuse before reading
        raise ValueError(
            f"snapshot file {clean(p)!r} is {p.stat().st_size} bytes, over the {max_bytes}-byte limit; "
            "pass a larger max_bytes or record fewer entries (max_entries=...)"
        )
    data = read_bounded(p, max_bytes, "snapshot file")  # bounded for devices and pipes too
    if not data:
        raise ValueError(f"not a CUDA memory snapshot: {clean(p)!r} is empty; {_HOW_TO_WRITE}")
    return analyze_snapshot(_unpickle(data))


# --------------------------------------------------------------------------- validation


def _field(d: dict, key: str, where: str) -> Any:
    if key not in d:
        raise ValueError(f"{where} lacks {key!r}; is this a CUDA memory snapshot?")
    return d[key]


def _as_size(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_SIZE_BYTES:
        got = type(value).__name__ if not isinstance(value, int) else "a negative or over-64-bit int"
        raise ValueError(f"{where} must be a non-negative int below 2**63, got {got}; is this a CUDA memory snapshot?")
    return value


def _as_list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list, got {type(value).__name__}; is this a CUDA memory snapshot?")
    return value


def _as_dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a dict, got {type(value).__name__}; is this a CUDA memory snapshot?")
    return value


def _as_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a str, got {type(value).__name__}; is this a CUDA memory snapshot?")
    return value


def _claim(obj: object, seen: set[int], where: str) -> None:
    """Refuse a container listed twice: shared references would multiply the work."""
    if not isinstance(obj, (dict, list)):
        return
    if id(obj) in seen:
        raise ValueError(
            f"{where} repeats an object listed earlier; snapshots never share segments, "
            "blocks or traces, so this file is malformed"
        )
    seen.add(id(obj))


# --------------------------------------------------------------------------- analysis


@dataclass(frozen=True)
class _Block:
    size: int
    requested: int
    state: str  # "allocated" | "pending_free" | "inactive"
    frames: Any  # raw frames list, formatted lazily (only for top allocations)
    where: str


def _parse_block(raw: Any, where: str) -> _Block:
    b = _as_dict(raw, where)
    size = _as_size(_field(b, "size", where), f"{where}.size")
    state_raw = _as_str(_field(b, "state", where), f"{where}.state")
    if state_raw not in _BLOCK_STATES:
        raise ValueError(
            f"{where}.state is {state_raw[:40]!r}, expected one of "
            "'active_allocated', 'active_pending_free', 'inactive'; is this a CUDA memory snapshot?"
        )
    frames: Any = b.get("frames")
    requested: int | None = None
    if "requested_size" in b:
        requested = _as_size(b["requested_size"], f"{where}.requested_size")
    if "history" in b:  # legacy blocks: history[0] is the allocation living in the block
        history = _as_list(b["history"], f"{where}.history")
        if history:
            h0 = _as_dict(history[0], f"{where}.history[0]")
            if requested is None and "real_size" in h0:
                requested = _as_size(h0["real_size"], f"{where}.history[0].real_size")
            if frames is None:
                frames = h0.get("frames")
    return _Block(
        size=size,
        requested=size if requested is None else requested,
        state=_BLOCK_STATES[state_raw],
        frames=frames,
        where=where,
    )


def _keep_frame(name: str, filename: str) -> bool:
    return not any(o in name for o in _OMIT_FUNCTIONS) and not any(o in filename for o in _OMIT_FILENAMES)


def _format_frames(raw: Any, where: str) -> tuple[str, ...]:
    """Format frames as ``file.py:12:fn``; prefer Python frames when there are any."""
    if raw is None:
        return ()
    frames = _as_list(raw, f"{where}.frames")
    parsed: list[tuple[str, int, str]] = []
    for i, f in enumerate(frames):
        fw = f"{where}.frames[{i}]"
        fd = _as_dict(f, fw)
        filename = _as_str(_field(fd, "filename", fw), f"{fw}.filename")
        name = _as_str(_field(fd, "name", fw), f"{fw}.name")
        line = fd.get("line", 0)
        if isinstance(line, bool) or not isinstance(line, int) or abs(line) >= MAX_SIZE_BYTES:
            raise ValueError(f"{fw}.line must be a 64-bit int, got {type(line).__name__}")
        if _keep_frame(name, filename):
            parsed.append((filename, line, name))
    python = [f for f in parsed if f[0].endswith(".py")]
    chosen = python or parsed
    return tuple(f"{fn.split('/')[-1]}:{ln}:{nm}" for fn, ln, nm in chosen[:MAX_FRAMES])


_CONF_BOOL = re.compile(r"(?:^|,)\s*expandable_segments\s*:\s*(\w+)", re.IGNORECASE)
_CONF_SPLIT = re.compile(r"(?:^|,)\s*max_split_size_mb\s*:\s*(\d{1,12})\b")
_CONF_GC = re.compile(r"(?:^|,)\s*garbage_collection_threshold\s*:\s*([0-9.]{1,20})(?![0-9.])")


def _parse_settings(raw: Any) -> AllocatorSettings:
    if raw is None:
        return AllocatorSettings(None, None, None, None)
    s = _as_dict(raw, "allocator_settings")
    conf = s.get("PYTORCH_CUDA_ALLOC_CONF")
    if conf is not None:
        conf = _as_str(conf, "allocator_settings.PYTORCH_CUDA_ALLOC_CONF")

    expandable: bool | None = None
    if "expandable_segments" in s:
        v = s["expandable_segments"]
        if not isinstance(v, bool):
            raise ValueError(f"allocator_settings.expandable_segments must be a bool, got {type(v).__name__}")
        expandable = v
    elif conf and (m := _CONF_BOOL.search(conf)):
        expandable = m.group(1).lower() == "true"

    max_split: int | None = None
    if "max_split_size" in s:
        v = s["max_split_size"]
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"allocator_settings.max_split_size must be an int, got {type(v).__name__}")
        # Unset is SIZE_MAX, which the snapshot stores cast to int64 (-1).
        max_split = v if 0 < v < 2**62 else None
    elif conf and (m := _CONF_SPLIT.search(conf)):
        max_split = int(m.group(1)) * 1024**2

    gc: float | None = None
    if "garbage_collection_threshold" in s:
        v = s["garbage_collection_threshold"]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(
                f"allocator_settings.garbage_collection_threshold must be a number, got {type(v).__name__}"
            )
        gc = float(v) if v > 0 else None
    elif conf and (m := _CONF_GC.search(conf)):
        try:
            gc = float(m.group(1)) or None
        except ValueError as exc:
            raise ValueError(
                f"allocator_settings.PYTORCH_CUDA_ALLOC_CONF has a bad garbage_collection_threshold {m.group(1)!r}"
            ) from exc
    return AllocatorSettings(conf, expandable, max_split, gc)


def _summarize_traces(raw: Any) -> TraceSummary | None:
    if raw is None:
        return None
    traces = _as_list(raw, "device_traces")
    counts: dict[str, int] = {}
    n = 0
    last_oom_size: int | None = None
    last_oom_free: int | None = None
    seen: set[int] = set()
    for d, trace in enumerate(traces):
        _claim(_as_list(trace, f"device_traces[{d}]"), seen, f"device_traces[{d}]")
        for i, entry in enumerate(trace):
            where = f"device_traces[{d}][{i}]"
            e = _as_dict(entry, where)
            _claim(e, seen, where)
            action = _as_str(_field(e, "action", where), f"{where}.action")
            counts[action] = counts.get(action, 0) + 1
            n += 1
            if action == "oom":
                last_oom_size = _as_size(e["size"], f"{where}.size") if "size" in e else None
                last_oom_free = _as_size(e["device_free"], f"{where}.device_free") if "device_free" in e else None
    return TraceSummary(
        num_entries=n,
        counts=tuple(sorted(counts.items())),
        has_oom="oom" in counts,
        last_oom_requested_bytes=last_oom_size,
        last_oom_device_free_bytes=last_oom_free,
    )


def analyze_snapshot(data: object) -> SnapshotReport:
    """Analyse an already-loaded snapshot (current dict layout or legacy segment list)."""
    if isinstance(data, dict):
        fmt = "current"
        segments_raw = _as_list(_field(data, "segments", "snapshot"), "snapshot.segments")
        settings = _parse_settings(data.get("allocator_settings"))
        traces = _summarize_traces(data.get("device_traces"))
    elif isinstance(data, list):
        fmt = "legacy"
        segments_raw = data
        settings = AllocatorSettings(None, None, None, None)
        traces = None
    else:
        raise ValueError(
            f"not a CUDA memory snapshot: top level is {type(data).__name__}, expected a dict "
            f"with 'segments' or a list of segments; {_HOW_TO_WRITE}"
        )

    reserved = allocated = requested = pending = free = largest_free = split = 0
    num_blocks = 0
    devices: set[int] = set()
    any_expandable_segment = False
    pools: dict[str, list[int]] = {}  # pool -> [segments, reserved, allocated, free]
    live: list[_Block] = []
    seen: set[int] = set()

    for si, seg_raw in enumerate(segments_raw):
        where = f"segments[{si}]"
        seg = _as_dict(seg_raw, where)
        _claim(seg, seen, where)
        total = _as_size(_field(seg, "total_size", where), f"{where}.total_size")
        blocks_raw = _as_list(_field(seg, "blocks", where), f"{where}.blocks")
        _claim(blocks_raw, seen, f"{where}.blocks")
        for bi, b in enumerate(blocks_raw):
            _claim(b, seen, f"{where}.blocks[{bi}]")
        pool = seg.get("segment_type", "unknown")
        pool = _as_str(pool, f"{where}.segment_type")
        if "device" in seg:
            devices.add(_as_size(seg["device"], f"{where}.device"))
        if "is_expandable" in seg:
            flag = seg["is_expandable"]
            if not isinstance(flag, bool):
                raise ValueError(f"{where}.is_expandable must be a bool, got {type(flag).__name__}")
            any_expandable_segment |= flag

        blocks = [_parse_block(b, f"{where}.blocks[{bi}]") for bi, b in enumerate(blocks_raw)]
        seg_alloc = sum(b.size for b in blocks if b.state == "allocated")
        seg_free = sum(b.size for b in blocks if b.state == "inactive")
        seg_used = any(b.state != "inactive" for b in blocks)

        reserved += total
        allocated += seg_alloc
        free += seg_free
        pending += sum(b.size for b in blocks if b.state == "pending_free")
        requested += sum(b.requested for b in blocks if b.state == "allocated")
        largest_free = max([largest_free] + [b.size for b in blocks if b.state == "inactive"])
        if seg_used:
            split += seg_free
        num_blocks += len(blocks)
        live.extend(b for b in blocks if b.state == "allocated")

        acc = pools.setdefault(pool, [0, 0, 0, 0])
        acc[0] += 1
        acc[1] += total
        acc[2] += seg_alloc
        acc[3] += seg_free

    ratio = 0.0 if free == 0 else 1.0 - largest_free / free

    expandable = settings.expandable_segments if settings.expandable_segments is not None else any_expandable_segment
    live.sort(key=lambda b: (-b.size, -b.requested))
    formatted: dict[int, tuple[str, ...]] = {}  # a frames list shared by many blocks is read once
    for b in live[:TOP_ALLOCATIONS]:
        if id(b.frames) not in formatted:
            formatted[id(b.frames)] = _format_frames(b.frames, b.where)
    top = tuple(Allocation(b.size, b.requested, formatted[id(b.frames)]) for b in live[:TOP_ALLOCATIONS])
    by_pool = tuple(PoolSummary(pool, *acc) for pool, acc in sorted(pools.items()))
    return SnapshotReport(
        format=fmt,
        reserved_bytes=reserved,
        allocated_bytes=allocated,
        requested_bytes=requested,
        pending_free_bytes=pending,
        free_bytes=free,
        largest_free_block_bytes=largest_free,
        inactive_split_bytes=split,
        fragmentation_ratio=ratio,
        num_segments=len(segments_raw),
        num_blocks=num_blocks,
        devices=tuple(sorted(devices)),
        segments_by_pool=by_pool,
        expandable_segments=expandable,
        allocator_settings=settings,
        top_allocations=top,
        device_trace_summary=traces,
        advice=allocator_advice(
            reserved=reserved,
            free=free,
            largest_free=largest_free,
            split=split,
            ratio=ratio,
            expandable=expandable,
            settings=settings,
            traces=traces,
        ),
    )
