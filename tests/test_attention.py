"""The attention kernel follows the target device (issue 22): costmodels.attention's rule, and traces
for a GPU that record the GPU's kernel, never the CPU math fallback's s x s scores.

The DeepSeek-V3 checks set the trace's activation bytes against a hand count of what each layer
saves (the same count as README.md's "What a DeepSeek-V3 layer saves").
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from models_for_tests import PATH
from torch import nn

from costmodels.attention import CUDNN, EFFICIENT, FLASH, MATH, NATIVE, SdpaCall, sdpa_kernel
from costmodels.hardware import get_device
from planner.runtime.live_trace import LiveTracer
from planner.tracing import recorder
from planner.tracing.specs import ModelSpec

H100 = get_device("h100-80gb")
BF16, FP32 = torch.bfloat16, torch.float32


def _call(d_qk=128, d_v=None, dtype=BF16, heads=(16, 16), s=(1024, 1024), **kw) -> SdpaCall:
    d_v = d_qk if d_v is None else d_v
    q, kv = heads
    return SdpaCall(
        (2, q, s[0], d_qk), (2, kv, s[1], d_qk), (2, kv, s[1], d_v), (dtype, dtype, dtype), requires_grad=True, **kw
    )


@pytest.mark.parametrize(
    ("device", "call", "kernel"),
    [
        ("h100-80gb", _call(), FLASH),  # bf16, equal head sizes
        ("h100-80gb", _call(dtype=FP32), EFFICIENT),  # flash needs fp16/bf16
        ("h100-80gb", _call(192, 128), EFFICIENT),  # DeepSeek-V3's MLA: flash needs equal head sizes
        ("h100-80gb", _call(512), EFFICIENT),  # flash stops at 256; memory-efficient has no limit
        ("h100-80gb", _call(6, dtype=FP32), MATH),  # memory-efficient needs multiples of 4 in fp32
        ("h100-80gb", _call(mask_shape=(1024, 1024)), EFFICIENT),  # flash takes no mask
        ("h100-80gb", _call(dropout_p=0.1), FLASH),
        ("h100-80gb", _call(heads=(32, 8), enable_gqa=True), FLASH),
        ("h100-80gb", _call(heads=(32, 8)), MATH),  # unequal heads without enable_gqa
        ("h100-80gb", _call(s=(512, 1024), is_causal=True), EFFICIENT),  # flash: causal only square
        ("h100-80gb", _call(last_dim_strides=(1, 2, 1)), MATH),
        ("h100-80gb", _call(storage_offsets=(0, 0, 4)), FLASH),
        ("h100-80gb", _call(dtype=FP32, mask_shape=(1, 16, 1024, 1024), storage_offsets=(0, 0, 2)), MATH),
        ("l40s", _call(200), EFFICIENT),  # sm89: flash cannot train head sizes in (192, 224]
        ("a100-80gb", _call(200), FLASH),
        ("mi300x", _call(192, 128), EFFICIENT),
        ("mi300x", _call(heads=(32, 8), enable_gqa=True, dtype=FP32), MATH),  # ROCm: no GQA in mem-efficient
        ("cpu", _call(192, 128), NATIVE),  # a CPU target keeps CPU torch's own choice
    ],
)
def test_kernel_rule(device, call, kernel):
    assert sdpa_kernel(get_device(device), call) == kernel


def test_three_dimensional_inputs_take_math():
    call = SdpaCall((16, 1024, 64), (16, 1024, 64), (16, 1024, 64), (BF16, BF16, BF16))
    assert sdpa_kernel(H100, call) == MATH


def test_cudnn_first_with_a_new_cudnn_on_hopper():
    """A profile with cuDNN newer than 9.15.0 on sm90 puts cuDNN first (check_prefer_cudnn_attention);
    192/128 runs there from cuDNN 9.11; cuDNN takes no fp32, so fp32 stays memory-efficient."""
    new = dataclasses.replace(H100, cudnn_version=91600)
    assert sdpa_kernel(new, _call()) == CUDNN
    assert sdpa_kernel(new, _call(192, 128)) == CUDNN
    assert sdpa_kernel(new, _call(dtype=FP32)) == EFFICIENT
    assert sdpa_kernel(new, _call(dropout_p=0.1)) == FLASH  # 0.1 is not a multiple of 1/16
    ampere = dataclasses.replace(get_device("a100-80gb"), cudnn_version=91600)
    assert sdpa_kernel(ampere, _call()) == FLASH  # not preferred below sm90


class _Attention(nn.Module):
    """One SDPA over (b, 4, s, d) heads with an optional boolean mask; grads flow to q, k, v."""

    def __init__(self, d_qk: int, d_v: int, mask: bool) -> None:
        super().__init__()
        self.q = nn.Linear(8, 4 * d_qk, bias=False)
        self.k = nn.Linear(8, 4 * d_qk, bias=False)
        self.v = nn.Linear(8, 4 * d_v, bias=False)
        self.mask = mask

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, 4, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        mask = torch.ones(s, s, dtype=torch.bool).tril() if self.mask else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not self.mask).sum()


def _attention_spec(d_qk: int, d_v: int, mask: bool) -> ModelSpec:
    def build(batch_size: int, seq_len: int):
        return _Attention(d_qk, d_v, mask), (torch.randn(batch_size, seq_len, 8),)

    return ModelSpec(f"attn-{d_qk}-{d_v}", "one attention", build)


def _saved(graph, *names):
    return [t for t in graph.tensors.values() if t.saved_by and graph.ops[t.alloc_op].name in names]


def test_fp32_masked_attention_on_h100_is_memory_efficient():
    s = 100
    graph = recorder.trace(_attention_spec(64, 64, mask=True), batch_size=2, seq_len=s, gpu="h100-80gb")
    names = [op.name for op in graph.ops]
    assert "aten._scaled_dot_product_efficient_attention.default" in names
    assert "aten._scaled_dot_product_efficient_attention_backward.default" in names
    (out, lse) = _saved(graph, "aten._scaled_dot_product_efficient_attention.default")[:2]
    assert out.shape == (2, 4, s, 64) and lse.shape == (2, 4, 128)  # logsumexp padded to 32
    # the mask, made additive and padded to 16 columns as ATen pads it, is saved: s x s, once
    pad = [t for t in graph.tensors.values() if graph.ops[t.alloc_op].name == "aten.constant_pad_nd.default"]
    assert [t.shape for t in pad] == [(2, 4, s, 112)] and pad[0].saved_by
    assert all(op.flops > 0 for op in graph.ops if "efficient_attention" in op.name)


class _GroupedQuery(nn.Module):
    """fp32 grouped-query attention (8 query heads, 2 key/value heads) through enable_gqa."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(8, 8 * 16, bias=False), nn.Linear(8, 2 * 2 * 16, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 8, 16).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, 2, 16).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum()


