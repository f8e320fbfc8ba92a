"""Tensor parallel (+ sequence parallel) and TP × FSDP2: per-rank traces on fake tensors under a
fake process group, and the same layouts measured on CPU gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from cli_helpers import assert_user_error, run
from tp_ranks import run_on_ranks

from planner.config import TrainConfig
from planner.errors import SpecError
from planner.simulation.layout import simulate_ranks
from planner.tracing.recorder import trace
from planner.tracing.specs import resolve_spec

HERE = Path(__file__).parent
TITAN = f"{HERE / 'tp_models.py'}:titan_small"
TITAN_UNEVEN = f"{HERE / 'tp_models.py'}:titan_uneven_vocab"
HF_LLAMA = f"hf:{HERE / 'data' / 'tiny_llama' / 'config.json'}"
HF_LLAMA_TIED = f"hf:{HERE / 'data' / 'tiny_llama_tied' / 'config.json'}"  # lm_head.weight is embed_tokens.weight
SPECS = {"titan": TITAN, "hf-llama": HF_LLAMA, "memplan-llama": "llama-7b-tiny", "memplan-gpt2": "gpt2-tiny"}
TOLERANCE = 0.01  # the issue asks for 3% and aims at 1%


def _config(**layout) -> TrainConfig:
    return TrainConfig(batch_size=2, seq_len=128, gpu="cpu", **layout)


def test_tp_shards_model_states_and_lists_every_rank():
    single = simulate_ranks("llama-7b-tiny", _config(tp=2)).to_dict()
    assert [r["ranks"] for r in single["ranks"]] == [[0, 1]]
    assert single["layout"]["world_size"] == 2 and single["worst_rank"] == 0
    from planner.api import simulate_model

    plain = simulate_model("llama-7b-tiny", _config()).to_dict()
    # parameters halve except the replicated norms (5 × hidden 128 fp32)
    norms = 5 * 128 * 4
    assert single["model_states"]["parameter"] == (plain["model_states"]["parameter"] - norms) // 2 + norms
    assert single["peak_bytes"] < plain["peak_bytes"]
    assert not dist.is_initialized()  # the fake process group is gone


@pytest.mark.fresh_trace
def test_fake_process_group_does_not_leak_into_later_traces():
    before = trace("llama-7b-tiny", batch_size=2, seq_len=64)
    simulate_ranks("llama-7b-tiny", TrainConfig(batch_size=2, seq_len=64, tp=2))
    after = trace("llama-7b-tiny", batch_size=2, seq_len=64)
    assert len(before.ops) == len(after.ops)
    assert sum(t.nbytes for t in before.tensors.values()) == sum(t.nbytes for t in after.tensors.values())


def test_sequence_parallel_gathers_and_scatters_and_no_sp_all_reduces():
    from planner.tracing.parallel.rank_trace import trace_tp_rank

    sp, _ = trace_tp_rank("llama-7b-tiny", _config(tp=2), 0, lifetimes=False)
    no_sp, _ = trace_tp_rank("llama-7b-tiny", _config(tp=2, sequence_parallel=False), 0, lifetimes=False)
    names = {op.name for op in sp.ops}
    assert "_c10d_functional.all_gather_into_tensor.default" in names
    assert "_c10d_functional.reduce_scatter_tensor.default" in names
    assert "_c10d_functional.all_reduce.default" in {op.name for op in no_sp.ops}
    assert (
        simulate_ranks("llama-7b-tiny", _config(tp=2)).peak_bytes
        < simulate_ranks("llama-7b-tiny", _config(tp=2, sequence_parallel=False)).peak_bytes
    )


def _float_logit_shapes(config: TrainConfig, tokens: int) -> set[tuple[int, ...]]:
    """Shapes of the fp32 (tokens, vocabulary-wide) tensors of the trace: the loss's logits."""
    from planner.tracing.parallel.rank_trace import trace_tp_rank

    graph, _ = trace_tp_rank("llama-7b-tiny", config, 0, lifetimes=False)
    return {
        t.shape
        for t in graph.tensors.values()
        if t.dtype == "float32" and t.shape[:1] == (tokens,) and len(t.shape) == 2
    }


