"""Why a live training step ran out of memory: verdict, where, what was live, what to change.

Built from what the run shows (the exception and its traceback, the live-bytes count on CPU,
the allocator's figures in a CUDA message) and what memplan simulated for the plan in force.
Remedies are planner.analysis.diagnose's, simulated on traces of the live model with the plan in
force applied, and priced against the capacity the error reports (the device's when it names none,
the plan's budget on CPU); with a plan in force the plan remedy is a tighter plan.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from costmodels.hardware import get_device
from planner.analysis.diagnose import Remedy, _remedies
from planner.analysis.oom_message import explain_oom_message
from planner.config import TrainConfig
from planner.simulation.step import simulate
from planner.tracing.graph import OpGraph
from planner.tracing.recorder import trace_key
from planner.units import fit_verdict, format_bytes

__all__ = ["OomContext", "OomReport", "build_oom_report", "failing_module", "write_oom_report"]

VERDICTS = ("init", "iteration", "fragmentation")


@dataclass(frozen=True)
class OomContext:
    """What the monitor knew when the error was raised."""

    step: int
    steps_done: int
    handle: Any  # an AutoHandle or None
    model: nn.Module | None
    device: torch.device
    live_bytes: int | None = None  # CPU: live tensor bytes counted when the error was raised
    current_op: str | None = None  # CPU: the aten op that was running
    seq_len: int | None = None


@dataclass(frozen=True)
class OomReport:
    """The root cause of one out-of-memory error in a monitored step."""

    verdict: str  # init | iteration | fragmentation
    step: int
    module: str | None
    op: str | None
    where: str | None  # innermost source line of the traceback
    message: str
    requested_bytes: int | None
    live_bytes: int | None
    budget_bytes: int | None
    predicted_peak_bytes: int | None
    predicted_breakdown: dict[str, int] = field(default_factory=dict)  # by category at the predicted peak
    model_state_bytes: int | None = None
    capacity_bytes: int | None = None  # what the remedies are priced against
    remedies: tuple[Remedy, ...] = ()
    advice: tuple[str, ...] = ()
    snapshot: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["remedies"] = [r.to_dict() for r in self.remedies]
        out["advice"] = list(self.advice)
        return out

    def render(self) -> str:
        lines = [
            f"memplan OOM report: {self.verdict} at step {self.step}",
            f"  error: {self.message}",
            f"  module: {self.module or '<outside any module>'}; op: {self.op or 'unknown'}",
        ]
        if self.where:
            lines.append(f"  at: {self.where}")
        figures = [
            ("requested", self.requested_bytes),
            ("live at failure", self.live_bytes),
            ("budget", self.budget_bytes),
            ("predicted peak", self.predicted_peak_bytes),
            ("model states", self.model_state_bytes),
            ("capacity", self.capacity_bytes),
        ]
        lines.append("  " + ", ".join(f"{k} {format_bytes(v)}" for k, v in figures if v is not None))
        if self.predicted_breakdown:
            lines.append(
                "  predicted at peak: "
                + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.predicted_breakdown.items() if v)
            )
        for i, r in enumerate(self.remedies, 1):
            fits = fit_verdict(r.peak_bytes, self.capacity_bytes) if self.capacity_bytes else "capacity unknown"
            lines.append(
                f"  {i}. {r.name}: {r.description} -> peak {format_bytes(r.peak_bytes)} ({fits}, "
                f"{r.overhead * 100:+.1f}% time)"
            )
        lines += [f"  - {a}" for a in self.advice]
        if self.snapshot:
            lines.append(f"  snapshot: {self.snapshot} (memplan diagnose --snapshot {self.snapshot})")
        return "\n".join(lines)


def failing_module(tb: TracebackType | None, model: nn.Module | None) -> str | None:
    """Path of the innermost module of `model` whose call is on the traceback."""
    if model is None:
        return None
    names = {id(m): name for name, m in model.named_modules()}
    found = None
    for frame, _ in traceback.walk_tb(tb):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            found = names[id(owner)] or "<root>"
    return found


def _where(tb: TracebackType | None) -> str | None:
    frames = traceback.extract_tb(tb)
    return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else None


class _LiveTraces:
    """planner.analysis.diagnose's trace source, served by the live model's tracer."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self._graphs: dict[tuple, OpGraph] = {}

    def __call__(self, config: TrainConfig) -> OpGraph:
        h = self.handle
        graph = h.graph_at(h.seq_len)
        if config.batch_size == int(graph.meta["batch_size"]) and config.precision == h.config.precision:
            return graph  # ZeRO changes model states only: the same trace
        key = trace_key(config)
        if key not in self._graphs:
            self._graphs[key] = h.tracer.retrace(h.seq_len, config.batch_size, config.precision)
        return self._graphs[key]

    @property
    def count(self) -> int:
        return len(self._graphs) + 1


