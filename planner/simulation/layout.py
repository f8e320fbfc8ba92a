"""Every rank's step under tensor and context parallel (and FSDP2 over the local shards): one
trace and one timeline per distinct role (planner/simulation/ranks.py).

Each role is traced on fake tensors under a fake process group with the TP plan applied and, under
``--cp``, inside torch's ``context_parallel`` (planner/tracing/parallel); ``--dp M --zero 3`` adds
FSDP2's per-rank buffers over the local shards the trace holds (planner/simulation/fsdp.py), sharded
over dp × cp as torchtitan's ``dp_shard_cp`` mesh, composed as torchtitan composes them (TP, then
checkpointing, then ``fully_shard`` per block and root). Context-parallel ranks run different ring
steps (load balancing), so each cp index is its own role.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from planner.config import TrainConfig
from planner.errors import MemplanError
from planner.simulation.effects import SpanChoice
from planner.simulation.ranks import LayoutTimeline, RankRole, group_roles
from planner.simulation.step import simulate
from planner.tracing.graph import OpGraph
from planner.tracing.parallel.rank_trace import stage_rank, trace_tp_rank
from planner.tracing.parallel.tp_plans import resolve_tp_plan

__all__ = ["is_tensor_parallel", "layout_timeline", "simulate_ranks", "trace_roles"]


def is_tensor_parallel(config: TrainConfig) -> bool:
    """Whether the layout needs per-rank simulation (tensor or context parallel)."""
    return config.tp > 1 or config.cp > 1


def _check_supported(config: TrainConfig) -> None:
    for name in ("ep", "pp"):
        if getattr(config, name) > 1:
            raise MemplanError(
                f"--{name} {getattr(config, name)} is not simulated per rank together with --tp or --cp yet; "
                f"drop --{name} (memplan simulates --tp N --cp C with --dp M --zero 3)"
            )


def trace_roles(spec: str, config: TrainConfig, lifetimes: bool = True) -> tuple[dict, dict[tuple, OpGraph]]:
    """(role key of every (cp index, TP index), graph of each distinct key): one trace per distinct
    role. TP indices share a role where their local shapes match; every cp index is its own."""
    _check_supported(config)
    tp_plan = resolve_tp_plan(config.tp_plan, config.sequence_parallel)
    keys: dict[tuple[int, int], tuple] = {}
    graphs: dict[tuple, OpGraph] = {}
    for cp_index in range(config.cp):
        first, tp_keys = trace_tp_rank(
            spec, config, rank=stage_rank(config, cp_index, 0), lifetimes=lifetimes, plan=tp_plan
        )
        graphs[(cp_index, tp_keys[0])] = first
        for tp_index, tp_key in enumerate(tp_keys):
            key = keys[(cp_index, tp_index)] = (cp_index, tp_key)
            if key not in graphs:
                rank = stage_rank(config, cp_index, tp_index)
                graphs[key] = trace_tp_rank(spec, config, rank=rank, lifetimes=lifetimes, plan=tp_plan)[0]
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
    for group in group_roles(config, lambda c: keys[(c.cp, c.tp)]):
        first = group[0]
        roles.append(RankRole(tuple(c.rank for c in group), first, (first.pp,), timelines[keys[(first.cp, first.tp)]]))
    return LayoutTimeline(config, tuple(roles))


def simulate_ranks(spec: str, config: TrainConfig, plan=None) -> LayoutTimeline:
    """Trace and simulate one rank per distinct TP / CP role (under a plan, if given); all ranks listed."""
    keys, graphs = trace_roles(spec, config, lifetimes=plan is not None)
    return layout_timeline(spec, config, keys, graphs, plan)
