"""A block's memory/time frontier from torch.compile's own partitioner, on fake tensors.

For one block (its module and the arguments it is called with, all fake tensors), AOTAutograd traces
the joint forward+backward graph and the min-cut partitioner splits it at each budget in `BUDGETS`.
Each split gives the bytes the forward saves for the backward (outputs of the forward graph that
the backward reads, less the block's own inputs and parameters), the peaks its forward and backward
graphs hold, and what the backward recomputes: its nodes beyond those of the budget-1.0 split.
Recompute is priced as inductor runs it: matmuls, convolutions and attention at the roofline of
their FLOPs; recomputed pointwise and reduction ops fuse into the backward's kernels, so each costs
one pass over its output's bytes.
"""

from __future__ import annotations

import functools
import operator
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from functorch.compile import aot_function, make_boxed_func
from torch import nn
from torch._functorch import config as functorch_config
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table
from torch.utils._pytree import tree_flatten, tree_map

from costmodels.flops import op_bytes_accessed, op_flops
from costmodels.hardware import DeviceSpec
from costmodels.runtime import BANDWIDTH_EFFICIENCY, op_time_s
from planner.plans.format import CompiledPoint
from planner.tracing.op_classes import ATTENTION_OPS, CONV_OPS, MATMUL_OPS

__all__ = ["BUDGETS", "block_call", "block_frontier"]

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
