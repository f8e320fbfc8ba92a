"""Run a plan once on fake tensors before the real model does: a plan that would fail (a cached
tensor mutated in place, a recompute that runs other ops) is refused with one line that names
the module and its decision."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch

from costmodels.memory import get_precision
from planner.config import TrainConfig
from planner.errors import MemplanError, PlanFileError
from planner.plans.format import Decision, Plan
from planner.runtime.apply import apply_plan
from planner.tracing.blocks import is_segment
from planner.tracing.fake_build import fake_model
from planner.tracing.module_tracker import ModuleTracker
from planner.tracing.recorder import (
    cast_parameters,
    forward_context,
    loss_of,
    run_step_inputs,
)
from planner.tracing.specs import ModelSpec

__all__ = ["dry_run", "planned_errors"]


def _owner(plan: Plan, active: set[str]) -> str | None:
    """The innermost planned module among the modules running (ModuleTracker names them
    'RootClass.path.to.module')."""
    planned = {d.module for d in plan.decisions}
    running = [p for p in planned if any(a == p or a.endswith("." + p) for a in active)]
    return max(running, key=len) if running else None


def _describe(decisions: list[Decision]) -> str:
    whole = [d.action for d in decisions if d.op is None]
    kept = [d.op for d in decisions if d.op is not None]
    text = whole[0] if whole else "keep"
    if kept:
        text += f" keeping {', '.join(kept[:3])}" + (" ..." if len(kept) > 3 else "")
    return text


@contextmanager
def planned_errors(plan: Plan) -> Iterator[None]:
    """An error raised while a model runs under `plan` becomes a one-line PlanFileError naming
    the planned module that was running and its decision."""
    tracker = ModuleTracker()
    with tracker:
        try:
            yield
        except MemplanError:
            raise
        except Exception as exc:
            module = _owner(plan, set(tracker.parents))
            phase = "backward" if tracker.is_bw else "forward"
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            if module is None:
                where = f"the plan fails in {phase}"
            else:
                decision = _describe([d for d in plan.decisions if d.module == module])
                where = f"module '{module}' ({decision}) fails in {phase}"
                first += f"; re-plan with --keep '{module}'"
            raise PlanFileError(f"{where}: {type(exc).__name__}: {first}") from exc


def dry_run(spec: ModelSpec, config: TrainConfig, plan: Plan) -> None:
    """One forward and backward of `spec` on fake tensors with `plan` applied (offload
    decisions left out: they move tensors, not ops); PlanFileError when it fails or when a
    planned module's forward never runs (wrapping it would change nothing)."""
    runnable = replace(plan, decisions=tuple(d for d in plan.decisions if d.action != "offload"))
    precision = str(plan.config["precision"])
    with fake_model(spec, config.batch_size, config.seq_len, config.moe_imbalance, config.gpu) as (
        model,
        inputs,
        _,
    ):
        dtype = get_precision(precision).param_dtype
        if dtype != torch.float32:
            cast_parameters(model, dtype)
        handle = apply_plan(model, runnable)
        ran: set[str] = set()
        hooks = [
            model.get_submodule(path).register_forward_pre_hook(lambda *_, path=path: ran.add(path))
            for path in {d.module for d in plan.decisions if not is_segment(d.module)}
        ]
        try:
            with planned_errors(runnable):
                with forward_context(precision):
                    loss = loss_of(run_step_inputs(model, inputs))
                loss.backward()
        finally:
            handle.remove()
            for hook in hooks:
                hook.remove()
        idle = sorted({d.module for d in plan.decisions if not is_segment(d.module)} - ran)
        if idle:
            raise PlanFileError(
                f"module '{idle[0]}' never runs its own forward (its parent loops over its children), so the "
                "plan's decisions on it would do nothing; plan its children or its parent instead"
            )