def _capacity(explained: Any, ctx: OomContext, config: TrainConfig, budget_bytes: int) -> int:
    """Bytes the device can give this process: the error's figure (a memory fraction's allowance,
    else the total less other processes), else the device's, else (CPU) the plan's budget."""
    if explained is not None and explained.allowed_bytes:
        return int(explained.allowed_bytes)
    if explained is not None and explained.total_bytes:
        return int(explained.total_bytes) - int(explained.other_processes_bytes or 0)
    if ctx.device.type == "cuda":
        return get_device(config.gpu).memory_bytes
    return budget_bytes


def build_oom_report(
    exc: BaseException, ctx: OomContext, *, remedies: bool = True, time_limit_s: float = 5.0
) -> OomReport:
    """Verdict, place and remedies of an out-of-memory error raised inside a monitored step."""
    message = " ".join(str(exc).split())
    try:
        explained = explain_oom_message(message)
    except ValueError:  # not a CUDA allocator message (an injected or CPU error)
        explained = None
    module = failing_module(exc.__traceback__, ctx.model)
    h = ctx.handle
    if explained is not None and explained.verdict == "fragmentation":
        verdict = "fragmentation"
    elif ctx.steps_done == 0 and module is None:
        verdict = "init"
    elif h is not None and h.model_states_bytes > h.budget_bytes:
        verdict = "init"
    else:
        verdict = "iteration"
    advice = tuple(explained.advice) if explained is not None else ()
    breakdown: dict[str, int] = {}
    found: list[Remedy] = []
    predicted = budget = states = capacity = None
    if h is not None:
        config = h.config.with_(seq_len=h.seq_len, batch_size=int(h.graph_at(h.seq_len).meta["batch_size"]))
        timeline = simulate(h.graph_at(h.seq_len), config, plan=h.plan)
        breakdown = {k: int(v) for k, v in timeline.breakdown_at_peak.items()}
        predicted, budget, states = timeline.peak_bytes, h.budget_bytes, h.model_states_bytes
        if remedies:
            capacity = _capacity(explained, ctx, config, budget)
            kind = "oom-init" if verdict == "init" else "oom-iteration"
            found = _remedies(_LiveTraces(h), config, timeline, kind, capacity, time_limit_s, plan=h.plan)
    return OomReport(
        verdict=verdict,
        step=ctx.step,
        module=module,
        op=ctx.current_op,
        where=_where(exc.__traceback__),
        message=message[:500],
        requested_bytes=explained.requested_bytes if explained is not None else None,
        live_bytes=ctx.live_bytes,
        budget_bytes=budget,
        predicted_peak_bytes=predicted,
        predicted_breakdown=breakdown,
        model_state_bytes=states,
        capacity_bytes=capacity,
        remedies=tuple(found),
        advice=advice,
    )


def write_oom_report(exc: BaseException, ctx: OomContext, report_dir: Path, *, snapshot: bool = False) -> OomReport:
    """Build the report and write it as JSON and text into `report_dir` (with a CUDA snapshot)."""
    report = build_oom_report(exc, ctx)
    report_dir.mkdir(parents=True, exist_ok=True)
    stem = report_dir / f"memplan-oom-step{ctx.step}"
    if snapshot:
        path = stem.with_suffix(".pickle")
        if not path.exists():  # the out-of-memory observer may have written it already
            torch.cuda.memory._dump_snapshot(str(path))
        report = OomReport(**{**report.__dict__, "snapshot": str(path)})
    stem.with_suffix(".json").write_text(json.dumps(report.to_dict(), indent=1))
    stem.with_suffix(".txt").write_text(report.render() + "\n")
    return report
