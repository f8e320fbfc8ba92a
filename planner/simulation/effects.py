"""What a plan does to a traced step: which module spans are recomputed or offloaded, and which
storages that frees.

A plan names modules by path and ops by `aten.name.overload#k` (the k-th call of that op in the
module's forward). This module resolves those names against an :class:`OpGraph` into
:class:`SpanChoice` objects the simulator and the solver share.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

from planner.tracing.graph import OpGraph

__all__ = ["SpanChoice", "ModuleSpan", "module_span", "op_keys", "dropped_tensors", "choices_from_decisions",
           "recompute_ops", "recompute_stop", "cached_outputs", "natural_free_in_span", "replay_events", "dropped_from", "recompute_cost",
           "reload_op"]


@dataclass(frozen=True)
class ModuleSpan:
    """Where a module runs in the step: forward ops [fwd_start, fwd_end), first backward op."""

    path: str
    fwd_start: int
    fwd_end: int
    bwd_start: int
    bwd_end: int


@dataclass(frozen=True)
class SpanChoice:
    """Recompute or offload what a module saves.

    `keep_ops` are forward op indices whose outputs stay saved (selective checkpointing);
    for `offload`, `target` is "cpu" or "disk".
    """

    span: ModuleSpan
    mode: str  # "recompute" | "offload"
    keep_ops: frozenset[int] = frozenset()
    target: str | None = None


def module_span(graph: OpGraph, path: str) -> ModuleSpan:
    """Forward/backward op ranges of a module; ValueError when it ran no forward and backward."""
    for r in graph.regions:
        if r.path == path:
            return ModuleSpan(path, r.fwd_start, r.fwd_end, r.bwd_start, r.bwd_end)
    ops = graph.ops_in_module(path)
    fwd = [i for i in ops if i < graph.backward_start]
    bwd = [i for i in ops if i >= graph.backward_start]
    if not fwd or not bwd:
        raise ValueError(f"module '{path}' runs no forward and backward ops in the traced step; "
                         "choose a module path that the model's forward uses")
    return ModuleSpan(path, min(fwd), max(fwd) + 1, min(bwd), max(bwd) + 1)


def op_keys(graph: OpGraph, span: ModuleSpan) -> dict[int, str]:
    """Forward op index -> `aten.op.overload#k` (k counts calls of that op inside the span)."""
    seen: dict[str, int] = defaultdict(int)
    out = {}
    for i in range(span.fwd_start, span.fwd_end):
        name = graph.ops[i].name
        out[i] = f"{name}#{seen[name]}"
        seen[name] += 1
    return out


def dropped_tensors(graph: OpGraph, span: ModuleSpan, keep_ops: Iterable[int] = ()) -> list[int]:
    """Storages a span stops holding from forward to backward when recomputed or offloaded.

    A storage qualifies when it was allocated inside the span by an op not in `keep_ops`, autograd
    saved it only inside the span, and no forward op outside the span reads it (outputs of the span
    stay alive: the next module saves them or a checkpoint keeps them as inputs).
    """
    keep = set(keep_ops)
    consumers = graph.forward_consumers()
    out = []
    for i in range(span.fwd_start, span.fwd_end):
        if i in keep:
            continue
        for tid in graph.ops[i].allocs:
            t = graph.tensors[tid]
            if not t.saved_by or t.category not in ("activation", "temporary"):
                continue
            if any(not (span.fwd_start <= s < span.fwd_end) for s in t.saved_by):
                continue
            if any(not (span.fwd_start <= c < span.fwd_end) for c in consumers.get(tid, ())):
                continue
            out.append(tid)
    return out


def choices_from_decisions(graph: OpGraph, decisions: Sequence) -> list[SpanChoice]:
    """Resolve plan decisions (objects with module, action, op, target) into span choices."""
    by_module: dict[str, list] = defaultdict(list)
    for d in decisions:
        by_module[d.module].append(d)
    choices = []
    for path, ds in by_module.items():
        whole = [d for d in ds if d.op is None]
        if not whole or whole[0].action == "keep":
            continue
        span = module_span(graph, path)
        if whole[0].action == "offload":
            choices.append(SpanChoice(span, "offload", target=whole[0].target))
            continue
        keys = {k: i for i, k in op_keys(graph, span).items()}
        keep = set()
        for d in ds:
            if d.op is None:
                continue
            if d.op not in keys:
                raise ValueError(f"plan names op '{d.op}' in module '{path}', which does not run it; "
                                 "re-plan with memplan plan for this model and configuration")
            if d.action == "keep":
                keep.add(keys[d.op])
        choices.append(SpanChoice(span, "recompute", frozenset(keep)))
    _check_disjoint(choices)
    return choices


def _check_disjoint(choices: list[SpanChoice]) -> None:
    spans = sorted((c.span.fwd_start, c.span.fwd_end, c.span.path) for c in choices)
    for (a0, a1, pa), (b0, _, pb) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(f"plan recomputes or offloads both '{pa}' and '{pb}', which overlap; "
                             "choose one of them")


def recompute_ops(graph: OpGraph, span: ModuleSpan, keep_ops: frozenset[int], dropped: Sequence[int]) -> list[int]:
    """Forward ops a non-reentrant checkpoint re-runs, minus those whose outputs a selective
    policy keeps. torch stops the recompute early, once it has re-saved as many tensors as the
    forward saved: right at the span's last save (inputs are saved before their op runs)."""
    if not dropped:
        return []
    return [i for i in range(span.fwd_start, recompute_stop(graph, span)) if i not in keep_ops]


