"""Context parallel (--cp): every rank's step traced on fake tensors inside torch's own
``context_parallel`` and ring attention. torch has no CPU kernel for it: the shapes and bytes are
checked against hand counts on fake tensors; the gloo tests run the same code on real ranks through
memplan's CPU route into torch's ring attention (numerics against full attention, measured peaks)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.nn.functional as F
from cli_helpers import assert_user_error, run

from planner.config import TrainConfig
from planner.plans.format import load_plan
from planner.simulation.layout import simulate_ranks
from planner.tracing.parallel.rank_trace import trace_tp_rank
from planner.tracing.recorder import trace

HERE = Path(__file__).parent
HF_LLAMA = f"hf:{HERE / 'data' / 'tiny_llama' / 'config.json'}"  # 4 query / 2 key-value heads, GQA in SDPA
HF_MIXTRAL = f"hf:{HERE / 'data' / 'tiny_mixtral' / 'config.json'}"
TITAN_MOE = f"{HERE / 'ep_models.py'}:titan_moe"
B, S, CP = 2, 128, 2
LAYERS, HEADS, HEAD_DIM, HIDDEN = 2, 4, 32, 128  # llama-7b-tiny
F32 = 4
SDPA = F.scaled_dot_product_attention


def _config(**layout) -> TrainConfig:
    return TrainConfig(batch_size=B, seq_len=S, gpu="cpu", **{"cp": CP, **layout})


def _collectives(graph) -> Counter:
    """(phase, collective, bytes of its output) -> how many ran."""
    out = Counter()
    for op in graph.ops:
        if op.name.startswith("_c10d_functional.") and op.allocs:
            kind = op.name.split(".")[1]
            out[(op.phase, kind, sum(graph.tensors[t].nbytes for t in op.allocs))] += 1
    return out


def _activation_bytes(graph) -> int:
    return sum(t.nbytes for t in graph.tensors.values() if t.category == "activation")


def test_each_cp_rank_saves_its_share_and_exchanges_kv_through_the_ring():
    local = S // CP
    kv_bytes = 2 * B * HEADS * local * HEAD_DIM * F32  # this rank's K and V, concatenated
    single = trace("llama-7b-tiny", batch_size=B, seq_len=local, lifetimes=False)
    ranks = [trace_tp_rank("llama-7b-tiny", _config(), rank=r, lifetimes=False)[0] for r in range(CP)]
    for graph in ranks:
        # ring attention as torch runs it: one all-gather of every rank's K/V per attention in forward
        # and again in backward; dK/dV rotate by all-to-all once per ring step (fp32 accumulators)
        assert _collectives(graph) == {
            ("forward", "all_gather_into_tensor", CP * kv_bytes): LAYERS,
            ("backward", "all_gather_into_tensor", CP * kv_bytes): LAYERS,
            ("backward", "all_to_all_single", kv_bytes): CP * LAYERS,
        }
        # every ring step's flash call sees the local queries (s/cp) or, load-balanced, half of them
        flash = [op for op in graph.ops if op.name == "aten._scaled_dot_product_flash_attention_for_cpu.default"]
        assert len(flash) == CP * LAYERS
        assert {graph.tensors[op.allocs[0]].shape for op in flash} <= {
            (B, HEADS, local, HEAD_DIM),
            (B, HEADS, local // 2, HEAD_DIM),
        }
        # the sharded inputs keep their full storage (context_parallel resizes them in place)
        inputs = [t for t in graph.tensors.values() if t.alloc_op < 0 and t.category == "activation"]
        assert inputs and all(t.shape == (B, local) and t.nbytes == B * S * 8 for t in inputs)
        assert len(inputs) == 2  # token ids (the embedding's backward) and labels (the loss's)
    input_growth = 2 * B * (S - local) * 8
    # the last cp rank saves what one rank saves at s/cp: q, k, v, out and logsumexp all local
    assert _activation_bytes(ranks[1]) == _activation_bytes(single) + input_growth
    # rank 0's second ring step updates half of the output (torch.cat): the merged output is then
    # contiguous (batch, heads, seq, dim), and o_proj's input becomes a copy saved in every layer
    assert _activation_bytes(ranks[0]) == _activation_bytes(ranks[1]) + LAYERS * B * local * HIDDEN * F32


def test_a_gpu_target_runs_torchs_own_ring_with_the_gpu_kernel():
    """On an H100 target the trace runs the CUDA flash op (planner/tracing/attention.py), which
    torch's own context_parallel handler sends around the ring; it saves what the CPU route saves."""
    saved, names = {}, {}
    for gpu in ("cpu", "h100-80gb"):
        config = TrainConfig(batch_size=2, seq_len=128, cp=2, gpu=gpu, precision="bf16-mixed")
        graph, _ = trace_tp_rank("llama-7b-tiny", config, rank=0, lifetimes=False)
        names[gpu] = {op.name for op in graph.ops if "scaled_dot_product" in op.name}
        saved[gpu] = sum(t.nbytes for t in graph.tensors.values() if t.saved and t.category == "activation")
    assert names["h100-80gb"] == {
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_flash_attention_backward.default",
    }
    assert all("for_cpu" in n for n in names["cpu"])
    assert saved["h100-80gb"] == saved["cpu"] > 0


