"""Mixture-of-experts routing under an explicit assumption.

A router's top-k over expert scores decides how many tokens each expert gets; on fake tensors
there are no scores. memplan assumes the routing instead: balanced by default (every expert gets
tokens x top-k / experts rows), or with the busiest expert getting `imbalance` times that mean
and the others sharing the rest evenly. Summed over experts the routed rows are tokens x top-k
whatever the routing, so activations saved for backward do not depend on it; only the transients
of the busiest expert do.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

import torch

from memplan_compat import disable_current_modes
from planner.errors import MemplanError

__all__ = ["RoutingAssumption", "describe_routing", "routed_indices"]


def routed_indices(tokens: int, experts: int, top_k: int, imbalance: float) -> torch.Tensor:
    """(tokens, top_k) expert indices, distinct per token: expert 0 is chosen by
    round(imbalance x tokens x top_k / experts) tokens (at most every token), the other experts
    round-robin over the remaining choices (a new real tensor each call, also inside a trace)."""
    with disable_current_modes():
        return _routed_indices(tokens, experts, top_k, imbalance).clone()


@functools.lru_cache(maxsize=16)
def _routed_indices(tokens: int, experts: int, top_k: int, imbalance: float) -> torch.Tensor:
    # every router of every trace asks (61 layers of 8192 tokens for DeepSeek-V3): computed once
    if top_k >= experts or experts < 2:
        return torch.arange(top_k).repeat(tokens, 1) % experts
    busiest = min(tokens, max(0, round(imbalance * tokens * top_k / experts)))
    token = torch.arange(tokens).unsqueeze(1)
    busy = (token < busiest).long()  # these tokens pick expert 0 first
    # the round-robin choices made before this token's: top_k per token, one fewer per busy token
    cursor = token * top_k - torch.clamp(token, max=busiest)
    slot = torch.arange(top_k).unsqueeze(0)
    others = 1 + (cursor + slot - busy) % (experts - 1)
    return torch.where((slot == 0) & (busy == 1), 0, others)


@dataclass
class RoutingAssumption:
    """What memplan assumes about routing, and how many router top-k ops it answered."""

    imbalance: float = 1.0
    routers: int = 0
    experts: int = 0
    top_k: int = 0
    tokens: int = 0

    def __post_init__(self) -> None:
        if not self.imbalance >= 1.0:
            raise MemplanError(f"--moe-imbalance must be at least 1.0 (1.0 = balanced), got {self.imbalance!r}")

    def __call__(self, func: Any, args: tuple, out: Any) -> list[torch.Tensor | None] | None:
        """Shadow for a top-k over the last dimension of float scores: the assumed indices."""
        if str(func) != "aten.topk.default":
            return None
        scores, k = args[0], int(args[1])
        dim = int(args[2]) if len(args) > 2 else -1
        if not scores.is_floating_point() or dim not in (-1, scores.dim() - 1) or scores.dim() < 1:
            return None
        experts = int(scores.shape[-1])
        tokens = int(scores.numel()) // experts
        self.routers += 1
        self.experts, self.top_k, self.tokens = experts, k, tokens
        indices = routed_indices(tokens, experts, k, self.imbalance).reshape(*scores.shape[:-1], k)
        return [None, indices]

    def busiest_rows(self) -> int:
        if not self.experts:
            return 0
        return int(routed_indices(self.tokens, self.experts, self.top_k, self.imbalance).eq(0).sum())

    def to_dict(self) -> dict:
        """What goes into the trace's meta, the JSON and the plan."""
        d = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        d["busiest_expert_rows"] = self.busiest_rows()
        d["mean_rows_per_expert"] = self.tokens * self.top_k / self.experts if self.experts else 0
        return d


def describe_routing(routing: dict) -> str:
    """One line for a RoutingAssumption.to_dict(): what the trace assumed."""
    imbalance = routing["imbalance"]
    kind = "balanced" if imbalance == 1.0 else f"imbalance {imbalance:g}"
    return (
        f"MoE routing assumed {kind} (--moe-imbalance): {routing['routers']} routers, "
        f"{routing['tokens']} tokens x top-{routing['top_k']} over {routing['experts']} experts, "
        f"{routing['mean_rows_per_expert']:g} rows per expert on average, "
        f"{routing['busiest_expert_rows']} for the busiest"
    )