def recompute_stop(graph: OpGraph, span: ModuleSpan) -> int:
    """The first forward op of a span that a recompute does not reach (its last save's position)."""
    prefix = span.path + "."
    saves = [n for n, module in graph.pack_events
             if span.fwd_start <= n <= span.fwd_end and (module == span.path or module.startswith(prefix))]
    return max(saves) if saves else span.fwd_end


def cached_outputs(graph: OpGraph, span: ModuleSpan, keep_ops: frozenset[int],
                   dropped: Sequence[int]) -> list[tuple[int, bool]]:
    """Outputs of kept ops that autograd did not save, which a selective policy's cache holds.

    Returns (storage, popped): popped when the recompute reaches the op and takes the output back
    (it then dies where it naturally would inside the replay); otherwise the cache keeps it until
    the checkpoint's frame dies at the end of the span's backward.
    """
    stop = recompute_stop(graph, span) if dropped else span.fwd_start
    out = []
    for i in sorted(keep_ops):
        for tid in graph.ops[i].allocs:
            t = graph.tensors[tid]
            if t.free_op is not None and t.free_op < span.bwd_start:
                out.append((tid, i < stop))
    return out


def dropped_from(graph: OpGraph, tid: int) -> int:
    """The op before which a dropped storage dies in forward: where it would die unsaved."""
    t = graph.tensors[tid]
    return t.natural_free_op if t.natural_free_op is not None else graph.backward_start


def recompute_cost(graph: OpGraph, span: ModuleSpan, keep_ops: frozenset[int], dropped: Sequence[int],
                   times) -> tuple[int, float]:
    """(FLOPs, seconds) of a span's recompute, with `times` the per-op seconds on the target."""
    redo = recompute_ops(graph, span, keep_ops, dropped)
    return sum(graph.ops[i].flops for i in redo), float(times[redo].sum()) if redo else 0.0


def natural_free_in_span(graph: OpGraph, tid: int, span: ModuleSpan) -> int:
    """Where a storage re-created by a span's recompute dies inside the replay (at the latest at
    the span's end, where the recompute's outputs are dropped)."""
    t = graph.tensors[tid]
    return min(t.natural_free_op if t.natural_free_op is not None else span.fwd_end, span.fwd_end)


def replay_events(graph: OpGraph, span: ModuleSpan, keep_ops: frozenset[int], dropped: Sequence[int],
                  popped: Sequence[int]) -> Iterator[tuple[str, int]]:
    """The memory events of a recompute replay, in order (shared by the simulator and the solver).

    ("free", storage): a replayed storage dies; ("alloc", storage): the next re-run op re-creates
    it; ("op", index): that op has run (a sample point); ("hold", storage): a re-created storage
    that stays until its own backward free. `popped` are cached outputs of kept ops, alive since
    forward, that the replay takes back and lets die where they naturally would.
    """
    drop_set = set(dropped)
    local: dict[int, list[int]] = defaultdict(list)  # op index -> storages that die before it
    for tid in popped:
        local[natural_free_in_span(graph, tid, span)].append(tid)
    for i in recompute_ops(graph, span, keep_ops, dropped):
        for k in sorted(k for k in local if k <= i):
            for tid in local.pop(k):
                yield "free", tid
        for tid in graph.ops[i].allocs:
            t = graph.tensors[tid]
            yield "alloc", tid
            if tid in drop_set and t.free_op is not None and t.free_op > span.bwd_start:
                yield "hold", tid
            else:
                local[natural_free_in_span(graph, tid, span)].append(tid)
        yield "op", i
    for k in sorted(local):
        for tid in local[k]:
            yield "free", tid


def reload_op(graph: OpGraph, tid: int, span: ModuleSpan) -> int | None:
    """Where an offloaded storage comes back: autograd unpacks it when the backward node that
    needs it runs (the first backward op reading it), and frees it when that node is done.
    None when it is freed before the span's backward (nothing to bring back)."""
    t = graph.tensors[tid]
    if t.free_op is None or t.free_op <= span.bwd_start:
        return None
    use = graph.first_backward_use().get(tid, t.free_op - 1)
    return min(max(use, span.bwd_start), t.free_op - 1)