def test_loss_parallel_keeps_logits_sharded_and_no_loss_parallel_gathers_them():
    """torchtitan's default: the head's logits stay sharded over the vocabulary and the log-softmax
    runs on each rank's shard; --no-loss-parallel gathers the whole vocabulary on every rank."""
    vocab = resolve_spec("llama-7b-tiny").build(1, 8)[0].lm_head.out_features
    tokens = 2 * 128
    assert (tokens, vocab // 2) in _float_logit_shapes(_config(tp=2), tokens)
    assert (tokens, vocab) not in _float_logit_shapes(_config(tp=2), tokens)
    assert (tokens, vocab) in _float_logit_shapes(_config(tp=2, loss_parallel=False), tokens)
    assert (
        simulate_ranks("llama-7b-tiny", _config(tp=2)).peak_bytes
        < simulate_ranks("llama-7b-tiny", _config(tp=2, loss_parallel=False)).peak_bytes
    )


def test_tied_embeddings_are_sharded_once_and_stay_tied():
    """transformers' plan shards embed_tokens.weight and lm_head.weight, one tensor when tied: it is
    sharded once (both split the vocabulary) and the head tied again to the shard."""
    untied = simulate_ranks(HF_LLAMA, _config(tp=2)).roles[0].timeline.model_states
    tied = simulate_ranks(HF_LLAMA_TIED, _config(tp=2)).roles[0].timeline.model_states
    whole = simulate_ranks(HF_LLAMA_TIED, _config()).roles[0].timeline.model_states
    head_bytes = 512 * 128 * 4 // 2  # the vocabulary x hidden head, half of it per rank
    assert tied["parameter"] == untied["parameter"] - head_bytes
    norms_bytes = 5 * 128 * 4  # two per layer and the final one, replicated on both ranks
    assert 2 * tied["parameter"] == whole["parameter"] + norms_bytes


@pytest.mark.parametrize("name", ["opt", "gpt_neo", "gpt2"])
def test_memplan_plan_keeps_a_tied_head_one_tensor(name):
    """memplan's plan shards the embedding rowwise and the head colwise (both split the vocabulary);
    where they are one tensor, the head is tied again to the embedding's shard, and a rank holds the
    vocabulary table once."""
    import torch

    from planner.tracing.parallel.rank_trace import fake_process_group
    from planner.tracing.parallel.tp_plans import resolve_tp_plan

    model, _ = resolve_spec(_other_layout(name)).build(batch_size=2, seq_len=32)
    embedding = model.get_input_embeddings()
    assert model.get_output_embeddings().weight is embedding.weight
    with fake_process_group(0, 2):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        resolve_tp_plan("auto", sequence_parallel=False)(model, mesh)
        assert model.get_output_embeddings().weight is embedding.weight
        assert embedding.weight.to_local().shape[0] == embedding.num_embeddings // 2


def test_a_tie_the_plan_cannot_shard_alike_stays_whole_and_refuses_sequence_parallel():
    """The token embeddings tied to the head and to a third module the plan does not shard: all three
    stay whole, one tensor, and sequence parallel (which shards the embedding's output) is refused."""
    import torch
    from tp_models import titan_small

    from planner.tracing.parallel.rank_trace import fake_process_group
    from planner.tracing.parallel.tp_plans import resolve_tp_plan

    for sequence_parallel in (False, True):
        model, _ = titan_small(2, 16)
        model.output.weight = model.tok_embeddings.weight
        model.reader = torch.nn.Linear(128, 512, bias=False)
        model.reader.weight = model.tok_embeddings.weight
        with fake_process_group(0, 2):
            mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
            plan = resolve_tp_plan("auto", sequence_parallel=sequence_parallel)
            if sequence_parallel:
                with pytest.raises(SpecError, match="tied to output.weight, reader.weight.*--no-sp"):
                    plan(model, mesh)
                continue
            plan(model, mesh)
            assert model.output.weight is model.tok_embeddings.weight is model.reader.weight
            assert not hasattr(model.tok_embeddings.weight, "placements")
            assert model.layers[0].attention.wq.weight.to_local().shape[0] == 64


def test_a_fused_projection_is_recognised_only_where_its_layout_is_known():
    """GPT-BigCode's c_attn without multi-query is as wide as GPT-2's, but interleaves q, k and v per
    head: it is sharded in its own order (whole heads per contiguous shard), GPT-2's per section.
    The same projection in an attention memplan does not know is not recognised: the shape cannot
    tell the layouts apart."""
    from torch import nn
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    from planner.tracing.parallel.tp_plans import decoder_blocks

    config = GPTBigCodeConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=128, multi_query=False)
    model = GPTBigCodeForCausalLM(config)
    assert model.transformer.h[0].attn.c_attn.out_features == 3 * 64
    assert [b.qkv_sections for b in decoder_blocks(model)] == [1, 1]
    gpt2, _ = resolve_spec(_other_layout("gpt2")).build(batch_size=2, seq_len=32)
    assert [b.qkv_sections for b in decoder_blocks(gpt2)] == [3, 3]

    class UnknownAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn, self.c_proj = nn.Linear(64, 192), nn.Linear(64, 64)

    for block in model.transformer.h:
        block.attn = UnknownAttention()
    assert decoder_blocks(model) == []


