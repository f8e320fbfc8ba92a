"""Which recompute of a pipeline stage may run in the bubble before its backward.

A stage past the last waits, before each backward B, for the gradient of its output from the
next stage. A recompute that memplan replays at the very start of that backward (a block whose
backward is the stage's first, checkpointed whole) needs nothing from the gradient: run while
the rank waits, it leaves the memory curve as it was (the same tensors, live from the same point
of the rank's order: the end of the action before B) and adds only what the wait does not cover.
`planner.runtime.early_recompute` runs it there under torch's GPipe and 1F1B schedules, whose
loop waits on the gradient right before B; the multi-stage runtime posts its receives earlier,
so its schedules recompute in B as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.config import SINGLE_STAGE_SCHEDULES
from planner.simulation.effects import SpanChoice, effective_keeps
from planner.simulation.pipeline_schedule import PipelineSchedule
from planner.simulation.pipeline_split import StageCut
from planner.tracing.graph import OpGraph

__all__ = ["early_recompute_s", "runs_early"]


def runs_early(graph: OpGraph, schedule: PipelineSchedule, cut: StageCut, choice: SpanChoice) -> bool:
    """Whether `choice` (inside stage `cut`) recomputes while its stage waits for a B's gradient:
    checkpointed whole (no kept op, an expert-parallel block's kept all-to-all included)."""
    return (
        schedule.name in SINGLE_STAGE_SCHEDULES
        and cut.index < schedule.num_stages - 1
        and choice.mode == "recompute"
        and choice.span.bwd_start == cut.bwd_start
        and not effective_keeps(graph, choice)
    )


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
