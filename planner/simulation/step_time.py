"""One optimizer step's time on the slowest rank of a layout, by where it goes: compute, exposed
communication, pipeline bubble, recompute, optimizer step and host offload.

Compute is the calibrated roofline of every traced op. Tensor- and sequence-parallel collectives
are ops of the traced rank, on the critical path, priced on the in-node link
(planner.simulation.costs.collective_s). FSDP2's all-gathers and reduce-scatters overlap compute as
its prefetch allows (planner.simulation.comm); a pipeline gathers each stage once per step and
reduce-scatters its gradients after the last microbatch (torch's pipelining turns gradient sync off
for the others), hidden where the rank waits anyway at the start and the end of the schedule. The
bubble is the slowest rank's idle time in the replay of its schedule's action list
(planner.simulation.pipeline_time).

Host offload (FSDP2's ``CPUOffloadPolicy``) keeps the sharded parameters, gradients and optimizer
states in host memory: each all-gather first copies the parameter shard to the GPU, each
reduce-scatter's gradient shard is copied back, and the optimizer step runs on the host at
``HOST_MEMORY_BYTES_PER_S`` per rank (a server's DRAM bandwidth shared by its GPUs). Those copies
and the host step are exposed: FSDP2 runs them on the default stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from costmodels.hardware import DeviceSpec, get_device
from costmodels.memory import ModelStates
from costmodels.runtime import collective_time_s, transfer_time_s
from planner.config import TrainConfig
from planner.simulation.costs import model_states_for, op_times, optimizer_step_s
from planner.simulation.effects import SpanChoice
from planner.simulation.fsdp import fsdp_itemsizes
from planner.simulation.pipeline import PipelineTimeline
from planner.simulation.pipeline_split import cut_stages
from planner.simulation.pipeline_step import stage_effects
from planner.simulation.pipeline_time import stage_times
from planner.simulation.step import Timeline
from planner.tracing.graph import OpGraph
from planner.tracing.op_classes import COLLECTIVE_OPS

__all__ = [
    "HOST_MEMORY_BYTES_PER_S",
    "StepTime",
    "data_parallel_step_time",
    "host_offload_s",
    "host_states",
    "pipeline_step_time",
]

HOST_MEMORY_BYTES_PER_S = 50e9  # host DRAM bandwidth per GPU (about 400 GB/s shared by 8 GPUs)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on the slowest rank; the parts add up to `step_s`."""

    step_s: float
    compute_s: float
    exposed_communication_s: float
    bubble_s: float
    recompute_s: float
    optimizer_s: float
    offload_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def host_states(graph: OpGraph, config: TrainConfig) -> ModelStates:
    """The sharded model states one rank keeps in host memory under host offload."""
    return model_states_for(graph, config.with_(cpu_offload=False))


def host_offload_s(graph: OpGraph, config: TrainConfig) -> float:
    """Seconds host offload adds to a step: parameter shards up for both all-gathers and gradient
    shards down in every micro-step, and one optimizer step over the host's copies (see the module
    docstring)."""
    states = host_states(graph, config)
    copies = config.grad_accum_steps * (2 * states.parameter + states.gradient)  # every micro-step's gathers
    host_step = 2 * (states.parameter + states.gradient + states.optimizer) / HOST_MEMORY_BYTES_PER_S
    return transfer_time_s(copies, get_device(config.gpu), "cpu") + host_step


def _collective_times(graph: OpGraph, times: np.ndarray) -> np.ndarray:
    mask = np.array([op.name in COLLECTIVE_OPS for op in graph.ops], dtype=bool)
    return np.where(mask, times, 0.0)


