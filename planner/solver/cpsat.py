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
from dataclasses import dataclass, replace

import numpy as np
from ortools.sat.python import cp_model

from costmodels.hardware import get_device
from planner.config import DEFAULT_TIME_LIMIT_S, TrainConfig
from planner.errors import InfeasibleBudget, MemplanError, SolverTimeout
from planner.signals import interruptible
from planner.simulation.comm import unplanned_communication
from planner.simulation.costs import op_times, storage_bytes
from planner.simulation.effects import SpanChoice, exposed_transfer_s
from planner.simulation.step import Timeline, simulate
from planner.solver.baselines import block_spans
from planner.solver.cpsat_solver import deterministic_solver
from planner.solver.options import (
    BlockOption,
    OptionEffect,
    block_options,
    option_effect,
)
from planner.tracing.graph import OpGraph
from planner.units import format_bytes

__all__ = ["RELATIVE_GAP_LIMIT", "Replan", "SolveResult", "prepare_replan", "replan_choices", "solve_choices"]

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
    greedy: _Greedy | None = None  # replan_choices' move tables, made at its first call

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
    graph: OpGraph,
    config: TrainConfig,
    offload: str | None,
    keep: set[str],
    force: set[str],
    times: np.ndarray,
    hide_in_communication: bool,
) -> _Problem:
    base = simulate(graph, config)
    total = base.total
    sizes = storage_bytes(graph, config)
    allocs = np.array([sum(sizes[t] for t in op.allocs) for op in graph.ops], dtype=np.int64)
    device = get_device(config.gpu)
    waits = _backward_waits(graph, config, times) if hide_in_communication else {}
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
        wait_s = waits.get(span.path, 0.0)
        effs = [
            replace(e, hidden_s=min(e.cost_s, wait_s)) if e is not None and e.transfer is None and wait_s else e
            for e in effs
        ]
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


def _backward_waits(graph: OpGraph, config: TrainConfig, times: np.ndarray) -> dict[str, float]:
    """Seconds each block's backward waits on communication without a plan, by block path: a
    recompute in that block runs in the wait (planner.simulation.comm), so up to that much of it
    adds nothing to the step."""
    schedule = unplanned_communication(graph, times, config, get_device(config.gpu))
    regions = sorted(graph.regions, key=lambda r: r.fwd_start)
    return {r.path: w for r, w in zip(regions, schedule.backward_wait_s) if w > 0}


_PROBLEMS: dict[tuple, tuple[weakref.ref, _Problem]] = {}
_PROBLEMS_KEPT = 4  # a fit search sweeps many configs of one graph: keep only the latest few


def _cached_problem(
    graph: OpGraph,
    config: TrainConfig,
    offload: str | None,
    keep: set[str],
    force: set[str],
    hide_in_communication: bool = True,
) -> _Problem:
    """_problem, kept while the graph lives: it does not depend on the budget, so re-planning the same
    trace for another budget (auto_checkpoint's set_budget, the monitor) skips the option effects."""
    key = (id(graph), get_device(config.gpu), config, offload, frozenset(keep), frozenset(force), hide_in_communication)
    hit = _PROBLEMS.get(key)
    if hit is not None and hit[0]() is graph:
        return hit[1]
    times = op_times(graph, get_device(config.gpu))
    problem = _problem(graph, config, offload, keep, force, times, hide_in_communication)
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
        return e.priced_s, d, e.replay_peak or 0, e.priced_s + e.store_s

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
    held_hi: list[int] = []  # a recompute can hold more than keeping (its replay outlives a freed tensor)
    for r, blk in enumerate(blocks):
        if blk is None or blk.hold_hi <= blk.hold_lo:
            held_vars.append(None)
            held_lo.append(0)
            held_hi.append(0)
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
        held_hi.append(hi_b)
    group_vars: dict[tuple[int, ...], cp_model.IntVar] = {}

    def held_sum(regions: tuple[int, ...]):
        if not regions:
            return 0
        if regions not in group_vars:
            z = model.NewIntVar(
                sum(held_lo[r] for r in regions), sum(held_hi[r] for r in regions), f"group{len(group_vars)}"
            )
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
    costs = [[0.0 if e is None else e.priced_s for e in effs] for effs in p.effects]
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
    solver = deterministic_solver(time_limit_s)
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


def _no_blocks_hint(graph: OpGraph) -> str:
    every = graph.meta.get("shared_modules", ())
    shared = [p for p in every if not any(p.startswith(q + ".") for q in every)][:3]  # the outermost
    hint = (
        "; memplan found no blocks to checkpoint in this model (blocks are the children of nn.ModuleList, "
        "nn.Sequential or nn.ModuleDict containers, each called once per step)"
    )
    if shared:
        hint += f"; {', '.join(shared)} {'runs' if len(shared) == 1 else 'run'} several times per step (a shared layer)"
    return hint


