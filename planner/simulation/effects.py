"""What a plan does to a traced step: the one description of a choice's events on the memory curve.

A :class:`SpanChoice` recomputes or offloads what a module span saves. :func:`choice_effect` lists,
for one choice, every event it puts on the curve with per-device bytes: where a dropped storage
leaves, its re-creation by the recompute's replay (or its reload after an offload), where it dies
again (or that it lives on past the step), and the span's traffic on the one transfer link. The
simulator (:mod:`planner.simulation.step`), the solver's per-option effects
(:mod:`planner.solver.options`) and the allocator replay of diagnose all read these events.

A plan names modules by path and ops by `aten.name.overload#k` (the k-th call of that op in the
module's forward); this module resolves those names against an :class:`OpGraph`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from costmodels.hardware import DeviceSpec, get_device
from costmodels.runtime import CheckpointHost, checkpoint_host_s, transfer_time_s
from planner.config import TrainConfig
from planner.errors import MemplanError, PlanFileError
from planner.plans.decisions import OpKeys, module_plans
from planner.plans.format import Decision
from planner.simulation.costs import SCALED_CATEGORIES, category_scale, op_times, storage_bytes
from planner.tracing.collectives import collective_first_uses
from planner.tracing.graph import OpGraph

__all__ = [
    "SpanChoice",
    "ModuleSpan",
    "module_span",
    "op_keys",
    "dropped_tensors",
    "effective_keeps",
    "choices_from_decisions",
    "recompute_ops",
    "recompute_stop",
    "Event",
    "FREE",
    "RELOAD",
    "REPLAY",
    "ALLOC",
    "SAMPLE",
    "Transfer",
    "ChoiceEffect",
    "storage_events",
    "one_holder_each",
    "choice_effect",
    "choice_effects_at",
    "exposed_transfer_s",
]


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
        raise MemplanError(
            f"module '{path}' runs no forward and backward ops in the traced step; "
            "choose a module path that the model's forward uses"
        )
    return ModuleSpan(path, min(fwd), max(fwd) + 1, min(bwd), max(bwd) + 1)


def op_keys(graph: OpGraph, span: ModuleSpan) -> dict[int, str]:
    """Forward op index -> `aten.op.overload#k` (k counts calls of that op inside the span)."""
    keys = OpKeys()
    return {i: keys.next_key(graph.ops[i].name) for i in range(span.fwd_start, span.fwd_end)}


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


def choices_from_decisions(graph: OpGraph, decisions: Iterable[Decision]) -> list[SpanChoice]:
    """Resolve plan decisions (read by :func:`planner.plans.decisions.module_plans`) into span choices."""
    choices = []
    for path, mp in module_plans(decisions).items():
        span = module_span(graph, path)
        if mp.action == "offload":
            choices.append(SpanChoice(span, "offload", target=mp.target))
            continue
        keys = {k: i for i, k in op_keys(graph, span).items()}
        unknown = sorted(mp.named_ops - keys.keys())
        if unknown:
            raise PlanFileError(
                f"plan names op '{unknown[0]}' in module '{path}', which does not run it; "
                "re-plan with memplan plan for this model and configuration"
            )
        choices.append(SpanChoice(span, "recompute", frozenset(keys[op] for op in mp.keep_ops)))
    _check_disjoint(choices)
    return choices


def _check_disjoint(choices: list[SpanChoice]) -> None:
    spans = sorted((c.span.fwd_start, c.span.fwd_end, c.span.path) for c in choices)
    for (_, a1, pa), (b0, _, pb) in zip(spans, spans[1:]):
        if b0 < a1:
            raise PlanFileError(
                f"plan recomputes or offloads both '{pa}' and '{pb}', which overlap; choose one of them"
            )


def recompute_ops(graph: OpGraph, span: ModuleSpan, keep_ops: frozenset[int], dropped: Sequence[int]) -> list[int]:
    """Forward ops a non-reentrant checkpoint re-runs, minus those whose outputs a selective
    policy keeps. torch stops the recompute early, once it has re-saved as many tensors as the
    forward saved: right at the span's last save (inputs are saved before their op runs)."""
    if not dropped:
        return []
    return [i for i in range(span.fwd_start, recompute_stop(graph, span)) if i not in keep_ops]


