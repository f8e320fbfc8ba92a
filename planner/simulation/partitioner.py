"""A block's memory/time frontier from torch.compile's own partitioner, on fake tensors.

For one block (its module and the arguments it is called with, all fake tensors), AOTAutograd traces
the joint forward+backward graph and the min-cut partitioner splits it at each budget in `BUDGETS`.
Each split gives the bytes the forward saves for the backward (outputs of the forward graph that
the backward reads, less the block's own inputs and parameters), the peaks its forward and backward
graphs hold, and what the backward recomputes: its nodes beyond those of the budget-1.0 split.

The peaks are inductor's own estimate: each graph is lowered and scheduled by inductor (fake
tensors, stopped before code generation) and `torch._inductor.memory` gives the peak of the order
its peak-memory pass picks. That sees what the partitioner's graphs do not: fusion, the order in
which inductor runs the kernels (it defers weight-gradient matmuls), and the items of a multi-output
op (a convolution's input gradient) freed apart. The backward is estimated with its saved tensors
strided as inductor's forward returns them (channels-last where it re-laid a convolution), as
AOTAutograd compiles it. On the benchmark ResNet the whole model's compiled peak came within 1% of
the profiler's at budgets 1.0, 0.7, 0.5 and 0.3.

Recompute is priced as inductor runs it: matmuls, convolutions and attention at the roofline of
their FLOPs; recomputed pointwise and reduction ops fuse into the backward's kernels, so each costs
one pass over its output's bytes.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from functorch.compile import aot_function, make_boxed_func
from torch import nn

from costmodels.flops import op_bytes_accessed, op_flops
from costmodels.hardware import DeviceSpec
from costmodels.runtime import BANDWIDTH_EFFICIENCY, op_time_s
from memplan_compat import (
    IRNode,
    V,
    compile_fx_inner,
    detect_fake_mode,
    functorch_config,
    inductor_config,
    inductor_memory,
    min_cut_rematerialization_partition,
    select_decomp_table,
    tree_flatten,
    tree_map,
)
from planner.plans.format import CompiledPoint
from planner.tracing.op_classes import EXTERN_KERNEL_OPS

__all__ = ["BUDGETS", "block_call", "block_frontier", "fused_pass_s"]

BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)


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


def fused_pass_s(nbytes: int, device: DeviceSpec) -> float:
    """Seconds of a pointwise or reduction op inductor fuses into a kernel: one pass over its output."""
    return nbytes / (BANDWIDTH_EFFICIENCY * device.hbm_bytes_per_s)


def _node_cost(n: torch.fx.Node, device: DeviceSpec) -> tuple[float, int]:
    """(seconds, FLOPs) of one recomputed node as inductor runs it (see module docstring)."""
    args, kwargs, out = tree_map(_val, n.args), tree_map(_val, n.kwargs), n.meta.get("val")
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    if not outs:
        return 0.0, 0
    flops = op_flops(n.target, args, kwargs, out)
    if str(n.target) in EXTERN_KERNEL_OPS:
        return op_time_s(flops, op_bytes_accessed((args, kwargs), out), outs[0].dtype, device), flops
    return fused_pass_s(sum(t.numel() * t.element_size() for t in outs), device), flops


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


class _Scheduled(Exception):
    """Raised once inductor's scheduler has ordered a graph: nothing after it is needed."""


def _inductor_peak_bytes(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    backward: bool,
    counted_inputs: frozenset[str],
    options: Mapping[str, Any],
) -> tuple[int, list[tuple[int, ...] | None]]:
    """Peak bytes inductor estimates for `gm` as it will run it: lowered, fused and ordered by its
    scheduler (the order its peak-memory pass picks), stopped before code generation. Buffers are
    held from their kernel to their last reader, the graph's outputs to the end, and the inputs
    named in `counted_inputs` (a backward's saved activations) until their last reader; the other
    inputs (parameters, the block's inputs, incoming gradients) are the caller's. `options`: inductor's
    config as the block will compile. Also the strides inductor gives the graph's outputs (None
    where an output is no tensor of its own)."""
    found: list[tuple[int, list[tuple[int, ...] | None]]] = []
    reorder = inductor_memory.reorder_for_peak_memory

    def estimate(nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs, *args, **kwargs):
        order = reorder(nodes, name_to_buf, name_to_fused_node, graph_inputs, graph_outputs, *args, **kwargs)
        freeable = inductor_memory.get_freeable_input_buf(order, graph_inputs)
        inputs = {name: buf for name, buf in freeable.items() if name in counted_inputs}
        strides = [
            tuple(int(s) for s in out.get_layout().stride)
            if isinstance(out, IRNode) and out.has_tensor_output()
            else None
            for out in V.graph.graph_outputs
        ]
        found.append((inductor_memory.estimate_peak_memory(order, inputs, graph_outputs)[0], strides))
        raise _Scheduled

    inductor_memory.reorder_for_peak_memory = estimate
    try:
        with inductor_config.patch({**options, "fx_graph_cache": False, "reorder_for_peak_memory": True}):
            compile_fx_inner(gm, example_inputs, is_backward=backward)
    except Exception:  # inductor wraps what its passes raise, _Scheduled included
        if not found:
            raise
    finally:
        inductor_memory.reorder_for_peak_memory = reorder
    return found[0] if found else (0, [])  # a graph with no kernels allocates nothing