def _infeasible(graph: OpGraph, config: TrainConfig, budget: int, p: _Problem, offload: str | None) -> InfeasibleBudget:
    best = simulate(graph, config, choices=_min_peak_choices(p))
    top = max(best.breakdown_at_peak.items(), key=lambda kv: kv[1])
    return InfeasibleBudget(
        f"budget {format_bytes(budget)} is infeasible: the smallest peak memplan can reach is "
        f"{format_bytes(best.peak_bytes)} ({best.peak_bytes} B) in {best.peak_phase} at {best.peak_op}, "
        f"dominated by {top[0]} ({format_bytes(top[1])}); raise --budget to at least that, or cut model "
        "states (--precision bf16-mixed, --optimizer adamw-8bit, --zero 3 --dp N)"
        + _offload_hint(config, offload)
        + ("" if graph.regions else _no_blocks_hint(graph)),
        smallest_peak_bytes=best.peak_bytes,
    )


@dataclass(frozen=True)
class Replan:
    """A re-plan of a solved trace for a new budget: the choices and their exact peak and costs."""

    choices: tuple[SpanChoice, ...]
    option_names: tuple[str, ...]
    peak_bytes: int
    recompute_s: float
    recompute_flops: int
    offload_bytes: int
    exposed_offload_s: float
    added_s: float  # what the choices add to one micro-batch's time (recompute and exposed offload)
    wall_s: float


