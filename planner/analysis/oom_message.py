"""Explain a CUDA out-of-memory error message from PyTorch's caching allocator.

Understands the current wording (torch >= 2.1)::

    CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of
    79.15 GiB of which 1.23 GiB is free. Process 4242 has 1.00 GiB memory in use.
    Including non-PyTorch memory, this process has 77.90 GiB memory in use. Of the
    allocated memory 74.50 GiB is allocated by PyTorch, and 2.40 GiB is reserved by
    PyTorch but unallocated. ...

and the older one (torch <= 2.0; "cached" before 1.5)::

    CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity;
    14.56 GiB already allocated; 3.94 MiB free; 14.71 GiB reserved in total by PyTorch)

PyTorch prints sizes rounded to two decimals, so byte figures are approximate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["OomExplanation", "explain_oom_message", "parse_size"]

OTHER_MEMORY_SHARE = 0.15
"""Memory outside PyTorch's cache above this share of the GPU is blamed for the OOM."""

NOT_OOM = (
    "not a CUDA out-of-memory message; paste the line that starts with 'torch.OutOfMemoryError' or 'CUDA out of memory'"
)

_UNITS: dict[str, int] = {
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    # Decimal units are never printed by PyTorch but turn up in pasted/edited text.
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}
# A number starts only where no digit precedes it, so a run of n digits is tried once, not n times
# (linear time); the digits are bounded when converted.
_SIZE = r"(?<![\d.])(\d+(?:\.\d+)?)\s*(bytes|byte|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)\b"
MAX_NUMBER_CHARS = 24
"""Longest number read from a message (PyTorch prints at most about 10 characters)."""
_SIZE_ONLY = re.compile(rf"^\s*{_SIZE}\s*$", re.IGNORECASE)

_OOM_MARKERS = re.compile(r"OutOfMemoryError|(?:CUDA|HIP) out of memory|CUDA error: out of memory", re.IGNORECASE)
_ALLOCATOR_OOM = re.compile(r"(?:CUDA|HIP) out of memory|OutOfMemoryError", re.IGNORECASE)


def _rx(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern.replace("{SIZE}", _SIZE), re.IGNORECASE)


_REQUESTED = _rx(r"Tried to allocate {SIZE}")
_DEVICE = re.compile(r"\bGPU (\d{1,6})\b")
# "capacty" is the spelling torch 2.1 printed.
_NEW_TOTAL_FREE = _rx(r"total capac\w* of {SIZE} of which {SIZE} is free")
_THIS_PROCESS = _rx(r"this process has {SIZE} memory in use")
_OTHER_PROCESS = re.compile(r"\bProcess (\d{1,12}) has " + _SIZE + r" memory in use", re.IGNORECASE)
_NEW_ALLOCATED = _rx(r"Of the allocated memory {SIZE} is allocated by PyTorch")
_PRIVATE_POOLS = _rx(r"{SIZE} allocated in private pools")
_NEW_UNALLOCATED = _rx(r"{SIZE} is reserved by PyTorch but unallocated")
_ALLOWED = _rx(r"{SIZE} allowed")
_OLD_TOTAL = _rx(r"{SIZE} total capacity")
_OLD_ALLOCATED = _rx(r"{SIZE} already allocated")
_OLD_FREE = _rx(r";\s*{SIZE} free")
_OLD_RESERVED = _rx(r"{SIZE} (?:reserved in total by PyTorch|cached)")


def parse_size(text: str) -> int:
    """Parse ``'2.00 GiB'`` / ``'512 bytes'`` / ``'1.5 GB'`` into bytes."""
    m = _SIZE_ONLY.match(text)
    if not m:
        raise ValueError(f"cannot read size {text[:40]!r}; write it like '2.00 GiB' or '512 MiB'")
    return _to_bytes(m.group(1), m.group(2))


def _to_bytes(number: str, unit: str) -> int:
    if len(number) > MAX_NUMBER_CHARS:
        raise ValueError(f"the message has a {len(number)}-digit size; paste the message as PyTorch printed it")
    return round(float(number) * _UNITS[unit.lower()])


def _find(pattern: re.Pattern[str], text: str, group: int = 0) -> int | None:
    m = pattern.search(text)
    if m is None:
        return None
    return _to_bytes(m.group(1 + 2 * group), m.group(2 + 2 * group))