def test_multi_query_and_alibi_in_the_mask_are_refused_in_one_line(capsys, tmp_path):
    """GPT-BigCode's multi-query c_attn holds one key-value head (a --tp above 1 cannot split it), and
    Falcon-RW adds its ALiBi biases through the mask, which the plan does not cut per rank."""
    from transformers import FalconConfig, GPTBigCodeConfig

    for name, config in {
        "mqa": GPTBigCodeConfig(n_layer=1, n_embd=64, n_head=4, vocab_size=128, multi_query=True),
        "alibi": FalconConfig(
            hidden_size=64, num_attention_heads=4, num_hidden_layers=1, vocab_size=128, alibi=True, multi_query=False
        ),
    }.items():
        (tmp_path / name).mkdir()
        config.to_json_file(tmp_path / name / "config.json")
    argv = ["simulate", "--gpu", "cpu", "--seq-len", "32", "--tp", "2", "--no-sp", "--model"]
    code, _, err = run([*argv, f"hf:{tmp_path / 'mqa' / 'config.json'}"], capsys)
    assert_user_error(code, err, "simulate", "does not divide the 1 key-value heads")
    code, _, err = run([*argv, f"hf:{tmp_path / 'alibi' / 'config.json'}"], capsys)
    assert_user_error(code, err, "simulate", "ALiBi biases through its attention mask")


def test_fused_qkv_rows_are_sharded_per_section():
    """A fused [q | k | v] projection's rows reordered rank-major: chunk r holds the r-th share of
    q, then of k, then of v, so each rank computes whole heads of all three."""
    from planner.tracing.parallel.projection_styles import rank_major_order

    assert rank_major_order(12, 3, 2).tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    assert rank_major_order(6, 3, 1).tolist() == list(range(6))


def test_gpt2_under_sequence_parallel_cuts_its_positions_to_the_sequence_share():
    """memplan's GPT-2 (fused q/k/v, learned positions, a tied head) under TP 2 with sequence
    parallel: every parameter halves except the replicated norms, biases of row-parallel projections
    and position table; the position rows a rank adds are its half of the sequence."""
    from planner.api import simulate_model
    from planner.tracing.parallel.rank_trace import trace_tp_rank

    config = _config(tp=2).with_(seq_len=64)
    whole = simulate_model("gpt2-tiny", config.with_(tp=1)).model_states["parameter"]
    sharded = simulate_ranks("gpt2-tiny", config).roles[0].timeline.model_states["parameter"]
    embed, layers, positions = 64, 2, 128
    replicated = 4 * (layers * (4 * embed + 2 * embed) + 2 * embed + positions * embed)
    assert sharded == (whole - replicated) // 2 + replicated
    graph, _ = trace_tp_rank("gpt2-tiny", config, 0, lifetimes=False)
    assert (32, embed) in {t.shape for t in graph.tensors.values()}


