"""A pipeline step's time and bubble from its schedule's action lists and per-stage op times.

Each rank runs its compute actions in its order; F(s, m) waits for F(s-1, m), B or I (s, m) for
B or I (s+1, m) (the last stage for its own F), W runs where the rank's order puts it.
Point-to-point transfers are taken as free (they overlap compute in torch's runtime).
A stage's early recompute (:mod:`planner.simulation.pipeline_early`) starts a B as soon as the rank
is free, before the gradient it waits for arrives: only what the wait does not cover adds time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from planner.errors import MemplanError
from planner.simulation.pipeline_schedule import INPUT_GRADIENT_KINDS, PipelineSchedule
from planner.simulation.pipeline_split import StageCut, weight_gradient_ops
from planner.tracing.graph import OpGraph

__all__ = ["PipelineTime", "stage_times", "pipeline_time"]


@dataclass(frozen=True)
class PipelineTime:
    """Step time (the last action's end), each rank's busy seconds and idle fraction (its bubble)."""

    step_s: float
    busy_s: tuple[float, ...]
    stage_times_s: dict[str, tuple[float, ...]]  # "F", "B", "I", "W" -> seconds per stage
    first_start_s: tuple[float, ...] = ()  # per rank: when its first action starts
    last_end_s: tuple[float, ...] = ()  # per rank: when its last action ends
    # (stage, kind, microbatch) -> seconds its rank sat idle before it, waiting on another stage
    waits_s: dict[tuple[int, str, int], float] = field(default_factory=dict, compare=False)
    hidden_recompute_s: tuple[float, ...] = ()  # per rank: early recompute run while it waited
    hidden_recompute_by_stage_s: tuple[float, ...] = ()  # the same, per stage

    @property
    def bubble(self) -> tuple[float, ...]:
        return tuple(1.0 - b / self.step_s if self.step_s > 0 else 0.0 for b in self.busy_s)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time over the step."""
        return float(np.mean(self.bubble)) if self.busy_s else 0.0

    def to_dict(self) -> dict:
        return {
            "step_s": self.step_s,
            "busy_s": list(self.busy_s),
            "bubble": list(self.bubble),
            "bubble_fraction": self.bubble_fraction,
            "stage_times_s": {k: list(v) for k, v in self.stage_times_s.items()},
            "hidden_recompute_s": list(self.hidden_recompute_s),
        }


def stage_times(graph: OpGraph, cuts: tuple[StageCut, ...], times: np.ndarray) -> dict[str, tuple[float, ...]]:
    """Seconds of each stage's F, B, I (input gradients) and W (weight gradients; stage 0's whole backward)."""
    weight = np.zeros(len(graph.ops), dtype=bool)
    weight[list(weight_gradient_ops(graph))] = True
    out: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": []}
    for c in cuts:
        bwd = slice(c.bwd_start, c.bwd_end)
        b = float(times[bwd].sum())
        w = b if c.index == 0 else float(times[bwd][weight[bwd]].sum())
        out["F"].append(float(times[c.fwd_start : c.fwd_end].sum()))
        out["B"].append(b)
        out["W"].append(w)
        out["I"].append(b - w)
    return {k: tuple(v) for k, v in out.items()}


def pipeline_time(
    schedule: PipelineSchedule, per_stage: dict[str, tuple[float, ...]], early_s: tuple[float, ...] = ()
) -> PipelineTime:
    """Replay every rank's compute actions against their cross-stage dependencies. `early_s`: per
    stage, the seconds of each B's recompute that may run before its gradient arrives (part of B)."""
    last = schedule.num_stages - 1
    queues = [list(schedule.compute(r)) for r in range(schedule.pp)]
    pos = [0] * schedule.pp
    free_at = [0.0] * schedule.pp
    busy = [0.0] * schedule.pp
    first = [None] * schedule.pp
    done: dict[tuple[int, str, int], float] = {}
    waits: dict[tuple[int, str, int], float] = {}
    hidden = [0.0] * schedule.pp
    hidden_by_stage = [0.0] * schedule.num_stages
    remaining = sum(len(q) for q in queues)
    while remaining:
        progressed = False
        for r, q in enumerate(queues):
            while pos[r] < len(q):
                a = q[pos[r]]
                if a.kind == "F":
                    deps = [(a.stage - 1, "F", a.microbatch)] if a.stage > 0 else []
                elif a.kind in INPUT_GRADIENT_KINDS:
                    after = a.stage + 1
                    deps = (
                        [(a.stage, "F", a.microbatch)]
                        if a.stage == last
                        else [(after, "B", a.microbatch), (after, "I", a.microbatch)]
                    )
                else:
                    deps = [(a.stage, "I", a.microbatch), (a.stage, "B", a.microbatch)]
                ready = [done[d] for d in deps if d in done]
                if deps and not ready:
                    break
                seconds = per_stage[a.kind][a.stage]
                ahead = min(early_s[a.stage], seconds) if a.kind in INPUT_GRADIENT_KINDS and early_s and ready else 0.0
                start = max([free_at[r], *[t - ahead for t in ready]])
                first[r] = start if first[r] is None else first[r]
                key = (a.stage, a.kind, a.microbatch)
                if ready and max(ready) > free_at[r]:
                    waits[key] = max(ready) - free_at[r]
                    covered = min(ahead, waits[key])
                    hidden[r] += covered
                    hidden_by_stage[a.stage] += covered
                free_at[r] = start + seconds
                busy[r] += seconds
                done[(a.stage, a.kind, a.microbatch)] = free_at[r]
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise MemplanError(f"the {schedule.name} schedule's actions wait on each other; cannot time it")
    return PipelineTime(
        step_s=max(free_at),
        busy_s=tuple(busy),
        stage_times_s=per_stage,
        first_start_s=tuple(0.0 if f is None else f for f in first),
        last_end_s=tuple(free_at),
        waits_s=waits,
        hidden_recompute_s=tuple(hidden),
        hidden_recompute_by_stage_s=tuple(hidden_by_stage),
    )
