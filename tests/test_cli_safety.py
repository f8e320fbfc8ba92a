"""The CLI under hostile and careless input (issue 10): safe --out/--json/--plot writes, clean and
capped output, Ctrl-C (exit 130, one line, also during imports), quiet broken pipes, small items."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_helpers import assert_user_error, run

from planner.cli.plan import EXAMPLE

MEMPLAN = str(Path(sys.executable).with_name("memplan"))
PLAN = ["plan", "--model", "gpt2-tiny", "--seq-len", "32", "--budget", "1GiB"]


def test_out_through_a_symlink_keeps_the_link(tmp_path: Path, capsys) -> None:
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "plan.json"
    link.symlink_to(real)
    code, out, err = run([*PLAN, "--out", str(link)], capsys)
    assert code == 0, err
    assert link.is_symlink() and json.loads(real.read_text())["kind"] == "plan"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "real.json"]


def test_out_to_a_fifo_writes_into_it(tmp_path: Path, capsys) -> None:
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    code, _, err = run([*PLAN, "--out", str(fifo)], capsys)
    reader.join(timeout=30)
    assert code == 0, err
    assert json.loads(got[0])["kind"] == "plan" and fifo.is_fifo()


def test_out_json_and_plot_to_a_directory_are_refused(tmp_path: Path, capsys) -> None:
    code, out, err = run([*PLAN, "--out", str(tmp_path)], capsys)
    assert_user_error(code, err, "plan", "is a directory")
    code, out, err = run(["simulate", "--model", "gpt2-tiny", "--seq-len", "32", "--plot", str(tmp_path)], capsys)
    assert_user_error(code, err, "simulate", "is a directory")
    assert f"wrote {tmp_path}" not in out
    assert list(tmp_path.iterdir()) == [] and not Path(f"{tmp_path}.tmp").exists()


def test_plot_without_png_suffix_writes_exactly_that_path(tmp_path: Path, capsys) -> None:
    target = tmp_path / "curve"
    code, out, err = run(["simulate", "--model", "gpt2-tiny", "--seq-len", "32", "--plot", str(target)], capsys)
    assert code == 0, err
    assert f"wrote {target}" in out and target.read_bytes().startswith(b"\x89PNG")
    assert [p.name for p in tmp_path.iterdir()] == ["curve"]


def test_seq_len_of_only_commas_is_a_usage_error(capsys) -> None:
    code, _, err = run(["simulate", "--model", "gpt2-tiny", "--seq-len", ","], capsys)
    assert code == 2 and "expected positive integers separated by commas" in err


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("[" * 1000 + "]" * 1000, "nested more than"),
        ('{"kind": "plan", "kind": "ladder"}', "appears twice"),
        ('{"budget_bytes": ' + "9" * 5000 + "}", "5000 digits"),
    ],
)
def test_hostile_plan_files_are_one_line_errors(content: str, fragment: str, tmp_path: Path, capsys) -> None:
    path = tmp_path / "plan.json"
    path.write_text(content)
    code, _, err = run(["simulate", "--model", "gpt2-tiny", "--seq-len", "32", "--plan", str(path)], capsys)
    assert_user_error(code, err, "simulate", fragment)


def test_plan_from_dev_zero_is_bounded(capsys) -> None:
    code, _, err = run(["apply", "--model", "gpt2-tiny", "--seq-len", "32", "--plan", "/dev/zero"], capsys)
    assert_user_error(code, err, "apply", "larger than")


def test_escape_sequences_and_huge_fields_are_not_echoed(tmp_path: Path, capsys) -> None:
    path = tmp_path / "plan.json"
    evil = "\x1b]0;pwned\x07\r\nmemplan: all good\x1b[2J" + "y" * 3_000_000
    path.write_text(json.dumps({"kind": "plan", "schema_version": 1, "strategy": evil}))
    code, _, err = run(["simulate", "--model", "gpt2-tiny", "--seq-len", "32", "--plan", str(path)], capsys)
    assert_user_error(code, err, "simulate")
    assert len(err) < 1200 and "\x1b" not in err and "\r" not in err


def test_snapshot_text_is_cleaned_before_printing(tmp_path: Path, capsys) -> None:
    frames = [{"filename": "evil.py", "line": 1, "name": "f\x1b[31m\nFAKE ROW" + "z" * 10_000}]
    block = {"size": 2**20, "requested_size": 2**20, "state": "active_allocated", "frames": frames}
    seg = {"total_size": 2**20, "segment_type": "large\x1b]0;title\x07", "blocks": [block]}
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": [seg]}))
    code, out, err = run(["diagnose", "--snapshot", str(path)], capsys)
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out and "FAKE ROW" in out
    assert not any(line.startswith("FAKE ROW") for line in out.splitlines())
    assert max(len(line) for line in out.splitlines()) < 1000


def _spawn(*argv: str) -> subprocess.Popen:
    return subprocess.Popen([MEMPLAN, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_ctrl_c_during_imports_or_later_is_one_line_and_130() -> None:
    proc = _spawn("simulate", "--model", "llama-7b", "--seq-len", "4096")
    time.sleep(0.5)  # torch is still importing
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().endswith("interrupted") and len(err.strip().splitlines()) == 1, err


def test_closed_pipe_exits_quietly() -> None:
    proc = subprocess.Popen(
        [MEMPLAN, "diagnose", "--oom-message", "CUDA out of memory. Tried to allocate 2.00 GiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # like `| head` exiting before memplan writes
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert err == ""


def test_infeasible_with_offload_disk_does_not_suggest_it(tmp_path: Path, capsys) -> None:
    code, _, err = run(
        [
            "plan",
            "--model",
            "gpt2-tiny",
            "--seq-len",
            "32",
            "--budget",
            "1KiB",
            "--offload",
            "disk",
            "--out",
            "unused.json",
        ],
        capsys,
    )
    assert_user_error(code, err, "plan", "is infeasible", "already counted")
    assert "(--offload disk)" not in err


def test_help_example_for_offload_disk_is_feasible(tmp_path: Path, capsys) -> None:
    example = next(line.strip() for line in EXAMPLE.splitlines() if "--offload disk" in line)
    argv = example.split()[1:]
    argv[argv.index("--out") + 1] = str(tmp_path / "plan.json")
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert (tmp_path / "plan.json").exists()


@pytest.mark.parametrize(
    "content", [None, "[" * 5000, '{"format": "memplan-device-profile/1", "device": {"fp32_flops": 1e999}}']
)
def test_hostile_device_profiles_are_one_line_errors(content: str | None, tmp_path: Path, capsys) -> None:
    path = "/dev/zero" if content is None else str(tmp_path / "gpu.json")
    if content is not None:
        Path(path).write_text(content)
    code, _, err = run(["simulate", "--model", "gpt2-tiny", "--seq-len", "32", "--gpu", path], capsys)
    assert_user_error(code, err, "simulate", "not a memplan device profile")


@pytest.mark.parametrize(
    "line",
    [
        '{"step": 1, "measured_peak_bytes": [1]}',
        "[" * 5000,
        '{"step": 1, "step": 2, "measured_peak_bytes": 1}',
        '{"step": 1, "measured_peak_bytes": ' + "9" * 5000 + "}",
        "\x1b]0;x\x07",
    ],
)
def test_hostile_monitor_logs_are_one_line_errors(line: str, tmp_path: Path, capsys) -> None:
    path = tmp_path / "mem.jsonl"
    path.write_text(line + "\n")
    code, _, err = run(["watch", str(path)], capsys)
    assert_user_error(code, err, "watch", "not a memplan monitor record")
