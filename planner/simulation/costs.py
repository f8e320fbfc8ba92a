"""What a step costs on the target device: op times, model-state bytes per device and the per-category scale of traced bytes."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from costmodels.hardware import DeviceSpec, get_device
from costmodels.memory import ModelStates, get_precision, model_state_bytes
from costmodels.runtime import collective_time_s, op_time_s
from planner.config import TrainConfig
from planner.simulation.fsdp import expert_shard_ranks, expert_state_shape
from planner.tracing.collectives import WAIT_OP, collective_first_uses
from planner.tracing.graph import OpGraph, OpNode
from planner.tracing.op_classes import ATTENTION_BACKWARD_OPS, ATTENTION_OPS, COLLECTIVE_OPS

__all__ = [
    "SCALED_CATEGORIES",
    "StepCosts",
    "category_scale",
    "collective_s",
    "optimizer_step_s",
    "model_states_for",
    "op_times",
    "storage_bytes",
]

_DTYPES = {str(d).replace("torch.", ""): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


@dataclass(frozen=True)
class StepCosts:
    """Time of the step and what a plan adds to it."""

    step_s: float
    recompute_flops: int
    recompute_s: float
    offload_bytes: int
    exposed_offload_s: float
    communication_s: float = 0.0  # data-parallel collectives, hidden or not
    exposed_communication_s: float = 0.0  # the part compute does not hide (inside step_s)
    hidden_recompute_s: float = 0.0  # recompute run while the step waited on communication (adds nothing)

    @property
    def added_s(self) -> float:
        """Seconds the plan adds to the step: recompute not hidden in a wait, and exposed offload."""
        return max(0.0, self.recompute_s - self.hidden_recompute_s) + self.exposed_offload_s

    @property
    def overhead(self) -> float:
        base = self.step_s - self.added_s
        return self.added_s / base if base > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "overhead": self.overhead}


_ALL_TO_ALL = str(torch.ops._c10d_functional.all_to_all_single.default)


def collective_s(op: OpNode, graph: OpGraph, device: DeviceSpec) -> float:
    """Seconds of a functional collective on the link of the group it ran over (the trace records
    each group's ranks and their stride: graph.meta["groups"], by the op's group_name); a trace
    without that record runs its collectives over the tensor-parallel group, or, for an
    expert-parallel trace's all-to-all, over its EP group."""
    side, passes = COLLECTIVE_OPS[op.name]
    tensors = op.outputs if side == "output" else op.inputs
    nbytes = sum(graph.tensors[t].nbytes for t in tensors[:1])
    group_name = dict(p.split("=", 1) for p in op.variant.split(",") if "=" in p).get("group_name")
    recorded = graph.meta.get("groups", {}).get(group_name)
    if recorded is not None:
        ranks, stride = recorded
        return passes * collective_time_s(nbytes, int(ranks), device, int(stride))
    ep = int(graph.meta.get("ep", 1))
    group = ep if op.name == _ALL_TO_ALL and ep > 1 else int(graph.meta.get("tp", 1))
    return passes * collective_time_s(nbytes, group, device)


def _exposed_collectives(graph: OpGraph, times: np.ndarray) -> None:
    """A functional collective runs on its own stream until its output is first used
    (planner.tracing.collectives): the compute issued in between hides it (ring attention issues
    the K/V exchange before attending to the local chunk); DTensor's collectives, used by the next
    op, hide nothing. Each collective's time becomes what that compute does not cover."""
    for issued, used in collective_first_uses(graph).items():
        end = issued + 1 if used is None else used
        window = [o for o in graph.ops[issued + 1 : end] if o.name not in COLLECTIVE_OPS and o.name != WAIT_OP]
        hidden = float(sum(times[o.index] for o in window))
        times[issued] = max(0.0, float(times[issued]) - hidden)


def op_times(graph: OpGraph, device: DeviceSpec) -> np.ndarray:
    """Roofline seconds of each op on the target device (views and no-ops cost nothing; an op that
    writes in place costs its bytes; a collective costs its ring passes on the link, see
    :func:`collective_s`, less the compute issued before its wait). Computed once per graph and
    device (read-only)."""
    key = ("op_times", device)
    if key not in graph.derived:
        out = _op_times(graph, device)
        out.flags.writeable = False
        graph.derived[key] = out
    return graph.derived[key]


def _op_times(graph: OpGraph, device: DeviceSpec) -> np.ndarray:
    out = np.zeros(len(graph.ops))
    for op in graph.ops:
        if op.name in COLLECTIVE_OPS:
            out[op.index] = collective_s(op, graph, device)
            continue
        if op.flops == 0 and not op.allocs and not op.mutates:
            continue
        written = op.allocs or op.mutates
        out[op.index] = op_time_s(
            op.flops,
            op.bytes_accessed,
            _DTYPES.get(op.dtype, torch.float32),
            device,
            attention=op.name in ATTENTION_OPS or op.name in ATTENTION_BACKWARD_OPS,
            name=op.name,
            elements=max((math.prod(graph.tensors[t].shape) for t in written), default=0),
            variant=op.variant,
        )
    _exposed_collectives(graph, out)
    return out