def test_uneven_vocab_makes_two_roles():
    layout = simulate_ranks(TITAN_UNEVEN, _config(tp=2)).to_dict()
    assert [r["ranks"] for r in layout["ranks"]] == [[0], [1]]
    assert layout["peak_bytes"] == max(r["peak_bytes"] for r in layout["ranks"])


def test_tp_inside_fsdp2_is_one_role_over_all_ranks():
    layout = simulate_ranks(TITAN, _config(tp=2, dp=2, zero_stage=3)).to_dict()
    assert [r["ranks"] for r in layout["ranks"]] == [[0, 1, 2, 3]]
    assert layout["peak_bytes"] < simulate_ranks(TITAN, _config(tp=2)).peak_bytes


def test_user_plan_function(tmp_path):
    plan_file = tmp_path / "plan.py"
    plan_file.write_text(
        "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module\n"
        "def plan(model, tp_mesh):\n"
        "    for block in model.layers:\n"
        "        parallelize_module(block.feed_forward, tp_mesh, {'w1': ColwiseParallel(), 'w3': ColwiseParallel(),"
        " 'w2': RowwiseParallel()})\n"
    )
    mlp_only = simulate_ranks(TITAN, _config(tp=2, tp_plan=f"{plan_file}:plan"))
    auto = simulate_ranks(TITAN, _config(tp=2))
    from planner.api import simulate_model

    assert auto.peak_bytes < mlp_only.peak_bytes < simulate_model(TITAN, _config()).peak_bytes


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--model", "llama-7b-tiny", "--tp", "3"], ("--tp 3 does not divide the 4 attention heads", "--tp 2")),
        (["--model", "mlp-tiny", "--tp", "2"], ("found no decoder blocks", "--tp-plan PATH.py:FUNC")),
        (["--model", HF_LLAMA, "--tp", "4"], ("2 key-value heads",)),
    ],
)
def test_layout_errors_are_one_line(capsys, argv, needles):
    code, _, err = run(["simulate", "--gpu", "cpu", "--seq-len", "64", *argv], capsys)
    assert_user_error(code, err, "simulate", *needles)


def test_plan_function_that_raises_is_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def plan(model, tp_mesh):\n    raise RuntimeError('boom')\n")
    code, _, err = run(
        [
            "simulate",
            "--gpu",
            "cpu",
            "--seq-len",
            "64",
            "--model",
            "llama-7b-tiny",
            "--tp",
            "2",
            "--tp-plan",
            f"{bad}:plan",
        ],
        capsys,
    )
    assert_user_error(code, err, "simulate", "raised RuntimeError: boom")
    assert not dist.is_initialized()
    with pytest.raises(SpecError, match="has no function 'nope'"):
        simulate_ranks("llama-7b-tiny", _config(tp=2, tp_plan=f"{bad}:nope"))


def test_cli_json_has_ranks(capsys, tmp_path):
    out = tmp_path / "tp.json"
    code, stdout, _ = run(
        [
            "simulate",
            "--gpu",
            "cpu",
            "--batch-size",
            "2",
            "--seq-len",
            "64",
            "--model",
            TITAN_UNEVEN,
            "--tp",
            "2",
            "--json",
            str(out),
        ],
        capsys,
    )
    assert code == 0
    import json

    result = json.loads(out.read_text())
    assert {tuple(r["ranks"]) for r in result["ranks"]} == {(0,), (1,)}
    assert f"worst rank {result['worst_rank']}" in stdout
    for role in result["ranks"]:
        assert set(role) >= {"ranks", "coords", "peak_bytes", "peak_op", "peak_phase", "breakdown_at_peak"}


# ---------------------------------------------------------------------------------------- gloo ranks

TP_CASES = {**SPECS, "titan-uneven": TITAN_UNEVEN}
PLAN_SPECS = {"titan-plan": TITAN, "memplan-llama-plan": "llama-7b-tiny", "hf-llama-tied-plan": HF_LLAMA_TIED}
PLAN_FRACTION = 0.85  # budget: this much of the no-plan peak of the worst rank


