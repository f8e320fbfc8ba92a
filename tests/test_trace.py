"""Structure of traced training steps (planner.tracing.recorder -> OpGraph)."""

from __future__ import annotations

import copy
import functools
import math
from collections import Counter

import pytest
import torch
from torch import nn

from planner.errors import TraceError
from planner.tracing.graph import CATEGORIES, PHASES
from planner.tracing.recorder import cast_parameters, trace
from planner.tracing.specs import ModelSpec

PRESETS = ["llama-7b-tiny", "gpt2-tiny", "mistral-7b-tiny", "resnet-tiny", "kwargs-tiny", "mlp-tiny", "bert-tiny"]
SEQ = {"resnet-tiny": 16, "mlp-tiny": 8}


def _graph(traced, preset, precision="fp32", batch_size=2):
    return traced(preset, batch_size, SEQ.get(preset, 32), precision)


def _phase_runs(graph):
    phases = [op.phase for op in graph.ops]
    return [p for i, p in enumerate(phases) if i == 0 or p != phases[i - 1]]


@pytest.mark.parametrize("preset", PRESETS)
def test_phases_in_order(traced, preset):
    g = _graph(traced, preset)
    assert _phase_runs(g) == ["forward", "loss", "backward"]
    assert all(op.phase in PHASES for op in g.ops)
    assert all(op.phase == "backward" for op in g.ops[g.backward_start :])
    assert all(op.phase != "backward" for op in g.ops[: g.backward_start])
    assert [op.index for op in g.ops] == list(range(len(g.ops)))


def test_llama_regions_are_identical_layers(traced):
    g = _graph(traced, "llama-7b-tiny")
    assert [r.path for r in g.regions] == ["layers.0", "layers.1"]
    assert len({r.signature for r in g.regions}) == 1
    assert len({r.param_bytes for r in g.regions}) == 1
    # each layer: 4 attention projections + 3 MLP projections + 2 norms (fp32)
    hidden, inter = 128, 344
    assert g.regions[0].param_bytes == 4 * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden)


@pytest.mark.parametrize("preset", PRESETS)
def test_regions_ordered_and_disjoint(traced, preset):
    """Forward ranges follow definition order; backward ranges run in reverse and never overlap
    (regression: module attribution in backward used to leak into the next block)."""
    g = _graph(traced, preset)
    regions = g.regions
    assert regions, "every preset has checkpointable blocks"
    for r in regions:
        assert 0 <= r.fwd_start < r.fwd_end <= g.backward_start <= r.bwd_start < r.bwd_end <= len(g.ops)
    by_fwd = sorted(regions, key=lambda r: r.fwd_start)
    for a, b in zip(by_fwd, by_fwd[1:]):
        assert a.fwd_end <= b.fwd_start
    by_bwd = sorted(regions, key=lambda r: r.bwd_start)
    for a, b in zip(by_bwd, by_bwd[1:]):
        assert a.bwd_end <= b.bwd_start
    assert [r.path for r in by_bwd] == [r.path for r in reversed(by_fwd)]


def test_gpt2_both_blocks_are_regions(traced):
    g = _graph(traced, "gpt2-tiny")
    assert [r.path for r in g.regions] == ["h.0", "h.1"]
    assert len({r.signature for r in g.regions}) == 1


@pytest.mark.parametrize("preset", PRESETS)
def test_saved_activations_live_from_forward_into_backward(traced, preset):
    g = _graph(traced, preset)
    acts = [t for t in g.tensors.values() if t.category == "activation"]
    assert acts
    for t in acts:
        assert t.saved_by, t
        assert all(0 <= s < g.backward_start for s in t.saved_by), t
        assert t.alloc_op < g.backward_start, t
        if t.alloc_op >= 0:  # allocated by the step (inputs, alloc_op -1, outlive it)
            assert t.free_op is not None and t.free_op >= g.backward_start, t


