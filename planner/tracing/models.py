"""Pure-torch models behind memplan's presets: Llama, GPT-2, BERT-style encoder, ResNet, MLP.

Every model works on real tensors, on the meta device and under FakeTensorMode: shapes are static,
nothing reads tensor values, and nothing is moved to a device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "LlamaConfig",
    "Llama",
    "LlamaStage",
    "KwargsLlama",
    "CausalLMOutput",
    "GPTConfig",
    "GPT",
    "EncoderConfig",
    "Encoder",
    "ConvNetConfig",
    "ConvNet",
    "MLPConfig",
    "MLP",
]


# ----------------------------------------------------------------------------- shared pieces


def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross entropy of (B, S, V) logits against already aligned (B, S) labels, in fp32 like HF."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def split_heads(x: Tensor, num_heads: int) -> Tensor:
    """(B, S, H*D) -> (B, H, S, D)."""
    return x.unflatten(-1, (num_heads, -1)).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, S, D) -> (B, S, H*D)."""
    return x.transpose(1, 2).flatten(2)


# ----------------------------------------------------------------------------- Llama


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must divide into num_heads {self.num_heads}, "
                f"and num_heads into num_kv_heads {self.num_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as in HF Llama."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """fp32 cos and sin tables, each (S, D), for rotate-half RoPE at positions 0..S-1."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (S, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (S, D)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, H, S, D) queries or keys by the (S, D) tables."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def repeat_kv(x: Tensor, num_heads: int) -> Tensor:
    """(B, KV, S, D) -> (B, H, S, D): each key/value head serves H/KV query heads."""
    b, kv, s, d = x.shape
    if kv == num_heads:
        return x
    return x[:, :, None].expand(b, kv, num_heads // kv, s, d).reshape(b, num_heads, s, d)


class LlamaAttention(nn.Module):
    """Grouped-query causal attention with rotary embeddings; an additive bias replaces the causal flag."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        kv_size = config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor | None = None) -> Tensor:
        q = apply_rotary(split_heads(self.q_proj(x), self.num_heads), cos, sin)  # (B, H, S, D)
        k = apply_rotary(split_heads(self.k_proj(x), self.num_kv_heads), cos, sin)  # (B, KV, S, D)
        v = split_heads(self.v_proj(x), self.num_kv_heads)
        k, v = repeat_kv(k, self.num_heads), repeat_kv(v, self.num_heads)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=bias is None)
        return self.o_proj(merge_heads(y))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = LlamaAttention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, bias: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, bias)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama-family decoder (Llama 2/3, Mistral): forward(input_ids, labels) -> loss, or logits without labels."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def logits(self, input_ids: Tensor, bias: Tensor | None = None) -> Tensor:
        """(B, S) token ids -> (B, S, V) logits; bias is an additive (B, 1, S, S) mask, causal when None."""
        x = self.embed_tokens(input_ids)  # (B, S, hidden)
        cos, sin = rotary_tables(input_ids.shape[1], self.config.head_dim, self.config.rope_theta, x.device)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, bias)
        return self.lm_head(self.norm(x))

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> Tensor:
        logits = self.logits(input_ids)
        return logits if labels is None else lm_loss(logits, labels)


class LlamaStage(nn.Module):
    """A pipeline stage of a :class:`Llama`, cut as torchtitan cuts it: layers [first, end) under
    their own names (``layers.3`` stays ``layers.3``, so a stage plan applies), the embeddings on
    the first stage, the final norm and head on the last (which returns logits). `seq_len`: the
    whole sequence, for the rotary tables (a later stage may receive sequence-parallel shards)."""

    def __init__(self, model: Llama, first: int, end: int, is_first: bool, is_last: bool, seq_len: int) -> None:
        super().__init__()
        self.config = model.config
        self.seq_len = seq_len
        self.embed_tokens = model.embed_tokens if is_first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(first, end)})
        self.norm = model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        cos, sin = rotary_tables(self.seq_len, self.config.head_dim, self.config.rope_theta, h.device)
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin, None)
        return self.lm_head(self.norm(h)) if self.lm_head is not None else h


@dataclass(frozen=True)
class CausalLMOutput:
    loss: Tensor
    logits: Tensor


