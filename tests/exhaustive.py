"""Brute-force search over every combination of block options: the reference the solver is tested against."""

from __future__ import annotations

import itertools

from costmodels.hardware import get_device
from planner.config import TrainConfig
from planner.simulation.costs import op_times
from planner.simulation.step import simulate
from planner.solver.cpsat import _problem
from planner.tracing.graph import OpGraph


def exhaustive_solve(
    graph: OpGraph, config: TrainConfig, budget_bytes: int, offload: str | None = None
) -> tuple[float, list[str]] | None:
    """Brute force over every combination of block options (tests only: exponential)."""
    times = op_times(graph, get_device(config.gpu))
    p = _problem(graph, config, offload, set(), set(), times, hide_in_communication=True)
    best: tuple[float, list[str]] | None = None
    for combo in itertools.product(*[range(len(o)) for o in p.options]):
        # recompute (beyond its block's communication wait) and load seconds: a lower bound on the
        # added time (an offload's store may stall)
        cost = sum(0.0 if p.effects[r][k] is None else p.effects[r][k].added_s for r, k in enumerate(combo))
        if best is not None and cost >= best[0]:
            continue
        choices = [p.options[r][k].choice for r, k in enumerate(combo) if p.options[r][k].choice is not None]
        timeline = simulate(graph, config, choices=choices)
        added_s = timeline.costs.added_s
        if timeline.peak_bytes <= budget_bytes and (best is None or added_s < best[0]):
            best = (added_s, [p.options[r][k].name for r, k in enumerate(combo)])
    return best
