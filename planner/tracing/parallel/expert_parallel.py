"""Expert parallel as torchtitan runs it (``torchtitan/distributed/expert_parallel.py``'s design).

``ExpertParallel`` is a ``ParallelStyle`` for a grouped-experts module whose forward is
``forward(routed_input, num_tokens_per_expert)`` (rows sorted by expert, counts per expert) and
whose parameters hold every expert on dim 0:

- the parameters are sharded ``Shard(0)`` over the EP mesh: each rank keeps 1/N of the experts;
- dispatch: the per-expert counts go to every rank with an all-to-all (then ``.tolist()``, the one
  host read of the layer), the rows with ``all_to_all_single_autograd`` sized by them, and the
  received rows, ordered (source rank, local expert), are permuted to (local expert, source rank);
- combine: the inverse permutation, and the rows back to the ranks that sent them with a second
  all-to-all (autograd through both).

With `hidden_dims` (torchtitan's ``ExpertTensorParallel``) the mesh is ``[ep, tp]``: each
parameter is also sharded over ``tp`` on its hidden dimension, the TP ranks of an EP rank route the
same (replicated) tokens, dispatch and combine run over the ``ep`` dimension at each TP index, and
the experts' output is each TP rank's partial sum (the MoE layer reduces it).

The same style runs on the fake-tensor model of a trace and on a real model under gloo.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["ExpertParallel", "GroupedExpertsTensorParallel"]


def _partial_gradient(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """`x`, replicated over the TP ranks, unchanged; its gradient, a partial sum on each TP rank (the
    experts' hidden dimension is sharded), all-reduced on the way back (torchtitan's experts under TP)."""
    return DTensor.from_local(x, tp_mesh, (Replicate(),), run_check=False).to_local(grad_placements=(Partial(),))


def _shard_parameters(module: nn.Module, mesh: DeviceMesh, placements: Callable[[str], list[Shard]]) -> None:
    """Each of the module's own parameters distributed over `mesh` with `placements(name)`."""
    for name, param in list(module.named_parameters(recurse=False)):
        sharded = nn.Parameter(distribute_tensor(param, mesh, placements(name), src_data_rank=None))
        module.register_parameter(name, sharded)


def _all_to_all_counts(counts: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Every rank's counts for this rank's experts (the counts' all-to-all; no autograd)."""
    from memplan_compat import all_to_all_single

    return torch.ops._c10d_functional.wait_tensor(all_to_all_single(counts, None, None, group=mesh.get_group()))


class ExpertParallel(ParallelStyle):
    """Shard a grouped-experts module over the EP mesh and move its tokens with all-to-all."""

    def __init__(self, hidden_dims: dict[str, int] | None = None) -> None:
        super().__init__()
        self.hidden_dims = hidden_dims
        self._splits: dict[int, tuple[list[int], list[int], torch.Tensor]] = {}

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        hidden = self.hidden_dims
        _shard_parameters(module, mesh, lambda p: [Shard(0)] if hidden is None else [Shard(0), Shard(hidden[p])])

    def _ep(self, mesh: DeviceMesh) -> DeviceMesh:
        return mesh if self.hidden_dims is None else mesh["ep"]

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        routed_input, num_tokens_per_expert = inputs[0], inputs[1]
        if self.hidden_dims is not None:
            routed_input = _partial_gradient(routed_input, mesh["tp"])
        mesh = self._ep(mesh)
        ep = mesh.size()
        with torch.no_grad():
            received = _all_to_all_counts(num_tokens_per_expert, mesh)  # [source rank, local expert]
            input_splits = num_tokens_per_expert.view(ep, -1).sum(dim=1).tolist()
            output_splits = received.view(ep, -1).sum(dim=1).tolist()
        from memplan_compat import all_to_all_single_autograd

        rows = all_to_all_single_autograd(routed_input, output_splits, input_splits, mesh.get_group())
        local = received.view(ep, -1)
        with torch.no_grad():
            # row ids of the received order, regrouped by local expert: (local expert, source rank)
            starts = torch.cumsum(local.reshape(-1), 0) - local.reshape(-1)
            order = [
                torch.arange(int(starts[s * local.shape[1] + e]), int(starts[s * local.shape[1] + e] + local[s, e]))
                for e in range(local.shape[1])
                for s in range(ep)
            ]
            permutation = torch.cat(order) if order else torch.zeros(0, dtype=torch.long)
        self._splits[id(module)] = (input_splits, output_splits, permutation)
        return rows[permutation], local.sum(dim=0)

    def _combine(self, module: nn.Module, routed_output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        mesh = self._ep(mesh)
        input_splits, output_splits, permutation = self._splits.pop(id(module))
        unpermuted = torch.empty_like(routed_output)
        unpermuted[permutation] = routed_output
        from memplan_compat import all_to_all_single_autograd

        return all_to_all_single_autograd(unpermuted, input_splits, output_splits, mesh.get_group())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=self._partition,
            input_fn=lambda mod, inputs, mesh: self._dispatch(mod, inputs, mesh),
            output_fn=lambda mod, outputs, mesh: self._combine(mod, outputs, mesh),
        )


class GroupedExpertsTensorParallel(ParallelStyle):
    """Tensor parallel for grouped experts without expert parallel (torchtitan's ``TensorParallel``
    for experts): every expert's hidden dimension sharded over the TP mesh (`hidden_dims`: parameter
    name -> that dimension); each rank runs every routed token through its shard and returns its
    partial sum (the MoE layer reduces it)."""

    def __init__(self, hidden_dims: dict[str, int]) -> None:
        super().__init__()
        self.hidden_dims = hidden_dims

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        _shard_parameters(module, mesh, lambda p: [Shard(self.hidden_dims[p])])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=self._partition,
            input_fn=lambda mod, inputs, mesh: (_partial_gradient(inputs[0], mesh), *inputs[1:]),
        )
