"""`memplan watch`: a monitor log as a table, a summary, a JSON file and a plot."""

from __future__ import annotations

import json

from cli_helpers import assert_user_error, run


def _record(step: int, measured: int, predicted: int, switches=()) -> dict:
    return {
        "step": step,
        "seq_len": 64 * (step + 1),
        "measured_peak_bytes": measured,
        "predicted_peak_bytes": predicted,
        "drift": (measured - predicted) / predicted,
        "budget_bytes": 3000,
        "target_bytes": 2850,
        "plan": {"recompute": step},
        "step_s": 0.5,
        "device": "cpu",
        "empty_cache": False,
        "switches": list(switches),
    }


def test_table_summary_json_and_plot(tmp_path, capsys):
    log = tmp_path / "mem.jsonl"
    records = [
        _record(0, 1000, 1000),
        _record(1, 2500, 2400, [{"reason": "sequence length 128: plan for 128"}]),
        _record(2, 3100, 2800, [{"reason": "measured 3.03 KiB within 5% of the budget: tighten"}]),
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    out_json, png = tmp_path / "summary.json", tmp_path / "mem.png"
    code, out, err = run(["watch", str(log), "--json", str(out_json), "--plot", str(png)], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["step", "seq", "measured", "predicted", "drift"]
    assert "+4.2%" in out and "tighten" in out and "2.44 KiB" in out
    assert "3 steps" in out and "2 plan switches" in out and "over budget at steps [2]" in out
    summary = json.loads(out_json.read_text())
    assert summary["steps_over_budget"] == [2] and summary["max_measured_peak_bytes"] == 3100
    assert [s["step"] for s in summary["switches"]] == [1, 2] and summary["total_step_s"] == 1.5
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_logs_are_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0}\n')
    code, _, err = run(["watch", str(bad)], capsys)
    assert_user_error(code, err, "watch", "line 1", "MemoryMonitor")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, _, err = run(["watch", str(empty)], capsys)
    assert_user_error(code, err, "watch", "no steps")
    code, _, err = run(["watch", str(tmp_path / "missing.jsonl")], capsys)
    assert code == 2 and "missing.jsonl" in err


def test_failed_retargets_are_not_plan_switches(tmp_path, capsys):
    log = tmp_path / "mem.jsonl"
    failed = {"reason": "measured 3.03 KiB, 1.0% over the budget 3 KiB: tighten", "target_bytes": 2850, "failed": "x"}
    records = [
        _record(0, 1000, 1000, [{"reason": "keep 5% of the budget free", "target_bytes": 2850}]),
        _record(1, 3100, 2800, [failed]),
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    out_json = tmp_path / "summary.json"
    code, out, err = run(["watch", str(log), "--json", str(out_json)], capsys)
    assert code == 0, err
    assert "1 plan switches, 1 failed retargets" in out and "(failed: no plan)" in out
    summary = json.loads(out_json.read_text())
    assert [s["step"] for s in summary["switches"]] == [0] and [s["step"] for s in summary["failed_retargets"]] == [1]
