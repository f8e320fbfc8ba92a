"""Parallel styles for the projections torch's ``ColwiseParallel`` / ``RowwiseParallel`` do not take,
and for the position embeddings of a sequence-parallel model.

- A transposed linear (GPT-2's ``Conv1D``: weight ``(in, out)``, ``y = x @ W + b``) is sharded on its
  output columns (column-wise) or input rows (row-wise), as ``nn.Linear`` is on the other dimension.
- A fused projection whose output concatenates equal sections (GPT-2's ``c_attn``: ``[q | k | v]``)
  is sharded per section: each rank keeps its share of every section, so it holds whole heads of q,
  k and v. DTensor has no placement for that, so the output features are reordered rank-major
  (:func:`rank_major_order`, Megatron's layout of a fused q/k/v) and sharded ``Shard`` on the
  reordered dimension: ``full_tensor()`` returns the rows in that order.
- Learned position embeddings under sequence parallel stay replicated; each rank keeps the rows of
  its share of the sequence, as the sequence-sharded token embeddings they are added to.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

__all__ = [
    "ColwiseProjection",
    "RowwiseProjection",
    "SequenceShardedPositions",
    "input_features",
    "is_projection",
    "output_dim",
    "output_features",
    "rank_heads",
    "rank_major_order",
]


def _is_transposed_linear(module: nn.Module) -> bool:
    """GPT-2's ``Conv1D`` (transformers) and its look-alikes: a 2-D weight ``(nx, nf)``."""
    weight = getattr(module, "weight", None)
    return isinstance(getattr(module, "nf", None), int) and weight is not None and weight.dim() == 2


def is_projection(module: nn.Module | None) -> bool:
    """Whether `module` is a projection the styles here shard: an ``nn.Linear`` or a transposed linear."""
    return isinstance(module, nn.Linear) or (module is not None and _is_transposed_linear(module))


def output_dim(module: nn.Module) -> int:
    """The weight dimension that indexes output features: 0 for ``nn.Linear``, 1 when transposed."""
    return 1 if _is_transposed_linear(module) else 0


def output_features(module: nn.Module) -> int:
    """A projection's output width."""
    return module.weight.shape[output_dim(module)]


def input_features(module: nn.Module) -> int:
    """A projection's input width."""
    return module.weight.shape[1 - output_dim(module)]


def rank_heads(values: torch.Tensor, heads: int, tp: int, rank: int, batch_folded: bool) -> torch.Tensor:
    """The rows of a per-head tensor (heads first, or batch x heads folded into dim 0: an ALiBi bias,
    a 3-D attention mask) that belong to the rank's heads."""
    local = heads // tp
    if batch_folded:
        return values.unflatten(0, (-1, heads))[:, rank * local : (rank + 1) * local].flatten(0, 1)
    return values[rank * local : (rank + 1) * local]


def rank_major_order(features: int, sections: int, world_size: int) -> torch.Tensor:
    """Indices that reorder `features` outputs, `sections` equal consecutive sections, so that
    ``Shard`` chunk r holds the r-th share of every section, in section order."""
    section = features // sections
    share = section // world_size
    starts = [s * section + r * share for r in range(world_size) for s in range(sections)]
    return torch.cat([torch.arange(start, start + share) for start in starts])


class ColwiseProjection(ColwiseParallel):
    """``ColwiseParallel`` for an ``nn.Linear`` or a transposed linear, whose output may be `sections`
    equal sections (a fused q/k/v: 3), each sharded over the mesh (see the module docstring)."""

    def __init__(self, *, sections: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sections = sections

    def _partition_projection_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        out_dim = output_dim(module)
        for param_name, param in list(module.named_parameters(recurse=False)):
            dim = out_dim if param.dim() == 2 else 0
            values = param.detach()
            if self.sections > 1:
                order = rank_major_order(param.shape[dim], self.sections, device_mesh.size())
                values = values.index_select(dim, order.to(param.device))
            sharded = distribute_tensor(values, device_mesh, [Shard(dim)], src_data_rank=self.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Linear) and self.sections == 1:
            return super()._apply(module, device_mesh)
        return _distributed(self, module, device_mesh, self._partition_projection_fn)


class _Unaliased(torch.autograd.Function):
    """Identity whose output its caller may modify in place. ``DTensor.to_local()`` returns a view
    made inside a custom Function, which autograd forbids modifying in place (Falcon adds its
    attention's output into its MLP's with ``+=``); this output shares the storage and is no view."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class RowwiseProjection(RowwiseParallel):
    """``RowwiseParallel`` for an ``nn.Linear`` or a transposed linear (weight sharded on its input
    rows, bias replicated), whose local output its caller may modify in place."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        outputs = RowwiseParallel._prepare_output_fn(output_layouts, False, mod, outputs, device_mesh)
        return _Unaliased.apply(outputs.to_local()) if use_local_output else outputs

    def _partition_transposed_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, placement in (("weight", Shard(0)), ("bias", Replicate())):
            param = getattr(module, param_name, None)
            if param is not None:
                sharded = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
                module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not _is_transposed_linear(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)
        return _distributed(self, module, device_mesh, self._partition_transposed_fn)


def _distributed(
    style: ColwiseParallel | RowwiseParallel, module: nn.Module, device_mesh: DeviceMesh, partition_fn: Callable
) -> nn.Module:
    """`module` with its parameters partitioned by `partition_fn` and its input and output laid out
    as `style` lays them (torch's own hooks for it)."""
    return distribute_module(
        module,
        device_mesh,
        partition_fn,
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


def _replicated(name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
    for param_name, param in list(module.named_parameters(recurse=False)):
        replicated = distribute_tensor(param, device_mesh, [Replicate()], src_data_rank=None)
        module.register_parameter(param_name, nn.Parameter(replicated, requires_grad=param.requires_grad))


def _replicated_input(module: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
    first = inputs[0]
    if not isinstance(first, DTensor):
        first = DTensor.from_local(first, device_mesh, (Replicate(),), run_check=False)
    return (first, *inputs[1:])


def _sequence_sharded_output(module: nn.Module, output: DTensor, device_mesh: DeviceMesh) -> torch.Tensor:
    """(…, S, E) positions' rows -> this rank's share of S: a local slice forward, an all-gather of
    the gradient backward."""
    return output.redistribute(placements=(Shard(output.dim() - 2),)).to_local()


class SequenceShardedPositions(ParallelStyle):
    """A learned position embedding under sequence parallel: its table replicated, its output (…, S, E)
    cut to this rank's share of the sequence, to be added to the sequence-sharded token embeddings."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, _replicated, _replicated_input, _sequence_sharded_output)