def data_parallel_step_time(graph: OpGraph, config: TrainConfig, timeline: Timeline, device: DeviceSpec) -> StepTime:
    """A step without pipeline stages: `config.grad_accum_steps` micro-steps of `timeline`'s ops
    (a tensor-parallel rank's collectives among them), FSDP2's exposed collectives, the optimizer."""
    times = op_times(graph, device)
    collectives = float(_collective_times(graph, times).sum())
    m = config.grad_accum_steps
    c = timeline.costs
    optimizer_s = 0.0 if config.cpu_offload else optimizer_step_s(sum(timeline.model_states.values()), device)
    offload_s = host_offload_s(graph, config) if config.cpu_offload else 0.0
    return StepTime(
        step_s=c.step_s + offload_s,
        compute_s=m * (float(times.sum()) - collectives),
        exposed_communication_s=m * (collectives + c.exposed_communication_s),
        bubble_s=0.0,
        recompute_s=m * c.recompute_s,
        optimizer_s=optimizer_s,
        offload_s=offload_s + m * c.exposed_offload_s,
    )


def pipeline_step_time(
    graph: OpGraph,
    config: TrainConfig,
    pipeline: PipelineTimeline,
    device: DeviceSpec,
    choices: Sequence[SpanChoice] = (),
) -> StepTime:
    """A pipeline step (`pipeline` simulated from `graph` under `choices`): each pp rank's replayed
    actions, its stages' FSDP2 gather and reduce-scatter where its schedule does not hide them, its
    optimizer step; the slowest rank's."""
    cuts = cut_stages(graph, pipeline.blocks_per_stage)
    times = op_times(graph, device)
    collective = stage_times(graph, cuts, _collective_times(graph, times))
    recompute = [0.0] * len(cuts)
    for e in stage_effects(graph, config, cuts, choices):
        recompute[e.stage] += e.effect.recompute_s
    gathered_itemsize, reduce_itemsize = fsdp_itemsizes(graph, config)
    params = _stage_parameter_bytes(graph, cuts)
    shard_ranks, stride = config.shard_ranks, config.tp  # FSDP2 over dp × cp (torchtitan's dp_shard_cp)
    timing, schedule = pipeline.time, pipeline.schedule
    worst: StepTime | None = None
    for r in range(schedule.pp):
        actions = schedule.compute(r)
        comm = sum(collective[a.kind][a.stage] for a in actions)
        rec = sum(recompute[a.stage] for a in actions if a.kind == "B")
        stages = schedule.stages(r)
        gather = sum(collective_time_s(params[s], shard_ranks, device, stride) for s in stages)
        reduce = gather * reduce_itemsize / gathered_itemsize
        fsdp = 0.0
        if shard_ranks > 1 and config.zero_stage == 3:
            hidden_start = timing.first_start_s[r] if timing.first_start_s else 0.0
            hidden_end = timing.step_s - timing.last_end_s[r] if timing.last_end_s else 0.0
            fsdp = max(0.0, gather - hidden_start) + max(0.0, reduce - hidden_end)
        role = next(x for x in pipeline.layout.roles if x.coords.pp == r)
        optimizer_s = optimizer_step_s(sum(role.timeline.model_states.values()), device)
        busy = timing.busy_s[r]
        candidate = StepTime(
            step_s=timing.step_s + fsdp + optimizer_s,
            compute_s=busy - comm - rec,
            exposed_communication_s=comm + fsdp,
            bubble_s=timing.step_s - busy,
            recompute_s=rec,
            optimizer_s=optimizer_s,
        )
        if worst is None or candidate.step_s > worst.step_s:
            worst = candidate
    assert worst is not None
    return worst


def _stage_parameter_bytes(graph: OpGraph, cuts) -> list[int]:
    """Traced parameter bytes each stage's forward reads (what FSDP2 gathers for it)."""
    out = []
    params = {t.id: t.nbytes for t in graph.preexisting() if t.category == "parameter"}
    for c in cuts:
        seen = {tid for op in graph.ops[c.fwd_start : c.fwd_end] for tid in op.inputs if tid in params}
        out.append(sum(params[t] for t in seen))
    return out
