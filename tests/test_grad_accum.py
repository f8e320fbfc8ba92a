"""Gradient accumulation: from the second micro-batch on, every gradient is live from the start."""

from __future__ import annotations

import pytest

from planner.api import plan_model, verify_model
from planner.config import TrainConfig
from planner.simulation.step import simulate
from planner.tracing.graph import CATEGORIES
from tests.conftest import cached_trace


@pytest.mark.parametrize("spec", ["gpt2-tiny", "llama-7b-tiny"])
@pytest.mark.parametrize("steps", [2, 4])
def test_accumulated_step_is_measured_as_predicted(spec: str, steps: int):
    result = verify_model(spec, TrainConfig(batch_size=2, seq_len=64, grad_accum_steps=steps))
    assert abs(result.error) < 0.01


def test_accumulation_holds_every_gradient_through_the_forward():
    graph = cached_trace("gpt2-tiny", batch_size=2, seq_len=64)
    one = simulate(graph, TrainConfig(batch_size=2, seq_len=64))
    four = simulate(graph, TrainConfig(batch_size=2, seq_len=64, grad_accum_steps=4))
    gradient = CATEGORIES.index("gradient")
    assert four.peak_bytes > one.peak_bytes
    assert one.by_category[0][gradient] == 0
    assert four.by_category[0][gradient] == one.by_category[-1][gradient]  # all of them, before the first op
    assert four.by_category[-1][gradient] == one.by_category[-1][gradient]  # added in place: no second copy
    assert 3 * one.costs.step_s < four.costs.step_s < 4 * one.costs.step_s  # four micro-batches, one optimizer step


def test_a_plan_under_accumulation_keeps_its_budget():
    config = TrainConfig(batch_size=4, seq_len=64, grad_accum_steps=2)
    plan, _, baseline = plan_model("llama-7b-tiny", config, "80%")
    assert plan.predicted.peak_bytes <= plan.budget_bytes < baseline
    measured = verify_model("llama-7b-tiny", config, plan)
    assert measured.measured_bytes <= plan.budget_bytes * 1.01
