"""Watch a training loop's memory step by step, against memplan's prediction, and adjust the plan.

    with planner.MemoryMonitor("mem.jsonl", handle, adapt=True) as monitor:
        for batch in data:
            with monitor.step(batch):
                loss = model(*batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()

Each step writes one JSON line (see :class:`StepRecord`). The measured peak is
`torch.cuda.max_memory_allocated` on CUDA and, on CPU, the live tensor bytes counted by
:class:`~planner.runtime.tracker.LiveBytesTracker` (parameters, buffers, gradients, optimizer
states and the batch passed to `step` are counted from the step's start). With `adapt=True` and an
:class:`~planner.runtime.auto.AutoHandle`, plans keep `reserve` of the budget free; a step whose
peak comes within the reserve of the budget tightens the plan for the next step, and `relax_after`
steps in a row with slack relax it back toward the budget. A switch takes effect at the next
forward and is logged with its reason. An out-of-memory error inside `step()` writes a report
(see planner.runtime.oom_report) and is re-raised.

A step is one optimizer step: with gradient accumulation, run all its micro-batches inside one
`step()` (the handle's plan, made with grad_accum_steps, predicts the peak of the whole step).
Nothing memplan does is measured: planning inside a step runs under `paused()` (the live-bytes
count and the step's clock stop). A step that starts before any optimizer state exists (the
first) is logged without a drift: its optimizer states are created after its peak.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from memplan_compat import disable_current_modes as _disable_current_modes
from memplan_compat import tree_leaves
from planner.budgets import usable_bytes
from planner.errors import InfeasibleBudget, MemplanError
from planner.runtime.apply import batch_seq_len
from planner.runtime.auto import AutoHandle
from planner.runtime.oom_report import OomContext, write_oom_report
from planner.runtime.tracker import LiveBytesTracker
from planner.units import format_bytes

__all__ = ["MemoryMonitor", "StepRecord", "plan_summary", "seq_len_of"]

RELAX_AFTER_STEPS = 3
EXPANDABLE_ADVICE = (
    "fragmentation seen (inactive split blocks hold memory); set "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the process starts"
)


@dataclass(frozen=True)
class StepRecord:
    """One monitored step: what was measured, what memplan predicted, and any plan switch."""

    step: int
    seq_len: int | None
    measured_peak_bytes: int
    predicted_peak_bytes: int | None
    drift: float | None  # (measured - predicted) / predicted
    budget_bytes: int | None
    target_bytes: int | None
    plan: dict | None  # plan in force: planned length, recompute/offload counts, predicted overhead
    step_s: float
    device: str
    live_bytes: int | None = None  # CPU: live tensor bytes at the step's end
    reserved_bytes: int | None = None  # CUDA: from torch.cuda.memory_stats
    inactive_split_bytes: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    empty_cache: bool = False
    switches: tuple[dict, ...] = field(default=())
    advice: str | None = None
    note: str | None = None  # why the step is not compared with the prediction

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["switches"] = [dict(s) for s in self.switches]
        optional = ("live_bytes", "reserved_bytes", "inactive_split_bytes", "alloc_retries", "ooms", "advice", "note")
        return {k: v for k, v in out.items() if v is not None or k not in optional}


def plan_summary(handle: AutoHandle) -> dict[str, Any]:
    """The plan in force in a few numbers (for the log)."""
    plan = handle.plan
    whole = [d for d in plan.decisions if d.op is None]
    return {
        "seq_len": int(plan.config["seq_len"]),
        "target_bytes": plan.budget_bytes,
        "recompute": sum(d.action == "recompute" for d in whole),
        "offload": sum(d.action == "offload" for d in whole),
        "kept_ops": sum(d.op is not None for d in plan.decisions),
        "predicted_overhead": round(plan.predicted.overhead, 6),
    }


class _OpTracker(LiveBytesTracker):
    """Live bytes, plus the op running now (named in an OOM report)."""

    current_op: Any = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.current_op = func
        return super().__torch_dispatch__(func, types, args, kwargs)


class MemoryMonitor:
    """Per-step memory log of a training loop; with adapt=True it moves the handle's plan target.

    `model` and `optimizer` default to the handle's model and to every optimizer that steps while
    the monitor is active; on CPU they are what the live-bytes count starts from. `empty_cache_above`
    (bytes, CUDA) empties PyTorch's cache between steps when inactive split blocks exceed it.
    `record_history` (CUDA) records allocation history so an OOM also writes a snapshot.
    """

    def __init__(
        self,
        log_path: str | Path,
        handle: AutoHandle | None = None,
        reserve: float = 0.05,
        adapt: bool = False,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        relax_after: int = RELAX_AFTER_STEPS,
        empty_cache_above: int | None = None,
        record_history: bool = False,
        report_dir: str | Path | None = None,
    ) -> None:
        if not 0 <= reserve < 0.5:
            raise MemplanError(f"reserve is a fraction of the budget in [0, 0.5), got {reserve!r}")
        if adapt and handle is None:
            raise MemplanError("adapt=True needs the handle of planner.auto_checkpoint to switch plans")
        if relax_after < 1:
            raise MemplanError(f"relax_after must be at least 1 step, got {relax_after}")
        self.log_path = Path(log_path)
        self.handle = handle
        self.reserve = float(reserve)
        self.adapt = adapt
        self.model = model if model is not None else (handle.model if handle is not None else None)
        self.relax_after = relax_after
        self.empty_cache_above = empty_cache_above
        self.record_history = record_history
        self.report_dir = Path(report_dir) if report_dir is not None else self.log_path.parent
        self.records: list[StepRecord] = []
        self.empty_cache_count = 0
        self._optimizers: weakref.WeakSet = weakref.WeakSet()
        if optimizer is not None:
            self._optimizers.add(optimizer)
        self._slack_steps = 0
        self._advised = False
        self._file: Any = None
        self._hook: Any = None
        self._tracker: _OpTracker | None = None
        self._pending: list[dict] = []
        self._step_start = 0.0
        self._paused_s = 0.0
        self._batch_seq_len: int | None = None
        self._in_step = False
        self._warmup = False

    # -- context ------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        param = next(self.model.parameters(), None) if self.model is not None else None
        return param.device if param is not None else torch.device("cpu")

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_available()

    def __enter__(self) -> MemoryMonitor:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.log_path.open("w")
        self._hook = register_optimizer_step_pre_hook(self._before_optimizer_step)
        if self.on_cuda and self.record_history:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            if hasattr(torch._C, "_cuda_attach_out_of_memory_observer"):
                torch._C._cuda_attach_out_of_memory_observer(self._on_cuda_oom)
        if self.adapt and self.handle is not None:
            self._keep_reserve()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.on_cuda and self.record_history:
            torch.cuda.memory._record_memory_history(enabled=None)
        if self._file is not None:
            self._file.close()
            self._file = None

    def attach(self, handle: AutoHandle, *, adapt: bool = False) -> None:
        """Follow a handle made after the monitor started (a callback plans at the first batch)."""
        self.handle = handle
        self.adapt = adapt
        if self.model is None:
            self.model = handle.model
        if adapt and self._file is not None:
            self._keep_reserve()

    def _keep_reserve(self) -> None:
        """The first retarget, to the budget less the reserve; logged with the next step."""
        self._pending += self._retarget(self._threshold(), f"keep {self.reserve:.0%} of the budget free")

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Run memplan's own work inside a step (planning at the first batch) unmeasured: no
        dispatch mode (the live-bytes count) sees it and its time is left out of the step's."""
        t0 = time.perf_counter()
        try:
            with _disable_current_modes():
                yield
        finally:
            self._paused_s += time.perf_counter() - t0

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.model is not None and optimizer not in self._optimizers:
            mine = {id(p) for p in self.model.parameters()}
            if not any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
                return  # another model's optimizer
        self._optimizers.add(optimizer)
        if self._tracker is not None and self._in_step:
            self._tracker.track_all(list(optimizer.state.values()))

    # -- one step -----------------------------------------------------------------------------
    @contextmanager
    def step(self, batch: Any = None) -> Iterator[None]:
        """Measure the step run inside; `batch` (optional) is counted and gives the sequence length."""
        self.begin_step(batch)
        try:
            yield
        except torch.OutOfMemoryError as exc:
            self._abort_step()
            self._report_oom(exc)
            raise
        except BaseException:
            self._abort_step()
            raise
        self.end_step()

    def begin_step(self, batch: Any = None) -> None:
        """Start measuring a step (for loops driven by callbacks; `step()` calls it)."""
        if self._file is None:
            raise MemplanError("use the monitor as a context manager: `with monitor: ...`")
        if self._in_step:
            raise MemplanError("begin_step called twice without end_step")
        self._batch_seq_len = seq_len_of(batch)
        self._warmup = not any(o.state for o in self._optimizers)
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            if self._tracker is None:
                self._tracker = _OpTracker()
            held = (
                [
                    list(self.model.parameters()),
                    list(self.model.buffers()),
                    [p.grad for p in self.model.parameters() if p.grad is not None],
                ]
                if self.model is not None
                else []
            )
            held += [list(o.state.values()) for o in self._optimizers]
            self._tracker.track_all([held, batch])
            self._tracker.peak_bytes = self._tracker.live_bytes
            self._tracker.__enter__()
        self._in_step = True
        self._paused_s = 0.0
        self._step_start = time.perf_counter()

    def _abort_step(self) -> None:
        if self._tracker is not None and self._in_step and not self.on_cuda:
            self._tracker.__exit__(None, None, None)
        self._in_step = False

    def end_step(self) -> StepRecord:
        """Finish the step: log it, and with adapt=True choose the plan target of the next one."""
        if not self._in_step:
            raise MemplanError("end_step called without begin_step")
        cuda: dict[str, Any] = {}
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
            step_s = time.perf_counter() - self._step_start - self._paused_s
            measured = int(torch.cuda.max_memory_allocated(self.device))
            stats = torch.cuda.memory_stats(self.device)
            cuda = {
                "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
                "inactive_split_bytes": int(stats.get("inactive_split_bytes.all.current", 0)),
                "alloc_retries": int(stats.get("num_alloc_retries", 0)),
                "ooms": int(stats.get("num_ooms", 0)),
            }
        else:
            step_s = time.perf_counter() - self._step_start - self._paused_s
            assert self._tracker is not None
            self._tracker.__exit__(None, None, None)
            self._tracker.sample()
            measured = self._tracker.peak_bytes
            cuda = {"live_bytes": self._tracker.live_bytes}
        self._in_step = False
        record = self._record(measured, step_s, cuda)
        self.records.append(record)
        self._file.write(json.dumps(record.to_dict()) + "\n")
        self._file.flush()
        return record

    def _record(self, measured: int, step_s: float, extra: dict[str, Any]) -> StepRecord:
        h = self.handle
        predicted = h.predicted_peak_bytes if h is not None else None
        seq_len = h.last_seq_len if h is not None and h.last_seq_len is not None else self._batch_seq_len
        switches = tuple(self._pending) + (tuple(h.drain_events()) if h is not None else ())
        self._pending = []
        plan = plan_summary(h) if h is not None else None
        emptied, advice = self._headroom(extra)
        warmup = self._warmup and h is not None and h.config.optimizer != "none"
        note = (
            "no optimizer state yet: this step's optimizer.step creates it after the peak; not compared"
            if warmup
            else None
        )
        if self.adapt and h is not None:
            switches += tuple(self._adapt(measured, predicted, compared=not warmup))
        return StepRecord(
            step=len(self.records),
            seq_len=seq_len,
            measured_peak_bytes=measured,
            predicted_peak_bytes=predicted,
            drift=None if not predicted or warmup else round((measured - predicted) / predicted, 6),
            budget_bytes=h.budget_bytes if h is not None else None,
            target_bytes=h.target_bytes if h is not None else None,
            plan=plan,
            step_s=round(step_s, 6),
            device=str(self.device),
            empty_cache=emptied,
            switches=switches,
            advice=advice,
            note=note,
            **extra,
        )

    # -- fragmentation and headroom (CUDA) --------------------------------------------------------
    def _headroom(self, stats: dict[str, Any]) -> tuple[bool, str | None]:
        inactive = stats.get("inactive_split_bytes")
        if inactive is None:
            return False, None
        emptied = self.empty_cache_above is not None and inactive > self.empty_cache_above
        if emptied:
            torch.cuda.empty_cache()
            self.empty_cache_count += 1
        fragmented = inactive > 0.1 * max(stats["reserved_bytes"], 1) or stats["alloc_retries"] > 0
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if fragmented and not self._advised and "expandable_segments:True" not in conf:
            self._advised = True
            return emptied, EXPANDABLE_ADVICE
        return emptied, None

    # -- online adjustment ----------------------------------------------------------------------
    def _threshold(self) -> int:
        assert self.handle is not None
        return usable_bytes(self.handle.budget_bytes, self.reserve)

    def _adapt(self, measured: int, predicted: int | None, compared: bool = True) -> list[dict]:
        """Tighten after a step above the threshold; relax after `relax_after` compared steps with slack."""
        h = self.handle
        assert h is not None
        budget, threshold = h.budget_bytes, self._threshold()
        step = max(int(self.reserve * budget / 2), 1)
        if measured > threshold:
            self._slack_steps = 0
            drift = max(measured - (predicted or measured), 0) if compared else 0
            target = min(threshold - drift, h.target_bytes - step)
            side = (
                f"{(measured - budget) / budget:.1%} over the budget {format_bytes(budget)}"
                if measured > budget
                else f"{(budget - measured) / budget:.1%} under the budget {format_bytes(budget)}, "
                f"inside its {self.reserve:.0%} reserve"
            )
            return self._retarget(target, f"measured {format_bytes(measured)}, {side}: tighten")
        if not compared:
            return []
        if measured < threshold - step and h.target_bytes < threshold:
            self._slack_steps += 1
            if self._slack_steps >= self.relax_after:
                self._slack_steps = 0
                target = min(threshold, h.target_bytes + max((threshold - h.target_bytes) // 2, step))
                reason = (
                    f"{self.relax_after} steps with {format_bytes(threshold - measured)} or more of slack "
                    "under the reserve: relax toward the budget"
                )
                return self._retarget(target, reason)
            return []
        self._slack_steps = 0
        return []

    def _retarget(self, target: int, reason: str) -> list[dict]:
        h = self.handle
        assert h is not None
        before = h.target_bytes
        if target == before:
            return []
        try:
            h.set_target(target)
        except InfeasibleBudget as exc:
            return [{"reason": reason, "target_bytes": before, "failed": str(exc).split(";")[0]}]
        event = {"reason": reason, "from_target_bytes": before, "target_bytes": h.target_bytes, "plan": plan_summary(h)}
        h.drain_events()  # the retarget is this event
        return [event]

    # -- out of memory ----------------------------------------------------------------------------
    def _context(self) -> OomContext:
        tracker = self._tracker if not self.on_cuda else None
        return OomContext(
            step=len(self.records),
            steps_done=len(self.records),
            handle=self.handle,
            model=self.model,
            device=self.device,
            live_bytes=tracker.live_bytes if tracker is not None else None,
            current_op=str(tracker.current_op) if tracker is not None and tracker.current_op else None,
            seq_len=self._batch_seq_len,
        )

    def _report_oom(self, exc: BaseException) -> None:
        self.last_report = write_oom_report(
            exc, self._context(), self.report_dir, snapshot=self.on_cuda and self.record_history
        )

    def _on_cuda_oom(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        """PyTorch's out-of-memory observer: dump the allocation history before the error unwinds."""
        path = self.report_dir / f"memplan-oom-step{len(self.records)}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))


def seq_len_of(batch: Any) -> int | None:
    """Dim 1 of the batch's first tensor with 2+ dims; None without a batch or such a tensor."""
    if batch is None:
        return None
    args, kwargs = (batch, {}) if not isinstance(batch, dict) else ((), batch)
    if isinstance(args, torch.Tensor):
        args = (args,)
    if not any(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in tree_leaves(batch)):
        return None
    return batch_seq_len(tuple(args), kwargs)
