"""Expert parallel (issue 23): every EP role's per-rank peak by category, and the time to simulate them.

transformers' DeepSeek-V3 config at its defaults (671B: 61 layers, 256 routed experts top-8, MLA),
fake tensors only, at `--ep 32 --dp 256 --zero 3 --seq-len 4096 --precision bf16-mixed --gpu
h100-80gb`, with balanced routing and with `--moe-imbalance 2` (the EP rank holding the busiest
expert is its own role). Quick: transformers' Mixtral from tests/data (4 experts) at `--dp 2 --ep 2`.

python -m benchmarks.expert_parallel [--quick] [--out DIR]  (or python -m benchmarks --only ep)
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.common import Options, print_table, standalone_main
from benchmarks.hot_path import _deepseek_config
from planner.config import TrainConfig
from planner.simulation.layout import simulate_ranks
from planner.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]
DEEPSEEK = {"dp": 256, "ep": 32, "zero_stage": 3, "seq_len": 4096, "precision": "bf16-mixed", "gpu": "h100-80gb"}
TINY = {"dp": 2, "ep": 2, "batch_size": 2, "seq_len": 64, "gpu": "cpu"}
CASES = [  # (name, model, layout, moe_imbalance)
    ("deepseek-v3", "DEEPSEEK", DEEPSEEK, 1.0),
    ("deepseek-v3", "DEEPSEEK", DEEPSEEK, 2.0),
    ("mixtral-tiny", f"hf:{ROOT / 'tests' / 'data' / 'tiny_mixtral' / 'config.json'}", TINY, 2.0),
]
QUICK = ("mixtral-tiny",)
CATEGORIES = ("parameter", "gradient", "optimizer", "activation", "temporary")


def run(opts: Options) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, layout, imbalance in opts.select(CASES, QUICK):
            spec = _deepseek_config(Path(tmp)) if model == "DEEPSEEK" else model
            config = TrainConfig(moe_imbalance=imbalance, **layout)
            wall, cpu = time.perf_counter(), time.process_time()
            result = simulate_ranks(spec, config).to_dict()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            for role in result["ranks"]:
                rows.append(
                    {
                        "model": name,
                        "layout": " ".join(
                            f"--{k.replace('_stage', '').replace('_', '-')} {v}"
                            for k, v in layout.items()
                            if k != "gpu"
                        ),
                        "moe_imbalance": imbalance,
                        "ep_index": role["coords"]["ep"],
                        "ranks": len(role["ranks"]),
                        "peak_bytes": role["peak_bytes"],
                        "breakdown_at_peak": role["breakdown_at_peak"],
                        "simulate_wall_s": round(wall, 1),
                        "simulate_cpu_s": round(cpu, 1),
                    }
                )
    return rows


def show(rows: list[dict]) -> None:
    print_table(
        "expert parallel: per-rank peak by category of every EP role (simulate time covers all roles)",
        ["model", "imbalance", "ep rank", "ranks", "peak", *CATEGORIES, "wall", "cpu"],
        [
            [
                r["model"],
                f"{r['moe_imbalance']:g}",
                r["ep_index"],
                r["ranks"],
                format_bytes(r["peak_bytes"]),
                *(format_bytes(r["breakdown_at_peak"][c]) for c in CATEGORIES),
                f"{r['simulate_wall_s']:.1f} s",
                f"{r['simulate_cpu_s']:.1f} s",
            ]
            for r in rows
        ],
    )


if __name__ == "__main__":
    standalone_main("expert_parallel", __doc__, run, show)
