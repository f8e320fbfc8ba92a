"""Recompute in pipeline bubbles (issue 25, item 3): priced in the plan, run by the runtime, measured.

Under GPipe, 1F1B, interleaved 1F1B and looped BFS a stage before the last waits, before each
backward, for its gradient from the next stage. memplan's stage plans run the recompute of the block
whose backward comes first there, while the stage waits (planner/simulation/pipeline_early.py,
planner/runtime/early_recompute.py).

1. Simulation: llama-70b, PP 8 x FSDP2 8, seq 8192, bf16-mixed, h100-80gb, 16 microbatches: plans
   that price a recompute by the step time it adds (bubble-aware, the default) against plans that
   price it by its own time, at the same budget (a fraction of the worst rank's unplanned peak).
2. Measured on 2 gloo CPU ranks (benchmarks/models.py:llama_pipe, 4 microbatches; 1F1B, and
   interleaved 1F1B with 2 stages per rank): the same stage plans stepped with the early recompute
   and without it (each block recomputed in its backward), rounds interleaved, median step seconds
   and each rank's peak against the prediction.

python -m benchmarks.bubble_recompute [--quick] [--out DIR]
"""

from __future__ import annotations

import dataclasses
import statistics

from benchmarks.common import Options, gb, pct, print_table, standalone_main
from benchmarks.models import spec
from planner.api import _pipeline_roles
from planner.config import TrainConfig
from planner.errors import InfeasibleBudget
from planner.simulation.pipeline import simulate_pipeline
from planner.solver.pipeline_plans import solve_pipeline, stage_plans
from planner.tracing.recorder import trace

SIM_FRACTIONS = (0.8, 0.6)
ROUNDS = 5


def _simulated(fractions: tuple[float, ...]) -> list[dict]:
    config = TrainConfig(
        batch_size=16,
        seq_len=8192,
        precision="bf16-mixed",
        gpu="h100-80gb",
        zero_stage=3,
        dp=8,
        pp=8,
        pp_schedule="1f1b",
        microbatches=16,
    )
    graph = next(iter(_pipeline_roles("llama-70b", config)[0].values()))
    unplanned = simulate_pipeline(graph, config)
    rows = []
    for fraction in fractions:
        budget = int(unplanned.layout.peak_bytes * fraction)
        row = {"budget_fraction": fraction, "budget_bytes": budget, "unplanned_step_s": unplanned.time.step_s}
        for label, aware in (("full_price", False), ("bubble_aware", True)):
            try:
                plan = solve_pipeline(graph, config, budget, bubble_aware=aware)
            except InfeasibleBudget:
                row[label] = None
                continue
            row[label] = {
                "peak_bytes": max(r.peak_with for r in plan.ranks),
                "recompute_s": sum(r.recompute_s for r in plan.ranks),
                "hidden_recompute_s": sum(plan.hidden_recompute_s),
                "step_s": plan.step_s_with,
            }
        a, b = row["full_price"], row["bubble_aware"]
        row["step_gain"] = a["step_s"] / b["step_s"] - 1 if a and b else None
        rows.append(row)
    return rows


MEASURED_SCHEDULES = (("1f1b", None), ("interleaved-1f1b", 2))


def _measured(rounds: int, schedule: str, stages_per_rank: int | None) -> dict:
    from planner.runtime.pipeline_verify import measure_pipeline_on_gloo_ranks  # torch.distributed's stack

    model = spec("llama_pipe")
    config = TrainConfig(
        batch_size=8, seq_len=256, pp=2, pp_schedule=schedule, microbatches=4, stages_per_rank=stages_per_rank
    )
    graph = trace(model, batch_size=2, seq_len=256)
    unplanned = simulate_pipeline(graph, config)
    plan = solve_pipeline(graph, config, int(unplanned.layout.peak_bytes * 0.85))
    early = stage_plans(graph, config, plan)
    late = dataclasses.replace(early, stages=tuple(dataclasses.replace(s, early_recompute=()) for s in early.stages))
    runs: dict[str, list] = {"early": [], "in_backward": []}
    for _ in range(rounds):  # interleaved: a burst of other work spoils one round of each
        for name, plans in (("early", early), ("in_backward", late)):
            runs[name].append(
                measure_pipeline_on_gloo_ranks(model, config, unplanned.blocks_per_stage, plans.to_dict())
            )
    out = {
        "schedule": schedule,
        "early_recompute": [list(s.early_recompute) for s in early.stages],
        "predicted_peak_bytes": [r.peak_with for r in plan.ranks],
    }
    for name, measured in runs.items():
        out[name] = {
            "step_s": statistics.median(max(m.step_s for m in ms) for ms in measured),
            "peak_bytes": [min(ms[r].peak_bytes for ms in measured) for r in range(config.pp)],
        }
    out["step_gain"] = out["in_backward"]["step_s"] / out["early"]["step_s"] - 1
    return out


def run(opts: Options) -> dict:
    return {
        "simulated": _simulated(SIM_FRACTIONS[:1] if opts.quick else SIM_FRACTIONS),
        "measured": [_measured(3 if opts.quick else ROUNDS, *s) for s in MEASURED_SCHEDULES],
    }


def show(result: dict) -> None:
    body = []
    for r in result["simulated"]:
        cells = [f"{r['budget_fraction']:.0%}", gb(r["budget_bytes"]), f"{r['unplanned_step_s']:.3f} s"]
        for label in ("full_price", "bubble_aware"):
            x = r[label]
            cells += (
                [f"{x['recompute_s']:.3f} s", f"{x['hidden_recompute_s']:.3f} s", f"{x['step_s']:.3f} s"]
                if x
                else ["infeasible", "-", "-"]
            )
        cells.append(pct(r["step_gain"], 2) if r["step_gain"] is not None else "-")
        body.append(cells)
    headers = ["budget", "bytes", "unplanned step"]
    headers += [f"{p} {c}" for p in ("full-price", "bubble-aware") for c in ("recompute", "hidden", "step")]
    print_table("llama-70b PP8 x FSDP2 8, 1F1B, 16 microbatches, simulated", headers + ["step gain"], body)
    for m in result["measured"]:
        rows = [
            [name, f"{m[name]['step_s']:.3f} s", " / ".join(gb(p) for p in m[name]["peak_bytes"])]
            for name in ("early", "in_backward")
        ]
        rows.append(["predicted", "-", " / ".join(gb(p) for p in m["predicted_peak_bytes"])])
        print_table(
            f"2 gloo ranks, {m['schedule']}, early {m['early_recompute']}: step gain {pct(m['step_gain'])}",
            ["recompute runs", "median step", "peak per rank"],
            rows,
        )


if __name__ == "__main__":
    standalone_main("bubble_recompute", __doc__, run, show)