def test_alltoall_rotation_permutes_kv_at_every_ring_step():
    graph = trace_tp_rank("llama-7b-tiny", _config(cp_rotate="alltoall"), rank=0, lifetimes=False)[0]
    kv_bytes = 2 * B * HEADS * (S // CP) * HEAD_DIM * F32
    collectives = _collectives(graph)
    assert collectives[("forward", "all_to_all_single", kv_bytes)] == (CP - 1) * LAYERS
    assert not any(kind == "all_gather_into_tensor" for _, kind, _ in collectives)
    assert F.scaled_dot_product_attention is SDPA  # context_parallel's patch (and memplan's guard) undone
    from memplan_compat import cp_options

    assert cp_options.rotate_method.name == "ALL_GATHER"  # torch's default is back
    assert not dist.is_initialized()


@pytest.mark.slow
def test_hf_llama_ring_exchanges_only_the_key_value_heads():
    local, kv_heads = S // CP, 2
    kv_bytes = 2 * B * kv_heads * local * HEAD_DIM * F32  # transformers calls SDPA with enable_gqa
    graph = trace_tp_rank(HF_LLAMA, _config(), rank=1, lifetimes=False)[0]
    assert _collectives(graph)[("forward", "all_gather_into_tensor", CP * kv_bytes)] == LAYERS
    single = trace(HF_LLAMA, batch_size=B, seq_len=local, lifetimes=False)
    saved_ids = B * (S - local) * 8  # the embedding saves the token ids, whose storage stays full
    assert _activation_bytes(graph) == _activation_bytes(single) + saved_ids


@pytest.mark.slow
def test_cp_with_tp_shards_heads_and_sequence():
    local = S // CP
    layout = simulate_ranks("llama-7b-tiny", _config(tp=2)).to_dict()
    assert [r["ranks"] for r in layout["ranks"]] == [[0, 1], [2, 3]]
    assert [r["coords"]["cp"] for r in layout["ranks"]] == [0, 1]
    graph = trace_tp_rank("llama-7b-tiny", _config(tp=2), rank=2, lifetimes=False)[0]
    kv_bytes = 2 * B * (HEADS // 2) * local * HEAD_DIM * F32
    assert _collectives(graph)[("forward", "all_gather_into_tensor", CP * kv_bytes)] == LAYERS
    norms = [graph.tensors[t].shape for op in graph.ops if op.module == "layers.0.attn_norm" for t in op.allocs]
    assert (B, local // 2, HIDDEN) in norms  # sequence parallel splits the cp-local sequence again


@pytest.mark.slow
def test_fsdp2_shards_over_dp_times_cp():
    from planner.api import simulate_model

    layout = simulate_ranks("llama-7b-tiny", _config(dp=2, zero_stage=3)).to_dict()
    assert [r["ranks"] for r in layout["ranks"]] == [[0, 2], [1, 3]]
    four = simulate_model("llama-7b-tiny", TrainConfig(batch_size=B, seq_len=S, dp=4, zero_stage=3)).to_dict()
    assert layout["model_states"] == four["model_states"]  # torchtitan's dp_shard_cp: 4 shards


@pytest.mark.slow
def test_cli_json_lists_every_cp_rank_and_names_the_worst(capsys, tmp_path):
    out = tmp_path / "cp.json"
    argv = ["simulate", "--gpu", "cpu", "--model", "llama-7b-tiny", "--batch-size", str(B), "--seq-len", str(S)]
    code, stdout, err = run([*argv, "--cp", "4", "--json", str(out)], capsys)
    assert code == 0, err
    result = json.loads(out.read_text())
    assert [r["ranks"] for r in result["ranks"]] == [[0], [1], [2], [3]]
    assert [r["coords"]["cp"] for r in result["ranks"]] == [0, 1, 2, 3]
    peaks = [r["peak_bytes"] for r in result["ranks"]]
    assert result["peak_bytes"] == max(peaks) and result["worst_rank"] == peaks.index(max(peaks))
    assert f"worst rank {result['worst_rank']}" in stdout
    assert result["layout"]["cp"] == 4 and result["layout"]["world_size"] == 4


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (
            ["simulate", "--model", "llama-7b-tiny", "--seq-len", "130", "--cp", "4"],
            ("does not split", "multiple of 8"),
        ),
        (["simulate", "--model", "mlp-tiny", "--seq-len", "16", "--cp", "2"], ("scaled_dot_product_attention",)),
        (["simulate", "--model", "kwargs-tiny", "--seq-len", "64", "--cp", "2"], ("no attn_mask", "is_causal=True")),
        (
            [
                "simulate",
                "--model",
                f"{HERE / 'models_for_tests.py'}:dropout_attention",
                "--seq-len",
                "64",
                "--cp",
                "2",
            ],
            ("no dropout", "dropout_p=0.1", "--gpu"),
        ),
        (  # bidirectional attention: torch's load balancing refuses it, on a GPU target's kernel too
            ["simulate", "--model", "bert-tiny", "--gpu", "h100-80gb", "--seq-len", "64", "--cp", "2"],
            ("needs causal attention", "drop --cp"),
        ),
        (  # fp32 on a GPU target: efficient attention, whose logsumexp is padded to 32 rows
            ["simulate", "--model", "llama-7b-tiny", "--gpu", "h100-80gb", "--seq-len", "128", "--cp", "4"],
            ("efficient-attention", "multiple of 64 x --cp", "bf16-mixed"),
        ),
        (
            [
                "plan",
                "--model",
                "llama-7b-tiny",
                "--seq-len",
                "64",
                "--cp",
                "2",
                "--compile",
                "--budget",
                "1GB",
                "--out",
                "unused.json",
            ],
            ("--compile",),
        ),
    ],
)
def test_cp_errors_are_one_line(capsys, argv, needles):
    code, _, err = run([argv[0], "--gpu", "cpu", *argv[1:]], capsys)
    assert_user_error(code, err, argv[0], *needles)
    assert not dist.is_initialized()


def test_expert_parallel_borrows_the_cp_ranks():
    """--ep 4 over --dp 2 --cp 2: EP index (dp · cp + cp index) mod ep, so each cp index holds two EP
    indices; under balanced routing those run alike, and each cp index is one role."""
    config = _config(ep=4, dp=2, zero_stage=3)
    from planner.simulation.ranks import mesh_coords

    assert {c.rank: (c.cp, c.ep) for c in mesh_coords(config)} == {0: (0, 0), 1: (1, 1), 2: (0, 2), 3: (1, 3)}
    layout = simulate_ranks(TITAN_MOE, config)
    assert [role.ranks for role in layout.roles] == [(0, 2), (1, 3)]


def test_pipeline_stages_under_context_parallel():
    """--pp 2 --cp 2 --dp 2 --zero 3: each stage is cut from every cp index's trace (a role per (pp
    rank, cp index)); FSDP2 shards over dp × cp, so each rank holds the states of 4-way data
    parallel, and each cp rank keeps about half the activations of a whole sequence."""
    from planner.api import simulate_pipeline_model

    base = {"batch_size": 4, "seq_len": 64, "pp": 2, "microbatches": 2, "zero_stage": 3, "gpu": "cpu"}
    cp = simulate_pipeline_model("llama-7b-tiny", TrainConfig(**base, dp=2, cp=2)).layout
    dp = simulate_pipeline_model("llama-7b-tiny", TrainConfig(**base, dp=4)).layout
    assert [(r.coords.pp, r.coords.cp) for r in cp.roles] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r.ranks for r in cp.roles] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    for role in cp.roles:
        whole = dp.roles[role.coords.pp].timeline
        assert role.timeline.model_states == whole.model_states
        activations = role.timeline.breakdown_at_peak["activation"]
        assert 0.3 < activations / whole.breakdown_at_peak["activation"] < 0.7
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------- gloo ranks
# torch has no CPU kernel for context_parallel; memplan's one DTensor handler routes the CPU flash op
# into torch's own ring functions, so the same code the trace records runs on real gloo ranks too.


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
def test_ring_attention_on_gloo_ranks_matches_full_attention(rotate):
    from cp_ranks import S, ring_attention_errors

    results = ring_attention_errors(2, rotate)
    assert [r[0] for r in results] == [0, 1]
    for _, error, forward, backward, _ in results:
        assert error < 1e-5 and forward == 1 and backward == 1
    # head-tail load balancing: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (of S/4 each)
    quarter = S // 4
    assert results[0][4] == list(range(quarter)) + list(range(3 * quarter, S))
    assert results[1][4] == list(range(quarter, 3 * quarter))


