"""`memplan plan --compile`: activation budgets for torch.compile's partitioner, per block or for the whole model."""

from __future__ import annotations

from collections import Counter

from planner.cli import report
from planner.config import TrainConfig
from planner.solver.compiled import plan_compiled
from planner.tracing.inductor_layout import WHOLE_MODEL
from planner.units import format_bytes

__all__ = ["run_compiled"]


def run_compiled(args, config: TrainConfig, budget: int | str) -> None:
    """Plan activation budgets (per block or for the whole model), print them and write the compiled plan (apply it with
    planner.apply_plan(model, path), check it with memplan verify --plan)."""
    plan = plan_compiled(args.model, config, budget, time_limit_s=args.time_limit, scope=args.compile_scope)
    print(
        f"{args.model} seq {config.seq_len} batch {config.batch_size} {config.precision} on {config.gpu}, "
        f"compiled: budget {format_bytes(plan.budget_bytes)}, predicted peak "
        f"{format_bytes(plan.predicted.peak_bytes)}, recompute {plan.predicted.recompute_s:.4g}s, "
        f"added time {plan.predicted.overhead * 100:+.1f}% of the eager step"
    )
    if WHOLE_MODEL in plan.budgets:
        print(f"the whole model compiled at activation_memory_budget {plan.budgets[WHOLE_MODEL]:.1f}")
    else:
        rows = [[f"{b:.1f}", n] for b, n in sorted(Counter(plan.budgets.values()).items())]
        print(report.table(["activation_memory_budget", "blocks"], rows))
    plan.save(args.out)
    print(f"wrote {args.out}")
