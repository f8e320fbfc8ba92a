"""The traced training step: ops in execution order and the storages they allocate and free.

An :class:`OpGraph` is what :func:`planner.tracing.recorder.trace` records and what the simulator and the
solver read. Tensors are tracked per *storage* (views share their base's memory), so `nbytes` is
real memory, not a sum over views.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from planner.tracing.blocks import parse_segment

if TYPE_CHECKING:
    import networkx as nx

CATEGORIES = ("parameter", "buffer", "gradient", "optimizer", "activation", "temporary")
CATEGORY_INDEX = {c: i for i, c in enumerate(CATEGORIES)}  # a category's column in per-category arrays
PHASES = ("forward", "loss", "backward", "optimizer")

__all__ = ["CATEGORIES", "CATEGORY_INDEX", "PHASES", "TensorInfo", "OpNode", "Region", "OpGraph"]


@dataclass(frozen=True)
class TensorInfo:
    """One storage of the step.

    `alloc_op` is the op that allocated it (-1: it exists before the step); `free_op` is the
    index of the first op that runs after it was freed (None: it outlives the step).
    `natural_free_op` is where a forward storage would be freed if autograd did not save it
    (measured by a second forward that saves nothing), and `saved_by` lists the forward ops
    whose autograd nodes saved it.
    """

    id: int
    nbytes: int
    category: str
    dtype: str
    shape: tuple[int, ...]
    alloc_op: int
    free_op: int | None
    natural_free_op: int | None = None
    saved_by: tuple[int, ...] = ()

    @property
    def saved(self) -> bool:
        return bool(self.saved_by)


@dataclass(frozen=True)
class OpNode:
    """One aten op call. `allocs` are the storages this op created, `mutates` those it wrote in
    place; `variant` names its string arguments ("approximate=tanh"), which pick its kernel."""

    index: int
    name: str
    phase: str
    module: str
    flops: int
    bytes_accessed: int
    dtype: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    allocs: tuple[int, ...]
    mutates: tuple[int, ...] = ()
    variant: str = ""


@dataclass(frozen=True)
class Region:
    """A checkpointable module (a transformer layer, a residual block).

    Forward ops are `fwd_start <= i < fwd_end`; backward ops carrying this module's path are
    `bwd_start <= i < bwd_end`. Regions with the same `signature` have the same structure.
    """

    path: str
    signature: str
    param_bytes: int
    fwd_start: int
    fwd_end: int
    bwd_start: int
    bwd_end: int


@dataclass
class OpGraph:
    """Ops of one training step (forward, loss, backward) and every storage they touch."""

    ops: list[OpNode]
    tensors: dict[int, TensorInfo]
    regions: list[Region]
    backward_start: int
    param_shapes: list[tuple[int, ...]]
    param_dtype: str
    meta: dict = field(default_factory=dict)
    # (ops dispatched so far, module) at each save autograd made in forward: torch's early stop
    # of a recompute happens right after the span's last save
    pack_events: tuple[tuple[int, str], ...] = ()
    # per parameter, whether it requires grad (empty: all do); frozen ones have no gradient or optimizer state
    param_trainable: tuple[bool, ...] = ()
    _consumers: dict[int, list[int]] | None = field(default=None, repr=False, compare=False)
    _by_module: dict[str, list[int]] | None = field(default=None, repr=False, compare=False)
    _first_bwd_use: dict[int, int] | None = field(default=None, repr=False, compare=False)
    _uncacheable: frozenset[int] | None = field(default=None, repr=False, compare=False)
    # what later layers derive from the graph alone and reuse (op times per device, FSDP2's buffers per sharding)
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_parameters(self) -> int:
        total = 0
        for shape in self.param_shapes:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def frees_by_op(self) -> dict[int, list[int]]:
        """Op index -> storages freed just before that op runs (len(ops): at the step's end)."""
        out: dict[int, list[int]] = {}
        for t in self.tensors.values():
            if t.free_op is not None:
                out.setdefault(t.free_op, []).append(t.id)
        return out

    def forward_consumers(self) -> dict[int, list[int]]:
        """Storage -> forward ops that read it (computed once)."""
        if self._consumers is None:
            out: dict[int, list[int]] = {}
            for op in self.ops[: self.backward_start]:
                for tid in op.inputs:
                    out.setdefault(tid, []).append(op.index)
            self._consumers = out
        return self._consumers

    def first_backward_use(self) -> dict[int, int]:
        """Storage -> the first backward op that reads it (computed once)."""
        if self._first_bwd_use is None:
            out: dict[int, int] = {}
            for op in self.ops[self.backward_start :]:
                for tid in op.inputs:
                    out.setdefault(tid, op.index)
            self._first_bwd_use = out
        return self._first_bwd_use

    def assumptions(self) -> dict:
        """What the trace assumed rather than saw (MoE routing), for results and plans."""
        return {"moe_routing": self.meta["moe"]} if "moe" in self.meta else {}

    def uncacheable_ops(self) -> frozenset[int]:
        """Forward ops a selective checkpoint must not cache: in-place ops, and ops with an output
        that a later forward op writes in place (torch refuses a cached tensor that was mutated)."""
        if self._uncacheable is None:
            out: set[int] = set()
            readers: dict[int, list[int]] = {}  # storage -> forward ops that output it
            for op in self.ops[: self.backward_start]:
                if op.mutates:
                    out.add(op.index)
                    for tid in op.mutates:
                        out.update(readers.get(tid, ()))
                for tid in op.outputs:
                    readers.setdefault(tid, []).append(op.index)
            self._uncacheable = frozenset(out)
        return self._uncacheable

    def buffers_written(self, path: str) -> dict[str, int]:
        """Buffer name (as named_buffers() gives it) -> storage, for the buffers that forward ops
        inside module `path` write in place, such as BatchNorm's running statistics. A recompute of
        `path` runs on copies of their pre-forward state, held from its forward to its backward
        (planner.runtime.apply.ForwardBuffers)."""
        writes = self.meta.get("buffer_writes", ())
        if not writes:
            return {}
        inside = set(self.ops_in_module(path))
        return {name: tid for i, tid, name in writes if i in inside}

    def ops_in_module(self, path: str) -> list[int]:
        """Indices of ops run inside a module (or its submodules), in order (indexed once)."""
        if self._by_module is None:
            index: dict[str, list[int]] = {}
            for op in self.ops:
                index.setdefault(op.module, []).append(op.index)
            self._by_module = index
        if path == "":
            return list(range(len(self.ops)))
        segment = parse_segment(path)
        if segment is not None:  # children I..J-1 of a Sequential
            parent, i, j = segment
            return sorted(x for k in range(i, j) for x in self.ops_in_module(f"{parent}.{k}" if parent else str(k)))
        prefix = path + "."
        out = list(self._by_module.get(path, ()))
        for name, ids in self._by_module.items():
            if name.startswith(prefix):
                out += ids
        return sorted(out)

    def preexisting(self) -> Iterator[TensorInfo]:
        return (t for t in self.tensors.values() if t.alloc_op < 0)

    def to_networkx(self) -> nx.DiGraph:
        """Dataflow view: op nodes, with an edge producer -> consumer per storage."""
        import networkx as nx  # 70 ms to import, and only this view needs it

        g = nx.DiGraph()
        producer: dict[int, int] = {}
        for op in self.ops:
            g.add_node(op.index, name=op.name, phase=op.phase, module=op.module)
            for tid in op.inputs:
                if tid in producer and producer[tid] != op.index:
                    g.add_edge(producer[tid], op.index, tensor=tid)
            for tid in op.allocs:
                producer[tid] = op.index
        return g
