"""Plans for compiled training: a choice of `activation_memory_budget` per block (or for the whole
model) under a global peak budget, from the partitioner's splits (planner.simulation.partitioner).

CompiledSkeleton simulates the compiled step around the chosen splits; CP-SAT picks one split per
block (a multiple-choice knapsack with one constraint per stretch of the step): the least recompute
time that fits the budget everywhere.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from ortools.sat.python import cp_model
from torch import nn

from costmodels.hardware import DeviceSpec, get_device
from planner.budgets import parse_budget
from planner.config import TrainConfig
from planner.errors import InfeasibleBudget, SolverTimeout, SpecError, TraceError
from planner.plans.format import CompiledPlan, CompiledPoint, CompiledPrediction
from planner.safe_io import clean
from planner.signals import interruptible
from planner.simulation.costs import op_times, storage_bytes
from planner.simulation.effects import ModuleSpan, SpanChoice, dropped_tensors, module_span
from planner.simulation.partitioner import BUDGETS, block_call, block_frontier, fused_pass_s
from planner.simulation.step import simulate
from planner.solver.cpsat_solver import deterministic_solver
from planner.solver.planning import graph_model_info
from planner.tracing.fake_mode import TraceFakeMode
from planner.tracing.graph import OpGraph
from planner.tracing.hf import disable_kv_cache, skip_init
from planner.tracing.inductor_layout import WHOLE_MODEL, inductor_options
from planner.tracing.op_classes import EXTERN_KERNEL_OPS
from planner.tracing.recorder import loss_of, trace_for
from planner.tracing.specs import resolve_spec
from planner.units import format_bytes

__all__ = [
    "choose_budgets",
    "CompiledSkeleton",
    "SCOPES",
    "Window",
    "plan_compiled",
]

FORWARD, SAVED, BACKWARD = 1, 2, 3  # what a block's split adds at a sample of a CompiledSkeleton
BYTES_HELD = {FORWARD: "forward_bytes", SAVED: "saved_bytes", BACKWARD: "backward_bytes"}  # CompiledPoint field


@dataclass(frozen=True)
class Window:
    """A stretch of the step: blocks running their forward, blocks holding their saved bytes, blocks
    running their backward, and the bytes the budget leaves them there."""

    forward: tuple[int, ...]
    saved: tuple[int, ...]
    backward: tuple[int, ...]
    cap_bytes: int

    def terms(self, points: Sequence[Sequence[CompiledPoint]]) -> list[tuple[int, int, int]]:
        """(block, point index, bytes) of every choice this window counts."""
        held = {FORWARD: self.forward, SAVED: self.saved, BACKWARD: self.backward}
        return [
            (i, j, getattr(p, BYTES_HELD[hold]))
            for hold, blocks in held.items()
            for i in blocks
            for j, p in enumerate(points[i])
        ]


def choose_budgets(
    frontiers: Sequence[Sequence[CompiledPoint]], windows: Sequence[Window], time_limit_s: float = 10.0
) -> list[CompiledPoint]:
    """One point per block with the least total recompute time such that in every window the blocks'
    bytes fit its cap (CP-SAT; times in microseconds). InfeasibleBudget when even the smallest
    points do not fit."""
    model = cp_model.CpModel()
    picks = [[model.new_bool_var(f"b{i}p{j}") for j in range(len(f))] for i, f in enumerate(frontiers)]
    for row in picks:
        model.add_exactly_one(row)
    for w in windows:
        model.add(sum(picks[i][j] * nbytes for i, j, nbytes in w.terms(frontiers)) <= w.cap_bytes)
    model.minimize(sum(v * round(p.recompute_s * 1e6) for row, f in zip(picks, frontiers) for v, p in zip(row, f)))
    solver = deterministic_solver(time_limit_s)
    with interruptible(solver):  # Ctrl-C stops the search and raises; the caller's SIGINT handler stays
        status = solver.solve(model)
    if status == cp_model.INFEASIBLE:
        raise InfeasibleBudget("no per-block budgets fit every window; raise the budget")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise SolverTimeout(f"CP-SAT found no per-block budgets within time limit {time_limit_s:g}; raise --time-limit")
    return [f[next(j for j, v in enumerate(row) if solver.value(v))] for row, f in zip(picks, frontiers)]


SCOPES = ("auto", "blocks", "model")


class _WithLoss(nn.Module):
    """The model and its step's loss as one module: the whole step's graph, split as a block."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return loss_of(self.model(*args, **kwargs))