GLOO_CASES = {
    "cp2": ("llama-7b-tiny", {}),
    "cp2-hf": (HF_LLAMA, {}),
    "cp2xtp2": ("llama-7b-tiny", {"tp": 2}),
    "cp2xfsdp2": ("llama-7b-tiny", {"dp": 2, "zero_stage": 3}),
    "cp2xfsdp2-bf16": ("llama-7b-tiny", {"dp": 2, "zero_stage": 3, "precision": "bf16-mixed"}),
    "cp4-alltoall": ("llama-7b-tiny", {"cp": 4, "cp_rotate": "alltoall"}),
    # expert parallel borrows the cp ranks (torchtitan): a role per (cp index, EP index), and per TP
    # index where transformers keeps each TP rank's experts whole
    "cp2xep2-hf": (HF_MIXTRAL, {"ep": 2}),
    "cp2xtp2xep2-hf": (HF_MIXTRAL, {"ep": 2, "tp": 2}),
    "cp2xep2xfsdp2-titan": (TITAN_MOE, {"ep": 2, "dp": 2, "zero_stage": 3, "moe_imbalance": 2.0}),
}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", list(GLOO_CASES))
def test_per_rank_peak_matches_gloo_ranks(case):
    """Every rank's predicted peak within 1% of its measured one (memplan verify --cp)."""
    from planner.api import verify_layout

    spec, layout = GLOO_CASES[case]
    result = verify_layout(spec, _config(**layout))
    assert max(abs(e) for e in result.errors) <= 0.01, (result.predicted_bytes, result.measured_bytes)


