"""`memplan diagnose`: why a step OOMs (from a model, a snapshot or an error message) and what to change."""

from __future__ import annotations

from planner.cli import report
from planner.cli.guard import guarded_imports
from planner.cli.options import add_model_options, config_from_args, write_json
from planner.config import DEFAULT_TIME_LIMIT_S
from planner.safe_io import clean  # snapshot text (pools, frames) may carry escape sequences
from planner.units import format_bytes

__all__ = ["register", "run"]

EXAMPLE = (
    "memplan diagnose --model llama-7b --gpu a100-40gb --seq-len 4096\n"
    "  memplan diagnose --snapshot snapshot.pickle\n"
    '  memplan diagnose --oom-message "CUDA out of memory. Tried to allocate ..."'
)

_NEEDS_INPUT = "diagnose needs --model SPEC, --snapshot FILE or --oom-message TEXT"


def _fb(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _print_snapshot(path: str, json_path: str | None) -> None:
    from planner.analysis.snapshot import read_snapshot  # torch-free, as explain_oom_message

    r = read_snapshot(path)
    print(
        f"snapshot {clean(path)} ({r.format}): reserved {_fb(r.reserved_bytes)}, allocated {_fb(r.allocated_bytes)}, "
        f"free in cache {_fb(r.free_bytes)} (largest block {_fb(r.largest_free_block_bytes)}), "
        f"fragmentation {r.fragmentation_ratio * 100:.1f}%"
    )
    rows = [
        [clean(p.pool, 40), p.segments, _fb(p.reserved_bytes), _fb(p.allocated_bytes), _fb(p.free_bytes)]
        for p in r.segments_by_pool
    ]
    if rows:
        print(report.table(["pool", "segments", "reserved", "allocated", "free"], rows))
    if r.top_allocations:
        print("largest live allocations:")
        print(
            report.table(
                ["size", "where"], [[_fb(a.size), clean(a.frames[0]) if a.frames else "?"] for a in r.top_allocations]
            )
        )
    for line in r.advice:
        print(f"- {line}")
    write_json(json_path, r.to_dict())


def _print_oom(text: str, json_path: str | None) -> None:
    from planner.analysis.oom_message import explain_oom_message  # torch-free: answers at once

    r = explain_oom_message(text)
    print(f"verdict: {r.verdict}")
    for line in r.explanation:
        print(line)
    for line in r.advice:
        print(f"- {line}")
    write_json(json_path, r.to_dict())


def run(args) -> None:
    if args.snapshot or args.oom_message:
        if args.snapshot:
            _print_snapshot(args.snapshot, args.json_path if not args.model else None)
        if args.oom_message:
            _print_oom(args.oom_message, args.json_path if not args.model else None)
        if not args.model:
            return
        print()
    if not args.model:
        raise ValueError(_NEEDS_INPUT)
    config = config_from_args(args)
    if config.layout_flags:
        with guarded_imports():
            from planner.api import diagnose_layout_model
        d = diagnose_layout_model(args.model, config, time_limit_s=args.time_limit)
    else:
        with guarded_imports():
            from planner.analysis.diagnose import diagnose
        d = diagnose(args.model, config, time_limit_s=args.time_limit)
    layout = f" {config.layout_flags} ({config.world_size} GPUs)" if config.layout_flags else ""
    print(
        f"{args.model} batch {config.batch_size} seq {config.seq_len} {config.precision} {config.optimizer} "
        f"ZeRO-{config.zero_stage} dp {config.dp}{layout} on {config.gpu} ({_fb(d.capacity_bytes)})"
    )
    if d.ranks:
        print(report.ranks_table(d.ranks))
    print(f"verdict: {d.verdict} ({d.summary})")
    print(
        f"peak {_fb(d.peak_bytes)} in {d.peak_phase} at {d.peak_op} (module '{d.peak_module or '<root>'}'); "
        "model states " + ", ".join(f"{k} {_fb(v)}" for k, v in d.model_states.items())
    )
    a = d.allocator
    if d.ranks:  # a parallel job: the allocator replay models one device's step
        print(f"expected allocator overhead {_fb(d.expected_overhead_bytes)} (2% of the device)")
    else:
        print(
            f"allocator estimate: peak allocated {_fb(a['peak_allocated_bytes'])}, reserved "
            f"{_fb(a['peak_reserved_bytes'])}, fragmentation {_fb(a['fragmentation_bytes'])}; "
            f"expected overhead {_fb(d.expected_overhead_bytes)}"
        )
    if d.remedies:
        rows = [
            [r.name, r.description, _fb(r.peak_bytes), "yes" if r.fits else "no", _pct(r.overhead), r.note]
            for r in d.remedies
        ]
        print("remedies (ranked: fitting first, then by added step time):")
        print(report.table(["remedy", "change", "new peak", "fits", "time cost", "note"], rows))
    write_json(args.json_path, d.to_dict())


def register(add) -> None:
    p = add("diagnose", "explain an OOM (model, snapshot or error message) and rank simulated remedies", run, EXAMPLE)
    add_model_options(p, sweep=False)
    p._option_string_actions["--model"].required = False
    p.add_argument("--snapshot", metavar="FILE", help="analyse a torch.cuda.memory._dump_snapshot() pickle")
    p.add_argument("--oom-message", metavar="TEXT", help="explain a 'CUDA out of memory' message")
    p.add_argument(
        "--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S, help="solver time limit in seconds per plan"
    )
