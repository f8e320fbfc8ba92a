"""Pipeline parallel: every pp rank's memory and the step's time under a torch schedule -> :class:`PipelineTimeline`.

The graph is traced once at the microbatch's batch (``batch_size / microbatches``); stages are
cut from it (planner.simulation.pipeline_split), each rank's actions come from torch
(planner.simulation.pipeline_schedule) and are replayed per rank (planner.simulation.pipeline_step).
Ranks that share a pp coordinate (dp replicas, FSDP shards) share one role.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

from costmodels.hardware import get_device
from planner.config import TrainConfig
from planner.errors import MemplanError
from planner.simulation.costs import op_times
from planner.simulation.effects import SpanChoice
from planner.simulation.pipeline_early import early_recompute_s
from planner.simulation.pipeline_fsdp import split_backward_gradient_hazard
from planner.simulation.pipeline_schedule import PipelineSchedule, pipeline_schedule
from planner.simulation.pipeline_split import blocks_per_stage, cut_stages
from planner.simulation.pipeline_step import replay_rank, stage_effects, stage_programs
from planner.simulation.pipeline_time import PipelineTime, pipeline_time, stage_times
from planner.simulation.ranks import LayoutTimeline, RankCoords, RankRole, group_roles
from planner.tracing.graph import OpGraph

__all__ = [
    "PipelineTimeline",
    "auto_split_path",
    "heaviest_role",
    "max_in_flight",
    "simulate_pipeline",
    "simulate_pipeline_roles",
]


@dataclass(frozen=True)
class PipelineTimeline:
    """Every pp rank's timeline (as ``"ranks"``), the split, the schedule and its step time."""

    layout: LayoutTimeline
    schedule: PipelineSchedule
    blocks_per_stage: tuple[int, ...]
    time: PipelineTime
    peak_actions: tuple[str, ...]  # per pp rank: the action its peak is in ("1B0": stage 1, backward, mb 0)
    in_flight: tuple[int, ...]  # per pp rank: most microbatches between their F and their last backward

    @property
    def peak_bytes(self) -> int:
        return self.layout.peak_bytes

    @property
    def worst(self) -> RankRole:
        return self.layout.worst

    @property
    def rank_peaks(self) -> list[int]:
        """Per pp rank, the peak of its heaviest role (expert-parallel ranks of a stage can differ)."""
        peaks = [0] * self.schedule.pp
        for role in self.layout.roles:
            peaks[role.coords.pp] = max(peaks[role.coords.pp], role.peak_bytes)
        return peaks

    @property
    def warnings(self) -> tuple[str, ...]:
        """What would make the real step differ from this one (split_backward_gradient_hazard)."""
        hazard = split_backward_gradient_hazard(self.layout.config, self.schedule)
        return (hazard,) if hazard else ()

    def to_dict(self, max_points: int = 2000) -> dict:
        out = self.layout.to_dict(max_points)
        per_rank = self.rank_peaks
        out["worst_stage"] = list(self.worst.stages)
        out["pipeline"] = {
            "schedule": self.schedule.name,
            "pp": self.schedule.pp,
            "microbatches": self.schedule.microbatches,
            "stages_per_rank": self.schedule.num_stages // self.schedule.pp,
            "blocks_per_stage": list(self.blocks_per_stage),
            "worst_pp_rank": self.worst.coords.pp,
            "peak_actions": list(self.peak_actions),
            "in_flight": list(self.in_flight),
            "peak_bytes_per_pp_rank": per_rank,
            "first_last_ratio": per_rank[0] / max(1, per_rank[-1]),
            "warnings": list(self.warnings),
            **self.time.to_dict(),
        }
        return out


def max_in_flight(schedule: PipelineSchedule, rank: int) -> int:
    """Most microbatches a rank holds at once: counted from F until B, or W for a split backward."""
    live, worst = set(), 0
    for a in schedule.compute(rank):
        key = (a.stage, a.microbatch)
        if a.kind == "F":
            live.add(key)
            worst = max(worst, len(live))
        elif a.kind in ("B", "W"):
            live.discard(key)
    return worst


