"""Every rank's step under tensor or expert parallel (and FSDP2 over the local shards): one trace
and one timeline per distinct role (planner/simulation/ranks.py).

Each role is traced on fake tensors under a fake process group with the TP plan applied
(planner/tracing/parallel); ``--dp M --zero 3`` adds FSDP2's per-rank buffers over the local
shards the trace holds (planner/simulation/fsdp.py), composed as torchtitan composes them (TP,
then checkpointing, then ``fully_shard`` per block and root). Under expert parallel a role is an
EP index whose experts receive the same rows under the routing assumption (the busiest first).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from planner.config import TrainConfig
from planner.errors import MemplanError
from planner.simulation.effects import SpanChoice
from planner.simulation.ranks import LayoutTimeline, RankRole, group_roles
from planner.simulation.step import simulate
from planner.tracing.graph import OpGraph
from planner.tracing.parallel.ep_plans import resolve_ep_plan
from planner.tracing.parallel.rank_trace import trace_tp_rank
from planner.tracing.parallel.tp_plans import tp_plan_for

__all__ = ["is_tensor_parallel", "layout_timeline", "simulate_ranks", "trace_roles"]


def is_tensor_parallel(config: TrainConfig) -> bool:
    """Whether the layout needs per-rank simulation of tensor or expert parallel."""
    return config.tp > 1 or config.ep > 1


def _check_supported(config: TrainConfig) -> None:
    for name in ("cp", "pp"):
        if getattr(config, name) > 1:
            raise MemplanError(
                f"--{name} {getattr(config, name)} is not simulated per rank together with --tp or --ep yet; "
                f"drop --{name} (memplan simulates --tp N or --ep N with --dp M --zero 3)"
            )
    if config.ep > 1 and config.tp > 1:
        raise MemplanError("--ep together with --tp is not simulated per rank yet; drop one of them")


def _role_index(config: TrainConfig, coords) -> int:
    """The mesh index that tells roles apart: EP's under expert parallel, else TP's."""
    return coords.ep if config.ep > 1 else coords.tp


def trace_roles(spec: str, config: TrainConfig, lifetimes: bool = True) -> tuple[list[tuple], dict[tuple, OpGraph]]:
    """(role key of every TP index, or EP index under expert parallel; graph of each distinct key):
    one trace per distinct role."""
    _check_supported(config)
    tp_plan = tp_plan_for(config)
    ep_plan = resolve_ep_plan(config.ep_plan) if config.ep > 1 else None
    # the global rank of each TP (or EP) index within the first data-parallel replica
    stride = config.tp if config.ep > 1 else 1
    first, keys = trace_tp_rank(spec, config, rank=0, lifetimes=lifetimes, plan=tp_plan, ep_plan=ep_plan)
    graphs = {keys[0]: first}
    for index, key in enumerate(keys):
        if key not in graphs:
            graphs[key] = trace_tp_rank(
                spec, config, rank=index * stride, lifetimes=lifetimes, plan=tp_plan, ep_plan=ep_plan
            )[0]
    return keys, graphs


def layout_timeline(
    spec: str,
    config: TrainConfig,
    keys: list[tuple],
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
    for group in group_roles(config, lambda c: keys[_role_index(config, c)]):
        key = keys[_role_index(config, group[0])]
        roles.append(RankRole(tuple(c.rank for c in group), group[0], (group[0].pp,), timelines[key]))
    return LayoutTimeline(config, tuple(roles))


def simulate_ranks(spec: str, config: TrainConfig, plan=None) -> LayoutTimeline:
    """Trace and simulate one rank per distinct TP role (under a plan, if given); all ranks listed."""
    keys, graphs = trace_roles(spec, config, lifetimes=plan is not None)
    return layout_timeline(spec, config, keys, graphs, plan)