@pytest.mark.parametrize("preset", PRESETS)
def test_parameters_never_activations_and_gradients_cover_them(traced, preset):
    g = _graph(traced, preset)
    params = [t for t in g.tensors.values() if t.category == "parameter"]
    assert sorted(t.shape for t in params) == sorted(g.param_shapes)
    assert all(t.alloc_op == -1 and t.free_op is None and not t.saved_by for t in params)
    param_bytes = sum(t.nbytes for t in params)
    assert param_bytes == 4 * g.num_parameters  # fp32
    grads = [t for t in g.tensors.values() if t.category == "gradient"]
    assert sum(t.nbytes for t in grads) == param_bytes
    assert sorted(math.prod(t.shape) for t in grads) == sorted(math.prod(s) for s in g.param_shapes)
    assert all(t.alloc_op >= g.backward_start and t.free_op is None for t in grads)
    assert all(t.category in CATEGORIES for t in g.tensors.values())


@pytest.mark.parametrize("preset", PRESETS)
def test_natural_free_not_after_traced_free(traced, preset):
    g = _graph(traced, preset)
    forward = [t for t in g.tensors.values() if 0 <= t.alloc_op < g.backward_start]
    assert forward
    for t in forward:
        assert t.natural_free_op is not None, t
        assert t.alloc_op < t.natural_free_op <= g.backward_start, t
        if t.free_op is not None:
            assert t.natural_free_op <= t.free_op, t
        if not t.saved and t.free_op is not None and t.free_op <= g.backward_start:
            # nothing saved it: it dies where it died in the traced step
            assert t.natural_free_op == t.free_op, t


@pytest.mark.parametrize("preset", PRESETS)
def test_ops_reference_known_storages(traced, preset):
    g = _graph(traced, preset)
    for op in g.ops:
        assert set(op.allocs) <= set(op.outputs)
        for tid in op.inputs + op.outputs:
            assert tid in g.tensors
        for tid in op.allocs:
            assert g.tensors[tid].alloc_op == op.index
        assert op.flops >= 0 and op.bytes_accessed >= 0


_MATMUL = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.matmul.", "scaled_dot_product", "attention")


def test_forward_matmul_flops_match_the_2n_rule(traced):
    """Forward matmul FLOPs = 2 * non-embedding params * tokens + attention (within 15%)."""
    b, s, hidden, layers, vocab = 2, 64, 128, 2, 256
    g = traced("llama-7b-tiny", b, s, "fp32")
    tokens = b * s
    non_embedding = g.num_parameters - vocab * hidden
    attention = layers * 4 * b * s * s * hidden  # QK^T and AV, 2 FLOPs per MAC
    expected = 2 * non_embedding * tokens + attention
    fwd = sum(op.flops for op in g.ops[: g.backward_start] if any(k in op.name for k in _MATMUL))
    assert abs(fwd - expected) / expected < 0.15, (fwd, expected)
    # the projections alone are exact: 2 FLOPs per weight element per token
    mm = sum(op.flops for op in g.ops[: g.backward_start] if op.name.startswith(("aten.mm.", "aten.addmm.")))
    norms = (2 * layers + 1) * hidden
    assert mm == 2 * (non_embedding - norms) * tokens
    # backward matmuls cost about twice the forward
    bwd = sum(op.flops for op in g.ops[g.backward_start :] if op.name.startswith(("aten.mm.", "aten.addmm.")))
    assert 1.8 * mm <= bwd <= 2.2 * mm


def test_attention_flops_counted(traced):
    b, s, heads, head_dim, layers = 2, 64, 4, 32, 2
    g = traced("llama-7b-tiny", b, s, "fp32")
    attn = sum(op.flops for op in g.ops[: g.backward_start] if "scaled_dot_product" in op.name)
    expected = layers * 4 * b * heads * s * s * head_dim
    assert abs(attn - expected) / expected < 0.10, (attn, expected)


@pytest.mark.fresh_trace
def test_trace_is_deterministic(traced):
    a = _graph(traced, "llama-7b-tiny")
    b = trace("llama-7b-tiny", batch_size=2, seq_len=32)
    assert [(o.name, o.module, o.phase, o.allocs) for o in a.ops] == [
        (o.name, o.module, o.phase, o.allocs) for o in b.ops
    ]
    assert a.regions == b.regions
    assert a.tensors == b.tensors


def test_activations_scale_with_batch(traced):
    one = traced("llama-7b-tiny", 1, 32, "fp32")
    two = traced("llama-7b-tiny", 2, 32, "fp32")

    def act(g):
        return sum(t.nbytes for t in g.tensors.values() if t.category == "activation" and t.alloc_op >= 0)

    assert act(two) == pytest.approx(2 * act(one), rel=0.02)
    assert len(one.ops) == len(two.ops)


