"""Every rank's step under tensor, context or expert parallel (and FSDP2 over the local shards):
one trace and one timeline per distinct role (planner/simulation/ranks.py).

Each role is traced on fake tensors under a fake process group with the TP (and EP) plan applied
and, under ``--cp``, inside torch's ``context_parallel`` (planner/tracing/parallel); ``--dp M
--zero 3`` adds FSDP2's per-rank buffers over the local shards the trace holds
(planner/simulation/fsdp.py), sharded over dp × cp as torchtitan's ``dp_shard_cp`` mesh, composed
as torchtitan composes them (TP, then checkpointing, then ``fully_shard`` per block and root).
Context-parallel ranks run different ring steps (load balancing), so each cp index is its own
role; under expert parallel a role is an EP index whose experts receive the same rows under the
routing assumption (the busiest first).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from planner.config import TrainConfig
from planner.errors import MemplanError
from planner.simulation.effects import SpanChoice
from planner.simulation.ranks import LayoutTimeline, RankCoords, RankRole, group_roles, mesh_coords
from planner.simulation.step import simulate
from planner.tracing.graph import OpGraph

__all__ = ["is_tensor_parallel", "layout_timeline", "role_of", "simulate_ranks", "trace_roles"]


def is_tensor_parallel(config: TrainConfig) -> bool:
    """Whether the layout needs per-rank simulation (tensor, context or expert parallel)."""
    return config.tp > 1 or config.cp > 1 or config.ep > 1


def _check_supported(config: TrainConfig) -> None:
    if config.pp > 1:
        raise MemplanError(
            f"--pp {config.pp} is not simulated per rank together with --tp, --cp or --ep here; "
            "simulate the pipeline with memplan simulate --pp (with --tp)"
        )


def _role_index(config: TrainConfig, coords: RankCoords) -> tuple[int, ...]:
    """The mesh indices that can tell roles apart: (cp, TP's), and EP's under expert parallel."""
    return (coords.cp, coords.tp, coords.ep) if config.ep > 1 else (coords.cp, coords.tp)


def role_of(config: TrainConfig, keys: Mapping[tuple[int, ...], tuple]) -> Callable[[RankCoords], tuple]:
    """A rank's role key (as :func:`trace_roles` keys its graphs) from its mesh coordinates."""
    return lambda coords: keys[_role_index(config, coords)]


def _role_key(config: TrainConfig, cp_index: int, index: tuple[int, ...], index_keys: list, own_tp: bool) -> tuple:
    """The role key of a role index: its cp index, its TP (EP) index's key, and under expert parallel
    its TP index where each TP rank holds the experts whole (`own_tp`)."""
    if config.ep == 1:
        return cp_index, index_keys[index[1]]
    return cp_index, index_keys[index[2]], index[1] if own_tp else 0


def trace_roles(spec: str, config: TrainConfig, lifetimes: bool = True) -> tuple[dict, dict[tuple, OpGraph]]:
    """(role key of every (cp, TP[, EP]) index, graph of each distinct key): one trace per distinct
    role. TP indices share a role where their local shapes match, EP indices where their received
    rows match; every cp index is its own. Under expert parallel the TP indices share a role where
    each holds a shard of the experts; where each holds them whole (transformers' layout) they run
    different slices of the tokens, and each is its own."""
    _check_supported(config)
    # DTensor's modules take 0.3 s to import; a layout without TP, CP or EP never needs them
    from planner.tracing.parallel.ep_plans import resolve_ep_plan
    from planner.tracing.parallel.rank_trace import trace_tp_rank
    from planner.tracing.parallel.tp_plans import tp_plan_for

    tp_plan = tp_plan_for(config)
    ep_plan = resolve_ep_plan(config.ep_plan) if config.ep > 1 else None
    keys: dict[tuple[int, ...], tuple] = {}
    graphs: dict[tuple, OpGraph] = {}
    # the first rank of each role index in the first pipeline stage (under expert parallel a cp
    # index holds the EP indices its data-parallel ranks land on)
    first_ranks: dict[tuple[int, ...], int] = {}
    for c in mesh_coords(config):
        if c.pp == 0:
            first_ranks.setdefault(_role_index(config, c), c.rank)
    for cp_index in range(config.cp):
        rank_of = {index: rank for index, rank in first_ranks.items() if index[0] == cp_index}
        first_index = min(rank_of, key=rank_of.get)
        first, index_keys = trace_tp_rank(
            spec, config, rank=rank_of[first_index], lifetimes=lifetimes, plan=tp_plan, ep_plan=ep_plan
        )
        own_tp = config.ep > 1 and first.meta.get("ep_expert_tp_replicas", 1) > 1
        graphs[_role_key(config, cp_index, first_index, index_keys, own_tp)] = first
        for index in sorted(rank_of):
            key = keys[index] = _role_key(config, cp_index, index, index_keys, own_tp)
            if key not in graphs:
                graphs[key] = trace_tp_rank(
                    spec, config, rank=rank_of[index], lifetimes=lifetimes, plan=tp_plan, ep_plan=ep_plan
                )[0]
    return keys, graphs


def layout_timeline(
    spec: str,
    config: TrainConfig,
    keys: dict[tuple[int, int], tuple],
    graphs: dict[tuple, OpGraph],
    plan=None,
    choices: Mapping[tuple, Sequence[SpanChoice]] | None = None,
) -> LayoutTimeline:
    """Each role's graph simulated (under a plan, or that role's span `choices`, if given), every
    global rank listed with its role."""
    timelines = {}
    for key, graph in graphs.items():
        timeline = simulate(graph, config, plan=plan, choices=(choices or {}).get(key, ()))
        timeline.config["model"] = spec
        timelines[key] = timeline
    roles = []
    key_of = role_of(config, keys)
    for group in group_roles(config, key_of):
        first = group[0]
        roles.append(RankRole(tuple(c.rank for c in group), first, (first.pp,), timelines[key_of(first)]))
    return LayoutTimeline(config, tuple(roles))


def simulate_ranks(spec: str, config: TrainConfig, plan=None) -> LayoutTimeline:
    """Trace and simulate one rank per distinct TP / CP / EP role (under a plan, if given); all ranks listed."""
    keys, graphs = trace_roles(spec, config, lifetimes=plan is not None)
    return layout_timeline(spec, config, keys, graphs, plan)