def _fmt(n: int) -> str:
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{n} bytes"


@dataclass(frozen=True)
class OomExplanation:
    """Figures read from an OOM message, a verdict, and what to do about it.

    ``verdict`` is ``"fragmentation"`` (PyTorch's cache holds at least the requested
    size, but split into smaller free blocks), ``"other-process"`` (memory outside
    PyTorch's cache — other processes, CUDA context, libraries — is large),
    ``"capacity"`` (PyTorch itself holds nearly all memory) or ``"unknown"`` (the
    message carries too few figures).
    """

    requested_bytes: int | None
    total_bytes: int | None
    free_bytes: int | None
    process_bytes: int | None
    allocated_bytes: int | None
    reserved_unallocated_bytes: int | None
    reserved_bytes: int | None
    non_pytorch_bytes: int | None
    other_processes_bytes: int | None
    private_pool_bytes: int | None
    allowed_bytes: int | None
    device: int | None
    message_format: str
    verdict: str
    explanation: tuple[str, ...]
    advice: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "requested_bytes": self.requested_bytes,
            "total_bytes": self.total_bytes,
            "free_bytes": self.free_bytes,
            "process_bytes": self.process_bytes,
            "allocated_bytes": self.allocated_bytes,
            "reserved_unallocated_bytes": self.reserved_unallocated_bytes,
            "reserved_bytes": self.reserved_bytes,
            "non_pytorch_bytes": self.non_pytorch_bytes,
            "other_processes_bytes": self.other_processes_bytes,
            "private_pool_bytes": self.private_pool_bytes,
            "allowed_bytes": self.allowed_bytes,
            "device": self.device,
            "message_format": self.message_format,
            "verdict": self.verdict,
            "explanation": list(self.explanation),
            "advice": list(self.advice),
        }


_ADVICE = {
    "fragmentation": (
        "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so cached segments grow instead of being split",
        "if expandable segments are not an option, set max_split_size_mb:<MiB> (a bit above "
        "your largest common allocation) so big cached blocks are not split",
        "to see which allocations split the cache, record with "
        "torch.cuda.memory._record_memory_history() and read the "
        "torch.cuda.memory._dump_snapshot() file with memplan's snapshot reader",
    ),
    "capacity": (
        "the model's own tensors fill the GPU: reduce the micro-batch or sequence length, "
        "or add activation checkpointing, lower-precision weights/optimizer state, "
        "or sharding/offload",
        "check for tensors kept alive across steps (losses accumulated without .item(), "
        "stored activations or gradients)",
    ),
    "other-process": (
        "memory outside PyTorch's cache is large: check nvidia-smi for other processes on "
        "this GPU and restrict each job with CUDA_VISIBLE_DEVICES",
        "inside this process look for other CUDA users (another framework, NCCL buffers, "
        "cuBLAS/cuDNN workspaces, DataLoader workers that touch CUDA)",
    ),
    "unknown": (
        "the message has too few figures to tell why; paste the full 'CUDA out of memory' "
        "text, or record a snapshot with torch.cuda.memory._record_memory_history()",
    ),
}


