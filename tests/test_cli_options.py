"""Options every subcommand shares: defaults in --help, --budget as a percentage, --blocks and
--moe-imbalance."""

from __future__ import annotations

import json
from pathlib import Path

from planner.api import simulate_model
from planner.config import TrainConfig
from tests.cli_helpers import assert_user_error, run

ATTRIBUTE_LAYERS = "benchmarks.zoo_models:attribute_layers"


def test_help_shows_defaults(capsys):
    code, out, _ = run(["plan", "--help"], capsys)
    assert code == 0
    for text in (
        "--batch-size",
        "(default: 1)",
        "(default: 512, or the model's position limit",
        "(default: cpu)",
        "(default: 0.05)",
    ):
        assert text in out
    assert "percentage of the no-plan" in out


def test_budget_as_a_percentage_of_the_no_plan_peak(tmp_path, capsys):
    out_path = tmp_path / "plan.json"
    code, _, err = run(
        [
            "plan",
            "--model",
            ATTRIBUTE_LAYERS,
            "--batch-size",
            "8",
            "--seq-len",
            "64",
            "--budget",
            "75%",
            "--out",
            str(out_path),
            "--json",
            str(tmp_path / "result.json"),
        ],
        capsys,
    )
    assert code == 0, err
    plan = json.loads(Path(out_path).read_text())
    peak = simulate_model(ATTRIBUTE_LAYERS, TrainConfig(batch_size=8, seq_len=64)).peak_bytes
    assert plan["budget_bytes"] == int(peak * 0.75)
    assert plan["predicted"]["peak_bytes"] <= plan["budget_bytes"]
    result = json.loads((tmp_path / "result.json").read_text())  # the strategy table plan prints
    rows = result["strategies"]["64"]
    assert {r["strategy"] for r in rows} >= {"none", "full"} and rows[0]["peak_bytes"] == peak


def test_blocks_glob_and_bad_trace_options_are_one_line(tmp_path, capsys):
    out_path = tmp_path / "plan.json"
    code, _, err = run(
        [
            "plan",
            "--model",
            ATTRIBUTE_LAYERS,
            "--batch-size",
            "8",
            "--seq-len",
            "64",
            "--blocks",
            "layer0,layer1",
            "--budget",
            "90%",
            "--out",
            str(out_path),
        ],
        capsys,
    )
    assert code == 0, err
    plan = json.loads(Path(out_path).read_text())
    assert plan["config"]["blocks"] == ["layer0", "layer1"]
    assert {d["module"] for d in plan["decisions"]} <= {"layer0", "layer1"}
    code, _, err = run(["simulate", "--model", ATTRIBUTE_LAYERS, "--blocks", "decoder.*"], capsys)
    assert_user_error(code, err, "simulate", "--blocks 'decoder.*' matches no module")
    code, _, err = run(["simulate", "--model", ATTRIBUTE_LAYERS, "--moe-imbalance", "0.5"], capsys)
    assert_user_error(code, err, "simulate", "imbalance")


def test_layouts_memplan_does_not_model_are_refused_in_one_line(capsys):
    base = ["--model", "gpt2-tiny", "--batch-size", "2", "--seq-len", "32"]
    cases = [
        (["plan", *base, "--ep", "2", "--dp", "2", "--out", "unused.json"], "--ep"),
        (["fit", *base, "--tp", "2", "--gpus", "8"], "--gpus"),
        (["simulate", *base, "--pp", "2", "--pp-schedule", "zero-bubble"], "--pp-schedule"),
        (["simulate", *base, "--pp", "2", "--pp-split", "1,2,3"], "--pp-split"),
        (["simulate", *base, "--pp", "2", "--microbatches", "4"], "--microbatches"),
        (["simulate", *base, "--tp", "2", "--dp", "3", "--ep", "2"], "--ep"),
    ]
    for argv, needle in cases:
        code, _, err = run(argv, capsys)
        assert_user_error(code, err, argv[0], needle)


def test_seq_len_defaults_to_the_models_position_limit(tmp_path, capsys):
    out_path = tmp_path / "plan.json"
    code, _, err = run(["plan", "--model", "gpt2-tiny", "--out", str(out_path)], capsys)
    assert code == 0, err
    assert json.loads(out_path.read_text())["config"]["seq_len"] == 128  # its 128 positions, not 512


def test_seq_len_over_the_models_position_limit_is_one_line(capsys):
    code, _, err = run(["simulate", "--model", "gpt2-tiny", "--seq-len", "256"], capsys)
    assert_user_error(code, err, "simulate", "exceeds the model's 128 positions", "--seq-len 128")


def test_simulate_strategy_is_the_plan_of_that_strategy(tmp_path, capsys):
    """simulate --strategy full gives the peak of simulate --plan with plan --strategy full's file."""
    base = ["--model", "gpt2-tiny", "--batch-size", "2", "--seq-len", "32"]
    plan_path, a, b = tmp_path / "full.json", tmp_path / "a.json", tmp_path / "b.json"
    code, _, err = run(["plan", *base, "--strategy", "full", "--budget", "100%", "--out", str(plan_path)], capsys)
    assert code == 0, err
    for argv, out in ((["--plan", str(plan_path)], a), (["--strategy", "full"], b)):
        code, _, err = run(["simulate", *base, *argv, "--json", str(out)], capsys)
        assert code == 0, err
    assert json.loads(a.read_text())["peak_bytes"] == json.loads(b.read_text())["peak_bytes"]
    for argv, needle in (
        (["--strategy", "optimal"], "memplan plan"),
        (["--strategy", "full", "--plan", str(plan_path)], "not both"),
        (["--strategy", "bogus"], "unknown strategy"),
    ):
        code, _, err = run(["simulate", *base, *argv], capsys)
        assert_user_error(code, err, "simulate", needle)
