"""Table 4: 7B-70B Llamas on H100-80GB and H200 (bf16-mixed, batch 1): fewest ZeRO-3 GPUs with and without a plan."""

from __future__ import annotations

import time

from benchmarks.common import Options, gb, pct, print_table
from planner.config import TrainConfig

MODELS = ("llama-7b", "llama-13b", "llama-70b")
CASES = [(m, s, g) for m in MODELS for s in (4096, 32768) for g in ("h100-80gb", "h200")]
QUICK = [("llama-7b", 4096, "h100-80gb"), ("llama-70b", 4096, "h100-80gb")]


def _fit(model: str, config: TrainConfig):
    """planner.analysis.fit.fit (ZeRO-3 dp search; plan budget = 95% of capacity)."""
    from planner.analysis.fit import fit

    r = fit(model, config)
    return r.min_gpus_without_plan, r.without_plan, r.min_gpus_with_plan, r.with_plan, r.budget_bytes


def run(opts: Options) -> list[dict]:
    cases = CASES if not opts.quick else QUICK
    if opts.models:
        cases = [c for c in CASES if c[0] in opts.models]
    rows = []
    for model, seq, gpu in cases:
        config = TrainConfig(batch_size=1, seq_len=seq, precision="bf16-mixed", gpu=gpu)
        row = {"model": model, "seq_len": seq, "gpu": gpu, "precision": "bf16-mixed", "zero_stage": 3}
        t0 = time.perf_counter()
        try:
            n_without, without, n_with, with_plan, budget = _fit(model, config)
            row.update(
                budget_bytes=budget,
                min_gpus_without_plan=n_without,
                min_gpus_with_plan=n_with,
                peak_without_plan=(without or {}).get("peak_bytes"),
                peak_with_plan=(with_plan or {}).get("peak_bytes"),
                overhead=(with_plan or {}).get("overhead"),
            )
        except Exception as e:
            row["failure"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
    return rows


def show(rows: list[dict]) -> None:
    print_table(
        "large: ZeRO-3, bf16-mixed, batch 1; plan budget 95% of capacity; peaks at each GPU count",
        ["model", "seq", "gpu", "GPUs no plan", "peak no plan", "GPUs plan", "peak plan", "overhead", "wall_s"],
        [
            [
                r["model"],
                r["seq_len"],
                r["gpu"],
                r.get("min_gpus_without_plan") or "none fit",
                gb(r.get("peak_without_plan")),
                r.get("min_gpus_with_plan") or "none fit",
                gb(r.get("peak_with_plan")),
                pct(r.get("overhead")),
                f"{r['wall_s']:.1f}",
            ]
            for r in rows
        ],
    )
    for r in rows:
        if "failure" in r:
            print(f"  {r['model']} {r['seq_len']} {r['gpu']}: {r['failure']}")
