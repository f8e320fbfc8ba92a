"""Online adjustment: a growing-sequence run that follows the length (adapt=True) against one plan
solved for the longest length, under the same fixed budget, on this machine's CPU.

Copies of one model train on the same batches, interleaved step by step in alternating order, under
MemoryMonitors (live-bytes tracker on); after one untimed warm-up round the table gives the median
over rounds of each run's total measured step time, and its measured peak. The adaptive run keeps
its 5% reserve below a budget set so that its target is the fixed plan's own peak (it may never
peak higher than the fixed plan does). Also: the monitor's own cost
(the fixed plan timed without a monitor) and how long `set_budget` takes to re-plan a 32-block
model from its cached trace.

python -m benchmarks.adaptive [--quick] [--out DIR]  (or python -m benchmarks --only adaptive)
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import Options, gb, print_table, standalone_main
from planner.runtime.auto import auto_checkpoint
from planner.runtime.monitor import MemoryMonitor
from planner.tracing.models import Llama, LlamaConfig

BATCH = 4
VOCAB = 256
BUDGET_POINT = 0.5  # budget: halfway from model states to the no-plan peak at the longest length
RESERVE = 0.05  # what the adaptive run keeps free; the fixed plan is solved for the same target


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(VOCAB, 128, 512, 8, 4, 2))


def _lengths(quick: bool) -> list[int]:
    grow = [64, 128, 256, 512] if quick else list(range(64, 513, 64))
    return [n for n in grow for _ in range(2)]


def _step(model, optimizer, ids, monitor: MemoryMonitor | None) -> tuple[float, float]:
    """One training step: (wall seconds, the monitor's when monitored; this process's CPU seconds,
    which other processes on a shared machine do not inflate)."""
    cpu0, t0 = time.process_time(), time.perf_counter()
    if monitor is None:
        model(ids, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, time.process_time() - cpu0
    with monitor.step((ids, ids)):
        model(ids, ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return monitor.records[-1].step_s, time.process_time() - cpu0


def growing_sequence(quick: bool, rounds: int, log_dir: Path) -> list[dict]:
    """Three copies of one model take the same batches, step by step in alternating order (so a
    busy machine slows them alike): the adaptive handle under a monitor with adapt=True, the plan
    for the longest length under a monitor, and that plan without a monitor (the monitor's cost).
    The adaptive run's target (its budget less the reserve) is the fixed plan's predicted peak."""
    lengths = _lengths(quick)
    longest = max(lengths)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (BATCH, n), generator=generator) for n in lengths]
    example = (batches[-1], batches[-1])
    names = (
        "adaptive (adapt=True, follows length)",
        f"fixed plan for seq {longest}",
        f"fixed plan for seq {longest}, no monitor",
    )
    models = {name: _model() for name in names}
    probe = auto_checkpoint(copy.deepcopy(models[names[1]]), example, "100%")
    states = probe.model_states_bytes
    budget = int(states + BUDGET_POINT * (probe.baseline_peak_bytes - states))
    probe.remove()
    fixed = [auto_checkpoint(models[name], example, budget) for name in names[1:]]
    # The adaptive run may not peak above the fixed plan: its target (budget less the reserve) is
    # the fixed plan's own predicted peak.
    target = fixed[0].predicted_peak_bytes
    t0 = time.perf_counter()
    adaptive = auto_checkpoint(
        models[names[0]], example, int(target / (1 - RESERVE)) + 1, seq_lens=sorted(set(lengths))
    )
    setup_s = time.perf_counter() - t0
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False) for name, m in models.items()}
    monitors = {
        names[0]: MemoryMonitor(log_dir / "adaptive.jsonl", adaptive, reserve=RESERVE, adapt=True),
        names[1]: MemoryMonitor(log_dir / "fixed.jsonl", fixed[0]),
    }
    totals: dict[str, list[float]] = {name: [] for name in names}
    cpu_totals: dict[str, list[float]] = {name: [] for name in names}
    with monitors[names[0]], monitors[names[1]]:
        for r in range(rounds + 1):  # round 0 warms up (optimizer states, plans at the target): not counted
            total, cpu = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
            for k, ids in enumerate(batches):
                for name in names if (k + r) % 2 == 0 else reversed(names):
                    wall_s, cpu_s = _step(models[name], optimizers[name], ids, monitors.get(name))
                    total[name] += wall_s
                    cpu[name] += cpu_s
            if r > 0:
                for name in names:
                    totals[name].append(total[name])
                    cpu_totals[name].append(cpu[name])
    for handle in (adaptive, *fixed):
        handle.remove()
    rows = []
    for name in names:
        monitor = monitors.get(name)
        counted = monitor.records[len(lengths) :] if monitor is not None else []
        rows.append(
            {
                "run": name,
                "steps": len(lengths),
                "lengths": f"{lengths[0]}..{longest}",
                "total_step_s_median": statistics.median(totals[name]),
                "total_step_s": totals[name],
                "total_cpu_s_median": statistics.median(cpu_totals[name]),
                "total_cpu_s": cpu_totals[name],
                "peak_bytes": max(r.measured_peak_bytes for r in counted) if counted else None,
                "budget_bytes": budget,
                "target_bytes": target,
                "plan_switches": sum(len(r.switches) for r in counted) if monitor is not None else None,
                "recompute_modules_per_step": [r.plan["recompute"] for r in counted[-len(lengths) :]],
                "rounds": rounds,
                "adaptive_setup_s": round(setup_s, 2) if name == names[0] else None,
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
    walls, cpus = [], []
    for point in points:
        cpu0, t0 = time.process_time(), time.perf_counter()
        handle.set_budget(int(states + point * (base - states)))
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - cpu0)
    handle.remove()
    return {
        "run": "set_budget, 32 blocks (llama, batch 2 x 128)",
        "blocks": 32,
        "set_budget_s_median": statistics.median(walls),
        "set_budget_s_max": max(walls),
        "set_budget_s": [round(w, 3) for w in walls],
        "set_budget_cpu_s_median": statistics.median(cpus),
        "set_budget_cpu_s": [round(c, 3) for c in cpus],
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
        [
            "run",
            "steps",
            "lengths",
            "step time (median)",
            "CPU time (median)",
            "peak",
            "budget",
            "switches",
            "recompute/step",
        ],
        [
            [
                r["run"],
                r["steps"],
                r["lengths"],
                f"{r['total_step_s_median']:.2f} s",
                f"{r['total_cpu_s_median']:.2f} s",
                gb(r["peak_bytes"]),
                gb(r["budget_bytes"]),
                "-" if r["plan_switches"] is None else r["plan_switches"],
                ",".join(map(str, r["recompute_modules_per_step"])) or "-",
            ]
            for r in runs
        ],
    )
    adaptive, fixed, plain = runs[0], runs[1], runs[2]
    for key, what in (("total_step_s_median", "wall"), ("total_cpu_s_median", "CPU")):
        speed = fixed[key] / adaptive[key]
        print(
            f"{what} time: adaptive runs at {speed:.2f}x the fixed plan's speed ({'faster' if speed > 1 else 'NOT faster'});"
            f" the monitor adds {(fixed[key] / plain[key] - 1) * 100:+.0f}% to the fixed run"
        )
    higher = (adaptive["peak_bytes"] or 0) > (fixed["peak_bytes"] or 0)
    print(
        f"peak: adaptive {gb(adaptive['peak_bytes'])}, fixed {gb(fixed['peak_bytes'])} ({'HIGHER' if higher else 'not higher'})"
    )
    for r in rows:
        if "set_budget_s_median" in r:
            print(
                f"{r['run']}: wall median {r['set_budget_s_median']:.2f} s (max {r['set_budget_s_max']:.2f} s), "
                f"CPU median {r['set_budget_cpu_s_median']:.2f} s"
            )


def main(argv: list[str] | None = None) -> int:
    standalone_main("adaptive", __doc__, run, show, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
