"""Recompute in pipeline bubbles: the step-time model (a B starts its recompute when its rank is free),
memplan's own checkpoint that can recompute ahead of its backward, and stage plans that say so."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from planner.config import TrainConfig
from planner.errors import MemplanError, PlanFileError
from planner.plans.format import load_plan
from planner.runtime.early_recompute import EarlyCheckpoint, EarlyQueue
from planner.simulation.pipeline_schedule import pipeline_schedule
from planner.simulation.pipeline_time import pipeline_time


def _times(pp: int, f: float, b: float) -> dict:
    return {"F": (f,) * pp, "B": (b,) * pp, "I": (b,) * pp, "W": (0.0,) * pp}


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(["gpipe", "1f1b"]),
    st.integers(2, 4),
    st.integers(1, 3),
    st.floats(0.1, 2.0),
    st.floats(0.0, 3.0),
)
def test_early_recompute_hides_at_most_the_waits_and_never_lengthens_the_step(schedule, pp, per_stage, f, r):
    s = pipeline_schedule(
        TrainConfig(pp=pp, pp_schedule=schedule, microbatches=pp * per_stage, batch_size=pp * per_stage)
    )
    times = _times(pp, f, 2 * f + r)
    late = pipeline_time(s, times)
    early = pipeline_time(s, times, tuple([r] * (pp - 1) + [0.0]))
    assert early.step_s <= late.step_s + 1e-9
    assert early.busy_s == late.busy_s  # the same work, started sooner
    for rank in range(pp):
        waits = sum(min(r, w) for (stage, kind, _), w in early.waits_s.items() if stage == rank and kind == "B")
        assert early.hidden_recompute_s[rank] <= waits + 1e-9
    assert late.step_s - early.step_s <= sum(early.hidden_recompute_s) + 1e-9
    assert early.hidden_recompute_s[-1] == 0.0  # the last stage waits on no gradient


def test_first_stage_hides_its_recompute_in_the_gpipe_drain():
    pp, m = 2, 2
    s = pipeline_schedule(TrainConfig(pp=pp, pp_schedule="gpipe", microbatches=m, batch_size=2))
    t = pipeline_time(s, _times(pp, 1.0, 3.0), (1.0, 0.0))
    assert t.hidden_recompute_s[0] == pytest.approx(2.0)  # B0 waits 4 s, B1 3 s: 1 s hidden in each
    assert t.step_s == pytest.approx(pipeline_time(s, _times(pp, 1.0, 3.0)).step_s - 1.0)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 16))


@pytest.mark.parametrize("ahead", [True, False])
def test_early_checkpoint_gives_the_gradients_of_no_checkpoint(ahead):
    model, x = _model(), torch.randn(4, 16, requires_grad=True)
    reference = copy.deepcopy(model)
    xr = x.detach().clone().requires_grad_()
    torch.manual_seed(1)
    reference(xr).pow(2).sum().backward()
    torch.manual_seed(1)
    call = EarlyCheckpoint(model, model.forward, (x,), {})
    loss = call.forward((x,), {}).pow(2).sum()
    assert not call.recomputed
    torch.manual_seed(7)  # the random state moves on before the recompute: dropout's mask must not
    if ahead:
        call.recompute()
        assert call.recomputed
    loss.backward()
    for a, b in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    torch.testing.assert_close(xr.grad, x.grad)
    assert call._saved is not None and all(t is None for t in call._saved)  # each dropped once read


@pytest.mark.parametrize("read_once", [True, False])
def test_a_checkpoint_and_what_it_recomputed_die_with_its_graph(read_once):
    """What a recompute made is kept detached (as torch's checkpoint keeps it): its own graph, whose
    nodes hold the recompute's hook, must not keep the checkpoint alive. Before, a recompute whose
    tensors were held (read_once=False, a split backward) or never all read outlived its step."""
    import gc
    import weakref

    model, x = _model().eval(), torch.randn(4, 16, requires_grad=True)
    call = EarlyCheckpoint(model, model.forward, (x,), {}, read_once=read_once)
    out = call.forward((x,), {})
    call.recompute()
    ref = weakref.ref(call)
    del call
    gc.collect()
    assert ref() is not None  # the graph still needs it
    del out
    gc.collect()
    assert ref() is None


def test_early_queue_recomputes_the_oldest_forward_still_waiting():
    model = _model().eval()
    x = torch.randn(4, 16, requires_grad=True)
    queue, calls, losses = EarlyQueue(), [], []
    for _ in range(3):
        call = EarlyCheckpoint(model, model.forward, (x,), {})
        queue.add("block", call)
        calls.append(call)
        losses.append(call.forward((x,), {}).sum())
    losses[0].backward()  # recomputed in its backward: passed over
    assert queue.recompute_oldest() == 1 and calls[1].recomputed and not calls[2].recomputed
    assert queue.recompute_oldest() == 1 and calls[2].recomputed
    assert queue.recompute_oldest() == 0


def test_a_module_that_saves_differently_the_second_time_is_refused():
    calls = []

    def fn(x):
        calls.append(1)
        return x.exp() if len(calls) == 1 else x * 2

    x = torch.randn(3, requires_grad=True)
    call = EarlyCheckpoint(nn.Identity(), fn, (x,), {})
    y = call.forward((x,), {})
    with pytest.raises(MemplanError, match="keep it"):
        call.recompute()
    del y


def test_stage_plans_name_only_whole_recomputes_early(tmp_path):
    import pp_ranks as P

    from planner.simulation.pipeline import simulate_pipeline
    from planner.solver.pipeline_plans import solve_pipeline, stage_plans
    from planner.tracing.recorder import trace

    graph = trace(f"{P.PATH}:titan_llama", batch_size=1, seq_len=128)
    cfg = TrainConfig(batch_size=4, seq_len=128, pp=2, pp_schedule="1f1b", microbatches=4)
    budget = int(simulate_pipeline(graph, cfg).layout.peak_bytes * 0.83)
    aware, full = solve_pipeline(graph, cfg, budget), solve_pipeline(graph, cfg, budget, bubble_aware=False)
    assert aware.step_s_with <= full.step_s_with + 1e-12  # same budget, no slower step
    plans = stage_plans(graph, cfg, aware)
    assert plans.stages[0].early_recompute == ("layers.1",)  # stage 0's last block, first in its backward
    assert plans.stages[1].early_recompute == ()  # the last stage has no gradient to wait for
    assert plans.stages[0].plan.predicted.hidden_recompute_s > 0
    assert load_plan(plans.to_dict()) == plans
    bad = plans.to_dict()
    bad["stages"][0]["early_recompute"] = ["layers.0.attention"]
    with pytest.raises(PlanFileError, match="does not recompute it whole"):
        load_plan(bad)


def test_uniform_checkpointing_recomputes_in_backward_where_the_recipe_runs_it_so():
    """torchtitan's full checkpointing (a layout search's uniform level, as its recipe launches it)
    recomputes in backward: nothing hidden, a step no shorter; memplan's runtime hides some."""
    import pp_ranks as P

    from planner.analysis.layouts import strategy_choices
    from planner.simulation.pipeline import simulate_pipeline
    from planner.tracing.recorder import trace

    graph = trace(f"{P.PATH}:titan_llama", batch_size=1, seq_len=128)
    cfg = TrainConfig(batch_size=4, seq_len=128, pp=2, pp_schedule="1f1b", microbatches=4)
    full = tuple(strategy_choices(graph, "full"))
    early, late = simulate_pipeline(graph, cfg, full), simulate_pipeline(graph, cfg, full, memplan_runtime=False)
    assert early.time.hidden_recompute_s[0] > 0 and not any(late.time.hidden_recompute_s)
    assert late.time.step_s > early.time.step_s and late.peak_bytes == early.peak_bytes


