"""The parallel layout of a live model that ``parallelize_module`` (and an expert-parallel plan) already sharded.

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
from planner.tracing.parallel.ep_plans import expert_trace_meta, is_expert_param
from planner.tracing.parallel.rank_trace import mesh_groups

__all__ = ["LiveLayout", "fake_dtensor", "live_layout"]


@dataclass(frozen=True)
class LiveLayout:
    """How a live model's DTensor parameters are sharded: tensor parallel over a 1-D mesh, expert
    parallel over a mesh with an ``ep`` dimension, or both."""

    tp: int  # ranks in the tensor-parallel group
    ep: int  # ranks in the expert-parallel group
    meshes: tuple[DeviceMesh, ...]  # the tensor-parallel mesh and the experts' mesh, as present
    rank: int  # this process's global rank
    expert_meta: dict[str, Any]  # ep_plans.expert_trace_meta of the model (empty without expert parallel)

    def meta(self) -> dict[str, Any]:
        """What a per-rank trace records of its layout (as planner.tracing.parallel.rank_trace does)."""
        meta: dict[str, Any] = {"tp": self.tp, "groups": mesh_groups(*self.meshes), "rank": self.rank}
        return {**meta, **self.expert_meta}


def live_layout(model: nn.Module) -> LiveLayout | None:
    """The model's parallel layout; None when no parameter is a DTensor.

    A model ``fully_shard`` already sharded is refused in one line: the plan is made before
    ``fully_shard`` (torchtitan's order)."""
    params = list(model.parameters())
    if not any(isinstance(p, DTensor) for p in params):
        return None
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise MemplanError(
            "fully_shard already ran on this model; call auto_checkpoint after parallelize_module and before "
            "fully_shard (torchtitan's order), with zero_stage=3 and dp=N for the sharding to come"
        )
    experts = tuple(is_expert_param(p) for p in params)
    dense = {p.device_mesh: p.device_mesh for p, e in zip(params, experts) if isinstance(p, DTensor) and not e}
    sparse = {p.device_mesh: p.device_mesh for p, e in zip(params, experts) if e}  # meshes are equal by value
    if len(dense) > 1 or any(m.ndim != 1 for m in dense) or len(sparse) > 1:
        names = sorted({str(m.mesh_dim_names) for m in [*dense, *sparse]})
        raise MemplanError(
            f"the model's parameters are sharded over several meshes ({', '.join(names)}); auto_checkpoint plans a "
            "model sharded over one tensor-parallel mesh and one expert mesh: make the plan per rank with "
            "`memplan plan --tp/--ep` and apply it with apply_plan"
        )
    tp = next(iter(dense)).size() if dense else 1
    ep_mesh = next(iter(sparse), None)
    ep = ep_mesh.size(ep_mesh.mesh_dim_names.index("ep")) if ep_mesh is not None else 1
    return LiveLayout(
        tp=tp,
        ep=ep,
        meshes=tuple(m for m in (next(iter(dense), None), ep_mesh) if m is not None),
        rank=dist.get_rank(),
        expert_meta=expert_trace_meta(model, ep, "live", tp) if ep > 1 else {},
    )


def fake_dtensor(t: DTensor, fake_local: torch.Tensor) -> DTensor:
    """A DTensor like `t` (mesh, placements, global shape and stride) around a fake local shard."""
    return DTensor.from_local(
        fake_local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )
