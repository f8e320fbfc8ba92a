"""Per-block options the solver chooses from, and their exact effect on the memory curve.

For each checkpointable block the options are: keep everything; recompute the whole block;
selective recompute (keep the outputs of the ops that are most expensive per byte, recompute
the rest); torch's op-SAC, torchtitan's alternating op-SAC and Megatron's selective recompute
(planner.solver.policies); recompute one child module; offload what the block saves. Each option's effect is the
change it makes to the simulated curve (`delta`, per op sample) and the peak of its own replay
(recompute or reload) just before the block's backward; the solver adds these up exactly as
:func:`planner.simulation.step.simulate` would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from costmodels.hardware import DeviceSpec
from costmodels.runtime import transfer_time_s
from planner.simulation.effects import (
    ModuleSpan,
    SpanChoice,
    cached_outputs,
    dropped_from,
    dropped_tensors,
    module_span,
    recompute_cost,
    reload_op,
    replay_events,
)
from planner.solver.policies import attention_core_choice, op_sac_alt_choice, op_sac_choice, saved_producers
from planner.tracing.graph import OpGraph

__all__ = ["BlockOption", "OptionEffect", "block_options", "option_effect"]

@dataclass(frozen=True)
class BlockOption:
    """One way to treat one block: `choice` None means keep everything."""

    name: str
    choice: SpanChoice | None


@dataclass(frozen=True)
class OptionEffect:
    """Exact effect of an option on the curve.

    `delta[i - lo]` is the change of live bytes at op sample i for lo <= i < hi (zero elsewhere);
    `replay_at` is the op before which the replay runs and `replay_peak` the most its replay adds
    on top of the live bytes just before that op (after the option's own drops).
    """

    lo: int
    hi: int
    delta: np.ndarray
    replay_at: int
    replay_peak: int
    cost_s: float
    recompute_flops: int
    offload_bytes: int


def _nbytes(graph: OpGraph, tid: int, scale: dict[str, float]) -> int:
    t = graph.tensors[tid]
    return int(t.nbytes * scale.get(t.category, 1.0))


def option_effect(graph: OpGraph, choice: SpanChoice, times: np.ndarray, device: DeviceSpec,
                  scale: dict[str, float]) -> OptionEffect:
    """How a span choice changes the curve, mirroring simulate()'s event rules."""
    span = choice.span
    b = span.bwd_start
    dropped = dropped_tensors(graph, span, choice.keep_ops)
    gone: list[tuple[int, int, int]] = []  # (from, until, bytes) a dropped storage is absent
    for tid in dropped:
        t = graph.tensors[tid]
        start = dropped_from(graph, tid)
        if choice.mode == "offload":
            back = reload_op(graph, tid, span)
            end = back if back is not None else (t.free_op or b)
        else:
            end = b if (t.free_op is not None and t.free_op > b) else (t.free_op or b)
        if end > start:
            gone.append((start, end, _nbytes(graph, tid, scale)))
    cached = cached_outputs(graph, span, choice.keep_ops, dropped)
    held = [(graph.tensors[tid].free_op, b if popped else span.bwd_end, _nbytes(graph, tid, scale))
            for tid, popped in cached]  # the cache keeps them past their free
    lo = span.fwd_start
    hi = max([b] + [end for _, end, _ in gone] + [end for _, end, _ in held])
    delta = np.zeros(hi - lo, dtype=np.int64)
    for start, end, nbytes in gone:
        delta[start - lo:end - lo] -= nbytes
    for start, end, nbytes in held:
        delta[start - lo:end - lo] += nbytes
    if choice.mode == "offload":
        nbytes = sum(graph.tensors[tid].nbytes for tid in dropped)
        replay_peak = 0  # the reloaded storages only return what the drops took away
        tx = transfer_time_s(nbytes, device, choice.target)
        fwd_s = float(times[span.fwd_start:span.fwd_end].sum())
        # the store overlaps the block's forward; the load is on the critical path (no prefetch)
        cost = max(0.0, tx - fwd_s) + tx
        return OptionEffect(lo, hi, delta, b, replay_peak, cost, 0, nbytes)
    popped = [tid for tid, in_replay in cached if in_replay]
    live = peak = sum(_nbytes(graph, tid, scale) for tid in popped)  # cached since forward
    for kind, x in replay_events(graph, span, choice.keep_ops, dropped, popped):
        if kind == "alloc":
            live += _nbytes(graph, x, scale)
        elif kind == "free":
            live -= _nbytes(graph, x, scale)
        elif kind == "op":
            peak = max(peak, live)
    flops, seconds = recompute_cost(graph, span, choice.keep_ops, dropped, times)
    # The replay starts after the dropped storages are gone: they come back inside `peak`.
    regained = sum(_nbytes(graph, tid, scale) for tid in dropped
                   if graph.tensors[tid].free_op is not None and graph.tensors[tid].free_op > b)
    return OptionEffect(lo, hi, delta, b, peak - regained, seconds, flops, 0)


def _child_spans(graph: OpGraph, path: str) -> list[ModuleSpan]:
    prefix = path + "."
    children = sorted({op.module[len(prefix):].split(".")[0] for op in graph.ops[: graph.backward_start]
                       if op.module.startswith(prefix)})
    spans = []
    for child in children:
        try:
            spans.append(module_span(graph, prefix + child))
        except ValueError:
            continue
    return spans


def block_options(graph: OpGraph, span: ModuleSpan, times: np.ndarray, offload: str | None,
                  max_selective: int = 6) -> list[BlockOption]:
    """Candidate options for one block (see module docstring)."""
    options = [BlockOption("keep", None), BlockOption("recompute", SpanChoice(span, "recompute"))]
    uncacheable = graph.uncacheable_ops()  # outputs mutated later: selective keeps recompute them
    producers = {i: n for i, n in saved_producers(graph, span).items() if i not in uncacheable}
    if len(producers) > 1:
        # Keep first what costs the most time per byte it would free (matmuls, attention).
        ranked = sorted(producers, key=lambda i: (-times[i] / max(producers[i], 1), i))
        counts = sorted({max(1, round(k * len(ranked) / max_selective)) for k in range(1, max_selective + 1)})
        for k in counts:
            if k >= len(ranked):
                continue
            options.append(BlockOption(f"selective-{k}", SpanChoice(span, "recompute", frozenset(ranked[:k]))))
    known = (("op-sac", op_sac_choice(graph, span)), ("op-sac-alt", op_sac_alt_choice(graph, span)),
             ("megatron-selective", attention_core_choice(graph, span)))
    for name, choice in known:  # the known policies (solver.policies), so the solver never loses to one
        if choice is not None and choice.keep_ops:
            options.append(BlockOption(name, choice))
    for child in _child_spans(graph, span.path):
        if saved_producers(graph, child):
            options.append(BlockOption(f"recompute {child.path}", SpanChoice(child, "recompute")))
    if offload:
        options.append(BlockOption(f"offload-{offload}", SpanChoice(span, "offload", target=offload)))
    return options

