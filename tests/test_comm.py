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
