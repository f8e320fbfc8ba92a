"""Route a real model's tokens as the trace assumed (``--moe-imbalance``), for verification runs.

A trace on fake tensors has no router scores; memplan answers each router's top-k from an explicit
assumption (planner/tracing/moe.py). To compare a real run with that prediction, the run must route
the same way: inside :func:`assumed_routing` every top-k a router runs over expert scores returns the
assumed experts (their scores gathered, so gradients flow through them as through top-k).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from memplan_compat import TorchDispatchMode, disable_current_modes
from planner.tracing.moe import RoutingAssumption

__all__ = ["assumed_routing"]


class _AssumedTopK(TorchDispatchMode):
    def __init__(self, routing: RoutingAssumption) -> None:
        super().__init__()
        self.routing = routing

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) != "aten.topk.default" or any(t is not torch.Tensor for t in types):
            return out
        with disable_current_modes():
            routed = self.routing(func, args, out)
        if routed is None:
            return out
        indices = routed[1].to(args[0].device)
        return args[0].gather(-1, indices), indices


@contextmanager
def assumed_routing(imbalance: float) -> Iterator[RoutingAssumption]:
    """While inside, routers pick experts as memplan's routing assumption says (1.0: balanced)."""
    routing = RoutingAssumption(imbalance)
    with _AssumedTopK(routing):
        yield routing
