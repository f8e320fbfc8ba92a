"""Test-only model builders (spec strings f"{__file__}:NAME"): activation-dominated configs.

Each FUNC(batch_size=, seq_len=) returns (model, inputs) like planner.tracing.specs presets.
"""

from __future__ import annotations

import torch
from torch import nn

from planner.tracing.models import (
    GPT,
    ConvNet,
    ConvNetConfig,
    GPTConfig,
    Llama,
    LlamaConfig,
    lm_loss,
)

PATH = __file__


def _tokens(batch_size: int, seq_len: int, vocab: int):
    return (torch.randint(0, vocab, (batch_size, seq_len)), torch.randint(0, vocab, (batch_size, seq_len)))


def llama_small(batch_size: int, seq_len: int):
    """Llama: vocab 64, hidden 128, 4 layers, 4 heads (2 kv heads)."""
    config = LlamaConfig(64, 128, 256, 4, 4, 2)
    return Llama(config), _tokens(batch_size, seq_len, 64)


def gpt_small(batch_size: int, seq_len: int):
    """GPT-2 shaped: vocab 64, 4 layers, 64 wide, 4 heads, 256 positions."""
    config = GPTConfig(vocab_size=64, block_size=256, n_layer=4, n_head=4, n_embd=64)
    return GPT(config), _tokens(batch_size, seq_len, 64)


def resnet_small(batch_size: int, seq_len: int):
    """ResNet-ish: 2 stages of 3 blocks, 16-32 channels; seq_len is the image side. The strided 1x1
    shortcut has 16 input channels: fewer reach oneDNN's faulty kernel (docs/safety.md)."""
    config = ConvNetConfig(channels=(16, 32), blocks=(3, 3), num_classes=10)
    images = torch.randn(batch_size, 3, seq_len, seq_len)
    return ConvNet(config), (images, torch.randint(0, 10, (batch_size,)))


class RandomBlock(nn.Module):
    """Linear -> activation -> (norm) -> Dropout(0) with a residual."""

    def __init__(self, width: int, hidden: int, act: str, norm: bool) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.act = {"gelu": nn.GELU(), "relu": nn.ReLU(), "tanh": nn.Tanh(), "silu": nn.SiLU()}[act]
        self.down = nn.Linear(hidden, width)
        self.norm = nn.LayerNorm(width) if norm else nn.Identity()
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return x + self.drop(self.norm(self.down(self.act(self.up(x)))))


class RandomNet(nn.Module):
    def __init__(self, width: int, blocks: list[tuple[int, str, bool]]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(RandomBlock(width, h, a, n) for h, a, n in blocks)
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def random_net(width: int, blocks: list[tuple[int, str, bool]], batch_size: int, seq_len: int):
    return RandomNet(width, blocks), (torch.randn(batch_size, seq_len, width),)


def flat_sequential(batch_size: int, seq_len: int):
    """A flat nn.Sequential: 16 repeats of (Linear 64, GELU), then a head."""
    layers = []
    for _ in range(16):
        layers += [nn.Linear(64, 64), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(64, 1)), (torch.randn(batch_size, seq_len, 64),)


class TwoLayer(nn.Module):
    """No blocks: two Linear layers of different shapes and a cross-entropy loss."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(64, 256)
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(torch.relu(self.inner(x))), y)


def two_layer(batch_size: int, seq_len: int):
    return TwoLayer(), (torch.randn(batch_size * seq_len, 64), torch.randint(0, 10, (batch_size * seq_len,)))


class _TableBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x) + table)))  # the add saves no input


class SharedTableNet(nn.Module):
    """Blocks that all read one table made before them and saved by none (as some rotary
    embeddings are): each checkpointed block holds it, and the table is one storage."""

    def __init__(self, vocab: int = 64, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.register_buffer("freqs", torch.linspace(0.1, 1.0, width), persistent=False)
        self.layers = nn.ModuleList(_TableBlock(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device, dtype=self.freqs.dtype)
        table = torch.sin(positions[:, None] * self.freqs)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, table)
        return lm_loss(self.head(self.norm(x)), targets)


def shared_table(batch_size: int, seq_len: int):
    """SharedTableNet: vocab 64, width 64, 4 blocks."""
    return SharedTableNet(), _tokens(batch_size, seq_len, 64)


class DropoutAttentionNet(nn.Module):
    """One causal self-attention layer whose SDPA call uses attention dropout (as GPT-2's does)."""

    def __init__(self, vocab: int = 64, width: int = 64, heads: int = 4, dropout_p: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.head = nn.Linear(width, vocab)
        self.heads, self.dropout_p = heads, dropout_p

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, s, w = x.shape
        q, k, v = (t.view(b, s, self.heads, w // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        dropout_p = self.dropout_p if self.training else 0.0
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return lm_loss(self.head(x + att.transpose(1, 2).reshape(b, s, w)), targets)


def dropout_attention(batch_size: int, seq_len: int):
    """DropoutAttentionNet: vocab 64, width 64, 4 heads, attention dropout 0.1."""
    return DropoutAttentionNet(), _tokens(batch_size, seq_len, 64)


class _ChannelsFirstBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, width, seq), a permuted view
        y = self.mlp(self.norm(x.permute(0, 2, 1)))
        return x + y.permute(0, 2, 1)  # as ConvNeXt's blocks: the result keeps the permuted layout


class ChannelsFirstNet(nn.Module):
    """Blocks that take and return a non-contiguous (batch, width, seq) feature map, as a vision
    model's permutes leave it: what crosses a pipeline cut is not contiguous."""

    def __init__(self, vocab: int = 64, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(_ChannelsFirstBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).permute(0, 2, 1)
        for layer in self.layers:
            x = layer(x)
        return lm_loss(self.head(x.permute(0, 2, 1)), targets)


def channels_first(batch_size: int, seq_len: int):
    """ChannelsFirstNet: vocab 64, width 64, 4 blocks."""
    return ChannelsFirstNet(), _tokens(batch_size, seq_len, 64)


class _SquaredTanh(torch.autograd.Function):
    """tanh(x)², saving only its input (as Bloom's GeLU saves only its input)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.tanh(x) ** 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        t = torch.tanh(x)
        return grad * 2 * t * (1 - t * t)


class _FunctionBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(_SquaredTanh.apply(self.up(x)))


class CustomFunctionNet(nn.Module):
    """Blocks whose activation is a custom autograd Function."""

    def __init__(self, vocab: int = 64, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(_FunctionBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return lm_loss(self.head(x), targets)


def custom_function(batch_size: int, seq_len: int):
    """CustomFunctionNet: vocab 64, width 64, 4 blocks."""
    return CustomFunctionNet(), _tokens(batch_size, seq_len, 64)
