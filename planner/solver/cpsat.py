"""Choose what to keep, recompute or offload under a peak-memory budget (OR-Tools CP-SAT).

Formulation. Each checkpointable block picks exactly one option (:mod:`planner.solver.options`). An
option changes the simulated curve by an exact, piecewise-constant `delta` over the block's
forward-to-backward window, plus a replay peak just before its backward. The curve is cut into
segments at every point where some option's delta changes; in each segment a block is inactive,
*held* (its delta is the same constant everywhere in the segment: one integer variable per block,
summed once per distinct set of held blocks) or *detailed* (a coefficient per option). One linear
constraint per segment (its highest baseline sample plus the deltas <= budget) and one per replay
make the model exact with respect to :func:`planner.simulation.step.simulate`. The objective is the
added time: recompute seconds plus offload transfer not hidden behind the block's own compute.
"""

from __future__ import annotations

import fnmatch
import math
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from costmodels.hardware import get_device
from planner.config import DEFAULT_TIME_LIMIT_S, TrainConfig
from planner.errors import InfeasibleBudget, MemplanError, SolverTimeout
from planner.signals import interruptible
from planner.simulation.costs import op_times, storage_bytes
from planner.simulation.effects import SpanChoice
from planner.simulation.step import Timeline, simulate
from planner.solver.baselines import block_spans
from planner.solver.options import (
    BlockOption,
    OptionEffect,
    block_options,
    option_effect,
)
from planner.tracing.graph import OpGraph
from planner.units import format_bytes

__all__ = ["RELATIVE_GAP_LIMIT", "SolveResult", "solve_choices"]

RELATIVE_GAP_LIMIT = 0.01  # stop once the plan is proven within 1% of the bound


@dataclass(frozen=True)
class SolveResult:
    """Chosen span choices, their simulated timeline and the solver's figures."""

    strategy: str
    choices: tuple[SpanChoice, ...]
    option_names: tuple[str, ...]
    timeline: Timeline
    status: str
    objective_s: float
    bound_s: float
    gap: float
    wall_s: float
    num_variables: int


def _match(paths: Sequence[str], patterns: Sequence[str], flag: str) -> set[str]:
    out: set[str] = set()
    for pattern in patterns:
        hit = {p for p in paths if fnmatch.fnmatchcase(p, pattern)}
        if not hit:
            sample = ", ".join(list(paths)[:6]) + (", ..." if len(paths) > 6 else "")
            raise MemplanError(f"{flag} '{pattern}' matches no checkpointable module; they are: {sample}")
        out |= hit
    return out


# -- the CP-SAT model ---------------------------------------------------------------------------
@dataclass
class _Problem:
    base_post: np.ndarray  # (n_ops,) live bytes after each op's allocations, no plan
    base_pre: np.ndarray  # (n_ops,) live bytes before each op's allocations
    optimizer_peak: int
    options: list[list[BlockOption]]
    effects: list[list[OptionEffect | None]]
    clock: np.ndarray  # (n_ops + 1,) start time of each op: when an offloaded block's store may begin
    deadline_op: int  # the stores must be done when this op (the backward's first) starts

    def peak_bytes(self, picks: Sequence[int]) -> int:
        """The peak this model gives the chosen options, in bytes (the simulator's, exactly)."""
        chosen = [e for effs, k in zip(self.effects, picks) if (e := effs[k]) is not None]
        curve = self.base_post.copy()
        for e in chosen:
            curve[e.lo : e.hi] += e.delta
        peak = max(int(curve.max(initial=0)), self.optimizer_peak)
        for e in chosen:
            b = e.replay_at
            if e.replay_peak is not None and b < len(curve):
                own = int(e.delta[b - e.lo]) if e.lo <= b < e.hi else 0
                others = int(curve[b] - self.base_post[b]) - own
                peak = max(peak, int(self.base_pre[b]) + others + e.replay_peak)
        return peak


