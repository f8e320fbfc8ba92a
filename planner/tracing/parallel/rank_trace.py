"""Trace what one rank of a tensor- or expert-parallel job runs, on fake tensors under a fake process group.

PyTorch's own sharding makes the per-rank graph: the model builds on fake tensors, the TP plan
shards it over the ``tp`` dimension of a ``[dp, cp, tp]`` DeviceMesh (``parallelize_module`` or
the model's own plan), and the recorder traces forward, loss and backward of this rank: local
shards, sequence parallel's all-gather and reduce-scatter outputs, DTensor's redistributions and
the loss. With ``cp > 1`` the step runs inside torch's ``context_parallel`` over the ``cp``
dimension (planner/tracing/parallel/context_parallel.py): the inputs hold this rank's share of the
sequence and attention runs as torch's ring attention. FSDP2 is not applied here (``fully_shard`` over TP shards fails on fake tensors): the
simulator models its buffers over the local shards the trace holds. Pipeline stages are another
module's concern: the fake group spans one stage's ``dp · cp · tp`` ranks.

Expert parallel borrows its ranks from ``dp × cp`` (torchtitan): a second ``[edp, ep, tp]`` mesh
over the same ranks, EP innermost, so a rank's EP index is ``(dp_i · cp + cp_i) mod ep``. The EP
plan shards the experts over ``ep``; the rows each EP rank receives follow the routing assumption
(``--moe-imbalance``), every rank routing alike, so EP ranks whose experts receive the same rows
are one role.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from costmodels.memory import get_precision
from planner.config import TrainConfig
from planner.errors import TraceError
from planner.tracing.depth import traced_part
from planner.tracing.fake_build import fake_model
from planner.tracing.graph import OpGraph
from planner.tracing.moe import RoutingAssumption, routed_indices
from planner.tracing.parallel.context_parallel import context_parallel_step
from planner.tracing.parallel.ep_plans import EpPlan, expert_trace_meta, resolve_ep_plan
from planner.tracing.parallel.tp_plans import TpPlan, step_context, tp_plan_for
from planner.tracing.recorder import cast_parameters, fold_run, trace_model
from planner.tracing.specs import ModelSpec, resolve_spec

__all__ = [
    "ep_mesh",
    "ep_role_keys",
    "fake_process_group",
    "layout_mesh",
    "tp_role_keys",
    "trace_tp_rank",
]


def _clear_sharding_caches() -> None:
    """DTensor caches sharding decisions by op and placements, not by rank; an uneven shard makes
    them rank-specific (a view's local shape), so each rank's trace starts and ends without them."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    type(propagator)._propagate_tensor_meta_cached.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's


@contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """A fake process group (no communication; collectives return buffers of the right size)
    as the default group while inside; destroyed on exit, so it leaks into no later trace, and
    DTensor's sharding caches are cleared on the way in and out."""
    from memplan_compat import FakeStore

    if dist.is_initialized():
        raise TraceError(
            "a torch.distributed process group is already initialised in this process; memplan traces "
            "parallel layouts under its own fake group: simulate in a process without one"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    _clear_sharding_caches()
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_sharding_caches()


def layout_mesh(config: TrainConfig) -> DeviceMesh:
    """The ``[dp, cp, tp]`` CPU mesh of one pipeline stage (build it outside any FakeTensorMode)."""
    return init_device_mesh("cpu", (config.dp, config.cp, config.tp), mesh_dim_names=("dp", "cp", "tp"))


def ep_mesh(config: TrainConfig) -> DeviceMesh:
    """The ``[edp, ep, tp]`` CPU mesh expert parallel shards experts over (EP innermost in dp × cp)."""
    edp = config.dp * config.cp // config.ep
    return init_device_mesh("cpu", (edp, config.ep, config.tp), mesh_dim_names=("edp", "ep", "tp"))


def mesh_groups(*meshes: DeviceMesh | None) -> dict[str, tuple[int, int]]:
    """Process-group name -> (ranks, stride between consecutive members in global ranks) of every
    mesh dimension with more than one rank: what a traced collective's ``group_name`` runs over."""
    groups: dict[str, tuple[int, int]] = {}
    for mesh in meshes:
        if mesh is None:
            continue
        shape = tuple(mesh.shape)
        for k, dim in enumerate(mesh.mesh_dim_names or ()):
            if shape[k] > 1:
                members = mesh.mesh.movedim(k, -1).reshape(-1, shape[k])[0]
                groups[mesh[dim].get_group().group_name] = (shape[k], int(members[1] - members[0]))
    return groups


def ep_role_keys(routing: RoutingAssumption, ep: int) -> list[tuple]:
    """One key per EP index: the rows each of its experts receives from one rank under the routing
    assumption (every rank routes alike), as a multiset (which local expert gets which count only
    reorders the experts' work). EP indices with equal keys are one role."""
    if not routing.experts or routing.experts % ep:
        return [()] * ep
    counts = routed_indices(routing.tokens, routing.experts, routing.top_k, routing.imbalance).flatten()
    counts = counts.bincount(minlength=routing.experts).tolist()
    local = routing.experts // ep
    return [tuple(sorted(counts[j * local : (j + 1) * local], reverse=True)) for j in range(ep)]


def _local_shape(p: torch.Tensor, tp_index: int) -> tuple[int, ...]:
    """A parameter's local shape on TP rank `tp_index` (DTensor's torch.chunk split)."""
    if not isinstance(p, DTensor):
        return tuple(p.shape)
    shape = list(p.shape)
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            d = placement.dim % len(shape)
            shape[d] = int(Shard.local_shard_size_and_offset(shape[d], p.device_mesh.size(mesh_dim), tp_index)[0])
    return tuple(shape)


def tp_role_keys(model: nn.Module, config: TrainConfig) -> list[tuple]:
    """One key per TP index: its local parameter shapes and (with sequence parallel) its share of
    the (context-parallel local) sequence. TP indices with equal keys run the same local step (one role)."""
    local_seq = config.seq_len // config.cp
    seq_share = [
        int(Shard.local_shard_size_and_offset(local_seq, config.tp, i)[0]) if config.sequence_parallel else 0
        for i in range(config.tp)
    ]
    params = list(model.parameters())
    return [(seq_share[i], tuple(_local_shape(p, i) for p in params)) for i in range(config.tp)]


def _traced_dtypes(config: TrainConfig) -> tuple[torch.dtype, str]:
    """Parameter dtype and the precision the forward runs in (ZeRO-3 gathers in the compute dtype)."""
    prec = get_precision(config.precision)
    if config.zero_stage == 3 and prec.autocast_dtype is not None:
        return prec.autocast_dtype, "fp32"
    return prec.param_dtype, config.precision


def trace_tp_rank(
    spec: str | ModelSpec,
    config: TrainConfig,
    rank: int,
    lifetimes: bool = True,
    plan: TpPlan | None = None,
    ep_plan: EpPlan | None = None,
) -> tuple[OpGraph, list[tuple]]:
    """(graph of global rank `rank` within one pipeline stage, role key of every TP index, or of
    every EP index under expert parallel). Under context parallel the graph is that rank's cp
    index's: its ring steps differ by cp index."""
    model_spec = resolve_spec(spec) if isinstance(spec, str) else spec
    plan = plan or tp_plan_for(config)
    if config.ep > 1:
        ep_plan = ep_plan or resolve_ep_plan(config.ep_plan)
    try:  # the TP plan applied to the blocks a folded trace runs; a trace that does not fold needs all
        return _trace_rank(model_spec, config, rank, lifetimes, plan, ep_plan, plans_on_traced_part=config.ep == 1)
    except _UnfoldedTrace:
        return _trace_rank(model_spec, config, rank, lifetimes, plan, ep_plan, plans_on_traced_part=False)


class _UnfoldedTrace(Exception):
    """The plans were applied to the blocks a folded trace runs, and the trace did not fold."""


def _trace_rank(
    model_spec: ModelSpec,
    config: TrainConfig,
    rank: int,
    lifetimes: bool,
    plan: TpPlan,
    ep_plan: EpPlan | None,
    plans_on_traced_part: bool,
) -> tuple[OpGraph, list[tuple]]:
    """trace_tp_rank's work. `plans_on_traced_part`: apply the TP plan only to the blocks a folded
    trace runs (parallelizing the other blocks of an 80-layer model took seconds per trace); their
    parameters keep their global shapes, so the model's fingerprint, its block run and the TP role
    keys (the blocks are identical) are those of the whole model parallelized. The expert meta reads
    every parameter: EP plans apply to the whole model."""
    param_dtype, traced_precision = _traced_dtypes(config)
    with fake_process_group(rank, config.dp * config.cp * config.tp):
        mesh = layout_mesh(config)
        sparse = ep_mesh(config) if config.ep > 1 else None
        with fake_model(model_spec, config.batch_size, config.seq_len, config.moe_imbalance, config.gpu) as (
            model,
            inputs,
            routing,
        ):
            if param_dtype != torch.float32:
                cast_parameters(model, param_dtype)
            run = fold_run(model, config.blocks) if plans_on_traced_part and config.tp > 1 else None
            if config.tp > 1:
                with traced_part(model, run) if run is not None else nullcontext():
                    plan(model, mesh["tp"])
            if sparse is not None:
                ep_plan(model, sparse)
                expert_meta = expert_trace_meta(model, config.ep, config.ep_plan, config.tp)
            keys = tp_role_keys(model, config)
            ring = (
                context_parallel_step(mesh["cp"], inputs, config.seq_len, config.cp_rotate) if config.cp > 1 else None
            )
            with step_context(config), ring or nullcontext():
                graph = trace_model(
                    model,
                    inputs,
                    precision=traced_precision,
                    name=model_spec.name,
                    lifetimes=lifetimes,
                    blocks=config.blocks,
                )
            if run is not None and (graph.meta.get("folded") != run.length or fold_run(model, config.blocks) != run):
                raise _UnfoldedTrace
            graph.meta["groups"] = mesh_groups(mesh, sparse)
            if sparse is not None:
                keys = ep_role_keys(routing, config.ep)
                routing.routers = sum(op.name == "aten.topk.default" for op in graph.ops[: graph.backward_start])
                graph.meta.update(expert_meta)
                graph.meta["moe"] = routing.to_dict()
    graph.meta.update(
        precision=config.precision,
        batch_size=config.batch_size,
        seq_len=config.seq_len,
        tp=config.tp,
        sequence_parallel=config.sequence_parallel,
        loss_parallel=config.loss_parallel,
        tp_plan=config.tp_plan,
        rank=rank,
    )
    if config.cp > 1:
        graph.meta.update(cp=config.cp, cp_index=rank // config.tp % config.cp, cp_rotate=config.cp_rotate)
    return graph, keys
