"""Whole-layout search: how long memplan's search takes and what it recommends for Llama 3 70B and
405B on H100s, llama-70b on 8 against 16 GPUs, and published layouts next to memplan's prediction.

Every search is planner.analysis.layouts.search_layouts at batch 1 x seq 8192, bf16-mixed, on
h100-80gb with 5% of the memory kept free, the default global batch (about 4M tokens). The search
table gives the wall time of one search, how many layouts it simulated, the recommended layout
and the Pareto front (fewest GPUs against the shortest step). The claim table takes, from the
same llama-70b search, the fastest layout that fits on exactly 8 GPUs and on exactly 16, per GPU
and per job, and what each needs (host offload, 8-bit AdamW states, recompute).

Published layouts are evaluated with their tensor and pipeline degrees pinned (config tp / pp),
plain AdamW and no host offload (allow_8bit / allow_offload off, as they ran), and a global batch
that gives each data-parallel replica the sequences the publication gives it; the row is the one
of the search's layouts with the published GPU count (or, for Meta's 8,192 and 16,384 GPUs, the
same tp x pp at a data-parallel degree the search reaches: every per-rank quantity depends on the
per-replica share, not on dp). Meta's numbers are from "The Llama 3 Herd of Models", Table 4
(seq 8192, CP 1); torchtitan's from torchtitan's train_configs/llama3_70b.toml and
benchmarks/llama3_h100_202412_torchtitan.md (Table 5).

DeepSeek-V3 is transformers' DeepseekV3Config at its defaults (671B: 61 layers, 256 routed experts
top-8, MLA), on fake tensors: searched like the Llamas (expert parallel over each stage's
data-parallel ranks, inside pipelines too), and evaluated as DeepSeek ran it (pp 16 x ep 64 on 2,048
GPUs at seq 4096) against the throughput its report implies (180K H800 GPU-hours per trillion tokens).

llama-405b and DeepSeek-V3 are searched up to 2048 GPUs (the search stops two doublings past the first GPU count
that fits, so the cap does not bind). --quick: llama-70b only (its search, the claim and the
torchtitan 70B recipe).

python -m benchmarks.layouts [--quick] [--out DIR]  (or python -m benchmarks --only layouts)
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from benchmarks.common import Options, gb, pct, print_table, standalone_main
from benchmarks.hot_path import _deepseek_config
from costmodels.hardware import get_device
from planner.analysis.layouts import Layout, search_layouts
from planner.budgets import usable_bytes
from planner.config import TrainConfig

GPU = "h100-80gb"
RESERVE = 0.05
SEQ_LEN = 8192
MODELS = [("llama-70b", 512), ("llama-405b", 2048), ("deepseek-v3", 2048)]  # (model, max GPUs searched)
QUICK = ("llama-70b",)
CLAIM_MODEL, CLAIM_GPUS = "llama-70b", (8, 16)

# Searches with pinned degrees for the published layouts: key -> model, tp, pp, ep (default 1),
# micro-batch, global batch, max GPUs, seq_len (default SEQ_LEN).
PINNED = {
    # 64 sequences: 32 per replica at dp 2 (256 GPUs), 16 per replica at dp 4 (512 GPUs), as Meta's
    # 2,048 sequences over dp 64 and dp 128. tp 8 x pp 16 starts at 128 GPUs, so the search reaches 512.
    "meta-405b": {"model": "llama-405b", "tp": 8, "pp": 16, "micro": 1, "batch": 64, "max_gpus": 512},
    # local_batch_size 8 (one forward of 8 sequences, no accumulation) x FSDP 8 = 64 sequences on 64 GPUs.
    "torchtitan-70b": {"model": "llama-70b", "tp": 8, "pp": 1, "micro": 8, "batch": 64, "max_gpus": 64},
    # local batch 32 (32 pipeline microbatches of 1, torchtitan's default microbatch size) x FSDP 8 = 256.
    "torchtitan-405b": {"model": "llama-405b", "tp": 8, "pp": 8, "micro": 1, "batch": 256, "max_gpus": 512},
    # DeepSeek-V3: PP 16 x EP 64 on 2,048 GPUs (dp 128), seq 4096; 16,384 sequences a step (128 per
    # replica; DeepSeek ramped its batch to 15,360, which no whole round of 16 microbatches splits).
    "deepseek-v3": {
        "model": "deepseek-v3",
        "tp": 1,
        "pp": 16,
        "ep": 64,
        "micro": 1,
        "batch": 16384,
        "max_gpus": 2048,
        "seq_len": 4096,
    },
}
TT_BENCH = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
PUBLISHED = [
    {
        "name": "Meta Llama 3 405B, 8,192 GPUs",
        "source": 'Meta, "The Llama 3 Herd of Models", Table 4',
        "search": "meta-405b",
        "published": "8192 GPUs: tp8 cp1 pp16 dp64, seq 8192, 32 seqs per replica, 16M tokens per batch",
        "published_gpus": 8192,
        "gpus": 256,  # dp 2, the same 32 sequences per replica
        "schedule": None,
        "recompute": None,
        "published_mfu": 0.43,  # 430 TFLOPs per GPU, BF16
        "published_tokens_per_s_per_gpu": None,
        "published_peak_gib": None,
    },
    {
        "name": "Meta Llama 3 405B, 16,384 GPUs",
        "source": 'Meta, "The Llama 3 Herd of Models", Table 4',
        "search": "meta-405b",
        "published": "16384 GPUs: tp8 cp1 pp16 dp128, seq 8192, 16 seqs per replica, 16M tokens per batch",
        "published_gpus": 16384,
        "gpus": 512,  # dp 4, the same 16 sequences per replica
        "schedule": None,
        "recompute": None,
        "published_mfu": 0.41,  # 400 TFLOPs per GPU; the 38% in the paper is the CP 16, seq 131072 row
        "published_tokens_per_s_per_gpu": None,
        "published_peak_gib": None,
    },
    {
        "name": "torchtitan Llama 3 70B recipe",
        "source": "torchtitan train_configs/llama3_70b.toml",
        "search": "torchtitan-70b",
        "published": "64 GPUs: tp8 fsdp8 pp1, local batch 8, seq 8192, full AC, AdamW",
        "published_gpus": 64,
        "gpus": 64,
        "schedule": None,
        "recompute": "full",
        "published_mfu": None,  # unverified: torchtitan publishes no MFU or TPS for this recipe
        "published_tokens_per_s_per_gpu": None,
        "published_peak_gib": None,
    },
    {
        "name": "torchtitan Llama 3.1 405B, 1F1B",
        "source": f"{TT_BENCH}, Table 5",
        "search": "torchtitan-405b",
        "published": "512 GPUs: tp8 pp8 fsdp8, 1F1B, local batch 32, full AC (Float8, compile, AsyncTP)",
        "published_gpus": 512,
        "gpus": 512,
        "schedule": "1f1b",
        "recompute": "full",
        "published_mfu": None,  # not reported (Float8)
        "published_tokens_per_s_per_gpu": 100.0,
        "published_peak_gib": 82.5,
    },
    {
        "name": "torchtitan Llama 3.1 405B, interleaved 1F1B",
        "source": f"{TT_BENCH}, Table 5",
        "search": "torchtitan-405b",
        "published": "512 GPUs: tp8 pp8 fsdp8, Interleaved 1F1B, local batch 32, full AC (Float8, compile, AsyncTP)",
        "published_gpus": 512,
        "gpus": 512,
        "schedule": "interleaved-1f1b",
        "recompute": "full",
        "published_mfu": None,
        "published_tokens_per_s_per_gpu": 128.0,
        "published_peak_gib": 72.7,
    },
]

PUBLISHED.append(
    {
        "name": "DeepSeek-V3 (671B MoE) pre-training",
        "source": "DeepSeek-V3 Technical Report, sections 3.1-3.3 and Table 1",
        "search": "deepseek-v3",
        "published": "2048 H800s: pp16 ep64 (ZeRO-1 dp), DualPipe, seq 4096, FP8 matmuls, BF16 AdamW moments",
        "published_gpus": 2048,
        "gpus": 2048,
        "schedule": "1f1b",
        "recompute": None,
        "published_mfu": None,  # not reported
        # 180K H800 GPU-hours per trillion tokens (Table 1): 1e12 / (180e3 x 3600 s) tokens/s per GPU
        "published_tokens_per_s_per_gpu": 1e12 / (180e3 * 3600),
        "published_peak_gib": None,
    }
)

NOTES = {
    "meta": (
        "memplan's MFU is the traced step's FLOPs (attention counted without the causal mask) over the step it "
        "predicts; Meta runs a tuned interleaved 1F1B with asynchronous communication, memplan times plain 1F1B "
        "(16 microbatches a replica leave no whole interleaved round at pp 16) and prices tensor-parallel "
        "collectives fully exposed"
    ),
    "torchtitan-70b": (
        "the toml says it is a preset for 64 A100 GPUs; evaluated here on H100; published TPS/MFU: unverified "
        "(none published for this recipe); the loss runs on vocabulary-sharded logits (loss parallel, torchtitan's "
        "default and memplan's): at a local batch of 8 each rank's fp32 logits are 8 x 8192 x 16032 x 4 B = 3.9 GiB "
        "(31.3 GiB with --no-loss-parallel), and the loss backward sets the peak"
    ),
    "deepseek-v3": (
        "memplan times bf16 matmuls on H100 (DeepSeek: FP8 on H800, about twice the dense throughput), plain "
        "1F1B with the uniform split (DeepSeek's DualPipe runs two directions at once, hides the dispatch and "
        "combine all-to-alls under compute and balances its stages; torch's DualPipeV is simulated by memplan "
        "simulate --pp but not searched), fp32 AdamW moments (DeepSeek's are BF16) and FSDP2 (ZeRO-3) where "
        "DeepSeek shards only the optimizer; memplan's bubble is the schedule's own idle time at each stage's "
        "predicted F and B times"
    ),
    "torchtitan-405b": (
        "published on 96 GB HBM2e H100s at 500 W with Float8 matmuls, torch.compile and AsyncTP; memplan times bf16 "
        "on 80 GB H100s with exposed TP collectives; seq 8192 assumed (Table 5 does not state it; the 405B toml "
        "uses 8192); published memory is torch's reserved peak on a 96 GB GPU"
    ),
}
GAP = 0.2  # relative gap between predicted and published MFU or tokens/s that gets the note


def _config(batch_size: int = 1, pp: int = 1, seq_len: int = SEQ_LEN, **kw) -> TrainConfig:
    """The search's config: `batch_size` is the micro-batch; a pinned pp's microbatches are searched."""
    microbatches = 1 if pp > 1 else None
    return TrainConfig(
        batch_size=batch_size, seq_len=seq_len, precision="bf16-mixed", gpu=GPU, pp=pp, microbatches=microbatches, **kw
    )


def _spec(model: str, folder: Path) -> str:
    """A preset's name, or a transformers config written to `folder` (DeepSeek-V3 at its defaults)."""
    return _deepseek_config(folder) if model == "deepseek-v3" else model


