"""Plans for compiled training: per block, the memory/time frontier of torch.compile's own partitioner,
and a per-block choice of `activation_memory_budget` under a global budget.

For one block (its module and the arguments it is called with, all fake tensors), AOTAutograd traces
the joint forward+backward graph and the min-cut partitioner splits it at each budget in `BUDGETS`.
Each split gives the bytes the forward saves for the backward (outputs of the forward graph that
the backward reads, less the block's own inputs and parameters) and what the backward recomputes:
its nodes beyond those of the budget-1.0 split. Recompute is priced as inductor runs it: matmuls,
convolutions and attention at the roofline of their FLOPs; recomputed pointwise and reduction ops
fuse into the backward's kernels, so each costs one pass over its output's bytes.

CP-SAT then picks one point per block (a multiple-choice knapsack): the least recompute time whose
saved bytes fit what the budget leaves for activations.
"""

from __future__ import annotations

import functools
import operator
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from functorch.compile import aot_function, make_boxed_func
from ortools.sat.python import cp_model
from torch import nn
from torch._functorch import config as functorch_config
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from costmodels.flops import op_bytes_accessed, op_flops
from costmodels.hardware import DeviceSpec, get_device
from costmodels.runtime import BANDWIDTH_EFFICIENCY, op_time_s
from planner.config import TrainConfig
from planner.errors import InfeasibleBudget, SolverTimeout, SpecError, TraceError
from planner.plans.format import CompiledPlan, CompiledPoint, CompiledPrediction
from planner.runtime.auto import parse_budget
from planner.safe_io import clean
from planner.signals import interruptible
from planner.simulation.costs import storage_bytes
from planner.simulation.effects import ModuleSpan, SpanChoice, dropped_tensors, module_span
from planner.simulation.step import simulate
from planner.solver.planning import graph_model_info
from planner.tracing.graph import OpGraph
from planner.tracing.hf import disable_kv_cache, skip_init
from planner.tracing.op_classes import ATTENTION_OPS, CONV_OPS, MATMUL_OPS
from planner.tracing.recorder import loss_of, trace_for
from planner.tracing.specs import resolve_spec
from planner.units import format_bytes

__all__ = [
    "BUDGETS",
    "block_call",
    "block_frontier",
    "choose_budgets",
    "CompiledSkeleton",
    "SCOPES",
    "WHOLE_MODEL",
    "Window",
    "plan_compiled",
]

BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)
_HEAVY = MATMUL_OPS | CONV_OPS | ATTENTION_OPS


class _Stop(Exception):
    pass


def block_call(model: nn.Module, inputs: tuple | dict, path: str) -> tuple[tuple, dict]:
    """The (args, kwargs) the model calls the block at `path` with (its first call), by running the
    model's forward until that call (on fake tensors this allocates nothing)."""
    block = model.get_submodule(path)
    got: list[tuple[tuple, dict]] = []

    def hook(_module, args, kwargs):
        got.append((args, kwargs))
        raise _Stop

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not got:
        raise ValueError(f"the model's forward never calls '{path}'; name a block its forward runs")
    return got[0]


def _val(a: Any) -> Any:
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


def _node_cost(n: torch.fx.Node, device: DeviceSpec) -> tuple[float, int]:
    """(seconds, FLOPs) of one recomputed node as inductor runs it (see module docstring)."""
    args, kwargs, out = tree_map(_val, n.args), tree_map(_val, n.kwargs), n.meta.get("val")
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if not outs:
        return 0.0, 0
    flops = op_flops(n.target, args, kwargs, out)
    if str(n.target) in _HEAVY:
        return op_time_s(flops, op_bytes_accessed((args, kwargs), out), outs[0].dtype, device), flops
    nbytes = sum(t.numel() * t.element_size() for t in outs)
    return nbytes / (BANDWIDTH_EFFICIENCY * device.hbm_bytes_per_s), flops


def _key(n: torch.fx.Node) -> tuple:
    shapes = tuple(
        tuple(v.shape) if isinstance(v, torch.Tensor) else None
        for v in (_val(a) for a in tree_flatten((n.args, n.kwargs))[0] if isinstance(a, torch.fx.Node))
    )
    return str(n.target), shapes


def _compute_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]


def _base(n: torch.fx.Node) -> torch.fx.Node:
    """The node whose output a chain of view ops looks into."""
    while n.op == "call_function" and getattr(n.target, "is_view", False) and isinstance(n.args[0], torch.fx.Node):
        n = n.args[0]
    return n


