"""`memplan fit`: the fewest GPUs a step fits on, or the largest batch and sequence on N GPUs."""

from __future__ import annotations

from costmodels.hardware import get_device
from planner.cli import report
from planner.cli.guard import guarded_imports
from planner.cli.options import add_model_options, config_from_args, positive_int, refuse_layout, write_json
from planner.config import DEFAULT_RESERVE, DEFAULT_TIME_LIMIT_S
from planner.units import format_bytes

__all__ = ["register", "run"]

TABLE_ROWS = 12  # configurations shown; --json holds them all

EXAMPLE = "memplan fit --model llama-70b --gpu h100-80gb --seq-len 4096 --precision bf16-mixed"


def _fb(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _gpu_row(label: str, n: int | None, info: dict | None) -> list:
    if n is None or info is None:
        return [label, "none", "-", "-", "-", "-"]
    ms = info["model_states"]
    act = info["breakdown_at_peak"].get("activation", 0)
    return [label, n, _fb(info["peak_bytes"]), _fb(sum(ms.values())), _fb(act), _pct(info.get("overhead", 0.0))]


def _size(entry: dict, key: str) -> str:
    if entry[key] is None:
        return "none"
    return f">= {entry[key]}" if entry[f"{key}_at_least"] else str(entry[key])


def run(args) -> None:
    for flag, value in (("--gpus", args.gpus), ("--max-gpus", args.max_gpus)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value}")
    config = config_from_args(args)
    refuse_layout(config, "fit")
    capacity = get_device(config.gpu).memory_bytes
    with guarded_imports():
        from planner.analysis.fit import fit, largest_fitting
    if args.gpus:
        r = largest_fitting(args.model, config, args.gpus, reserve=args.reserve, time_limit_s=args.time_limit)
        print(
            f"{args.model} {config.precision} on {args.gpus} x {config.gpu} ({_fb(capacity)}, "
            f"budget {_fb(r['budget_bytes'])}{', ZeRO-3' if args.gpus > 1 else ''})"
        )
        rows = []
        for name, fixed in (("batch_size", f"seq {config.seq_len}"), ("seq_len", f"batch {config.batch_size}")):
            e = r[f"largest_{name}"]
            rows.append(
                [
                    f"largest {name.replace('_', ' ')} ({fixed})",
                    _size(e, "without_plan"),
                    _fb(e.get("without_plan_peak_bytes")),
                    _size(e, "with_plan"),
                    _fb(e.get("with_plan_peak_bytes")),
                    _pct(e.get("with_plan_overhead")),
                ]
            )
        print(report.table(["", "no plan", "peak", "with plan", "peak", "time cost"], rows))
        print(
            f"sizes tried: batch {config.batch_size} and seq {config.seq_len} times or divided by powers of two "
            "(>=: the search stopped at its bound)"
        )
        for name in ("batch_size", "seq_len"):
            if r[f"largest_{name}"].get("limited_by"):
                print(f"{name.replace('_', ' ')} limited by the model: {r[f'largest_{name}']['limited_by']}")
        write_json(args.json_path, r)
        return
    r = fit(
        args.model,
        config,
        args.max_gpus,
        reserve=args.reserve,
        time_limit_s=args.time_limit,
        search_configurations=True,
    )
    print(
        f"{args.model} batch {config.batch_size} seq {config.seq_len} {config.precision} on {config.gpu} "
        f"({_fb(capacity)}, budget {_fb(r.budget_bytes)}), ZeRO-3 over N GPUs:"
    )
    print(
        report.table(
            ["", "GPUs", "peak / GPU", "model states / GPU", "activations at peak", "time cost"],
            [
                _gpu_row("without a plan", r.min_gpus_without_plan, r.without_plan),
                _gpu_row("with the best plan", r.min_gpus_with_plan, r.with_plan),
            ],
        )
    )
    if r.min_gpus_without_plan is None:
        why = r.why_not_without_plan or "raise --max-gpus or shorten the sequence"
        print(f"does not fit on up to {args.max_gpus} GPUs without a plan: {why}")
    if r.min_gpus_with_plan is None and r.why_not_with_plan:
        print(f"does not fit on up to {args.max_gpus} GPUs with a plan either: {r.why_not_with_plan}")
    if r.configurations is not None:
        print(report.configurations_table(r.configurations, TABLE_ROWS))
    write_json(args.json_path, r.to_dict())


def register(add) -> None:
    p = add(
        "fit",
        "the cheapest configuration that fits (GPU count, 8-bit optimizer states, host offload, plan, "
        "micro-batching) by GPU-hours, or the largest batch/sequence on --gpus N",
        run,
        EXAMPLE,
    )
    add_model_options(p, sweep=False)
    p.add_argument("--gpus", type=positive_int, help="report the largest batch and sequence that fit on this many GPUs")
    p.add_argument("--max-gpus", type=positive_int, default=4096, help="largest GPU count to consider")
    p.add_argument("--reserve", type=float, default=DEFAULT_RESERVE, help="fraction of each GPU kept free")
    p.add_argument(
        "--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S, help="solver time limit in seconds per plan"
    )