class _Greedy:
    """Moves one block to another option at a time on the exact curve of :class:`_Problem`: first the
    move freeing the most bytes at the peak per second it adds, until the budget holds; then the
    move saving the most time that keeps it. Every block's window is cut where one of its options'
    delta changes (each delta is constant on a segment), so all moves are priced at once on the
    curve's segment maxima and at the replay points, in arrays over (block, option). The segments
    of all blocks cut the curve into elementary intervals: one reduceat gives their maxima, and a
    sparse table over those gives any segment's maximum in constant time."""

    def __init__(self, p: _Problem) -> None:
        self.p = p
        blocks = _blocks(p)
        n = len(p.base_post)
        self.active = [r for r, blk in enumerate(blocks) if blk is not None and len(p.options[r]) > 1]
        self.blocks = blocks
        k_max = max([len(p.options[r]) for r in self.active], default=1)
        cuts = []
        for r in self.active:
            blk = blocks[r]
            inner = blk.changes[(blk.changes > blk.lo) & (blk.changes < blk.hi)]
            cuts.append(np.unique(np.concatenate([[blk.lo], inner])))
        s_max = max([len(c) for c in cuts], default=1)
        ends = [np.append(c[1:], blocks[r].hi) for r, c in zip(self.active, cuts)]
        bounds = np.unique(np.concatenate([[0], *cuts, *ends]))
        self.bounds = bounds[bounds < n]  # first ops of the elementary intervals; the last runs to n

        def elementary(ops: np.ndarray) -> np.ndarray:  # op index (a bound, or n) -> interval index
            return np.searchsorted(self.bounds, ops)

        rows, k_real = len(self.active), np.array([len(p.options[r]) for r in self.active], dtype=np.int64)
        self.starts = np.zeros((rows, s_max), dtype=np.int64)
        self.tails = np.zeros((rows, s_max), dtype=np.int64)
        self.level = np.zeros((rows, s_max), dtype=np.int64)
        self.seg = np.zeros((rows, k_max, s_max), dtype=np.int64)  # option deltas on the segments
        self.cost = np.full((rows, k_max), np.inf)
        self.lo = elementary(np.array([blocks[r].lo for r in self.active], dtype=np.int64))
        self.hi = elementary(np.array([blocks[r].hi for r in self.active], dtype=np.int64))
        for i, (r, starts, stops) in enumerate(zip(self.active, cuts, ends)):
            blk = blocks[r]
            first, last = elementary(starts), elementary(stops)
            level = np.floor(np.log2(last - first)).astype(np.int64)
            pad = s_max - len(starts)
            self.starts[i] = np.pad(first, (0, pad), mode="edge")
            self.tails[i] = np.pad(last - (1 << level), (0, pad), mode="edge")
            self.level[i] = np.pad(level, (0, pad), mode="edge")
            seg = blk.rows[:, starts - blk.lo]
            self.seg[i, : len(seg)] = np.pad(seg, ((0, 0), (0, pad)), mode="edge")
            self.cost[i, : k_real[i]] = [0.0 if e is None else e.priced_s + e.store_s for e in p.effects[r]]
        # replays: every option's replay point, and each option's delta at every such point
        at = np.full((rows, k_max), -1, dtype=np.int64)
        peak = np.zeros((rows, k_max), dtype=np.int64)
        for i, r in enumerate(self.active):
            for k, e in enumerate(p.effects[r]):
                if e is not None and e.replay_peak is not None and e.replay_at < n:
                    at[i, k], peak[i, k] = e.replay_at, e.replay_peak
        self.points = np.unique(at[at >= 0])
        self.point_of = np.where(at >= 0, np.searchsorted(self.points, np.maximum(at, 0)), 0)
        self.has_replay = at >= 0
        self.replay_peak = peak
        self.delta_at = np.zeros((rows, k_max, len(self.points)), dtype=np.int64)
        for i, r in enumerate(self.active):
            blk = blocks[r]
            inside = (self.points >= blk.lo) & (self.points < blk.hi)
            self.delta_at[i, : k_real[i]][:, inside] = blk.rows[:, self.points[inside] - blk.lo]
        self.gap_at = (p.base_pre - p.base_post)[self.points] if len(self.points) else np.zeros(0, dtype=np.int64)

    def _peaks(self, picks: list[int], curve: np.ndarray) -> np.ndarray:
        """peaks[i, k]: the exact peak after moving active block i to option k (inf: no such option)."""
        p = self.p
        rows = np.arange(len(self.active))
        a = np.array([picks[r] for r in self.active], dtype=np.int64)
        elem = np.maximum.reduceat(curve, self.bounds)
        e = len(elem)
        table = np.empty((max(e.bit_length(), 1), e), dtype=curve.dtype)  # [i, s]: max of elem[s : s + 2**i]
        table[0] = elem
        for i in range(1, len(table)):
            half = 1 << (i - 1)
            np.maximum(table[i - 1, :-half], table[i - 1, half:], out=table[i, :-half])
        seg_max = np.maximum(table[self.level, self.starts], table[self.level, self.tails])
        peaks = ((seg_max - self.seg[rows, a])[:, None, :] + self.seg).max(axis=2)
        prefix = np.concatenate([[0], np.maximum.accumulate(elem)])  # [lo]: the curve's max before lo
        suffix = np.concatenate([np.maximum.accumulate(elem[::-1])[::-1], [0]])  # [hi]: from hi on
        outside = np.maximum(np.maximum(prefix[self.lo], suffix[self.hi]), p.optimizer_peak)
        peaks = np.maximum(peaks, outside[:, None])
        if len(self.points):
            curve_at = curve[self.points]
            # the replays of the options in force, and how moving block i to option k shifts each
            q = self.point_of[rows, a]
            held = self.has_replay[rows, a]
            replays = np.where(
                held, self.gap_at[q] + curve_at[q] - self.delta_at[rows, a, q] + self.replay_peak[rows, a], -1
            )
            shift = self.delta_at[:, :, q] - self.delta_at[rows, a][:, q][:, None, :]  # [i, k, other block]
            moved = np.where(held[None, None, :], replays[None, None, :] + shift, -1)
            moved[rows, :, rows] = -1  # a block's own replay moves with its option: below
            peaks = np.maximum(peaks, moved.max(axis=2))
            qk = self.point_of
            own = self.gap_at[qk] + curve_at[qk] - self.delta_at[rows, a][rows[:, None], qk] + self.replay_peak
            peaks = np.maximum(peaks, np.where(self.has_replay, own, -1))
        return np.where(np.isinf(self.cost), np.iinfo(np.int64).max, peaks)

    def cost_of(self, picks: list[int]) -> float:
        """Seconds the picks add (recompute, and offload priced as load plus store)."""
        return float(sum(self.cost[i, picks[r]] for i, r in enumerate(self.active)))

    def run(self, budget: int, start: list[int]) -> list[int] | None:
        """Picks within `budget` from `start`, or None when no move lowers the peak enough."""
        p = self.p
        picks = list(start)
        curve = p.base_post.copy()
        for r, k in enumerate(picks):
            if self.blocks[r] is not None:
                curve[self.blocks[r].lo : self.blocks[r].hi] += self.blocks[r].rows[k]
        peak = p.peak_bytes(picks)
        if not self.active:
            return picks if peak <= budget else None
        rows = np.arange(len(self.active))
        while True:
            peaks = self._peaks(picks, curve)
            a = np.array([picks[r] for r in self.active])
            added = self.cost - self.cost[rows, a][:, None]
            if peak > budget:  # tighten: most bytes freed at the peak per second added
                freed = peak - np.maximum(peaks, budget)
                with np.errstate(divide="ignore", invalid="ignore"):
                    score = np.where(added <= 0, np.inf, freed / added)
                score = np.where(freed > 0, score, -np.inf)
                i, k = np.unravel_index(int(np.argmax(score - peaks * 1e-30)), score.shape)
                if score[i, k] == -np.inf:
                    return None
            else:  # relax: the largest saving of time that keeps the budget
                saving = np.where(peaks <= budget, -added, 0.0)
                i, k = np.unravel_index(int(np.argmax(saving)), saving.shape)
                if saving[i, k] <= 0:
                    return picks if p.peak_bytes(picks) <= budget else None
            r = self.active[i]
            blk = self.blocks[r]
            curve[blk.lo : blk.hi] += blk.rows[k] - blk.rows[picks[r]]
            picks[r] = int(k)
            peak = int(peaks[i, k])


