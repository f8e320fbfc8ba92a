"""`memplan apply`: check a plan against a model and show what it wraps."""

from __future__ import annotations

from planner.cli.guard import guarded_imports
from planner.cli.options import add_model_options, config_from_args

__all__ = ["register", "run"]

EXAMPLE = "memplan apply --model llama-7b-tiny --seq-len 64 --plan plan.json"


def register(add) -> None:
    p = add("apply", "check a plan against a model and show what it wraps", run, EXAMPLE)
    add_model_options(p, sweep=False)
    p.add_argument("--plan", required=True, help="plan file")


def run(args) -> None:
    with guarded_imports():
        from planner.api import check_plan_for_spec
    summary = check_plan_for_spec(args.model, config_from_args(args), args.plan)
    print(summary)