def test_fp32_grouped_query_on_h100_repeats_heads_for_memory_efficient():
    spec = ModelSpec(
        "gqa",
        "grouped-query attention",
        lambda batch_size, seq_len: (_GroupedQuery(), (torch.randn(batch_size, seq_len, 8),)),
    )
    graph = recorder.trace(spec, batch_size=2, seq_len=48, gpu="h100-80gb")
    assert any(op.name == "aten._scaled_dot_product_efficient_attention_backward.default" for op in graph.ops)
    repeated = [t.shape for t in _saved(graph, "aten.clone.default")]  # repeat_interleave's copies
    assert repeated == [(2, 2, 4, 48, 16)] * 2
    bf16 = recorder.trace(spec, batch_size=2, seq_len=48, precision="bf16-mixed", gpu="h100-80gb")
    assert any(op.name == "aten._scaled_dot_product_flash_attention.default" for op in bf16.ops)  # GQA natively


def test_cpu_target_trace_unchanged_and_gpu_flash_saves_the_same_bytes():
    """Flash-eligible attention: the H100 trace records the CUDA flash kernel, saving what the CPU
    flash kernel saved (output and logsumexp); a CPU target keeps the CPU kernel."""
    spec = f"{PATH}:llama_small"
    cpu = recorder.trace(spec, batch_size=2, seq_len=64, precision="bf16-mixed", gathered_params=True)
    gpu = recorder.trace(spec, batch_size=2, seq_len=64, precision="bf16-mixed", gathered_params=True, gpu="h100-80gb")
    assert any(op.name == "aten._scaled_dot_product_flash_attention_for_cpu.default" for op in cpu.ops)
    assert not any("_for_cpu" in op.name for op in gpu.ops)
    assert any(op.name == "aten._scaled_dot_product_flash_attention.default" for op in gpu.ops)

    def activation(g):
        return sum(t.nbytes for t in g.tensors.values() if t.category == "activation")

    assert activation(gpu) == activation(cpu)
    attention = ("scaled_dot_product_flash_attention",)
    assert sum(op.flops for op in gpu.ops if any(a in op.name for a in attention)) == sum(
        op.flops for op in cpu.ops if any(a in op.name for a in attention)
    )


# -- DeepSeek-V3: no s x s, and the hand count ---------------------------------------------------


def _ceil32(n: int) -> int:
    return math.ceil(n / 32) * 32