def _evaluate(
    graph: OpGraph,
    config: TrainConfig,
    schedule: PipelineSchedule,
    counts: tuple[int, ...],
    choices: Sequence[SpanChoice] = (),
    memplan_runtime: bool = True,
):
    cuts = cut_stages(graph, counts)
    effects = stage_effects(graph, config, cuts, choices)
    split = next((e for e in effects if e.stage in schedule.split_stages), None)
    if split is not None and not memplan_runtime:
        raise MemplanError(
            f"{schedule.name} splits the backward of stage {split.stage}, where torch's checkpoint (torchtitan's "
            "activation checkpointing) recomputes a block once per weight group in W, which memplan does not model; "
            "plan with memplan plan --pp (its stage plans recompute there once)"
        )
    selective = next((e for e in effects if e.stage in schedule.split_stages and e.choice.keep_ops), None)
    if selective is not None:
        raise MemplanError(
            f"{schedule.name} splits the backward of stage {selective.stage}, where memplan recomputes whole modules "
            f"only (once, in I), but '{selective.choice.span.path}' recomputes selectively; use a whole-module "
            "--strategy (full, every-N, sqrt) or plan with memplan plan --pp"
        )
    stages = stage_programs(graph, config, cuts, effects)
    per_stage = stage_times(graph, cuts, op_times(graph, get_device(config.gpu)))
    if effects:  # a recompute runs in its stage's backward: B, or under a split backward I (stage 0: W)
        extra = [0.0] * len(cuts)
        for e in effects:
            extra[e.stage] += e.effect.recompute_s
        in_i, in_w = [0.0, *extra[1:]], [extra[0], *[0.0] * (len(extra) - 1)]
        per_stage = {
            **per_stage,
            "B": tuple(t + x for t, x in zip(per_stage["B"], extra)),
            "I": tuple(t + x for t, x in zip(per_stage["I"], in_i)),
            "W": tuple(t + x for t, x in zip(per_stage["W"], in_w)),
        }
    runs = [(e.stage, e.choice, e.effect.recompute_s) for e in effects] if memplan_runtime else []
    early = early_recompute_s(graph, schedule, cuts, runs)
    timing = pipeline_time(schedule, per_stage, early if any(early) else ())
    replays = [replay_rank(graph, config, stages, schedule, r, timing.step_s) for r in range(schedule.pp)]
    return cuts, timing, replays


def auto_split_path(graph: OpGraph, config: TrainConfig) -> list[tuple[int, ...]]:
    """The splits `--pp-split auto` goes through without a plan, from the uniform one: each moves a
    block off the worst rank's stages while the worst peak falls (ties: the shorter step); the last
    is the split ``auto`` simulates."""
    schedule = pipeline_schedule(config)
    counts = blocks_per_stage(len(graph.regions), schedule.num_stages)
    path = [counts]

    def score(c: tuple[int, ...]) -> tuple[tuple[int, float], int]:
        """((worst peak, step time), worst pp rank) of a split."""
        _, timing, replays = _evaluate(graph, config, schedule, c)
        peaks = [t.peak_bytes for t, _ in replays]
        return (max(peaks), timing.step_s), peaks.index(max(peaks))

    best, worst_rank = score(counts)
    for _ in range(len(graph.regions) * schedule.num_stages):
        moves = []
        for s in schedule.stages(worst_rank):
            for t in range(len(counts)):
                if t != s and counts[s] > 1:  # the cuts between s and t each shift by one block
                    c = list(counts)
                    c[s] -= 1
                    c[t] += 1
                    moves.append(tuple(c))
        scored = [(*score(c), c) for c in moves]
        if not scored or min(scored)[0] >= best:
            return path
        best, worst_rank, counts = min(scored)
        path.append(counts)
    return path


def _check(graph: OpGraph, config: TrainConfig) -> None:
    for dim in ("tp", "ep", "cp"):
        if graph.meta.get(dim, 1) != getattr(config, dim):
            raise MemplanError(
                f"the graph was traced at --{dim} {graph.meta.get(dim, 1)}, the config asks --{dim} "
                f"{getattr(config, dim)}; trace one rank of the layout "
                "(planner.tracing.parallel.rank_trace.trace_tp_rank)"
            )
    if not graph.regions:
        raise MemplanError(
            "memplan found no blocks to cut into pipeline stages; name them with --blocks GLOB (e.g. 'layers.*')"
        )


