"""Test-only: a small torchtitan-style decoder (tok_embeddings, attention.wq/wk/wv/wo,
feed_forward.w1/w2/w3, attention_norm/ffn_norm, norm, output), written as torchtitan writes it
(heads from the local width: ``view(bs, seqlen, -1, head_dim)``), not for the simulator."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = rotary(xq, freqs_cis), rotary(xk, freqs_cis)
        n_rep = xq.shape[2] // xk.shape[2]
        xk, xv = xk.repeat_interleave(n_rep, dim=2), xv.repeat_interleave(n_rep, dim=2)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


def rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3).type_as(x)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads, n_kv_heads, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seqlen = tokens.shape[1]
        freqs = 1.0 / (10000.0 ** (torch.arange(0, self.head_dim, 2, device=tokens.device).float() / self.head_dim))
        freqs_cis = torch.polar(torch.ones(seqlen, freqs.numel()), torch.outer(torch.arange(seqlen).float(), freqs))
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, freqs_cis)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def titan_small(batch_size: int, seq_len: int):
    """2 layers, dim 128, 8 query / 4 key-value heads, vocab 512."""
    model = Transformer(512, 128, 2, 8, 4, 384)
    tokens = torch.randint(0, 512, (batch_size, seq_len))
    return model, (tokens, torch.roll(tokens, -1, dims=1))


def titan_uneven_vocab(batch_size: int, seq_len: int):
    """titan_small with a vocabulary of 509: TP shards of the embeddings and head are uneven."""
    model = Transformer(509, 128, 2, 8, 4, 384)
    tokens = torch.randint(0, 509, (batch_size, seq_len))
    return model, (tokens, torch.roll(tokens, -1, dims=1))


class EncoderLM(nn.Module):
    """A causal language model on torch's nn.TransformerEncoder (nn.MultiheadAttention, linear1 /
    linear2 on the layer), batch first or sequence first."""

    def __init__(self, batch_first: bool, vocab: int = 128, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed_tokens = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens)
        h = h if self.batch_first else h.transpose(0, 1)
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        h = self.encoder(h, mask=causal, is_causal=True)
        h = h if self.batch_first else h.transpose(0, 1)
        return F.cross_entropy(self.lm_head(h).flatten(0, 1), labels.flatten())


def encoder_lm(batch_size: int, seq_len: int):
    tokens = torch.randint(0, 128, (batch_size, seq_len))
    return EncoderLM(batch_first=True), (tokens, torch.roll(tokens, -1, dims=1))


def encoder_lm_sequence_first(batch_size: int, seq_len: int):
    tokens = torch.randint(0, 128, (batch_size, seq_len))
    return EncoderLM(batch_first=False), (tokens, torch.roll(tokens, -1, dims=1))


class _VisionEncoderBlock(nn.Module):
    """torchvision's ViT ``EncoderBlock``: ln_1, an nn.MultiheadAttention, ln_2, and its ``MLPBlock``
    (an nn.Sequential of Linear, GELU, Dropout, Linear, Dropout)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.self_attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.0), nn.Linear(4 * dim, dim), nn.Dropout(0.0)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.self_attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class VisionTransformer(nn.Module):
    """torchvision's ViT layout: a patch convolution, a class token, learned positions, encoder blocks."""

    def __init__(self, dim: int = 64, heads: int = 4, patch: int = 4, image: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.conv_proj = nn.Conv2d(3, dim, patch, stride=patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embedding = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, dim))
        self.layers = nn.Sequential(*(_VisionEncoderBlock(dim, heads) for _ in range(2)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embedding
        return F.cross_entropy(self.head(self.ln(self.layers(x))[:, 0]), labels)


def vision_transformer(batch_size: int, seq_len: int):
    """seq_len is unused: 16x16 images in 4x4 patches."""
    return VisionTransformer(), (torch.randn(batch_size, 3, 16, 16), torch.randint(0, 10, (batch_size,)))


class ScaledMLP(nn.Module):
    """Two linear layers with a learnable scalar between them (as xIELU's alphas): a tensor-parallel
    plan that shards the linears and leaves the scalar replicated gives each rank a partial gradient."""

    def __init__(self, learnable_scale: bool, dim: int = 32) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.scale = nn.Parameter(torch.ones(())) if learnable_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(x))
        return self.down(h * self.scale if self.scale is not None else h).pow(2).mean()


def scaled_mlp(batch_size: int, seq_len: int):
    return ScaledMLP(learnable_scale=True), (torch.randn(batch_size, seq_len, 32),)


def plain_mlp(batch_size: int, seq_len: int):
    return ScaledMLP(learnable_scale=False), (torch.randn(batch_size, seq_len, 32),)


def mlp_plan(model: nn.Module, tp_mesh) -> None:
    """The linears column- then row-parallel; nothing else (a user's plan)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
