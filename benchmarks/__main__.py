"""python -m benchmarks [--quick] [--out DIR] [--only NAME[,NAME]] [--models NAME[,NAME]] [--measured-time]"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

from benchmarks.common import Options, to_jsonable

TABLES = {
    "accuracy": "accuracy",
    "quality": "quality",
    "presets": "preset_quality",
    "solver": "solver_scaling",
    "large": "large",
    "speed": "simulate_speed",
    "measured": "measured_time",
    "zoo": "zoo",
    "fsdp": "fsdp",
    "configurations": "configurations",
    "startup": "cli_startup",
}
TABLES["adaptive"] = "adaptive"  # growing sequence: adaptive plan vs a fixed one (benchmarks/adaptive.py)
TABLES["set_budget"] = "set_budget"  # re-planning latency, 4/32/80 blocks (benchmarks/set_budget.py)
TABLES["layouts"] = "layouts"  # whole-layout search (benchmarks/layouts.py)
TABLES["hot_path"] = "hot_path"  # simulate/plan wall time, folded vs full trace (benchmarks/hot_path.py)
TABLES["tp_megatron"] = "tp_megatron"  # llama-70b at TP 1/2/4/8 against Megatron's formula (benchmarks/tp_megatron.py)
TABLES["ep"] = "expert_parallel"  # EP roles per rank, DeepSeek-V3 at EP 32 (benchmarks/expert_parallel.py)
TABLES["hidden_recompute"] = (
    "hidden_recompute"  # plans priced by step time vs recompute time (benchmarks/hidden_recompute.py)
)
TABLES["bubble_recompute"] = "bubble_recompute"  # recompute in pipeline waits (benchmarks/bubble_recompute.py)
TABLES["pipeline_verify"] = "pipeline_verify"  # verify --pp 2 under every schedule (benchmarks/pipeline_verify.py)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--quick", action="store_true", help="reduced set (under 10 minutes on 2 cores)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for results.json")
    p.add_argument(
        "--only",
        default=",".join(t for t in TABLES if t not in ("measured", "bubble_recompute")),
        help="comma list of: " + ", ".join(TABLES),
    )
    p.add_argument("--measured-time", action="store_true", help="only the measured-time table (needs a quiet machine)")
    p.add_argument("--models", default="", help="comma list of model names to keep in every table")
    args = p.parse_args(argv)
    only = ["measured"] if args.measured_time else [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in TABLES]
    if unknown:
        p.error(f"unknown table(s) {', '.join(unknown)}; choose from {', '.join(TABLES)}")
    opts = Options(quick=args.quick, models=tuple(m.strip() for m in args.models.split(",") if m.strip()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "meta": {
            "quick": args.quick,
            "only": only,
            "models": list(opts.models),
            "argv": sys.argv if argv is None else argv,
        },
        "timings_s": {},
        "failures": [],
    }
    t_all = time.perf_counter()
    for name in only:
        module = importlib.import_module(f"benchmarks.{TABLES[name]}")
        t0 = time.perf_counter()
        try:
            rows = module.run(opts)
        except Exception as e:  # one broken table must not hide the others
            traceback.print_exc()
            results["failures"].append(f"{name}: {type(e).__name__}: {e}")
            rows = []
        results[name] = rows
        results["timings_s"][name] = round(time.perf_counter() - t0, 1)
        if rows:
            module.show(rows)
        print(f"[{name}: {results['timings_s'][name]} s]", flush=True)
        (out / "results.json").write_text(json.dumps(to_jsonable(results), indent=1))
    results["timings_s"]["total"] = round(time.perf_counter() - t_all, 1)
    (out / "results.json").write_text(json.dumps(to_jsonable(results), indent=1))
    print(
        f"\nwrote {out / 'results.json'} in {results['timings_s']['total']} s"
        + (f"; failures: {results['failures']}" if results["failures"] else "")
    )
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
