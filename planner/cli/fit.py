"""`memplan fit`: the fewest GPUs a step fits on, or the largest batch and sequence on N GPUs."""

from __future__ import annotations

import sys

from costmodels.hardware import get_device
from planner.cli import report
from planner.cli.guard import guarded_imports
from planner.cli.options import add_model_options, config_from_args, positive_int, write_json
from planner.config import DEFAULT_RESERVE, DEFAULT_TIME_LIMIT_S
from planner.units import format_bytes

__all__ = ["register", "run"]

TABLE_ROWS = 12  # configurations shown; --json holds them all

EXAMPLE = "memplan fit --model llama-70b --gpu h100-80gb --seq-len 8192 --precision bf16-mixed --layouts"


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


def _progress(done: int, total: int, what: str) -> None:
    """A one-line progress bar on a terminal's stderr; nothing where stderr is a file or a pipe."""
    if not sys.stderr.isatty():
        return
    width = 30
    filled = width * done // max(total, 1)
    end = "\n" if done >= total else ""
    print(
        f"\rsearching layouts [{'#' * filled}{'.' * (width - filled)}] {what:<12}", end=end, file=sys.stderr, flush=True
    )


def _layout_row(x) -> list:
    t = x.time
    extras = ", ".join(
        e for e in (x.optimizer if x.optimizer != "adamw" else "", "host offload" if x.offload else "") if e
    )
    return [
        x.gpus,
        x.label,
        x.recompute,
        extras or "-",
        f"{t.step_s:.2f} s",
        f"{x.tokens_per_s_per_gpu:,.0f}",
        f"{x.mfu * 100:.1f}%",
        _fb(x.peak_bytes),
        _fb(x.headroom_bytes),
        f"{t.recompute_s:.2f} s",
        f"{t.exposed_communication_s:.2f} s",
        f"{t.bubble_s:.2f} s",
    ]


LAYOUT_HEADERS = [
    "GPUs",
    "layout",
    "recompute",
    "states",
    "step",
    "tokens/s/GPU",
    "MFU",
    "peak/GPU",
    "headroom",
    "recompute",
    "exposed comm",
    "bubble",
]


def _run_layouts(args, config) -> None:
    with guarded_imports():
        from planner.analysis.layouts import search_layouts
        from planner.budgets import usable_bytes
    capacity = get_device(config.gpu).memory_bytes
    budget = usable_bytes(capacity, args.reserve)
    r = search_layouts(
        args.model,
        config,
        max_gpus=args.max_gpus,
        gpus_per_node=args.gpus_per_node,
        global_batch=args.global_batch,
        budget_bytes=budget,
        time_limit_s=args.time_limit,
        allow_offload=not args.no_offload,
        allow_8bit=not args.no_8bit_optimizer,
        progress=_progress,
    )
    c = r.config
    print(
        f"{args.model} seq {config.seq_len} {config.precision}, micro-batch {config.batch_size}, global batch "
        f"{c['global_batch']} sequences, on {config.gpu} ({_fb(capacity)}, budget {_fb(budget)}, "
        f"{c['gpus_per_node']} per node): {len(r.layouts)} layouts simulated in {r.search_s:.1f} s"
    )
    if r.pareto:
        print("fastest layout per GPU count that beats every smaller one (time per optimizer step):")
        print(report.table(LAYOUT_HEADERS, [_layout_row(x) for x in r.pareto]))
    for tp, why in sorted(r.skipped.items()):
        print(f"tp {tp} skipped: {why}")
    if r.recommended is None:
        print(f"no layout fits on up to {args.max_gpus} GPUs: {r.why_none}")
    else:
        x = r.recommended
        t = x.time
        print(
            f"recommended: {x.gpus} GPUs, {x.label}, recompute {x.recompute}: {x.tokens_per_s_per_gpu:,.0f} tokens/s per "
            f"GPU, MFU {x.mfu * 100:.1f}%, peak {_fb(x.peak_bytes)} per GPU; a step is {t.compute_s:.2f} s compute, "
            f"{t.exposed_communication_s:.2f} s exposed communication, {t.bubble_s:.2f} s bubble, "
            f"{t.recompute_s:.2f} s recompute, {t.optimizer_s:.2f} s optimizer"
            + (f", {t.offload_s:.2f} s host offload" if t.offload_s else "")
        )
        print(f"launch: {r.recipe['torchrun']}")
        print(f"check it: {r.recipe['memplan']}")
        print("torchtitan:")
        print("  " + r.recipe["torchtitan_toml"].replace("\n", "\n  "))
    write_json(args.json_path, r.to_dict())


def run(args) -> None:
    for flag, value in (("--gpus", args.gpus), ("--max-gpus", args.max_gpus)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value}")
    if args.layouts or args.tp > 1 or args.pp > 1 or args.ep > 1 or args.cp > 1:
        if args.gpus:
            raise ValueError("--gpus asks for the largest batch on N GPUs; drop it to search layouts (--layouts)")
        for flag, value in (("--microbatches", args.microbatches), ("--stages-per-rank", args.stages_per_rank)):
            if value is not None:
                raise ValueError(f"fit --layouts chooses {flag} itself; drop it (pin only --tp, --pp, --cp and --ep)")
        args.microbatches = 1 if args.pp > 1 else None  # --batch-size is the micro-batch here
        args.dp = max(args.dp, args.ep)  # the search chooses dp; a pinned --ep needs one it divides
        _run_layouts(args, config_from_args(args))
        return
    config = config_from_args(args)
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
    p.add_argument(
        "--layouts",
        action="store_true",
        help="search the whole layout: GPU count x --tp x --pp x schedule x microbatches x FSDP2 x optimizer states "
        "x host offload x recompute, and expert parallel for a mixture-of-experts model (also when --tp, --pp or "
        "--ep is given, which pin that degree)",
    )
    p.add_argument("--no-offload", action="store_true", help="--layouts without FSDP2 host offload")
    p.add_argument("--no-8bit-optimizer", action="store_true", help="--layouts without 8-bit AdamW states")
    p.add_argument(
        "--gpus-per-node", type=positive_int, help="GPUs per node for --layouts (tensor parallel stays in a node)"
    )
    p.add_argument(
        "--global-batch",
        type=positive_int,
        help="sequences per optimizer step for --layouts (default: about 4M tokens of micro-batches)",
    )
    p.add_argument("--reserve", type=float, default=DEFAULT_RESERVE, help="fraction of each GPU kept free")
    p.add_argument(
        "--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S, help="solver time limit in seconds per plan"
    )
