"""Which model a plan was made for: its fingerprint and counts, and the check that a live model matches."""

from __future__ import annotations

from typing import Any

from planner.errors import PlanFileError
from planner.plans.format import CompiledPlan, ModelInfo, Plan
from planner.tracing.fingerprint import is_segment_of, model_fingerprint, num_parameters

__all__ = ["check_plan_matches", "model_info"]


def model_info(model: Any, spec: str) -> ModelInfo:
    """ModelInfo for ``model`` built from ``spec``."""
    return ModelInfo(
        spec=spec,
        fingerprint=model_fingerprint(model),
        num_parameters=num_parameters(model),
        num_modules=sum(1 for _ in model.named_modules()),
    )


def _human(n: int) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.1f}{suffix}"
    return str(n)


def check_plan_matches(plan: Plan | CompiledPlan, model: Any, identity: ModelInfo | None = None) -> None:
    """Raise PlanFileError saying what differs when ``plan`` was made for another model.
    `identity`: the model's, when known from an earlier check (a wrapper such as fully_shard
    changes the fingerprint of a model, not what it is)."""
    info = identity or model_info(model, plan.model.spec)
    names = {name for name, _ in model.named_modules()}
    modules = plan.budgets if isinstance(plan, CompiledPlan) else (d.module for d in plan.decisions)
    missing = list(dict.fromkeys(m for m in modules if m not in names and not is_segment_of(model, m)))
    if info.fingerprint == plan.model.fingerprint and not missing:
        return
    parts = []
    if plan.model.num_modules != info.num_modules:
        parts.append(f"{plan.model.num_modules} modules vs {info.num_modules}")
    if plan.model.num_parameters != info.num_parameters:
        parts.append(f"{_human(plan.model.num_parameters)} vs {_human(info.num_parameters)} parameters")
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        parts.append(f"modules not found: {', '.join(missing[:3])}{more}")
    if not parts:
        parts.append(
            "same module and parameter counts but different structure, shapes or "
            f"dtypes ({plan.model.fingerprint[:19]} vs {info.fingerprint[:19]})"
        )
    spec = plan.model.spec or "<model>"
    raise PlanFileError(
        f"plan was made for a different model: {', '.join(parts)}; re-plan with memplan plan --model {spec}"
    )
