"""How many GPUs a step needs, and how large a batch or sequence fits on a given number of them.

`fit` searches the ZeRO-3 data-parallel degree: model states shrink with dp, activations do not.
One trace serves every dp (a ZeRO-3 trace does not depend on dp); each dp is a simulation, and the
solver runs only where a full-recompute baseline cannot already prove that a plan exists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from costmodels.hardware import get_device
from planner.analysis.configurations import ConfigurationReport, cheapest_configuration, fewest_gpus
from planner.budgets import usable_bytes
from planner.config import DEFAULT_RESERVE, DEFAULT_TIME_LIMIT_S, TrainConfig
from planner.errors import InfeasibleBudget, SolverTimeout
from planner.simulation.step import simulate
from planner.solver.baselines import strategy_choices
from planner.solver.planning import solve
from planner.tracing.graph import OpGraph
from planner.tracing.recorder import TraceCache, trace_for, trace_key
from planner.units import format_bytes

__all__ = ["FitResult", "fit", "largest_fitting"]

MAX_SIZE_TRACES = 12  # bound on traces per dimension in largest_fitting


@dataclass(frozen=True)
class FitResult:
    """Smallest GPU counts (ZeRO-3 dp) on which one step fits, without and with a plan."""

    min_gpus_without_plan: int | None
    min_gpus_with_plan: int | None
    without_plan: dict | None  # peak_bytes, breakdown_at_peak, model_states at that count
    with_plan: dict | None  # peak_bytes, overhead, breakdown_at_peak, model_states, decisions
    config: dict
    budget_bytes: int = 0
    capacity_bytes: int = 0
    max_gpus: int = 0
    configurations: ConfigurationReport | None = None  # the cheapest-configuration search, when asked
    why_not_without_plan: str | None = None  # what binds when no count fits without a plan
    why_not_with_plan: str | None = None  # what binds when no count fits even with a plan

    def to_dict(self) -> dict[str, Any]:
        return {
            "min_gpus_without_plan": self.min_gpus_without_plan,
            "min_gpus_with_plan": self.min_gpus_with_plan,
            "without_plan": self.without_plan,
            "with_plan": self.with_plan,
            "config": dict(self.config),
            "budget_bytes": self.budget_bytes,
            "capacity_bytes": self.capacity_bytes,
            "max_gpus": self.max_gpus,
            "configurations": None if self.configurations is None else self.configurations.to_dict(),
            "why_not_without_plan": self.why_not_without_plan,
            "why_not_with_plan": self.why_not_with_plan,
        }


class _Checker:
    """Fits-without-plan and fits-with-plan tests of one graph, memoised per config."""

    def __init__(self, graph: OpGraph, budget: int, time_limit_s: float) -> None:
        self.graph, self.budget, self.time_limit_s = graph, budget, time_limit_s
        self._bare: dict[TrainConfig, Any] = {}
        self._plan: dict[TrainConfig, Any] = {}

    def bare(self, config: TrainConfig):
        if config not in self._bare:
            self._bare[config] = simulate(self.graph, config)
        return self._bare[config]

    def fits(self, config: TrainConfig) -> bool:
        return self.bare(config).peak_bytes <= self.budget

    def plan_fits(self, config: TrainConfig) -> bool:
        """A plan exists: the step fits as is, full recompute fits, or the solver finds one."""
        if self.fits(config):
            return True
        states = self.bare(config).model_states
        if sum(states.values()) > self.budget:
            return False
        if simulate(self.graph, config, choices=strategy_choices(self.graph, "full")).peak_bytes <= self.budget:
            return True
        return self.plan(config) is not None

    def plan(self, config: TrainConfig):
        """The optimal plan under the budget (None when infeasible)."""
        if config not in self._plan:
            try:
                self._plan[config] = solve(self.graph, config, self.budget, time_limit_s=self.time_limit_s)
            except InfeasibleBudget:
                self._plan[config] = None
            except SolverTimeout:  # fall back to full recompute if it fits
                try:
                    self._plan[config] = solve(self.graph, config, self.budget, strategy="full")
                except InfeasibleBudget:
                    self._plan[config] = None
        return self._plan[config]

    def bare_dict(self, config: TrainConfig) -> dict:
        tl = self.bare(config)
        return {
            "peak_bytes": tl.peak_bytes,
            "peak_phase": tl.peak_phase,
            "peak_op": tl.peak_op,
            "breakdown_at_peak": dict(tl.breakdown_at_peak),
            "model_states": dict(tl.model_states),
            "step_s": tl.costs.step_s,
        }

    def plan_dict(self, config: TrainConfig) -> dict | None:
        plan = self.plan(config)
        if plan is None:
            return None
        tl = simulate(self.graph, config, plan=plan)
        return {
            "peak_bytes": tl.peak_bytes,
            "overhead": plan.predicted.overhead,
            "recompute_flops": plan.predicted.recompute_flops,
            "decisions": len(plan.decisions),
            "peak_phase": tl.peak_phase,
            "peak_op": tl.peak_op,
            "breakdown_at_peak": dict(tl.breakdown_at_peak),
            "model_states": dict(tl.model_states),
            "step_s": tl.costs.step_s,
        }


_STATES = ("parameter", "gradient", "optimizer")


def _binding(tl, gpus: int, budget: int, planned: bool) -> str:
    """What keeps a step (timeline `tl` at `gpus` ZeRO-3 GPUs) over the budget: the model states,
    which more GPUs shrink, or the activations and temporaries at the peak, which they do not."""
    fb = format_bytes
    states = sum(tl.model_states.values())
    at_peak = tl.breakdown_at_peak
    unsharded = at_peak.get("activation", 0) + at_peak.get("temporary", 0)
    where = f"at the peak ({tl.peak_phase}, {tl.peak_op})"
    if states > budget:
        return (
            f"the model states alone are {fb(states)} per GPU on {gpus} GPUs, over the budget {fb(budget)}: "
            "more GPUs shrink them, so raise --max-gpus (or use a lighter optimizer or precision)"
        )
    what = "even recomputing every block, the activations" if planned else "the activations"
    if unsharded > budget:
        return (
            f"{what} and temporaries {where} are {fb(unsharded)}, over the budget {fb(budget)} by themselves: "
            "ZeRO-3 shards model states, not activations, so no GPU count fits"
            + ("; shorten the sequence or the batch" if planned else "; a plan or a shorter sequence or batch")
        )
    states_at_peak = sum(at_peak.get(k, 0) for k in _STATES)
    return (
        f"on {gpus} GPUs the model states ({fb(states_at_peak)}) and the "
        + ("activations of full recompute" if planned else "activations")
        + f" and temporaries ({fb(unsharded)}) {where} make {fb(tl.peak_bytes)}, over the budget {fb(budget)}; "
        f"more GPUs shrink only the states: raise --max-gpus, or shorten the sequence or the batch"
    )


def _fewest_gpus(report: ConfigurationReport, config: TrainConfig) -> tuple[int | None, int | None]:
    """The fewest GPUs the configuration search found for the config as given (its optimizer, no host
    offload, no micro-batching): without a plan, and with one where needed."""
    rows = [
        c
        for c in report.configurations
        if c.fits and c.optimizer == config.optimizer and not c.cpu_offload and c.accumulation == 1
    ]
    without = min((c.gpus for c in rows if not c.plan), default=None)
    return without, min((c.gpus for c in rows), default=None)


def fit(
    spec: str,
    config: TrainConfig,
    max_gpus: int = 4096,
    *,
    reserve: float = DEFAULT_RESERVE,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    search_configurations: bool = False,
) -> FitResult:
    """Smallest ZeRO-3 data-parallel degree on which a step fits `config.gpu`, without and with a plan;
    with `search_configurations`, also the cheapest configuration by GPU-hours (see
    :mod:`planner.analysis.configurations`)."""
    if not isinstance(max_gpus, int) or max_gpus < 1:
        raise ValueError(f"max gpus must be a positive integer, got {max_gpus!r}")
    capacity = get_device(config.gpu).memory_bytes
    budget = usable_bytes(capacity, reserve)
    base = config.with_(zero_stage=3, dp=1)
    traces = TraceCache(spec)
    check = _Checker(traces(base), budget, time_limit_s)

    def at(dp: int) -> TrainConfig:
        return config.with_(zero_stage=3, dp=dp)

    configurations = None
    if search_configurations:

        def trace_micro_batch(batch_size: int) -> OpGraph:
            return traces(base.with_(batch_size=batch_size))

        configurations = cheapest_configuration(
            trace_micro_batch, config, budget, max_gpus=max_gpus, time_limit_s=time_limit_s
        )
        without, with_plan = _fewest_gpus(configurations, config)
    else:
        without = fewest_gpus(lambda n: check.fits(at(n)), max_gpus)
        with_plan = fewest_gpus(lambda n: check.plan_fits(at(n)), without if without is not None else max_gpus)
    why_without = why_with = None
    if without is None and not check.fits(at(max_gpus)):
        why_without = _binding(check.bare(at(max_gpus)), max_gpus, budget, planned=False)
    if with_plan is None and not check.plan_fits(at(max_gpus)):
        full = simulate(check.graph, at(max_gpus), choices=strategy_choices(check.graph, "full"))
        why_with = _binding(full, max_gpus, budget, planned=True)
    return FitResult(
        min_gpus_without_plan=without,
        min_gpus_with_plan=with_plan,
        without_plan=check.bare_dict(at(without)) if without is not None else None,
        with_plan=check.plan_dict(at(with_plan)) if with_plan is not None else None,
        config={**config.to_dict(), "model": spec, "zero_stage": 3},
        budget_bytes=budget,
        capacity_bytes=capacity,
        max_gpus=max_gpus,
        configurations=configurations,
        why_not_without_plan=why_without,
        why_not_with_plan=why_with,
    )


def _largest(ok: Callable[[int], bool], start: int, max_traces: int) -> tuple[int | None, bool]:
    """Largest size start * 2**k that passes ok (doubling up from `start` when it passes, halving
    down to 1 when it does not), testing at most max_traces sizes; None when not even 1 passes.
    The flag is True when the bound stopped the doubling (the true largest may be larger)."""
    n, tried = start, 1
    if ok(n):
        while tried < max_traces:
            tried += 1
            if not ok(n * 2):
                return n, False
            n *= 2
        return n, True
    while n > 1 and tried < max_traces:
        n, tried = n // 2, tried + 1
        if ok(n):
            return n, False
    return None, False


def largest_fitting(
    spec: str,
    config: TrainConfig,
    gpus: int,
    *,
    reserve: float = DEFAULT_RESERVE,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    max_traces: int = MAX_SIZE_TRACES,
) -> dict:
    """Largest micro-batch (at config.seq_len) and sequence length (at config.batch_size) that fit on
    `gpus` GPUs (ZeRO-3 when gpus > 1), without and with a plan: the config's size times or divided
    by powers of two."""
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a positive integer, got {gpus!r}")
    capacity = get_device(config.gpu).memory_bytes
    budget = usable_bytes(capacity, reserve)
    run = config.with_(zero_stage=3, dp=gpus) if gpus > 1 else config.with_(dp=1)
    checkers: dict[tuple, _Checker] = {}
    limits: dict[str, str] = {}

    def checker(batch: int, seq: int) -> tuple[_Checker, TrainConfig]:
        c = run.with_(batch_size=batch, seq_len=seq)
        key = trace_key(c)
        if key not in checkers:
            checkers[key] = _Checker(trace_for(spec, c), budget, time_limit_s)
        return checkers[key], c

    def test(batch: int, seq: int, with_plan: bool, name: str) -> bool:
        try:
            ch, c = checker(batch, seq)
        except ValueError as exc:  # the model cannot take this shape (e.g. more positions than it has)
            limits[name] = " ".join(str(exc).split())
            return False
        return ch.plan_fits(c) if with_plan else ch.fits(c)

    out: dict[str, Any] = {
        "gpus": gpus,
        "config": {**run.to_dict(), "model": spec},
        "budget_bytes": budget,
        "capacity_bytes": capacity,
    }
    for name, start, make in (
        ("batch_size", config.batch_size, lambda n: (n, config.seq_len)),
        ("seq_len", config.seq_len, lambda n: (config.batch_size, n)),
    ):
        bare, bare_capped = _largest(lambda n, make=make, name=name: test(*make(n), False, name), start, max_traces)
        planned, plan_capped = _largest(
            lambda n, make=make, name=name: test(*make(n), True, name), bare or start, max_traces
        )
        entry: dict[str, Any] = {
            "without_plan": bare,
            "with_plan": planned,
            "limited_by": limits.get(name),
            "without_plan_at_least": bare_capped,
            "with_plan_at_least": plan_capped,
        }
        if bare is not None:
            ch, c = checker(*make(bare))
            entry["without_plan_peak_bytes"] = ch.bare(c).peak_bytes
        if planned is not None:
            ch, c = checker(*make(planned))
            d = ch.plan_dict(c) if not ch.fits(c) else {"peak_bytes": ch.bare(c).peak_bytes, "overhead": 0.0}
            entry["with_plan_peak_bytes"] = d["peak_bytes"]
            entry["with_plan_overhead"] = d["overhead"]
        out[f"largest_{name}"] = entry
    return out
