"""A plan per pipeline stage: each pp rank's recompute choices under one budget for every rank.

Formulation. A pp rank's memory curve is the replay of its stages' programs over the schedule
(:mod:`planner.simulation.pipeline_step`), and that replay is linear in the programs: a block
option (:mod:`planner.solver.options`) changes the stage's F and B programs by the events of its
choice (:func:`planner.simulation.effects.choice_effect`), so the rank's curve under any set of
options is the no-plan curve plus each option's own change, replayed over the schedule, where
every microbatch that is in flight carries what the option changes in it. All curves are laid on
the same rows (every option's recompute replay adds its sample rows before its span's backward),
so one linear constraint per distinct row is exact; CP-SAT picks one option per block minimising
the recompute seconds of the rank, each rank on its own (its stages are its own). The result is
checked by replaying every rank with the chosen choices, as ``simulate --pp --plan`` does.

A recompute that may run in the bubble before its stage's backward (:mod:`planner.simulation.pipeline_early`)
is priced by what the unplanned schedule's waits before that stage's backwards do not cover (a hidden
second still costs HIDDEN_PRICE of one, as under FSDP2's waits); `bubble_aware=False` prices every
recompute in full. The step time reported is the replay's under the chosen plans either way.

Under a split backward (zero-bubble, DualPipeV) a stage past the first recomputes whole modules
only, once in I, holding what it made until W (:attr:`PipelineSchedule.split_stages`: torch's own
checkpoint would recompute once per weight group there); stage 0's recompute runs once per W.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from costmodels.hardware import get_device
from planner.config import DEFAULT_TIME_LIMIT_S, TrainConfig
from planner.errors import InfeasibleBudget, MemplanError, SolverTimeout
from planner.plans.format import Plan, Predicted, SolverInfo, StagePlan, StagePlans
from planner.signals import interruptible
from planner.simulation.costs import op_times
from planner.simulation.effects import SpanChoice, choices_from_decisions, op_keys
from planner.simulation.pipeline import auto_split_path, simulate_pipeline
from planner.simulation.pipeline_early import runs_early
from planner.simulation.pipeline_schedule import INPUT_GRADIENT_KINDS, PipelineSchedule, pipeline_schedule
from planner.simulation.pipeline_split import StageCut, cut_stages
from planner.simulation.pipeline_step import (
    StageMemory,
    replay_rank,
    replay_rows,
    stage_effects,
    stage_programs,
)
from planner.solver.baselines import block_spans
from planner.solver.cpsat import RELATIVE_GAP_LIMIT, _match
from planner.solver.cpsat_solver import deterministic_solver
from planner.solver.options import HIDDEN_PRICE, block_options
from planner.solver.planning import decisions_for, graph_model_info
from planner.tracing.graph import OpGraph
from planner.units import format_bytes

__all__ = [
    "AUTO_SPLITS_TRIED",
    "PipelinePlan",
    "RankPlan",
    "evaluate_pipeline",
    "solve_pipeline",
    "solve_pipeline_split",
    "stage_plans",
    "uniform_choices",
]

AUTO_SPLITS_TRIED = 6  # splits of --pp-split auto planned and compared (spread over its path)


@dataclass(frozen=True)
class RankPlan:
    """One pp rank's plan: its stages' choices, peaks without and with them, seconds they add."""

    rank: int
    stages: tuple[int, ...]
    in_flight: int
    peak_without: int
    peak_with: int
    recompute_s: float  # per step: every microbatch's backward on this rank's stages
    choices: tuple[SpanChoice, ...]
    option_names: tuple[str, ...]
    status: str
    wall_s: float


@dataclass(frozen=True)
class PipelineEvaluation:
    """Every pp rank's peak and the step's time under some choices (replayed, not modelled)."""

    peaks: tuple[int, ...]
    recompute_s: tuple[float, ...]  # per pp rank, per step
    step_s: float
    hidden_recompute_s: tuple[float, ...] = ()  # per pp rank, per step: run while it waited
    hidden_recompute_by_stage_s: tuple[float, ...] = ()  # the same, per stage


@dataclass(frozen=True)
class PipelinePlan:
    """Per-rank plans, the pipeline step without and with them, and the split they hold for."""

    ranks: tuple[RankPlan, ...]
    budget_bytes: int
    schedule: PipelineSchedule
    cuts: tuple[StageCut, ...]
    step_s_without: float
    step_s_with: float
    hidden_recompute_s: tuple[float, ...] = ()  # per pp rank: recompute run in the bubble before B
    hidden_recompute_by_stage_s: tuple[float, ...] = ()  # the same, per stage

    @property
    def choices(self) -> tuple[SpanChoice, ...]:
        return tuple(c for r in self.ranks for c in r.choices)

    def to_dict(self) -> dict:
        return {
            "budget_bytes": self.budget_bytes,
            "schedule": self.schedule.name,
            "step_s_without": self.step_s_without,
            "step_s_with": self.step_s_with,
            "ranks": [
                {
                    "pp_rank": r.rank,
                    "stages": list(r.stages),
                    "in_flight": r.in_flight,
                    "peak_without_bytes": r.peak_without,
                    "peak_with_bytes": r.peak_with,
                    "recompute_s": r.recompute_s,
                    "hidden_recompute_s": self.hidden_recompute_s[r.rank] if self.hidden_recompute_s else 0.0,
                    "options": list(r.option_names),
                    "status": r.status,
                }
                for r in self.ranks
            ],
        }


def _setup(graph: OpGraph, config: TrainConfig):
    schedule = pipeline_schedule(config)
    base = simulate_pipeline(graph, config)  # checks the layout, resolves --pp-split (auto included)
    cuts = cut_stages(graph, base.blocks_per_stage)
    return schedule, cuts, base


def evaluate_pipeline(
    graph: OpGraph, config: TrainConfig, choices: Sequence[SpanChoice], cuts: tuple[StageCut, ...] | None = None
) -> PipelineEvaluation:
    """Replay every pp rank under `choices` (span choices inside stages): peaks and step time."""
    cuts = cuts if cuts is not None else _setup(graph, config)[1]
    result = simulate_pipeline(graph, config.with_(pp_split=",".join(str(c.num_blocks) for c in cuts)), choices)
    schedule = result.schedule
    effects = stage_effects(graph, config, cuts, choices)
    per_rank = tuple(
        sum(e.effect.recompute_s * schedule.recompute_runs(e.stage) for e in effects if e.stage in schedule.stages(r))
        for r in range(schedule.pp)
    )
    return PipelineEvaluation(
        tuple(r.peak_bytes for r in result.layout.roles),
        per_rank,
        result.time.step_s,
        result.time.hidden_recompute_s,
        result.time.hidden_recompute_by_stage_s,
    )


REPLAY_ROUNDS = 8  # tighter solves of a rank whose replayed peak exceeds the budget


def _diff(with_: list[StageMemory], without: list[StageMemory]) -> list[StageMemory]:
    """What a choice changes, as stages holding nothing but the change."""
    zero = np.zeros_like(without[0].persistent)
    return [
        dataclasses.replace(
            b,
            persistent=zero,
            sent_bytes=zero,
            grad_sent_bytes=zero,
            programs={k: a.programs[k].minus(p) for k, p in b.programs.items()},
            optimizer_bytes=0,
            optimizer_step_temporary=0,
            param_shapes=(),
            fsdp=None,  # FSDP2's buffers do not depend on the choice: the base replay has them
            loss_output=zero,
        )
        for a, b in zip(with_, without)
    ]


def _solve_rank(base: np.ndarray, deltas: list[list[np.ndarray | None]], costs, budget: int, time_limit_s: float):
    """CP-SAT: one option per block, every row of base + chosen deltas <= budget, least seconds."""
    flat = [(r, k) for r, row in enumerate(deltas) for k, d in enumerate(row) if d is not None]
    if not flat:
        if base.max() > budget:
            return "INFEASIBLE", None, 0.0, 0.0
        return "OPTIMAL", [0] * len(deltas), 0.0, 0.0
    matrix = np.stack([deltas[r][k] for r, k in flat], axis=1)  # (rows, options)
    moving = np.any(matrix != 0, axis=1)
    if base[~moving].max(initial=0) > budget:
        return "INFEASIBLE", None, 0.0, 0.0
    unique, inverse = np.unique(matrix[moving], axis=0, return_inverse=True)
    worst = np.full(len(unique), np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(worst, inverse.reshape(-1), base[moving])
    model = cp_model.CpModel()
    unit = max(1, math.ceil(budget / 10_000_000))  # bytes per model unit, rounded on the safe side
    y = [[model.NewBoolVar(f"y{r}_{k}") for k in range(len(row))] for r, row in enumerate(deltas)]
    for row in y:
        model.AddExactlyOne(row)
    var = [y[r][k] for r, k in flat]
    for coeffs, top in zip(unique, worst):
        terms = [int(math.ceil(c / unit)) * v for c, v in zip(coeffs.tolist(), var) if c]
        model.Add(sum(terms) <= budget // unit - int(math.ceil(top / unit)))
    scale = max(max((c for row in costs for c in row), default=0.0), 1e-12) / 1_000_000
    model.Minimize(sum(int(round(c / scale)) * y[r][k] for r, row in enumerate(costs) for k, c in enumerate(row)))
    solver = deterministic_solver(time_limit_s)
    solver.parameters.relative_gap_limit = RELATIVE_GAP_LIMIT
    with interruptible(solver):
        status = solver.Solve(model)
    name = solver.StatusName(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return name, None, 0.0, 0.0
    picks = [next(k for k, v in enumerate(row) if solver.Value(v)) for row in y]
    return name, picks, solver.ObjectiveValue() * scale, solver.BestObjectiveBound() * scale


def _least(base: np.ndarray, deltas: list[list[np.ndarray | None]]) -> np.ndarray:
    """A low curve the options reach: block by block, the option that lowers the peak the most."""
    curve = base.copy()
    for row in deltas:
        real = [d for d in row if d is not None]
        if real:
            curve = curve + min(real, key=lambda d: int((curve + d).max()))
    return curve


def solve_pipeline(
    graph: OpGraph,
    config: TrainConfig,
    budget_bytes: int,
    *,
    keep: Sequence[str] = (),
    recompute: Sequence[str] = (),
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    bubble_aware: bool = True,
) -> PipelinePlan:
    """The cheapest recompute choices per pp rank that keep every rank's replayed peak within
    `budget_bytes`; `graph` is the step traced at one microbatch's batch. Raises InfeasibleBudget
    naming the rank that cannot fit. `bubble_aware`: price a recompute that runs while its stage
    waits for a gradient by what the wait leaves (else in full)."""
    if budget_bytes <= 0:
        raise MemplanError(f"budget must be positive, got {budget_bytes}")
    if not time_limit_s > 0:
        raise MemplanError(f"--time-limit must be a positive number of seconds, got {time_limit_s}")
    schedule, cuts, baseline = _setup(graph, config)
    paths = [r.path for r in graph.regions]
    keep_set, force_set = _match(paths, keep, "--keep"), _match(paths, recompute, "--recompute")
    if keep_set & force_set:
        raise MemplanError(f"modules both kept and recomputed: {', '.join(sorted(keep_set & force_set))}")
    times = op_times(graph, get_device(config.gpu))
    spans = block_spans(graph)
    stage_of_block = [int(next(c.index for c in cuts if c.fwd_start <= s.fwd_start < c.fwd_end)) for s in spans]
    options, effects = [], []
    for span, stage in zip(spans, stage_of_block):
        opts = [o for o in block_options(graph, span, times, None) if span.path not in keep_set or o.choice is None]
        if stage in schedule.split_stages:  # whole modules only (PipelineSchedule.split_stages)
            opts = [o for o in opts if o.choice is None or not o.choice.keep_ops]
        if span.path in force_set:
            opts = [o for o in opts if o.choice is not None and o.choice.span.path == span.path]
        options.append(opts)
        effects.append([None if o.choice is None else stage_effects(graph, config, cuts, [o.choice])[0] for o in opts])
    rows = replay_rows([e for row in effects for e in row if e is not None])
    base_stages = stage_programs(graph, config, cuts, rows=rows)
    step_without = baseline.time.step_s

    def plan_rank(r: int, solve_budget: int) -> RankPlan:
        """Rank `r`'s cheapest choices whose modelled peak is within `solve_budget`."""
        t0 = time.perf_counter()
        own = set(schedule.stages(r))
        base = replay_rank(graph, config, base_stages, schedule, r, step_without)[0].total
        blocks = [b for b, s in enumerate(stage_of_block) if s in own]
        deltas, costs = [], []
        for b in blocks:
            row_d, row_c = [], []
            for e in effects[b]:
                if e is None:
                    row_d.append(None)
                    row_c.append(0.0)
                    continue
                with_ = stage_programs(graph, config, cuts, [e], only=e.moved, rows=rows)
                without = stage_programs(graph, config, cuts, only=e.moved, rows=rows)
                d = replay_rank(graph, config, _diff(with_, without), schedule, r, 0.0)[0].total
                row_d.append(d)
                row_c.append(_price(graph, schedule, cuts, e, baseline.time.waits_s if bubble_aware else {}))
            if all(d is None for d in row_d):
                row_d = [None]
                row_c = [0.0]
            deltas.append([np.zeros_like(base) if d is None and len(row_d) > 1 else d for d in row_d])
            costs.append(row_c)
        status, picks, _, _ = _solve_rank(base, deltas, costs, solve_budget, time_limit_s)
        if picks is None:
            if status != "INFEASIBLE":
                raise SolverTimeout(
                    f"the solver found no plan for pp rank {r} within --time-limit {time_limit_s:g}s ({status}); "
                    "raise --time-limit"
                )
            # a re-solve's tighter budget leaves room for what the replay holds beyond the model
            least = int(_least(base, deltas).max()) + budget_bytes - solve_budget
            raise InfeasibleBudget(
                f"budget {format_bytes(budget_bytes)} is infeasible for pp rank {r} (stages "
                f"{','.join(map(str, sorted(own)))}, {baseline.in_flight[r]} microbatches in flight): the smallest "
                f"peak memplan reaches there is {format_bytes(least)}"
                + "; raise --budget, add stages (--pp), or cut model states (--precision bf16-mixed, --zero 3 --dp N)",
                smallest_peak_bytes=least,
            )
        chosen = [(options[b][k], effects[b][k]) for b, k in zip(blocks, picks) if k < len(options[b])]
        modelled = base + sum((deltas[i][k] for i, k in enumerate(picks) if deltas[i][k] is not None), 0)
        return RankPlan(
            rank=r,
            stages=tuple(sorted(own)),
            in_flight=baseline.in_flight[r],
            peak_without=baseline.layout.roles[r].peak_bytes,
            peak_with=int(np.max(modelled)),
            recompute_s=sum(
                e.effect.recompute_s * schedule.recompute_runs(e.stage) for _, e in chosen if e is not None
            ),
            choices=tuple(o.choice for o, _ in chosen if o.choice is not None),
            option_names=tuple(o.name for o, _ in chosen),
            status=status,
            wall_s=time.perf_counter() - t0,
        )

    ranks = [plan_rank(r, budget_bytes) for r in range(schedule.pp)]
    solve_budgets = [budget_bytes] * schedule.pp
    for _ in range(REPLAY_ROUNDS):
        check = evaluate_pipeline(graph, config, [c for rp in ranks for c in rp.choices], cuts)
        over = [r for r, peak in enumerate(check.peaks) if peak > budget_bytes]
        if not over:
            break
        for r in over:  # its replay holds more than the model summed: leave room for that much more
            unmodelled = check.peaks[r] - ranks[r].peak_with
            solve_budgets[r] = min(solve_budgets[r] - (check.peaks[r] - budget_bytes), budget_bytes - unmodelled)
            ranks[r] = plan_rank(r, solve_budgets[r])
    else:
        raise InfeasibleBudget(
            f"budget {format_bytes(budget_bytes)} is infeasible for pp rank {over[0]}: solved {REPLAY_ROUNDS} times "
            f"tighter, its replayed peak is still {format_bytes(check.peaks[over[0]])}; raise --budget",
            smallest_peak_bytes=check.peaks[over[0]],
        )
    # the replay is the truth: the model sums each choice's change, and can miss what two choices share
    ranks = [dataclasses.replace(rp, peak_with=peak) for rp, peak in zip(ranks, check.peaks)]
    plan = PipelinePlan(tuple(ranks), budget_bytes, schedule, cuts, step_without, 0.0)
    return dataclasses.replace(
        plan,
        step_s_with=check.step_s,
        hidden_recompute_s=check.hidden_recompute_s,
        hidden_recompute_by_stage_s=check.hidden_recompute_by_stage_s,
    )