def effective_keeps(graph: OpGraph, choice: SpanChoice) -> frozenset[int]:
    """The ops whose outputs a recompute choice keeps: its own `keep_ops`, plus every functional
    collective the early-stopped recompute would issue but not wait for (its first use lies at or
    past the span's last save, planner.tracing.collectives: an expert-parallel combine read by the
    block's final scatter). Re-issued, such a collective's buffer and work would stay registered,
    never waited, for the life of the process; kept, selective checkpointing returns it from its
    cache and the recompute communicates nothing for it (torchtitan's SAC keeps all-to-all outputs too)."""
    if choice.mode != "recompute":
        return choice.keep_ops
    stop = recompute_stop(graph, choice.span)
    cut = [
        issued
        for issued, used in collective_first_uses(graph).items()
        if choice.span.fwd_start <= issued < stop and (used is None or used >= stop)
    ]
    return choice.keep_ops | frozenset(cut) if cut else choice.keep_ops


def recompute_stop(graph: OpGraph, span: ModuleSpan) -> int:
    """The first forward op of a span that a recompute does not reach (its last save's position)."""
    key = ("recompute_stop", span.path, span.fwd_start, span.fwd_end)
    if key not in graph.derived:
        prefix = span.path + "."
        saves = [
            n
            for n, module in graph.pack_events
            if span.fwd_start <= n <= span.fwd_end and (module == span.path or module.startswith(prefix))
        ]
        graph.derived[key] = max(saves) if saves else span.fwd_end
    return graph.derived[key]


def held_inputs(graph: OpGraph, span: ModuleSpan) -> list[int]:
    """Inputs of a checkpointed span that die before its backward starts without the plan (no op
    saves them, or only ops before the span): the checkpoint saves its inputs regardless and holds
    them through the span's backward (a sequence-parallel block's norm output, gathered inside
    the span, is one)."""
    out = []
    for i in range(span.fwd_start, span.fwd_end):
        for tid in graph.ops[i].inputs:
            t = graph.tensors[tid]
            if t.alloc_op < span.fwd_start and t.category in ("activation", "temporary"):
                if t.free_op is not None and t.free_op < span.bwd_start and tid not in out:
                    out.append(tid)
    return out


def cached_outputs(
    graph: OpGraph, span: ModuleSpan, keep_ops: frozenset[int], dropped: Sequence[int]
) -> list[tuple[int, bool]]:
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


def natural_free_in_span(graph: OpGraph, tid: int, span: ModuleSpan) -> int:
    """Where a storage re-created by a span's recompute dies inside the replay (at the latest at
    the span's end, where the recompute's outputs are dropped)."""
    t = graph.tensors[tid]
    return min(t.natural_free_op if t.natural_free_op is not None else span.fwd_end, span.fwd_end)


def reload_op(graph: OpGraph, tid: int, span: ModuleSpan) -> int | None:
    """Where an offloaded storage comes back: autograd unpacks it when the backward node that
    needs it runs (the first backward op reading it; the span's backward start when none does).
    None when it is freed before the span's backward (nothing to bring back)."""
    t = graph.tensors[tid]
    if t.free_op is not None and t.free_op <= span.bwd_start:
        return None
    last = t.free_op - 1 if t.free_op is not None else len(graph.ops) - 1
    use = graph.first_backward_use().get(tid, last)
    return min(max(use, span.bwd_start), last)


# -- events on the curve ---------------------------------------------------------------------------
FREE, RELOAD, REPLAY, ALLOC = range(4)  # order of the events at one op, before its sample
SAMPLE = -1  # the storage of an event that marks a sample point inside a replay


class Event(NamedTuple):
    """A change of live bytes: before op `op` runs (len(ops): at the step's end; -1: before the step),
    at `stage`. `nbytes` is per device and signed (+ allocated or brought back, - freed or dropped).
    A replay's sample points are events of storage SAMPLE and 0 bytes naming the op just re-run."""

    op: int
    stage: int
    storage: int
    nbytes: int
    category: str = ""
    replayed: int = -1


@dataclass(frozen=True)
class Transfer:
    """An offloaded span's traffic on the one transfer link: `nbytes` stored to `target` once the
    span's forward ends (before op `ready_op`), and loaded back in its backward."""

    ready_op: int
    nbytes: int
    target: str


@dataclass(frozen=True)
class ChoiceEffect:
    """Everything one choice does to the step.

    `moved` are the storages whose lifetimes the choice rewrites; `events` are their whole new
    lifetimes plus the replay (re-created copies, sample points), in order within each op and stage.
    """

    moved: frozenset[int]
    events: tuple[Event, ...]
    recompute_flops: int
    recompute_s: float
    transfer: Transfer | None