@pytest.mark.distributed
@pytest.mark.slow
def test_plan_for_the_worst_cp_rank_holds_on_every_gloo_rank():
    from planner.api import plan_model, verify_layout

    config = _config()
    budget = int(0.95 * simulate_ranks("llama-7b-tiny", config).peak_bytes)
    plan, _, _ = plan_model("llama-7b-tiny", config, budget, time_limit_s=5.0)
    # whole modules only: an op key would name different ring ops on different cp ranks
    assert plan.decisions and all(d.op is None for d in plan.decisions)
    result = verify_layout("llama-7b-tiny", config, plan)
    assert all(m <= budget * 1.01 for m in result.measured_bytes), (result.measured_bytes, budget)
    assert max(abs(e) for e in result.errors) <= 0.01


@pytest.mark.slow
def test_seq_len_sweep_simulates_every_cp_rank(capsys):
    argv = ["simulate", "--gpu", "cpu", "--model", "llama-7b-tiny", "--batch-size", str(B), "--cp", str(CP)]
    code, stdout, err = run([*argv, "--seq-len", f"64,{S}"], capsys)
    assert code == 0, err
    swept = simulate_ranks("llama-7b-tiny", _config()).peak_bytes
    from planner.units import format_bytes

    assert format_bytes(swept) in stdout.splitlines()[3]  # the row of --seq-len S: the worst cp rank's peak


