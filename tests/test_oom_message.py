"""Tests for planner.analysis.oom_message: CUDA OOM message parsing and verdicts."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.analysis.oom_message import (
    NOT_OOM,
    OomExplanation,
    explain_oom_message,
    parse_size,
)

GiB = 1024**3
MiB = 1024**2

CURRENT_FRAGMENTATION = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 79.15 GiB of which 1.23 GiB is free. Including non-PyTorch memory, this process "
    "has 77.90 GiB memory in use. Of the allocated memory 74.50 GiB is allocated by PyTorch, and "
    "2.40 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
    "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html"
    "#environment-variables)"
)
CURRENT_CAPACITY = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total "
    "capacity of 79.15 GiB of which 512.00 MiB is free. Including non-PyTorch memory, this "
    "process has 78.60 GiB memory in use. Of the allocated memory 77.80 GiB is allocated by "
    "PyTorch, and 300.00 MiB is reserved by PyTorch but unallocated."
)
CURRENT_OTHER_PROCESS = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 3 has a total "
    "capacity of 79.15 GiB of which 256.00 MiB is free. Process 4242 has 30.00 GiB memory in "
    "use. Including non-PyTorch memory, this process has 48.90 GiB memory in use. Of the "
    "allocated memory 47.00 GiB is allocated by PyTorch, and 100.00 MiB is reserved by PyTorch "
    "but unallocated."
)
# torch 2.1 printed "capacty"; newer versions add private pools (CUDA graphs) and "allowed".
TORCH21_TYPO_WITH_POOLS = (
    "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 1 has a "
    "total capacty of 23.65 GiB of which 10.50 GiB is free. 12.00 GiB allowed; Including "
    "non-PyTorch memory, this process has 12.10 GiB memory in use. Of the allocated memory "
    "11.50 GiB is allocated by PyTorch, with 2.00 GiB allocated in private pools (e.g., CUDA "
    "Graphs), and 20.00 MiB is reserved by PyTorch but unallocated."
)
LEGACY_FRAGMENTATION = (
    "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total "
    "capacity; 14.56 GiB already allocated; 3.94 MiB free; 14.71 GiB reserved in total by "
    "PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb to avoid "
    "fragmentation."
)
LEGACY_CAPACITY = (
    "RuntimeError: CUDA out of memory. Tried to allocate 512.00 MiB (GPU 1; 10.76 GiB total "
    "capacity; 9.70 GiB already allocated; 0 bytes free; 9.80 GiB reserved in total by PyTorch)"
)
ANCIENT_CACHED = (
    "RuntimeError: CUDA out of memory. Tried to allocate 1.53 GiB (GPU 0; 11.17 GiB total "
    "capacity; 8.40 GiB already allocated; 1.38 GiB free; 8.50 GiB cached)"
)


def test_current_fragmentation_figures_and_verdict() -> None:
    r = explain_oom_message(CURRENT_FRAGMENTATION)
    assert r.message_format == "current"
    assert r.device == 0
    assert r.requested_bytes == 2 * GiB
    assert r.total_bytes == 84_986_665_370  # 79.15 * 2**30 = 84_986_665_369.6
    assert r.free_bytes == 1_320_702_444  # 1.23 * 2**30 = 1_320_702_443.52
    assert r.process_bytes == 83_644_488_090  # 77.90 * 2**30 = 83_644_488_089.6
    assert r.allocated_bytes == 79_993_765_888  # 74.5 * 2**30 exactly
    assert r.reserved_unallocated_bytes == 2_576_980_378  # 2.40 * 2**30 = 2_576_980_377.6
    assert r.reserved_bytes == 79_993_765_888 + 2_576_980_378
    # outside the cache: 79.15 - 1.23 - (74.50 + 2.40) = 1.02 GiB (CUDA context etc.)
    assert r.non_pytorch_bytes == 84_986_665_370 - 1_320_702_444 - (79_993_765_888 + 2_576_980_378)
    # 2.40 GiB reserved-but-unallocated >= 2.00 GiB requested -> the memory exists but is split
    assert r.verdict == "fragmentation"
    assert any("expandable_segments:True" in a for a in r.advice)
    assert any("fragmented" in line for line in r.explanation)


def test_current_capacity() -> None:
    r = explain_oom_message(CURRENT_CAPACITY)
    assert r.requested_bytes == 1 * GiB
    assert r.free_bytes == 512 * MiB
    assert r.reserved_unallocated_bytes == 300 * MiB
    # 300 MiB unallocated < 1 GiB requested; outside the cache:
    # 79.15 GiB - 0.5 GiB - 77.80 GiB - 300 MiB ~= 0.56 GiB, about 0.7% of the GPU
    assert r.non_pytorch_bytes is not None and r.non_pytorch_bytes < 0.6 * GiB
    assert r.verdict == "capacity"
    assert any("micro-batch" in a for a in r.advice)


def test_current_other_process() -> None:
    r = explain_oom_message(CURRENT_OTHER_PROCESS)
    assert r.device == 3
    assert r.other_processes_bytes == 30 * GiB
    assert r.process_bytes == round(48.90 * GiB)
    # outside the cache: 79.15 - 0.25 - (47.00 + 100/1024) ~= 31.80 GiB, 40% of the GPU
    assert r.non_pytorch_bytes == round(79.15 * GiB) - 256 * MiB - (47 * GiB + 100 * MiB)
    assert r.verdict == "other-process"
    assert any("nvidia-smi" in a for a in r.advice)
    assert any("other processes hold 30.00 GiB" in line for line in r.explanation)


def test_torch21_typo_private_pools_and_allowed() -> None:
    r = explain_oom_message(TORCH21_TYPO_WITH_POOLS)
    assert r.message_format == "current"
    assert r.device == 1
    assert r.total_bytes == round(23.65 * GiB)
    assert r.free_bytes == round(10.5 * GiB)
    assert r.allowed_bytes == 12 * GiB
    assert r.private_pool_bytes == 2 * GiB
    assert r.allocated_bytes == round(11.5 * GiB)
    assert r.reserved_unallocated_bytes == 20 * MiB
    # 20 MiB unallocated < 1 GiB requested; reserved 11.50 GiB + 20 MiB + 1 GiB > 12 GiB cap,
    # so the memory-fraction cap, not the device, is what ran out
    assert r.verdict == "capacity"
    assert any("memory-fraction cap" in line for line in r.explanation)


def test_legacy_fragmentation() -> None:
    r = explain_oom_message(LEGACY_FRAGMENTATION)
    assert r.message_format == "legacy"
    assert r.device == 0
    assert r.requested_bytes == 20 * MiB
    assert r.total_bytes == round(15.78 * GiB)
    assert r.allocated_bytes == round(14.56 * GiB)
    assert r.free_bytes == round(3.94 * MiB)
    assert r.reserved_bytes == round(14.71 * GiB)
    assert r.process_bytes is None  # the old message does not say
    # 14.71 - 14.56 = 0.15 GiB ~= 153.6 MiB unallocated >= 20 MiB requested
    assert r.reserved_unallocated_bytes == round(14.71 * GiB) - round(14.56 * GiB)
    assert r.verdict == "fragmentation"


def test_legacy_capacity_with_zero_bytes_free() -> None:
    r = explain_oom_message(LEGACY_CAPACITY)
    assert r.device == 1
    assert r.free_bytes == 0
    # 9.80 - 9.70 = 0.10 GiB unallocated < 512 MiB; outside cache 10.76 - 0 - 9.80 = 0.96 GiB (9%)
    assert r.reserved_unallocated_bytes == round(9.80 * GiB) - round(9.70 * GiB)
    assert r.verdict == "capacity"


def test_ancient_cached_wording() -> None:
    r = explain_oom_message(ANCIENT_CACHED)
    assert r.message_format == "legacy"
    assert r.reserved_bytes == round(8.50 * GiB)
    # 0.10 GiB unallocated < 1.53 GiB; outside cache 11.17 - 1.38 - 8.50 = 1.29 GiB (11.5%)
    assert r.verdict == "capacity"


def test_wrapped_paste_with_traceback() -> None:
    pasted = (
        'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\n'
        + CURRENT_FRAGMENTATION.replace(". ", ".\n   ")
    )
    assert explain_oom_message(pasted).to_dict() == explain_oom_message(CURRENT_FRAGMENTATION).to_dict()


def test_hip_message() -> None:
    r = explain_oom_message(CURRENT_CAPACITY.replace("CUDA out of memory", "HIP out of memory"))
    assert r.verdict == "capacity"


@pytest.mark.parametrize(
    "text, fmt",
    [
        ("torch.OutOfMemoryError: CUDA out of memory.", "bare"),
        ("CUDA out of memory. Tried to allocate 2.00 GiB.", "partial"),
        ("RuntimeError: CUDA error: out of memory", "cuda-error"),
    ],
)
def test_messages_without_figures_are_unknown(text: str, fmt: str) -> None:
    r = explain_oom_message(text)
    assert r.message_format == fmt
    assert r.verdict == "unknown"
    assert r.advice


@pytest.mark.parametrize(
    "text",
    ["", "hello", "RuntimeError: CUDA error: device-side assert triggered", "out of memory"],
)
def test_not_an_oom_message(text: str) -> None:
    with pytest.raises(ValueError) as info:
        explain_oom_message(text)
    assert str(info.value) == NOT_OOM


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512 B", 512),
        ("0 bytes", 0),
        ("3 KiB", 3 * 1024),
        ("1.50 MiB", 1_572_864),
        ("2.00 GiB", 2 * GiB),
        ("1 KB", 1000),
        ("1.5 GB", 1_500_000_000),
        ("20 MB", 20_000_000),
    ],
)
def test_parse_size_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_parse_size_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="write it like"):
        parse_size("lots")


def test_units_inside_message() -> None:
    r = explain_oom_message(
        "CUDA out of memory. Tried to allocate 1536 KiB (GPU 2; 8 GB total capacity; "
        "7000 MB already allocated; 512 B free; 7.5 GB reserved in total by PyTorch)"
    )
    assert r.requested_bytes == 1536 * 1024
    assert r.total_bytes == 8_000_000_000
    assert r.allocated_bytes == 7_000_000_000
    assert r.free_bytes == 512
    assert r.reserved_unallocated_bytes == 500_000_000
    assert r.verdict == "fragmentation"


def test_to_dict_is_json_and_frozen() -> None:
    r = explain_oom_message(CURRENT_OTHER_PROCESS)
    d = json.loads(json.dumps(r.to_dict()))
    assert d["verdict"] == "other-process"
    assert set(d) == {f.name for f in dataclasses.fields(OomExplanation)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.verdict = "capacity"  # type: ignore[misc]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "CUDA out of memory.",
                "Tried to allocate",
                "GPU 0",
                "total capacity of",
                "of which",
                "is free.",
                "total capacity;",
                "already allocated;",
                "free;",
                "reserved in total by PyTorch",
                "is reserved by PyTorch but unallocated",
                "Of the allocated memory",
                "is allocated by PyTorch",
                "Process 7 has",
                "memory in use",
                "allowed",
                "1.00 GiB",
                "0 bytes",
                "99999999999.99 TiB",
                "3 KB",
            ]
        )
        | st.text(max_size=12),
        max_size=25,
    )
)
def test_fuzz_never_crashes(parts: list[str]) -> None:
    text = " ".join(parts)
    try:
        r = explain_oom_message(text)
    except ValueError as exc:
        assert str(exc) == NOT_OOM
        return
    assert r.verdict in {"fragmentation", "capacity", "other-process", "unknown"}
    json.dumps(r.to_dict())


@pytest.mark.parametrize(
    "text",
    [
        "CUDA out of memory. Tried to allocate " + "9" * 100_000,
        "CUDA out of memory. Tried to allocate " + "9" * 100_000 + " GiB",
        "CUDA out of memory. GPU " + "1" * 100_000 + " has a total capacity of 1." + "5" * 100_000 + " GiB",
        "CUDA out of memory. " + "1" * 100_000 + "x",
    ],
)
def test_long_digit_runs_parse_in_linear_time(text: str) -> None:
    start = time.thread_time()  # this thread's CPU time: a busy machine and other threads stretch the rest
    try:
        explain_oom_message(text)
    except ValueError as exc:  # a huge size is refused in one line, not as OverflowError or digit-limit text
        assert "\n" not in str(exc) and "Exceeds the limit" not in str(exc)
    assert time.thread_time() - start < 1.0  # was 16 s for 10,000 digits (quadratic)