def _split_error(what: str, exc: Exception) -> TraceError:
    first = clean(str(exc).splitlines()[0] if str(exc) else "")
    return TraceError(
        f"torch.compile's partitioner could not split {what} on fake tensors ({type(exc).__name__}: {first}); "
        "plan it for eager training, without --compile"
    )


@dataclass(frozen=True)
class _Option:
    """One way to compile the step: module path -> its split, with the predicted peak and the
    seconds it saves against eager beyond the blocks (`fused_s`: the whole model fuses the code
    between blocks too)."""

    points: dict[str, CompiledPoint]
    peak_bytes: int
    fused_s: float = 0.0

    @property
    def recompute_s(self) -> float:
        return sum(p.recompute_s for p in self.points.values())

    @property
    def added_s(self) -> float:
        return self.recompute_s - self.fused_s


def _outside_blocks_fused_s(graph: OpGraph, device: DeviceSpec) -> float:
    """Seconds compiling the whole model saves on the forward and backward ops outside its blocks
    (embeddings, a ResNet's stem and head, final norms, the loss): inductor fuses each pointwise or
    reduction op there into its kernels, where it costs one pass over the bytes it writes instead
    of its eager time. Matmuls, convolutions and attention cost the same either way."""
    eager = op_times(graph, device)
    inside = np.zeros(len(graph.ops), dtype=bool)
    for r in graph.regions:
        span = module_span(graph, r.path)
        inside[span.fwd_start : span.fwd_end] = inside[span.bwd_start : span.bwd_end] = True
    saved = 0.0
    for op in graph.ops:
        if inside[op.index] or op.phase not in ("forward", "loss", "backward") or op.name in EXTERN_KERNEL_OPS:
            continue
        written = sum(graph.tensors[t].nbytes for t in op.allocs + op.mutates)
        saved += max(0.0, eager[op.index] - fused_pass_s(written, device))
    return saved


def _per_block(
    graph: OpGraph,
    config: TrainConfig,
    frontiers: dict[str, list[CompiledPoint]],
    budget_bytes: int,
    time_limit_s: float,
) -> tuple[_Option | None, int]:
    """The least-recompute per-block budgets under budget_bytes (None when none fit), and the least
    peak per-block budgets reach."""
    rows = [frontiers[r.signature] for r in graph.regions]
    skeleton = CompiledSkeleton.of(graph, config, [module_span(graph, r.path) for r in graph.regions], rows)
    smallest = skeleton.peak_bytes([min(f, key=lambda p: p.saved_bytes) for f in rows])
    try:
        chosen = choose_budgets(rows, skeleton.windows(budget_bytes), time_limit_s)
    except InfeasibleBudget:
        return None, smallest
    points = {r.path: p for r, p in zip(graph.regions, chosen)}
    return _Option(points, skeleton.peak_bytes(chosen)), smallest


def _whole_model(
    graph: OpGraph, config: TrainConfig, frontier: list[CompiledPoint], budget_bytes: int
) -> tuple[_Option | None, int]:
    """The whole model's least-recompute split under budget_bytes (None when none fits), and the
    least peak its splits reach."""
    skeleton = CompiledSkeleton.of(graph, config, [module_span(graph, WHOLE_MODEL)], [frontier])
    fused_s = _outside_blocks_fused_s(graph, get_device(config.gpu))
    options = [_Option({WHOLE_MODEL: p}, skeleton.peak_bytes([p]), fused_s) for p in frontier]
    fitting = [o for o in options if o.peak_bytes <= budget_bytes]
    best = min(fitting, key=lambda o: (o.recompute_s, o.peak_bytes)) if fitting else None
    return best, min(o.peak_bytes for o in options)