def _owner(n: torch.fx.Node) -> torch.fx.Node:
    """The node that allocated what `n` holds: through views and through items of a multi-output op."""
    while n.op == "call_function" and isinstance(n.args[0] if n.args else None, torch.fx.Node):
        if not (getattr(n.target, "is_view", False) or n.target is operator.getitem):
            break
        n = n.args[0]
    return n


def _tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


def _fused_away(n: torch.fx.Node, outputs: set[torch.fx.Node]) -> bool:
    """A pointwise node inductor fuses into its consumers: every user is pointwise and it is no output."""
    pointwise = torch.Tag.pointwise

    def is_pointwise(m: torch.fx.Node) -> bool:
        return m.op == "call_function" and isinstance(m.target, torch._ops.OpOverload) and pointwise in m.target.tags

    return is_pointwise(n) and n not in outputs and all(is_pointwise(u) for u in n.users)


def _graph_peak_bytes(gm: torch.fx.GraphModule, with_inputs: bool) -> int:
    """Peak bytes a graph holds as inductor runs it: each node's output from its node to its last
    use, the graph's outputs to the end, and with `with_inputs` its inputs until their last use
    (a backward's saved tensors and incoming gradients; a forward's inputs are the caller's). Without
    inputs (a forward), pointwise nodes inductor fuses into their consumers hold nothing."""
    nodes = list(gm.graph.nodes)
    last_use: dict[torch.fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last_use[_owner(a)] = len(nodes) if n.op == "output" else i
    outputs = {_owner(a) for a in nodes[-1].all_input_nodes}
    counted = ("placeholder", "call_function") if with_inputs else ("call_function",)
    live = peak = 0
    held: set[torch.fx.Node] = set()
    for i, n in enumerate(nodes):
        if n.op in counted and _owner(n) is n and (with_inputs or not _fused_away(n, outputs)):
            held.add(n)
            live += _tensor_bytes(n.meta.get("val"))
        peak = max(peak, live)
        for a in {_owner(x) for x in n.all_input_nodes}:
            if last_use.get(a) == i and a in held:
                live -= _tensor_bytes(a.meta.get("val"))
    return peak


def _saved_bytes(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> int:
    """Bytes of the forward outputs the backward reads, each underlying tensor once (a view counts
    as its base), less the forward's own inputs and their views."""
    (out,) = [n for n in fw.graph.nodes if n.op == "output"]
    fw_outputs = {a.name: a for a in tree_flatten(out.args)[0] if isinstance(a, torch.fx.Node)}
    bases = {_base(fw_outputs[n.name]) for n in bw.graph.nodes if n.op == "placeholder" and n.name in fw_outputs}
    total = 0
    for b in bases:
        v = b.meta.get("val")
        if b.op != "placeholder" and isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


@contextmanager
def _batch_stats_only(norms: list[nn.Module]) -> Iterator[None]:
    for m in norms:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in norms:
            m.track_running_stats = True


def _split(block: nn.Module, args: tuple, kwargs: dict, budget: float) -> tuple[Any, Any]:
    """(forward graph, backward graph) of the block at one budget."""
    got: dict[str, torch.fx.GraphModule] = {}

    def keep(key: str):
        def compiler(gm, _example):
            got[key] = gm
            return make_boxed_func(gm)

        return compiler

    names = [n for n, _ in block.named_parameters()]
    flat, spec = tree_flatten((args, kwargs))
    tensor_at = [k for k, a in enumerate(flat) if isinstance(a, torch.Tensor)]

    def f(*xs):
        params, tensors = xs[: len(names)], xs[len(names) :]
        values = list(flat)
        for k, t in zip(tensor_at, tensors):
            values[k] = t
        a, kw = torch.utils._pytree.tree_unflatten(values, spec)
        return torch.func.functional_call(block, dict(zip(names, params)), a, kw)

    params = [p.detach().requires_grad_(p.requires_grad) for p in block.parameters()]
    tensors = [flat[k].detach().requires_grad_(flat[k].requires_grad) for k in tensor_at]  # as the model calls it
    partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    # BatchNorm's running-stat updates trip AOTAutograd's saved-tensor version check under remat;
    # training-mode BatchNorm computes the same with batch statistics only
    norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    with functorch_config.patch(activation_memory_budget=budget), _batch_stats_only(norms):
        compiled = aot_function(
            f,
            fw_compiler=keep("fw"),
            bw_compiler=keep("bw"),
            partition_fn=partition,
            decompositions=select_decomp_table(),
        )
        out = compiled(*params, *tensors)
        sum(t.sum() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad).backward()
    return got["fw"], got["bw"]


def block_frontier(
    block: nn.Module, args: tuple, kwargs: dict, device: DeviceSpec, budgets: Sequence[float] = BUDGETS
) -> list[CompiledPoint]:
    """The partitioner's split of one block at each budget (fake tensors in, nothing allocated),
    without points that save as much as a cheaper one."""
    base_fw, base_bw = _split(block, args, kwargs, 1.0)
    base = Counter(_key(n) for n in _compute_nodes(base_bw))
    points = []
    for budget in budgets:
        fw, bw = (base_fw, base_bw) if budget == 1.0 else _split(block, args, kwargs, budget)
        seen: Counter = Counter()
        seconds, flops = 0.0, 0
        for n in _compute_nodes(bw):
            k = _key(n)
            seen[k] += 1
            if seen[k] > base.get(k, 0):  # beyond the budget-1.0 backward: a recompute
                s, f = _node_cost(n, device)
                seconds, flops = seconds + s, flops + f
        points.append(
            CompiledPoint(
                budget,
                _saved_bytes(fw, bw),
                seconds,
                flops,
                backward_bytes=_graph_peak_bytes(bw, with_inputs=True),
                forward_bytes=_graph_peak_bytes(fw, with_inputs=False),
            )
        )
    points.sort(key=lambda p: (p.recompute_s, p.saved_bytes))
    frontier: list[CompiledPoint] = []
    for p in points:
        if not frontier or p.saved_bytes < frontier[-1].saved_bytes:
            frontier.append(p)
    return frontier


FORWARD, SAVED, BACKWARD = 1, 2, 3  # what a block's split adds at a sample of a CompiledSkeleton


@dataclass(frozen=True)
class Window:
    """A stretch of the step: blocks running their forward, blocks holding their saved bytes, blocks
    running their backward, and the bytes the budget leaves them there."""

    forward: tuple[int, ...]
    saved: tuple[int, ...]
    backward: tuple[int, ...]
    cap_bytes: int

    def terms(self, points: Sequence[Sequence[CompiledPoint]]) -> list[tuple[int, int, int]]:
        """(block, point index, bytes) of every choice this window counts."""
        return [
            (i, j, getattr(p, field))
            for blocks, field in (
                (self.forward, "forward_bytes"),
                (self.saved, "saved_bytes"),
                (self.backward, "backward_bytes"),
            )
            for i in blocks
            for j, p in enumerate(points[i])
        ]


def choose_budgets(
    frontiers: Sequence[Sequence[CompiledPoint]], windows: Sequence[Window], time_limit_s: float = 10.0
) -> list[CompiledPoint]:
    """One point per block with the least total recompute time such that in every window the blocks'
    bytes fit its cap (CP-SAT; times in microseconds). InfeasibleBudget when even the smallest
    points do not fit."""
    model = cp_model.CpModel()
    picks = [[model.new_bool_var(f"b{i}p{j}") for j in range(len(f))] for i, f in enumerate(frontiers)]
    for row in picks:
        model.add_exactly_one(row)
    for w in windows:
        model.add(sum(picks[i][j] * nbytes for i, j, nbytes in w.terms(frontiers)) <= w.cap_bytes)
    model.minimize(sum(v * round(p.recompute_s * 1e6) for row, f in zip(picks, frontiers) for v, p in zip(row, f)))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 1
    with interruptible(solver):  # Ctrl-C stops the search and raises; the caller's SIGINT handler stays
        status = solver.solve(model)
    if status == cp_model.INFEASIBLE:
        raise InfeasibleBudget("no per-block budgets fit every window; raise the budget")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise SolverTimeout(f"CP-SAT found no per-block budgets in {time_limit_s:g}s; raise --time-limit")
    return [f[next(j for j, v in enumerate(row) if solver.value(v))] for row, f in zip(picks, frontiers)]


WHOLE_MODEL = ""  # the module path of a plan that compiles the whole model (and its loss) at one budget
SCOPES = ("auto", "blocks", "model")


class _WithLoss(nn.Module):
    """The model and its step's loss as one module: the whole step's graph, split as a block."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return loss_of(self.model(*args, **kwargs))


def _split_error(what: str, exc: Exception) -> TraceError:
    first = clean(str(exc).splitlines()[0] if str(exc) else "")
    return TraceError(
        f"torch.compile's partitioner could not split {what} on fake tensors ({type(exc).__name__}: {first}); "
        "plan it for eager training, without --compile"
    )


@dataclass(frozen=True)
class _Option:
    """One way to compile the step: module path -> its split, with the predicted peak."""

    points: dict[str, CompiledPoint]
    peak_bytes: int

    @property
    def recompute_s(self) -> float:
        return sum(p.recompute_s for p in self.points.values())


def _per_block(
    graph: OpGraph,
    config: TrainConfig,
    frontiers: dict[str, list[CompiledPoint]],
    budget_bytes: int,
    time_limit_s: float,
) -> tuple[_Option | None, int]:
    """The least-recompute per-block budgets under budget_bytes (None when none fit), and the least
    peak per-block budgets reach."""
    rows = [frontiers[r.signature] for r in graph.regions]
    skeleton = CompiledSkeleton.of(graph, config, [module_span(graph, r.path) for r in graph.regions], rows)
    smallest = skeleton.peak_bytes([min(f, key=lambda p: p.saved_bytes) for f in rows])
    try:
        chosen = choose_budgets(rows, skeleton.windows(budget_bytes), time_limit_s)
    except InfeasibleBudget:
        return None, smallest
    points = {r.path: p for r, p in zip(graph.regions, chosen)}
    return _Option(points, skeleton.peak_bytes(chosen)), smallest


def _whole_model(
    graph: OpGraph, config: TrainConfig, frontier: list[CompiledPoint], budget_bytes: int
) -> tuple[_Option | None, int]:
    """The whole model's least-recompute split under budget_bytes (None when none fits), and the
    least peak its splits reach."""
    skeleton = CompiledSkeleton.of(graph, config, [module_span(graph, WHOLE_MODEL)], [frontier])
    options = [_Option({WHOLE_MODEL: p}, skeleton.peak_bytes([p])) for p in frontier]
    fitting = [o for o in options if o.peak_bytes <= budget_bytes]
    best = min(fitting, key=lambda o: (o.recompute_s, o.peak_bytes)) if fitting else None
    return best, min(o.peak_bytes for o in options)


def plan_compiled(
    spec: str,
    config: TrainConfig,
    budget: int | str,
    time_limit_s: float = 10.0,
    budgets: Sequence[float] = BUDGETS,
    scope: str = "auto",
) -> CompiledPlan:
    """Activation budgets for torch.compile under a peak budget (bytes, a size such as '8GiB' or a
    percentage of the no-plan peak such as '60%'), from the partitioner's splits on fake tensors.

    scope "blocks": one budget per block (one frontier per block signature), the rest of the step
    eager; "model": the whole model and its loss compiled as `torch.compile(model)` runs it, at
    budget 1.0 only (below it the partitioner recomputes across the whole graph and inductor's
    backward held 12-25% more than memplan's liveness of that graph predicts, on the test models at
    0.5); "auto": whichever recomputes less (the whole model on a tie: it also fuses the code between
    blocks), the blocks alone when the whole model's graph cannot be split."""
    if scope not in SCOPES:
        raise SpecError(f"compile scope '{scope}' is not one of {', '.join(SCOPES)}")
    graph = trace_for(spec, config)
    timeline = simulate(graph, config)
    budget_bytes = parse_budget(budget, timeline.peak_bytes)
    device = get_device(config.gpu)
    frontiers: dict[str, list[CompiledPoint]] = {}
    with FakeTensorMode(allow_non_fake_inputs=True), skip_init():
        model, inputs = resolve_spec(spec).build(batch_size=config.batch_size, seq_len=config.seq_len)
        model.train()
        disable_kv_cache(model)  # as the trace and compile_blocks run it
        if scope != "model":
            for region in graph.regions:
                if region.signature not in frontiers:
                    args, kwargs = block_call(model, inputs, region.path)
                    try:
                        frontiers[region.signature] = block_frontier(
                            model.get_submodule(region.path), args, kwargs, device, budgets
                        )
                    except Exception as exc:  # AOTAutograd and the partitioner raise many kinds
                        raise _split_error(f"block '{region.path}'", exc) from None
        if scope != "blocks":
            args, kwargs = ((), dict(inputs)) if isinstance(inputs, dict) else (tuple(inputs), {})
            try:
                frontiers[WHOLE_MODEL] = block_frontier(_WithLoss(model), args, kwargs, device, (1.0,))
            except Exception as exc:
                if scope == "model":
                    raise _split_error("the whole model", exc) from None
    found: list[tuple[_Option | None, int]] = []
    if scope != "model":
        block_frontiers = {k: v for k, v in frontiers.items() if k != WHOLE_MODEL}
        found.append(_per_block(graph, config, block_frontiers, budget_bytes, time_limit_s))
    if WHOLE_MODEL in frontiers:
        found.append(_whole_model(graph, config, frontiers[WHOLE_MODEL], budget_bytes))
    options = [o for o, _ in found if o is not None]
    if not options:
        smallest = min(least for _, least in found)
        raise InfeasibleBudget(
            f"no activation budgets fit {format_bytes(budget_bytes)}; with the least the partitioner can "
            f"save the compiled peak is {format_bytes(smallest)}; raise --budget",
            smallest_peak_bytes=smallest,
        )
    best = min(options, key=lambda o: (round(o.recompute_s * 1e6), WHOLE_MODEL not in o.points))
    step_s = timeline.costs.step_s
    return CompiledPlan(
        model=graph_model_info(graph),
        config={**config.with_(compile=True).to_dict(), **graph.assumptions()},
        budget_bytes=budget_bytes,
        budgets={path: p.budget for path, p in best.points.items()},
        predicted=CompiledPrediction(
            peak_bytes=best.peak_bytes,
            baseline_peak_bytes=timeline.peak_bytes,
            recompute_s=best.recompute_s,
            overhead=best.recompute_s / step_s if step_s else 0.0,
        ),
        frontiers={k: tuple(v) for k, v in frontiers.items()},
    )


@dataclass(frozen=True)
class CompiledSkeleton:
    """A compiled step around its blocks' splits: `base` bytes at each sample, and what each block's
    split adds on top (`holds`, blocks x samples): its forward graph's peak (FORWARD) while that
    runs, its saved bytes (SAVED) from the end of its forward to the start of its backward, its
    backward graph's peak (BACKWARD) while that runs.

    It comes from the eager step with every block checkpointed: model states, the blocks' inputs,
    everything outside the blocks, and a block's re-created activations and gradient temporaries
    while its backward runs. While a block's forward runs, base holds what was live before it (the
    forward graph's peak, outputs included, comes on top). In a block's backward, the split without
    recompute (`unsplit`) stands in for the eager replay: base gains its saved bytes less the replay
    and less its backward peak, and the chosen split's backward peak comes on top (so the unsplit
    split reads as itself).
    """

    base: np.ndarray
    holds: np.ndarray

    @classmethod
    def of(
        cls,
        graph: OpGraph,
        config: TrainConfig,
        spans: Sequence[ModuleSpan],
        frontiers: Sequence[Sequence[CompiledPoint]],
    ) -> CompiledSkeleton:
        """The step with each span (a block, or the whole model) compiled; `frontiers[k]`: span k's splits."""
        unsplit = [max(f, key=lambda p: p.saved_bytes) for f in frontiers]  # the split without recompute
        timeline = simulate(graph, config, choices=[SpanChoice(span, "recompute") for span in spans])
        sizes = storage_bytes(graph, config)
        at = timeline.op_index
        eager = timeline.total.astype(np.int64)
        base = eager.copy()
        holds = np.zeros((len(spans), len(at)), dtype=np.int8)
        for k, (span, point) in enumerate(zip(spans, unsplit)):
            forward = (at >= span.fwd_start) & (at < span.fwd_end)
            first_op_bytes = sum(sizes[t] for t, tensor in graph.tensors.items() if tensor.alloc_op == span.fwd_start)
            base[forward] = eager[np.argmax(forward)] - first_op_bytes  # what was live before the block
            holds[k, forward] = FORWARD
            replay = sum(sizes[t] for t in dropped_tensors(graph, span))
            backward = (at >= span.bwd_start) & (at < span.bwd_end)
            base[backward] += point.saved_bytes - replay - point.backward_bytes
            holds[k, (at >= span.fwd_end) & (at < span.bwd_start)] = SAVED
            holds[k, backward] = BACKWARD
        return cls(base, holds)

    def peak_bytes(self, points: Sequence[CompiledPoint]) -> int:
        """Peak of the step with block k split at points[k]."""
        total = self.base.copy()
        for hold, field in ((FORWARD, "forward_bytes"), (SAVED, "saved_bytes"), (BACKWARD, "backward_bytes")):
            total += np.array([getattr(p, field) for p in points], dtype=np.int64) @ (self.holds == hold)
        return int(total.max())

    def windows(self, budget_bytes: int) -> list[Window]:
        """One constraint of choose_budgets per distinct pattern of what the blocks hold: the budget
        less the highest base under that pattern."""
        patterns, which = np.unique(self.holds.T, axis=0, return_inverse=True)
        highest = np.full(len(patterns), np.iinfo(np.int64).min)
        np.maximum.at(highest, which.ravel(), self.base)
        return [
            Window(
                tuple(np.flatnonzero(row == FORWARD).tolist()),
                tuple(np.flatnonzero(row == SAVED).tolist()),
                tuple(np.flatnonzero(row == BACKWARD).tolist()),
                int(budget_bytes - top),
            )
            for row, top in zip(patterns, highest)
        ]
