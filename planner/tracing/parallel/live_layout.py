"""The tensor-parallel layout of a live model that ``parallelize_module`` already sharded.

A training script shards its model in torchtitan's order: the TP plan, then checkpointing, then
``fully_shard``. A plan made at the checkpointing step sees DTensor parameters on a real device
mesh. memplan traces such a model as it is: the fake copy keeps every DTensor's mesh and placements
around a fake local shard, and under FakeTensorMode DTensor's functional collectives run their
fake kernels (no communication), so the trace is this rank's graph, made by the hooks the user's
own plan installed. Only the layout is read here; the copy is planner.runtime.live_trace's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from planner.errors import MemplanError
from planner.tracing.parallel.ep_plans import is_expert_param
from planner.tracing.parallel.rank_trace import mesh_groups

__all__ = ["LiveLayout", "fake_dtensor", "live_layout"]


@dataclass(frozen=True)
class LiveLayout:
    """The tensor-parallel group a live model's DTensor parameters are sharded over."""

    tp: int  # ranks in the tensor-parallel group
    mesh: DeviceMesh  # the 1-D tensor-parallel mesh
    rank: int  # this process's global rank

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    def meta(self) -> dict[str, Any]:
        """What a per-rank trace records of its layout (as planner.tracing.parallel.rank_trace does)."""
        return {"tp": self.tp, "groups": mesh_groups(self.mesh), "rank": self.rank}


def live_layout(model: nn.Module) -> LiveLayout | None:
    """The model's tensor-parallel layout; None when no parameter is a DTensor.

    A model that ``fully_shard`` or an expert-parallel plan already sharded is refused in one line:
    the plan is made before ``fully_shard`` (torchtitan's order), and an expert-parallel model is
    planned per rank by ``memplan plan --ep``."""
    meshes = {p.device_mesh: p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}  # equal by value
    if not meshes:
        return None
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise MemplanError(
            "fully_shard already ran on this model; call auto_checkpoint after parallelize_module and before "
            "fully_shard (torchtitan's order), with zero_stage=3 and dp=N for the sharding to come"
        )
    if len(meshes) > 1 or any(m.ndim != 1 for m in meshes.values()) or any(map(is_expert_param, model.parameters())):
        names = sorted({str(m.mesh_dim_names) for m in meshes.values()})
        raise MemplanError(
            f"the model's parameters are sharded over an expert-parallel or more than one mesh ({', '.join(names)}); "
            "auto_checkpoint plans a model sharded by parallelize_module over one tensor-parallel mesh: for expert "
            "parallel make the plan per rank with `memplan plan --ep` and apply it with apply_plan"
        )
    (mesh,) = meshes.values()
    return LiveLayout(tp=mesh.size(), mesh=mesh, rank=dist.get_rank())


def fake_dtensor(t: DTensor, fake_local: torch.Tensor) -> DTensor:
    """A DTensor like `t` (mesh, placements, global shape and stride) around a fake local shard."""
    return DTensor.from_local(
        fake_local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )
