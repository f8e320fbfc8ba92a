"""Baseline strategies (none, full, every-N, sqrt, op-sac, op-sac-alt, megatron-selective) as fixed rules
over a model's blocks."""

from __future__ import annotations

import math

import numpy as np

from planner.errors import MemplanError
from planner.simulation.effects import ModuleSpan, SpanChoice, module_span
from planner.solver.policies import (
    attention_core_choice,
    op_sac_alt_choice,
    op_sac_choice,
)
from planner.tracing.graph import OpGraph

__all__ = [
    "ALIASES",
    "STRATEGIES",
    "block_spans",
    "check_strategy",
    "parse_every",
    "strategy_choices",
]

STRATEGIES = (
    "optimal",
    "none",
    "full",
    "every-N",
    "sqrt",
    "op-sac",
    "op-sac-alt",
    "megatron-selective",
    "selective",
)
# Older names that mean the same strategy.
ALIASES = {"selective": "megatron-selective"}


# -- helpers ------------------------------------------------------------------------------------
def block_spans(graph: OpGraph) -> list[ModuleSpan]:
    return [module_span(graph, r.path) for r in graph.regions]


def parse_every(strategy: str) -> int | None:
    if strategy.startswith("every-"):
        try:
            n = int(strategy.split("-", 1)[1])
        except ValueError:
            n = 0
        if n <= 0:
            raise MemplanError(f"strategy '{strategy}' needs a positive N, e.g. every-2")
        return n
    return None


def check_strategy(strategy: str) -> None:
    if strategy in STRATEGIES and strategy != "every-N":
        return
    if parse_every(strategy) is None:
        raise MemplanError(
            f"unknown strategy '{strategy}'; choose one of: optimal, none, full, every-N "
            "(e.g. every-2), sqrt, op-sac, op-sac-alt, megatron-selective"
        )


def strategy_choices(graph: OpGraph, strategy: str) -> list[SpanChoice]:
    """Baseline strategies, all at block granularity.

    full: every block recomputed. every-N: every N-th block. sqrt: all but about sqrt(L) evenly
    spaced blocks recomputed, so that about sqrt(L) blocks keep their activations (Chen et al.'s
    O(sqrt L) memory target at block granularity). op-sac: torch's op-level selective checkpointing
    in every block (keep matmul, convolution and attention outputs). op-sac-alt: torchtitan's
    variant, which also recomputes every second matmul. megatron-selective (alias selective):
    recompute only the attention core of every block (Megatron-LM's selective recompute).
    """
    check_strategy(strategy)
    strategy = ALIASES.get(strategy, strategy)
    spans = block_spans(graph)
    if strategy == "none":
        return []
    if strategy == "full":
        return [SpanChoice(s, "recompute") for s in spans]
    every = parse_every(strategy)
    if every is not None:
        return [SpanChoice(s, "recompute") for k, s in enumerate(spans) if k % every == 0]
    if strategy == "sqrt":
        kept = set(np.linspace(0, len(spans) - 1, max(1, round(math.sqrt(len(spans))))).round().astype(int).tolist())
        return [SpanChoice(s, "recompute") for k, s in enumerate(spans) if k not in kept]
    if strategy == "op-sac":
        return [op_sac_choice(graph, s) for s in spans]
    if strategy == "op-sac-alt":
        return [op_sac_alt_choice(graph, s) for s in spans]
    if strategy == "megatron-selective":
        return [c for c in (attention_core_choice(graph, s) for s in spans) if c is not None]
    raise MemplanError(f"strategy '{strategy}' is solved by solve_choices, not a fixed rule")
