"""Why a parallel job (tensor, context, expert or pipeline parallel) would run out of memory on its
worst rank, and which change fixes it: every remedy is simulated on every rank of the new layout.

The verdicts are :func:`planner.analysis.diagnose.classify`'s, on the rank with the highest peak
(model states: the rank that holds the most). The caller hands in how to simulate a layout and how
to plan one (planner.api's ``simulate_layout`` and the per-rank or per-stage planners), so this
module stays below the API. The allocator's overhead is taken as 2% of the device (its replay
models one device's step), and the longest fitting sequence is not searched (each length would
trace every rank role again).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from costmodels.hardware import get_device
from planner.analysis.diagnose import (
    MIN_FRAGMENTATION_FRACTION,
    Diagnosis,
    Remedy,
    classify,
    diagnosis_of,
    summary,
)
from planner.config import DEFAULT_RESERVE, TrainConfig
from planner.errors import InfeasibleBudget, MemplanError, SequenceParallelUnsupported
from planner.simulation.pipeline import PipelineTimeline
from planner.simulation.ranks import LayoutTimeline

__all__ = ["LayoutPlanner", "LayoutSimulator", "PlannedLayout", "diagnose_layout"]

LayoutSimulator = Callable[[TrainConfig], LayoutTimeline | PipelineTimeline]


@dataclass(frozen=True)
class PlannedLayout:
    """What a plan for every rank of a layout reaches: its worst rank's peak, the step's added
    time (a fraction) and how many decisions it makes."""

    peak_bytes: int
    overhead: float
    decisions: int


LayoutPlanner = Callable[[TrainConfig, int], PlannedLayout]  # (config, budget bytes); raises InfeasibleBudget


@dataclass(frozen=True)
class _Change:
    """A layout change worth simulating; `more_gpus`: it takes more GPUs per replica."""

    name: str
    description: str
    config: TrainConfig
    note: str
    more_gpus: bool = False


def _step_s(result: LayoutTimeline | PipelineTimeline) -> float:
    """A layout's step: the pipeline's (bubbles included), else its slowest rank's."""
    if isinstance(result, PipelineTimeline):
        return result.time.step_s
    return max(role.timeline.costs.step_s for role in result.roles)


def _layout_of(result: LayoutTimeline | PipelineTimeline) -> LayoutTimeline:
    return result.layout if isinstance(result, PipelineTimeline) else result


def diagnose_layout(
    spec: str,
    config: TrainConfig,
    simulate_layout: LayoutSimulator,
    plan_layout: LayoutPlanner,
    *,
    remedies: bool = True,
) -> Diagnosis:
    """Simulate every rank of `config`'s layout, classify its worst rank, rank simulated remedies."""
    capacity = get_device(config.gpu).memory_bytes
    base = simulate_layout(config)
    layout = _layout_of(base)
    worst = layout.worst
    tl = worst.timeline
    states = max(sum(role.timeline.model_states.values()) for role in layout.roles)
    expected = int(capacity * MIN_FRAGMENTATION_FRACTION)
    verdict = classify(states, tl.peak_bytes, capacity, expected)
    found = []
    if remedies and verdict != "fits":
        found = _remedies(config, base, verdict, capacity, simulate_layout, plan_layout)
    rank = f" on rank {worst.ranks[0]} ({', '.join(f'{k}={v}' for k, v in worst.coords.to_dict().items())})"
    ranks = tuple(role.to_dict() for role in layout.roles)
    allocator = {"peak_allocated_bytes": tl.peak_bytes, "expected_reserved_bytes": tl.peak_bytes + expected}
    text = summary(verdict, config, tl, states, capacity, expected, 0, rank=rank)
    return diagnosis_of(
        spec, config, tl, capacity, verdict, states, allocator, expected, None, tuple(found), text, ranks
    )