def test_ring_exchanges_are_priced_on_the_cp_link_and_hidden_by_the_local_attention():
    """Each traced collective is priced over the group it ran on (cp ranks are tp apart in the
    [dp, cp, tp] mesh), and costs only what the compute before its output's first use leaves
    exposed: the ring's K/V exchange overlaps attention to the local chunk."""
    from costmodels.hardware import get_device
    from planner.simulation.costs import collective_s, op_times

    config = TrainConfig(batch_size=1, seq_len=2048, cp=2, tp=2, gpu="h100-80gb", precision="bf16-mixed")
    graph = trace_tp_rank("llama-7b-tiny", config, rank=0)[0]
    assert sorted(graph.meta["groups"].values()) == [(2, 1), (2, 2)]  # tp: adjacent ranks; cp: 2 apart
    device = get_device(config.gpu)
    times = op_times(graph, device)
    cp_group = next(name for name, (_, stride) in graph.meta["groups"].items() if stride == 2)
    ring = [o for o in graph.ops if o.name.startswith("_c10d") and f"group_name={cp_group}" in o.variant]
    assert ring and all(0 <= times[o.index] <= collective_s(o, graph, device) for o in ring)
    assert sum(times[o.index] for o in ring) < 0.5 * sum(collective_s(o, graph, device) for o in ring)


@pytest.mark.slow  # 11 s; tests/test_layouts.py covers the search in the fast tier
def test_fit_searches_context_parallel_layouts(capsys, tmp_path):
    """`fit --cp 2` searches layouts with context parallel 2: FSDP2 over dp × cp, the recipe and the
    flags say cp, and the flags simulate to the layout's peak."""
    out = tmp_path / "fit.json"
    argv = ["fit", "--model", "llama-7b-tiny", "--gpu", "h100-80gb", "--precision", "bf16-mixed", "--seq-len", "256"]
    code, _, err = run([*argv, "--cp", "2", "--max-gpus", "4", "--json", str(out)], capsys)
    assert code == 0, err
    result = json.loads(out.read_text())
    best = result["recommended"]
    assert best["cp"] == 2 and all(x["cp"] == 2 for x in result["layouts"])
    assert "--cp 2" in best["flags"] and "context_parallel_degree = 2" in result["recipe"]["torchtitan_toml"]
    sim = tmp_path / "sim.json"
    flags = best["flags"].split()
    code, _, err = run(["simulate", *argv[1:], *flags, "--json", str(sim)], capsys)
    assert code == 0, err
    assert json.loads(sim.read_text())["peak_bytes"] == best["peak_bytes"]


