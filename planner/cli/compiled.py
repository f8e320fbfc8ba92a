"""`memplan plan --compile`: per-block activation budgets for torch.compile's partitioner."""

from __future__ import annotations

from planner.cli import report
from planner.config import TrainConfig
from planner.solver.compiled import plan_compiled
from planner.units import format_bytes

__all__ = ["run_compiled"]


def run_compiled(args, config: TrainConfig, budget: int | str) -> None:
    """Plan per-block budgets, print them and write the compiled plan (apply it with
    planner.apply_plan(model, path), check it with memplan verify --plan)."""
    plan = plan_compiled(args.model, config, budget, time_limit_s=args.time_limit)
    print(
        f"{args.model} seq {config.seq_len} batch {config.batch_size} {config.precision} on {config.gpu}, "
        f"compiled: budget {format_bytes(plan.budget_bytes)}, predicted peak "
        f"{format_bytes(plan.predicted.peak_bytes)}, recompute {plan.predicted.recompute_s:.4g}s "
        f"({plan.predicted.overhead * 100:.1f}% of the eager step)"
    )
    counts: dict[float, int] = {}
    for b in plan.budgets.values():
        counts[b] = counts.get(b, 0) + 1
    print(report.table(["activation_memory_budget", "blocks"], [[f"{b:.1f}", n] for b, n in sorted(counts.items())]))
    plan.save(args.out)
    print(f"wrote {args.out}")
