"""Baseline strategies (none, full, every-N, sqrt, selective) as fixed rules over a model's blocks."""

from __future__ import annotations

import math

import numpy as np

from planner.simulation.effects import ModuleSpan, SpanChoice, module_span
from planner.solver.options import attention_core_choice
from planner.tracing.graph import OpGraph

__all__ = ["STRATEGIES", "parse_every", "check_strategy", "strategy_choices", "block_spans"]

STRATEGIES = ("optimal", "none", "full", "every-N", "sqrt", "selective")


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
            raise ValueError(f"strategy '{strategy}' needs a positive N, e.g. every-2")
        return n
    return None


def check_strategy(strategy: str) -> None:
    if strategy in STRATEGIES and strategy != "every-N":
        return
    if parse_every(strategy) is None:
        raise ValueError(f"unknown strategy '{strategy}'; choose one of: optimal, none, full, every-N "
                         "(e.g. every-2), sqrt, selective")


def strategy_choices(graph: OpGraph, strategy: str) -> list[SpanChoice]:
    """Baseline strategies, all at block granularity.

    full: every block recomputed. every-N: every N-th block. sqrt: all but about sqrt(L) evenly
    spaced blocks recomputed, so that about sqrt(L) blocks keep their activations (Chen et al.'s
    O(sqrt L) memory target at block granularity). selective: recompute only the attention core
    of every block (Megatron-LM's selective activation recomputation).
    """
    check_strategy(strategy)
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
    if strategy == "selective":
        out = []
        for s in spans:
            choice = attention_core_choice(graph, s)
            if choice is not None:
                out.append(choice)
        return out
    raise ValueError(f"strategy '{strategy}' is solved by solve_choices, not a fixed rule")