def _price(graph: OpGraph, schedule: PipelineSchedule, cuts: tuple[StageCut, ...], e, waits_s: dict) -> float:
    """Seconds a stage effect costs per step: its recompute in every backward of its stage, less
    (but for HIDDEN_PRICE) what the waits before them cover where it runs early."""
    full = e.effect.recompute_s * schedule.recompute_runs(e.stage)
    if not waits_s or not runs_early(graph, schedule, cuts[e.stage], e.choice):
        return full
    hidden = sum(
        min(e.effect.recompute_s, w)
        for (stage, kind, _), w in waits_s.items()
        if stage == e.stage and kind in INPUT_GRADIENT_KINDS
    )
    return full - hidden * (1.0 - HIDDEN_PRICE)


def solve_pipeline_split(
    graph: OpGraph,
    config: TrainConfig,
    budget_bytes: int,
    *,
    keep: Sequence[str] = (),
    recompute: Sequence[str] = (),
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    bubble_aware: bool = True,
) -> tuple[PipelinePlan, TrainConfig]:
    """Under ``--pp-split auto``, the split and per-stage plans with the shortest step under the budget:
    up to AUTO_SPLITS_TRIED splits along the path `auto` takes without a plan (from the uniform split,
    blocks moved off the worst rank: fewer blocks where memory binds) are each planned, and the
    fastest that fits wins. (plan, config with that split); another --pp-split is solved as given."""
    if config.pp_split.strip() != "auto":
        return solve_pipeline(
            graph,
            config,
            budget_bytes,
            keep=keep,
            recompute=recompute,
            time_limit_s=time_limit_s,
            bubble_aware=bubble_aware,
        ), config
    path = auto_split_path(graph, config)
    picks = sorted({round(i * (len(path) - 1) / max(1, AUTO_SPLITS_TRIED - 1)) for i in range(AUTO_SPLITS_TRIED)})
    best: tuple[PipelinePlan, TrainConfig] | None = None
    refused: InfeasibleBudget | None = None
    for counts in (path[i] for i in picks):
        split = config.with_(pp_split=",".join(map(str, counts)))
        try:
            plan = solve_pipeline(
                graph,
                split,
                budget_bytes,
                keep=keep,
                recompute=recompute,
                time_limit_s=time_limit_s,
                bubble_aware=bubble_aware,
            )
        except InfeasibleBudget as exc:
            lowest = math.inf if exc.smallest_peak_bytes is None else exc.smallest_peak_bytes
            if refused is None or lowest < (refused.smallest_peak_bytes or math.inf):
                refused = exc
            continue
        if best is None or plan.step_s_with < best[0].step_s_with:
            best = (plan, split)
    if best is None:
        assert refused is not None
        tried = ", ".join(",".join(map(str, path[i])) for i in picks)
        raise InfeasibleBudget(
            f"{refused} (--pp-split auto planned the splits {tried}; none fits)",
            smallest_peak_bytes=refused.smallest_peak_bytes,
        )
    return best


