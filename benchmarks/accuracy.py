"""Table 1: predicted against measured peak of a real CPU step (fp32 AdamW), with and without a plan."""

from __future__ import annotations

from benchmarks.common import Options, gb, pct, print_table
from benchmarks.models import spec
from planner.api import trace_for, verify_model
from planner.config import TrainConfig
from planner.planning import solve
from planner.simulate import simulate
from planner.solve import InfeasibleBudget, strategy_choices

BUDGET_FRACTION = 0.7
# name, tiny preset, bigger custom config, seq_len (resnet: image side)
MODELS = [
    ("llama", "llama-7b-tiny", spec("llama_small"), 128),
    ("mistral", "mistral-7b-tiny", spec("mistral_small"), 128),
    ("gpt2", "gpt2-tiny", spec("gpt2_small"), 128),
    ("bert", "bert-tiny", spec("bert_small"), 128),
    ("resnet", "resnet-tiny", spec("resnet_small"), 32),
    ("mlp", "mlp-tiny", spec("mlp_small"), 128),
    ("kwargs", "kwargs-tiny", spec("kwargs_small"), 128),
]


def make_plan(model: str, config: TrainConfig):
    """memplan's optimal plan at 70% of the no-plan peak, else the full strategy (which always runs)."""
    graph = trace_for(model, config)
    base = simulate(graph, config).peak_bytes
    full = simulate(graph, config, choices=strategy_choices(graph, "full")).peak_bytes
    # 70% of the peak; when model states make that unreachable, halfway between full recompute and none
    for budget in (int(BUDGET_FRACTION * base), (full + base) // 2):
        try:
            return solve(graph, config, budget, time_limit_s=10.0)
        except InfeasibleBudget:
            pass
    return solve(graph, config, base, strategy="full")


def run(opts: Options) -> list[dict]:
    rows = []
    quick = tuple(m[0] for m in MODELS if m[0] != "mistral")
    for name, tiny, small, seq in opts.select(MODELS, quick):
        for size, model in (("tiny", tiny), ("small", small)):
            config = TrainConfig(seq_len=seq, precision="fp32", optimizer="adamw", gpu="cpu")
            for kind in ("none", "optimal"):
                row = {"model": name, "spec": model if size == "tiny" else model.rsplit(":", 1)[1],
                       "size": size, "seq_len": seq, "plan": kind}
                try:
                    plan = make_plan(model, config) if kind == "optimal" else None
                    if plan is not None:
                        row.update(strategy=plan.strategy, budget_bytes=plan.budget_bytes,
                                   budget_fraction=plan.budget_bytes / plan.predicted.baseline_peak_bytes)
                    r = verify_model(model, config, plan)
                    row.update(predicted_bytes=r.predicted_bytes, measured_bytes=r.measured_bytes, error=r.error)
                except Exception as e:  # a failure is a result too: keep going
                    row.update(predicted_bytes=None, measured_bytes=None, error=None,
                               failure=f"{type(e).__name__}: {e}")
                rows.append(row)
    return rows


def show(rows: list[dict]) -> None:
    print_table("accuracy: predicted vs measured peak, CPU fp32 AdamW",
                ["model", "size", "plan", "strategy", "budget", "predicted", "measured", "error"],
                [[r["model"], r["size"], r["plan"], r.get("strategy", "-"), pct(r.get("budget_fraction"), 0), gb(r["predicted_bytes"]),
                  gb(r["measured_bytes"]), pct(r["error"], 2) if r["error"] is not None else r.get("failure", "-")]
                 for r in rows])
    ok = [abs(r["error"]) for r in rows if r["error"] is not None]
    if ok:
        print(f"{len(ok)}/{len(rows)} rows measured; max |error| {max(ok) * 100:.2f}%, "
              f"mean |error| {sum(ok) / len(ok) * 100:.2f}%")