@pytest.mark.slow  # 6 s; the fast tier covers pinned searches
def test_fit_searches_expert_parallel_with_pinned_context_parallel(capsys, tmp_path):
    """`fit --ep 2 --cp 2`: every layout has both (EP borrowing the dp × cp ranks), and the flags of
    the recommended one simulate to its peak."""
    out = tmp_path / "fit.json"
    argv = ["fit", "--model", HF_MIXTRAL, "--gpu", "h100-80gb", "--seq-len", "512"]
    code, _, err = run([*argv, "--ep", "2", "--cp", "2", "--max-gpus", "4", "--json", str(out)], capsys)
    assert code == 0, err
    result = json.loads(out.read_text())
    assert result["layouts"] and all(x["cp"] == 2 and x["ep"] == 2 for x in result["layouts"])
    best = result["recommended"]
    sim = tmp_path / "sim.json"
    code, _, err = run(["simulate", *argv[1:], *best["flags"].split(), "--json", str(sim)], capsys)
    assert code == 0, err
    assert max(r["peak_bytes"] for r in json.loads(sim.read_text())["ranks"]) == best["peak_bytes"]


@pytest.mark.slow
def test_fit_searches_context_parallel_inside_pipelines(capsys, tmp_path):
    """`fit --cp 2 --pp 2`: context parallel stages, FSDP2 over dp × cp; the flags of the heaviest
    layout simulate every rank to its peak, to the byte."""
    from planner.analysis.layouts import search_layouts

    config = TrainConfig(batch_size=1, seq_len=256, precision="bf16-mixed", gpu="h100-80gb", cp=2, pp=2, microbatches=1)
    found = search_layouts("llama-70b-tiny", config, max_gpus=16, budget_bytes=2**30, global_batch=16)
    assert found.layouts and all(x.cp == 2 and x.pp == 2 for x in found.layouts)
    x = max(found.layouts, key=lambda x: x.peak_bytes)
    out = tmp_path / "rank.json"
    argv = ["simulate", "--model", "llama-70b-tiny", "--seq-len", "256", "--precision", "bf16-mixed"]
    code, _, err = run([*argv, "--gpu", "h100-80gb", *x.flags().split(), "--json", str(out)], capsys)
    assert code == 0, err
    assert json.loads(out.read_text())["peak_bytes"] == x.peak_bytes, x.flags()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "spec, layout",
    [("llama-7b-tiny", {}), (HF_LLAMA, {"zero_stage": 3}), (HF_MIXTRAL, {"ep": 2})],
    ids=["cp2", "cp2-fsdp2-hf", "cp2xep2-hf-mixtral"],
)
def test_auto_checkpoint_under_context_parallel_installs_the_plan_on_every_gloo_rank(spec, layout):
    """auto_checkpoint(..., cp_mesh=) on each rank: the decisions `memplan plan --cp 2` makes, every
    rank within 1% of its prediction and of the budget, gradients as without the plan; following
    the step's sequence length, not the shard's the model sees."""
    from cp_ranks import auto_checkpoint_on_cp_ranks

    from planner.api import plan_model

    config = _config(**layout)
    budget = int(0.95 * simulate_ranks(spec, config).peak_bytes)
    want, _, _ = plan_model(spec, config, budget, time_limit_s=5.0)
    predicted = {r: role.peak_bytes for role in simulate_ranks(spec, config, want).roles for r in role.ranks}
    results = auto_checkpoint_on_cp_ranks(spec, config, budget)
    assert want.decisions and [r[0] for r in results] == [0, 1]
    for rank, peak, grad_error, plan, seen_len in results:
        assert load_plan(plan).decisions == want.decisions and seen_len == S, (rank, seen_len)
        assert abs(peak - predicted[rank]) <= 0.01 * peak, (rank, peak, predicted[rank])
        assert peak <= budget * 1.01, (rank, peak, budget)
        assert grad_error == 0.0, (rank, grad_error)