def _local(path: str, block: str) -> str:
    return path.replace(block, "<block>", 1)


def uniform_choices(graph: OpGraph, config: TrainConfig, plan: PipelinePlan) -> list[SpanChoice]:
    """One plan for all stages: the choices of the stage that recomputes the most, repeated on every
    stage's blocks by position (the k-th block of each stage treated as that stage's k-th block);
    stages whose backward the schedule splits recompute those modules whole (PipelineSchedule.split_stages)."""
    times = op_times(graph, get_device(config.gpu))
    spans = block_spans(graph)
    by_stage = [[s for s in spans if c.fwd_start <= s.fwd_start < c.fwd_end] for c in plan.cuts]
    source = max(plan.ranks, key=lambda r: r.recompute_s)
    src_stage = source.stages[0]
    names = []
    for s in by_stage[src_stage]:
        picked = next(
            (c for c in source.choices if c.span.path == s.path or c.span.path.startswith(s.path + ".")), None
        )
        names.append(picked)
    out = []
    for stage, blocks in enumerate(by_stage):
        for k, span in enumerate(blocks):
            src = names[min(k, len(names) - 1)] if names else None
            if src is None:
                continue
            src_block = by_stage[src_stage][min(k, len(names) - 1)]
            opts = block_options(graph, span, times, None)
            want = _local(src.span.path, src_block.path)
            src_keys = _keep_keys(graph, src)
            match = next(
                (
                    o.choice
                    for o in opts
                    if o.choice is not None
                    and _local(o.choice.span.path, span.path) == want
                    and _keep_keys(graph, o.choice) == src_keys
                ),
                None,
            )
            choice = match if match is not None else dataclasses.replace(src, span=span, keep_ops=frozenset())
            if stage in plan.schedule.split_stages:  # whole modules only there (PipelineSchedule.split_stages)
                choice = dataclasses.replace(choice, keep_ops=frozenset())
            out.append(choice)
    return out