def _by_rank(layout) -> list[int]:
    by_rank = {r: role.peak_bytes for role in layout.roles for r in role.ranks}
    return [by_rank[r] for r in range(layout.config.world_size)]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "cases"),
    [({"tp": 2}, TP_CASES), ({"tp": 2, "dp": 2, "zero_stage": 3}, SPECS)],
    ids=["tp2-sp", "tp2xfsdp2"],
)
def test_per_rank_peak_and_plans_match_gloo_ranks(layout, cases):
    """Each rank's measured peak within 1% of its prediction; plans solved for the worst rank keep
    every rank within the budget with gradients allclose to one process."""
    from planner.api import plan_model

    config = _config(**layout)
    predicted = {key: _by_rank(simulate_ranks(spec, config)) for key, spec in cases.items()}
    runs = [(key, spec, config, None) for key, spec in cases.items()]
    budgets = {}
    for key, spec in PLAN_SPECS.items():
        budgets[key] = int(PLAN_FRACTION * simulate_ranks(spec, config).peak_bytes)
        plan, _, _ = plan_model(spec, config, budgets[key], time_limit_s=5.0)
        predicted[key] = _by_rank(simulate_ranks(spec, config, plan))
        runs.append((key, spec, config, plan.to_dict()))
    measured = run_on_ranks(runs, config.world_size)
    for key, want in predicted.items():
        peaks, grad_error = measured[key]
        for rank, (w, got) in enumerate(zip(want, peaks)):
            assert abs(w - got) <= TOLERANCE * got, (key, rank, w, got)
            assert key not in budgets or got <= budgets[key] * (1 + TOLERANCE), (key, rank, got, budgets[key])
        assert grad_error == 0.0, (key, grad_error)


@pytest.mark.distributed
@pytest.mark.slow
def test_gathered_logits_match_gloo_ranks():
    """--no-loss-parallel (the logits gathered whole on every rank) against gloo ranks, within 1%."""
    config = _config(tp=2, loss_parallel=False)
    cases = {"titan": TITAN, "memplan-llama": "llama-7b-tiny"}
    predicted = {key: _by_rank(simulate_ranks(spec, config)) for key, spec in cases.items()}
    measured = run_on_ranks([(key, spec, config, None) for key, spec in cases.items()], config.world_size)
    for key, want in predicted.items():
        for rank, (w, got) in enumerate(zip(want, measured[key][0])):
            assert abs(w - got) <= TOLERANCE * got, (key, rank, w, got)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tp": 2}, {"tp": 2, "dp": 2, "zero_stage": 3}], ids=["tp2-sp", "tp2xfsdp2"])
def test_auto_checkpoint_on_a_tensor_parallel_model_matches_gloo_ranks(layout):
    """auto_checkpoint after parallelize_module (before fully_shard): every rank solves the plan
    `memplan plan` makes for the layout, keeps within the budget and within 1% of the prediction,
    with gradients allclose to one process."""
    from tp_ranks import assert_auto_matches_plan

    assert_auto_matches_plan({"titan": TITAN, "hf-llama": HF_LLAMA}, _config(**layout), PLAN_FRACTION, TOLERANCE)


HF_STABLELM = f"hf:{HERE / 'data' / 'tiny_stablelm' / 'config.json'}"  # ships no TP plan: memplan's shards it


def test_memplan_plan_on_a_transformers_model_runs_without_sequence_parallel(capsys):
    """StableLM calls its attention with keywords and reads its positions from the embedding's
    output: memplan's plan shards it without sequence parallel, and says --no-sp where asked for it."""
    code, _, err = run(
        ["simulate", "--model", HF_STABLELM, "--batch-size", "2", "--seq-len", "64", "--tp", "2"], capsys
    )
    assert_user_error(code, err, "simulate", "--no-sp")
    ranks = simulate_ranks(HF_STABLELM, _config(tp=2, sequence_parallel=False))
    whole = simulate_ranks(HF_STABLELM, _config())
    assert ranks.peak_bytes < whole.peak_bytes


