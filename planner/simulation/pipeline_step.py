"""Memory of every pipeline rank over one step: the traced step cut into stages, replayed per microbatch
in the order torch's schedule runs it (planner.simulation.pipeline_schedule).

One trace at the microbatch's batch serves every stage. Each stage's storages are sorted by
where they live, as ``torch.distributed.pipelining`` (stage.py, torch 2.13) keeps them:

- a stage's own forward storages freed in its backward (saved activations) live from F(m) to
  B(m); what its forward hands on (the stage's output, in ``fwd_cache``) lives until B(m) ends;
- with a split backward, I(m) frees what only the input gradients need; what the weight-gradient
  ops read stays until W(m). Stage 0 has no input gradient: its I does nothing and W runs the
  whole backward (as torch does);
- a non-first stage keeps one receive buffer per microbatch for its input, and the input's
  gradient lands in that buffer's ``.grad`` at B(m) and stays there until the next step; a
  non-last stage keeps one receive buffer per microbatch for its output's gradient;
- tensors an earlier stage made and this one reads besides its input (rotary tables, masks) are
  made again by each microbatch's forward, as a stage module does;
- parameters, buffers and optimizer states of the stage's modules; gradients are allocated by
  the first microbatch's backward and accumulated into by the others (a transient each, until
  AccumulateGrad adds it in);
- the batch's inputs (ids on the first stage, labels on the last) are the whole batch;
- FSDP2 (``--zero 3 --dp N``): the buffers of planner.simulation.fsdp at each replayed op;
- gradient accumulation over pipeline steps (``--grad-accum N``): a later step starts with the
  stage's gradients held and every backward accumulates into them (the step replayed is a later one,
  the heavier).

The last stage's outputs are not kept for the caller (``schedule.step(..., return_outputs=False)``,
as torchtitan runs it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from costmodels.hardware import get_device
from costmodels.memory import get_precision, model_state_bytes
from planner.config import TrainConfig
from planner.errors import MemplanError
from planner.simulation.costs import SCALED_CATEGORIES, StepCosts, op_times, storage_bytes
from planner.simulation.effects import (
    FREE,
    REPLAY,
    SAMPLE,
    ChoiceEffect,
    SpanChoice,
    choice_effects_at,
    one_holder_each,
)
from planner.simulation.fsdp import state_shape
from planner.simulation.memo import memo
from planner.simulation.pipeline_fsdp import StageFsdp, StageFsdpState, stage_fsdp, unshard_plan
from planner.simulation.pipeline_schedule import INPUT_GRADIENT_KINDS, PipelineAction, PipelineSchedule
from planner.simulation.pipeline_split import StageCut, op_stages, tied_gradients, weight_gradient_ops
from planner.simulation.step import Timeline, gradient_accumulated_at
from planner.tracing.graph import CATEGORIES, CATEGORY_INDEX, OpGraph

__all__ = ["StageMemory", "StageEffect", "stage_effects", "replay_rows", "stage_programs", "replay_rank"]

_NC = len(CATEGORIES)
HEAD, TAIL = -1, -2  # rows before the first sampled op and after the last
REDUCE_GRAD = "REDUCE_GRAD (FSDP2's reduce-scatter)"  # the row before the optimizer step's


@dataclass
class _Program:
    """One action kind of one stage: the ops it samples, bytes applied before each, and at its ends."""

    ops: np.ndarray
    delta: np.ndarray  # (len(ops), categories)
    head: np.ndarray = field(default_factory=lambda: np.zeros(_NC, dtype=np.int64))
    tail: np.ndarray = field(default_factory=lambda: np.zeros(_NC, dtype=np.int64))
    pending: list[tuple[int, int, int, bool]] = field(default_factory=list)  # add()s not yet on the rows

    def add(self, op: int, category: str, nbytes: int, after: bool = False) -> None:
        """Bytes applied before op `op` samples (`after`: right after it), or at HEAD / TAIL. Where a
        recompute's replay adds sample rows before op `op` (the op appears more than once), frees
        land before the replay (its first row) and allocations after it (the op's own row). They
        reach the rows at :meth:`settle`."""
        if op == HEAD:
            self.head[CATEGORY_INDEX[category]] += nbytes
        else:
            self.pending.append((op, CATEGORY_INDEX[category], nbytes, after))

    def settle(self) -> None:
        """Put every pending add() on its row (or the tail), all at once."""
        if not self.pending:
            return
        op, cat, nbytes, after = np.array(self.pending, dtype=np.int64).T  # one conversion: 2x faster than per column
        self.pending.clear()
        left = np.searchsorted(self.ops, op, side="left")
        right = np.searchsorted(self.ops, op, side="right")
        pos = np.where(after.astype(bool), right, np.where((nbytes < 0) | (right == left), left, right - 1))
        tail = (op == TAIL) | (pos >= len(self.ops))
        np.add.at(self.tail, cat[tail], nbytes[tail])
        np.add.at(self.delta, (pos[~tail], cat[~tail]), nbytes[~tail])

    def add_row(self, pos: int, category: str, nbytes: int) -> None:
        """Bytes applied before row `pos` samples (a replay's rows)."""
        self.delta[pos, CATEGORY_INDEX[category]] += nbytes

    def plus(self, other: _Program) -> _Program:
        """Both programs' bytes on the same rows."""
        assert np.array_equal(self.ops, other.ops), "programs on different rows"
        assert not self.pending and not other.pending, "settle() the programs first"
        return _Program(self.ops, self.delta + other.delta, self.head + other.head, self.tail + other.tail)

    def minus(self, other: _Program) -> _Program:
        """This program's bytes less another's on the same rows (what a choice changes)."""
        assert np.array_equal(self.ops, other.ops), "programs on different rows"
        assert not self.pending and not other.pending, "settle() the programs first"
        return _Program(self.ops, self.delta - other.delta, self.head - other.head, self.tail - other.tail)


def _program(ops, rows: Mapping[int, int] | None = None) -> _Program:
    """A program sampling `ops`; `rows` (op -> n) adds n sample rows before op (a replay's)."""
    ops = list(ops)
    if rows:
        present = set(ops)
        ops += [op for op, n in rows.items() if op in present for _ in range(n)]
    ops = np.asarray(sorted(ops), dtype=np.int64)
    return _Program(ops, np.zeros((len(ops), _NC), dtype=np.int64))


@dataclass(frozen=True)
class StageMemory:
    """A stage's persistent bytes and its per-action programs (F, B, I, W; ``*_first`` for the first
    backward, which allocates the gradients the others accumulate into; ``B_held`` for a whole B
    where the schedule splits the stage's other backwards, whose recomputes hold what they make)."""

    index: int
    persistent: np.ndarray  # (categories,) live throughout the step
    sent_bytes: np.ndarray  # (categories,) the output one microbatch's F sends on
    grad_sent_bytes: np.ndarray  # (categories,) the input gradient one microbatch's backward sends back
    programs: dict[str, _Program]
    num_parameters: int
    optimizer_bytes: int
    optimizer_step_temporary: int
    param_shapes: tuple[tuple[int, ...], ...]
    fsdp: StageFsdp | None = None  # FSDP2's units and gradients on this stage (--zero 3 --dp > 1)
    # the last stage's output, which its loss reads: freed by its backward, or later where the
    # schedule's loop still holds it (PipelineSchedule.output_released_after)
    loss_output: np.ndarray = field(default_factory=lambda: np.zeros(_NC, dtype=np.int64))


def _readers(graph: OpGraph) -> dict[int, list[int]]:
    """Storage -> the ops that read it (kept while the graph lives)."""
    return memo("readers", graph, (), lambda: _make_readers(graph))


def _make_readers(graph: OpGraph) -> dict[int, list[int]]:
    out: dict[int, list[int]] = defaultdict(list)
    for op in graph.ops:
        for tid in op.inputs:
            out[tid].append(op.index)
    return out


def _retained_forward_ops(graph: OpGraph, stage_of: np.ndarray, in_bwd: np.ndarray) -> set[int]:
    """Forward ops whose autograd nodes a split backward's I keeps for W: those that read a
    parameter and every op of the same stage they depend on."""
    out: set[int] = set()
    todo = [
        op.index
        for op in graph.ops[: graph.backward_start]
        if any(graph.tensors[t].category == "parameter" for t in op.inputs)
    ]
    while todo:
        i = todo.pop()
        if i in out:
            continue
        out.add(i)
        for tid in graph.ops[i].inputs:
            a = graph.tensors[tid].alloc_op
            if a >= 0 and not in_bwd[a] and stage_of[a] == stage_of[i]:
                todo.append(a)
    return out


@dataclass(frozen=True)
class _Context:
    """What stage_programs reads of a graph for one split (kept while the graph lives)."""

    stage_of: np.ndarray
    in_bwd: np.ndarray
    sizes: dict[int, int]
    readers: dict[int, list[int]]
    weight_ops: frozenset[int]
    w_read: set[int]
    retained: set[int]
    times: np.ndarray
    # a weight tied across stages (embeddings and head): each stage's own gradient of it, and the
    # sums that accumulate them in the whole-model trace, which no stage makes (tied_gradients)
    own_gradients: frozenset[int]
    cross_stage_sums: frozenset[int]


def _sizing(config: TrainConfig) -> TrainConfig:
    """The part of a config that a stage's storages and programs depend on: not the schedule, the
    number of microbatches, the accumulation steps or the replica's batch (the trace is at one microbatch)."""
    return config.with_(
        pp=1,
        pp_schedule="1f1b",
        pp_split="uniform",
        microbatches=None,
        stages_per_rank=None,
        batch_size=1,
        grad_accum_steps=1,
    )


def _context(graph: OpGraph, config: TrainConfig, cuts: tuple[StageCut, ...]) -> _Context:
    return memo("context", graph, (_sizing(config), cuts), lambda: _make_context(graph, config, cuts))


def _make_context(graph: OpGraph, config: TrainConfig, cuts: tuple[StageCut, ...]) -> _Context:
    stage_of, in_bwd = op_stages(graph, cuts)
    weight_ops = weight_gradient_ops(graph)
    w_read = {tid for i in weight_ops for tid in graph.ops[i].inputs} | {
        tid for i in weight_ops for tid in graph.ops[i].allocs
    }
    return _Context(
        stage_of,
        in_bwd,
        storage_bytes(graph, config),
        _readers(graph),
        weight_ops,
        w_read,
        _retained_forward_ops(graph, stage_of, in_bwd),
        op_times(graph, get_device(config.gpu)),
        *tied_gradients(graph, stage_of, in_bwd),
    )


@dataclass(frozen=True)
class StageEffect:
    """A recompute choice on a pipeline stage: its stage, the storages it moves there (those its
    stage made in forward; a checkpointed block's input from the stage before is already held in a
    receive buffer) and its events (:func:`planner.simulation.effects.choice_effect`)."""

    stage: int
    choice: SpanChoice
    effect: ChoiceEffect
    moved: frozenset[int]

    @property
    def replay_samples(self) -> tuple[int, int]:
        """(op before which its replay runs, sample rows the replay adds there)."""
        return self.choice.span.bwd_start, sum(1 for ev in self.effect.events if ev.storage == SAMPLE)


def stage_effects(
    graph: OpGraph, config: TrainConfig, cuts: tuple[StageCut, ...], choices: Sequence[SpanChoice]
) -> list[StageEffect]:
    """Each choice's effect on its stage; a choice must lie inside one stage and recompute."""
    key = (_sizing(config), cuts, tuple(choices))
    return memo("effects", graph, key, lambda: _stage_effects(graph, config, cuts, choices))


def _stage_effects(
    graph: OpGraph, config: TrainConfig, cuts: tuple[StageCut, ...], choices: Sequence[SpanChoice]
) -> list[StageEffect]:
    ctx = _context(graph, config, cuts)
    out = []
    for c, eff in zip(choices, choice_effects_at(graph, choices, config), strict=True):
        span = c.span
        s = int(ctx.stage_of[span.fwd_start])
        inside = int(ctx.stage_of[span.fwd_end - 1]) == s == int(ctx.stage_of[span.bwd_start])
        if c.mode != "recompute" or not inside or ctx.in_bwd[span.fwd_start]:
            what = "offloads" if c.mode != "recompute" else "spans more than one stage"
            raise MemplanError(
                f"a pipeline plan recomputes modules inside one stage; the choice on '{span.path}' {what}"
            )
        moved = frozenset(
            tid
            for tid in eff.moved
            if (a := graph.tensors[tid].alloc_op) >= 0 and not ctx.in_bwd[a] and int(ctx.stage_of[a]) == s
        )
        out.append(StageEffect(s, c, eff, moved))
    return out


def replay_rows(effects: Sequence[StageEffect]) -> dict[int, dict[int, int]]:
    """Stage -> (op -> sample rows its backward programs add before the op) for these effects."""
    out: dict[int, dict[int, int]] = defaultdict(dict)
    for e in effects:
        b, n = e.replay_samples
        if n:
            out[e.stage][b] = max(out[e.stage].get(b, 0), n)
    return dict(out)


def stage_programs(
    graph: OpGraph,
    config: TrainConfig,
    cuts: tuple[StageCut, ...],
    choices: Sequence[SpanChoice | StageEffect] = (),
    *,
    only: Collection[int] | None = None,
    rows: Mapping[int, Mapping[int, int]] | None = None,
) -> list[StageMemory]:
    """Every stage's persistent bytes and replay programs, from one trace at the microbatch's batch.
    What a stage sends (its output, its input's gradient) is allocated by the programs and freed
    by the replay, where both the stage and the schedule's send request have let go of it.

    `choices` (recompute span choices, each inside one stage) move what they drop to their
    events, as :func:`planner.simulation.step.simulate` does: a recompute's replay adds sample rows
    before its span's backward in the stage's B programs (`rows`: stage -> op -> rows, default
    the choices' own; give a superset to line several plans' programs up row for row). `only`:
    place just these storages (and the choices' events), for what a choice changes."""
    effects = [
        c if isinstance(c, StageEffect) else e
        for c in choices
        for e in ([c] if isinstance(c, StageEffect) else stage_effects(graph, config, cuts, [c]))
    ]
    if only is None and rows is None:  # the whole step: the same for every microbatch count
        key = (_sizing(config), cuts, tuple(e.choice for e in effects))
        placed = memo("placed", graph, key, lambda: _place_step(graph, config, cuts, effects))
    else:
        placed = _place(graph, config, cuts, effects, only, rows)
    m = config.num_microbatches
    out = []
    precision = get_precision(config.precision)
    foreach = get_device(config.gpu).is_cuda
    sharded = config.zero_stage >= 3 and config.shard_ranks > 1
    ctx = _context(graph, config, cuts) if sharded else None
    for c in cuts:
        fsdp = (
            memo(
                "stage_fsdp",
                graph,
                (_sizing(config), c),
                lambda c=c: stage_fsdp(graph, config, c, ctx.sizes, ctx.cross_stage_sums),
            )
            if ctx is not None
            else None
        )
        shapes = placed.param_shapes[c.index]
        states = model_state_bytes(
            shapes, precision, config.optimizer, config.zero_stage, config.shard_ranks, foreach=foreach
        )
        out.append(
            StageMemory(
                index=c.index,
                persistent=placed.persistent[c.index] + m * placed.per_microbatch[c.index],
                sent_bytes=placed.sent_bytes[c.index],
                grad_sent_bytes=placed.grad_sent_bytes[c.index],
                programs=placed.programs[c.index],
                num_parameters=states.num_parameters,
                optimizer_bytes=0 if config.cpu_offload else states.optimizer,
                optimizer_step_temporary=0 if config.cpu_offload else states.optimizer_step_temporary,
                param_shapes=shapes,
                fsdp=fsdp,
                loss_output=placed.loss_output[c.index],
            )
        )
    return out


@dataclass(frozen=True)
class _Placed:
    """Every stage's storages placed on its programs (read-only; shared by cached callers):
    persistent bytes, those held once per microbatch, what one microbatch sends on and back."""

    persistent: list[np.ndarray]
    per_microbatch: list[np.ndarray]
    sent_bytes: list[np.ndarray]
    grad_sent_bytes: list[np.ndarray]
    programs: list[dict[str, _Program]]
    param_shapes: list[tuple[tuple[int, ...], ...]]
    loss_output: list[np.ndarray]  # what the last stage's forward returns to the loss

    def plus(self, other: _Placed) -> _Placed:
        """Both placements together (of disjoint storages, on the same rows); the parameter shapes are `other`'s."""
        return _Placed(
            [a + b for a, b in zip(self.persistent, other.persistent, strict=True)],
            [a + b for a, b in zip(self.per_microbatch, other.per_microbatch, strict=True)],
            [a + b for a, b in zip(self.sent_bytes, other.sent_bytes, strict=True)],
            [a + b for a, b in zip(self.grad_sent_bytes, other.grad_sent_bytes, strict=True)],
            [{k: p[k].plus(q[k]) for k in p} for p, q in zip(self.programs, other.programs, strict=True)],
            other.param_shapes,
            [a + b for a, b in zip(self.loss_output, other.loss_output, strict=True)],
        )


def _place_step(graph: OpGraph, config: TrainConfig, cuts: tuple[StageCut, ...], effects: list[StageEffect]) -> _Placed:
    """Every storage of the step placed. What ZeRO does not scale (all but parameters and gradients)
    is placed once for every shard count (a layout search asks at every GPU count), the parameters
    and gradients for this config; a choice whose events touch those is placed whole."""
    touched = {graph.tensors[tid].category for e in effects for tid in e.moved}
    touched.update(ev.category for e in effects for ev in e.effect.events)
    if touched.intersection(SCALED_CATEGORIES):
        return _place(graph, config, cuts, effects, None, None)
    scaled = memo("scaled_storages", graph, (), lambda: _scaled_storages(graph))
    unscaled = memo("unscaled_storages", graph, (), lambda: _unscaled_storages(graph))
    rows = replay_rows(effects)
    # an unscaled storage's bytes are its traced bytes whatever the config: the key needs no config
    key = (cuts, tuple(e.choice for e in effects))
    fixed = memo("placed_unscaled", graph, key, lambda: _place(graph, config, cuts, effects, unscaled, rows))
    return fixed.plus(_place(graph, config, cuts, [], scaled, rows))


def _scaled_storages(graph: OpGraph) -> list[int]:
    return [t.id for t in graph.tensors.values() if t.category in SCALED_CATEGORIES]


def _unscaled_storages(graph: OpGraph) -> list[int]:
    return [t.id for t in graph.tensors.values() if t.category not in SCALED_CATEGORIES]


def _place(
    graph: OpGraph,
    config: TrainConfig,
    cuts: tuple[StageCut, ...],
    effects: list[StageEffect],
    only: Collection[int] | None,
    rows: Mapping[int, Mapping[int, int]] | None,
) -> _Placed:
    n_ops = len(graph.ops)
    last = len(cuts) - 1
    ctx = _context(graph, config, cuts)
    stage_of, in_bwd, sizes, readers = ctx.stage_of, ctx.in_bwd, ctx.sizes, ctx.readers
    weight_ops, w_read, retained = ctx.weight_ops, ctx.w_read, ctx.retained
    own_gradients, cross_stage_sums = ctx.own_gradients, ctx.cross_stage_sums
    accumulated_at = gradient_accumulated_at(graph)
    phase = [op.phase for op in graph.ops]
    regions = sorted(graph.regions, key=lambda r: r.fwd_start)
    rows = replay_rows(effects) if rows is None else rows
    moved = set().union(*(e.moved for e in effects)) if effects else set()
    effects = [
        replace(e, moved=m, effect=replace(e.effect, events=tuple(events)))
        for e, (m, events) in zip(
            effects, one_holder_each([e.moved for e in effects], [e.effect.events for e in effects]), strict=True
        )
    ]

    fwd_ops = [range(c.fwd_start, c.fwd_end) for c in cuts]
    bwd_ops = [range(c.bwd_start, c.bwd_end) for c in cuts]
    persistent = [np.zeros(_NC, dtype=np.int64) for _ in cuts]
    per_microbatch = [np.zeros(_NC, dtype=np.int64) for _ in cuts]
    sent_bytes = [np.zeros(_NC, dtype=np.int64) for _ in cuts]
    grad_sent_bytes = [np.zeros(_NC, dtype=np.int64) for _ in cuts]
    loss_output = [np.zeros(_NC, dtype=np.int64) for _ in cuts]
    progs = []
    for c in cuts:
        w = [i for i in bwd_ops[c.index] if i in weight_ops]
        i_ops = [i for i in bwd_ops[c.index] if i not in weight_ops]
        if c.index == 0:  # torch: stage 0's I is a no-op, its W runs the whole backward
            w, i_ops = list(bwd_ops[0]), []
        progs.append(
            {
                "F": _program(fwd_ops[c.index]),
                "B_first": _program(bwd_ops[c.index], rows.get(c.index)),
                "B": _program(bwd_ops[c.index], rows.get(c.index)),
                "I": _program(i_ops),
                "W_first": _program(w),
                "W": _program(w),
            }
        )
    param_shapes: list[list[tuple[int, ...]]] = [[] for _ in cuts]

    def backward_event(s: int, op: int, tid: int, nbytes: int, first_only: bool = False, after=False) -> None:
        """A backward event on stage s, in B and in the split backward's I or W. I runs with
        ``retain_graph``: the autograd nodes from the weight-reading ops down to the stage's input
        stay, with what they saved, until W; so do the gradients W's ops read (torch keeps them in
        ``param_groups``), each until its last reader. Stage 0's W is its whole backward."""
        cat = "gradient" if tid in own_gradients else graph.tensors[tid].category
        p = progs[s]
        t = graph.tensors[tid]
        deferred = s > 0 and (tid in w_read or any(o in retained for o in t.saved_by))
        split, row, w_after = ("W" if s == 0 or op in weight_ops else "I"), op, after
        if nbytes < 0 and deferred:  # freed after the last W op that reads it, else when W ends
            w_readers = [i for i in readers.get(tid, ()) if i in weight_ops and stage_of[i] == s]
            split, row, w_after = "W", max(w_readers, default=TAIL), bool(w_readers)
        elif nbytes < 0 and s > 0 and t.saved_by:  # retain_graph: kept until I's autograd.grad returns
            row = TAIL
        p["B_first"].add(op, cat, nbytes, after)
        if split == "W":
            p["W_first"].add(row, cat, nbytes, w_after)
        if not first_only:
            p["B"].add(op, cat, nbytes, after)
            p[split].add(row, cat, nbytes, w_after)

    def backward_pair(s: int, alloc: int, free: int, tid: int, nbytes: int) -> None:
        backward_event(s, alloc, tid, nbytes)
        backward_event(s, free, tid, -nbytes)

    tensors = graph.tensors.values() if only is None else (graph.tensors[tid] for tid in only)
    for t in tensors:
        z = sizes[t.id]
        if z == 0 or t.id in moved or t.id in cross_stage_sums:
            continue
        reads = readers.get(t.id, ())
        f = t.free_op if t.free_op is not None and t.free_op < n_ops else None
        if t.alloc_op < 0:  # before the step: parameters, buffers, the batch
            for s in sorted({int(stage_of[i]) for i in reads}):
                (per_microbatch if t.category == "activation" else persistent)[s][CATEGORY_INDEX[t.category]] += z
                if t.category == "parameter":
                    param_shapes[s].append(state_shape(graph, t.id, config))
            continue
        a = t.alloc_op
        sa, a_bwd = int(stage_of[a]), bool(in_bwd[a])
        freed_here = f is not None and int(stage_of[f]) == sa
        if not a_bwd:
            sent = sa < last and a >= regions[cuts[sa].block_end - 1].fwd_start and any(stage_of[i] > sa for i in reads)
            # the last stage's output (what its loss_fn reads) stays in fwd_cache until its backward
            output = sent or (sa == last and graph.ops[a].phase == "forward" and any(phase[i] == "loss" for i in reads))
            progs[sa]["F"].add(a, t.category, z)
            if sent:
                sent_bytes[sa][CATEGORY_INDEX[t.category]] += z
            elif output:
                backward_event(sa, TAIL, t.id, -z)
                loss_output[sa][CATEGORY_INDEX[t.category]] += z
            elif freed_here and not in_bwd[f]:
                progs[sa]["F"].add(f, t.category, -z)
            elif f is not None and not in_bwd[f] and all(stage_of[i] == sa for i in reads):
                progs[sa]["F"].add(TAIL, t.category, -z)  # dies when the stage's forward returns
            else:  # saved for the backward, or outlives it
                backward_event(sa, f if freed_here else TAIL, t.id, -z)
            # later stages that read it: their input (a receive buffer per microbatch) or a tensor
            # they make again in each forward
            for s in sorted({int(stage_of[i]) for i in reads} - {sa}):
                if s < sa:
                    continue
                boundary = s == sa + 1 and a >= regions[cuts[sa].block_end - 1].fwd_start
                if boundary:
                    per_microbatch[s][CATEGORY_INDEX[t.category]] += z
                    continue
                read_in_bwd = any(stage_of[i] == s and in_bwd[i] for i in reads)
                progs[s]["F"].add(HEAD, t.category, z)
                if read_in_bwd or any(stage_of[i] == s for i in t.saved_by):
                    backward_event(s, TAIL, t.id, -z)
                else:
                    progs[s]["F"].add(TAIL, t.category, -z)
            continue
        # allocated in sa's backward
        if (t.category == "gradient" and t.free_op is None) or t.id in own_gradients:
            backward_event(sa, a, t.id, z, first_only=True)
            p = progs[sa]
            for key in ("B", "W"):  # a later microbatch's: added into the one held, then freed
                p[key].add(a, "gradient", z)
                p[key].add(accumulated_at.get(t.id, a), "gradient", -z, after=True)
            continue
        earlier_reads = {int(stage_of[i]) for i in reads if int(stage_of[i]) < sa}
        if freed_here and in_bwd[f]:
            backward_pair(sa, a, f, t.id, z)
        elif sa > 0 and earlier_reads:  # the input's gradient, sent to the stage before
            backward_event(sa, a, t.id, z)
            grad_sent_bytes[sa][CATEGORY_INDEX[t.category]] += z
        else:
            backward_pair(sa, a, TAIL, t.id, z)
        for s in earlier_reads:  # a gradient received from a later stage: one buffer per microbatch
            if s == sa - 1:
                per_microbatch[s][CATEGORY_INDEX[t.category]] += z
    for e in effects:
        _place_effect(graph, cuts[e.stage], e, progs[e.stage], rows.get(e.stage, {}), backward_event)
    for p in progs:
        for key, prog in p.items():
            if key != _HELD_MOVES:
                prog.settle()
        _with_held(p)
    return _Placed(
        persistent, per_microbatch, sent_bytes, grad_sent_bytes, progs, [tuple(p) for p in param_shapes], loss_output
    )


def _place_effect(graph: OpGraph, cut: StageCut, e: StageEffect, p: dict[str, _Program], rows, backward_event) -> None:
    """A choice's events on its stage's programs: allocations and the drop in F (a drop after the
    stage's forward returns at its end), the replay at its rows before the span's backward in B
    (net in the split backward's I, or W on stage 0), the rest in the backward; a re-created storage
    that outlived the step dies at the end of B, as the stage's saved tensors do. Past stage 0 a
    split backward's recompute (:class:`planner.runtime.early_recompute.EarlyCheckpoint`, read more
    than once) holds all it made, and the checkpoint's inputs, until the stage's graph is freed at
    the end of W."""
    b = e.choice.span.bwd_start
    own_rows = rows.get(b, 0)
    first_row = int(np.searchsorted(p["B"].ops, b, side="left"))
    split = ("W_first", "W") if e.stage == 0 else ("I",)
    in_backward = _held_until_w(graph, p, backward_event, e)
    sampled = 0
    net: dict[int, int] = defaultdict(int)
    freed: set[int] = set()
    for ev in e.effect.events:
        if ev.storage == SAMPLE:
            sampled += 1
            continue
        if ev.storage not in e.moved and ev.category != "buffer":
            continue  # a block input another stage made: this stage holds it in a receive buffer
        net[ev.storage] += ev.nbytes
        first_free = ev.nbytes < 0 and ev.storage not in freed
        if ev.nbytes < 0:
            freed.add(ev.storage)
        if ev.op == b and ev.stage == REPLAY:
            row = first_row + min(sampled, own_rows)
            for key in ("B_first", "B"):
                p[key].add_row(row, ev.category, ev.nbytes)
            for key in split:
                p[key].add(b, ev.category, ev.nbytes)
        elif ev.op < cut.fwd_end:
            p["F"].add(ev.op, ev.category, ev.nbytes)
        elif ev.op < cut.bwd_start or (first_free and ev.stage == FREE and ev.op <= graph.backward_start):
            p["F"].add(TAIL, ev.category, ev.nbytes)
        else:
            in_backward(ev.op, ev.storage, ev.nbytes)
    for tid, left in net.items():
        if left:
            in_backward(TAIL, tid, -left)


def _held_until_w(graph: OpGraph, p: dict[str, _Program], backward_event, e: StageEffect):
    """A recompute choice's backward event on its stage: where it happens in B. Past stage 0, where
    the schedule splits the stage's backward, memplan's checkpoint holds what the recompute made
    until autograd lets go of the block: a free moves to W's end, and in a whole B (DualPipeV runs
    some) to the end of the span's backward (``B_held``, settled by :func:`_with_held`)."""

    def event(op: int, tid: int, nbytes: int) -> None:
        if e.stage == 0 or nbytes > 0:
            backward_event(e.stage, op, tid, nbytes)
            return
        category = graph.tensors[tid].category
        for key in ("B_first", "B"):
            p[key].add(op, category, nbytes)
        if op != TAIL and op < e.choice.span.bwd_end:
            p.setdefault(_HELD_MOVES, []).append((op, e.choice.span.bwd_end, CATEGORY_INDEX[category], nbytes))
        for key in ("W_first", "W"):
            p[key].add(TAIL, category, nbytes)

    return event


_HELD_MOVES = "held_moves"  # a stage's frees that B_held makes later: (op, later op, category, bytes)


def _with_held(p: dict) -> None:
    """Add ``B_held`` and ``B_held_first``: B's programs with the held frees moved later (the same
    programs where nothing moves)."""
    moves = p.pop(_HELD_MOVES, [])
    if not moves:
        p["B_held"], p["B_held_first"] = p["B"], p["B_first"]
        return
    ops = p["B"].ops
    change = _Program(ops, np.zeros_like(p["B"].delta))
    for op, later, category, nbytes in moves:  # a free sits on the first row of its op (see _Program.settle)
        change.delta[int(np.searchsorted(ops, op, side="left")), category] -= nbytes
        at = int(np.searchsorted(ops, later, side="left"))
        if at < len(ops):
            change.delta[at, category] += nbytes
        else:
            change.tail[category] += nbytes
    p["B_held"], p["B_held_first"] = p["B"].plus(change), p["B_first"].plus(change)


def _phase_names(graph: OpGraph) -> np.ndarray:
    """Phase of each sample position: index 0 the step's start, i + 1 op i, the last the optimizer."""
    if "phase_names" not in graph.derived:
        names = ["start", *(op.phase for op in graph.ops), "optimizer"]
        graph.derived["phase_names"] = np.array(names, dtype=object)
    return graph.derived["phase_names"]


def _send_frees(stages: list[StageMemory], schedule: PipelineSchedule, rank: int) -> dict[int, np.ndarray]:
    """Action index -> bytes freed after it: each sent tensor once its stage is done with it (an
    output after its last backward action, a gradient after the one that made it) and the
    schedule has dropped its send request; one handed to a stage on the same rank at once."""
    actions = schedule.compute(rank)
    own = set(schedule.stages(rank))
    last_use: dict[tuple[int, str, int], int] = {}
    made: dict[tuple[int, str, int], int] = {}  # an output or input gradient -> the action that made it
    for k, a in enumerate(actions):
        if a.kind == "F":
            made[(a.stage, "F", a.microbatch)] = k
        if a.kind in ("B", "W"):
            last_use[(a.stage, "F", a.microbatch)] = k
        if a.kind in INPUT_GRADIENT_KINDS:
            last_use[(a.stage, "B", a.microbatch)] = k
            made[(a.stage, "B", a.microbatch)] = k
    out: dict[int, np.ndarray] = defaultdict(lambda: np.zeros(_NC, dtype=np.int64))
    for (stage, kind, mb), k in last_use.items():
        nbytes = stages[stage].sent_bytes if kind == "F" else stages[stage].grad_sent_bytes
        if not nbytes.any():
            continue
        if (stage + 1 if kind == "F" else stage - 1) in own:
            # handed to a stage on this rank as soon as it is made (set_local_fwd_input /
            # set_local_bwd_input), it becomes that stage's receive buffer for this microbatch
            # (counted there), whose previous tensor is dropped then
            out[made[(stage, kind, mb)]] += nbytes
        elif kind == "B" and actions[k].kind == "I":  # I leaves the input's gradient in its .grad
            out[len(actions) - 1] += nbytes
        else:
            out[max(k, schedule.released_after(rank, stage, kind, mb))] += nbytes
    return dict(out)


_FSDP_COLUMNS = [CATEGORY_INDEX["parameter"], CATEGORY_INDEX["gradient"]]


def _loop_holds(
    graph: OpGraph, stages: list[StageMemory], schedule: PipelineSchedule, rank: int
) -> dict[int, list[tuple[np.ndarray, int]]]:
    """Action index -> (bytes, up to which op) a single-stage schedule's loop holds beyond the
    programs: the last stage's output, which the loop keeps in a local until the next forward
    returns (1F1B's last stage: through that forward, up to its loss), after its backward freed it."""
    actions = schedule.compute(rank)
    holds: dict[int, list[tuple[np.ndarray, int]]] = defaultdict(list)
    backward = {(a.stage, a.microbatch): k for k, a in enumerate(actions) if a.kind in ("B", "W")}
    loss_start = _loss_start(graph)
    for a in actions:
        nbytes = stages[a.stage].loss_output
        released = schedule.output_released_after(rank, a.stage, a.microbatch) if a.kind == "F" else None
        if released is None or not nbytes.any() or released <= backward.get((a.stage, a.microbatch), len(actions)):
            continue
        for k in range(backward[(a.stage, a.microbatch)] + 1, released + 1):
            holds[k].append((nbytes, loss_start if k == released else len(graph.ops)))
    return holds


def _loss_start(graph: OpGraph) -> int:
    """The first op of the loss (after every op when there is none)."""
    if "loss_start" not in graph.derived:
        graph.derived["loss_start"] = next((op.index for op in graph.ops if op.phase == "loss"), len(graph.ops))
    return graph.derived["loss_start"]


def _last_backward(actions: list[PipelineAction]) -> dict[int, int]:
    """Stage -> the index of its last backward action (B, or W under a split backward)."""
    return {a.stage: k for k, a in enumerate(actions) if a.kind in ("B", "W")}


def _reduce_peak(states: list[StageFsdpState], reducing: list[StageFsdpState]) -> np.ndarray:
    """The highest instant of REDUCE_GRAD of the stages `reducing`, beyond the sharded gradients and
    what every stage of `states` holds: each block (the last first, the root last) reduce-scattered
    through an input buffer in the reduce dtype, its unsharded gradients and gathered parameters
    freed after it."""
    out = np.zeros(_NC, dtype=np.int64)
    held = [list(state.held_bytes()) for state in states]
    for i, state in enumerate(states):
        if state not in reducing:
            continue
        f = state.fsdp
        units = [*range(len(f.block_bytes) - 1, -1, -1), len(f.block_bytes)]  # blocks backward, then the root
        for u in units:
            param, grad = sum(h[0] for h in held), sum(h[1] for h in held)
            if param + grad + f.reduce_input_bytes[u] > out.sum():
                out[:] = 0
                out[CATEGORY_INDEX["parameter"]], out[CATEGORY_INDEX["gradient"]] = (
                    param,
                    grad + f.reduce_input_bytes[u],
                )
            held[i][0] -= f.block_bytes[u] if u < len(f.block_bytes) else f.root_bytes
            held[i][1] -= f.unit_gradient_bytes[u]
    return out


def _end_name(at: int, reducing: bool, num_ops: int) -> str:
    if reducing:
        return REDUCE_GRAD
    return "optimizer.step" if at >= num_ops else "step start"


def _net(prog: _Program) -> np.ndarray:
    """Bytes a program leaves allocated when it ends."""
    return prog.head + prog.delta.sum(axis=0) + prog.tail


def replay_rank(
    graph: OpGraph,
    config: TrainConfig,
    stages: list[StageMemory],
    schedule: PipelineSchedule,
    rank: int,
    step_s: float,
) -> tuple[Timeline, PipelineAction]:
    """One pipeline rank's timeline over the step, and the action it peaks in; FSDP2's buffers from
    each stage's `fsdp` (planner.simulation.pipeline_fsdp), the gradients' reduce-scatter last."""
    own = [stages[s] for s in schedule.stages(rank)]
    fsdp = {s.index: StageFsdpState(s.fsdp) for s in own if s.fsdp is not None}
    base = sum((s.persistent for s in own), np.zeros(_NC, dtype=np.int64)).copy()
    base[CATEGORY_INDEX["optimizer"]] += sum(s.optimizer_bytes for s in own)
    grads_made: set[int] = set()
    actions = schedule.compute(rank)
    split = schedule.split_stages  # a whole B there holds what a recompute made to the span's end
    if config.grad_accum_steps > 1:  # a later accumulation step: the gradients are live from its start
        for s in own:
            pair = "W" if any(a.kind == "W" and a.stage == s.index for a in actions) else "B"
            base = base + _net(s.programs[f"{pair}_first"]) - _net(s.programs[pair])
            grads_made.add(s.index)
    rows: list[np.ndarray] = [base.copy()[None, :]]
    op_index: list[np.ndarray] = [np.array([-1])]
    action_of: list[int] = [-1]
    frees = _send_frees(stages, schedule, rank)
    curves: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # program -> (bytes at its rows from its start, net)
    runtime = unshard_plan([a.stage for a in actions]) if fsdp and len(own) > 1 else None
    # under FSDP2, REDUCE_GRAD right after a stage's last backward (torch's _add_reduce_grad), the rank's
    # last at the end (a row each, also where the plans replay what a choice changes, without FSDP2)
    sharded = config.zero_stage >= 3 and config.shard_ranks > 1
    reduce_after = {k: s for s, k in _last_backward(actions).items() if sharded and k < len(actions) - 1}
    reduce_rows: list[int] = []
    holds = _loop_holds(graph, stages, schedule, rank)
    for k, act in enumerate(actions):
        if runtime is not None:  # the multi-stage runtime's RESHARD / UNSHARD before this action
            evict, fetch = runtime[k]
            for s in evict:
                fsdp[s].reshard()
            for s in fetch:
                fsdp[s].unshard()
        p = stages[act.stage].programs
        if act.kind in ("F", "I"):
            prog = p[act.kind]
        else:  # B or W: the stage's first one allocates its gradients, the others accumulate
            kind = "B_held" if act.kind == "B" and act.stage in split else act.kind
            prog = p[kind if act.stage in grads_made else f"{kind}_first"]
            grads_made.add(act.stage)
        if id(prog) not in curves:
            curves[id(prog)] = (prog.head + np.cumsum(prog.delta, axis=0), _net(prog))
        curve, net = curves[id(prog)]
        if len(prog.ops):
            live = base + curve
            if act.stage in fsdp:
                # what the rank's other stages hold: (parameter, gradient) bytes
                others = [state.held_bytes() for s, state in fsdp.items() if s != act.stage]
                held = np.array(others, dtype=np.int64).reshape(-1, 2).sum(axis=0)
                extra = fsdp[act.stage].extras(act.kind, prog.ops)
                live[:, _FSDP_COLUMNS] += np.stack([extra.parameter, extra.gradient], axis=1) + held
                if len(extra.copy_out_at):  # the instant before an op, as FSDP2 copies a unit out, is that op's
                    # row where it is higher (one row per op: the plans' replays without FSDP2 line up with it)
                    at = extra.copy_out_at
                    # after the op's frees (the tracer's free_op), before its outputs
                    instants = base + curve[at] - np.maximum(prog.delta[at], 0)
                    instants[:, _FSDP_COLUMNS] += extra.copy_out_bytes + held
                    for j, instant in zip(at.tolist(), instants):
                        if instant.sum() > live[j].sum():
                            live[j] = instant
            for nbytes, until in holds.get(k, ()):
                live[prog.ops < until] += nbytes
            rows.append(live)
            op_index.append(prog.ops)
            action_of.extend([k] * len(prog.ops))
        base = base + net - frees.get(k, 0)
        if k in reduce_after:
            state = fsdp.get(reduce_after[k])
            reduce_rows.append(sum(len(r) for r in rows))
            rows.append((base + _reduce_peak(list(fsdp.values()), [state] if state else []))[None, :])
            op_index.append(prog.ops[-1:] if len(prog.ops) else np.array([len(graph.ops) - 1]))
            action_of.append(k)
            if state:
                state.reduced()
    reduce_rows.append(sum(len(r) for r in rows))
    left = [state for s, state in fsdp.items() if s not in reduce_after.values()]
    rows.append((base + _reduce_peak(list(fsdp.values()), left))[None, :])  # REDUCE_GRAD (the step's end without FSDP2)
    op_index.append(np.array([len(graph.ops) - 1]))
    action_of.append(len(actions) - 1)
    temp = np.zeros(_NC, dtype=np.int64)
    temp[CATEGORY_INDEX["temporary"]] = sum(s.optimizer_step_temporary for s in own)
    rows.append((base + temp)[None, :])
    op_index.append(np.array([len(graph.ops)]))
    action_of.append(-1)
    by_category = np.concatenate(rows, dtype=np.int64)  # (no copy: the rows are int64)
    ops_idx = np.concatenate(op_index)
    total = by_category.sum(axis=1)
    k = int(np.argmax(total))
    at = int(ops_idx[k])
    op = graph.ops[at] if 0 <= at < len(graph.ops) and k not in reduce_rows else None
    phases = tuple(_phase_names(graph)[np.clip(ops_idx + 1, 0, len(graph.ops) + 1)].tolist())
    states = model_state_bytes(
        [sh for s in own for sh in s.param_shapes],
        get_precision(config.precision),
        config.optimizer,
        config.zero_stage,
        config.shard_ranks,
        foreach=get_device(config.gpu).is_cuda,
    )
    timeline = Timeline(
        peak_bytes=int(total[k]),
        peak_phase=phases[k],
        peak_op=op.name if op is not None else _end_name(at, k in reduce_rows, len(graph.ops)),
        peak_module=op.module if op is not None else "",
        breakdown_at_peak={c: int(v) for c, v in zip(CATEGORIES, by_category[k])},
        model_states={"parameter": states.parameter, "gradient": states.gradient, "optimizer": states.optimizer},
        num_parameters=states.num_parameters,
        costs=StepCosts(step_s=step_s, recompute_flops=0, recompute_s=0.0, offload_bytes=0, exposed_offload_s=0.0),
        config={**config.to_dict(), **graph.assumptions()},
        op_index=ops_idx,
        phases=phases,
        by_category=by_category,
    )
    peak_action = (
        actions[action_of[k]] if action_of[k] >= 0 else PipelineAction(-1, "optimizer" if at >= 0 else "start")
    )
    return timeline, peak_action