def plan_compiled(
    spec: str,
    config: TrainConfig,
    budget: int | str,
    time_limit_s: float = 10.0,
    budgets: Sequence[float] = BUDGETS,
    scope: str = "auto",
) -> CompiledPlan:
    """Activation budgets for torch.compile under a peak budget (bytes, a size such as '8GiB' or a
    percentage of the no-plan peak such as '60%'), from the partitioner's splits on fake tensors.

    scope "blocks": one budget per block (one frontier per block signature), the rest of the step
    eager; "model": the whole model and its loss compiled as `torch.compile(model)` runs it, at one
    budget; "auto": whichever adds less time, where the whole model's recompute is offset by what
    it saves fusing the ops outside the blocks (the whole model on a tie), the blocks alone when the
    whole model's graph cannot be split. The predicted overhead is that added time over the eager
    step's (below zero where compiling saves more than the recompute costs)."""
    if scope not in SCOPES:
        raise SpecError(f"compile scope '{scope}' is not one of {', '.join(SCOPES)}")
    graph = trace_for(spec, config)
    if scope == "blocks" and not graph.regions:
        raise SpecError("the model has no blocks to compile one by one; use --compile-scope model or auto")
    timeline = simulate(graph, config)
    budget_bytes = parse_budget(budget, timeline.peak_bytes)
    device = get_device(config.gpu)
    frontiers: dict[str, list[CompiledPoint]] = {}
    with TraceFakeMode(), skip_init():
        model, inputs = resolve_spec(spec).build(batch_size=config.batch_size, seq_len=config.seq_len)
        model.train()
        disable_kv_cache(model)  # as the trace and compile_blocks run it
        if scope != "model":
            for region in graph.regions:
                if region.signature not in frontiers:
                    args, kwargs = block_call(model, inputs, region.path)
                    try:
                        frontiers[region.signature] = block_frontier(
                            model.get_submodule(region.path),
                            args,
                            kwargs,
                            device,
                            budgets,
                            inductor_options(region.path, model.get_submodule(region.path)),
                        )
                    except Exception as exc:  # AOTAutograd and the partitioner raise many kinds
                        raise _split_error(f"block '{region.path}'", exc) from None
        if scope != "blocks":
            args, kwargs = ((), dict(inputs)) if isinstance(inputs, dict) else (tuple(inputs), {})
            try:
                frontiers[WHOLE_MODEL] = block_frontier(
                    _WithLoss(model), args, kwargs, device, budgets, inductor_options(WHOLE_MODEL, model)
                )
            except Exception as exc:
                if scope == "model":
                    raise _split_error("the whole model", exc) from None
    found: list[tuple[_Option | None, int]] = []
    if scope != "model" and graph.regions:
        block_frontiers = {k: v for k, v in frontiers.items() if k != WHOLE_MODEL}
        found.append(_per_block(graph, config, block_frontiers, budget_bytes, time_limit_s))
    if WHOLE_MODEL in frontiers:
        found.append(_whole_model(graph, config, frontiers[WHOLE_MODEL], budget_bytes))
    if not found:
        raise TraceError(
            "the model has no blocks and torch.compile's partitioner could not split the whole model on "
            "fake tensors; plan it for eager training, without --compile"
        )
    options = [o for o, _ in found if o is not None]
    if not options:
        smallest = min(least for _, least in found)
        raise InfeasibleBudget(
            f"no activation budgets fit {format_bytes(budget_bytes)}; with the least the partitioner can "
            f"save the compiled peak is {format_bytes(smallest)}; raise --budget",
            smallest_peak_bytes=smallest,
        )
    best = min(options, key=lambda o: (round(o.added_s * 1e6), WHOLE_MODEL not in o.points))
    step_s = timeline.costs.step_s
    return CompiledPlan(
        model=graph_model_info(graph),
        config={**config.with_(compile=True).to_dict(), **graph.assumptions()},
        budget_bytes=budget_bytes,
        budgets={path: p.budget for path, p in best.points.items()},
        predicted=CompiledPrediction(
            peak_bytes=best.peak_bytes,
            baseline_peak_bytes=timeline.peak_bytes,
            recompute_s=best.recompute_s,
            overhead=best.added_s / step_s if step_s else 0.0,
        ),
        frontiers={k: tuple(v) for k, v in frontiers.items()},
    )