def test_the_multi_stage_runtime_recomputes_a_stage_before_the_wait_for_its_gradient():
    """torch's multi-stage runtime (interleaved 1F1B, looped BFS) takes a backward's posted receive
    out of `bwd_recv_ops` right before waiting on it: that stage's early queue, and only that
    stage's, recomputes its oldest forward there; the schedule is left as it was."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules

    from planner.runtime.early_recompute import recompute_in_bubbles

    modules = [_model().eval(), _model().eval()]
    x = torch.randn(4, 16, requires_grad=True)
    handles, calls = [], []
    for m in modules:
        queue, call = EarlyQueue(), EarlyCheckpoint(m, m.forward, (x,), {})
        queue.add("block", call)
        call.forward((x,), {})
        handles.append(SimpleNamespace(model=m, early_queue=queue))
        calls.append(call)
    schedule = object.__new__(schedules.ScheduleInterleaved1F1B)  # the runtime's loop is not run here
    schedule._stages = [SimpleNamespace(stage_index=i, submod=m) for i, m in zip((0, 2), modules)]
    schedule.bwd_recv_ops = {(2, 0): [], (0, 0): []}
    wait = schedules._wait_batch_p2p
    with recompute_in_bubbles(schedule, handles):
        schedules._wait_batch_p2p(schedule.bwd_recv_ops.pop((2, 0)))
        assert calls[1].recomputed and not calls[0].recomputed
        schedules._wait_batch_p2p([])  # another wait (a send's): nothing armed
        assert not calls[0].recomputed
    assert schedules._wait_batch_p2p is wait and type(schedule.bwd_recv_ops) is dict
    assert schedule.bwd_recv_ops == {(0, 0): []}


@pytest.mark.parametrize(
    ("schedule", "early_stages"),
    [
        ("interleaved-1f1b", [0, 2]),  # stage s on rank s % 2: every stage but the last waits for a gradient
        ("looped-bfs", [1, 2]),  # stages 0, 1 on rank 0: stage 0 takes stage 1's gradient with no wait
        ("interleaved-zero-bubble", [1, 2]),  # split backward: stages past the first wait before I
    ],
)
def test_multi_stage_plans_recompute_early_where_a_stage_waits_for_its_gradient(schedule, early_stages):
    """Which stages' plans run a block early under the multi-stage schedules (its first-backward
    block where the planner recomputes it), and each stage's hidden seconds add up to its rank's."""
    import pp_ranks as P

    from planner.simulation.pipeline import simulate_pipeline
    from planner.solver.pipeline_plans import solve_pipeline, stage_plans
    from planner.tracing.recorder import trace

    graph = trace(f"{P.PATH}:titan_llama", batch_size=1, seq_len=128)
    cfg = TrainConfig(batch_size=4, seq_len=128, pp=2, pp_schedule=schedule, microbatches=4, stages_per_rank=2)
    fraction = 0.88 if schedule == "interleaved-zero-bubble" else 0.85
    plan = solve_pipeline(graph, cfg, int(simulate_pipeline(graph, cfg).layout.peak_bytes * fraction))
    plans = stage_plans(graph, cfg, plan)
    early = [s.stage for s in plans.stages if s.early_recompute]
    recomputed = {s.stage for s in plans.stages if any(d.action == "recompute" for d in s.plan.decisions)}
    assert early == [s for s in early_stages if s in recomputed] and bool(early) == bool(early_stages)
    for rank in range(cfg.pp):
        mine = [s.plan.predicted.hidden_recompute_s for s in plans.stages if s.pp_rank == rank]
        assert sum(mine) == pytest.approx(plan.hidden_recompute_s[rank])


@pytest.mark.parametrize(
    ("schedule", "waiting"),
    [
        ("interleaved-zero-bubble", [1, 2]),  # stage s on rank s % 2
        ("zbv-zero-bubble", [2]),  # stage 1 hands its gradient's turn to stage 2 on its own rank
        ("dualpipev", [2]),  # the same V; stage 2's whole Bs wait too
    ],
)
def test_split_backward_stages_recompute_early_where_they_wait_before_i(schedule, waiting):
    """Under a split backward a stage past the first waits for its gradient before I (and before a
    whole B): its first-backward block may recompute in that wait; stage 0 recomputes in W, after
    its I, and the last stage waits for nothing."""
    import pp_ranks as P

    from planner.simulation.effects import SpanChoice
    from planner.simulation.pipeline import simulate_pipeline
    from planner.simulation.pipeline_early import runs_early
    from planner.simulation.pipeline_split import cut_stages
    from planner.solver.baselines import block_spans
    from planner.tracing.recorder import trace

    graph = trace(f"{P.PATH}:titan_llama", batch_size=1, seq_len=128)
    cfg = TrainConfig(batch_size=4, seq_len=128, pp=2, pp_schedule=schedule, microbatches=4, stages_per_rank=2)
    timeline = simulate_pipeline(graph, cfg)
    cuts = cut_stages(graph, timeline.blocks_per_stage)
    spans = block_spans(graph)
    early = [
        c.index
        for c in cuts
        if any(
            runs_early(graph, timeline.schedule, c, SpanChoice(s, "recompute"))
            for s in spans
            if c.fwd_start <= s.fwd_start < c.fwd_end
        )
    ]
    assert early == waiting