def _candidates(config: TrainConfig, verdict: str) -> list[_Change]:
    """Each layout change worth simulating for this verdict."""
    out = []
    if config.precision == "fp32" and verdict != "oom-init":
        description = "train in bf16 autocast with fp32 master weights"
        out.append(_Change("mixed precision", description, config.with_(precision="bf16-mixed"), ""))
    if config.optimizer == "adamw":
        new = config.with_(optimizer="adamw-8bit")
        out.append(_Change("8-bit optimizer", "keep AdamW states in 8 bits", new, "states shrink 4x"))
    gpus = f"needs {config.world_size * 2} GPUs"
    if config.tp * 2 <= get_device(config.gpu).gpus_per_node:
        description = f"--tp {config.tp * 2}: shard every block over twice the GPUs of a node"
        out.append(_Change("more tensor parallel", description, config.with_(tp=config.tp * 2), gpus, True))
    microbatches = max(config.num_microbatches, config.pp * 2)
    if config.pp > 1 and microbatches <= config.batch_size:
        new = config.with_(pp=config.pp * 2, microbatches=microbatches)
        description = f"--pp {config.pp * 2}: each stage holds half the blocks"
        out.append(_Change("more pipeline stages", description, new, f"{gpus}; {microbatches} microbatches", True))
    dp = config.dp * 2
    description = f"--dp {dp} --zero 3: shard parameters, gradients and optimizer states over {dp} replicas"
    out.append(_Change("FSDP over more GPUs", description, config.with_(dp=dp, zero_stage=3), gpus, True))
    half = config.batch_size // 2
    if verdict != "oom-init" and half >= (config.num_microbatches if config.pp > 1 else 1):
        steps = config.grad_accum_steps * 2
        new = config.with_(batch_size=half, grad_accum_steps=steps)
        note = "the same samples per optimizer step in twice the micro-steps"
        out.append(_Change("gradient accumulation", f"--batch-size {half} --grad-accum {steps}", new, note))
    return out


def _remedies(
    config: TrainConfig,
    base: LayoutTimeline | PipelineTimeline,
    verdict: str,
    capacity: int,
    simulate_layout: LayoutSimulator,
    plan_layout: LayoutPlanner,
) -> list[Remedy]:
    base_s = _step_s(base)
    before = config.to_dict()
    out: list[Remedy] = []
    for change in _candidates(config, verdict):
        try:
            change, result = _simulated(change, simulate_layout)
        except MemplanError:  # the model cannot take that layout (heads or blocks do not divide)
            continue
        overhead = _step_s(result) / base_s - 1.0 if base_s > 0 else 0.0
        if change.more_gpus:
            overhead = max(0.0, overhead)  # more GPUs per replica is not a speed-up to sell
        changes = {k: v for k, v in change.config.to_dict().items() if before.get(k) != v}
        fits = result.peak_bytes <= capacity
        out.append(Remedy(change.name, change.description, changes, result.peak_bytes, fits, overhead, change.note))
    planned = _plan_remedy(config, base.peak_bytes, capacity, plan_layout) if verdict != "oom-init" else None
    if planned is not None:
        out.append(planned)
    out.sort(key=lambda r: (not r.fits, r.overhead, r.peak_bytes))
    return out


def _simulated(change: _Change, simulate_layout: LayoutSimulator) -> tuple[_Change, LayoutTimeline | PipelineTimeline]:
    """The change and its simulation; where its tensor-parallel plan cannot run sequence parallel,
    the change without it (its description says --no-sp)."""
    try:
        return change, simulate_layout(change.config)
    except SequenceParallelUnsupported:
        config = change.config.with_(sequence_parallel=False)
        change = replace(change, description=f"{change.description} (--no-sp)", config=config)
        return change, simulate_layout(config)


def _plan_remedy(config: TrainConfig, peak_bytes: int, capacity: int, plan_layout: LayoutPlanner) -> Remedy | None:
    """A plan for every rank under 95% of the device (None where memplan cannot plan this layout)."""
    budget = int(capacity * (1 - DEFAULT_RESERVE))
    what = "memplan plan --pp: a plan per stage" if config.pp > 1 else "memplan plan: a plan for the worst rank"
    remedy = Remedy(
        "checkpoint plan", f"recompute what the solver picks ({what})", {"budget_bytes": budget}, 0, False, 0.0
    )
    try:
        planned = plan_layout(config, budget)
    except InfeasibleBudget as exc:
        peak = exc.smallest_peak_bytes if exc.smallest_peak_bytes is not None else peak_bytes
        return replace(
            remedy, peak_bytes=peak, note="no plan reaches 95% of the device; the peak is the smallest reachable"
        )
    except MemplanError:  # a layout the planner refuses (it says why under memplan plan)
        return None
    return replace(
        remedy,
        peak_bytes=planned.peak_bytes,
        fits=planned.peak_bytes <= capacity,
        overhead=planned.overhead,
        note=f"{planned.decisions} decisions, every rank checked",
    )
