"""Online adjustment: a growing-sequence run that follows the length (adapt=True) against one plan
solved for the longest length, under the same fixed budget, on this machine's CPU.

Both runs train the same model on the same batches under a MemoryMonitor (live-bytes tracker on);
rounds are interleaved (order alternating) after one untimed warm-up round, and the table gives
the median over rounds of each run's total measured step time, and its measured peak. Also: the
monitor's own overhead (the fixed run timed without a monitor) and how long `set_budget` takes to
re-plan a 32-block model from its cached trace.

python -m benchmarks.adaptive [--quick] [--out DIR]  (or python -m benchmarks --only adaptive)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import Options, gb, print_table, to_jsonable
from planner.runtime.auto import auto_checkpoint
from planner.runtime.monitor import MemoryMonitor
from planner.tracing.models import Llama, LlamaConfig

BATCH = 4
VOCAB = 256
BUDGET_POINT = 0.5  # budget: halfway from model states to the no-plan peak at the longest length


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(VOCAB, 128, 512, 8, 4, 2))


def _lengths(quick: bool) -> list[int]:
    grow = [64, 128, 256, 512] if quick else list(range(64, 513, 64))
    return [n for n in grow for _ in range(2)]


def _epoch(model, optimizer, batches, monitor: MemoryMonitor | None) -> tuple[float, int | None]:
    """Total step time and measured peak of one pass over the batches."""
    total, peak = 0.0, None
    for ids in batches:
        t0 = time.perf_counter()
        if monitor is None:
            model(ids, ids).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total += time.perf_counter() - t0
            continue
        with monitor.step((ids, ids)):
            model(ids, ids).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        record = monitor.records[-1]
        total += record.step_s
        peak = max(peak or 0, record.measured_peak_bytes)
    return total, peak


def growing_sequence(quick: bool, rounds: int, log_dir: Path) -> list[dict]:
    lengths = _lengths(quick)
    longest = max(lengths)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (BATCH, n), generator=generator) for n in lengths]
    example = (batches[-1], batches[-1])

    adaptive_model, fixed_model = _model(), _model()
    probe = auto_checkpoint(copy.deepcopy(fixed_model), example, "100%")
    states = probe.model_states_bytes
    budget = int(states + BUDGET_POINT * (probe.baseline_peak_bytes - states))
    probe.remove()
    t0 = time.perf_counter()
    adaptive = auto_checkpoint(adaptive_model, example, budget, seq_lens=sorted(set(lengths)))
    plan_s = time.perf_counter() - t0
    fixed = auto_checkpoint(fixed_model, example, budget)
    runs = {
        "adaptive (adapt=True, follows length)": (adaptive_model, adaptive, True),
        f"fixed plan for seq {longest}": (fixed_model, fixed, False),
        f"fixed plan for seq {longest}, no monitor": (fixed_model, None, False),
    }
    optimizers = {
        id(m): torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False) for m in (adaptive_model, fixed_model)
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    peaks: dict[str, int | None] = {}
    switches: dict[str, int] = {}
    for r in range(rounds + 1):  # round 0 warms up (optimizer states, cached plans) and is not counted
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            model, handle, adapt = runs[name]
            optimizer = optimizers[id(model)]
            if handle is None and name.endswith("no monitor"):
                total, peak = _epoch(model, optimizer, batches, None)
            else:
                log = log_dir / f"{'adaptive' if adapt else 'fixed'}.jsonl"
                with MemoryMonitor(log, handle, adapt=adapt) as monitor:
                    total, peak = _epoch(model, optimizer, batches, monitor)
                switches[name] = sum(len(rec.switches) for rec in monitor.records)
            if r > 0:
                times[name].append(total)
                peaks[name] = peak if peaks.get(name) is None else max(peaks[name] or 0, peak or 0)
    adaptive.remove()
    fixed.remove()
    rows = []
    for name in runs:
        rows.append(
            {
                "run": name,
                "steps": len(lengths),
                "lengths": f"{lengths[0]}..{longest}",
                "total_step_s_median": statistics.median(times[name]),
                "total_step_s": times[name],
                "peak_bytes": peaks.get(name),
                "budget_bytes": budget,
                "plan_switches_last_round": switches.get(name),
                "rounds": rounds,
                "adaptive_plan_setup_s": round(plan_s, 2) if "adaptive" in name else None,
            }
        )
    return rows


def set_budget_latency(quick: bool) -> dict:
    """Wall time of handle.set_budget on a 32-block Llama (trace cached, a new budget each call)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(64, 64, 128, 32, 4, 2))
    ids = torch.randint(0, 64, (2, 128))
    handle = auto_checkpoint(model, (ids, ids), "100%")
    states, base = handle.model_states_bytes, handle.baseline_peak_bytes
    points = (0.5, 0.6, 0.7) if quick else (0.4, 0.5, 0.6, 0.7, 0.8)
    walls = []
    for point in points:
        t0 = time.perf_counter()
        handle.set_budget(int(states + point * (base - states)))
        walls.append(time.perf_counter() - t0)
    handle.remove()
    return {
        "run": "set_budget, 32 blocks (llama, batch 2 x 128)",
        "blocks": 32,
        "set_budget_s_median": statistics.median(walls),
        "set_budget_s_max": max(walls),
        "set_budget_s": [round(w, 3) for w in walls],
    }


def run(opts: Options) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steadier timings on a shared machine
    try:
        with tempfile.TemporaryDirectory(prefix="memplan-adaptive-") as tmp:
            rows = growing_sequence(opts.quick, 3 if opts.quick else 5, Path(tmp))
        rows.append(set_budget_latency(opts.quick))
    finally:
        torch.set_num_threads(threads)
    return rows


def show(rows: list[dict]) -> None:
    runs = [r for r in rows if "total_step_s_median" in r]
    print_table(
        "Growing sequence under a fixed budget: adaptive vs one plan for the longest length (CPU)",
        ["run", "steps", "lengths", "total step time (median)", "peak", "budget", "switches"],
        [
            [
                r["run"],
                r["steps"],
                r["lengths"],
                f"{r['total_step_s_median']:.2f} s",
                gb(r["peak_bytes"]),
                gb(r["budget_bytes"]),
                "-" if r["plan_switches_last_round"] is None else r["plan_switches_last_round"],
            ]
            for r in runs
        ],
    )
    adaptive, fixed, plain = runs[0], runs[1], runs[2]
    faster = adaptive["total_step_s_median"] < fixed["total_step_s_median"]
    no_higher = (adaptive["peak_bytes"] or 0) <= (fixed["peak_bytes"] or 0)
    print(
        f"adaptive: {fixed['total_step_s_median'] / adaptive['total_step_s_median']:.2f}x the speed of the fixed "
        f"plan ({'faster' if faster else 'NOT faster'}), peak {'not higher' if no_higher else 'HIGHER'}; "
        f"monitor overhead on the fixed run: "
        f"{(fixed['total_step_s_median'] / plain['total_step_s_median'] - 1) * 100:+.0f}%"
    )
    for r in rows:
        if "set_budget_s_median" in r:
            print(f"{r['run']}: median {r['set_budget_s_median']:.2f} s, max {r['set_budget_s_max']:.2f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.adaptive", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    rows = run(Options(quick=args.quick))
    show(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adaptive.json").write_text(json.dumps(to_jsonable(rows), indent=1))
    print(f"wrote {out / 'adaptive.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
