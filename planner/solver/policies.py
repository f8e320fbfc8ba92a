"""Known per-block recompute policies, as span choices: what torch's op-level SAC, torchtitan's
alternating variant and Megatron's selective recompute would do to one block.

The baselines apply one of them to every block; the solver's option set includes each of them,
so CP-SAT can always pick the known policy where it is best.
"""

from __future__ import annotations

from planner.simulation.effects import ModuleSpan, SpanChoice, dropped_tensors
from planner.tracing.graph import OpGraph
from planner.tracing.op_classes import (
    ATTENTION_CORE_OPS,
    LINEAR_MATMUL_OPS,
    OP_SAC_SAVE_OPS,
)

__all__ = [
    "attention_core_choice",
    "op_sac_alt_choice",
    "op_sac_choice",
    "saved_producers",
]


def saved_producers(graph: OpGraph, span: ModuleSpan) -> dict[int, int]:
    """Forward op -> bytes it would free if recomputed (its dropped outputs)."""
    out: dict[int, int] = {}
    for tid in dropped_tensors(graph, span):
        op = graph.tensors[tid].alloc_op
        out[op] = out.get(op, 0) + graph.tensors[tid].nbytes
    return out


def _cacheable(graph: OpGraph, span: ModuleSpan) -> list[int]:
    """Forward ops of a span whose outputs a selective policy may cache."""
    uncacheable = graph.uncacheable_ops()
    return [i for i in range(span.fwd_start, span.fwd_end) if graph.ops[i].allocs and i not in uncacheable]


def op_sac_choice(graph: OpGraph, span: ModuleSpan) -> SpanChoice:
    """torch's op-level SAC (torch.utils.checkpoint's policy example, torchtitan's save list): keep
    the outputs of matmuls, convolutions and attention, recompute every other op."""
    keep = frozenset(i for i in _cacheable(graph, span) if graph.ops[i].name in OP_SAC_SAVE_OPS)
    return SpanChoice(span, "recompute", keep)


def op_sac_alt_choice(graph: OpGraph, span: ModuleSpan) -> SpanChoice:
    """torchtitan's op SAC policy: as op-SAC, but every second Linear matmul of the block (the
    2nd, 4th, ... in forward order) is recomputed. torchtitan counts aten.mm only; bias Linears
    (aten.addmm) count here too."""
    keep = set()
    matmuls = 0
    for i in range(span.fwd_start, span.fwd_end):
        name = graph.ops[i].name
        if name in LINEAR_MATMUL_OPS:
            matmuls += 1
            if matmuls % 2 == 0:
                continue
        if name in OP_SAC_SAVE_OPS:
            keep.add(i)
    return SpanChoice(span, "recompute", frozenset(keep & set(_cacheable(graph, span))))


def attention_core_choice(graph: OpGraph, span: ModuleSpan) -> SpanChoice | None:
    """Megatron-LM's selective recompute: recompute only the attention core (in each attention
    module, the ops from its first to its last attention-core op), keep every other saved output. None when
    the block has no attention."""
    anchors = [i for i in range(span.fwd_start, span.fwd_end) if graph.ops[i].name in ATTENTION_CORE_OPS]
    if not anchors:
        return None
    runs: dict[str, list[int]] = {}  # attention module -> its anchors
    for i in anchors:
        runs.setdefault(graph.ops[i].module, []).append(i)
    core = {i for module, ids in runs.items() for i in range(ids[0], ids[-1] + 1) if graph.ops[i].module == module}
    producers = saved_producers(graph, span)
    if not core & set(producers):
        return None
    uncacheable = graph.uncacheable_ops()
    return SpanChoice(
        span,
        "recompute",
        frozenset(i for i in producers if i not in core and i not in uncacheable),
    )
