"""`memplan plan` and `memplan apply` (and `verify --plan`) through planner.cli.main."""

from __future__ import annotations

import json
from functools import cache

import pytest
from cli_helpers import assert_user_error, run
from models_for_tests import PATH

from planner.api import trace_for
from planner.cli.main import main
from planner.config import TrainConfig
from planner.plans.format import Plan, PlanLadder, load_plan
from planner.simulation.step import simulate
from planner.solver.baselines import strategy_choices
from planner.solver.planning import BASELINES

GPT = f"{PATH}:gpt_small"
LLAMA = f"{PATH}:llama_small"
ARGS = ["--model", GPT, "--batch-size", "2", "--seq-len", "64"]


@cache
def peaks(seq_len: int = 64) -> dict[str, int]:
    config = TrainConfig(batch_size=2, seq_len=seq_len)
    graph = trace_for(GPT, config)
    return {s: simulate(graph, config, choices=strategy_choices(graph, s)).peak_bytes for s in BASELINES}


def mid_budget(seq_len: int = 64) -> int:
    p = peaks(seq_len)
    return (p["none"] + p["full"]) // 2


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    assert main(["plan", *ARGS, "--budget", f"{mid_budget()}B", "--out", str(path)]) == 0
    return path


# ---------------------------------------------------------------- plan


def test_plan_writes_a_loadable_plan_and_prints_the_table(tmp_path, capsys):
    out_path, json_path = tmp_path / "plan.json", tmp_path / "plan-copy.json"
    budget = mid_budget()
    code, out, err = run(
        ["plan", *ARGS, "--budget", f"{budget}B", "--out", str(out_path), "--json", str(json_path)], capsys
    )
    assert code == 0, err
    plan = load_plan(out_path)
    assert isinstance(plan, Plan)
    assert plan.strategy == "optimal" and plan.budget_bytes == budget and plan.decisions
    assert plan.predicted.peak_bytes <= budget < plan.predicted.baseline_peak_bytes
    assert plan.config["seq_len"] == 64 and plan.config["batch_size"] == 2
    report = json.loads(json_path.read_text())
    assert load_plan(report["plan"]) == plan
    assert {r["strategy"] for r in report["strategies"]["64"]} >= set(BASELINES)
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:4] == ["strategy", "peak", "overhead", "fits"])
    table = lines[header + 2 : header + 2 + len(BASELINES) + 1]
    assert [row.split()[0] for row in table] == list(BASELINES) + ["optimal"]
    assert "(chosen)" in table[-1]
    fits = {row.split()[0]: row.split()[-1] for row in table}
    assert fits["none"] == "no" and fits["full"] == "yes"
    assert "no-plan peak" in out and "solver: OPTIMAL" in out
    assert f"wrote {out_path}" in out


def test_plan_baseline_strategy(tmp_path, capsys):
    out_path = tmp_path / "plan.json"
    code, out, err = run(["plan", *ARGS, "--budget", "1GiB", "--strategy", "every-2", "--out", str(out_path)], capsys)
    assert code == 0, err
    plan = load_plan(out_path)
    assert plan.strategy == "every-2" and plan.recompute_modules() == ("h.0", "h.2")
    assert plan.solver.status == "NOT_SOLVED"


def test_plan_offload_disk_keep_and_recompute(tmp_path, capsys):
    out_path = tmp_path / "plan.json"
    code, out, err = run(
        [
            "plan",
            *ARGS,
            "--budget",
            f"{mid_budget()}B",
            "--offload",
            "disk",
            "--keep",
            "h.0",
            "--recompute",
            "h.3",
            "--time-limit",
            "5",
            "--out",
            str(out_path),
        ],
        capsys,
    )
    assert code == 0, err
    plan = load_plan(out_path)
    assert not any(d.module == "h.0" or d.module.startswith("h.0.") for d in plan.decisions)
    assert any(m == "h.3" or m.startswith("h.3.") for m in plan.recompute_modules())


def test_plan_infeasible_budget(tmp_path, capsys):
    out_path = tmp_path / "plan.json"
    budget = peaks()["full"] * 9 // 10
    code, out, err = run(["plan", *ARGS, "--budget", f"{budget}B", "--out", str(out_path)], capsys)
    assert_user_error(code, err, "plan", "smallest peak", "is infeasible")
    assert not out_path.exists()


def test_plan_infeasible_baseline_strategy(tmp_path, capsys):
    code, out, err = run(
        ["plan", *ARGS, "--budget", f"{mid_budget()}B", "--strategy", "none", "--out", str(tmp_path / "p.json")], capsys
    )
    assert_user_error(code, err, "plan", "strategy 'none' peaks at", "--strategy optimal")


@pytest.mark.parametrize("strategy", ["fastest", "every-0", "every-x"])
def test_plan_unknown_strategy(strategy, tmp_path, capsys):
    code, out, err = run(
        ["plan", *ARGS, "--budget", "1GiB", "--strategy", strategy, "--out", str(tmp_path / "p.json")], capsys
    )
    needles = ["every-2"]
    if strategy == "fastest":
        needles = ["optimal, none, full, every-N", "sqrt, op-sac, op-sac-alt, megatron-selective"]
    assert_user_error(code, err, "plan", *needles)