def _as_saved(
    bw: torch.fx.GraphModule, example_inputs: Sequence[Any], fw: torch.fx.GraphModule, strides: Sequence[Any]
) -> list[Any]:
    """The backward's example inputs with each saved tensor strided as inductor's forward returns it
    (channels-last where it re-laid a convolution's output), as AOTAutograd compiles the backward."""
    stride_of = {a.name: s for a, s in zip(_outputs(fw), strides) if isinstance(a, torch.fx.Node)}
    fake_mode = detect_fake_mode(example_inputs)
    restrided = list(example_inputs)
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    for i, (n, x) in enumerate(zip(placeholders, example_inputs)):
        stride = stride_of.get(n.name)
        if isinstance(x, torch.Tensor) and stride is not None and tuple(x.stride()) != stride:
            with fake_mode:
                restrided[i] = torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device)
    return restrided


def _outputs(gm: torch.fx.GraphModule) -> list[Any]:
    """The graph's outputs in order (nodes, and constants where an output is no node)."""
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    return tree_flatten(out.args)[0]


def _saved_activations(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    """The backward's inputs that the forward saved for it, by name -> the forward node that allocated
    each (a view's base), less the forward's own inputs and their views."""
    fw_outputs = {a.name: a for a in _outputs(fw) if isinstance(a, torch.fx.Node)}
    saved = {}
    for n in bw.graph.nodes:
        if n.op == "placeholder" and n.name in fw_outputs:
            base = _base(fw_outputs[n.name])
            if base.op != "placeholder" and isinstance(base.meta.get("val"), torch.Tensor):
                saved[n.name] = base
    return saved


def _saved_bytes(saved: Mapping[str, torch.fx.Node]) -> int:
    """Bytes of the saved activations (`_saved_activations`), each underlying tensor once."""
    return sum(b.meta["val"].numel() * b.meta["val"].element_size() for b in set(saved.values()))


@dataclass(frozen=True)
class _Split:
    """A block's split at one budget: its backward graph, the bytes its forward saves for it, and
    inductor's peak estimate of each graph."""

    backward: torch.fx.GraphModule
    saved_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int


@contextmanager
def _batch_stats_only(norms: list[nn.Module]) -> Iterator[None]:
    for m in norms:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in norms:
            m.track_running_stats = True


def _split(block: nn.Module, args: tuple, kwargs: dict, budget: float, options: Mapping[str, Any]) -> _Split:
    """The block's split at one budget."""
    forward: list[tuple[torch.fx.GraphModule, int, list[tuple[int, ...] | None]]] = []  # graph, peak, strides
    got: list[_Split] = []

    def forward_compiler(gm, example_inputs):
        forward.append((gm, *_inductor_peak_bytes(gm, example_inputs, False, frozenset(), options)))
        return make_boxed_func(gm)

    def backward_compiler(gm, example_inputs):
        ((fw, fw_peak, strides),) = forward
        saved = _saved_activations(fw, gm)
        example_inputs = _as_saved(gm, example_inputs, fw, strides)
        bw_peak, _ = _inductor_peak_bytes(gm, example_inputs, True, frozenset(saved), options)
        got.append(_Split(gm, _saved_bytes(saved), fw_peak, bw_peak))
        return make_boxed_func(gm)

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
            fw_compiler=forward_compiler,
            bw_compiler=backward_compiler,
            partition_fn=partition,
            decompositions=select_decomp_table(),
        )
        out = compiled(*params, *tensors)
        sum(t.sum() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad).backward()
    return got[0]


def block_frontier(
    block: nn.Module,
    args: tuple,
    kwargs: dict,
    device: DeviceSpec,
    budgets: Sequence[float] = BUDGETS,
    options: Mapping[str, Any] | None = None,
) -> list[CompiledPoint]:
    """The partitioner's split of one block at each budget (fake tensors in, nothing allocated),
    without points that hold as much as a cheaper one. `options`: inductor's config as the block
    will compile (`planner.tracing.inductor_layout.inductor_options`)."""
    options = {} if options is None else options
    base = _split(block, args, kwargs, 1.0, options)
    base_nodes = Counter(_key(n) for n in _compute_nodes(base.backward))
    points = []
    for budget in budgets:
        split = base if budget == 1.0 else _split(block, args, kwargs, budget, options)
        seen: Counter = Counter()
        seconds, flops = 0.0, 0
        for n in _compute_nodes(split.backward):
            k = _key(n)
            seen[k] += 1
            if seen[k] > base_nodes.get(k, 0):  # beyond the budget-1.0 backward: a recompute
                s, f = _node_cost(n, device)
                seconds, flops = seconds + s, flops + f
        points.append(
            CompiledPoint(
                budget,
                split.saved_bytes,
                seconds,
                flops,
                backward_bytes=split.backward_peak_bytes,
                forward_bytes=split.forward_peak_bytes,
            )
        )
    points.sort(key=lambda p: (p.recompute_s, p.saved_bytes))
    frontier: list[CompiledPoint] = []
    for p in points:
        if not any(_holds_no_more(q, p) for q in frontier):
            frontier.append(p)
    return frontier


def _holds_no_more(a: CompiledPoint, b: CompiledPoint) -> bool:
    """`a` holds at most what `b` holds at every moment of the step (saved, forward and backward bytes)."""
    return all(getattr(a, f) <= getattr(b, f) for f in ("saved_bytes", "forward_bytes", "backward_bytes"))
