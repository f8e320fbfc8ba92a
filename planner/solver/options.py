"""Per-block options the solver chooses from, and their exact effect on the memory curve.

For each checkpointable block the options are: keep everything; recompute the whole block;
selective recompute (keep the outputs of the ops that are most expensive per byte, recompute
the rest); torch's op-SAC, torchtitan's alternating op-SAC and Megatron's selective recompute
(planner.solver.policies); recompute one child module; offload what the block saves. Each option's effect is
summed from the events :func:`planner.simulation.effects.choice_effect` gives the simulator: the
change it makes to the curve (`delta`, per op sample) and its own replay's peak just before the
block's backward; the solver adds these up exactly as :func:`planner.simulation.step.simulate` does.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from costmodels.hardware import DeviceSpec
from costmodels.runtime import checkpoint_host_s, transfer_time_s
from planner.simulation.effects import (
    REPLAY,
    SAMPLE,
    ModuleSpan,
    SpanChoice,
    Transfer,
    choice_effect,
    module_span,
    storage_events,
)
from planner.solver.policies import attention_core_choice, op_sac_alt_choice, op_sac_choice, saved_producers
from planner.tracing.graph import OpGraph

__all__ = ["BlockOption", "OptionEffect", "block_options", "option_effect"]


@dataclass(frozen=True)
class BlockOption:
    """One way to treat one block: `choice` None means keep everything."""

    name: str
    choice: SpanChoice | None


HIDDEN_PRICE = 0.01  # a recompute second hidden in a communication wait, against one that adds to the step


@dataclass(frozen=True)
class OptionEffect:
    """Exact effect of an option on the curve, summed from its events (:func:`choice_effect`).

    `delta[i - lo]` is the change of live bytes at op sample i for lo <= i < hi (zero elsewhere);
    `replay_at` is the op before which the replay runs and `replay_peak` the option's own change
    of live bytes at the highest sample of its replay (None: no replay), on top of the curve just
    before that op's allocations. `cost_s` is the recompute time, or an offload's load time; its
    store (`transfer`, `store_s` seconds) is priced on the one shared link. `hidden_s` is the part
    of a recompute that runs while its block's backward would wait on communication.
    """

    lo: int
    hi: int
    delta: np.ndarray
    replay_at: int
    replay_peak: int | None
    cost_s: float
    recompute_flops: int
    offload_bytes: int
    transfer: Transfer | None = None
    store_s: float = 0.0
    hidden_s: float = 0.0

    @property
    def added_s(self) -> float:
        """Seconds the option adds to the step, its store aside."""
        return self.cost_s - self.hidden_s

    @property
    def priced_s(self) -> float:
        """What the planners minimise: the added seconds, and a hidden second at HIDDEN_PRICE (of
        plans that add the same time, the one that recomputes less)."""
        return self.added_s + HIDDEN_PRICE * self.hidden_s


def option_effect(
    graph: OpGraph, choice: SpanChoice, times: np.ndarray, device: DeviceSpec, sizes: Mapping[int, int]
) -> OptionEffect:
    """How a span choice changes the curve: its events minus the traced lifetimes they replace."""
    span = choice.span
    b = span.bwd_start
    effect = choice_effect(graph, choice, sizes, times, checkpoint_host_s(device))
    replaced = [ev for tid in sorted(effect.moved) for ev in storage_events(graph, tid, sizes[tid])]
    changes = list(effect.events) + [ev._replace(nbytes=-ev.nbytes) for ev in replaced]
    per_op: dict[int, int] = defaultdict(int)
    for ev in changes:
        per_op[ev.op] += ev.nbytes
    assert sum(per_op.values()) == 0, f"the choice on '{span.path}' does not end the step as it found it"
    lo = span.fwd_start
    hi = max([b] + [op for op, nbytes in per_op.items() if nbytes])
    steps = np.zeros(hi - lo + 1, dtype=np.int64)
    for op, nbytes in per_op.items():
        assert op >= lo or not nbytes, f"the choice on '{span.path}' changes the curve before its forward"
        if lo <= op <= hi:
            steps[op - lo] += nbytes
    delta = np.cumsum(steps)[: hi - lo]
    live = sum(ev.nbytes for ev in changes if (ev.op, ev.stage) < (b, REPLAY))
    replay_peak = None
    for ev in effect.events:
        if ev.op == b and ev.stage == REPLAY:
            if ev.storage == SAMPLE:
                replay_peak = live if replay_peak is None else max(replay_peak, live)
            else:
                live += ev.nbytes
    tr = effect.transfer
    if tr is None:
        return OptionEffect(lo, hi, delta, b, replay_peak, effect.recompute_s, effect.recompute_flops, 0)
    seconds = transfer_time_s(tr.nbytes, device, tr.target)  # the store and the load each take this long
    return OptionEffect(lo, hi, delta, b, replay_peak, seconds, 0, tr.nbytes, tr, seconds)


def _child_spans(graph: OpGraph, path: str) -> list[ModuleSpan]:
    prefix = path + "."
    children = sorted(
        {
            op.module[len(prefix) :].split(".")[0]
            for op in graph.ops[: graph.backward_start]
            if op.module.startswith(prefix)
        }
    )
    containers = set(graph.meta.get("containers", ()))  # a ModuleList's forward is its parent's loop
    spans = []
    for child in children:
        if prefix + child in containers:
            continue
        try:
            spans.append(module_span(graph, prefix + child))
        except ValueError:
            continue
    return spans


def block_options(
    graph: OpGraph, span: ModuleSpan, times: np.ndarray, offload: str | None, max_selective: int = 6
) -> list[BlockOption]:
    """Candidate options for one block (see module docstring)."""
    options = [BlockOption("keep", None), BlockOption("recompute", SpanChoice(span, "recompute"))]
    uncacheable = graph.uncacheable_ops()  # outputs mutated later: selective keeps recompute them
    producers = {i: n for i, n in saved_producers(graph, span).items() if i not in uncacheable}
    # Under context parallel the trace records ring attention's local ops, which differ by cp rank
    # and which a selective-checkpoint policy does not see (it sees the one SDPA op DTensor
    # dispatches): an op key would name different ops on different ranks. Whole modules only.
    op_level = graph.meta.get("cp", 1) == 1
    if op_level and len(producers) > 1:
        # Keep first what costs the most time per byte it would free (matmuls, attention).
        ranked = sorted(producers, key=lambda i: (-times[i] / max(producers[i], 1), i))
        counts = sorted({max(1, round(k * len(ranked) / max_selective)) for k in range(1, max_selective + 1)})
        for k in counts:
            if k >= len(ranked):
                continue
            options.append(BlockOption(f"selective-{k}", SpanChoice(span, "recompute", frozenset(ranked[:k]))))
    known = (
        ("op-sac", op_sac_choice(graph, span)),
        ("op-sac-alt", op_sac_alt_choice(graph, span)),
        ("megatron-selective", attention_core_choice(graph, span)),
    )
    for name, choice in known:  # the known policies (solver.policies), so the solver never loses to one
        if op_level and choice is not None and choice.keep_ops:
            options.append(BlockOption(name, choice))
    for child in _child_spans(graph, span.path):
        if saved_producers(graph, child):
            options.append(BlockOption(f"recompute {child.path}", SpanChoice(child, "recompute")))
    if offload:
        options.append(BlockOption(f"offload-{offload}", SpanChoice(span, "offload", target=offload)))
    return options