def _budget() -> int:
    return usable_bytes(get_device(GPU).memory_bytes, RESERVE)


def _needs(x: Layout) -> str:
    parts = []
    if x.offload:
        parts.append(f"host offload ({gb(x.host_bytes)}/GPU on host)")
    if x.optimizer != "adamw":
        parts.append(x.optimizer)
    parts.append(f"recompute {x.recompute}")
    return ", ".join(parts)


def _layout(x: Layout | None) -> dict | None:
    if x is None:
        return None
    return {
        "gpus": x.gpus,
        "label": x.label,
        "tp": x.tp,
        "pp": x.pp,
        "dp": x.dp,
        "schedule": x.schedule,
        "microbatches": x.microbatches,
        "accumulation": x.accumulation,
        "stages_per_rank": x.stages_per_rank,
        "global_batch": x.global_batch,
        "optimizer": x.optimizer,
        "offload": x.offload,
        "recompute": x.recompute,
        "needs": _needs(x),
        "fits": x.fits,
        "peak_bytes": x.peak_bytes,
        "budget_bytes": x.budget_bytes,
        "host_bytes": x.host_bytes,
        "step_s": x.time.step_s,
        "time": x.time.to_dict(),
        "tokens_per_s_per_gpu": x.tokens_per_s_per_gpu,
        "tokens_per_s_job": x.tokens_per_s_per_gpu * x.gpus,
        "mfu": x.mfu,
        "flags": x.flags(),
    }


