"""Event simulation of one steady-state training step -> :class:`Timeline`.

The step starts with parameters and optimizer states live and gradients `None`
(`zero_grad(set_to_none=True)`), runs the traced forward, loss and backward, then the optimizer
step. Storages are allocated and freed where the trace saw it happen; a plan moves the frees of
what it recomputes or offloads to where they would die naturally, and re-creates them in backward.
ZeRO sharding scales parameter, gradient and optimizer bytes per device and adds the gathered
parameters (stage 3) and unsharded gradients (stage 2+) of the block that is running.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from costmodels.hardware import get_device
from costmodels.memory import ModelStates
from planner.config import TrainConfig
from planner.errors import TraceError
from planner.simulation.comm import block_recompute_s, step_communication, unplanned_communication
from planner.simulation.costs import (
    StepCosts,
    category_scale,
    model_states_for,
    op_times,
    optimizer_step_s,
    storage_bytes,
)
from planner.simulation.effects import (
    FREE,
    SAMPLE,
    ChoiceEffect,
    Event,
    SpanChoice,
    choice_effects_at,
    choices_from_decisions,
    exposed_transfer_s,
    one_holder_each,
    storage_events,
)
from planner.simulation.fsdp import fsdp_buffers
from planner.tracing.graph import CATEGORIES, CATEGORY_INDEX, OpGraph

__all__ = ["Timeline", "gradient_accumulated_at", "simulate", "step_events"]


@dataclass(frozen=True)
class Timeline:
    """Memory of one step over time, per category, with the peak and who causes it."""

    peak_bytes: int
    peak_phase: str
    peak_op: str
    peak_module: str
    breakdown_at_peak: dict[str, int]
    model_states: dict[str, int]
    num_parameters: int
    costs: StepCosts
    config: dict
    op_index: np.ndarray = field(repr=False)  # (n,) op index of each sample
    phases: tuple[str, ...] = field(repr=False)  # (n,) phase of each sample
    by_category: np.ndarray = field(repr=False)  # (n, 6) bytes per category

    @property
    def total(self) -> np.ndarray:
        return self.by_category.sum(axis=1)

    def to_dict(self, max_points: int = 2000) -> dict:
        """JSON-ready; the curve keeps each bucket's maximum so the peak survives downsampling."""
        total = self.total
        n = len(total)
        step = max(1, -(-n // max_points))
        rows = []
        for start in range(0, n, step):
            k = start + int(np.argmax(total[start : start + step]))
            rows.append(
                {
                    "index": k,
                    "op_index": int(self.op_index[k]),
                    "phase": self.phases[k],
                    "total_bytes": int(total[k]),
                    **{c: int(v) for c, v in zip(CATEGORIES, self.by_category[k])},
                }
            )
        return {
            "peak_bytes": self.peak_bytes,
            "peak_phase": self.peak_phase,
            "peak_op": self.peak_op,
            "peak_module": self.peak_module,
            "breakdown_at_peak": dict(self.breakdown_at_peak),
            "model_states": dict(self.model_states),
            "num_parameters": self.num_parameters,
            "costs": self.costs.to_dict(),
            "config": dict(self.config),
            "timeline": rows,
        }


class _Memory:
    """Live bytes per category (in CATEGORIES order) and the recorded samples."""

    def __init__(self) -> None:
        self.live = [0] * len(CATEGORIES)
        self.samples: list[tuple[int, str, str, str, tuple[int, ...]]] = []

    def add(self, category: str, nbytes: int) -> None:
        self.live[CATEGORY_INDEX[category]] += nbytes

    def sample(self, op_index: int, phase: str, op: str, module: str, extra: dict[str, int] | None = None) -> None:
        values = self.live
        if extra:
            values = values.copy()
            for c, v in extra.items():
                values[CATEGORY_INDEX[c]] += v
        self.samples.append((op_index, phase, op, module, tuple(values)))


def _block_transients(graph: OpGraph, config: TrainConfig, scale: dict[str, float]) -> dict[int, dict[str, int]]:
    """Op index -> extra bytes of sharding buffers while a block runs.

    ZeRO-3 is FSDP2 as it runs (planner/simulation/fsdp.py: all-gather and reduce-scatter
    buffers, prefetch, the root unsharded through the step). ZeRO-2 (DeepSpeed-style) assumes each
    block's gradients stay unsharded from when its backward produces them until its backward ends
    and they are reduce-scattered in one bucket per block, with no buffer of its own (the simulator
    counts their sharded part); ZeRO-1 shards only optimizer states and adds nothing here.
    """
    if config.shard_ranks == 1 or config.zero_stage < 2:
        return {}
    if config.zero_stage >= 3:
        return fsdp_buffers(graph, config, scale["gradient"])
    out: dict[int, dict[str, int]] = defaultdict(lambda: {"parameter": 0, "gradient": 0})
    unsharded = max(0.0, 1.0 - scale["gradient"])
    grad_bytes = np.zeros(len(graph.ops), dtype=np.int64)
    for t in graph.tensors.values():
        if t.category == "gradient" and t.alloc_op >= 0:
            grad_bytes[t.alloc_op] += t.nbytes
    for r in graph.regions:
        produced = np.cumsum(grad_bytes[r.bwd_start : r.bwd_end])
        for i, nbytes in zip(range(r.bwd_start, r.bwd_end), produced):
            if nbytes:
                out[i]["gradient"] += int(nbytes * unsharded)
    return dict(out)


def simulate(
    graph: OpGraph, config: TrainConfig | None = None, plan=None, choices: Sequence[SpanChoice] = ()
) -> Timeline:
    """Simulate one training step of a traced graph, optionally under a plan (or span choices)."""
    if plan is not None:
        choices = list(choices) + choices_from_decisions(graph, plan.decisions)
    if choices and not graph.meta.get("natural_lifetimes", True):
        raise TraceError("this trace was made with lifetimes=False; trace again with lifetimes=True to simulate a plan")
    config = config or TrainConfig(batch_size=graph.meta.get("batch_size", 1), seq_len=graph.meta.get("seq_len", 1))
    traced_tp = graph.meta.get("tp", 1)
    if config.tp != traced_tp:
        raise TraceError(
            f"this trace is one rank of --tp {traced_tp} but the config says --tp {config.tp}; simulate every rank "
            "of a tensor-parallel layout with planner.api.simulate_layout (memplan simulate --tp N)"
        )
    traced_ep = graph.meta.get("ep", 1)
    if config.ep != traced_ep:
        raise TraceError(
            f"this trace is one rank of --ep {traced_ep} but the config says --ep {config.ep}; simulate every rank "
            "of an expert-parallel layout with planner.api.simulate_layout (memplan simulate --ep N)"
        )
    device = get_device(config.gpu)
    scale = category_scale(graph, config)
    states = model_states_for(graph, config)
    times = op_times(graph, device)
    transients = _block_transients(graph, config, scale)

    sizes = storage_bytes(graph, config)
    effects = choice_effects_at(graph, choices, config)
    accumulating = config.grad_accum_steps > 1
    slots = step_events(graph, sizes, effects, accumulating)

    mem = _Memory()
    mem.add("optimizer", states.optimizer)
    if accumulating:  # the earlier micro-batches' gradients
        mem.add("gradient", sum(sizes[t.id] for t in graph.tensors.values() if t.category == "gradient"))
    for ev in slots[0]:
        mem.add(ev.category, ev.nbytes)
    for op in graph.ops:
        extra = transients.get(op.index)
        for ev in slots[op.index + 1]:
            if ev.storage == SAMPLE:  # a point inside a recompute's replay
                redo = graph.ops[ev.replayed]
                mem.sample(op.index, "backward", f"recompute {redo.name}", redo.module, extra)
            else:
                mem.add(ev.category, ev.nbytes)
        mem.sample(op.index, op.phase, op.name, op.module, extra)
    for ev in slots[-1]:
        mem.add(ev.category, ev.nbytes)
    mem.sample(len(graph.ops), "optimizer", "optimizer.step", "", {"temporary": states.optimizer_step_temporary})

    transfers = [e.transfer for e in effects if e.transfer is not None]
    exposed = exposed_transfer_s(transfers, times, graph.backward_start, device)
    recompute_s = sum(e.recompute_s for e in effects)
    optimizer_s = optimizer_step_s(states.total, device)
    unplanned = unplanned_communication(graph, times, config, device)
    replays = block_recompute_s(graph, ((c.span.fwd_start, e.recompute_s) for c, e in zip(choices, effects)))
    comm = step_communication(graph, times, config, device, replays) if recompute_s else unplanned
    micro_batch_s = float(times.sum()) + recompute_s + exposed + comm.exposed_communication_s
    costs = StepCosts(
        step_s=config.grad_accum_steps * micro_batch_s + optimizer_s,
        recompute_flops=int(sum(e.recompute_flops for e in effects)),
        recompute_s=recompute_s,
        offload_bytes=int(sum(tr.nbytes for tr in transfers)),
        exposed_offload_s=exposed,
        communication_s=comm.communication_s,
        exposed_communication_s=comm.exposed_communication_s,
        hidden_recompute_s=_hidden_s(unplanned.exposed_communication_s - comm.exposed_communication_s),
    )
    return _timeline(mem, states, graph, config, costs)


def _hidden_s(seconds: float) -> float:
    """Recompute seconds hidden in communication; below a nanosecond it is float rounding."""
    return seconds if seconds > 1e-9 else 0.0


def step_events(
    graph: OpGraph, sizes: Mapping[int, int], effects: Sequence[ChoiceEffect] = (), accumulating: bool = False
) -> list[list[Event]]:
    """The step's events in order, in slots: [0] before the step, [i + 1] at op i, [-1] at the end.

    Storages no choice moves keep their traced lifetimes; the choices' events replace the others'.
    Within a slot events run by stage (frees, reloads, replays, allocations), stable otherwise.
    `accumulating`: a later micro-batch of gradient accumulation, where each new gradient is added
    into the one already held and freed then (:func:`gradient_accumulated_at`).
    """
    moved = set().union(*(e.moved for e in effects))
    accumulated_at = gradient_accumulated_at(graph) if accumulating else {}
    slots: list[list[Event]] = [[] for _ in range(len(graph.ops) + 2)]
    last_op = len(graph.ops) - 1
    traced = _traced_events(graph)
    for tid, t in graph.tensors.items():
        if tid not in moved:
            nbytes = sizes[tid]
            events = traced[tid] if nbytes == t.nbytes else storage_events(graph, tid, nbytes)
            for ev in events:
                slots[ev.op + 1].append(ev)
            if accumulating and tid in accumulated_at:
                freed = min(accumulated_at[tid] + 1, last_op)
                slots[freed + 1].append(Event(freed, FREE, tid, -sizes[tid], t.category))
    for _, events in one_holder_each([e.moved for e in effects], [e.events for e in effects]):
        for ev in events:
            slots[ev.op + 1].append(ev)
    by_stage = attrgetter("stage")
    return [sorted(slot, key=by_stage) if len(slot) > 1 else slot for slot in slots]


def gradient_accumulated_at(graph: OpGraph) -> dict[int, int]:
    """Each parameter gradient the backward makes -> the op after which a later micro-batch's copy
    of it is added into the one already held (AccumulateGrad's in-place ``grad += new``) and
    freed: its last reader, AccumulateGrad's own op in the trace, which runs when the autograd
    node that made it has made its other outputs too (a linear's input gradient, after its
    weight's); the op that made it when nothing reads it. Kept with the graph."""
    if "gradient_accumulated_at" not in graph.derived:
        last = {
            tid: t.alloc_op
            for tid, t in graph.tensors.items()
            if t.category == "gradient" and t.free_op is None and t.alloc_op >= 0
        }
        for op in graph.ops[graph.backward_start :]:
            for tid in op.inputs:
                if tid in last:
                    last[tid] = max(last[tid], op.index)
        graph.derived["gradient_accumulated_at"] = last
    return graph.derived["gradient_accumulated_at"]


def _traced_events(graph: OpGraph) -> dict[int, tuple[Event, ...]]:
    """Every storage's events at its traced bytes (what it holds on a device unless ZeRO scales it),
    kept with the graph: a layout search simulates the same graph at many configs."""
    if "traced_events" not in graph.derived:
        events = {tid: tuple(storage_events(graph, tid, t.nbytes)) for tid, t in graph.tensors.items()}
        graph.derived["traced_events"] = events
    return graph.derived["traced_events"]


def _timeline(mem: _Memory, states: ModelStates, graph: OpGraph, config: TrainConfig, costs: StepCosts) -> Timeline:
    by_category = np.array([s[4] for s in mem.samples], dtype=np.int64).reshape(-1, len(CATEGORIES))
    total = by_category.sum(axis=1)
    k = int(np.argmax(total))
    op_index, phase, op, module, _ = mem.samples[k]
    return Timeline(
        peak_bytes=int(total[k]),
        peak_phase=phase,
        peak_op=op,
        peak_module=module,
        breakdown_at_peak={c: int(v) for c, v in zip(CATEGORIES, by_category[k])},
        model_states={"parameter": states.parameter, "gradient": states.gradient, "optimizer": states.optimizer},
        num_parameters=states.num_parameters,
        costs=costs,
        config={**config.to_dict(), **graph.assumptions()},
        op_index=np.array([s[0] for s in mem.samples]),
        phases=tuple(s[1] for s in mem.samples),
        by_category=by_category,
    )
