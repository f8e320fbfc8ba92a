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

The same style runs on the fake-tensor model of a trace and on a real model under gloo.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["ExpertParallel"]


def _all_to_all_counts(counts: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Every rank's counts for this rank's experts (the counts' all-to-all; no autograd)."""
    from memplan_compat import all_to_all_single

    return torch.ops._c10d_functional.wait_tensor(all_to_all_single(counts, None, None, group=mesh.get_group()))


class ExpertParallel(ParallelStyle):
    """Shard a grouped-experts module over the EP mesh and move its tokens with all-to-all."""

    def __init__(self) -> None:
        super().__init__()
        self._splits: dict[int, tuple[list[int], list[int], torch.Tensor]] = {}

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)], src_data_rank=None))
            module.register_parameter(pname, sharded)

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        routed_input, num_tokens_per_expert = inputs[0], inputs[1]
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
