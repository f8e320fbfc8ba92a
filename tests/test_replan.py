"""Re-planning for a new budget (planner.solver.cpsat.replan_choices, AutoHandle.set_budget): exact
peaks, time close to CP-SAT's, milliseconds on deep models; OOM reports priced against the device."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from models_for_tests import llama_small

from planner.analysis.oom_message import explain_oom_message
from planner.config import TrainConfig
from planner.errors import InfeasibleBudget
from planner.runtime.auto import auto_checkpoint
from planner.runtime.oom_report import OomContext, build_oom_report
from planner.simulation.step import simulate
from planner.solver.cpsat import replan_choices, solve_choices
from planner.tracing.models import Llama, LlamaConfig
from tests.conftest import cached_trace

MiB = 2**20


@pytest.mark.parametrize("spec", ["gpt2-tiny", "llama-7b-tiny"])
def test_replan_peaks_exactly_as_simulated_and_costs_about_what_cpsat_does(spec):
    graph = cached_trace(spec, batch_size=2, seq_len=64)
    config = TrainConfig(batch_size=2, seq_len=64)
    base = simulate(graph, config)
    states = sum(base.model_states.values())
    previous = ()
    solved = 0
    for point in (0.9, 0.6, 0.3, 0.75, 0.5):
        budget = int(states + point * (base.peak_bytes - states))
        found = replan_choices(graph, config, budget, previous)
        try:
            best = solve_choices(graph, config, budget, time_limit_s=5.0)
        except InfeasibleBudget:
            assert found is None
            continue
        assert found is not None
        timeline = simulate(graph, config, choices=found.choices)
        assert timeline.peak_bytes == found.peak_bytes <= budget
        assert found.recompute_s == pytest.approx(timeline.costs.recompute_s, rel=1e-9)
        assert found.added_s <= 1.1 * best.objective_s + 1e-12, (point, found.added_s, best.objective_s)
        previous, solved = found.choices, solved + 1
    assert solved >= 2
    assert replan_choices(graph, config, states) is None  # model states alone exceed it


@pytest.mark.slow
def test_set_budget_on_32_blocks_takes_well_under_a_step():
    torch.manual_seed(0)
    model = Llama(LlamaConfig(64, 64, 128, 32, 4, 2))
    ids = torch.randint(0, 64, (2, 64))
    handle = auto_checkpoint(model, (ids, ids), "100%")
    states, base = handle.model_states_bytes, handle.baseline_peak_bytes
    cpu_seconds = []
    for point in (0.4, 0.7, 0.5, 0.8, 0.6):
        t0 = time.process_time()  # CPU time (all threads): a busy shared machine stretches wall time
        plan = handle.set_budget(int(states + point * (base - states)))
        cpu_seconds.append(time.process_time() - t0)
        timeline = simulate(handle.graph_at(64), handle.config, plan=plan)
        assert plan.predicted.peak_bytes == timeline.peak_bytes <= plan.budget_bytes
        assert plan.predicted.step_s == pytest.approx(timeline.costs.step_s, rel=1e-9)
    assert statistics.median(cpu_seconds) < 0.2, cpu_seconds
    handle.remove()


@pytest.mark.slow
def test_oom_remedies_are_priced_against_the_capacity_in_the_error():
    torch.manual_seed(0)
    model, inputs = llama_small(2, 64)
    handle = auto_checkpoint(model, inputs, "100%")
    handle.set_budget(int(handle.model_states_bytes + 0.7 * (handle.baseline_peak_bytes - handle.model_states_bytes)))
    capacity = handle.predicted_peak_bytes  # the device has exactly what the plan predicts
    message = (
        f"CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of {capacity / MiB:.2f} MiB "
        "of which 1.00 MiB is free. Of the allocated memory 5.00 MiB is allocated by PyTorch, and 0.10 MiB "
        "is reserved by PyTorch but unallocated."
    )
    ctx = OomContext(step=3, steps_done=3, handle=handle, model=model, device=torch.device("cpu"))
    report = build_oom_report(torch.OutOfMemoryError(message), ctx, time_limit_s=2.0)
    names = [r.name for r in report.remedies]
    assert "checkpoint plan" not in names and "tighter plan" in names  # a plan is in force
    device_bytes = explain_oom_message(message).total_bytes  # what the error says the device has
    assert abs(device_bytes - capacity) < MiB and report.capacity_bytes == device_bytes != handle.budget_bytes
    for r in report.remedies:
        assert r.fits == (r.peak_bytes <= device_bytes), r
    tighter = next(r for r in report.remedies if r.name == "tighter plan")
    assert tighter.peak_bytes < handle.predicted_peak_bytes and "set_budget" in tighter.description
    eight_bit = next(r for r in report.remedies if r.name == "8-bit optimizer")
    assert eight_bit.peak_bytes < handle.predicted_peak_bytes  # priced with the plan in force, not from no plan
    handle.remove()