def _keep_keys(graph: OpGraph, choice: SpanChoice) -> tuple[str, ...]:
    keys = op_keys(graph, choice.span)
    return tuple(sorted(keys[i] for i in choice.keep_ops))


def stage_plans(graph: OpGraph, config: TrainConfig, plan: PipelinePlan, strategy: str = "optimal") -> StagePlans:
    """The plan file: one Plan per stage (its blocks' decisions; the rank's predicted peaks)."""
    out = []
    for rp in plan.ranks:
        for s in rp.stages:
            c = plan.cuts[s]
            own = [ch for ch in rp.choices if c.fwd_start <= ch.span.fwd_start < c.fwd_end]
            effects = stage_effects(graph, config, plan.cuts, own)
            recompute_s = sum(e.effect.recompute_s * plan.schedule.recompute_runs(e.stage) for e in effects)
            regions = sorted(graph.regions, key=lambda r: r.fwd_start)[c.block_start : c.block_end]
            p = StagePlan(
                stage=s,
                pp_rank=rp.rank,
                in_flight=rp.in_flight,
                blocks=tuple(r.path for r in regions),
                plan=_stage_plan(graph, config, plan, rp, s, own, recompute_s, effects, strategy),
                early_recompute=tuple(ch.span.path for ch in own if runs_early(graph, plan.schedule, c, ch)),
                split_backward=s in plan.schedule.split_stages,
            )
            out.append(p)
    return StagePlans(
        schedule=plan.schedule.name,
        pp=plan.schedule.pp,
        microbatches=plan.schedule.microbatches,
        budget_bytes=plan.budget_bytes,
        stages=tuple(sorted(out, key=lambda p: p.stage)),
    )