def one_holder_each(
    moved: Sequence[frozenset[int]], events: Sequence[Sequence[Event]]
) -> list[tuple[frozenset[int], list[Event]]]:
    """Several choices' (moved storages, events) with each storage that more than one of them holds
    described once: an input that several checkpointed spans hold (a table made before the blocks
    and saved by none, as some rotary embeddings are) is one storage, live from its allocation to
    the last of their frees. The first choice that holds it keeps it; the others let it go."""
    counts = Counter(tid for m in moved for tid in m)
    shared = {tid for tid, n in counts.items() if n > 1}
    for m, evs in zip(moved, events, strict=True):  # only a plain hold (one allocation, one free) merges
        signs: dict[int, list[bool]] = defaultdict(list)
        for ev in evs:
            if ev.storage in shared and ev.storage in m:
                signs[ev.storage].append(ev.nbytes >= 0)
        shared -= {tid for tid, s in signs.items() if s != [True, False]}
    if not shared:
        return [(m, list(evs)) for m, evs in zip(moved, events, strict=True)]
    last_free: dict[int, Event] = {}
    for evs in events:
        for ev in evs:
            if ev.storage in shared and ev.nbytes < 0:
                seen = last_free.get(ev.storage)
                if seen is None or (ev.op, ev.stage) > (seen.op, seen.stage):
                    last_free[ev.storage] = ev
    out, held = [], set()
    for m, evs in zip(moved, events, strict=True):
        mine = {tid for tid in m & shared if tid not in held}
        held |= mine
        kept = [ev for ev in evs if ev.storage not in shared or (ev.storage in mine and ev.nbytes >= 0)]
        out.append((m - (shared - mine), kept + [last_free[tid] for tid in sorted(mine)]))
    return out


def storage_events(graph: OpGraph, tid: int, nbytes: int) -> Iterator[Event]:
    """A storage's lifetime without a plan: allocated by its op (-1: before the step), freed where
    the trace freed it (never when it outlives the step)."""
    t = graph.tensors[tid]
    yield Event(t.alloc_op, ALLOC, tid, nbytes, t.category)
    if t.free_op is not None:
        yield Event(t.free_op, FREE, tid, -nbytes, t.category)


def choice_effect(
    graph: OpGraph,
    choice: SpanChoice,
    sizes: Mapping[int, int],
    times: np.ndarray,
    host: CheckpointHost | None = None,
) -> ChoiceEffect:
    """The events of one choice, with `sizes` the per-device bytes of each storage, `times` the
    seconds of each op on the target and `host` what checkpointing's Python adds (None: nothing;
    costmodels.runtime.checkpoint_host_s): a selective recompute pays its per-op cost for every
    forward op of the span and every op its recompute reaches, kept ones included; a plain one for
    every op its recompute reaches.

    A dropped storage is allocated by its op and leaves where it would die unsaved. A recompute
    re-creates it in the replay just before the span's backward; an offload reloads it when its
    backward node needs it. Either way it then dies at its own backward free, or lives on when it
    outlived the step without the plan (as in torch: the re-created tensor is the one kept).
    """
    span = choice.span
    keep_ops = effective_keeps(graph, choice)
    dropped = dropped_tensors(graph, span, keep_ops)
    cached = cached_outputs(graph, span, keep_ops, dropped)
    events: list[Event] = []

    def add(op: int, stage: int, tid: int, sign: int) -> None:
        events.append(Event(op, stage, tid, sign * sizes[tid], graph.tensors[tid].category))

    for tid in dropped:
        t = graph.tensors[tid]
        add(t.alloc_op, ALLOC, tid, 1)
        add(dropped_from(graph, tid), FREE, tid, -1)
        at = reload_op(graph, tid, span) if choice.mode == "offload" else None
        if at is not None:
            add(at, RELOAD, tid, 1)
            if t.free_op is not None:
                add(t.free_op, FREE, tid, -1)
    popped = []
    for tid, in_replay in cached:
        t = graph.tensors[tid]
        add(t.alloc_op, ALLOC, tid, 1)
        if in_replay:
            popped.append(tid)
        else:
            add(max(span.bwd_end, t.free_op), FREE, tid, -1)
    held = held_inputs(graph, span) if choice.mode == "recompute" else []
    for tid in held:
        add(graph.tensors[tid].alloc_op, ALLOC, tid, 1)
        add(span.bwd_end, FREE, tid, -1)
    moved = frozenset(dropped) | {tid for tid, _ in cached} | frozenset(held)
    if choice.mode == "offload":
        transfer = Transfer(span.fwd_end, sum(sizes[tid] for tid in dropped), choice.target)
        return ChoiceEffect(moved, tuple(events), 0, 0.0, transfer)
    events += _replay(graph, span, keep_ops, dropped, popped, sizes)
    for tid in graph.buffers_written(span.path).values():  # the pre-forward copies its replay runs on
        events += [
            Event(span.fwd_start, ALLOC, tid, sizes[tid], "buffer"),
            Event(span.bwd_end, FREE, tid, -sizes[tid], "buffer"),
        ]
    redo = recompute_ops(graph, span, keep_ops, dropped)
    flops = sum(graph.ops[i].flops for i in redo)
    seconds = float(times[redo].sum()) if redo else 0.0
    host = host or CheckpointHost()
    replayed = recompute_stop(graph, span) - span.fwd_start if dropped else 0
    if keep_ops:
        seconds += host.selective_op_s * (span.fwd_end - span.fwd_start + replayed)
    else:
        seconds += host.replay_op_s * replayed
    return ChoiceEffect(moved, tuple(events), flops, seconds, None)


