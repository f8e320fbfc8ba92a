"""Which recompute of a pipeline stage may run in the bubble before its backward.

A stage past the last waits, before each backward B, for the gradient of its output from the
next stage. A recompute that memplan replays at the very start of that backward (a block whose
backward is the stage's first, checkpointed whole) needs nothing from the gradient: run while
the rank waits, it leaves the memory curve as it was (the same tensors, live from the same point
of the rank's order: the end of the action before B) and adds only what the wait does not cover.
`planner.runtime.early_recompute` runs it there: torch's schedules wait on a B's gradient right
before B (GPipe and 1F1B; interleaved 1F1B and looped BFS, each of their stages on its own), and
under a split backward on I's gradient right before I, where a stage past the first recomputes
(memplan's checkpoint, held until W). Not where the next stage lives on the same rank (the
V-shaped schedules hand the gradient over with no wait), nor on stage 0 under a split backward,
which recomputes in W, after its I.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.simulation.effects import SpanChoice, effective_keeps
from planner.simulation.pipeline_schedule import PipelineSchedule
from planner.simulation.pipeline_split import StageCut
from planner.tracing.graph import OpGraph

__all__ = ["early_recompute_s", "runs_early"]


def runs_early(graph: OpGraph, schedule: PipelineSchedule, cut: StageCut, choice: SpanChoice) -> bool:
    """Whether `choice` (inside stage `cut`) recomputes while its stage waits for a B's gradient:
    checkpointed whole (no kept op, an expert-parallel block's kept all-to-all included)."""
    return (
        choice.mode == "recompute"
        and choice.span.bwd_start == cut.bwd_start
        and _waits_for_gradient(schedule, cut.index)
        and not effective_keeps(graph, choice)
    )


def _waits_for_gradient(schedule: PipelineSchedule, stage: int) -> bool:
    """Whether `stage` has a next stage on another rank and recomputes in the backward that waits
    for it: B, or I on a stage whose backward is split (stage 0 recomputes in W, after its I)."""
    if stage == schedule.num_stages - 1:
        return False
    rank = {s: r for r in range(schedule.pp) for s in schedule.stages(r)}
    kinds = {a.kind for a in schedule.compute(rank[stage]) if a.stage == stage and a.kind != "F"}
    waited = kinds == {"B"} or (stage in schedule.split_stages and kinds <= {"B", "I", "W"})
    return rank[stage + 1] != rank[stage] and waited


def early_recompute_s(
    graph: OpGraph,
    schedule: PipelineSchedule,
    cuts: Sequence[StageCut],
    choices: Sequence[tuple[int, SpanChoice, float]],
) -> tuple[float, ...]:
    """Per stage, the seconds of each B's recompute that may run before its gradient arrives;
    `choices`: (stage, choice, its recompute seconds per backward)."""
    out = [0.0] * len(cuts)
    for stage, choice, seconds in choices:
        if runs_early(graph, schedule, cuts[stage], choice):
            out[stage] += seconds
    return tuple(out)
