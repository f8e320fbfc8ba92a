"""planner.safe_io: writes that never tear, replace devices or links; bounded reads and JSON; clean text."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.safe_io import (
    ECHO_MAX_CHARS,
    JSON_MAX_BYTES,
    JSON_MAX_DEPTH,
    clean,
    load_json,
    loads_json,
    read_bounded,
    write_text,
)

# ---------------------------------------------------------------- writes


def test_regular_file_replaced_atomically_keeping_its_mode(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    target.write_text("old")
    os.chmod(target, 0o640)
    assert write_text(target, "new") == target
    assert target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no stray temporary file


def test_new_file_gets_umask_permissions(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        write_text(tmp_path / "a.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644


def test_symlink_is_kept_and_its_target_written(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert write_text(link, "new") == real
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == "new"


def test_dangling_symlink_creates_its_target(tmp_path: Path) -> None:
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "made.json")
    write_text(link, "x")
    assert link.is_symlink() and (tmp_path / "made.json").read_text() == "x"


def test_fifo_is_written_in_place(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    write_text(fifo, "through the pipe")
    reader.join(timeout=10)
    assert got == ["through the pipe"] and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_device_is_written_in_place() -> None:
    before = os.stat("/dev/null")
    write_text("/dev/null", "discarded")
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and (before.st_ino, before.st_rdev) == (after.st_ino, after.st_rdev)


def test_directory_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is a directory") as info:
        write_text(tmp_path, "x")
    assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []  # no DIR.tmp left beside or inside it
    with pytest.raises(ValueError, match="does not exist"):
        write_text(tmp_path / "missing" / "a.json", "x")


def _writer(path: str, tag: int, rounds: int, start: float) -> None:
    while time.time() < start:
        pass
    for r in range(rounds):
        write_text(path, json.dumps({"writer": tag, "round": r, "pad": "x" * 200_000}))


def test_four_concurrent_writers_over_fifty_rounds_never_tear(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    target.write_text("{}")
    start = time.time() + 0.5
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(target), k, 50, start)) for k in range(4)]
    for p in procs:
        p.start()
    reads = 0
    while any(p.is_alive() for p in procs):
        json.loads(target.read_text())  # a torn file would not parse
        reads += 1
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert json.loads(target.read_text())["round"] == 49 and reads > 0
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


# ---------------------------------------------------------------- reads and JSON


def test_read_bounded_ends_on_dev_zero() -> None:
    with pytest.raises(ValueError, match="larger than the 1000-byte limit"):
        read_bounded("/dev/zero", 1000)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[" * 1000 + "]" * 1000, f"nested more than {JSON_MAX_DEPTH} levels"),
        ("[" * 100_000 + "]" * 100_000, f"nested more than {JSON_MAX_DEPTH} levels"),
        ('{"a": 1, "a": 2}', "key 'a' appears twice"),
        ('{"budget_bytes": ' + "9" * 5000 + "}", "5000 digits"),
        ("[1e999]", "out of range"),
        ("[NaN]", "NaN is not valid JSON"),
        ('{"a": ', "not valid JSON"),
        (b"\xff\xfe", "not valid UTF-8"),
        ("[" + "0," * (JSON_MAX_BYTES // 2) + "0]", "larger than"),
    ],
)
def test_bad_json_is_one_line_value_error(text: str | bytes, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as info:
        loads_json(text, "plan file x.json")
    message = str(info.value)
    assert "\n" not in message and len(message) < 300 and "Exceeds the limit" not in message


def test_load_json_round_trip(tmp_path: Path) -> None:
    doc = {"a": [1, 2.5, None, True, {"b": "c"}], "n": -(2**63)}
    (tmp_path / "d.json").write_text(json.dumps(doc))
    assert load_json(tmp_path / "d.json") == doc


# ---------------------------------------------------------------- clean


def test_clean_strips_control_characters_and_caps_length() -> None:
    evil = "name\x1b]0;pwned\x07\r\nfake row\u202e" + "x" * 50_000_000
    out = clean(evil)
    assert len(out) < ECHO_MAX_CHARS + 40 and out.endswith(f"(+{len(evil) - ECHO_MAX_CHARS} chars)")
    assert not any(ord(c) < 32 or 0x7F <= ord(c) <= 0x9F or c == "\u202e" for c in out)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.text())
def test_clean_is_printable_one_line(text: str) -> None:
    out = clean(text, 50)
    assert "\n" not in out and "\r" not in out and "\x1b" not in out and len(out) <= 50 + 30
