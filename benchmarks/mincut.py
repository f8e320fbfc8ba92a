"""PyTorch's min-cut rematerialisation (torch.compile's partitioner) on the same models, via aot_module.

For a budget B (torch._functorch.config.activation_memory_budget, a fraction of *activation* memory)
the partitioned forward and backward graphs give: bytes saved for backward (forward outputs the
backward consumes, less the forward's own inputs) and recomputed FLOPs, counted directly: the backward
nodes whose (op target, input shapes) are extra against the no-remat default partition's backward,
each costed with memplan's per-op rule (costmodels.flops.op_flops) on its meta tensors.
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict

import torch
from torch import nn

from costmodels.flops import op_bytes_accessed, op_flops
from costmodels.runtime import op_time_s
from memplan_compat import tree_flatten, tree_map
from planner.tracing.recorder import loss_of, run_step_inputs
from planner.tracing.specs import resolve_spec


class _Loss(nn.Module):
    """Returns the loss as a tensor (aot_module cannot return the kwargs model's output object)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return loss_of(self.model(*args, **kwargs))


def _val(a):
    return a.meta.get("val") if isinstance(a, torch.fx.Node) else a


def node_flops(n: torch.fx.Node) -> int:
    """memplan's FLOP rule for one call_function node, on its meta tensors (inputs: args' meta['val'])."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return 0
    return op_flops(n.target, tree_map(_val, n.args), tree_map(_val, n.kwargs), n.meta.get("val"))


def graph_flops(gm: torch.fx.GraphModule) -> int:
    return sum(node_flops(n) for n in gm.graph.nodes)


def _shape(a):
    v = _val(a)
    if isinstance(v, torch.Tensor):
        return (tuple(int(s) for s in v.shape), str(v.dtype))
    return None


def node_key(n: torch.fx.Node) -> tuple:
    """(op target, input shapes): what identifies 'the same computation' across two partitions."""
    return (
        str(n.target),
        tuple(_shape(a) for a in tree_flatten((n.args, n.kwargs))[0] if isinstance(a, torch.fx.Node)),
    )


def node_time_s(n: torch.fx.Node, device) -> float:
    """memplan's eager roofline time of one node (each op its own kernel, as in eager mode)."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return 0.0
    args, kwargs, out = tree_map(_val, n.args), tree_map(_val, n.kwargs), n.meta.get("val")
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    flops = op_flops(n.target, args, kwargs, out)
    if flops == 0 and not outs:
        return 0.0
    dtype = outs[0].dtype if outs else torch.float32
    return op_time_s(flops, op_bytes_accessed((args, kwargs), out), dtype, device)


def recompute_time_s(remat_bw: torch.fx.GraphModule, base_bw: torch.fx.GraphModule, device) -> float:
    """Eager roofline seconds of the extra (recomputing) backward nodes, as recompute_flops counts them."""
    base = Counter(node_key(n) for n in base_bw.graph.nodes if n.op == "call_function")
    by_key: dict[tuple, list[float]] = defaultdict(list)
    for n in remat_bw.graph.nodes:
        if n.op == "call_function":
            by_key[node_key(n)].append(node_time_s(n, device))
    return sum(sum(sorted(t)[-(len(t) - base.get(k, 0)) :]) for k, t in by_key.items() if len(t) > base.get(k, 0))


def recompute_flops(remat_bw: torch.fx.GraphModule, base_bw: torch.fx.GraphModule) -> tuple[int, dict]:
    """FLOPs of the backward nodes that recompute forward ops: the multiset of (target, input shapes)
    of the remat backward less that of the no-remat backward; only extra nodes count (never negative).
    Returns (FLOPs, op name -> FLOPs)."""
    base = Counter(node_key(n) for n in base_bw.graph.nodes if n.op == "call_function")
    by_key: dict[tuple, list[int]] = defaultdict(list)
    for n in remat_bw.graph.nodes:
        if n.op == "call_function":
            by_key[node_key(n)].append(node_flops(n))
    total, by_op = 0, defaultdict(int)
    for key, flops in by_key.items():
        extra = len(flops) - base.get(key, 0)
        if extra > 0:
            f = sum(sorted(flops)[-extra:])  # equal keys give equal FLOPs; take the largest to be safe
            total += f
            by_op[key[0]] += f
    return total, dict(by_op)


def saved_bytes(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> int:
    """Bytes of the forward graph's outputs that the backward consumes, less the forward's inputs
    (parameters, buffers and batch inputs passed through: they are live anyway)."""
    fw_inputs = {n.name for n in fw.graph.nodes if n.op == "placeholder"}
    (out,) = [n for n in fw.graph.nodes if n.op == "output"]
    fw_outputs = {a.name: a for a in tree_flatten(out.args)[0] if isinstance(a, torch.fx.Node)}
    total = 0
    for n in bw.graph.nodes:
        if n.op != "placeholder" or n.name not in fw_outputs:
            continue
        src = fw_outputs[n.name]
        if src.op == "placeholder" or src.name in fw_inputs:
            continue
        v = src.meta.get("val")
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return total


def _untie(model: nn.Module) -> None:
    """aot_module rejects tied weights (GPT-2's lm_head/wte): give each use its own copy (FLOPs unchanged)."""
    seen: set[int] = set()
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) in seen:
                m._parameters[name] = nn.Parameter(p.detach().clone())
            seen.add(id(p))


def partition(spec: str, batch_size: int, seq_len: int, budget: float | None) -> dict:
    """One real forward+backward through aot_module; budget None = default_partition (no remat)."""
    from functorch.compile import aot_module, make_boxed_func

    from memplan_compat import default_partition, min_cut_rematerialization_partition
    from memplan_compat import functorch_config as fconfig

    torch.manual_seed(0)
    model, inputs = resolve_spec(spec).build(batch_size=batch_size, seq_len=seq_len)
    for m in model.modules():  # running-stat updates trip aot's saved-tensor version check under remat
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.track_running_stats = False
    _untie(model)
    got: dict = {}

    def keep(key):
        def compiler(gm, _):
            got[key] = gm
            return make_boxed_func(gm)

        return compiler

    part = (
        default_partition
        if budget is None
        else functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    )
    with fconfig.patch(activation_memory_budget=1.0 if budget is None else budget):
        wrapped = aot_module(_Loss(model), fw_compiler=keep("fw"), bw_compiler=keep("bw"), partition_fn=part)
        run_step_inputs(wrapped, inputs).backward()
    fw, bw = graph_flops(got["fw"]), graph_flops(got["bw"])
    return {
        "fw_flops": fw,
        "bw_flops": bw,
        "flops": fw + bw,
        "saved_bytes": saved_bytes(got["fw"], got["bw"]),
        "fw": got["fw"],
        "bw": got["bw"],
    }