def _fastest(layouts) -> Layout | None:
    fitting = [x for x in layouts if x.fits]
    if fitting:
        return max(fitting, key=lambda x: x.tokens_per_s_per_gpu)
    return min(layouts, key=lambda x: x.peak_bytes) if layouts else None


def _search_rows(model: str, spec: str, max_gpus: int, budget: int) -> tuple[list[dict], object]:
    t0 = time.perf_counter()
    r = search_layouts(spec, _config(), max_gpus=max_gpus, budget_bytes=budget)
    wall = time.perf_counter() - t0
    rows = [
        {
            "table": "search",
            "model": model,
            "max_gpus": max_gpus,
            "gpus_searched": sorted({x.gpus for x in r.layouts}),
            "search_s": r.search_s,
            "wall_s": wall,
            "layouts": len(r.layouts),
            "fitting": sum(x.fits for x in r.layouts),
            "global_batch": r.config["global_batch"],
            "budget_bytes": budget,
            "recommended": _layout(r.recommended),
            "recipe": r.recipe,
            "why_none": r.why_none,
            "skipped_tp": {str(k): v for k, v in r.skipped.items()},
        }
    ]
    rows += [{"table": "pareto", "model": model, **_layout(x)} for x in r.pareto]
    return rows, r


def _claim_rows(r) -> list[dict]:
    rows = []
    for n in CLAIM_GPUS:
        best = _fastest([x for x in r.layouts if x.gpus == n and x.fits])
        rows.append({"table": "claim", "model": CLAIM_MODEL, "target_gpus": n, "layout": _layout(best)})
    return rows


