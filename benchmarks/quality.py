"""Table 2: memplan's optimal plan against the baseline strategies and PyTorch's min-cut partitioner."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import Options, gb, graph_flops, pct, print_table, ratio, saved_activation_bytes, sci
from benchmarks.mincut import partition
from benchmarks.models import spec
from costmodels.flops import op_flops
from planner.api import trace_for
from planner.apply import apply_plan
from planner.config import TrainConfig
from planner.planning import BASELINES, compare_strategies, solve
from planner.simulate import simulate
from planner.spec import resolve_spec
from planner.trace import loss_of, run_step_inputs

MODELS = [("llama", spec("llama_act"), 512), ("gpt2", spec("gpt2_act"), 512),
          ("resnet", spec("resnet_act"), 64), ("mlp", spec("mlp_act"), 1024)]
QUICK = ("llama", "gpt2", "resnet")
BUDGETS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
QUICK_BUDGETS = (0.4, 0.6, 0.8)
TOL = 1e-9


class _OpFlops(TorchDispatchMode):
    """FLOPs of every aten op that runs, by memplan's rule (costmodels.flops.op_flops)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.flops += op_flops(func, args, kwargs or {}, out)
        return out


def real_flops(model_spec: str, seq: int, plan) -> tuple[int, int]:
    """(memplan-rule FLOPs, FlopCounterMode FLOPs) of one real forward+backward, under a plan if given."""
    torch.manual_seed(0)
    model, inputs = resolve_spec(model_spec).build(batch_size=1, seq_len=seq)
    handle = apply_plan(model, plan) if plan is not None else None
    try:
        with FlopCounterMode(display=False) as fcm, _OpFlops() as ours:
            loss_of(run_step_inputs(model, inputs)).backward()
    finally:
        if handle is not None:
            handle.remove()
    return ours.flops, fcm.get_total_flops()


def run(opts: Options) -> list[dict]:
    rows = []
    budgets = QUICK_BUDGETS if opts.quick else BUDGETS
    for name, model, seq in opts.select(MODELS, QUICK):
        try:
            rows += _model_rows(name, model, seq, budgets)
        except Exception as e:  # keep the other models' rows
            rows.append({"model": name, "seq_len": seq, "failure": f"{type(e).__name__}: {str(e).splitlines()[0]}"})
    return rows


def _model_rows(name: str, model: str, seq: int, budgets) -> list[dict]:
    rows = []
    config = TrainConfig(seq_len=seq, precision="fp32", gpu="cpu")
    graph = trace_for(model, config)
    base = simulate(graph, config)
    base_saved, step_flops = saved_activation_bytes(base), graph_flops(graph)
    real_base = real_flops(model, seq, None)
    mc_base = partition(model, 1, seq, None)
    for frac in budgets:
        budget = int(frac * base.peak_bytes)
        row = {"model": name, "seq_len": seq, "budget_fraction": frac, "budget_bytes": budget,
               "none_peak_bytes": base.peak_bytes, "strategies": {}}
        for s in compare_strategies(graph, config, budget, BASELINES):
            row["strategies"][s.strategy] = {"peak_bytes": s.peak_bytes, "overhead": s.overhead, "fits": s.fits}
        try:
            plan = solve(graph, config, budget, time_limit_s=10.0)
            tl = simulate(graph, config, plan=plan)
            real = real_flops(model, seq, plan)
            reduction = base_saved - saved_activation_bytes(tl)
            row["optimal"] = {
                "peak_bytes": plan.predicted.peak_bytes, "overhead": plan.predicted.overhead, "fits": True,
                "status": plan.solver.status, "gap": plan.solver.gap,
                "saved_bytes_reduction": reduction, "recompute_flops": plan.predicted.recompute_flops,
                "flops_per_saved_byte": ratio(plan.predicted.recompute_flops, reduction),
                "flop_overhead": plan.predicted.recompute_flops / step_flops,
                "measured_recompute_flops": real[0] - real_base[0],
                "measured_recompute_flops_fcm": real[1] - real_base[1]}
        except ValueError as e:
            row["optimal"] = {"fits": False, "failure": str(e).splitlines()[0]}
        fitting = [v["overhead"] for v in row["strategies"].values() if v["fits"]]
        row["dominates"] = (all(row["optimal"]["overhead"] <= o + TOL for o in fitting)
                            if row["optimal"]["fits"] else not fitting)
        mc = partition(model, 1, seq, frac)
        mc_red = mc_base["saved_bytes"] - mc["saved_bytes"]
        mc_flops = mc["flops"] - mc_base["flops"]
        row["mincut"] = {"activation_memory_budget": frac, "saved_bytes": mc["saved_bytes"],
                         "baseline_saved_bytes": mc_base["saved_bytes"], "saved_bytes_reduction": mc_red,
                         "recompute_flops": mc_flops, "flops_per_saved_byte": ratio(mc_flops, mc_red),
                         "flop_overhead": mc_flops / mc_base["flops"]}
        rows.append(row)
    return rows


def _cell(s: dict) -> str:
    return pct(s["overhead"]) if s["fits"] else "no fit"


def show(rows: list[dict]) -> None:
    for r in rows:
        if "failure" in r:
            print(f"quality: {r['model']} failed: {r['failure']}")
    rows = [r for r in rows if "failure" not in r]
    print_table("quality: overhead of the plan that fits (simulated); 'no fit' = over budget",
                ["model", "budget", "optimal", "opt peak"] + [b for b in BASELINES] + ["dominates"],
                [[r["model"], pct(r["budget_fraction"], 0),
                  _cell(r["optimal"]) if r["optimal"]["fits"] else "infeasible", gb(r["optimal"].get("peak_bytes"))]
                 + [_cell(r["strategies"][b]) for b in BASELINES] + [str(r["dominates"])] for r in rows])
    n = sum(r["dominates"] for r in rows)
    print(f"memplan optimal overhead <= every fitting strategy at {n}/{len(rows)} (model, budget) points")
    print_table("quality: memplan vs min-cut partitioner (same FLOP rule; saved = bytes kept for backward)",
                ["model", "budget", "memplan saved-", "memplan rFLOPs", "real rFLOPs", "real rFLOPs(fcm)",
                 "FLOP/B", "mincut saved-", "mincut rFLOPs", "FLOP/B", "flop ovh memplan", "flop ovh mincut"],
                [[r["model"], pct(r["budget_fraction"], 0), gb(r["optimal"].get("saved_bytes_reduction")),
                  sci(r["optimal"].get("recompute_flops")), sci(r["optimal"].get("measured_recompute_flops")),
                  sci(r["optimal"].get("measured_recompute_flops_fcm")), sci(r["optimal"].get("flops_per_saved_byte")),
                  gb(r["mincut"]["saved_bytes_reduction"]), sci(r["mincut"]["recompute_flops"]),
                  sci(r["mincut"]["flops_per_saved_byte"]), pct(r["optimal"].get("flop_overhead")),
                  pct(r["mincut"]["flop_overhead"])] for r in rows])
