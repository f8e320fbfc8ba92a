"""Tests for planner.analysis.fit: smallest GPU count (ZeRO-3 dp) and the largest fitting batch/sequence."""

from __future__ import annotations

import pytest

from costmodels.hardware import get_device
from planner.analysis.fit import FitResult, fit, largest_fitting
from planner.api import trace_for
from planner.config import DEFAULT_RESERVE, TrainConfig
from planner.errors import InfeasibleBudget
from planner.simulation.step import simulate
from planner.solver.planning import solve

CONFIG = TrainConfig(batch_size=1, seq_len=4096, precision="bf16-mixed", gpu="a100-40gb")
BUDGET = int(get_device("a100-40gb").memory_bytes * (1 - DEFAULT_RESERVE))


@pytest.fixture(scope="module")
def llama7b() -> tuple[FitResult, object]:
    result = fit("llama-7b", CONFIG, max_gpus=64, time_limit_s=5.0)
    return result, trace_for("llama-7b", CONFIG.with_(zero_stage=3))


@pytest.mark.slow
def test_plan_needs_no_more_gpus_than_no_plan(llama7b) -> None:
    result, _ = llama7b
    d = result.to_dict()
    assert isinstance(d["min_gpus_without_plan"], int) and isinstance(d["min_gpus_with_plan"], int)
    assert 1 <= d["min_gpus_with_plan"] <= d["min_gpus_without_plan"]
    assert d["without_plan"]["peak_bytes"] <= BUDGET and d["with_plan"]["peak_bytes"] <= BUDGET
    assert d["with_plan"]["overhead"] >= 0
    assert set(d["with_plan"]["model_states"]) == {"parameter", "gradient", "optimizer"}
    assert d["config"]["zero_stage"] == 3


@pytest.mark.slow
def test_reported_counts_are_the_smallest(llama7b) -> None:
    result, graph = llama7b

    def config(dp: int) -> TrainConfig:
        return CONFIG.with_(zero_stage=3, dp=dp)

    n = result.min_gpus_without_plan
    assert simulate(graph, config(n)).peak_bytes <= BUDGET
    if n > 1:
        assert simulate(graph, config(n - 1)).peak_bytes > BUDGET
    m = result.min_gpus_with_plan
    assert solve(graph, config(m), BUDGET, time_limit_s=5.0).predicted.peak_bytes <= BUDGET
    if m > 1:
        with pytest.raises(InfeasibleBudget):
            solve(graph, config(m - 1), BUDGET, time_limit_s=5.0)


def test_nothing_fits_gives_none() -> None:
    # gpt2 at batch 64 x 1024 on one L40S: activations alone exceed the device at any dp.
    r = fit("gpt2", TrainConfig(batch_size=64, seq_len=1024, gpu="l40s"), max_gpus=4, time_limit_s=5.0)
    assert r.min_gpus_without_plan is None and r.without_plan is None
    assert r.to_dict()["min_gpus_without_plan"] is None


def test_small_model_fits_on_one_gpu() -> None:
    r = fit("gpt2-tiny", TrainConfig(seq_len=64, gpu="h100-80gb"))
    assert (r.min_gpus_without_plan, r.min_gpus_with_plan) == (1, 1)


@pytest.mark.slow
def test_largest_fitting_batch_and_sequence() -> None:
    r = largest_fitting("gpt2", TrainConfig(batch_size=1, seq_len=1024, gpu="l40s"), 2, time_limit_s=5.0)
    batch = r["largest_batch_size"]
    assert batch["without_plan"] is not None and batch["with_plan"] >= batch["without_plan"]
    budget = r["budget_bytes"]
    assert batch["without_plan_peak_bytes"] <= budget and batch["with_plan_peak_bytes"] <= budget
    config = TrainConfig(batch_size=batch["without_plan"] * 2, seq_len=1024, gpu="l40s", zero_stage=3, dp=2)
    assert simulate(trace_for("gpt2", config), config).peak_bytes > budget
    seq = r["largest_seq_len"]
    assert seq["without_plan"] == 1024 and "1024" in seq["limited_by"]  # gpt2 has 1024 positions


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max gpus"):
        fit("gpt2-tiny", TrainConfig(seq_len=64), max_gpus=0)
    with pytest.raises(ValueError, match="gpus"):
        largest_fitting("gpt2-tiny", TrainConfig(seq_len=64), 0)


def test_nothing_fits_says_what_binds() -> None:
    # activations alone exceed an L40S: the advice says so instead of "raise --max-gpus"
    r = fit("gpt2", TrainConfig(batch_size=64, seq_len=1024, gpu="l40s"), max_gpus=4, time_limit_s=5.0)
    assert r.min_gpus_without_plan is None
    assert "activations and temporaries" in r.why_not_without_plan
    assert "no GPU count fits" in r.why_not_without_plan and "--max-gpus" not in r.why_not_without_plan
    assert r.to_dict()["why_not_without_plan"] == r.why_not_without_plan
    if r.min_gpus_with_plan is None:
        assert "even recomputing every block" in r.why_not_with_plan


@pytest.mark.slow
def test_model_states_that_need_more_gpus_say_raise_max_gpus() -> None:
    r = fit("llama-7b", TrainConfig(batch_size=1, seq_len=64, gpu="l40s"), max_gpus=1, time_limit_s=5.0)
    assert r.min_gpus_without_plan is None and r.min_gpus_with_plan is None
    assert "model states alone" in r.why_not_without_plan and "raise --max-gpus" in r.why_not_without_plan
    assert "model states alone" in r.why_not_with_plan