def _problem(
    graph: OpGraph, config: TrainConfig, offload: str | None, keep: set[str], force: set[str], times: np.ndarray
) -> _Problem:
    base = simulate(graph, config)
    total = base.total
    sizes = storage_bytes(graph, config)
    allocs = np.array([sum(sizes[t] for t in op.allocs) for op in graph.ops], dtype=np.int64)
    device = get_device(config.gpu)
    options, effects = [], []
    for span in block_spans(graph):
        if span.path in keep:
            opts = [BlockOption("keep", None)]
        else:
            opts = block_options(graph, span, times, offload)
            if span.path in force:
                opts = [
                    o
                    for o in opts
                    if o.choice is not None and o.choice.mode == "recompute" and o.choice.span.path == span.path
                ]
        effs = [None if o.choice is None else option_effect(graph, o.choice, times, device, sizes) for o in opts]
        opts, effs = _undominated(opts, effs)
        options.append(opts)
        effects.append(effs)
    n = len(graph.ops)
    clock = np.concatenate([[0.0], np.cumsum(times)])
    return _Problem(
        total[:n].astype(np.int64),
        total[:n].astype(np.int64) - allocs,
        int(total[n]),
        options,
        effects,
        clock,
        graph.backward_start,
    )


_PROBLEMS: dict[tuple, tuple[weakref.ref, _Problem]] = {}
_PROBLEMS_KEPT = 4  # a fit search sweeps many configs of one graph: keep only the latest few


def _cached_problem(
    graph: OpGraph, config: TrainConfig, offload: str | None, keep: set[str], force: set[str], times: np.ndarray
) -> _Problem:
    """_problem, kept while the graph lives: it does not depend on the budget, so re-planning the same
    trace for another budget (auto_checkpoint's set_budget, the monitor) skips the option effects."""
    key = (id(graph), get_device(config.gpu), config, offload, frozenset(keep), frozenset(force))
    hit = _PROBLEMS.get(key)
    if hit is not None and hit[0]() is graph:
        return hit[1]
    problem = _problem(graph, config, offload, keep, force, times)
    while len(_PROBLEMS) >= _PROBLEMS_KEPT:
        del _PROBLEMS[next(iter(_PROBLEMS))]
    _PROBLEMS[key] = (weakref.ref(graph), problem)
    weakref.finalize(graph, _PROBLEMS.pop, key, None)
    return problem


def _undominated(opts: list[BlockOption], effs: list[OptionEffect | None]):
    """Drop options that cost at least as much as another and never use less memory."""

    def profile(e: OptionEffect | None, length: int, lo: int):
        if e is None:
            return 0.0, np.zeros(length, dtype=np.int64), 0, 0.0
        d = np.zeros(length, dtype=np.int64)
        d[e.lo - lo : e.hi - lo] = e.delta
        # an offload's store adds between 0 and store_s to the link's stall
        return e.cost_s, d, e.replay_peak or 0, e.cost_s + e.store_s

    real = [e for e in effs if e is not None]
    if not real:
        return opts, effs
    lo, hi = min(e.lo for e in real), max(e.hi for e in real)
    profiles = [profile(e, hi - lo, lo) for e in effs]
    keep = []
    for i, (ci, di, ri, _) in enumerate(profiles):
        dominated = False
        for j, (_, dj, rj, cj) in enumerate(profiles):
            if j == i:
                continue
            no_worse = cj <= ci and rj <= ri and bool(np.all(dj <= di))
            strictly = cj < ci or rj < ri or bool(np.any(dj < di))
            if no_worse and (strictly or j < i):
                dominated = True
                break
        if not dominated:
            keep.append(i)
    return [opts[i] for i in keep], [effs[i] for i in keep]


@dataclass
class _Block:
    """One block's options on a common window [lo, hi): a delta row per option (keep: zeros), and
    its hold zone [hold_lo, hold_hi), the longest stretch where no option's delta changes."""

    lo: int
    hi: int
    rows: np.ndarray  # (options, hi - lo)
    changes: np.ndarray  # op indices where some option's delta changes
    hold_lo: int
    hold_hi: int