def choice_effects_at(graph: OpGraph, choices: Sequence[SpanChoice], config: TrainConfig) -> list[ChoiceEffect]:
    """:func:`choice_effect` of each choice at `config`'s per-device sizes on its target device,
    kept with the graph: the layouts of a search ask for the same choices at many GPU counts. An
    effect whose events touch no parameter or gradient storage (the ones ZeRO sharding scales)
    is the same at every scale and kept once; any other is kept per scale."""
    device = get_device(config.gpu)
    cache = graph.derived.setdefault(("choice_effects", device), {})
    scale = tuple(sorted(category_scale(graph, config).items()))
    sizes: dict[int, int] | None = None
    out = []
    for c in choices:
        effect = cache.get(c) or cache.get((c, scale))
        if effect is None:
            sizes = sizes if sizes is not None else storage_bytes(graph, config)
            effect = choice_effect(graph, c, sizes, op_times(graph, device), checkpoint_host_s(device))
            scaled = any(ev.category in SCALED_CATEGORIES for ev in effect.events)
            cache[(c, scale) if scaled else c] = effect
        out.append(effect)
    return out


def _replay(
    graph: OpGraph,
    span: ModuleSpan,
    keep_ops: frozenset[int],
    dropped: Sequence[int],
    popped: Sequence[int],
    sizes: Mapping[int, int],
) -> Iterator[Event]:
    """The recompute's replay just before the span's backward: each re-run op re-creates its
    outputs (a sample point follows it); a re-created dropped storage that the backward needs is
    held, the rest die where they naturally would inside the replay. `popped` are cached outputs
    of kept ops, alive since forward, that the replay takes back and lets die the same way."""
    b = span.bwd_start
    drop_set = set(dropped)
    local: dict[int, list[int]] = defaultdict(list)  # op index -> storages that die before it

    def event(tid: int, sign: int) -> Event:
        return Event(b, REPLAY, tid, sign * sizes[tid], graph.tensors[tid].category)

    for tid in popped:
        local[natural_free_in_span(graph, tid, span)].append(tid)
    for i in recompute_ops(graph, span, keep_ops, dropped):
        for k in sorted(k for k in local if k <= i):
            for tid in local.pop(k):
                yield event(tid, -1)
        for tid in graph.ops[i].allocs:
            t = graph.tensors[tid]
            yield event(tid, 1)
            if tid in drop_set and (t.free_op is None or t.free_op > b):
                if t.free_op is not None:  # held until its own backward free
                    yield Event(t.free_op, FREE, tid, -sizes[tid], t.category)
            else:
                local[natural_free_in_span(graph, tid, span)].append(tid)
        yield Event(b, REPLAY, SAMPLE, 0, "", i)
    for k in sorted(local):
        for tid in local[k]:
            yield event(tid, -1)


def exposed_transfer_s(transfers: Sequence[Transfer], times: np.ndarray, deadline_op: int, device: DeviceSpec) -> float:
    """Seconds of offload traffic not hidden behind compute, on the one transfer link.

    Stores queue on the link in the order their spans' forwards end and stall the step only if
    the link is still busy when op `deadline_op` (the backward's start) begins; loads happen when
    autograd unpacks a tensor (no prefetch), so every load is on the critical path. The link ends
    at max over k of (ready_k + the stores queued from k on): the solver prices it in that form.
    """
    if not transfers:
        return 0.0
    clock = np.concatenate([[0.0], np.cumsum(times)])  # clock[i] = start time of op i
    link = 0.0
    for tr in sorted(transfers, key=lambda x: x.ready_op):
        link = max(link, clock[tr.ready_op]) + transfer_time_s(tr.nbytes, device, tr.target)
    stores = max(0.0, link - clock[deadline_op])
    loads = sum(transfer_time_s(tr.nbytes, device, tr.target) for tr in transfers)
    return stores + loads
