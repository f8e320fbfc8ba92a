"""A deep stack of identical blocks traced through a shallow copy (tracing/depth.py) records the
same graph as the full trace: ops, storages, frees, saves, regions, byte for byte."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import planner.tracing.recorder as recorder
from planner.config import TrainConfig
from planner.simulation.step import simulate
from planner.tracing.depth import FOLD_MIN_RUN, same_graph
from planner.tracing.fingerprint import model_fingerprint
from planner.tracing.models import GPT, GPTConfig, Llama, LlamaConfig, random_tokens
from planner.tracing.specs import ModelSpec


def _unfolded(monkeypatch, make):
    """What `make()` traces with folding off (MEMPLAN_FULL_TRACE=1)."""
    with monkeypatch.context() as m:
        m.setenv(recorder.FULL_TRACE_ENV, "1")
        return make()


def _spec(name, build) -> ModelSpec:
    return ModelSpec(name, name, build)


def _llama(layers: int) -> ModelSpec:
    def build(batch_size, seq_len):
        return Llama(LlamaConfig(256, 64, 128, layers, 4, 2)), random_tokens(batch_size, seq_len, 256)

    return _spec(f"llama-{layers}", build)


def _gpt(layers: int) -> ModelSpec:
    def build(batch_size, seq_len):
        model = GPT(GPTConfig(vocab_size=256, block_size=128, n_layer=layers, n_head=4, n_embd=64))
        return model, random_tokens(batch_size, seq_len, 256)

    return _spec(f"gpt-{layers}", build)


def _assert_folds_exactly(monkeypatch, spec, layers: int, **kw):
    folded = recorder.trace(spec, batch_size=2, seq_len=32, **kw)
    full = _unfolded(monkeypatch, lambda: recorder.trace(spec, batch_size=2, seq_len=32, **kw))
    assert folded.meta.get("folded") == layers
    assert "folded" not in full.meta
    assert same_graph(folded, full)
    assert folded.meta["fingerprint"] == full.meta["fingerprint"]
    config = TrainConfig(batch_size=2, seq_len=32)
    a, b = simulate(folded, config), simulate(full, config)
    assert (a.peak_bytes, a.peak_op, a.breakdown_at_peak) == (b.peak_bytes, b.peak_op, b.breakdown_at_peak)


@pytest.mark.parametrize("make", [_llama, pytest.param(_gpt, marks=pytest.mark.slow)], ids=["llama", "gpt"])
def test_folded_trace_is_the_full_trace(monkeypatch, make):
    _assert_folds_exactly(monkeypatch, make(FOLD_MIN_RUN + 1), FOLD_MIN_RUN + 1)


@pytest.mark.slow  # 5 s; folding stays proven in the fast tier
def test_folded_trace_keeps_which_parameters_are_frozen(monkeypatch):
    """Frozen parameters (no gradient, no optimizer states) in every block extend with the copies."""

    def build(batch_size, seq_len):
        model, inputs = _llama(FOLD_MIN_RUN).build(batch_size=batch_size, seq_len=seq_len)
        for name, p in model.named_parameters():
            p.requires_grad_("norm" not in name)
        return model, inputs

    spec = _spec("llama-frozen-norms", build)
    folded = recorder.trace(spec, batch_size=1, seq_len=16)
    full = _unfolded(monkeypatch, lambda: recorder.trace(spec, batch_size=1, seq_len=16))
    assert folded.meta.get("folded") == FOLD_MIN_RUN and same_graph(folded, full)  # same_graph compares them
    assert folded.param_trainable.count(False) == 2 * FOLD_MIN_RUN + 1  # two norms a layer, the final norm
    config = TrainConfig(batch_size=1, seq_len=16)
    assert simulate(folded, config).model_states == simulate(full, config).model_states


@pytest.mark.slow  # 6 s; folding stays proven in the fast tier
def test_folded_trace_is_the_full_trace_in_mixed_precision_under_zero3(monkeypatch):
    _assert_folds_exactly(monkeypatch, _llama(FOLD_MIN_RUN), FOLD_MIN_RUN, precision="bf16-mixed", gathered_params=True)


@pytest.mark.slow  # three depths, each traced whole (31 s); the fast tier folds llama and GPT at one depth
@settings(max_examples=3, deadline=None)
@given(layers=st.integers(FOLD_MIN_RUN, FOLD_MIN_RUN + 6))
def test_any_depth_folds_exactly(layers):
    mp = pytest.MonkeyPatch()
    try:
        _assert_folds_exactly(mp, _llama(layers), layers)
    finally:
        mp.undo()


def test_short_stacks_are_traced_whole():
    graph = recorder.trace(_llama(FOLD_MIN_RUN - 1), batch_size=1, seq_len=16)
    assert "folded" not in graph.meta


class _IndexedBlock(nn.Module):
    """A block that runs more ops the deeper it sits: folding must notice and trace whole."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.linear = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(1 + self.index // 6):
            x = torch.tanh(self.linear(x))
        return x


