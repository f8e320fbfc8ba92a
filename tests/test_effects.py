"""planner.simulation.effects: the solver's per-option effects, summed, are the simulator's curve.

Random plans on small traced graphs (storages that outlive the step, selective caches, child
spans, offload and recompute in one plan): the op samples, each replay's highest sample, the
final sample, the peak (as the solver's model computes it) and the added time all agree exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models_for_tests import RandomBlock, RandomNet
from torch._subclasses import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from costmodels.hardware import get_device
from costmodels.runtime import transfer_time_s
from planner.config import TrainConfig
from planner.simulation.costs import op_times, storage_bytes
from planner.simulation.effects import SpanChoice, choice_effect, choice_effects_at, exposed_transfer_s, module_span
from planner.simulation.step import simulate
from planner.solver.baselines import block_spans
from planner.solver.cpsat import _Problem
from planner.solver.options import option_effect
from planner.tracing.models import GPT, GPTConfig
from planner.tracing.recorder import trace_model


class StashBlock(RandomBlock):
    """Keeps its hidden activation on the module: a saved storage that outlives the step."""

    def forward(self, x):
        h = self.act(self.up(x))
        self.stash = h
        return x + self.drop(self.norm(self.down(h)))


def _stash_net(width: int, batch_size: int, seq_len: int):
    net = RandomNet(width, [(32, "gelu", True), (16, "relu", False), (32, "silu", True)])
    net.blocks[1] = StashBlock(width, 32, "tanh", False)
    return net, (torch.randn(batch_size, seq_len, width),)


def _gpt(width: int, batch_size: int, seq_len: int):
    config = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=width)
    ids = torch.randint(0, 32, (batch_size, seq_len))
    return GPT(config), (ids, ids)


# (builder, width, config): a CPU step with disk offload and an A100 step with host offload
CASES = (
    (_stash_net, 16, TrainConfig(batch_size=2, seq_len=16), "disk"),
    (_gpt, 16, TrainConfig(batch_size=1, seq_len=8, gpu="a100-40gb"), "cpu"),
)
_CONTEXTS: dict[int, tuple] = {}


def _context(case: int):
    """(graph, config, target, spans, sizes, times, device, baseline curve), traced once per case."""
    if case not in _CONTEXTS:
        build, width, config, target = CASES[case]
        with FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True):
            model, inputs = build(width, config.batch_size, config.seq_len)
            model.train()
            graph = trace_model(model, inputs, name=build.__name__)
        device = get_device(config.gpu)
        base = simulate(graph, config).total
        _CONTEXTS[case] = (
            graph,
            config,
            target,
            block_spans(graph),
            storage_bytes(graph, config),
            op_times(graph, device),
            device,
            base,
        )
    return _CONTEXTS[case]


def _children(graph, path: str) -> list:
    prefix = path + "."
    names = sorted(
        {
            op.module[len(prefix) :].split(".")[0]
            for op in graph.ops[: graph.backward_start]
            if op.module.startswith(prefix)
        }
    )
    out = []
    for name in names:
        try:
            out.append(module_span(graph, prefix + name))
        except ValueError:
            continue
    return out


@st.composite
def plans(draw):
    case = draw(st.integers(0, len(CASES) - 1))
    graph, _, target, spans, *_ = _context(case)
    choices = []
    for span in spans:
        kind = draw(st.sampled_from(("keep", "recompute", "selective", "child", "offload")))
        if kind == "recompute":
            choices.append(SpanChoice(span, "recompute"))
        elif kind == "selective":
            ops = range(span.fwd_start, span.fwd_end)
            keep = draw(st.sets(st.sampled_from(ops), max_size=len(ops)))
            choices.append(SpanChoice(span, "recompute", frozenset(keep)))
        elif kind == "child" and (children := _children(graph, span.path)):
            choices.append(SpanChoice(draw(st.sampled_from(children)), "recompute"))
        elif kind == "offload":
            choices.append(SpanChoice(span, "offload", target=target))
    return case, choices


def _check(case: int, choices: list[SpanChoice]) -> None:
    graph, config, _, _, sizes, times, device, base = _context(case)
    n = len(graph.ops)
    effects = [option_effect(graph, c, times, device, sizes) for c in choices]
    timeline = simulate(graph, config, choices=choices)
    total, op_index = timeline.total, timeline.op_index
    last = np.searchsorted(op_index, np.arange(n + 1), side="right") - 1  # each op's own sample
    allocs = np.array([sum(sizes[t] for t in op.allocs) for op in graph.ops], dtype=np.int64)
    model = base[:n].astype(np.int64).copy()
    for e in effects:
        model[e.lo : e.hi] += e.delta
    np.testing.assert_array_equal(total[last[:n]], model)  # every op sample
    assert total[last[n]] == base[n]  # the optimizer step
    for c, e in zip(choices, effects):
        b = c.span.bwd_start
        first = np.searchsorted(op_index, b, side="left")
        if e.replay_peak is None:
            assert first == last[b]  # no replay samples
            continue
        own = e.delta[b - e.lo] if e.lo <= b < e.hi else 0
        expected = base[b] - allocs[b] + model[b] - base[b] - own + e.replay_peak
        assert total[first : last[b]].max() == expected  # the replay's highest sample
    problem = _Problem(
        base[:n].astype(np.int64),
        base[:n].astype(np.int64) - allocs,
        int(base[n]),
        [[None] for _ in effects],
        [[e] for e in effects],
        np.concatenate([[0.0], np.cumsum(times)]),
        graph.backward_start,
    )
    assert problem.peak_bytes([0] * len(effects)) == timeline.peak_bytes
    recompute_s = sum(e.cost_s for e in effects if e.transfer is None)
    assert timeline.costs.recompute_s == pytest.approx(recompute_s, rel=1e-12, abs=1e-18)
    # the link as the solver prices it: loads, plus max over k of (ready_k + stores from k on) - deadline
    stores = sorted((e.transfer.ready_op, e.store_s) for e in effects if e.transfer is not None)
    ends = [problem.clock[r] + sum(s for _, s in stores[k:]) for k, (r, _) in enumerate(stores)]
    stall = max([0.0] + [end - problem.clock[graph.backward_start] for end in ends])
    loads = sum(e.cost_s for e in effects if e.transfer is not None)
    assert timeline.costs.exposed_offload_s == pytest.approx(loads + stall, rel=1e-9, abs=1e-15)


@pytest.mark.slow
@settings(
    max_examples=2000,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(plans())
def test_option_effects_sum_to_the_simulated_curve(plan):
    _check(*plan)


def test_outliving_storage_is_recreated_and_lives_on():
    """A recomputed storage that outlives the step comes back in the replay and is never freed;
    offloaded, it is reloaded in backward and lives on too. Offload and recompute in one plan."""
    graph, config, target, spans, sizes, times, *_ = _context(0)
    stash = next(
        t
        for t in graph.tensors.values()
        if t.free_op is None and t.saved_by and t.category == "activation" and t.alloc_op >= 0
    )
    span = next(s for s in spans if s.fwd_start <= stash.alloc_op < s.fwd_end)
    recompute = choice_effect(graph, SpanChoice(span, "recompute"), sizes, times)
    mine = [ev for ev in recompute.events if ev.storage == stash.id]
    assert [ev.nbytes > 0 for ev in mine] == [True, False, True]  # allocated, dropped, re-created
    assert mine[-1].op == span.bwd_start
    offload = choice_effect(graph, SpanChoice(span, "offload", target=target), sizes, times)
    mine = [ev for ev in offload.events if ev.storage == stash.id]
    assert [ev.nbytes > 0 for ev in mine] == [True, False, True] and mine[-1].op >= span.bwd_start
    others = [SpanChoice(s, "recompute") for s in spans if s != span]
    _check(0, [SpanChoice(span, "offload", target=target), *others])
    _check(0, [SpanChoice(span, "recompute"), *others])


def test_exposed_transfer_queues_stores_on_one_link():
    graph, config, target, spans, sizes, times, device, _ = _context(0)
    transfers = [choice_effect(graph, SpanChoice(s, "offload", target=target), sizes, times).transfer for s in spans]
    one = transfer_time_s(transfers[0].nbytes, device, target)
    assert exposed_transfer_s(transfers[:1], times, graph.backward_start, device) >= one  # the load
    together = exposed_transfer_s(transfers, times, graph.backward_start, device)
    apart = sum(exposed_transfer_s([t], times, graph.backward_start, device) for t in transfers)
    assert together >= apart - 1e-15  # stores share the link: queueing never hides more


def test_effects_kept_with_the_graph_match_fresh_ones_at_every_scale():
    """choice_effects_at keeps each effect with the graph, and gives what choice_effect gives at
    each config's own sizes (here a whole plan at one rank and at ZeRO-3 over 4 ranks)."""
    graph, config, target, spans, *_ = _context(1)
    choices = [SpanChoice(spans[0], "recompute"), SpanChoice(spans[-1], "offload", target=target)]
    device = get_device(config.gpu)
    for c in (config, config.with_(zero_stage=3, dp=4)):
        fresh = [choice_effect(graph, ch, storage_bytes(graph, c), op_times(graph, device)) for ch in choices]
        kept = choice_effects_at(graph, choices, c)
        assert [(e.events, e.moved, e.recompute_flops, e.transfer) for e in kept] == [
            (e.events, e.moved, e.recompute_flops, e.transfer) for e in fresh
        ]
        assert all(a is b for a, b in zip(kept, choice_effects_at(graph, choices, c)))
