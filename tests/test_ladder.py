"""A plan ladder on a real model: mixed-length batches stay under one budget, short ones recompute less."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from planner.api import plan_model, trace_for
from planner.config import TrainConfig
from planner.plans.format import PlanLadder
from planner.runtime.apply import apply_plan
from planner.runtime.verify import measure_step
from planner.simulation.step import simulate
from planner.tracing.specs import resolve_spec

SPEC = "llama-7b-tiny"
BATCH = 2
LENGTHS = (32, 64, 128)


class _OpCounter(TorchDispatchMode):
    """Counts aten ops that run (a recompute runs forward ops again)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _config(seq: int) -> TrainConfig:
    return TrainConfig(batch_size=BATCH, seq_len=seq)


@pytest.fixture(scope="module")
def ladder_setup():
    peaks = {s: simulate(trace_for(SPEC, _config(s)), _config(s)).peak_bytes for s in LENGTHS}
    # Between the two short buckets' no-plan peaks and the longest's: only the longest must recompute.
    budget = (peaks[64] + peaks[128]) // 2
    assert peaks[32] < peaks[64] <= budget < peaks[128]
    plans = {s: plan_model(SPEC, _config(s), budget, time_limit_s=5.0)[0] for s in LENGTHS}
    return budget, peaks, plans


def _inputs(seq: int):
    torch.manual_seed(1)
    return resolve_spec(SPEC).build(batch_size=BATCH, seq_len=seq)[1]


def _model():
    torch.manual_seed(0)
    return resolve_spec(SPEC).build(batch_size=BATCH, seq_len=max(LENGTHS))[0]


def _ops_with(plan, seq: int) -> Counter:
    """Aten op counts of training steps (warm-up and measured) of a fresh model under a plan."""
    model = _model()
    counter = _OpCounter()
    with apply_plan(model, plan), counter:
        measure_step(model, _inputs(seq), _config(seq))
    return counter.counts


def test_buckets_are_planned_as_intended(ladder_setup) -> None:
    budget, _, plans = ladder_setup
    assert plans[32].predicted.recompute_flops == 0
    assert plans[128].predicted.recompute_flops > 0
    assert all(p.predicted.peak_bytes <= budget for p in plans.values())


@pytest.mark.slow
def test_ladder_keeps_every_length_under_the_budget(ladder_setup) -> None:
    budget, peaks, plans = ladder_setup
    ladder = PlanLadder(buckets=tuple((s, plans[s]) for s in LENGTHS))
    model = _model()
    with apply_plan(model, ladder) as handle:
        for seq in (128, 32, 64, 128, 32):  # mixed lengths through one model
            measured = measure_step(model, _inputs(seq), _config(seq)).peak_bytes
            assert handle.active_bucket == seq
            assert measured <= budget, f"seq {seq}: measured {measured} B over budget {budget} B"
    plain = measure_step(_model(), _inputs(128), _config(128)).peak_bytes
    assert plain > budget  # the longest length really needs the plan


@pytest.mark.slow
def test_short_batches_recompute_less_than_the_longest_plan(ladder_setup) -> None:
    _, _, plans = ladder_setup
    ladder = PlanLadder(buckets=tuple((s, plans[s]) for s in LENGTHS))
    for seq in (32, 64):
        graph = trace_for(SPEC, _config(seq))
        chosen = ladder.plan_for(seq)[0]
        ladder_flops = simulate(graph, _config(seq), plan=chosen).costs.recompute_flops
        single_flops = simulate(graph, _config(seq), plan=plans[128]).costs.recompute_flops
        assert ladder_flops < single_flops, seq
    # The real step runs fewer ops under the ladder than under the single longest-bucket plan.
    ladder_ops = _ops_with(ladder, 32)
    single_ops = _ops_with(plans[128], 32)
    assert sum(ladder_ops.values()) < sum(single_ops.values())
    assert ladder_ops["aten.mm.default"] < single_ops["aten.mm.default"]