def padding_causal_bias(attention_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, S) mask, 1 = token and 0 = padding -> additive (B, 1, S, S) bias: 0 where attention is allowed, else dtype min."""
    s = attention_mask.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()  # (S, S)
    allowed = causal & attention_mask[:, None, None, :].bool()  # (B, 1, S, S)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=attention_mask.device)
    return bias.masked_fill(~allowed, torch.finfo(dtype).min)


class KwargsLlama(Llama):
    """Llama called HF-style with keyword inputs only, returning an output object with .loss and .logits."""

    def forward(self, *, input_ids: Tensor, attention_mask: Tensor, labels: Tensor) -> CausalLMOutput:
        logits = self.logits(input_ids, padding_causal_bias(attention_mask, self.embed_tokens.weight.dtype))
        return CausalLMOutput(loss=lm_loss(logits, labels), logits=logits)


# ----------------------------------------------------------------------------- GPT-2


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.dropout = config.n_head, config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (split_heads(t, self.n_head) for t in self.c_attn(x).chunk(3, dim=-1))  # each (B, H, S, D)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(merge_heads(y)))


class GPTMLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class GPTBlock(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = GPTMLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 decoder with learned positions and a tied lm_head: forward(idx, targets) -> loss."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(GPTBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        nn.init.normal_(self.wte.weight, std=0.02)  # GPT-2 init: N(0, 1) rows would make tied logits huge

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)  # (S,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, S, E)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits if targets is None else lm_loss(logits, targets)


# ----------------------------------------------------------------------------- BERT-style encoder


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    max_positions: int = 512
    norm_eps: float = 1e-12


class EncoderAttention(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.q = nn.Linear(config.hidden_size, config.hidden_size)
        self.k = nn.Linear(config.hidden_size, config.hidden_size)
        self.v = nn.Linear(config.hidden_size, config.hidden_size)
        self.o = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (split_heads(proj(x), self.num_heads) for proj in (self.q, self.k, self.v))  # each (B, H, S, D)
        return self.o(merge_heads(F.scaled_dot_product_attention(q, k, v)))


class EncoderBlock(nn.Module):
    """Post-LN transformer block, as in BERT."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.attn = EncoderAttention(config)
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.ffn = nn.Sequential(
            nn.Linear(config.hidden_size, config.intermediate_size),
            nn.GELU(),
            nn.Linear(config.intermediate_size, config.hidden_size),
        )
        self.ffn_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        x = self.attn_norm(x + self.attn(x))
        return self.ffn_norm(x + self.ffn(x))


class Encoder(nn.Module):
    """BERT-style encoder with a masked-LM head tied to the word embeddings: forward(input_ids, labels) -> loss."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_positions, config.hidden_size)
        self.embed_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.layers = nn.ModuleList(EncoderBlock(config) for _ in range(config.num_layers))
        self.mlm_head = nn.Sequential(
            nn.Linear(config.hidden_size, config.hidden_size),
            nn.GELU(),
            nn.LayerNorm(config.hidden_size, eps=config.norm_eps),
        )
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.decoder.weight = self.word_embeddings.weight
        nn.init.normal_(self.word_embeddings.weight, std=0.02)  # BERT init: N(0, 1) rows would make tied logits huge

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)  # (S,)
        x = self.embed_norm(self.word_embeddings(input_ids) + self.position_embeddings(pos))  # (B, S, hidden)
        for layer in self.layers:
            x = layer(x)
        logits = self.decoder(self.mlm_head(x))
        return logits if labels is None else lm_loss(logits, labels)


# ----------------------------------------------------------------------------- ResNet


@dataclass(frozen=True)
class ConvNetConfig:
    channels: tuple[int, ...] = (64, 128, 256, 512)
    blocks: tuple[int, ...] = (2, 2, 2, 2)
    num_classes: int = 1000
    in_channels: int = 3


class BasicBlock(nn.Module):
    """conv-bn-relu-conv-bn plus a skip connection, projected by a strided 1x1 conv+bn when the shape changes."""

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or in_channels != channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, channels, 1, stride, bias=False), nn.BatchNorm2d(channels)
            )

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.downsample(x))


class ConvNet(nn.Module):
    """ResNet with BasicBlocks; every stage after the first halves the image side: forward(images, targets) -> loss."""

    def __init__(self, config: ConvNetConfig) -> None:
        super().__init__()
        self.config = config
        c0 = config.channels[0]
        self.stem = nn.Sequential(
            nn.Conv2d(config.in_channels, c0, 3, padding=1, bias=False), nn.BatchNorm2d(c0), nn.ReLU()
        )
        stages, in_channels = [], c0
        for i, (channels, n) in enumerate(zip(config.channels, config.blocks, strict=True)):
            blocks = [BasicBlock(in_channels, channels, 1 if i == 0 else 2)]
            blocks += [BasicBlock(channels, channels, 1) for _ in range(n - 1)]
            stages.append(nn.Sequential(*blocks))
            in_channels = channels
        self.stages = nn.ModuleList(stages)
        self.fc = nn.Linear(in_channels, config.num_classes)

    def forward(self, images: Tensor, targets: Tensor | None = None) -> Tensor:
        x = self.stem(images)  # (B, C0, H, W)
        for stage in self.stages:
            x = stage(x)
        logits = self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))  # (B, classes)
        return logits if targets is None else F.cross_entropy(logits, targets)


# ----------------------------------------------------------------------------- MLP


@dataclass(frozen=True)
class MLPConfig:
    in_features: int
    hidden: int
    num_layers: int
    out_features: int


class MLPBlock(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.norm = nn.LayerNorm(out_features)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(F.gelu(self.linear(x)))


class MLP(nn.Module):
    """Stack of Linear+GELU+LayerNorm blocks and a linear head: forward(x, target) -> MSE loss."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        widths = [config.in_features] + [config.hidden] * config.num_layers
        self.layers = nn.ModuleList(MLPBlock(a, b) for a, b in zip(widths, widths[1:]))
        self.head = nn.Linear(config.hidden, config.out_features)

    def forward(self, x: Tensor, target: Tensor | None = None) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        y = self.head(x)  # (B, S, out)
        return y if target is None else F.mse_loss(y, target)


def random_tokens(batch_size: int, seq_len: int, vocab_size: int) -> tuple[Tensor, Tensor]:
    """Random (B, S) input ids and aligned labels."""
    return (
        torch.randint(0, vocab_size, (batch_size, seq_len)),
        torch.randint(0, vocab_size, (batch_size, seq_len)),
    )
