"""Regression tests for the budgeted plain-data unpickler (issue 10): hash bombs, opcode floods,
shared references, huge numbers; each ends fast, as a one-line ValueError, in bounded memory."""

from __future__ import annotations

import io
import pickle

import pytest
from hostile import hash_bombs, meter, opcode_flood, shared_frames_snapshot

from planner.analysis.snapshot import load_snapshot_bytes
from planner.analysis.unpickler import (
    KEY_MAX_ELEMENTS,
    PickleBudget,
    PickleBudgetExceeded,
    PlainDataUnpickler,
)

MiB = 2**20


def _load(data: bytes) -> object:
    return PlainDataUnpickler(io.BytesIO(data), PickleBudget.for_input(len(data))).load()


@pytest.mark.parametrize("where", ["set", "frozenset", "setitem", "dict"])
def test_memo_tuple_hash_bomb_is_refused_at_once(where: str) -> None:
    data = hash_bombs(100)[where]
    assert len(data) < 700  # the 649-byte file hashed for over 120 s
    with meter() as m, pytest.raises(ValueError, match="set element or dict key") as info:
        load_snapshot_bytes(data)
    assert m["cpu_s"] < 0.5
    assert "\n" not in str(info.value)


def test_wide_shallow_shared_key_is_refused() -> None:
    # Depth 3 but 64**3 items counted with repeats: hashing would be 262144 steps per use.
    inner = tuple(range(64))
    key = (tuple([inner] * 64),) * 64
    with pytest.raises(PickleBudgetExceeded, match=f"more than {KEY_MAX_ELEMENTS} items"):
        _load(pickle.dumps({key: 1}, protocol=4))


def test_plain_keys_still_load() -> None:
    data = {"a": {1, 2, ("x", 3)}, ("k", (1, 2)): frozenset({"s"}), 5: [1.5, None, True, b"b"]}
    assert _load(pickle.dumps(data, protocol=4)) == data
    text_opcodes = {"n": [1, 2**70, 2.5, "x", None], "t": ("t", 1)}  # protocol 0: INT, LONG, FLOAT, GET, PUT
    assert _load(pickle.dumps([text_opcodes, text_opcodes], protocol=0)) == [text_opcodes, text_opcodes]


@pytest.mark.slow
@pytest.mark.parametrize("opcode", [pickle.EMPTY_SET, pickle.EMPTY_DICT, pickle.MARK, pickle.MEMOIZE])
def test_ten_megabyte_opcode_flood_stays_small(opcode: bytes) -> None:
    data = opcode_flood(opcode, 10 * MiB)
    with meter() as m, pytest.raises(ValueError, match="MiB of memory|pickle data was truncated|EOFError"):
        load_snapshot_bytes(data)
    # Before: ~230 bytes of memory per input byte (over 2 GB). Budget: 64 MiB + 16 bytes per byte.
    assert m["peak_rss_delta_bytes"] < 400 * MiB, m


def test_shared_frames_list_is_counted_per_use() -> None:
    # 20 blocks share one 200k-entry frames list: every further use is charged its length.
    with meter() as m, pytest.raises(ValueError, match="elements"):
        load_snapshot_bytes(shared_frames_snapshot(200_000, 20))
    assert m["cpu_s"] < 2.0


def test_shared_frames_within_budget_are_formatted_once() -> None:
    with meter() as m:
        report = load_snapshot_bytes(shared_frames_snapshot(100_000, 3))
    assert [a.frames for a in report.top_allocations] == [("x.py:1:f",) * 10] * 3
    assert m["cpu_s"] < 5.0  # bounded CPU time: what a blow-up costs, whatever else a busy machine runs


@pytest.mark.parametrize(
    "data, fragment",
    [
        (b"I" + b"9" * 5000 + b"\n.", "5001-character number"),  # Python's int-digit limit is 4300
        (b"L" + b"9" * 5000 + b"L\n.", "character number"),
        (b"F" + b"9" * 400 + b"\n.", "character number"),
        (b"g" + b"9" * 5000 + b"\n.", "character number"),
        (b"\x80\x02\x8a\x20" + b"\xff" * 31 + b"\x7f.", "wider than 128 bits"),
        (b"\x80\x02\x8b" + (4000).to_bytes(4, "little") + b"\x01" * 4000 + b".", "wider than 128 bits"),
    ],
)
def test_huge_numbers_are_one_line_errors(data: bytes, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as info:
        load_snapshot_bytes(data)
    assert "\n" not in str(info.value) and "Exceeds the limit" not in str(info.value)


def test_huge_size_field_is_refused() -> None:
    seg = {"total_size": 10**30, "blocks": []}
    with pytest.raises(ValueError, match=r"below 2\*\*63"):
        load_snapshot_bytes(pickle.dumps({"segments": [seg]}, protocol=4))


def test_budget_scales_with_input_and_is_capped() -> None:
    small, big = PickleBudget.for_input(1000), PickleBudget.for_input(100 * MiB)
    assert small.memory_bytes < big.memory_bytes and small.elements < big.elements
    assert small.time_s < big.time_s
    huge = PickleBudget.for_input(2**40)
    assert huge.memory_bytes == 8 * 2**30 and huge.elements == 500_000_000


def test_time_budget_is_enforced() -> None:
    data = pickle.dumps([[i] for i in range(50_000)], protocol=4)
    with pytest.raises(PickleBudgetExceeded, match="longer than"):
        PlainDataUnpickler(io.BytesIO(data), PickleBudget(2**40, 2**40, 0.0)).load()