@dataclass(frozen=True)
class CompiledSkeleton:
    """A compiled step around its blocks' splits: `base` bytes at each sample, and what each block's
    split adds on top (`holds`, blocks x samples): its forward graph's peak (FORWARD) while that
    runs, its saved bytes (SAVED) from the end of its forward to the start of its backward, its
    backward graph's peak (BACKWARD) while that runs.

    It comes from the eager step with every block checkpointed: model states, the blocks' inputs,
    everything outside the blocks, and a block's re-created activations and gradient temporaries
    while its backward runs. While a block's forward runs, base holds what was live before it (the
    forward graph's peak, outputs included, comes on top). In a block's backward, the split without
    recompute (`unsplit`) stands in for the eager replay: base gains its saved bytes less the replay
    and less its backward peak, and the chosen split's backward peak comes on top (so the unsplit
    split reads as itself).
    """

    base: np.ndarray
    holds: np.ndarray

    @classmethod
    def of(
        cls,
        graph: OpGraph,
        config: TrainConfig,
        spans: Sequence[ModuleSpan],
        frontiers: Sequence[Sequence[CompiledPoint]],
    ) -> CompiledSkeleton:
        """The step with each span (a block, or the whole model) compiled; `frontiers[k]`: span k's splits."""
        unsplit = [max(f, key=lambda p: p.saved_bytes) for f in frontiers]  # the split without recompute
        timeline = simulate(graph, config, choices=[SpanChoice(span, "recompute") for span in spans])
        sizes = storage_bytes(graph, config)
        at = timeline.op_index
        eager = timeline.total.astype(np.int64)
        base = eager.copy()
        allocated_by_op: Counter[int] = Counter()
        for t, tensor in graph.tensors.items():
            allocated_by_op[tensor.alloc_op] += sizes[t]
        holds = np.zeros((len(spans), len(at)), dtype=np.int8)
        for k, (span, point) in enumerate(zip(spans, unsplit)):
            forward = (at >= span.fwd_start) & (at < span.fwd_end)
            # what was live before the block: the sample at its first op, less what that op allocated
            base[forward] = eager[np.argmax(forward)] - allocated_by_op[span.fwd_start]
            holds[k, forward] = FORWARD
            replay = sum(sizes[t] for t in dropped_tensors(graph, span))
            backward = (at >= span.bwd_start) & (at < span.bwd_end)
            base[backward] += point.saved_bytes - replay - point.backward_bytes
            holds[k, (at >= span.fwd_end) & (at < span.bwd_start)] = SAVED
            holds[k, backward] = BACKWARD
        return cls(base, holds)

    def peak_bytes(self, points: Sequence[CompiledPoint]) -> int:
        """Peak of the step with block k split at points[k]."""
        total = self.base.copy()
        for hold, field in BYTES_HELD.items():
            total += np.array([getattr(p, field) for p in points], dtype=np.int64) @ (self.holds == hold)
        return int(total.max())

    def windows(self, budget_bytes: int) -> list[Window]:
        """One constraint of choose_budgets per distinct pattern of what the blocks hold: the budget
        less the highest base under that pattern."""
        patterns, which = np.unique(self.holds.T, axis=0, return_inverse=True)
        highest = np.full(len(patterns), np.iinfo(np.int64).min)
        np.maximum.at(highest, which.ravel(), self.base)
        return [
            Window(
                tuple(np.flatnonzero(row == FORWARD).tolist()),
                tuple(np.flatnonzero(row == SAVED).tolist()),
                tuple(np.flatnonzero(row == BACKWARD).tolist()),
                int(budget_bytes - top),
            )
            for row, top in zip(patterns, highest)
        ]