def test_bf16_mixed_has_bf16_activations(traced):
    g = _graph(traced, "llama-7b-tiny", "bf16-mixed")
    assert g.param_dtype == "float32" and g.meta["precision"] == "bf16-mixed"
    params = [t for t in g.tensors.values() if t.category == "parameter"]
    assert all(t.dtype == "float32" for t in params)
    mm_out = [
        g.tensors[o].dtype for op in g.ops[: g.backward_start] if op.name.startswith("aten.mm.") for o in op.allocs
    ]
    assert mm_out and set(mm_out) == {"bfloat16"}
    acts = Counter(t.dtype for t in g.tensors.values() if t.category == "activation")
    assert acts["bfloat16"] > acts["float32"]
    # (total activation bytes need not drop: autocast saves bf16 copies of the weights too)


@pytest.mark.parametrize("preset", ["llama-7b-tiny", "resnet-tiny", "kwargs-tiny"])
def test_pure_bf16_trace(traced, preset):
    """Regression: casting fake parameters with Module.to used to raise "Couldn't swap ...weight"."""
    g = _graph(traced, preset, "bf16")
    assert g.param_dtype == "bfloat16"
    assert all(t.dtype == "bfloat16" for t in g.tensors.values() if t.category in ("parameter", "gradient"))
    assert sum(t.nbytes for t in g.tensors.values() if t.category == "parameter") == 2 * g.num_parameters


def _one_line_naming(msg: str, *needles: str) -> None:
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)


def test_item_in_control_flow_is_a_trace_error(bad_models):
    with pytest.raises(TraceError) as info:
        trace(f"{bad_models}:item_model", batch_size=1, seq_len=4)
    _one_line_naming(str(info.value), "aten.", "'branch'", "item_model")


def test_nonzero_is_a_trace_error_naming_op_and_module(bad_models):
    with pytest.raises(TraceError) as info:
        trace(f"{bad_models}:nonzero_model", batch_size=1, seq_len=4)
    _one_line_naming(str(info.value), "nonzero", "'gate'")


def test_nonzero_is_a_one_line_trace_error(bad_models):
    with pytest.raises(TraceError) as info:
        trace(f"{bad_models}:nonzero_model", batch_size=1, seq_len=4)
    assert "\n" not in str(info.value) and "data-dependent" in str(info.value)


def test_file_spec_traces(bad_models):
    g = trace(f"{bad_models}:good_model", batch_size=2, seq_len=4)
    assert _phase_runs(g)[-1] == "backward"
    assert g.num_parameters == 8 * 16 + 16 + 16 * 8 + 8


def test_networkx_view_is_a_dag_in_execution_order(traced):
    import networkx as nx

    graph = traced("llama-7b-tiny")
    g = graph.to_networkx()
    assert nx.is_directed_acyclic_graph(g)
    assert all(u < v for u, v in g.edges)
    assert g.number_of_nodes() == len(graph.ops)


def test_tied_weights_stay_tied_when_parameters_are_cast():
    """A ZeRO-3 bf16 trace casts parameters to bf16; a tied embedding and head stay one parameter."""
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
    model[1].weight = model[0].weight
    cast_parameters(model, torch.bfloat16)
    assert model[1].weight is model[0].weight and model[0].weight.dtype == torch.bfloat16
    assert len(list(model.parameters())) == 1


@functools.lru_cache(maxsize=4)
def _cached_index(n: int) -> torch.Tensor:
    """A process-wide memo of a tensor built on first use (transformers' BEiT relative positions)."""
    return torch.arange(n).flip(0).clone()


class CachedIndexModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x[:, _cached_index(x.shape[1])]).pow(2).mean()


