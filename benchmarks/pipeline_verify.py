"""Pipeline parallel (issue 24): each pp rank's predicted peak against the one measured on 2 gloo
ranks, under every schedule torch.distributed.pipelining has (`memplan verify --pp 2`).

Four stages of one block (two per rank; one per rank for gpipe and 1f1b, which run two stages of
two blocks), batch 4 in 4 microbatches, seq 64, fp32, AdamW, on memplan's llama-70b-tiny,
transformers' Llama (tests/pp_ranks.py) and Gemma2 (eager attention with soft-capping, sliding
window; tests/data/tiny_gemma2). Quick: transformers' Llama and Gemma2 under 1f1b and
zbv-zero-bubble.

python -m benchmarks.pipeline_verify [--quick] [--out DIR]  (or python -m benchmarks --only pipeline_verify)
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import Options, pct, print_table, standalone_main
from planner.api import verify_layout
from planner.config import PP_SCHEDULES, SINGLE_STAGE_SCHEDULES, TrainConfig

ROOT = Path(__file__).resolve().parents[1]
MODELS = [
    ("llama-70b-tiny", "llama-70b-tiny"),
    ("transformers-llama", "tests/pp_ranks.py:hf_llama"),
    ("transformers-gemma2", f"hf:{ROOT / 'tests' / 'data' / 'tiny_gemma2' / 'config.json'}"),
]
QUICK_MODELS = ("transformers-llama", "transformers-gemma2")
QUICK_SCHEDULES = ("1f1b", "zbv-zero-bubble")


def run(opts: Options) -> list[dict]:
    rows = []
    schedules = QUICK_SCHEDULES if opts.quick else PP_SCHEDULES
    for name, spec in opts.select(MODELS, QUICK_MODELS):
        for schedule in schedules:
            config = TrainConfig(
                batch_size=4,
                seq_len=64,
                pp=2,
                pp_schedule=schedule,
                microbatches=4,
                stages_per_rank=1 if schedule in SINGLE_STAGE_SCHEDULES else 2,
            )
            result = verify_layout(spec, config)
            rows.append(
                {
                    "model": name,
                    "schedule": schedule,
                    "predicted_bytes": result.predicted_bytes,
                    "measured_bytes": result.measured_bytes,
                    "errors": [round(e, 5) for e in result.errors],
                }
            )
    return rows


def show(rows: list[dict]) -> None:
    mib = 2**20
    print_table(
        "verify --pp 2: predicted / measured MiB per rank (error), CPU gloo",
        ["model", "schedule", "rank 0", "rank 1"],
        [
            [
                r["model"],
                r["schedule"],
                *(
                    f"{p / mib:.2f} / {m / mib:.2f} ({pct(e)})"
                    for p, m, e in zip(r["predicted_bytes"], r["measured_bytes"], r["errors"])
                ),
            ]
            for r in rows
        ],
    )


if __name__ == "__main__":
    standalone_main("pipeline_verify", __doc__, run, show)
