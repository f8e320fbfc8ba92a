"""Why a training step does not fit a device, and what to change: verdict plus simulated remedies.

`diagnose` traces the step once, simulates it and classifies it: ``oom-init`` (model states
alone exceed the device), ``oom-iteration`` (the step's peak does), ``at-risk`` (the peak fits
but the headroom is smaller than what PyTorch's caching allocator is expected to add) or
``fits``. Every remedy is simulated for real (re-tracing only when shapes or precision change)
and the list is ranked: remedies that fit first, then by added step time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from costmodels.allocator import AllocatorEstimate, simulate_allocator
from costmodels.hardware import get_device
from planner.analysis.oom_message import explain_oom_message
from planner.analysis.snapshot import read_snapshot
from planner.config import DEFAULT_RESERVE, DEFAULT_TIME_LIMIT_S, TrainConfig
from planner.errors import InfeasibleBudget, PlanFileError
from planner.plans.format import Plan, Predicted
from planner.simulation.costs import model_states_for, storage_bytes
from planner.simulation.step import Timeline, simulate, step_events
from planner.solver.planning import solve
from planner.tracing.graph import OpGraph
from planner.tracing.recorder import TraceCache
from planner.units import fit_verdict, format_bytes

__all__ = [
    "Remedy",
    "Diagnosis",
    "diagnose",
    "diagnose_snapshot",
    "diagnose_oom_message",
    "allocator_events",
    "allocator_estimate",
    "VERDICTS",
    "classify",
    "diagnosis_of",
    "summary",
]

VERDICTS = ("oom-init", "oom-iteration", "at-risk", "fits")
MIN_FRAGMENTATION_FRACTION = 0.02  # the allocator is expected to add at least 2% of the device
MAX_SEQ_TRACES = 6  # bound on re-traces while searching the longest fitting sequence
MAX_BATCH_TRACES = 3  # bound on re-traces while halving the micro-batch
ZERO_DPS = (2, 4, 8)


@dataclass(frozen=True)
class Remedy:
    """One change to the run, with its simulated per-device peak and added step time."""

    name: str
    description: str
    config_changes: dict
    peak_bytes: int
    fits: bool
    overhead: float  # added step time as a fraction of the current step (negative: faster)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "config_changes": dict(self.config_changes)}


@dataclass(frozen=True)
class Diagnosis:
    """Verdict of one step on one device, the peak's cause, the allocator estimate and remedies."""

    model: str
    config: dict
    capacity_bytes: int
    verdict: str
    peak_bytes: int
    peak_phase: str
    peak_op: str
    peak_module: str
    breakdown_at_peak: dict
    model_states: dict
    model_state_bytes: int
    headroom_bytes: int  # capacity - peak (negative: short by)
    allocator: dict  # allocated/reserved peaks of the no-plan step and the expected overhead
    expected_overhead_bytes: int
    longest_fitting_seq_len: int | None  # oom-iteration only: longest sequence that fits (None: none)
    remedies: tuple[Remedy, ...] = field(default=())
    summary: str = ""
    ranks: tuple[dict, ...] = ()  # a parallel job's rank roles (simulate's "ranks" entries); none for one device

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["remedies"] = [r.to_dict() for r in self.remedies]
        if not self.ranks:
            del out["ranks"]
        return out


# -- allocator estimate -------------------------------------------------------------------------
def allocator_events(graph: OpGraph, config: TrainConfig) -> Iterator[tuple[int, int]]:
    """(id, nbytes) events of the no-plan step as the simulator runs it (0 bytes frees).

    Parameters, buffers and inputs exist first, then one optimizer-state block per parameter
    (the per-device optimizer bytes split in proportion to parameter size); then the simulator's
    own event stream (:func:`planner.simulation.step.step_events`); the optimizer step's temporary
    is allocated and freed at the end.
    """
    sizes = storage_bytes(graph, config)
    states = model_states_for(graph, config)
    slots = step_events(graph, sizes)
    params = [ev.storage for ev in slots[0] if ev.category == "parameter"]
    param_total = sum(graph.tensors[i].nbytes for i in params)
    next_id = max(graph.tensors, default=0) + 1
    live: dict[int, list[int]] = defaultdict(list)  # storage -> allocator ids of its live copies
    for slot_index, slot in enumerate(slots):
        for ev in slot:
            if ev.nbytes > 0:
                block = ev.storage if not live[ev.storage] else next_id
                next_id += block != ev.storage
                live[ev.storage].append(block)
                yield block, max(1, ev.nbytes)
            elif ev.nbytes < 0 and live[ev.storage]:
                yield live[ev.storage].pop(), 0
        if slot_index == 0 and states.optimizer and param_total:
            for tid in params:
                share = states.optimizer * graph.tensors[tid].nbytes // param_total
                if share > 0:
                    yield next_id, share
                    next_id += 1
    if states.optimizer_step_temporary:
        yield next_id, states.optimizer_step_temporary
        yield next_id, 0


