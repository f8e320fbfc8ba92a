"""`memplan simulate`: the memory of one training step, or a sweep over sequence lengths."""

from __future__ import annotations

from costmodels.hardware import get_device
from planner.cli import report
from planner.cli.guard import guarded_imports
from planner.cli.options import add_model_options, config_from_args, write_json
from planner.units import format_bytes

__all__ = ["register", "run"]

EXAMPLE = (
    "memplan simulate --model llama-7b --gpu h100-80gb --seq-len 4096 --precision bf16-mixed\n"
    "  memplan simulate --model gpt2 --seq-len 512,1024,2048 --gpu a100-40gb --plot sweep.png"
)


def register(add) -> None:
    p = add("simulate", "simulate one training step's memory", run, EXAMPLE)
    add_model_options(p)
    p.add_argument("--plan", help="simulate under this plan file")
    p.add_argument(
        "--strategy",
        default="none",
        help="simulate under a fixed recompute rule instead of a plan: full, selective (Megatron's), every-N, "
        "sqrt, op-sac, op-sac-alt (memplan plan's names)",
    )
    p.add_argument("--plot", help="write the memory curve (or the sweep) as PNG")


def run(args) -> None:
    capacity = get_device(args.gpu).memory_bytes
    with guarded_imports():
        from planner.api import simulate_model, simulate_sweep
    if len(args.seq_len) == 1:
        config = config_from_args(args)
        if (
            config.tp > 1 or config.cp > 1 or config.ep > 1 or config.pp > 1
        ):  # every rank of the layout; the worst one's timeline at the top level
            from planner.api import simulate_layout

            result = simulate_layout(args.model, config, args.plan, args.strategy).to_dict()
        else:
            result = simulate_model(args.model, config, args.plan, args.strategy).to_dict()
        print(report.timeline_table(result, capacity))
        write_json(args.json_path, result)
        if args.plot:
            report.plot_timeline(result, args.plot, capacity)
            print(f"wrote {args.plot}")
        return
    configs = [config_from_args(args, s) for s in args.seq_len]
    results = simulate_sweep(args.model, configs, args.plan, strategy=args.strategy)
    fitting = [s for s, r in zip(args.seq_len, results) if r["peak_bytes"] <= capacity]
    rows = [
        [
            s,
            format_bytes(r["peak_bytes"]),
            r["peak_phase"],
            r["peak_op"],
            "yes" if r["peak_bytes"] <= capacity else "no",
        ]
        for s, r in zip(args.seq_len, results)
    ]
    print(report.table(["seq_len", "peak", "phase", "op at peak", f"fits {args.gpu}"], rows))
    longest = max(fitting) if fitting else None
    print(
        f"longest sequence that fits on {args.gpu} ({format_bytes(capacity)}): "
        f"{longest if longest else 'none of those tried'}"
    )
    write_json(
        args.json_path,
        {"sweep": results, "seq_lens": args.seq_len, "longest_fitting_seq_len": longest, "capacity_bytes": capacity},
    )
    if args.plot:
        report.plot_sweep(
            args.seq_len,
            [r["peak_bytes"] for r in results],
            args.plot,
            capacity,
            f"{args.model} on {args.gpu}, batch {args.batch_size}, {args.precision}",
        )
        print(f"wrote {args.plot}")