def _gap(predicted: float | None, published: float | None) -> float | None:
    return predicted / published if predicted is not None and published else None


def _published_rows(opts: Options, budget: int, folder: Path) -> list[dict]:
    models = QUICK if opts.quick else [m for m, _ in MODELS]
    entries = [e for e in PUBLISHED if PINNED[e["search"]]["model"] in models]
    if opts.models:
        entries = [e for e in entries if PINNED[e["search"]]["model"] in opts.models]
    searches: dict[str, tuple[object, float]] = {}
    rows = []
    for e in entries:
        p = PINNED[e["search"]]
        tp, pp, ep, micro, batch = p["tp"], p["pp"], p.get("ep", 1), p["micro"], p["batch"]
        if e["search"] not in searches:
            t0 = time.perf_counter()
            r = search_layouts(
                _spec(p["model"], folder),
                _config(batch_size=micro, tp=tp, pp=pp, ep=ep, dp=ep, seq_len=p.get("seq_len", SEQ_LEN)),
                max_gpus=p["max_gpus"],
                budget_bytes=budget,
                global_batch=batch,
                allow_offload=False,
                allow_8bit=False,
            )
            searches[e["search"]] = (r, time.perf_counter() - t0)
        r, wall = searches[e["search"]]
        shape = [
            x
            for x in r.layouts
            if (x.gpus, x.tp, x.pp, x.ep) == (e["gpus"], tp, pp, ep)
            and (e["schedule"] is None or x.schedule == e["schedule"])
        ]
        dp = e["gpus"] // (tp * pp)
        exact = [
            x
            for x in shape
            if (e["recompute"] is None or x.recompute == e["recompute"])
            and x.accumulation == 1  # the whole replica's share in one pipeline step, as published
        ]
        chosen = _fastest(exact) or _fastest(shape)
        best = _fastest(shape)
        x = _layout(chosen)
        mfu_ratio = _gap(x and x["mfu"], e["published_mfu"])
        tps_ratio = _gap(x and x["tokens_per_s_per_gpu"], e["published_tokens_per_s_per_gpu"])
        note = []
        if x is None:
            note.append(f"memplan's search did not reach {e['gpus']} GPUs as tp{tp} pp{pp}")
        elif not exact:
            note.append("no simulated layout matches the published recompute and microbatches; memplan's nearest")
        gaps = [g for g in (mfu_ratio, tps_ratio) if g is not None and abs(g - 1) > GAP]
        key = "meta" if e["search"] == "meta-405b" else e["search"]
        layout_label = f"tp{tp} pp{pp} dp{dp}" + (f" ep{ep}" if ep > 1 else "")
        if gaps or key != "meta":
            note.append(NOTES[key])
        rows.append(
            {
                "table": "published",
                "name": e["name"],
                "source": e["source"],
                "published": e["published"],
                "published_gpus": e["published_gpus"],
                "evaluated_as": f"{e['gpus']} GPUs: {layout_label}, {batch // dp} seqs/replica, micro-batch {micro}",
                "seqs_per_replica": batch // dp,
                "micro_batch_size": micro,
                "global_batch": batch,
                "search_s": wall,
                "layout": x,
                "memplan_best_on_shape": _layout(best),
                "published_mfu": e["published_mfu"],
                "published_tokens_per_s_per_gpu": e["published_tokens_per_s_per_gpu"],
                "published_peak_gib": e["published_peak_gib"],
                "mfu_ratio": mfu_ratio,
                "tokens_ratio": tps_ratio,
                "note": "; ".join(note),
            }
        )
    return rows