def _picks_of(p: _Problem, choices: Sequence[SpanChoice]) -> list[int]:
    """Each block's option index for the given choices (keep where none is chosen or it is not an option)."""
    by_choice = {o.choice: (r, k) for r, opts in enumerate(p.options) for k, o in enumerate(opts) if o.choice}
    picks = [next((k for k, o in enumerate(opts) if o.choice is None), 0) for opts in p.options]
    for c in choices:
        if c in by_choice:
            r, k = by_choice[c]
            picks[r] = k
    return picks


def prepare_replan(graph: OpGraph, config: TrainConfig, offload: str | None = None) -> None:
    """Build (and cache while the graph lives) what replan_choices needs for this trace: the
    per-block options, their effects and the move tables (none of it depends on the budget)."""
    p = _cached_problem(graph, config, None if offload in (None, "none") else offload, set(), set())
    if p.greedy is None:
        p.greedy = _Greedy(p)


def replan_choices(
    graph: OpGraph,
    config: TrainConfig,
    budget_bytes: int,
    start: Sequence[SpanChoice] = (),
    *,
    offload: str | None = None,
) -> Replan | None:
    """Re-plan a trace for a new budget in milliseconds, from a plan's choices (`start`) and from
    keeping everything, the cheaper of the two: greedy moves on the per-block options and their
    effects, computed once per trace and cached (they do not depend on the budget). The peak is exact (the simulator's); the time is not proven optimal
    (solve_choices does that). None when the moves cannot reach the budget."""
    t0 = time.perf_counter()
    offload = None if offload in (None, "none") else offload
    device = get_device(config.gpu)
    prepare_replan(graph, config, offload)
    p = _cached_problem(graph, config, offload, set(), set())
    if p.optimizer_peak > budget_bytes:
        return None
    runs = [p.greedy.run(budget_bytes, _picks_of(p, s)) for s in ([start, ()] if start else [()])]
    found = [picks for picks in runs if picks is not None]
    if not found:
        return None
    picks = min(found, key=p.greedy.cost_of)  # from the start given and from keeping everything
    chosen = [(p.options[r][k], p.effects[r][k]) for r, k in enumerate(picks)]
    effects = [e for _, e in chosen if e is not None]
    recompute_s = sum(e.cost_s for e in effects if e.transfer is None)
    transfers = [e.transfer for e in effects if e.transfer is not None]
    exposed = exposed_transfer_s(transfers, np.diff(p.clock), p.deadline_op, device) if transfers else 0.0
    return Replan(
        choices=tuple(o.choice for o, _ in chosen if o.choice is not None),
        option_names=tuple(o.name for o, _ in chosen),
        peak_bytes=p.peak_bytes(picks),
        recompute_s=recompute_s,
        recompute_flops=sum(e.recompute_flops for e in effects),
        offload_bytes=sum(e.offload_bytes for e in effects),
        exposed_offload_s=exposed,
        added_s=recompute_s + exposed,
        wall_s=time.perf_counter() - t0,
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
    hide_in_communication: bool = True,
) -> SolveResult:
    """Span choices whose simulated peak fits `budget_bytes` and that add the least step time (CP-SAT,
    deterministic). A recompute that runs while its block's backward waits on data-parallel
    communication adds only what exceeds the wait; `hide_in_communication=False` prices every
    recompute in full (the least recompute time, whatever the waits)."""
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
    p = _cached_problem(graph, config, offload, keep_set, force_set, hide_in_communication)
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
    # the model sums each choice's change: an input several chosen spans hold counts once per span
    # there, once in the simulator (effects.one_holder_each), so the model may only be above it
    assert timeline.peak_bytes <= model_peak <= budget_bytes, (
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