class _Indexed(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_IndexedBlock(i) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


class _Rotate(nn.Module):
    """A parameterless module outside the model, shared by every block (as transformers turns
    apply_rotary_pos_emb into one when the `kernels` package is installed)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., 16:], x[..., :16]), dim=-1) * 0.5 + x


_ROTATE = _Rotate()


class _RotatingBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(_ROTATE(self.linear(x)))


class _Rotating(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_RotatingBlock() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_a_module_outside_the_model_runs_as_part_of_its_caller(monkeypatch):
    layers = FOLD_MIN_RUN + 2
    spec = _spec("rotating", lambda batch_size, seq_len: (_Rotating(layers), (torch.randn(batch_size, seq_len, 32),)))
    _assert_folds_exactly(monkeypatch, spec, layers)
    graph = recorder.trace(spec, batch_size=2, seq_len=8)
    cats = [op.module for op in graph.ops if op.name == "aten.cat.default" and op.phase == "forward"]
    assert cats == [f"layers.{i}" for i in range(layers)]


def test_blocks_that_differ_by_depth_are_traced_whole(monkeypatch):
    layers = FOLD_MIN_RUN + 4
    spec = _spec("indexed", lambda batch_size, seq_len: (_Indexed(layers), (torch.randn(batch_size, seq_len, 32),)))
    folded = recorder.trace(spec, batch_size=2, seq_len=8)
    full = _unfolded(monkeypatch, lambda: recorder.trace(spec, batch_size=2, seq_len=8))
    assert "folded" not in folded.meta
    assert folded.meta["unfolded_because"].startswith("one more block does not extend the shallow trace: ops differ")
    assert same_graph(folded, full)


@pytest.mark.slow  # 12 s; the fast tier folds llama's trace and traces TP ranks elsewhere
def test_tensor_parallel_rank_trace_folds_exactly(monkeypatch):
    from planner.tracing.parallel.rank_trace import trace_tp_rank

    spec = _llama(FOLD_MIN_RUN)
    config = TrainConfig(batch_size=2, seq_len=32, tp=2, sequence_parallel=True)
    folded, folded_keys = trace_tp_rank(spec, config, rank=1)  # the plan applied to the traced blocks only
    full, full_keys = _unfolded(monkeypatch, lambda: trace_tp_rank(spec, config, rank=1))
    assert folded.meta.get("folded") == FOLD_MIN_RUN
    assert same_graph(folded, full)
    assert folded.meta["fingerprint"] == model_fingerprint(_llama(FOLD_MIN_RUN).build(1, 8)[0])
    assert len(set(folded_keys)) == len(set(full_keys)) == 1


def test_tensor_parallel_rank_trace_that_does_not_fold_parallelizes_every_block(monkeypatch):
    """The TP plan goes to the blocks a folded trace runs; when the trace then does not fold, the
    rank is traced again with every block parallelized (else the deeper blocks would run unsharded)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from planner.tracing.parallel.rank_trace import trace_tp_rank

    def plan(model, mesh):
        for block in model.layers:
            parallelize_module(block, mesh, {"linear": ColwiseParallel(output_layouts=Replicate())})

    layers = FOLD_MIN_RUN + 4
    spec = _spec("indexed", lambda batch_size, seq_len: (_Indexed(layers), (torch.randn(batch_size, seq_len, 32),)))
    config = TrainConfig(batch_size=2, seq_len=8, tp=2, sequence_parallel=False)
    traced, _ = trace_tp_rank(spec, config, rank=0, plan=plan)
    full, _ = _unfolded(monkeypatch, lambda: trace_tp_rank(spec, config, rank=0, plan=plan))
    assert "folded" not in traced.meta and same_graph(traced, full)
    assert {t.nbytes for t in traced.tensors.values() if t.category == "parameter"} == {16 * 32 * 4, 16 * 4}


HF = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "gpt2": {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_head": 4},
    "bert": {
        "architectures": ["BertForMaskedLM"],
        "model_type": "bert",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 128,
    },
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    },
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HF))
def test_transformers_models_fold_exactly(monkeypatch, tmp_path, name):
    pytest.importorskip("transformers")
    layers = FOLD_MIN_RUN
    dense = HF[name].get("first_k_dense_replace", 0)
    config = {**HF[name], "vocab_size": 256, "max_position_embeddings": 128, "tie_word_embeddings": False}
    config["n_layer" if name == "gpt2" else "num_hidden_layers"] = layers + dense
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = f"hf:{tmp_path / 'config.json'}"
    folded = recorder.trace(spec, batch_size=2, seq_len=32)
    full = _unfolded(monkeypatch, lambda: recorder.trace(spec, batch_size=2, seq_len=32))
    assert folded.meta.get("folded") == layers, folded.meta.get("unfolded_because")
    assert same_graph(folded, full)
