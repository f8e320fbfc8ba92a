"""Table 3: CP-SAT plan time, gap and size for Llama-shaped models of 2 to 128 layers (hidden 1024).

--quick: 2, 8 and 16 layers; full: 2, 8, 32, 64 and 128. CP-SAT time limit 30 s.
"""

from __future__ import annotations

import time

from benchmarks.common import Options, gb, pct, print_table
from benchmarks.models import spec
from planner.api import trace_for
from planner.config import TrainConfig
from planner.simulation.step import simulate
from planner.solver.baselines import strategy_choices
from planner.solver.cpsat import solve_choices

LAYERS = (2, 8, 32, 64, 128)
QUICK_LAYERS = (2, 8, 16)
MODELS = [(f"llama-L{n}", spec(f"llama_1024_L{n}"), n) for n in sorted(set(LAYERS) | set(QUICK_LAYERS))]
TIME_LIMIT_S = 30.0
CONFIG = TrainConfig(batch_size=8, seq_len=2048, precision="bf16-mixed", gpu="h100-80gb")


def run(opts: Options) -> list[dict]:
    rows = []
    keep = QUICK_LAYERS if opts.quick else LAYERS
    entries = opts.select(MODELS) if opts.models else [m for m in MODELS if m[2] in keep]
    for name, model, layers in entries:
        row = {
            "model": name,
            "layers": layers,
            "seq_len": CONFIG.seq_len,
            "gpu": CONFIG.gpu,
            "precision": CONFIG.precision,
            "batch_size": CONFIG.batch_size,
        }
        t0 = time.perf_counter()
        graph = trace_for(model, CONFIG)
        row["trace_s"] = round(time.perf_counter() - t0, 3)
        row["num_ops"] = len(graph.ops)
        base = simulate(graph, CONFIG).peak_bytes
        full = simulate(graph, CONFIG, choices=strategy_choices(graph, "full")).peak_bytes
        row.update(none_peak_bytes=base, full_peak_bytes=full)
        # 50% of the no-plan peak; where model states make that unreachable, halfway from full to none
        budget = base // 2 if full <= base // 2 else (full + base) // 2
        row.update(budget_bytes=budget, budget_fraction=budget / base)
        try:
            r = solve_choices(graph, CONFIG, budget, time_limit_s=TIME_LIMIT_S)
            row.update(
                solve_s=round(r.wall_s, 3),
                gap=r.gap,
                status=r.status,
                num_variables=r.num_variables,
                peak_bytes=r.timeline.peak_bytes,
                overhead=r.timeline.costs.overhead,
            )
        except ValueError as e:
            row.update(solve_s=None, gap=None, status="FAILED", num_variables=None, failure=str(e).splitlines()[0])
        rows.append(row)
    return rows


def show(rows: list[dict]) -> None:
    print_table(
        "solver: Llama-shaped (hidden 1024, batch 8 x seq 2048, bf16-mixed, h100-80gb), budget 50% of no-plan peak, "
        f"CP-SAT limit {TIME_LIMIT_S:.0f} s",
        [
            "model",
            "ops",
            "trace_s",
            "solve_s",
            "status",
            "gap",
            "variables",
            "budget",
            "none peak",
            "plan peak",
            "overhead",
        ],
        [
            [
                r["model"],
                r["num_ops"],
                f"{r['trace_s']:.2f}",
                "-" if r["solve_s"] is None else f"{r['solve_s']:.2f}",
                r["status"],
                pct(r["gap"], 2),
                r["num_variables"] if r["num_variables"] is not None else "-",
                pct(r["budget_fraction"], 0),
                gb(r["none_peak_bytes"]),
                gb(r.get("peak_bytes")),
                pct(r.get("overhead")),
            ]
            for r in rows
        ],
    )
