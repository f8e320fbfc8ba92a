"""`memplan verify`: run a real step on this machine's CPU, measured against predicted peak."""

from __future__ import annotations

from planner.cli import report
from planner.cli.guard import guarded_imports
from planner.cli.options import add_model_options, config_from_args, write_json
from planner.units import format_bytes

__all__ = ["register", "run"]

EXAMPLE = (
    "memplan verify --model llama-7b-tiny --batch-size 2 --seq-len 64\n"
    "  memplan verify --model gpt2-tiny --seq-len 64 --plan plan.json\n"
    "  memplan verify --model llama-7b-tiny --batch-size 2 --seq-len 128 --tp 2 --dp 2 --zero 3\n"
    "  memplan verify --model llama-7b-tiny --batch-size 4 --seq-len 64 --pp 2 --pp-schedule 1f1b"
)


def register(add) -> None:
    p = add("verify", "run a real step on CPU and compare measured with predicted peak", run, EXAMPLE)
    add_model_options(p)
    p.add_argument("--plan", help="apply this plan to the real model first")


def run(args) -> None:
    if args.gpu != "cpu":
        raise ValueError(f"verify runs the real model on this machine's CPU; drop --gpu {args.gpu}")
    with guarded_imports():
        from planner.api import runs_on_ranks, verify_model
    if runs_on_ranks(config_from_args(args, args.seq_len[0])):
        _run_layout(args)
        return
    results = [verify_model(args.model, config_from_args(args, s), args.plan) for s in args.seq_len]
    rows = [
        [r.config["seq_len"], format_bytes(r.predicted_bytes), format_bytes(r.measured_bytes), f"{r.error * 100:+.2f}%"]
        for r in results
    ]
    print(f"{args.model}: predicted vs measured peak of live tensor bytes (CPU, {args.precision}, {args.optimizer})")
    print(report.table(["seq_len", "predicted", "measured", "error"], rows))
    write_json(args.json_path, {"results": [r.to_dict() for r in results]})


def _run_layout(args) -> None:
    """Every rank of a parallel or FSDP2-sharded layout, each a CPU process under gloo."""
    with guarded_imports():
        from planner.api import verify_layout
    results = [verify_layout(args.model, config_from_args(args, s), args.plan) for s in args.seq_len]
    print(
        f"{args.model}: predicted vs measured peak of live tensor bytes per rank "
        f"(CPU gloo, {args.precision}, {args.optimizer})"
    )
    rows = [
        [r.config["seq_len"], rank, format_bytes(p), format_bytes(m), f"{e * 100:+.2f}%"]
        for r in results
        for rank, (p, m, e) in enumerate(zip(r.predicted_bytes, r.measured_bytes, r.errors))
    ]
    print(report.table(["seq_len", "rank", "predicted", "measured", "error"], rows))
    diverged = sorted({name for r in results for name in r.diverged_parameters})
    if diverged:
        shown = ", ".join(diverged[:5]) + (f" and {len(diverged) - 5} more" if len(diverged) > 5 else "")
        print(
            f"warning: {len(diverged)} replicated parameters get different gradients on the tensor-parallel ranks "
            f"(the plan does not sum them over the ranks), so training with it would drift the replicas apart: {shown}"
        )
    write_json(args.json_path, {"results": [r.to_dict() for r in results]})
