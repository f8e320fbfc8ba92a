"""`memplan diagnose` (why a step OOMs and what to change) and `memplan fit` (how many GPUs it needs)."""

from __future__ import annotations

from costmodels.hardware import get_device
from planner import report

__all__ = ["register"]

_NEEDS_INPUT = "diagnose needs --model SPEC, --snapshot FILE or --oom-message TEXT"


def _fb(n: int | None) -> str:
    return "-" if n is None else report.format_bytes(n)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _print_snapshot(path: str, write_json, json_path: str | None) -> None:
    from planner.diagnose import diagnose_snapshot

    r = diagnose_snapshot(path)
    print(f"snapshot {path} ({r.format}): reserved {_fb(r.reserved_bytes)}, allocated {_fb(r.allocated_bytes)}, "
          f"free in cache {_fb(r.free_bytes)} (largest block {_fb(r.largest_free_block_bytes)}), "
          f"fragmentation {r.fragmentation_ratio * 100:.1f}%")
    rows = [[p.pool, p.segments, _fb(p.reserved_bytes), _fb(p.allocated_bytes), _fb(p.free_bytes)]
            for p in r.segments_by_pool]
    if rows:
        print(report.table(["pool", "segments", "reserved", "allocated", "free"], rows))
    if r.top_allocations:
        print("largest live allocations:")
        print(report.table(["size", "where"], [[_fb(a.size), a.frames[0] if a.frames else "?"]
                                                for a in r.top_allocations]))
    for line in r.advice:
        print(f"- {line}")
    write_json(json_path, r.to_dict())


def _print_oom(text: str, write_json, json_path: str | None) -> None:
    from planner.diagnose import diagnose_oom_message

    r = diagnose_oom_message(text)
    print(f"verdict: {r.verdict}")
    for line in r.explanation:
        print(line)
    for line in r.advice:
        print(f"- {line}")
    write_json(json_path, r.to_dict())


def cmd_diagnose(args, config_of, write_json) -> None:
    from planner.diagnose import diagnose

    if args.snapshot or args.oom_message:
        if args.snapshot:
            _print_snapshot(args.snapshot, write_json, args.json_path if not args.model else None)
        if args.oom_message:
            _print_oom(args.oom_message, write_json, args.json_path if not args.model else None)
        if not args.model:
            return
        print()
    if not args.model:
        raise ValueError(_NEEDS_INPUT)
    config = config_of(args)
    d = diagnose(args.model, config, time_limit_s=args.time_limit)
    print(f"{args.model} batch {config.batch_size} seq {config.seq_len} {config.precision} {config.optimizer} "
          f"ZeRO-{config.zero_stage} dp {config.dp} on {config.gpu} ({_fb(d.capacity_bytes)})")
    print(f"verdict: {d.verdict} ({d.summary})")
    print(f"peak {_fb(d.peak_bytes)} in {d.peak_phase} at {d.peak_op} (module '{d.peak_module or '<root>'}'); "
          "model states " + ", ".join(f"{k} {_fb(v)}" for k, v in d.model_states.items()))
    a = d.allocator
    print(f"allocator estimate: peak allocated {_fb(a['peak_allocated_bytes'])}, reserved "
          f"{_fb(a['peak_reserved_bytes'])}, fragmentation {_fb(a['fragmentation_bytes'])}; "
          f"expected overhead {_fb(d.expected_overhead_bytes)}")
    if d.remedies:
        rows = [[r.name, r.description, _fb(r.peak_bytes), "yes" if r.fits else "no", _pct(r.overhead), r.note]
                for r in d.remedies]
        print("remedies (ranked: fitting first, then by added step time):")
        print(report.table(["remedy", "change", "new peak", "fits", "time cost", "note"], rows))
    write_json(args.json_path, d.to_dict())


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


def cmd_fit(args, config_of, write_json) -> None:
    from planner.fit import fit, largest_fitting

    for flag, value in (("--gpus", args.gpus), ("--max-gpus", args.max_gpus)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value}")
    config = config_of(args)
    capacity = get_device(config.gpu).memory_bytes
    if args.gpus:
        r = largest_fitting(args.model, config, args.gpus, reserve=args.reserve, time_limit_s=args.time_limit)
        print(f"{args.model} {config.precision} on {args.gpus} x {config.gpu} ({_fb(capacity)}, "
              f"budget {_fb(r['budget_bytes'])}{', ZeRO-3' if args.gpus > 1 else ''})")
        rows = []
        for name, fixed in (("batch_size", f"seq {config.seq_len}"), ("seq_len", f"batch {config.batch_size}")):
            e = r[f"largest_{name}"]
            rows.append([f"largest {name.replace('_', ' ')} ({fixed})", _size(e, "without_plan"),
                         _fb(e.get("without_plan_peak_bytes")), _size(e, "with_plan"),
                         _fb(e.get("with_plan_peak_bytes")), _pct(e.get("with_plan_overhead"))])
        print(report.table(["", "no plan", "peak", "with plan", "peak", "time cost"], rows))
        print(f"sizes tried: batch {config.batch_size} and seq {config.seq_len} times or divided by powers of two "
              "(>=: the search stopped at its bound)")
        for name in ("batch_size", "seq_len"):
            if r[f"largest_{name}"].get("limited_by"):
                print(f"{name.replace('_', ' ')} limited by the model: {r[f'largest_{name}']['limited_by']}")
        write_json(args.json_path, r)
        return
    r = fit(args.model, config, args.max_gpus, reserve=args.reserve, time_limit_s=args.time_limit)
    print(f"{args.model} batch {config.batch_size} seq {config.seq_len} {config.precision} on {config.gpu} "
          f"({_fb(capacity)}, budget {_fb(r.budget_bytes)}), ZeRO-3 over N GPUs:")
    print(report.table(["", "GPUs", "peak / GPU", "model states / GPU", "activations at peak", "time cost"],
                       [_gpu_row("without a plan", r.min_gpus_without_plan, r.without_plan),
                        _gpu_row("with the best plan", r.min_gpus_with_plan, r.with_plan)]))
    if r.min_gpus_without_plan is None:
        print(f"does not fit on up to {args.max_gpus} GPUs without a plan; raise --max-gpus or shorten the sequence")
    write_json(args.json_path, r.to_dict())


def register(add, add_model_options, config_of, write_json) -> None:
    p = add("diagnose", "explain an OOM (model, snapshot or error message) and rank simulated remedies",
            lambda a: cmd_diagnose(a, config_of, write_json))
    add_model_options(p, sweep=False)
    p._option_string_actions["--model"].required = False
    p.add_argument("--snapshot", metavar="FILE", help="analyse a torch.cuda.memory._dump_snapshot() pickle")
    p.add_argument("--oom-message", metavar="TEXT", help="explain a 'CUDA out of memory' message")
    p.add_argument("--time-limit", type=float, default=10.0, help="solver time limit in seconds per plan")

    p = add("fit", "smallest number of GPUs (ZeRO-3) a step fits on, or the largest batch/sequence on --gpus N",
            lambda a: cmd_fit(a, config_of, write_json))
    add_model_options(p, sweep=False)
    p.add_argument("--gpus", type=int, help="report the largest batch and sequence that fit on this many GPUs")
    p.add_argument("--max-gpus", type=int, default=4096, help="largest GPU count to consider")
    p.add_argument("--reserve", type=float, default=0.05, help="fraction of each GPU kept free")
    p.add_argument("--time-limit", type=float, default=10.0, help="solver time limit in seconds per plan")
