"""Table: the cheapest configuration of a 70B step on H100-80GB (bf16-mixed, seq 4096): how many GPUs each
combination of 8-bit optimizer states, host offload and a plan needs, its step time and GPU-hours."""

from __future__ import annotations

import time
from functools import cache

from benchmarks.common import Options, gb, print_table
from costmodels.hardware import get_device
from planner.analysis.configurations import cheapest_configuration
from planner.api import trace_for
from planner.config import DEFAULT_RESERVE, TrainConfig

CASES = [("llama-70b", 4096, "h100-80gb", 1)]
QUICK = CASES


def run(opts: Options) -> list[dict]:
    cases = [c for c in CASES if not opts.models or c[0] in opts.models]
    rows = []
    for model, seq, gpu, batch in cases:
        config = TrainConfig(batch_size=batch, seq_len=seq, precision="bf16-mixed", gpu=gpu)
        budget = int(get_device(gpu).memory_bytes * (1 - DEFAULT_RESERVE))

        @cache
        def graph(batch_size: int, model: str = model, config: TrainConfig = config):
            return trace_for(model, config.with_(batch_size=batch_size, zero_stage=3))

        t0 = time.perf_counter()
        report = cheapest_configuration(graph, config, budget, max_gpus=256)
        wall = time.perf_counter() - t0
        for c in report.configurations:
            rows.append(
                {
                    "model": model,
                    "seq_len": seq,
                    "gpu": gpu,
                    "budget_bytes": budget,
                    **c.to_dict(),
                    "recommended": c == report.recommended,
                    "search_wall_s": round(wall, 1),
                }
            )
    return rows


def _fewest(rows: list[dict], **where) -> dict | None:
    fitting = [r for r in rows if r["fits"] and all(r[k] == v for k, v in where.items())]
    return min(fitting, key=lambda r: (r["gpus"], r["gpu_hours_per_million_tokens"])) if fitting else None


def show(rows: list[dict]) -> None:
    table = []
    for optimizer in ("adamw", "adamw-8bit"):
        for cpu_offload in (False, True):
            for plan in (False, True):
                r = _fewest(rows, optimizer=optimizer, cpu_offload=cpu_offload, plan=plan)
                table.append(
                    [
                        optimizer,
                        "yes" if cpu_offload else "no",
                        "yes" if plan else "no",
                        r["gpus"] if r else "none fit",
                        gb(r["peak_bytes"]) if r else "-",
                        gb(r["host_bytes"]) if r and cpu_offload else "-",
                        f"{r['step_s']:.2f}" if r else "-",
                        f"{r['gpu_hours_per_million_tokens']:.1f}" if r else "-",
                    ]
                )
    head = rows[0] if rows else {}
    print_table(
        f"configurations: {head.get('model')} seq {head.get('seq_len')} bf16-mixed on {head.get('gpu')}, "
        f"fewest GPUs per combination (search {head.get('search_wall_s')} s)",
        ["optimizer", "host offload", "plan", "GPUs", "peak / GPU", "host / GPU", "step s", "GPU-h / M tokens"],
        table,
    )
    best = next((r for r in rows if r["recommended"]), None)
    if best:
        print(
            f"  recommended: {best['label']} ({best['gpu_hours_per_million_tokens']:.1f} GPU-hours per million tokens)"
        )
