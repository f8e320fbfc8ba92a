"""Table 2b: memplan's optimal plan against the baseline strategies on the big presets (llama-7b,
llama-70b at sequence 4096, bf16-mixed on h100-80gb, simulated), budgets 30%..90% of the no-plan peak.
ZeRO-3 (8 GPUs for llama-7b, 32 for llama-70b) so that activations, not model states, dominate the peak."""

from __future__ import annotations

import time

from benchmarks.common import Options, gb, pct, print_table
from planner.api import trace_for
from planner.config import TrainConfig
from planner.simulation.step import simulate
from planner.solver.planning import BASELINES, compare_strategies, solve

MODELS = [
    ("llama-7b", TrainConfig(batch_size=1, seq_len=4096, precision="bf16-mixed", gpu="h100-80gb", zero_stage=3, dp=8)),
    (
        "llama-70b",
        TrainConfig(batch_size=1, seq_len=4096, precision="bf16-mixed", gpu="h100-80gb", zero_stage=3, dp=32),
    ),
]
BUDGETS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
QUICK_BUDGETS = (0.3, 0.5, 0.7, 0.9)
TOL = 1e-9


def run(opts: Options) -> list[dict]:
    rows = []
    for name, config in opts.select(MODELS, tuple(m[0] for m in MODELS)):
        t0 = time.perf_counter()
        graph = trace_for(name, config)
        trace_s = time.perf_counter() - t0
        base = simulate(graph, config).peak_bytes
        for frac in QUICK_BUDGETS if opts.quick else BUDGETS:
            budget = int(frac * base)
            row = {
                "model": name,
                "config": config.to_dict(),
                "budget_fraction": frac,
                "budget_bytes": budget,
                "none_peak_bytes": base,
                "trace_s": trace_s,
                "strategies": {},
            }
            for s in compare_strategies(graph, config, budget, BASELINES):
                row["strategies"][s.strategy] = {"peak_bytes": s.peak_bytes, "overhead": s.overhead, "fits": s.fits}
            try:
                plan = solve(graph, config, budget, time_limit_s=20.0)
                row["optimal"] = {
                    "fits": True,
                    "peak_bytes": plan.predicted.peak_bytes,
                    "overhead": plan.predicted.overhead,
                    "status": plan.solver.status,
                    "gap": plan.solver.gap,
                    "solve_s": plan.solver.wall_s,
                }
            except ValueError as e:
                row["optimal"] = {"fits": False, "failure": str(e).splitlines()[0]}
            fitting = [v["overhead"] for v in row["strategies"].values() if v["fits"]]
            row["dominates"] = (
                bool(row["optimal"]["fits"] and all(row["optimal"]["overhead"] <= o + TOL for o in fitting))
                if fitting
                else None
            )
            rows.append(row)
    return rows


def _cell(s: dict) -> str:
    return pct(s["overhead"]) if s["fits"] else "no fit"


def show(rows: list[dict]) -> None:
    print_table(
        "preset quality: llama-7b (ZeRO-3 dp 8) / llama-70b (ZeRO-3 dp 32), seq 4096, bf16-mixed, h100-80gb; "
        "budget = fraction of the no-plan peak; overhead = added time / step time (simulated)",
        ["model", "budget", "optimal", "opt peak", "gap", "solve_s"] + list(BASELINES) + ["dominates"],
        [
            [
                r["model"],
                pct(r["budget_fraction"], 0),
                _cell(r["optimal"]) if r["optimal"]["fits"] else "infeasible",
                gb(r["optimal"].get("peak_bytes")),
                pct(r["optimal"].get("gap"), 2),
                f"{r['optimal']['solve_s']:.1f}" if r["optimal"].get("solve_s") is not None else "-",
            ]
            + [_cell(r["strategies"][b]) for b in BASELINES]
            + ["-" if r["dominates"] is None else str(r["dominates"])]
            for r in rows
        ],
    )
    judged = [r for r in rows if r["dominates"] is not None]
    print(
        f"memplan optimal overhead <= every fitting baseline at {sum(r['dominates'] for r in judged)}/{len(judged)} "
        "points that have a fitting baseline"
    )