@pytest.mark.distributed
@pytest.mark.slow
def test_memplan_plan_on_a_transformers_model_matches_gloo_ranks():
    config = _config(tp=2, sequence_parallel=False)
    want = _by_rank(simulate_ranks(HF_STABLELM, config))
    peaks, grad_error = run_on_ranks([("stablelm", HF_STABLELM, config, None)], config.world_size)["stablelm"]
    for w, got in zip(want, peaks):
        assert abs(w - got) <= TOLERANCE * got, (w, got)
    assert grad_error == 0.0


OTHER_LAYOUTS = {  # transformers models that ship no TP plan, laid out unlike Llama
    "opt": (
        "self_attn",
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "self_attn.out_proj",
        ("fc1",),
        "fc2",
    ),
    "gpt_neo": (
        "attn.attention",
        ("attn.attention.q_proj", "attn.attention.k_proj", "attn.attention.v_proj"),
        "attn.attention.out_proj",
        ("mlp.c_fc",),
        "mlp.c_proj",
    ),
    "bert": (
        "attention.self",
        ("attention.self.query", "attention.self.key", "attention.self.value"),
        "attention.output.dense",
        ("intermediate.dense",),
        "output.dense",
    ),
    "gpt2": ("attn", ("attn.c_attn",), "attn.c_proj", ("mlp.c_fc",), "mlp.c_proj"),  # Conv1D, fused q/k/v
    "vit": (  # transformers 5 lays ViT out as Llama's projections with a plain MLP
        "attention",
        ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
        "attention.o_proj",
        ("mlp.fc1",),
        "mlp.fc2",
    ),
    # fused q/k/v laid out per head (Bloom, GPT-BigCode, Persimmon), per key-value group (Falcon's
    # new decoder) or concatenated (MPT); Bloom and MPT take per-head ALiBi biases; XGLM reshapes
    # its heads back with its embed_dim
    "bloom": (
        "self_attention",
        ("self_attention.query_key_value",),
        "self_attention.dense",
        ("mlp.dense_h_to_4h",),
        "mlp.dense_4h_to_h",
    ),
    "falcon": (
        "self_attention",
        ("self_attention.query_key_value",),
        "self_attention.dense",
        ("mlp.dense_h_to_4h",),
        "mlp.dense_4h_to_h",
    ),
    "gpt_bigcode": ("attn", ("attn.c_attn",), "attn.c_proj", ("mlp.c_fc",), "mlp.c_proj"),
    "mpt": ("attn", ("attn.Wqkv",), "attn.out_proj", ("ffn.up_proj",), "ffn.down_proj"),
    "persimmon": (
        "self_attn",
        ("self_attn.query_key_value",),
        "self_attn.dense",
        ("mlp.dense_h_to_4h",),
        "mlp.dense_4h_to_h",
    ),
    "xglm": (
        "self_attn",
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "self_attn.out_proj",
        ("fc1",),
        "fc2",
    ),
}


def _other_layout(name: str) -> str:
    return f"hf:{HERE / 'data' / f'tiny_{name}' / 'config.json'}"


@pytest.mark.parametrize("name", list(OTHER_LAYOUTS))
def test_memplan_plan_recognises_blocks_of_transformers_models_without_a_plan(name):
    """OPT (projections on the block), GPT-Neo (attention one level down, plain MLP), BERT (q/k/v in
    attention.self, the output projection beside it), GPT-2 (Conv1D projections, q/k/v fused), ViT
    (a plain MLP) and the fused layouts above: every block recognised with the paths of its
    projections, and a TP rank holds less than the whole model."""
    from planner.tracing.parallel.tp_plans import decoder_blocks

    model, _ = resolve_spec(_other_layout(name)).build(batch_size=2, seq_len=32)
    blocks = decoder_blocks(model)
    assert len(blocks) == 2
    assert {(b.attention, b.qkv, b.out, b.up, b.down) for b in blocks} == {OTHER_LAYOUTS[name]}
    config = TrainConfig(batch_size=2, seq_len=32, gpu="cpu")
    assert (
        simulate_ranks(_other_layout(name), config.with_(tp=2, sequence_parallel=False)).peak_bytes
        < simulate_ranks(_other_layout(name), config).peak_bytes
    )