def simulate_pipeline(
    graph: OpGraph, config: TrainConfig, choices: Sequence[SpanChoice] = (), memplan_runtime: bool = True
) -> PipelineTimeline:
    """Every pp rank of a pipeline step; `graph` is the step traced at one microbatch's batch.
    `choices`: recompute span choices inside stages (a plan per stage, resolved on `graph`), run
    by memplan's runtime (`memplan_runtime`: apply_plan and planner.recompute_in_bubbles, early in a
    stage's wait for its gradient where they may, once in I on a stage whose backward is split), or
    else by torch's checkpoint in every backward, as torchtitan's activation checkpointing runs them
    (refused on a split stage, where it recomputes once per weight group)."""
    _check(graph, config)
    schedule = pipeline_schedule(config)
    if config.pp_split.strip() == "auto":
        counts = auto_split_path(graph, config)[-1]
    else:
        counts = blocks_per_stage(len(graph.regions), schedule.num_stages, config.pp_split)
    cuts, timing, replays = _evaluate(graph, config, schedule, counts, choices, memplan_runtime)
    groups = group_roles(config, lambda c: c.pp)
    roles = tuple(
        RankRole(
            ranks=tuple(c.rank for c in group),
            coords=group[0],
            stages=schedule.stages(group[0].pp),
            timeline=replays[group[0].pp][0],
        )
        for group in groups
    )
    return PipelineTimeline(
        layout=LayoutTimeline(config, roles),
        schedule=schedule,
        blocks_per_stage=tuple(c.num_blocks for c in cuts),
        time=timing,
        peak_actions=tuple(str(a) for _, a in replays),
        in_flight=tuple(max_in_flight(schedule, r) for r in range(schedule.pp)),
    )


def heaviest_role(
    graphs: Mapping[Hashable, OpGraph],
    config: TrainConfig,
    choices: Mapping[Hashable, Sequence[SpanChoice]] | None = None,
) -> Hashable:
    """The role whose pipeline peaks highest, each replayed at the config's split (``auto``: at the
    uniform one, where the roles' splits would differ)."""
    probe = config.with_(pp_split="uniform") if config.pp_split.strip() == "auto" else config
    peaks = {key: simulate_pipeline(g, probe, (choices or {}).get(key, ())).peak_bytes for key, g in graphs.items()}
    return max(peaks, key=peaks.__getitem__)


def simulate_pipeline_roles(
    graphs: Mapping[Hashable, OpGraph],
    role_of: Callable[[RankCoords], Hashable],
    config: TrainConfig,
    choices: Mapping[Hashable, Sequence[SpanChoice]] | None = None,
    heaviest: Hashable | None = None,
) -> PipelineTimeline:
    """Every rank of a pipeline whose stage ranks differ: each distinct role's graph (the key
    `role_of` gives a rank's coordinates; under expert parallel, EP indices whose experts receive
    different rows) replayed under one split, the heaviest role's, each role under its own
    `choices`. The step lasts as long as the slowest role's (the ranks of a stage wait for each
    other in every collective); per pp rank, the peak action and in-flight count are its heaviest role's.
    `heaviest`: :func:`heaviest_role` under these choices, where the caller has it already."""
    choices = choices or {}
    if len(graphs) == 1:
        key, graph = next(iter(graphs.items()))
        return simulate_pipeline(graph, config, choices.get(key, ()))
    heaviest = heaviest if heaviest is not None else heaviest_role(graphs, config, choices)
    first = simulate_pipeline(graphs[heaviest], config, choices.get(heaviest, ()))
    counts = first.blocks_per_stage
    split = config.with_(pp_split=",".join(map(str, counts)))
    results = {
        key: first if key == heaviest else simulate_pipeline(graph, split, choices.get(key, ()))
        for key, graph in graphs.items()
    }
    pp = results[heaviest].schedule.pp
    roles = tuple(
        RankRole(
            ranks=tuple(c.rank for c in group),
            coords=group[0],
            stages=results[role_of(group[0])].schedule.stages(group[0].pp),
            timeline=results[role_of(group[0])].layout.roles[group[0].pp].timeline,
        )
        for group in group_roles(config, lambda c: (c.pp, role_of(c)))
    )
    worst_per_rank = [max(results.values(), key=lambda r: r.layout.roles[p].peak_bytes) for p in range(pp)]
    return PipelineTimeline(
        layout=LayoutTimeline(config, roles),
        schedule=results[heaviest].schedule,
        blocks_per_stage=counts,
        time=max((r.time for r in results.values()), key=lambda t: t.step_s),
        peak_actions=tuple(r.peak_actions[p] for p, r in enumerate(worst_per_rank)),
        in_flight=tuple(r.in_flight[p] for p, r in enumerate(worst_per_rank)),
    )
