"""Fuzz the readers of untrusted input (issue 10): plan JSON, memory snapshots (valid structures,
mutations and every pickle opcode family) and OOM messages.

Every input must end within 2 s of CPU time and under 256 MB above the RSS it started at, either accepted or
refused as a one-line ValueError; any other exception fails. Seeded (derandomize) and sized to
run in well under a minute.
"""

from __future__ import annotations

import json
import pickle
import pickletools
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hostile import PROTO4, hash_bombs, meter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.analysis.oom_message import explain_oom_message
from planner.analysis.snapshot import load_snapshot_bytes
from planner.plans.format import load_plan

CPU_S = 2.0
RSS_BYTES = 256 * 2**20
GOLDEN = Path(__file__).parent / "golden"
pytestmark = (
    pytest.mark.slow
)  # about a minute of hypothesis cases; test_safe_io and test_unpickler cover the readers fast
FUZZ = settings(derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def bounded(fn: Callable[[Any], Any], arg: Any) -> None:
    """fn(arg) is accepted or raises a one-line ValueError, within CPU_S of CPU time and RSS_BYTES."""
    with meter() as m:
        try:
            fn(arg)
        except ValueError as exc:
            message = str(exc)
            assert "\n" not in message and len(message) < 2000, message[:300]
    assert m["cpu_s"] < CPU_S, m
    assert m["peak_rss_delta_bytes"] < RSS_BYTES, m


# ---------------------------------------------------------------- plan JSON

_TMP = Path(tempfile.mkdtemp(prefix="memplan-fuzz-"))
_PLAN_TEXTS = [p.read_text() for p in sorted(GOLDEN.glob("*.json"))]


def _load_plan_text(text: str | bytes) -> None:
    path = _TMP / "plan.json"
    path.write_bytes(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    load_plan(path)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=8), kids, max_size=5),
    max_leaves=30,
)


def _set_leaf(doc: Any, path: list[int], value: Any) -> Any:
    """Replace the node reached by following `path` (indices modulo each container's size)."""
    if not path or not isinstance(doc, (dict, list)) or not doc:
        return value
    keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
    key = keys[path[0] % len(keys)]
    doc[key] = _set_leaf(doc[key], path[1:], value)
    return doc


@FUZZ
@given(st.sampled_from(range(len(_PLAN_TEXTS))), st.lists(st.integers(0, 50), max_size=8), json_values)
def test_fuzz_plan_with_one_node_replaced(which: int, path: list[int], value: Any) -> None:
    doc = _set_leaf(json.loads(_PLAN_TEXTS[which]), path, value)
    bounded(_load_plan_text, json.dumps(doc))


@FUZZ
@given(
    st.sampled_from(range(len(_PLAN_TEXTS))),
    st.integers(0, 10**6),
    st.sampled_from(["[" * 3000, "9" * 5000, '"a": 1, "a": 2, ', "\x00", "\ufffd", "1e999", "-", "\\u", "}", ""]),
    st.integers(0, 400),
)
def test_fuzz_plan_text_spliced(which: int, at: int, insert: str, cut: int) -> None:
    text = _PLAN_TEXTS[which]
    at %= len(text) + 1
    bounded(_load_plan_text, text[:at] + insert + text[at + cut :])


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_plan_any_bytes(data: bytes) -> None:
    bounded(_load_plan_text, data)


# ---------------------------------------------------------------- snapshots

sizes = st.integers(0, 2**40) | st.integers(-(2**70), 2**70) | st.sampled_from([0, 512, 2**20, 2**63 - 1, 2**64])
texts = st.text(max_size=20) | st.sampled_from(["x.py", "large", "small", "\x1b[31m", "a\nb", "inactive"])
frames = st.lists(st.fixed_dictionaries({"filename": texts, "line": sizes, "name": texts}), max_size=4)
blocks = st.fixed_dictionaries(
    {"size": sizes, "state": st.sampled_from(["active_allocated", "active_pending_free", "inactive", "bogus"])},
    optional={
        "requested_size": sizes,
        "frames": frames | st.none(),
        "history": st.lists(
            st.dictionaries(st.sampled_from(["addr", "real_size", "frames"]), sizes, max_size=3), max_size=2
        ),
    },
)
segments = st.fixed_dictionaries(
    {"total_size": sizes, "blocks": st.lists(blocks, max_size=4)},
    optional={"segment_type": texts, "device": sizes, "is_expandable": st.booleans() | sizes},
)
traces = st.lists(
    st.lists(
        st.fixed_dictionaries(
            {"action": st.sampled_from(["alloc", "free_requested", "oom", "segment_alloc"]) | texts},
            optional={"size": sizes, "device_free": sizes},
        ),
        max_size=4,
    ),
    max_size=2,
)
settings_dicts = st.dictionaries(
    st.sampled_from(
        ["PYTORCH_CUDA_ALLOC_CONF", "expandable_segments", "max_split_size", "garbage_collection_threshold"]
    ),
    st.booleans()
    | sizes
    | st.floats(allow_nan=False)
    | st.sampled_from(
        ["expandable_segments:True,max_split_size_mb:" + "9" * 40, "garbage_collection_threshold:" + "1." * 50]
    ),
)
snapshots = st.fixed_dictionaries(
    {"segments": st.lists(segments, max_size=4)},
    optional={"device_traces": traces, "allocator_settings": settings_dicts},
) | st.lists(segments, max_size=3)


