"""FSDP2 step time: collectives on one link, overlapped with compute as prefetch allows."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodels.hardware import get_device
from planner.config import TrainConfig
from planner.simulation.comm import BlockTimes, fsdp_communication, fsdp_schedule
from planner.simulation.costs import op_times
from planner.tracing.recorder import trace

NO_ROOT = BlockTimes(0.0, 0.0, 0.0, 0.0)


def test_fast_links_hide_all_but_the_gathers_at_each_pass_start_and_the_last_reduce():
    blocks = [BlockTimes(1.0, 2.0, 0.1, 0.1)] * 4
    s = fsdp_schedule(blocks, root=NO_ROOT, head_forward_s=0.0, head_backward_s=0.0)
    assert s.compute_s == pytest.approx(12.0)
    assert s.communication_s == pytest.approx(4 * 0.1 * 2 + 4 * 0.1)  # gathers in both passes, reduces
    # exposed: block 0's forward gather before anything runs, the last block's backward gather right
    # after the loss (nothing to overlap it with), the last reduce after the last backward
    assert s.exposed_communication_s == pytest.approx(0.3)


def test_slow_links_bound_the_step():
    blocks = [BlockTimes(1.0, 1.0, 5.0, 5.0)] * 3
    s = fsdp_schedule(blocks, root=NO_ROOT, head_forward_s=0.0, head_backward_s=0.0)
    # the link is busy for every collective back to back, from t=0 to the end
    assert s.compute_s + s.exposed_communication_s == pytest.approx(s.communication_s + 1.0)


def test_no_reshard_gathers_once():
    blocks = [BlockTimes(1.0, 2.0, 0.5, 0.5)] * 3
    resharded = fsdp_schedule(blocks, root=NO_ROOT, head_forward_s=0.0, head_backward_s=0.0)
    kept = fsdp_schedule(blocks, root=NO_ROOT, head_forward_s=0.0, head_backward_s=0.0, reshard_after_forward=False)
    assert kept.communication_s == pytest.approx(resharded.communication_s - 3 * 0.5)
    assert kept.exposed_communication_s <= resharded.exposed_communication_s


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(*[st.floats(0, 10)] * 4), min_size=1, max_size=6), st.floats(0, 3), st.floats(0, 3))
def test_step_time_between_compute_and_everything_serialised(raw, head_f, head_b):
    blocks = [BlockTimes(*b) for b in raw]
    root = BlockTimes(0.5, 0.5, 0.2, 0.2)
    s = fsdp_schedule(blocks, root=root, head_forward_s=head_f, head_backward_s=head_b)
    step = s.compute_s + s.exposed_communication_s
    assert max(s.compute_s, s.communication_s) - 1e-9 <= step <= s.compute_s + s.communication_s + 1e-9


@pytest.mark.slow
def test_traced_llama_communication_grows_with_world_size_across_nodes():
    config = TrainConfig(batch_size=1, seq_len=4096, precision="bf16-mixed", zero_stage=3, dp=8, gpu="h100-80gb")
    graph = trace("llama-7b", batch_size=1, seq_len=4096, precision="bf16-mixed", gathered_params=True)
    device = get_device(config.gpu)
    times = op_times(graph, device)
    in_node = fsdp_communication(graph, times, dp=8, device=device)
    across = fsdp_communication(graph, times, dp=64, device=device)
    assert in_node.compute_s == pytest.approx(float(times.sum()))
    assert across.communication_s > 5 * in_node.communication_s  # 50 GB/s network against 450 GB/s NVLink
    assert 0 < in_node.exposed_communication_s < across.exposed_communication_s


def test_recompute_fills_the_wait_for_the_next_all_gather_and_only_the_excess_adds():
    """Link-bound backward: each block's backward waits for the next block's all-gather. Compute
    added at the start of a block's backward (its recompute) runs in that block's wait; only what
    exceeds it lengthens the step, block by block."""
    blocks = [BlockTimes(1.0, 1.0, 2.0, 2.0)] * 6
    plain = fsdp_schedule(blocks, root=NO_ROOT, head_forward_s=0.0, head_backward_s=0.0)
    waits = plain.backward_wait_s
    assert all(w > 0 for w in waits)

    def added(extra: list[float]) -> float:
        replayed = [BlockTimes(b.forward_s, b.backward_s + e, b.gather_s, b.reduce_s) for b, e in zip(blocks, extra)]
        s = fsdp_schedule(replayed, root=NO_ROOT, head_forward_s=0.0, head_backward_s=0.0)
        return s.compute_s + s.exposed_communication_s - plain.compute_s - plain.exposed_communication_s

    for extra in (waits, [0, 4, 4, 0, 0, 0], [0, 2, 2, 2, 2, 2], [1, 0, 0, 0, 0, 5]):
        assert added(extra) == pytest.approx(sum(max(0.0, e - w) for e, w in zip(extra, waits)))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(*[st.floats(0, 3)] * 5), min_size=1, max_size=6))
def test_block_waits_never_claim_more_hiding_than_the_schedule_gives(raw):
    """Pricing each block's extra backward compute against its own wait (what the planner does)
    never under-states the time it adds to the step."""
    blocks = [BlockTimes(*b[:4]) for b in raw]
    root = BlockTimes(0.3, 0.4, 0.5, 0.6)
    plain = fsdp_schedule(blocks, root=root, head_forward_s=0.2, head_backward_s=0.3)
    replayed = [BlockTimes(b.forward_s, b.backward_s + r[4], b.gather_s, b.reduce_s) for b, r in zip(blocks, raw)]
    s = fsdp_schedule(replayed, root=root, head_forward_s=0.2, head_backward_s=0.3)
    added = s.compute_s + s.exposed_communication_s - plain.compute_s - plain.exposed_communication_s
    assert added <= sum(max(0.0, r[4] - w) for r, w in zip(raw, plain.backward_wait_s)) + 1e-9


def test_plans_priced_by_step_time_hide_recompute_in_fsdp_waits():
    """A small MLP over 64 H100s waits on FSDP2's all-gathers in backward: at the same budget, the
    plan that prices recompute by the step time it adds is faster than the one that prices it in
    full, and the simulator reports what ran inside the waits."""
    from planner.simulation.step import simulate
    from planner.solver.cpsat import solve_choices
    from planner.tracing.recorder import trace_for

    config = TrainConfig(batch_size=8, seq_len=64, precision="bf16-mixed", zero_stage=3, dp=64, gpu="h100-80gb")
    graph = trace_for("mlp-small", config)
    budget = int(simulate(graph, config).peak_bytes * 0.7)
    aware = solve_choices(graph, config, budget, time_limit_s=10)
    full = solve_choices(graph, config, budget, hide_in_communication=False, time_limit_s=10)
    assert aware.timeline.peak_bytes <= budget and full.timeline.peak_bytes <= budget
    assert aware.timeline.costs.hidden_recompute_s > 0
    assert aware.timeline.costs.step_s < full.timeline.costs.step_s
    added = aware.timeline.costs.added_s
    assert added == pytest.approx(aware.timeline.costs.recompute_s - aware.timeline.costs.hidden_recompute_s)