def allocator_estimate(graph: OpGraph, config: TrainConfig) -> AllocatorEstimate:
    """PyTorch caching-allocator replay of the no-plan step (peak reserved vs allocated)."""
    return simulate_allocator(allocator_events(graph, config))


# -- helpers --------------------------------------------------------------------------------------
def _changes(base: TrainConfig, new: TrainConfig) -> dict:
    a, b = base.to_dict(), new.to_dict()
    return {k: v for k, v in b.items() if a.get(k) != v}  # to_dict leaves some defaults out


def _relative_time(new: Timeline, base: Timeline) -> float:
    return new.costs.step_s / base.costs.step_s - 1.0 if base.costs.step_s > 0 else 0.0


def _longest_seq(traces: TraceCache, config: TrainConfig, capacity: int) -> int | None:
    """Longest seq_len <= config.seq_len that fits: binary search over halvings, then bisection."""

    def fits(seq: int) -> bool:
        c = config.with_(seq_len=seq)
        return simulate(traces(c), c).peak_bytes <= capacity

    exps = []
    s = config.seq_len // 2
    while s >= 1:
        exps.append(s)  # descending
        s //= 2
    if not exps:
        return None
    if not fits(exps[-1]):
        return None
    used, best_i = 1, len(exps) - 1
    lo, hi = 0, best_i - 1  # find the smallest index (longest seq) that fits
    while lo <= hi and used < MAX_SEQ_TRACES:
        mid = (lo + hi) // 2
        used += 1
        if fits(exps[mid]):
            best_i, hi = mid, mid - 1
        else:
            lo = mid + 1
    best = exps[best_i]
    upper = exps[best_i - 1] if best_i > 0 else config.seq_len  # known (or assumed) not to fit
    step = 8 if best >= 64 else 1
    while used < MAX_SEQ_TRACES and upper - best > step:
        mid = (best + upper) // 2 // step * step
        if mid <= best:
            break
        used += 1
        if fits(mid):
            best = mid
        else:
            upper = mid
    return best