def deepseek_v3_activation_bytes(c: dict, b: int, s: int) -> int:
    """What one bf16 step of transformers' DeepSeek-V3 saves for backward (bytes), FSDP2-style
    (parameters gathered in bf16, no autocast), attention memory-efficient (H100), MoE with the
    grouped-mm experts and balanced routing. T = b*s tokens, d hidden; see README.md."""
    t, d, h = b * s, c["hidden_size"], c["num_attention_heads"]
    d_nope, d_rope, d_v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    e, k, i_e = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]

    def norm(width):  # RMSNorm: fp32 copy, rsqrt, bf16 copy, output (saved by the next matmul)
        return 8 * t * width + 4 * t

    mla = (
        norm(d)  # input_layernorm
        + norm(c["q_lora_rank"])  # q_a_layernorm
        + norm(c["kv_lora_rank"])  # kv_a_layernorm
        + 2 * t * h * (d_nope + d_v)  # kv_b_proj output (value is a view of it)
        + 2 * 2 * t * h * (d_nope + d_rope)  # query and key (192 wide)
        + 2 * t * h * d_v  # attention output (also o_proj's input)
        + 4 * b * h * _ceil32(s)  # logsumexp, fp32, rows padded to 32
    )
    dense_mlp = norm(d) + 4 * 2 * t * c["intermediate_size"]  # gate, silu, up, product
    router = 4 * t * d + 4 * e * d + 4 * t * e + t * e + 16 * t * c["n_group"] + 8 * t * c["topk_group"]
    router += 8 * t * k + 4 * t + 4 * t * k  # top-k indices, normaliser, weights
    experts = 4 * t * k * d + 8 * t * k * i_e + 28 * t * k + 4 * e  # routed rows in and out, gate_up, silu, product
    shared = 4 * 2 * t * i_e * c["n_shared_experts"]
    moe = norm(d) + router + experts + shared
    dense_layers = c["first_k_dense_replace"]
    layers = dense_layers * (mla + dense_mlp) + (c["num_hidden_layers"] - dense_layers) * (mla + moe)
    outside = 8 * t + 2 * 2 * t * d_rope + norm(d) + 8 * b * (s + 1) + 4 * t * c["vocab_size"] + 4
    return layers + outside  # ids, cos/sin, final norm, shifted labels, log-softmax, loss


SMALL = {  # DeepSeek-V3's MLA head sizes (q/k 192, v 128), everything else small
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 256,
    "intermediate_size": 320,
    "moe_intermediate_size": 64,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "kv_lora_rank": 64,
    "q_lora_rank": 96,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "vocab_size": 200,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def _deepseek(tmp_path, config: dict, s: int, gpu: str):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return recorder.trace(f"hf:{path}", batch_size=1, seq_len=s, precision="bf16-mixed", gathered_params=True, gpu=gpu)


def _square(graph, s: int) -> list:
    return [t for t in graph.tensors.values() if sum(d == s for d in t.shape) >= 2]


def _activation_bytes(graph) -> int:
    return sum(t.nbytes for t in graph.tensors.values() if t.category == "activation")


@pytest.mark.slow  # 5 s: a 671B trace; the other attention counts stay fast
def test_deepseek_v3_on_h100_has_no_s_by_s_and_matches_the_hand_count(tmp_path):
    pytest.importorskip("transformers")
    s = 300  # no dimension of the config is 300
    gpu = _deepseek(tmp_path, SMALL, s, "h100-80gb")
    assert _square(gpu, s) == []
    kernels = {op.name for op in gpu.ops if "attention" in op.name}
    assert kernels == {
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_efficient_attention_backward.default",
    }
    assert _activation_bytes(gpu) == deepseek_v3_activation_bytes(SMALL, 1, s)
    cpu = _deepseek(tmp_path, SMALL, s, "cpu")  # the CPU's math fallback: s x s scores per head
    assert any(t.shape == (1, 2, s, s) and t.category == "activation" for t in _square(cpu, s))


@pytest.mark.slow
def test_full_deepseek_v3_671b_at_seq_4096(tmp_path):
    """transformers' default DeepseekV3Config (61 layers, 256 experts): about 30 s on 2 cores."""
    transformers = pytest.importorskip("transformers")
    config = {**transformers.DeepseekV3Config().to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    graph = _deepseek(tmp_path, config, 4096, "h100-80gb")
    assert _square(graph, 4096) == []
    assert _activation_bytes(graph) == deepseek_v3_activation_bytes(config, 1, 4096)


def test_live_tracer_of_a_real_model_follows_its_gpu():
    """auto_checkpoint / plan_for trace a live model for its config's gpu the same way."""
    model, inputs = _Attention(24, 16, mask=False), (torch.randn(2, 40, 8),)
    names = {op.name for op in LiveTracer(model, "fp32", gpu="h100-80gb").trace(inputs).ops}
    assert "aten._scaled_dot_product_efficient_attention.default" in names
    names = {op.name for op in LiveTracer(model, "fp32").trace(inputs).ops}
    assert "aten._safe_softmax.default" in names  # the CPU's math fallback for 24/16 head sizes
