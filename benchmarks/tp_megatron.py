"""llama-70b under tensor parallel against Megatron's closed-form activation memory.

llama-70b, seq 8192, batch 1, bf16-mixed, h100-80gb, 64 GPUs as TP t x FSDP2 64/t, t = 1, 2, 4, 8,
with and without sequence parallel. Each row is memplan's worst rank (one per-rank trace on fake
tensors): its peak by category, and the activation bytes one decoder layer saves for backward
(tensors allocated in that layer's forward and saved by autograd) next to Megatron's per-layer
estimate (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
2022, eq. 2-4): sbh·(10 + 24/t) without SP and sbh·34/t with SP, both without the 5as²/(ht) term
of the attention scores, which flash attention (what SDPA runs on H100, and what memplan traces)
never saves (Megatron's "selective recompute" form). The formula is for a GPT layer (4h GeLU MLP,
LayerNorm, dropout masks, multi-head attention); a Llama layer differs, and `layer_saved` lists
what one layer saves tensor by tensor so each difference can be read off.
"""

from __future__ import annotations

from collections import Counter

from benchmarks.common import Options, gb, pct, print_table, standalone_main
from planner.config import TrainConfig
from planner.simulation.layout import layout_timeline, trace_roles
from planner.tracing.graph import OpGraph

SPEC = "llama-70b"
SEQ, BATCH, GPUS = 8192, 1, 64
HIDDEN = 8192
TP_DEGREES = (1, 2, 4, 8)


def megatron_layer_bytes(tp: int, sequence_parallel: bool) -> int:
    """Megatron's activation bytes per layer without the attention-score term (flash attention)."""
    sbh = SEQ * BATCH * HIDDEN
    return round(sbh * 34 / tp) if sequence_parallel else round(sbh * (10 + 24 / tp))


def layer_saved(graph: OpGraph, layer: int = 1) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(op, shape, dtype, bytes) of each storage that decoder layer `layer` allocates in its forward
    and autograd saves for backward."""
    region = graph.regions[layer]
    return [
        (graph.ops[t.alloc_op].name, t.shape, t.dtype, t.nbytes)
        for t in graph.tensors.values()
        if t.saved and region.fwd_start <= t.alloc_op < region.fwd_end and t.category == "activation"
    ]


def _row(tp: int, sequence_parallel: bool) -> dict:
    config = TrainConfig(
        batch_size=BATCH,
        seq_len=SEQ,
        precision="bf16-mixed",
        gpu="h100-80gb",
        zero_stage=3,
        dp=GPUS // tp,
        tp=tp,
        sequence_parallel=sequence_parallel,
    )
    keys, graphs = trace_roles(SPEC, config, lifetimes=False)
    worst = layout_timeline(SPEC, config, keys, graphs).worst
    graph = graphs[keys[worst.coords.tp]]
    saved = layer_saved(graph)
    per_layer = sum(b for *_, b in saved)
    formula = megatron_layer_bytes(tp, sequence_parallel)
    return {
        "tp": tp,
        "sp": sequence_parallel,
        "peak_bytes": worst.peak_bytes,
        "breakdown_at_peak": dict(worst.timeline.breakdown_at_peak),
        "layer_saved_bytes": per_layer,
        "megatron_layer_bytes": formula,
        "gap": per_layer / formula - 1,
        "layer_saved": [list(s) for s in saved],
        "layers": len(graph.regions),
    }


def run(opts: Options) -> list[dict]:
    degrees = (1, 8) if opts.quick else TP_DEGREES
    return [_row(tp, sp) for sp in (True, False) for tp in degrees if not (tp == 1 and not sp)]


def show(rows: list[dict]) -> None:
    headers = ["tp", "SP", "peak", "params", "grads", "optim", "activ", "temp", "layer saves", "Megatron", "gap"]
    body = []
    for r in rows:
        b = r["breakdown_at_peak"]
        body.append(
            [r["tp"], "on" if r["sp"] else "off", gb(r["peak_bytes"]), gb(b["parameter"]), gb(b["gradient"])]
            + [gb(b["optimizer"]), gb(b["activation"]), gb(b["temporary"])]
            + [gb(r["layer_saved_bytes"]), gb(r["megatron_layer_bytes"]), pct(r["gap"])]
        )
    print_table(
        f"{SPEC}, seq {SEQ}, bf16-mixed, TP t x FSDP2 {GPUS}/t: worst rank, one layer's saved activations",
        headers,
        body,
    )
    for r in rows:
        if r["tp"] in (1, 8):
            counts = Counter((op, tuple(shape), dtype, b) for op, shape, dtype, b in r["layer_saved"])
            lines = [
                [op, "x".join(map(str, shape)), dtype, gb(b), n]
                for (op, shape, dtype, b), n in sorted(counts.items(), key=lambda kv: -kv[0][3] * kv[1])
            ]
            sp = "on" if r["sp"] else "off"
            print_table(
                f"what one layer saves at tp {r['tp']}, SP {sp}", ["op", "shape", "dtype", "bytes", "count"], lines
            )


if __name__ == "__main__":
    standalone_main("tp_megatron", __doc__, run, show)