def explain_oom_message(text: str) -> OomExplanation:
    """Parse a CUDA OOM message and say whether fragmentation, capacity or others caused it."""
    if not isinstance(text, str) or not _OOM_MARKERS.search(text):
        raise ValueError(NOT_OOM)
    text = " ".join(text.split())  # messages are often pasted wrapped

    requested = _find(_REQUESTED, text)
    dev = _DEVICE.search(text)
    device = int(dev.group(1)) if dev else None
    allowed = _find(_ALLOWED, text)
    others = [_to_bytes(m.group(2), m.group(3)) for m in _OTHER_PROCESS.finditer(text)]
    other_processes = sum(others) if others else None

    total = free = process = allocated = unallocated = reserved = private = None
    if _NEW_TOTAL_FREE.search(text) or _NEW_ALLOCATED.search(text):
        fmt = "current"
        total = _find(_NEW_TOTAL_FREE, text, 0)
        free = _find(_NEW_TOTAL_FREE, text, 1)
        process = _find(_THIS_PROCESS, text)
        allocated = _find(_NEW_ALLOCATED, text)
        private = _find(_PRIVATE_POOLS, text)
        unallocated = _find(_NEW_UNALLOCATED, text)
        if allocated is not None and unallocated is not None:
            reserved = allocated + unallocated
    elif _OLD_TOTAL.search(text) or _OLD_ALLOCATED.search(text):
        fmt = "legacy"
        total = _find(_OLD_TOTAL, text)
        free = _find(_OLD_FREE, text)
        allocated = _find(_OLD_ALLOCATED, text)
        reserved = _find(_OLD_RESERVED, text)
        if reserved is not None and allocated is not None:
            unallocated = max(reserved - allocated, 0)
    elif _ALLOCATOR_OOM.search(text) and requested is not None:
        fmt = "partial"
    elif _ALLOCATOR_OOM.search(text):
        fmt = "bare"
    else:
        fmt = "cuda-error"

    non_pytorch = None
    if total is not None and free is not None and reserved is not None:
        non_pytorch = max(total - free - reserved, 0)

    verdict, lines = _judge(
        fmt=fmt,
        requested=requested,
        total=total,
        free=free,
        allocated=allocated,
        unallocated=unallocated,
        reserved=reserved,
        non_pytorch=non_pytorch,
        other_processes=other_processes,
        allowed=allowed,
    )
    advice = _ADVICE[verdict]
    return OomExplanation(
        requested_bytes=requested,
        total_bytes=total,
        free_bytes=free,
        process_bytes=process,
        allocated_bytes=allocated,
        reserved_unallocated_bytes=unallocated,
        reserved_bytes=reserved,
        non_pytorch_bytes=non_pytorch,
        other_processes_bytes=other_processes,
        private_pool_bytes=private,
        allowed_bytes=allowed,
        device=device,
        message_format=fmt,
        verdict=verdict,
        explanation=tuple(lines),
        advice=advice,
    )


def _judge(
    *,
    fmt: str,
    requested: int | None,
    total: int | None,
    free: int | None,
    allocated: int | None,
    unallocated: int | None,
    reserved: int | None,
    non_pytorch: int | None,
    other_processes: int | None,
    allowed: int | None,
) -> tuple[str, list[str]]:
    lines: list[str] = []
    if fmt == "cuda-error":
        lines.append(
            "'CUDA error: out of memory' comes from a CUDA call outside the caching allocator "
            "(a library workspace, context creation or a kernel), so it carries no figures"
        )
        return "unknown", lines
    where = "the GPU" if total is None else f"a {_fmt(total)} GPU"
    if requested is not None:
        lines.append(f"PyTorch asked for {_fmt(requested)} more on {where}")
    if free is not None:
        lines.append(f"CUDA reported {_fmt(free)} free on the device")
    if allowed is not None:
        lines.append(
            f"a per-process memory fraction caps this process at {_fmt(allowed)} "
            "(torch.cuda.set_per_process_memory_fraction)"
        )
    if allocated is not None:
        lines.append(f"live tensors hold {_fmt(allocated)}")
    if unallocated is not None:
        lines.append(f"PyTorch's cache holds {_fmt(unallocated)} reserved but unallocated")
    if non_pytorch is not None:
        detail = f", of which other processes hold {_fmt(other_processes)}" if other_processes is not None else ""
        lines.append(
            f"{_fmt(non_pytorch)} is used outside PyTorch's cache (CUDA context, libraries, other processes{detail})"
        )

    if requested is None or (unallocated is None and non_pytorch is None and allocated is None):
        return "unknown", lines
    if unallocated is not None and unallocated >= requested:
        lines.append(
            f"the cache already holds {_fmt(unallocated)} >= the {_fmt(requested)} requested, "
            "but no single free block is large enough: the cached memory is fragmented"
        )
        return "fragmentation", lines
    if allowed is not None and reserved is not None and reserved + requested > allowed:
        lines.append(
            f"the request would take PyTorch past its {_fmt(allowed)} memory-fraction cap: "
            "raise the fraction or use less memory"
        )
        return "capacity", lines
    outside = non_pytorch if non_pytorch is not None else other_processes
    if outside is not None and total and outside >= OTHER_MEMORY_SHARE * total:
        lines.append(
            f"memory outside PyTorch's cache ({_fmt(outside)}, "
            f"{outside / total:.0%} of the GPU) is what leaves too little for this request"
        )
        return "other-process", lines
    lines.append("PyTorch's own allocations fill the GPU: the job needs less memory or a larger GPU")
    return "capacity", lines