def test_an_attention_with_per_head_parameters_is_not_recognised():
    """Swin's relative position bias holds a column per head, StableLM keeps a norm per head and
    OLMo2 normalises q over all heads: each would need sharding the plan does not do, so such a
    block is left to the user's plan (--tp-plan auto then says it found no blocks). One norm as wide
    as a head (Persimmon's q and k layernorms) runs on every rank's heads: recognised."""
    import torch
    from torch import nn

    from planner.tracing.parallel.tp_plans import decoder_blocks

    def block(extra: str | None) -> nn.Module:
        out = nn.Module()
        out.attention = nn.Module()
        out.attention.head_dim = 4
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(out.attention, name, nn.Linear(16, 16))
        if extra == "table":
            out.attention.relative_position_bias_table = nn.Parameter(torch.zeros(49, 4))
        elif extra == "norm per head":
            out.attention.q_norm = nn.ModuleList(nn.LayerNorm(4) for _ in range(4))
        elif extra == "norm over heads":
            out.attention.q_norm = nn.LayerNorm(16)
        elif extra == "head norm":
            out.attention.q_norm = nn.LayerNorm(4)
        out.mlp = nn.Module()
        out.mlp.fc1, out.mlp.fc2 = nn.Linear(16, 64), nn.Linear(64, 16)
        return out

    for extra in ("table", "norm per head", "norm over heads"):
        assert decoder_blocks(nn.ModuleList([block(extra)])) == [], extra
    assert [b.head_norms for b in decoder_blocks(nn.ModuleList([block("head norm")]))] == [("attention.q_norm",)]
    assert [b.head_norms for b in decoder_blocks(nn.ModuleList([block(None)]))] == [()]


TORCH_LAYERS = {  # models on torch's nn.MultiheadAttention
    "encoder": f"{HERE / 'tp_models.py'}:encoder_lm",
    "encoder-sequence-first": f"{HERE / 'tp_models.py'}:encoder_lm_sequence_first",
    "seq2seq": f"{HERE.parent / 'benchmarks' / 'zoo_models.py'}:torch_transformer",  # cross-attention, padding
    "vision": f"{HERE / 'tp_models.py'}:vision_transformer",  # torchvision's ViT layout
}


def test_memplan_plan_recognises_torch_transformer_layers():
    """nn.TransformerEncoderLayer / DecoderLayer: the self-attention (an nn.MultiheadAttention, sharded
    by its own style) and linear1 / linear2; a decoder's cross-attention stays whole; torchvision's
    ViT block with its nn.Sequential MLP. Sequence parallel is refused in one line."""
    from planner.tracing.parallel.tp_plans import decoder_blocks

    model, _ = resolve_spec(TORCH_LAYERS["seq2seq"]).build(batch_size=2, seq_len=32)
    blocks = decoder_blocks(model)
    assert len(blocks) == 4
    assert {(b.attention, b.qkv, b.out, b.up, b.down, b.multihead_attention) for b in blocks} == {
        ("self_attn", (), "", ("linear1",), "linear2", True)
    }
    vision, _ = resolve_spec(TORCH_LAYERS["vision"]).build(batch_size=2, seq_len=32)
    assert {(b.attention, b.up, b.down, b.multihead_attention) for b in decoder_blocks(vision)} == {
        ("self_attention", ("mlp.0",), "mlp.3", True)
    }
    config = TrainConfig(batch_size=2, seq_len=32, gpu="cpu")
    assert simulate_ranks(TORCH_LAYERS["encoder"], config.with_(tp=2, sequence_parallel=False)).peak_bytes < (
        simulate_ranks(TORCH_LAYERS["encoder"], config).peak_bytes
    )
    with pytest.raises(SpecError, match="nn.MultiheadAttention, which memplan's plan shards without sequence"):
        simulate_ranks(TORCH_LAYERS["encoder"], config.with_(tp=2))


@pytest.mark.distributed
@pytest.mark.slow
def test_memplan_plan_on_torch_transformer_layers_matches_gloo_ranks():
    """torch's layers under memplan's plan (--no-sp) on 2 gloo ranks: every rank's peak to the byte,
    gradients equal to one process (in_proj rows in the plan's rank-major order)."""
    _assert_matches_gloo_ranks_without_sp(TORCH_LAYERS)