def run(opts: Options) -> list[dict]:
    budget = _budget()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, max_gpus in opts.select(MODELS, QUICK):
            search_rows, r = _search_rows(model, _spec(model, Path(tmp)), max_gpus, budget)
            rows += search_rows
            if model == CLAIM_MODEL:
                rows += _claim_rows(r)
        rows += _published_rows(opts, budget, Path(tmp))
    return rows


def _tps(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _cells(x: dict) -> list[str]:
    """label, needs, step, tok/s/GPU, tok/s job, MFU, peak of a layout row."""
    return [
        x["label"],
        x["needs"],
        f"{x['step_s']:.1f} s",
        _tps(x["tokens_per_s_per_gpu"]),
        _tps(x["tokens_per_s_job"]),
        pct(x["mfu"]),
        gb(x["peak_bytes"]),
    ]


def show(rows: list[dict]) -> None:
    searches = [r for r in rows if r["table"] == "search"]
    if searches:
        budget = gb(searches[0]["budget_bytes"])
        print_table(
            f"layouts: whole-layout search ({GPU}, budget {budget}, batch 1 x seq {SEQ_LEN}, bf16-mixed)",
            [
                "model",
                "max GPUs",
                "search",
                "layouts",
                "fit",
                "GPUs",
                "recommended",
                "needs",
                "tok/s/GPU",
                "MFU",
                "peak",
            ],
            [
                [
                    r["model"],
                    r["max_gpus"],
                    f"{r['search_s']:.1f} s",
                    r["layouts"],
                    r["fitting"],
                    *(
                        [
                            x["gpus"],
                            x["label"],
                            x["needs"],
                            _tps(x["tokens_per_s_per_gpu"]),
                            pct(x["mfu"]),
                            gb(x["peak_bytes"]),
                        ]
                        if (x := r["recommended"])
                        else ["-", r["why_none"], "-", "-", "-", "-"]
                    ),
                ]
                for r in searches
            ],
        )
    pareto = [r for r in rows if r["table"] == "pareto"]
    if pareto:
        print_table(
            "layouts: Pareto front (fewest GPUs against the shortest step; global batch about 4M tokens)",
            ["model", "GPUs", "layout", "needs", "step", "tok/s/GPU", "tok/s job", "MFU", "peak"],
            [[r["model"], r["gpus"], *_cells(r)] for r in pareto],
        )
    claim = [r for r in rows if r["table"] == "claim"]
    if claim:
        print_table(
            f"layouts: {CLAIM_MODEL} on 8 vs 16 H100s (the fastest layout that fits on exactly that many)",
            ["GPUs", "layout", "needs", "step", "tok/s/GPU", "tok/s job", "MFU", "peak"],
            [[r["target_gpus"], *(_cells(x) if (x := r["layout"]) else ["no layout fits", *["-"] * 6])] for r in claim],
        )
    published = [r for r in rows if r["table"] == "published"]
    if published:
        print_table(
            "layouts: published layouts next to memplan's prediction (tp/pp pinned, AdamW, no offload)",
            [
                "published",
                "evaluated as",
                "memplan layout",
                "peak/GPU",
                "fits",
                "MFU pred",
                "MFU pub",
                "ratio",
                "tok/s/GPU pred",
                "pub",
                "ratio",
                "peak pub",
            ],
            [
                [
                    r["name"],
                    r["evaluated_as"],
                    *(
                        [f"{x['label']}, recompute {x['recompute']}", gb(x["peak_bytes"]), "yes" if x["fits"] else "no"]
                        if (x := r["layout"])
                        else ["-", "-", "-"]
                    ),
                    pct(x and x["mfu"]),
                    pct(r["published_mfu"], 0),
                    "-" if r["mfu_ratio"] is None else f"x{r['mfu_ratio']:.2f}",
                    _tps(x and x["tokens_per_s_per_gpu"]),
                    _tps(r["published_tokens_per_s_per_gpu"]),
                    "-" if r["tokens_ratio"] is None else f"x{r['tokens_ratio']:.2f}",
                    "-" if r["published_peak_gib"] is None else f"{r['published_peak_gib']} GiB",
                ]
                for r in published
            ],
        )
        for i, r in enumerate(published, 1):
            print(f"  [{i}] {r['name']} ({r['source']}; search {r['search_s']:.0f} s): {r['published']}")
            if r["note"]:
                print(f"      note: {r['note']}")


if __name__ == "__main__":
    standalone_main("layouts", __doc__, run, show)