@pytest.mark.parametrize("budget", ["forty", "40 parsecs", "-3GiB", "0B"])
def test_plan_unparsable_budget(budget, tmp_path, capsys):
    code, out, err = run(["plan", *ARGS, f"--budget={budget}", "--out", str(tmp_path / "p.json")], capsys)
    if budget in ("-3GiB", "0B") and "positive" in err:
        assert_user_error(code, err, "plan", "positive")
    else:
        assert_user_error(code, err, "plan", f"'{budget}'", "KiB", "MiB", "GiB")


def test_plan_keep_glob_matching_nothing(tmp_path, capsys):
    code, out, err = run(
        ["plan", *ARGS, "--budget", "1GiB", "--keep", "layers.*", "--out", str(tmp_path / "p.json")], capsys
    )
    assert_user_error(code, err, "plan", "--keep 'layers.*' matches no checkpointable module", "h.0, h.1, h.2, h.3")


def test_plan_unknown_offload_target(tmp_path, capsys):
    code, out, err = run(
        ["plan", *ARGS, "--budget", "1GiB", "--offload", "tape", "--out", str(tmp_path / "p.json")], capsys
    )
    assert_user_error(code, err, "plan", "none, cpu, disk")


def test_plan_ladder(tmp_path, capsys):
    out_path = tmp_path / "ladder.json"
    budget = max(mid_budget(32), mid_budget(64))
    code, out, err = run(
        [
            "plan",
            "--model",
            GPT,
            "--batch-size",
            "2",
            "--seq-len",
            "32,64",
            "--budget",
            f"{budget}B",
            "--out",
            str(out_path),
        ],
        capsys,
    )
    assert code == 0, err
    ladder = load_plan(out_path)
    assert isinstance(ladder, PlanLadder)
    assert [s for s, _ in ladder.buckets] == [32, 64]
    for s, p in ladder.buckets:
        assert p.config["seq_len"] == s and p.predicted.peak_bytes <= budget
    assert out.count("(chosen)") == 2


# ---------------------------------------------------------------- apply / verify --plan


def test_apply_matching_plan(plan_file, capsys):
    code, out, err = run(["apply", *ARGS, "--plan", str(plan_file)], capsys)
    assert code == 0, err
    assert "plan matches" in out and "apply_plan" in out


def test_apply_plan_for_a_different_model(plan_file, capsys):
    code, out, err = run(
        ["apply", "--model", LLAMA, "--batch-size", "2", "--seq-len", "64", "--plan", str(plan_file)], capsys
    )
    assert_user_error(code, err, "apply", "different model")


def test_verify_with_plan(plan_file, capsys):
    code, out, err = run(["verify", *ARGS, "--plan", str(plan_file)], capsys)
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.split()[:1] == ["64"])
    error = float(row.split()[-1].rstrip("%"))
    assert abs(error) <= 3.0


def _bad_plans(plan_file, tmp_path):
    text = plan_file.read_text()
    d = json.loads(text)
    wrong_version = dict(d, schema_version=99)
    no_decisions = {k: v for k, v in d.items() if k != "decisions"}
    return {
        "not-json": "this is not json",
        "truncated": text[: len(text) // 2],
        "empty": "",
        "wrong-version": json.dumps(wrong_version),
        "missing-field": json.dumps(no_decisions),
        "list": "[1, 2, 3]",
    }


@pytest.mark.parametrize("kind", ["not-json", "truncated", "empty", "wrong-version", "missing-field", "list"])
def test_verify_with_a_malformed_plan(kind, plan_file, tmp_path, capsys):
    bad = tmp_path / f"{kind}.json"
    bad.write_text(_bad_plans(plan_file, tmp_path)[kind])
    code, out, err = run(["verify", *ARGS, "--plan", str(bad)], capsys)
    assert_user_error(code, err, "verify", str(bad))


def test_verify_with_a_missing_plan(tmp_path, capsys):
    code, out, err = run(["verify", *ARGS, "--plan", str(tmp_path / "nope.json")], capsys)
    assert_user_error(code, err, "verify", "not found")


def test_apply_with_a_wrong_version_plan(plan_file, tmp_path, capsys):
    bad = tmp_path / "v2.json"
    bad.write_text(json.dumps(dict(json.loads(plan_file.read_text()), schema_version=2)))
    code, out, err = run(["apply", *ARGS, "--plan", str(bad)], capsys)
    assert_user_error(code, err, "apply", "schema_version")


def test_non_positive_time_limit_is_a_one_line_error(tmp_path, capsys):
    code, _, err = run(
        ["plan", *ARGS, "--budget", "1GiB", "--time-limit", "-1", "--out", str(tmp_path / "p.json")], capsys
    )
    assert_user_error(code, err, "plan", "--time-limit")


def test_unwritable_output_is_a_one_line_error(tmp_path, capsys):
    out = tmp_path / "missing-dir" / "p.json"
    code, _, err = run(["plan", *ARGS, "--budget", "1GiB", "--out", str(out)], capsys)
    assert_user_error(code, err, "plan", "missing-dir")
