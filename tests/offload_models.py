"""Test-only models and plans for offload: a gated residual block and hand-made offload plans."""

from __future__ import annotations

import torch
from torch import nn

from planner.plans.format import Decision, Plan, Predicted, SolverInfo
from planner.plans.identity import model_info

CONFIG = {
    "batch_size": 2,
    "seq_len": 4,
    "precision": "fp32",
    "optimizer": "adamw",
    "zero_stage": 0,
    "dp": 1,
    "gpu": "cpu",
}


class Gated(nn.Module):
    """x + tanh(alpha) * f(x): autograd saves tanh(alpha), a 0-d tensor."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.f = nn.Linear(d, d)
        self.alpha = nn.Parameter(torch.tensor(0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.alpha) * self.f(x)


class GatedNet(nn.Module):
    """Embedding, a bool mask, a non-contiguous view, integer gather indices and gated blocks."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, d)
        self.blocks = nn.ModuleList([Gated(d) for _ in range(2)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) * (idx > 3).unsqueeze(-1)  # a bool tensor is saved
        x = x.transpose(0, 1)[1:]  # a non-contiguous view
        x = torch.gather(x, 2, (idx.T[1:] % x.shape[2]).unsqueeze(-1).expand_as(x))  # int64 index saved
        for block in self.blocks:
            x = block(x)
        return x.square().sum()


def offload_plan(model: nn.Module, paths: list[str], target: str) -> Plan:
    decisions = tuple(Decision(p, "offload", target=target) for p in paths)
    return Plan(
        model_info(model, "gated"),
        CONFIG,
        0,
        "test",
        decisions,
        Predicted(0, 0, 0, 0.0, 0, 0.0, 0.0, 0.0),
        SolverInfo("NOT_SOLVED", 0.0, 0.0, 0.0, 0.0),
    )