def _blocks(p: _Problem) -> list[_Block | None]:
    out: list[_Block | None] = []
    for effs in p.effects:
        real = [e for e in effs if e is not None]
        if not real:
            out.append(None)
            continue
        lo, hi = min(e.lo for e in real), max(e.hi for e in real)
        rows = np.zeros((len(effs), hi - lo), dtype=np.int64)
        for k, e in enumerate(effs):
            if e is not None:
                rows[k, e.lo - lo : e.hi - lo] = e.delta
        padded = np.concatenate(
            [np.zeros((len(effs), 1), dtype=np.int64), rows, np.zeros((len(effs), 1), dtype=np.int64)], axis=1
        )
        changed = np.flatnonzero(np.any(np.diff(padded, axis=1) != 0, axis=0)) + lo
        edges = np.unique(np.concatenate([[lo], changed, [hi]]))
        widths = np.diff(edges)
        k = int(np.argmax(widths))
        out.append(_Block(lo, hi, rows, changed, int(edges[k]), int(edges[k + 1])))
    return out


def _solve_cpsat(p: _Problem, budget: int, time_limit_s: float, n: int):
    model = cp_model.CpModel()
    unit = max(1, math.ceil(budget / 10_000_000))  # bytes per model unit: keeps coefficients small

    def up(x: float) -> int:  # conservative for costs on the memory side
        return int(math.ceil(x / unit))

    y = [[model.NewBoolVar(f"y{r}_{k}") for k in range(len(opts))] for r, opts in enumerate(p.options)]
    for row_vars in y:
        model.AddExactlyOne(row_vars)
    blocks = _blocks(p)
    cuts = {0, n}
    held_vars: list[cp_model.IntVar | None] = []
    held_lo: list[int] = []
    for r, blk in enumerate(blocks):
        if blk is None or blk.hold_hi <= blk.hold_lo:
            held_vars.append(None)
            held_lo.append(0)
            if blk is not None:
                cuts.update(blk.changes.tolist() + [blk.lo, blk.hi])
            continue
        cuts.update(blk.changes.tolist() + [blk.lo, blk.hi, blk.hold_lo, blk.hold_hi])
        coeffs = [up(v) for v in blk.rows[:, blk.hold_lo - blk.lo]]
        lo_b, hi_b = min([0] + coeffs), max([0] + coeffs)
        h = model.NewIntVar(lo_b, hi_b, f"held{r}")
        model.Add(h == sum(c * y[r][k] for k, c in enumerate(coeffs) if c))
        held_vars.append(h)
        held_lo.append(lo_b)
    group_vars: dict[tuple[int, ...], cp_model.IntVar] = {}

    def held_sum(regions: tuple[int, ...]):
        if not regions:
            return 0
        if regions not in group_vars:
            z = model.NewIntVar(sum(held_lo[r] for r in regions), 0, f"group{len(group_vars)}")
            model.Add(z == sum(held_vars[r] for r in regions))
            group_vars[regions] = z
        return group_vars[regions]

    def row(s: int, e: int, base_value: int, own: int | None = None, own_terms=None) -> None:
        held, terms = [], []
        for r, blk in enumerate(blocks):
            if blk is None or r == own or e <= blk.lo or s >= blk.hi:
                continue
            if held_vars[r] is not None and blk.hold_lo <= s and e <= blk.hold_hi:
                held.append(r)
                continue
            for k, v in enumerate(blk.rows[:, s - blk.lo]):
                c = up(v)
                if c:
                    terms.append(c * y[r][k])
        expr = held_sum(tuple(held)) + sum(terms) + (0 if own_terms is None else own_terms)
        model.Add(expr <= budget // unit - up(base_value))

    edges = np.array(sorted(c for c in cuts if 0 <= c <= n))
    for s_, e_ in zip(edges[:-1], edges[1:]):
        row(int(s_), int(e_), int(p.base_post[s_:e_].max()))
    for r, effs in enumerate(p.effects):
        for k, eff in enumerate(effs):
            if eff is None or eff.replay_at >= n or eff.replay_peak is None:
                continue
            b = eff.replay_at
            own = int(eff.delta[b - eff.lo]) if eff.lo <= b < eff.hi else 0
            if eff.replay_peak <= own + int(p.base_post[b] - p.base_pre[b]):
                continue  # never above the op's own sample, which a segment row bounds
            row(b, b + 1, int(p.base_pre[b]), own=r, own_terms=up(eff.replay_peak) * y[r][k])
    costs = [[0.0 if e is None else e.cost_s for e in effs] for effs in p.effects]
    stores = [
        (e.transfer.ready_op, e.store_s, y[r][k])
        for r, effs in enumerate(p.effects)
        for k, e in enumerate(effs)
        if e is not None and e.transfer is not None
    ]
    scale_s = (
        max(max((c for row_ in costs for c in row_), default=0.0), max((s for _, s, _ in stores), default=0.0), 1e-12)
        / 1_000_000
    )
    objective = sum(int(round(c / scale_s)) * y[r][k] for r, row_ in enumerate(costs) for k, c in enumerate(row_))
    model.Minimize(objective + _link_stall(model, p, stores, scale_s))
    solver = cp_model.CpSolver()
    # A deterministic-time limit makes the plan the same on every run and machine even when the
    # limit is hit; the wall-clock limit is only a backstop.
    solver.parameters.max_deterministic_time = float(time_limit_s)
    solver.parameters.max_time_in_seconds = 3.0 * float(time_limit_s)
    solver.parameters.num_workers = 1  # one worker and a fixed seed: the same plan every run
    solver.parameters.random_seed = 0
    solver.parameters.linearization_level = 2  # a tight LP bound: proves small gaps fast
    solver.parameters.relative_gap_limit = RELATIVE_GAP_LIMIT
    with interruptible(solver):  # Ctrl-C stops the search and raises; the caller's SIGINT handler stays
        status = solver.Solve(model)
    name = solver.StatusName(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return name, None, 0.0, 0.0, sum(len(r) for r in y)
    picks = [next(k for k, v in enumerate(row_) if solver.Value(v)) for row_ in y]
    return name, picks, solver.ObjectiveValue() * scale_s, solver.BestObjectiveBound() * scale_s, sum(len(r) for r in y)


def _link_stall(model: cp_model.CpModel, p: _Problem, stores: list[tuple[int, float, cp_model.IntVar]], scale_s: float):
    """The stall of the one transfer link when the backward starts, in units of `scale_s`, as
    :func:`planner.simulation.effects.exposed_transfer_s` prices it: the link ends at max over k
    of (ready_k + the stores queued from k on), so stall >= that minus the deadline, and >= 0."""
    if not stores:
        return 0
    stores = sorted(stores, key=lambda x: x[0])
    units = [int(round(s / scale_s)) for _, s, _ in stores]
    stall = model.NewIntVar(0, sum(units), "link_stall")
    deadline = p.clock[p.deadline_op]
    for k, (ready_op, _, _) in enumerate(stores):
        offset_s = p.clock[ready_op] - deadline
        if offset_s + sum(s for _, s, _ in stores[k:]) <= 0:
            continue  # the link is idle again before the deadline whatever is stored
        queued = sum(u * v for u, (_, _, v) in zip(units[k:], stores[k:]))
        model.Add(stall >= int(round(offset_s / scale_s)) + queued)
    return stall


def _min_peak_choices(p: _Problem) -> list[SpanChoice]:
    """Per block, the option that frees the most while held (a lower bound on reachable peaks)."""
    out = []
    for opts, effs in zip(p.options, p.effects):
        best, best_saving = None, 0
        for o, e in zip(opts, effs):
            if e is None:
                continue
            saving = -int(e.delta.min()) if len(e.delta) else 0
            if saving > best_saving:
                best, best_saving = o.choice, saving
        if best is not None:
            out.append(best)
    return out


def _offload_hint(config: TrainConfig, offload: str | None) -> str:
    """What offload could still add to the search (nothing once --offload disk is in it)."""
    if offload is None:
        return f" or offload (--offload {'cpu' if get_device(config.gpu).is_cuda else 'disk'})"
    if offload == "cpu":
        return " or offload to disk as well (--offload disk)"
    return " (offload to disk is already counted in that peak)"


def _infeasible(graph: OpGraph, config: TrainConfig, budget: int, p: _Problem, offload: str | None) -> InfeasibleBudget:
    best = simulate(graph, config, choices=_min_peak_choices(p))
    top = max(best.breakdown_at_peak.items(), key=lambda kv: kv[1])
    return InfeasibleBudget(
        f"budget {format_bytes(budget)} is infeasible: the smallest peak memplan can reach is "
        f"{format_bytes(best.peak_bytes)} ({best.peak_bytes} B) in {best.peak_phase} at {best.peak_op}, "
        f"dominated by {top[0]} ({format_bytes(top[1])}); raise --budget to at least that, or cut model "
        "states (--precision bf16-mixed, --optimizer adamw-8bit, --zero 3 --dp N)"
        + _offload_hint(config, offload)
        + (
            ""
            if graph.regions
            else "; memplan found no blocks to checkpoint in this model (blocks are the "
            "children of nn.ModuleList, nn.Sequential or nn.ModuleDict containers)"
        ),
        smallest_peak_bytes=best.peak_bytes,
    )


def solve_choices(
    graph: OpGraph,
    config: TrainConfig,
    budget_bytes: int,
    *,
    offload: str | None = None,
    keep: Sequence[str] = (),
    recompute: Sequence[str] = (),
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
) -> SolveResult:
    """Cheapest span choices whose simulated peak fits `budget_bytes` (CP-SAT, deterministic)."""
    if budget_bytes <= 0:
        raise MemplanError(f"budget must be positive, got {budget_bytes}")
    if not time_limit_s > 0:
        raise MemplanError(f"--time-limit must be a positive number of seconds, got {time_limit_s}")
    if offload not in (None, "none", "cpu", "disk"):
        raise MemplanError(f"unknown offload target '{offload}'; choose one of: none, cpu, disk")
    offload = None if offload in (None, "none") else offload
    if offload == "cpu" and not get_device(config.gpu).is_cuda:
        raise MemplanError("offloading to cpu on a cpu device frees nothing; use --offload disk")
    t0 = time.perf_counter()
    paths = [r.path for r in graph.regions]
    keep_set = _match(paths, keep, "--keep")
    force_set = _match(paths, recompute, "--recompute")
    if keep_set & force_set:
        raise MemplanError(f"modules both kept and recomputed: {', '.join(sorted(keep_set & force_set))}")
    times = op_times(graph, get_device(config.gpu))
    p = _cached_problem(graph, config, offload, keep_set, force_set, times)
    n = len(graph.ops)
    if p.optimizer_peak > budget_bytes:
        raise _infeasible(graph, config, budget_bytes, p, offload)
    status, picks, objective, bound, nvars = _solve_cpsat(p, budget_bytes, time_limit_s, n)
    if picks is None:
        if status == "INFEASIBLE":
            raise _infeasible(graph, config, budget_bytes, p, offload)
        raise SolverTimeout(
            f"the solver found no plan within --time-limit {time_limit_s:g}s ({status}); raise --time-limit"
        )
    chosen = [p.options[r][k] for r, k in enumerate(picks)]
    choices = tuple(o.choice for o in chosen if o.choice is not None)
    timeline = simulate(graph, config, choices=choices)
    model_peak = p.peak_bytes(picks)
    assert timeline.peak_bytes == model_peak <= budget_bytes, (
        f"the solver's model ({model_peak} B) and the simulator ({timeline.peak_bytes} B) disagree "
        f"on the plan's peak under a budget of {budget_bytes} B"
    )
    gap = (objective - bound) / objective if objective > 0 else 0.0
    return SolveResult(
        "optimal",
        choices,
        tuple(o.name for o in chosen),
        timeline,
        status,
        objective,
        bound,
        max(0.0, gap),
        time.perf_counter() - t0,
        nvars,
    )