# -- remedies -------------------------------------------------------------------------------------
def _remedies(
    traces: TraceCache,
    config: TrainConfig,
    base: Timeline,
    verdict: str,
    capacity: int,
    time_limit_s: float,
    plan: Plan | None = None,
) -> list[Remedy]:
    """Remedies priced against `capacity`; with `plan` (a live run's plan in force, `base` its
    timeline) each is priced with that plan applied, and the plan remedy is a tighter plan."""
    device = get_device(config.gpu)
    graph = traces(config)
    out: list[Remedy] = []

    def simulated(name: str, description: str, new: TrainConfig, note: str = "") -> Remedy:
        try:
            tl = simulate(traces(new), new, plan=plan)
        except PlanFileError:  # the plan's op-level keeps do not exist in this configuration's trace
            tl = simulate(traces(new), new)
            note = (note + "; " if note else "") + "priced without the plan in force"
        return Remedy(
            name,
            description,
            _changes(config, new),
            tl.peak_bytes,
            tl.peak_bytes <= capacity,
            _relative_time(tl, base),
            note,
        )

    if config.precision == "fp32" and verdict != "oom-init":  # fp32 master weights: states do not shrink
        out.append(
            simulated(
                "mixed precision",
                "train in bf16 autocast with fp32 master weights",
                config.with_(precision="bf16-mixed"),
                "activations in bf16; parameter, gradient and Adam states stay fp32",
            )
        )
    if config.optimizer == "adamw":
        out.append(
            simulated(
                "8-bit optimizer",
                "keep AdamW states in 8 bits (bitsandbytes AdamW8bit)",
                config.with_(optimizer="adamw-8bit"),
                "optimizer states shrink 4x",
            )
        )
    if config.zero_stage < 3 or config.dp == 1:
        dps = ZERO_DPS if config.dp == 1 else (config.dp, config.dp * 2, config.dp * 4)
    else:
        dps = (config.dp * 2, config.dp * 4, config.dp * 8)
    best: Remedy | None = None
    for dp in dps:
        new = config.with_(zero_stage=3, dp=dp)
        r = simulated(
            "ZeRO-3 / FSDP",
            f"shard parameters, gradients and optimizer states over {dp} GPUs",
            new,
            f"needs {dp} GPUs; all-gather/reduce-scatter traffic is not in the time cost",
        )
        r = replace(r, overhead=max(0.0, r.overhead))  # a sharded optimizer step is not a speed-up to sell
        best = r
        if r.fits:
            break
    if best is not None:
        out.append(best)
    if verdict != "oom-init" and plan is not None:
        out.append(_tighter_plan(graph, config, base, plan, capacity, time_limit_s))
    elif verdict != "oom-init":
        budget = int(capacity * (1 - DEFAULT_RESERVE))
        targets = [(None, "checkpoint plan", "recompute what the solver picks (memplan plan)")]
        if device.is_cuda:
            targets.append(("cpu", "offload plan", "recompute or offload to host memory (memplan plan --offload cpu)"))
        for offload, name, description in targets:
            changes = {"plan": "optimal" if offload is None else f"optimal, offload {offload}", "budget_bytes": budget}
            try:
                plan = solve(graph, config, budget, offload=offload, time_limit_s=time_limit_s)
            except InfeasibleBudget as exc:
                peak = exc.smallest_peak_bytes
                out.append(
                    Remedy(
                        name,
                        description,
                        changes,
                        peak if peak is not None else base.peak_bytes,
                        False,
                        0.0,
                        "no plan reaches 95% of the device; the peak is the smallest reachable",
                    )
                )
                continue
            p = plan.predicted
            note = f"{len(plan.decisions)} decisions"
            if p.offload_bytes:
                note += f"; offloads {format_bytes(p.offload_bytes)} per step"
            out.append(Remedy(name, description, changes, p.peak_bytes, p.peak_bytes <= capacity, p.overhead, note))
        if config.batch_size > 1:
            batch, r = config.batch_size, None
            for _ in range(MAX_BATCH_TRACES):
                batch //= 2
                if batch < 1:
                    break
                steps = -(-config.batch_size // batch)
                new = config.with_(batch_size=batch, grad_accum_steps=config.grad_accum_steps * steps)
                r = simulated(
                    "gradient accumulation",
                    f"micro-batch {batch} with {steps} accumulation steps",
                    new,
                    f"{batch * steps} samples per optimizer step in {steps} micro-steps; "
                    "smaller matmuls may run less efficiently",
                )
                r = replace(r, config_changes={"batch_size": batch, "accumulation_steps": steps})
                if r.fits:
                    break
            if r is not None:
                out.append(r)
    out.sort(key=lambda r: (not r.fits, r.overhead, r.peak_bytes))
    return out


def _tighter_plan(
    graph: OpGraph, config: TrainConfig, in_force: Timeline, plan: Plan, capacity: int, time_limit_s: float
) -> Remedy:
    """A plan 5% below the lower of the plan in force's predicted peak and the capacity: the run
    needed more than that plan predicts, so only a tighter one helps."""
    budget = int(min(in_force.peak_bytes, capacity) * (1 - DEFAULT_RESERVE))
    changes = {"plan": "optimal", "budget_bytes": budget}
    description = f"re-plan under {format_bytes(budget)} (handle.set_budget({budget}))"
    try:
        tighter = solve(graph, config, budget, time_limit_s=time_limit_s)
    except InfeasibleBudget as exc:
        peak = exc.smallest_peak_bytes if exc.smallest_peak_bytes is not None else in_force.peak_bytes
        return Remedy("tighter plan", description, changes, peak, peak <= capacity, 0.0, "no plan reaches that budget")
    p = tighter.predicted
    note = f"{len(tighter.decisions)} decisions, against {len(plan.decisions)} in the plan in force"
    return Remedy(
        "tighter plan",
        description,
        changes,
        p.peak_bytes,
        p.peak_bytes <= capacity,
        _relative_time_s(p, in_force),
        note,
    )


def _relative_time_s(predicted: Predicted, base: Timeline) -> float:
    return predicted.step_s / base.costs.step_s - 1.0 if base.costs.step_s > 0 else 0.0


def classify(model_state_bytes: int, peak_bytes: int, capacity_bytes: int, expected_overhead_bytes: int) -> str:
    """The verdict (one of VERDICTS) of a device's step: its model states, its peak, and the
    allocator overhead expected on top of that peak."""
    if model_state_bytes > capacity_bytes:
        return "oom-init"
    if peak_bytes > capacity_bytes:
        return "oom-iteration"
    if capacity_bytes - peak_bytes < expected_overhead_bytes:
        return "at-risk"
    return "fits"


# -- entry points -----------------------------------------------------------------------------------
def diagnose(
    spec: str, config: TrainConfig, *, remedies: bool = True, time_limit_s: float = DEFAULT_TIME_LIMIT_S
) -> Diagnosis:
    """Trace and simulate one step of `spec` under `config` on `config.gpu`, classify it, rank remedies."""
    capacity = get_device(config.gpu).memory_bytes
    traces = TraceCache(spec)
    graph = traces(config)
    tl = simulate(graph, config)
    states = sum(tl.model_states.values())
    estimate = allocator_estimate(graph, config)
    fragmentation = max(estimate.peak_reserved_bytes - estimate.peak_allocated_bytes, 0)
    expected = max(fragmentation, int(capacity * MIN_FRAGMENTATION_FRACTION))
    verdict = classify(states, tl.peak_bytes, capacity, expected)
    longest = _longest_seq(traces, config, capacity) if verdict == "oom-iteration" else None
    found = _remedies(traces, config, tl, verdict, capacity, time_limit_s) if remedies and verdict != "fits" else []
    allocator = {
        "peak_allocated_bytes": estimate.peak_allocated_bytes,
        "peak_reserved_bytes": estimate.peak_reserved_bytes,
        "fragmentation_bytes": fragmentation,
        "fragmentation_headroom": (
            fragmentation / estimate.peak_reserved_bytes if estimate.peak_reserved_bytes else 0.0
        ),
        "expected_reserved_bytes": tl.peak_bytes + expected,
    }
    text = summary(verdict, config, tl, states, capacity, expected, longest)
    return diagnosis_of(spec, config, tl, capacity, verdict, states, allocator, expected, longest, tuple(found), text)


def diagnosis_of(
    spec: str,
    config: TrainConfig,
    tl: Timeline,
    capacity: int,
    verdict: str,
    states: int,
    allocator: dict,
    expected: int,
    longest: int | None,
    remedies: tuple[Remedy, ...],
    summary: str,
    ranks: tuple[dict, ...] = (),
) -> Diagnosis:
    """The Diagnosis of the step `tl` (a device's, or a parallel job's worst rank's, with its `ranks`)."""
    return Diagnosis(
        model=spec,
        config=config.to_dict(),
        capacity_bytes=capacity,
        verdict=verdict,
        peak_bytes=tl.peak_bytes,
        peak_phase=tl.peak_phase,
        peak_op=tl.peak_op,
        peak_module=tl.peak_module,
        breakdown_at_peak=dict(tl.breakdown_at_peak),
        model_states=dict(tl.model_states),
        model_state_bytes=states,
        headroom_bytes=capacity - tl.peak_bytes,
        allocator=allocator,
        expected_overhead_bytes=expected,
        longest_fitting_seq_len=longest,
        remedies=remedies,
        summary=summary,
        ranks=ranks,
    )


def summary(
    verdict: str,
    config: TrainConfig,
    tl: Timeline,
    states: int,
    capacity: int,
    expected: int,
    longest: int | None,
    rank: str = "",
) -> str:
    """One line on a verdict: where the peak is, against the device (`tl`: the step, or a parallel
    job's worst rank, named by `rank`; `longest`: the longest sequence that fits, 0 when not searched)."""
    where = f"{tl.peak_phase} at {tl.peak_op} (module '{tl.peak_module or '<root>'}'){rank}"
    if verdict == "oom-init":
        return (
            f"out of memory before the first step: model states need {format_bytes(states)} per device, "
            f"more than the {format_bytes(capacity)} of {config.gpu}"
        )
    if verdict == "oom-iteration":
        tail = (
            f"; the longest sequence that fits is {longest}"
            if longest
            else "; no sequence length fits at this batch size"
            if longest is None
            else ""
        )
        peak, device, verdict_text = (
            format_bytes(tl.peak_bytes),
            format_bytes(capacity),
            fit_verdict(tl.peak_bytes, capacity),
        )
        return f"out of memory during the step: peak {peak} in {where} on {device}: {verdict_text}{tail}"
    if verdict == "at-risk":
        return (
            f"{fit_verdict(tl.peak_bytes, capacity)}, less than the allocator's expected "
            f"overhead {format_bytes(expected)}: a real run may OOM (peak in {where})"
        )
    return f"peak {format_bytes(tl.peak_bytes)} in {where}: {fit_verdict(tl.peak_bytes, capacity)}"


def diagnose_snapshot(path: str):
    """Read and analyse a CUDA caching-allocator snapshot file (planner.analysis.snapshot.SnapshotReport)."""
    return read_snapshot(path)


def diagnose_oom_message(text: str):
    """Explain a CUDA out-of-memory message (planner.analysis.oom_message.OomExplanation)."""
    return explain_oom_message(text)