@FUZZ
@given(snapshots, st.integers(0, 5))
def test_fuzz_snapshot_structures(snapshot: Any, protocol: int) -> None:
    bounded(load_snapshot_bytes, pickle.dumps(snapshot, protocol=protocol))


@FUZZ
@given(
    snapshots,
    st.lists(st.tuples(st.integers(0, 10**6), st.binary(min_size=1, max_size=4)), max_size=4),
    st.integers(0, 10**6),
)
def test_fuzz_snapshot_mutated_bytes(snapshot: Any, edits: list[tuple[int, bytes]], cut: int) -> None:
    data = bytearray(pickle.dumps(snapshot, protocol=4))
    for at, patch in edits:
        at %= len(data)
        data[at : at + len(patch)] = patch
    bounded(load_snapshot_bytes, bytes(data[: len(data) - cut % 8]))


def _arg(op: pickletools.OpcodeInfo, draw_bytes: bytes, length: int) -> bytes:
    """Argument bytes for `op`: fixed-size, newline-terminated or length-prefixed (declared `length`)."""
    if op.arg is None:
        return b""
    n = op.arg.n
    if n >= 0:
        return draw_bytes[:n].ljust(n, b"\x00")
    if n == -1:  # up to a newline (GLOBAL/INST take two lines)
        lines = 2 if "pair" in op.arg.name else 1
        return (draw_bytes.replace(b"\n", b"") + b"\n") * lines
    prefix = {-2: "<B", -3: "<i", -4: "<I", -5: "<Q"}[n]
    declared = length % 256 if prefix == "<B" else length
    return struct.pack(prefix, declared) + draw_bytes


OPCODES = pickletools.opcodes
opcode_runs = st.lists(
    st.tuples(st.sampled_from(range(len(OPCODES))), st.binary(max_size=12), st.integers(0, 2**31 - 1)),
    max_size=40,
)


def _assemble(run: list[tuple[int, bytes, int]], head: bytes = PROTO4) -> bytes:
    return head + b"".join(OPCODES[i].code.encode("latin-1") + _arg(OPCODES[i], b, n) for i, b, n in run)


@FUZZ
@given(opcode_runs, st.sampled_from([b"", PROTO4, b"\x80\x02", b"\x80\x05"]))
def test_fuzz_snapshot_opcode_sequences(run: list[tuple[int, bytes, int]], head: bytes) -> None:
    bounded(load_snapshot_bytes, _assemble(run, head))


@pytest.mark.parametrize("op", OPCODES, ids=[op.name for op in OPCODES])
def test_every_opcode_family_alone_and_in_context(op: pickletools.OpcodeInfo) -> None:
    code = op.code.encode("latin-1")
    for arg in (_arg(op, b"9" * 8, 3), _arg(op, b"", 2**31 - 1), _arg(op, b"\xff" * 8, 0)):
        for prefix in (b"", PROTO4, PROTO4 + b"N(]}", PROTO4 + b"\x8c\x01k\x94N\x94"):
            bounded(load_snapshot_bytes, prefix + code + arg)
            bounded(load_snapshot_bytes, prefix + code + arg + b".")
            bounded(load_snapshot_bytes, prefix + (code + arg) * 2000 + b".")


@pytest.mark.parametrize("name", sorted(hash_bombs(100)))
def test_hash_bombs_within_bounds(name: str) -> None:
    bounded(load_snapshot_bytes, hash_bombs(100)[name])


# ---------------------------------------------------------------- OOM messages

PHRASES = [
    "CUDA out of memory. ",
    "Tried to allocate ",
    " GiB",
    " MiB",
    " bytes",
    ". GPU ",
    " has a total capacity of ",
    " of which ",
    " is free. ",
    "Process ",
    " has ",
    " memory in use. ",
    "Of the allocated memory ",
    " is allocated by PyTorch, and ",
    " is reserved by PyTorch but unallocated.",
    " already allocated; ",
    " reserved in total by PyTorch",
    " total capacity; ",
    " allowed; ",
    " free; ",
    ".",
    ";",
    " ",
]
numbers = st.integers(0, 10**30).map(str) | st.sampled_from(["9" * 100_000, "1." * 5000, "0" * 5000 + "1", "1e308"])
oom_texts = st.lists(st.sampled_from(PHRASES) | numbers | st.text(max_size=10), max_size=30).map("".join)


@FUZZ
@given(oom_texts)
def test_fuzz_oom_messages(text: str) -> None:
    bounded(explain_oom_message, "CUDA out of memory. " + text)


@FUZZ
@given(st.text(max_size=400))
def test_fuzz_oom_any_text(text: str) -> None:
    bounded(explain_oom_message, text)