def test_a_forward_that_caches_tensors_across_calls_is_a_one_line_trace_error():
    """The first fake forward fills the cache, the second reuses it: the op counts differ and the
    cache now holds a fake tensor (a real step after it silently returned a fake loss). The error
    says so and what to do."""
    from planner.tracing.specs import ModelSpec

    _cached_index.cache_clear()
    spec = ModelSpec(
        "cached",
        "a forward with an lru_cache",
        lambda batch_size, seq_len: (CachedIndexModel(), (torch.randn(batch_size, seq_len, 8),)),
    )
    with pytest.raises(
        TraceError, match=r"fewer ops on its second forward.*lru_cache.*run the model once for real"
    ) as info:
        trace(spec, batch_size=2, seq_len=8)
    assert "\n" not in str(info.value)
    _cached_index.cache_clear()
    model, inputs = spec.build(batch_size=2, seq_len=8)
    model(*inputs)  # filled for real first, the trace reuses the real tensor and succeeds
    assert trace(spec, batch_size=2, seq_len=8).ops
    _cached_index.cache_clear()


def test_trace_cache_keys_on_every_field_a_trace_reads():
    """Configs that differ only in what the trace does not read (data-parallel degree) share one
    trace; a different target GPU (its attention kernel) or sequence is traced again."""
    from planner.config import TrainConfig
    from planner.tracing.recorder import TraceCache, trace_key

    base = TrainConfig(seq_len=32, zero_stage=3, dp=2)
    assert trace_key(base) == trace_key(base.with_(dp=8))
    assert trace_key(base) != trace_key(base.with_(gpu="h100-80gb"))
    traces = TraceCache("gpt2-tiny")
    assert traces(base) is traces(base.with_(dp=8))
    traces(base.with_(seq_len=16))
    assert traces.count == 2


def test_a_model_refusing_its_inputs_is_told_to_check_the_shapes(bad_models):
    with pytest.raises(TraceError) as info:
        trace(f"{bad_models}:fixed_size_model", batch_size=1, seq_len=4)
    _one_line_naming(str(info.value), "ValueError", "doesn't match model (16)", "--seq-len")
    assert "data-dependent" not in str(info.value)


def test_a_model_that_deep_copies_its_layers_traces_as_one_that_builds_them():
    """nn.TransformerEncoder deep-copies its layer. torch's deep copy of a fake tensor copies its
    mode too, and each view of the copy then had a storage of its own: every transpose of a weight
    was counted as a new tensor (+15% on two layers). The trace's mode is its own copy."""
    from planner.tracing.fake_mode import TraceFakeMode

    def layer() -> nn.Module:
        return nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)

    with TraceFakeMode():
        weight = copy.deepcopy(nn.Linear(4, 8)).weight
        assert weight.t().untyped_storage()._cdata == weight.untyped_storage()._cdata

    def build(deep_copied: bool, batch_size: int, seq_len: int):
        layers = nn.TransformerEncoder(layer(), 2, enable_nested_tensor=False) if deep_copied else None
        model = nn.Sequential(layers if deep_copied else nn.Sequential(layer(), layer()))
        return model, (torch.randn(batch_size, seq_len, 32),)

    storages = {}
    for deep_copied in (True, False):
        spec = ModelSpec("encoder", "", functools.partial(build, deep_copied))
        graph = trace(spec, batch_size=2, seq_len=16)
        storages[deep_copied] = sorted((t.alloc_op, t.nbytes, t.category) for t in graph.tensors.values())
    assert storages[True] == storages[False]


@pytest.mark.parametrize(
    ("steps", "batch", "input_size", "hidden"),
    [(32, 4, 64, 96), (1, 1, 8, 8), (7, 3, 5, 11), (100, 2, 300, 50), (16, 16, 16, 16)],
)
def test_onednn_lstm_workspace_is_the_real_kernels(steps, batch, input_size, hidden):
    """oneDNN's LSTM layer keeps a workspace for its backward that its fake kernel leaves empty
    (a two-layer LSTM was predicted 26% under): the trace sizes it as the real kernel does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from planner.tracing.kernel_storage import onednn_lstm_workspace_bytes

    workspaces = []

    class Workspaces(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if str(func) == "aten.mkldnn_rnn_layer.default":
                workspaces.append(out[3].untyped_storage().nbytes())
            return out

    with Workspaces():
        nn.LSTM(input_size, hidden, batch_first=True)(torch.randn(batch, steps, input_size))
    if not workspaces:
        pytest.skip("this torch runs LSTM without oneDNN")
    assert workspaces == [onednn_lstm_workspace_bytes(steps, batch, input_size, hidden)]