SCALED_CATEGORIES = ("parameter", "gradient")  # the only categories whose per-device bytes differ from traced


def category_scale(graph: OpGraph, config: TrainConfig) -> dict[str, float]:
    """Per-device bytes of each traced parameter/gradient byte: ZeRO sharding, and the fp32 master
    weights and gradients behind a trace whose parameters are in the compute dtype (FSDP)."""
    states = model_states_for(graph, config)
    # a gradient byte scales as its parameter's (the traced bytes of the trainable parameters), as the
    # gradient storages may be larger (_gradients_beyond_parameters) and are kept whole; where ZeRO
    # shards the gradients (FSDP2 reduce-scatters each into its parameter's shard) the shards kept add
    # up to the sharded gradients, so the storages scale to that total
    sharded = config.zero_stage >= 2 and config.shard_ranks > 1
    traced_gradient = _traced_gradient_bytes(graph) if sharded else _traced_trainable_bytes(graph)
    traced = {"parameter": _traced_parameter_bytes(graph), "gradient": traced_gradient}
    want = {"parameter": states.parameter, "gradient": states.gradient}
    return {c: want[c] / traced[c] if traced[c] else 1.0 for c in SCALED_CATEGORIES}


def _traced_parameter_bytes(graph: OpGraph) -> int:
    return sum(t.nbytes for t in graph.preexisting() if t.category == "parameter")


def _trainable_flags(graph: OpGraph) -> tuple[bool, ...]:
    shapes = graph.param_shapes
    return graph.param_trainable if len(graph.param_trainable) == len(shapes) else (True,) * len(shapes)


def _traced_trainable_bytes(graph: OpGraph) -> int:
    """Traced bytes of the parameters that have gradients."""
    numels = [math.prod(shape) for shape in graph.param_shapes]
    trainable = sum(n for n, t in zip(numels, _trainable_flags(graph)) if t)
    return _traced_parameter_bytes(graph) * trainable // max(1, sum(numels))


def _traced_gradient_bytes(graph: OpGraph) -> int:
    return sum(t.nbytes for t in graph.tensors.values() if t.category == "gradient")


def _gradients_beyond_parameters(graph: OpGraph) -> int:
    """Traced gradient bytes beyond the trainable parameters': a vocabulary-parallel embedding's
    backward makes a whole-vocabulary gradient and keeps its rank's rows as a view of it."""
    return max(0, _traced_gradient_bytes(graph) - _traced_trainable_bytes(graph))


def storage_bytes(graph: OpGraph, config: TrainConfig) -> dict[int, int]:
    """Per-device bytes of every storage of the step: its traced bytes times its category's scale
    (the one place bytes are scaled; the simulator, the solver and diagnose read it)."""
    scale = category_scale(graph, config)
    return {t.id: int(t.nbytes * scale.get(t.category, 1.0)) for t in graph.tensors.values()}


def model_states_for(graph: OpGraph, config: TrainConfig) -> ModelStates:
    precision = get_precision(config.precision)
    foreach = get_device(config.gpu).is_cuda
    shapes = graph.param_shapes
    experts = graph.meta.get("ep_expert_params", ())  # per parameter: whether it is an expert's
    if config.zero_stage == 3 and any(experts):
        ranks = config.shard_ranks, expert_shard_ranks(graph, config.shard_ranks)
        shapes = [expert_state_shape(tuple(s), *ranks) if e else tuple(s) for s, e in zip(shapes, experts, strict=True)]
    trainable = [s for s, t in zip(shapes, _trainable_flags(graph)) if t]  # only these have gradients and states
    states = model_state_bytes(
        shapes,
        precision,
        config.optimizer,
        config.zero_stage,
        config.shard_ranks,
        foreach=foreach,
        trainable_shapes=trainable,
    )
    if config.cpu_offload:  # FSDP2 CPUOffloadPolicy: sharded states and the optimizer step live on the host
        return replace(states, parameter=0, gradient=0, optimizer=0, optimizer_step_temporary=0)
    unsharded_states = config.zero_stage == 0 or config.shard_ranks == 1
    if config.optimizer == "sgd" and unsharded_states and (beyond := _gradients_beyond_parameters(graph)):
        # SGD's momentum buffer is a clone of the gradient: it has the gradient's storage, not the parameter's
        per_traced_byte = states.gradient / max(1, _traced_trainable_bytes(graph))
        return replace(states, optimizer=states.optimizer + int(beyond * per_traced_byte))
    return states


def optimizer_step_s(model_state_bytes: int, device: DeviceSpec) -> float:
    """Seconds of the optimizer step on the device: it reads and writes every model-state byte it holds."""
    return 2 * model_state_bytes / device.hbm_bytes_per_s
