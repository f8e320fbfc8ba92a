"""Recompute hidden in communication waits (issue 25, item 3): plans that price a recompute by the
step time it adds against plans that price it by its own time, at the same budget.

Under FSDP2 a block's backward starts with its recompute, on the compute stream, while the link still
carries the next block's all-gather and earlier reduce-scatters; where the backward would wait for
that all-gather, the recompute fills the wait (planner/simulation/comm.py). memplan's plans price
each recompute by what it adds beyond its block's wait (`solve_choices(hide_in_communication=True)`,
the default); the baseline prices it in full (`hide_in_communication=False`: the least recompute
time). Both plans are simulated by the same step-time model; each row is one budget, a fraction of
the layout's unplanned peak. Tensor-parallel collectives wait on the compute stream, so they hide
nothing; the waits come from FSDP2's collectives over the data-parallel ranks.

python -m benchmarks.hidden_recompute [--quick] [--out DIR]  (or python -m benchmarks --only hidden_recompute)
"""

from __future__ import annotations

from benchmarks.common import Options, gb, pct, print_table, standalone_main
from planner.config import TrainConfig
from planner.errors import InfeasibleBudget
from planner.simulation.step import simulate
from planner.solver.cpsat import solve_choices
from planner.tracing.parallel.rank_trace import trace_tp_rank
from planner.tracing.recorder import trace_for

BUDGET_FRACTIONS = (0.8, 0.6, 0.4)
LAYOUTS = [  # (name, spec, seq_len, batch per data-parallel rank, tp, dp)
    ("llama-7b fsdp64 b2", "llama-7b", 4096, 2, 1, 64),
    ("llama-70b fsdp64 b1", "llama-70b", 4096, 1, 1, 64),
    ("llama-70b tp8 fsdp8 b1", "llama-70b", 8192, 1, 8, 8),
    ("llama-70b tp8 fsdp8 b2", "llama-70b", 8192, 2, 8, 8),
]
QUICK = ("llama-7b fsdp64 b2",)


def _config(seq_len: int, batch: int, tp: int, dp: int) -> TrainConfig:
    return TrainConfig(
        batch_size=batch, seq_len=seq_len, precision="bf16-mixed", gpu="h100-80gb", zero_stage=3, dp=dp, tp=tp
    )


def _rows(name: str, spec: str, seq_len: int, batch: int, tp: int, dp: int) -> list[dict]:
    config = _config(seq_len, batch, tp, dp)
    graph = trace_tp_rank(spec, config, rank=0)[0] if tp > 1 else trace_for(spec, config)
    unplanned = simulate(graph, config)
    rows = []
    for fraction in BUDGET_FRACTIONS:
        budget = int(unplanned.peak_bytes * fraction)
        row = {"layout": name, "budget_fraction": fraction, "budget_bytes": budget}
        row["unplanned_step_s"] = unplanned.costs.step_s
        row["exposed_communication_s"] = unplanned.costs.exposed_communication_s
        for label, hide in (("full_price", False), ("step_time", True)):
            try:
                result = solve_choices(graph, config, budget, hide_in_communication=hide, time_limit_s=60)
            except InfeasibleBudget:
                row[label] = None
                continue
            costs = result.timeline.costs
            row[label] = {
                "peak_bytes": result.timeline.peak_bytes,
                "recompute_s": costs.recompute_s,
                "hidden_recompute_s": costs.hidden_recompute_s,
                "step_s": costs.step_s,
            }
        a, b = row["full_price"], row["step_time"]
        row["step_gain"] = a["step_s"] / b["step_s"] - 1 if a and b else None
        rows.append(row)
    return rows


def run(opts: Options) -> list[dict]:
    return [row for layout in opts.select(LAYOUTS, QUICK) for row in _rows(*layout)]


def show(rows: list[dict]) -> None:
    body = []
    for r in rows:
        cells = [r["layout"], f"{r['budget_fraction']:.0%}", f"{r['exposed_communication_s']:.3f} s"]
        for label in ("full_price", "step_time"):
            x = r[label]
            cells += (
                [
                    gb(x["peak_bytes"]),
                    f"{x['recompute_s']:.3f} s",
                    f"{x['hidden_recompute_s']:.3f} s",
                    f"{x['step_s']:.3f} s",
                ]
                if x
                else ["infeasible", "-", "-", "-"]
            )
        cells.append(pct(r["step_gain"]) if r["step_gain"] is not None else "-")
        body.append(cells)
    headers = ["layout", "budget", "exposed comm"]
    headers += [f"{p} {c}" for p in ("full-price", "step-time") for c in ("peak", "recompute", "hidden", "step")]
    print_table(
        "plans priced by step time vs by recompute time, same budget (fraction of the unplanned peak), h100-80gb",
        headers + ["step gain"],
        body,
    )


if __name__ == "__main__":
    standalone_main("hidden_recompute", __doc__, run, show)
