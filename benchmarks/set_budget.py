"""Online re-planning: how long `AutoHandle.set_budget` takes on 4-, 32- and 80-block Llamas, and
what the re-plan costs against CP-SAT's at the same budgets.

Each model is planned once (trace and CP-SAT at 100%); then, in rounds, every handle is given the
round's budget in turn (the order alternates, so a busy machine slows them alike). A budget is a
point between model states and the no-plan peak, plus the round number in bytes (every call is a
new budget, never a cache hit). The table gives the median and the maximum wall time per call, and
the added time of the re-planned plans against a fresh CP-SAT solve (REPLAN_TIME_LIMIT_S, as
set_budget used before) at the same budgets.

python -m benchmarks.set_budget [--quick] [--out DIR]  (or python -m benchmarks --only set_budget)
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import Options, print_table, standalone_main
from planner.errors import InfeasibleBudget
from planner.runtime.auto import REPLAN_TIME_LIMIT_S, AutoHandle, auto_checkpoint
from planner.solver.planning import solve
from planner.tracing.models import Llama, LlamaConfig

BLOCKS = (4, 32, 80)
BATCH, SEQ_LEN, VOCAB = 2, 128, 64
POINTS = (0.4, 0.8, 0.5, 0.7, 0.6, 0.45, 0.75, 0.55, 0.65, 0.35)  # fractions from model states to the peak


def _handle(blocks: int, seq_len: int) -> tuple[AutoHandle, float]:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(VOCAB, 64, 128, blocks, 4, 2))
    ids = torch.randint(0, VOCAB, (BATCH, seq_len))
    t0 = time.perf_counter()
    handle = auto_checkpoint(model, (ids, ids), "100%")
    return handle, time.perf_counter() - t0


def _budget(handle: AutoHandle, point: float, round_: int) -> int:
    states = handle.model_states_bytes
    return int(states + point * (handle.baseline_peak_bytes - states)) + round_


def run(opts: Options) -> list[dict]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steadier timings on a shared machine
    try:
        seq_len = 64 if opts.quick else SEQ_LEN
        rounds = 5 if opts.quick else len(POINTS)
        handles = {n: _handle(n, seq_len) for n in BLOCKS}
        walls: dict[int, list[float]] = {n: [] for n in BLOCKS}
        overheads: dict[int, list[float]] = {n: [] for n in BLOCKS}
        for r in range(rounds):
            for n in BLOCKS if r % 2 == 0 else reversed(BLOCKS):
                handle = handles[n][0]
                t0 = time.perf_counter()
                plan = handle.set_budget(_budget(handle, POINTS[r], r))
                walls[n].append(time.perf_counter() - t0)
                overheads[n].append(plan.predicted.overhead)
        rows = []
        for n in BLOCKS:
            handle, setup_s = handles[n]
            graph, config = handle.graph_at(seq_len), handle.config
            cpsat_s, cpsat_overheads = [], []
            for r in range(rounds):
                try:
                    plan = solve(graph, config, _budget(handle, POINTS[r], r), time_limit_s=REPLAN_TIME_LIMIT_S)
                except InfeasibleBudget:
                    plan = None
                cpsat_s.append(plan.solver.wall_s if plan is not None else None)
                cpsat_overheads.append(plan.predicted.overhead if plan is not None else None)
            ratios = [a / b for a, b in zip(overheads[n], cpsat_overheads) if b]
            handle.remove()
            rows.append(
                {
                    "blocks": n,
                    "ops": len(graph.ops),
                    "batch": f"{BATCH} x {seq_len}",
                    "setup_s": round(setup_s, 2),
                    "set_budget_s_median": statistics.median(walls[n]),
                    "set_budget_s_max": max(walls[n]),
                    "set_budget_s": [round(w, 4) for w in walls[n]],
                    "cpsat_s_median": statistics.median([s for s in cpsat_s if s is not None]),
                    "cpsat_s": [None if s is None else round(s, 3) for s in cpsat_s],
                    "overhead": [round(o, 5) for o in overheads[n]],
                    "cpsat_overhead": [None if o is None else round(o, 5) for o in cpsat_overheads],
                    "overhead_ratio_max": max(ratios) if ratios else None,
                    "overhead_ratio_median": statistics.median(ratios) if ratios else None,
                    "rounds": rounds,
                }
            )
    finally:
        torch.set_num_threads(threads)
    return rows


def show(rows: list[dict]) -> None:
    print_table(
        "set_budget: re-plan a traced model for a new budget (CPU, one thread; medians over interleaved rounds)",
        ["blocks", "ops", "batch", "set_budget median", "max", "CP-SAT re-solve median", "overhead vs CP-SAT"],
        [
            [
                r["blocks"],
                r["ops"],
                r["batch"],
                f"{r['set_budget_s_median'] * 1e3:.0f} ms",
                f"{r['set_budget_s_max'] * 1e3:.0f} ms",
                f"{r['cpsat_s_median']:.2f} s",
                "-"
                if r["overhead_ratio_median"] is None
                else f"x{r['overhead_ratio_median']:.3f} median, x{r['overhead_ratio_max']:.3f} max",
            ]
            for r in rows
        ],
    )


def main(argv: list[str] | None = None) -> int:
    standalone_main("set_budget", __doc__, run, show, argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
