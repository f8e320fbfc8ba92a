"""From a traced graph and a budget to a :class:`Plan` (solver or baseline strategy)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from planner.config import DEFAULT_TIME_LIMIT_S, TrainConfig
from planner.errors import InfeasibleBudget, SpecError
from planner.plans.format import Decision, ModelInfo, Plan, Predicted, SolverInfo
from planner.simulation.costs import StepCosts
from planner.simulation.effects import SpanChoice, effective_keeps, op_keys
from planner.simulation.step import simulate
from planner.solver.baselines import check_strategy, strategy_choices
from planner.solver.cpsat import solve_choices
from planner.tracing.graph import OpGraph
from planner.units import over_budget

__all__ = ["solve", "decisions_for", "graph_model_info", "make_plan", "StrategyRow", "compare_strategies", "BASELINES"]

BASELINES = ("none", "full", "every-2", "sqrt", "op-sac", "op-sac-alt", "megatron-selective")


def decisions_for(graph: OpGraph, choices: Sequence[SpanChoice]) -> tuple[Decision, ...]:
    """Plan decisions that reproduce span choices (op-level keeps for selective recompute)."""
    out: list[Decision] = []
    for c in sorted(choices, key=lambda c: c.span.fwd_start):
        if c.mode == "offload":
            out.append(Decision(c.span.path, "offload", None, c.target))
            continue
        out.append(Decision(c.span.path, "recompute", None, None))
        keys = op_keys(graph, c.span)
        out += [Decision(c.span.path, "keep", keys[i], None) for i in sorted(effective_keeps(graph, c))]
    return tuple(out)


def graph_model_info(graph: OpGraph) -> ModelInfo:
    """Which model a trace is of, as a plan records it."""
    meta = graph.meta
    return ModelInfo(
        spec=str(meta.get("model", "model")),
        fingerprint=meta["fingerprint"],
        num_parameters=graph.num_parameters,
        num_modules=int(meta["num_modules"]),
    )


def make_plan(
    graph: OpGraph,
    config: TrainConfig,
    budget_bytes: int,
    strategy: str,
    choices: Sequence[SpanChoice],
    peak_bytes: int,
    costs: StepCosts,
    baseline_peak: int,
    solver: SolverInfo,
) -> Plan:
    """The plan file's content for span choices with their predicted peak and costs."""
    return Plan(
        model=graph_model_info(graph),
        config={**config.to_dict(), **graph.assumptions()},
        budget_bytes=int(budget_bytes),
        strategy=strategy,
        decisions=decisions_for(graph, choices),
        predicted=Predicted(
            peak_bytes=peak_bytes,
            baseline_peak_bytes=baseline_peak,
            recompute_flops=costs.recompute_flops,
            recompute_s=costs.recompute_s,
            offload_bytes=costs.offload_bytes,
            exposed_offload_s=costs.exposed_offload_s,
            step_s=costs.step_s,
            overhead=costs.overhead,
            hidden_recompute_s=costs.hidden_recompute_s,
        ),
        solver=solver,
    )


def solve(
    graph: OpGraph,
    config: TrainConfig,
    budget_bytes: int,
    *,
    strategy: str = "optimal",
    offload: str | None = None,
    keep: Sequence[str] = (),
    recompute: Sequence[str] = (),
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
) -> Plan:
    """The plan of a strategy under a budget; `optimal` asks CP-SAT for the cheapest one.

    Raises InfeasibleBudget (a ValueError naming the smallest reachable peak) when nothing fits.
    """
    if config.compile:
        raise SpecError(
            "a plan for torch.compile needs the model, not only its trace: use planner.plan_compiled(spec, "
            "config, budget) or memplan plan --compile"
        )
    check_strategy(strategy)
    baseline = simulate(graph, config)
    if strategy == "optimal":
        result = solve_choices(
            graph, config, budget_bytes, offload=offload, keep=keep, recompute=recompute, time_limit_s=time_limit_s
        )
        info = SolverInfo(
            status=result.status,
            objective=result.objective_s,
            bound=result.bound_s,
            gap=result.gap,
            wall_s=result.wall_s,
        )
        timeline = result.timeline
        return make_plan(
            graph,
            config,
            budget_bytes,
            strategy,
            result.choices,
            timeline.peak_bytes,
            timeline.costs,
            baseline.peak_bytes,
            info,
        )
    t0 = time.perf_counter()
    choices = strategy_choices(graph, strategy)
    timeline = simulate(graph, config, choices=choices)
    if timeline.peak_bytes > budget_bytes:
        raise InfeasibleBudget(
            f"strategy '{strategy}' peaks at {over_budget(timeline.peak_bytes, budget_bytes)}; "
            "use --strategy optimal or raise --budget",
            smallest_peak_bytes=timeline.peak_bytes,
        )
    info = SolverInfo(
        status="NOT_SOLVED", objective=timeline.costs.added_s, bound=0.0, gap=0.0, wall_s=time.perf_counter() - t0
    )
    return make_plan(
        graph, config, budget_bytes, strategy, choices, timeline.peak_bytes, timeline.costs, baseline.peak_bytes, info
    )


@dataclass(frozen=True)
class StrategyRow:
    """One strategy's simulated result for the comparison table."""

    strategy: str
    peak_bytes: int
    overhead: float
    recompute_s: float
    fits: bool

    def to_dict(self) -> dict:
        return {
            "strategy": self.strategy,
            "peak_bytes": self.peak_bytes,
            "overhead": self.overhead,
            "recompute_s": self.recompute_s,
            "fits": self.fits,
        }


def compare_strategies(
    graph: OpGraph, config: TrainConfig, budget_bytes: int, strategies: Sequence[str] = BASELINES
) -> list[StrategyRow]:
    """Simulate each baseline strategy under the same config (no budget enforcement)."""
    rows = []
    for name in strategies:
        tl = simulate(graph, config, choices=strategy_choices(graph, name))
        rows.append(
            StrategyRow(name, tl.peak_bytes, tl.costs.overhead, tl.costs.recompute_s, tl.peak_bytes <= budget_bytes)
        )
    return rows