def _assert_matches_gloo_ranks_without_sp(cases: dict[str, str]) -> None:
    """Each spec of `cases` under memplan's plan at --tp 2 --no-sp on 2 gloo ranks: every rank's peak
    as simulated, gradients equal to one process."""
    config = _config(tp=2, sequence_parallel=False).with_(seq_len=32)
    measured = run_on_ranks([(key, spec, config, None) for key, spec in cases.items()], config.world_size)
    for key, spec in cases.items():
        want = _by_rank(simulate_ranks(spec, config))
        peaks, grad_error = measured[key]
        assert all(abs(w - got) <= TOLERANCE * got for w, got in zip(want, peaks)), (key, want, peaks)
        assert grad_error == 0.0, key


@pytest.mark.distributed
@pytest.mark.slow
def test_memplan_plan_on_other_transformers_layouts_matches_gloo_ranks():
    """Every model of OTHER_LAYOUTS under memplan's plan (--no-sp) on 2 gloo ranks: every rank's peak
    to the byte, gradients equal to one process (a tied head's and a fused projection's too)."""
    _assert_matches_gloo_ranks_without_sp({name: _other_layout(name) for name in OTHER_LAYOUTS})


def test_a_bias_added_to_sharded_logits_says_no_loss_parallel(capsys, tmp_path):
    """BART adds a plain bias to its logits. With its head untied, loss parallel leaves them sharded:
    the trace error says to try --no-loss-parallel, and with it BART's encoder and decoder blocks
    shard (the decoder's self-attention; its cross-attention stays replicated). Tied (BART's
    default), its head shares the embeddings of the encoder and decoder, which the plan does not
    shard alike: they stay whole, one tensor, and the step runs with loss parallel."""
    import json

    tied_config = HERE / "data" / "bart_tiny" / "config.json"
    untied_config = tmp_path / "config.json"
    untied_config.write_text(json.dumps({**json.loads(tied_config.read_text()), "tie_word_embeddings": False}))
    argv = ["simulate", "--seq-len", "32", "--batch-size", "2", "--tp", "2", "--no-sp"]
    code, _, err = run([*argv, "--model", f"hf:{untied_config}"], capsys)
    assert_user_error(code, err, "simulate", "--no-loss-parallel", "--tp-plan PATH.py:FUNC")
    code, _, err = run([*argv, "--model", f"hf:{untied_config}", "--no-loss-parallel"], capsys)
    assert code == 0, err
    code, _, err = run([*argv, "--model", f"hf:{tied_config}"], capsys)
    assert code == 0, err


@pytest.mark.distributed
@pytest.mark.slow
def test_verify_names_replicated_parameters_a_plan_leaves_unsummed(capsys):
    """A plan that shards the linears around a learnable scalar leaves the scalar's gradient partial on
    each rank: verify measures the step and names the parameter whose replicas get different
    gradients; the same plan without the scalar leaves every replica's gradient alike."""
    from planner.api import verify_layout

    plan = f"{HERE / 'tp_models.py'}:mlp_plan"
    config = _config(tp=2, sequence_parallel=False, tp_plan=plan).with_(seq_len=16)
    scaled = verify_layout(f"{HERE / 'tp_models.py'}:scaled_mlp", config)
    assert scaled.diverged_parameters == ["scale"]
    assert verify_layout(f"{HERE / 'tp_models.py'}:plain_mlp", config).diverged_parameters == []
    code, out, err = run(
        [
            "verify",
            "--model",
            f"{HERE / 'tp_models.py'}:scaled_mlp",
            "--tp",
            "2",
            "--no-sp",
            "--tp-plan",
            plan,
            "--seq-len",
            "16",
            "--batch-size",
            "2",
        ],
        capsys,
    )
    assert code == 0, err
    assert "warning: 1 replicated parameters get different gradients on the tensor-parallel ranks" in out
    assert out.rstrip().endswith(": scale")
