"""Every rank's step under tensor parallel (and FSDP2 over the TP shards): one trace and one
timeline per distinct role (planner/simulation/ranks.py).

Each role is traced on fake tensors under a fake process group with the TP plan applied
(planner/tracing/parallel); ``--dp M --zero 3`` adds FSDP2's per-rank buffers over the local
shards the trace holds (planner/simulation/fsdp.py), composed as torchtitan composes them (TP,
then checkpointing, then ``fully_shard`` per block and root).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from planner.config import TrainConfig
from planner.errors import MemplanError
from planner.simulation.effects import SpanChoice
from planner.simulation.ranks import LayoutTimeline, RankRole, group_roles
from planner.simulation.step import simulate
from planner.tracing.graph import OpGraph
from planner.tracing.parallel.rank_trace import trace_tp_rank
from planner.tracing.parallel.tp_plans import tp_plan_for

__all__ = ["is_tensor_parallel", "layout_timeline", "simulate_ranks", "trace_roles"]


def is_tensor_parallel(config: TrainConfig) -> bool:
    """Whether the layout needs per-rank simulation of tensor parallel."""
    return config.tp > 1


def _check_supported(config: TrainConfig) -> None:
    for name in ("cp", "ep", "pp"):
        if getattr(config, name) > 1:
            raise MemplanError(
                f"--{name} {getattr(config, name)} is not simulated per rank together with --tp yet; "
                f"drop --{name} (memplan simulates --tp N with --dp M --zero 3)"
            )


def trace_roles(spec: str, config: TrainConfig, lifetimes: bool = True) -> tuple[list[tuple], dict[tuple, OpGraph]]:
    """(role key of every TP index, graph of each distinct key): one trace per distinct role."""
    _check_supported(config)
    tp_plan = tp_plan_for(config)
    first, keys = trace_tp_rank(spec, config, rank=0, lifetimes=lifetimes, plan=tp_plan)
    graphs = {keys[0]: first}
    for tp_index, key in enumerate(keys):
        if key not in graphs:
            graphs[key] = trace_tp_rank(spec, config, rank=tp_index, lifetimes=lifetimes, plan=tp_plan)[0]
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
    for group in group_roles(config, lambda c: keys[c.tp]):
        roles.append(RankRole(tuple(c.rank for c in group), group[0], (group[0].pp,), timelines[keys[group[0].tp]]))
    return LayoutTimeline(config, tuple(roles))


def simulate_ranks(spec: str, config: TrainConfig, plan=None) -> LayoutTimeline:
    """Trace and simulate one rank per distinct TP role (under a plan, if given); all ranks listed."""
    keys, graphs = trace_roles(spec, config, lifetimes=plan is not None)
    return layout_timeline(spec, config, keys, graphs, plan)
