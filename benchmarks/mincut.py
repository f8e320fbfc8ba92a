"""PyTorch's min-cut rematerialisation (torch.compile's partitioner) on the same models, via aot_module.

For a memory budget B (torch._functorch.config.activation_memory_budget) the partitioned forward and
backward graphs give: bytes saved for backward (backward placeholders that are neither parameters,
inputs nor tangents) and FLOPs (memplan's per-op rule, costmodels.flops.op_flops, on every node).
Recomputed FLOPs = FLOPs of both graphs minus those of the no-remat default partition.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils._pytree import tree_map

from costmodels.flops import op_flops
from planner.spec import resolve_spec
from planner.trace import loss_of, run_step_inputs


class _Loss(nn.Module):
    """Returns the loss as a tensor (aot_module cannot return the kwargs model's output object)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return loss_of(self.model(*args, **kwargs))


def graph_flops(gm: torch.fx.GraphModule) -> int:
    def val(a):
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    total = 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            total += op_flops(n.target, tree_map(val, n.args), tree_map(val, n.kwargs), n.meta.get("val"))
    return total


def saved_bytes(bw: torch.fx.GraphModule) -> int:
    out = 0
    for n in bw.graph.nodes:
        if n.op == "placeholder" and not n.name.startswith(("primals_", "tangents_")):
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor):
                out += v.numel() * v.element_size()
    return out


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
    from torch._functorch import config as fconfig
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

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

    part = default_partition if budget is None else functools.partial(min_cut_rematerialization_partition,
                                                                      compiler="inductor")
    with fconfig.patch(activation_memory_budget=1.0 if budget is None else budget):
        wrapped = aot_module(_Loss(model), fw_compiler=keep("fw"), bw_compiler=keep("bw"), partition_fn=part)
        run_step_inputs(wrapped, inputs).backward()
    fw, bw = graph_flops(got["fw"]), graph_flops(got["bw"])
    return {"fw_flops": fw, "bw_flops": bw, "flops": fw + bw, "saved_bytes": saved_bytes(got["bw"])}