def _stage_plan(graph, config, plan: PipelinePlan, rp: RankPlan, stage: int, own, recompute_s, effects, strategy):
    added = plan.step_s_with - plan.step_s_without
    return Plan(
        model=graph_model_info(graph),
        config={**config.to_dict(), **graph.assumptions()},
        budget_bytes=plan.budget_bytes,
        strategy=strategy,
        decisions=decisions_for(graph, own),
        predicted=Predicted(
            peak_bytes=rp.peak_with,
            baseline_peak_bytes=rp.peak_without,
            recompute_flops=sum(e.effect.recompute_flops * plan.schedule.recompute_runs(e.stage) for e in effects),
            recompute_s=recompute_s,
            offload_bytes=0,
            exposed_offload_s=0.0,
            step_s=plan.step_s_with,
            overhead=max(0.0, added) / plan.step_s_without if plan.step_s_without > 0 else 0.0,
            hidden_recompute_s=plan.hidden_recompute_by_stage_s[stage] if plan.hidden_recompute_by_stage_s else 0.0,
        ),
        solver=SolverInfo(status=rp.status, objective=rp.recompute_s, bound=0.0, gap=0.0, wall_s=rp.wall_s),
    )


def choices_of(graph: OpGraph, plans: StagePlans) -> list[SpanChoice]:
    """Every stage plan's decisions as span choices on the whole step's trace."""
    return [c for p in plans.stages for c in choices_from_decisions(graph, p.plan.decisions)]
