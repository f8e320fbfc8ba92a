"""Test-only: a small torchtitan-style mixture-of-experts decoder, written as torchtitan writes its MoE
(``torchtitan/models/moe``: a token-choice top-k router, grouped experts with every expert on dim 0
of w1/w2/w3 run by ``forward(x, num_tokens_per_expert)``, a shared expert, scores applied before
the experts, outputs scattered back), not for the simulator."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


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


class GroupedExperts(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.randn(num_experts, hidden, dim) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, dim, hidden) * hidden**-0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, hidden, dim) * dim**-0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # torchtitan: expert parallel hands plain local shards to dynamic-shape inputs
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        counts = num_tokens_per_expert.tolist()
        outs = []
        for i, x_expert in enumerate(torch.split(x[: sum(counts)], counts, dim=0)):
            h = F.silu(torch.matmul(x_expert, w1[i].transpose(-2, -1))) * torch.matmul(
                x_expert, w3[i].transpose(-2, -1)
            )
            outs.append(torch.matmul(h, w2[i].transpose(-2, -1)))
        return torch.cat(outs, dim=0)


class TokenChoiceTopKRouter(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts, self.top_k = num_experts, top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.gate(x).to(torch.float32))
        top_scores, selected = torch.topk(scores, k=self.top_k, dim=1)
        top_scores = top_scores / top_scores.sum(dim=-1, keepdim=True)
        num_tokens_per_expert = torch.bincount(selected.view(-1), minlength=self.num_experts)
        return top_scores, selected, num_tokens_per_expert


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.router = TokenChoiceTopKRouter(dim, num_experts, top_k)
        self.experts = GroupedExperts(dim, hidden, num_experts)
        self.shared_experts = FeedForward(dim, hidden)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        top_scores, selected, num_tokens_per_expert = self.router(x)
        order = torch.argsort(selected.view(-1), stable=True)
        token_indices = order // self.top_k
        routed_input = x[token_indices]
        routed_input = (routed_input.to(torch.float32) * top_scores.view(-1)[order].reshape(-1, 1)).to(x.dtype)
        routed_output = self.experts(routed_input, num_tokens_per_expert)
        out = self.shared_experts(x)
        out = out.scatter_add(0, token_indices.reshape(-1, 1).expand(-1, dim), routed_output)
        return out.reshape(bs, slen, dim)


class MoEBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.moe = MoE(dim, hidden, num_experts, top_k)
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.moe(self.ffn_norm(h))


class MoETransformer(nn.Module):
    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            MoEBlock(dim, n_heads, n_heads // 2, hidden, num_experts, top_k) for _ in range(n_layers)
        )
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


def titan_moe(batch_size: int, seq_len: int):
    """2 layers, dim 64, 4 heads, 4 experts top-2 (hidden 128) and a shared expert, vocab 512."""
    model = MoETransformer(512, 64, 2, 4, 128, 4, 2)
    tokens = torch.randint(0, 512, (batch_size, seq_len))
    return model, (tokens, torch.roll(tokens, -1, dims=1))
