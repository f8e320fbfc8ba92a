"""FSDP2's own memory per rank: all-gather buffers, unsharded parameters and gradients, reduce-scatter buffers.

Follows ``torch.distributed.fsdp.fully_shard`` (torch 2.13, ``_fully_shard/_fsdp_param_group.py``,
``_fsdp_state.py``, ``_fsdp_collectives.py``) with one FSDP unit per block (``graph.regions``) and
the root holding every other parameter, the order torchtitan applies it. Per unit of padded
unsharded bytes P (dim 0 padded to a multiple of dp, in the all-gather dtype) and dp ranks:

- forward: a unit's pre-forward all-gathers into a P-byte output, then frees the *previous* unit's
  output and copies out into the unsharded parameters (P); the output stays held until the next
  unit's copy-out (the last one until the root's forward ends, so it is live at the loss). The
  root gathers first and is never resharded after forward. Post-forward frees the unsharded
  parameters (`reshard_after_forward=True`), keeps them (False) or keeps a P/N shard (an int N);
- backward: the root's pre-backward prefetches the last block's all-gather; each block's
  pre-backward copies out its own and prefetches the block before it, so one more output is live
  throughout a block's backward;
- a block's post-backward frees its unsharded parameters and the previous reduce-scatter input,
  copies its unsharded gradients into a new input (P in the reduce dtype), frees them and
  allocates the output (P / dp), which becomes the sharded gradients (cast to the parameter dtype
  when the reduce dtype differs). The input is held until the next unit's reduce; the root's
  gradients stay unsharded until the end of backward and its buffers go with it;
- mixed precision (``MixedPrecisionPolicy.param_dtype``) casts each shard into a P / dp temporary
  before the all-gather; ``CPUOffloadPolicy`` copies each shard to the device (P / dp) instead and
  sends the sharded gradients to the host.

Everything else (sharded parameters, gradients as the step produces them, optimizer states,
activations) the simulator counts from the trace; this module returns only the difference FSDP2
makes, as extra bytes per op. Gloo/NCCL internal workspaces are not tensors and are left out.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from costmodels.memory import get_precision
from planner.config import TrainConfig
from planner.simulation.memo import memo
from planner.tracing.graph import OpGraph, TensorInfo

__all__ = [
    "expert_params",
    "state_shape",
    "expert_shard_ranks",
    "FsdpUnit",
    "fsdp_buffers",
    "fsdp_itemsizes",
    "fsdp_units",
    "padded_bytes",
    "param_itemsize",
    "param_owners",
]

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class FsdpUnit:
    """One ``fully_shard`` unit: its module path ("" for the root) and op ranges.

    `param_bytes` is the unsharded size with dim 0 padded to a multiple of dp, in the traced
    (all-gather) dtype; the root's ranges cover the whole forward and backward.
    """

    path: str
    param_bytes: int
    fwd_start: int
    fwd_end: int
    bwd_start: int
    bwd_end: int

    def to_dict(self) -> dict:
        return asdict(self)


def padded_bytes(shape: tuple[int, ...], itemsize: int, dp: int) -> int:
    """Bytes of a parameter after FSDP2 pads dim 0 to a multiple of dp (``_get_dim0_padded_size``)."""
    if not shape:
        return itemsize * dp
    return math.ceil(shape[0] / dp) * dp * math.prod(shape[1:]) * itemsize


def param_itemsize(t: TensorInfo) -> int:
    """Bytes per element of a traced parameter."""
    return _DTYPE_BYTES.get(t.dtype, t.nbytes // max(1, math.prod(t.shape)))


def fsdp_units(graph: OpGraph, dp: int) -> list[FsdpUnit]:
    """The blocks in forward order, then the root; a parameter belongs to the first block that reads it
    (kept while the graph lives; read-only)."""
    return memo("fsdp_units", graph, dp, lambda: _fsdp_units(graph, dp))


def expert_params(graph: OpGraph) -> frozenset[int]:
    """Storages of the expert-parallel parameters (each rank's local experts) of an EP trace (kept
    while the graph lives)."""

    def find() -> frozenset[int]:
        params = {t.id: t for t in graph.preexisting() if t.category == "parameter"}
        return frozenset().union(*(owned for _, owned in _expert_units(graph, params)))

    return memo("expert_params", graph, (), find)


def expert_shard_ranks(graph: OpGraph, shard_ranks: int) -> int:
    """Ranks FSDP2 shards an expert parameter over: the dp × cp ranks that hold the same experts
    (``shard_ranks // ep``), times the tensor-parallel ranks that hold them whole
    (``ep_plans.expert_tp_replicas``)."""
    meta = graph.meta
    return max(1, shard_ranks // int(meta.get("ep", 1))) * int(meta.get("ep_expert_tp_replicas", 1))


def expert_state_shape(local_shape: tuple[int, ...], shard_ranks: int, expert_ranks: int) -> tuple[int, ...]:
    """The shape whose ZeRO-3 shard over `shard_ranks` is the one a rank keeps of an expert
    parameter that FSDP2 shards over `expert_ranks` (:func:`expert_shard_ranks`): dim 0 padded there."""
    if not local_shape:
        return local_shape
    return (math.ceil(local_shape[0] / expert_ranks) * shard_ranks, *local_shape[1:])


def state_shape(graph: OpGraph, tensor_id: int, config: TrainConfig) -> tuple[int, ...]:
    """The shape whose ZeRO-3 shard a rank keeps of a traced parameter: an expert parameter's
    (expert_state_shape), any other as traced."""
    shape = tuple(graph.tensors[tensor_id].shape)
    if config.zero_stage == 3 and int(graph.meta.get("ep", 1)) > 1 and tensor_id in expert_params(graph):
        return expert_state_shape(shape, config.shard_ranks, expert_shard_ranks(graph, config.shard_ranks))
    return shape


def param_owners(graph: OpGraph) -> dict[int, int]:
    """Parameter storage -> the block (in forward order) that owns it: the first whose forward reads
    it; the root's parameters are absent (kept while the graph lives; read-only)."""
    return memo("param_owners", graph, (), lambda: _param_owners(graph))


def _param_owners(graph: OpGraph) -> dict[int, int]:
    params = {t.id for t in graph.preexisting() if t.category == "parameter"}
    owner: dict[int, int] = {}
    for k, r in enumerate(sorted(graph.regions, key=lambda r: r.fwd_start)):
        for op in graph.ops[r.fwd_start : r.fwd_end]:
            for tid in op.inputs:
                if tid in params:
                    owner.setdefault(tid, k)
    return owner


def _fsdp_units(graph: OpGraph, dp: int) -> list[FsdpUnit]:
    params = {t.id: t for t in graph.preexisting() if t.category == "parameter"}
    blocks = sorted(graph.regions, key=lambda r: r.fwd_start)
    owner = param_owners(graph)
    experts = _expert_units(graph, params)
    sizes = [0] * (len(blocks) + 1)
    expert_dp = expert_shard_ranks(graph, dp)
    expert_sizes = [0] * len(experts)
    for tid, t in params.items():
        e = next((k for k, (_, owned) in enumerate(experts) if tid in owned), None)
        if e is not None:
            expert_sizes[e] += padded_bytes(t.shape, param_itemsize(t), expert_dp)
        else:
            sizes[owner.get(tid, len(blocks))] += padded_bytes(t.shape, param_itemsize(t), dp)
    units = [FsdpUnit(r.path, sizes[k], r.fwd_start, r.fwd_end, r.bwd_start, r.bwd_end) for k, r in enumerate(blocks)]
    units += [FsdpUnit(u.path, expert_sizes[k], *u.ranges) for k, (u, _) in enumerate(experts)]
    units.sort(key=lambda u: u.fwd_end)  # FSDP2's post-forward order: backward prefetches the unit before
    units.append(FsdpUnit("", sizes[-1], 0, graph.backward_start, graph.backward_start, len(graph.ops)))
    return units


@dataclass(frozen=True)
class _ExpertRanges:
    path: str
    ranges: tuple[int, int, int, int]


def _expert_units(graph: OpGraph, params: dict[int, TensorInfo]) -> list[tuple[_ExpertRanges, set[int]]]:
    """Under expert parallel with FSDP2, each experts module is its own ``fully_shard`` unit nested in
    its block (torchtitan shards it over the dp / ep ranks that hold the same experts): its op ranges
    and the expert parameters its forward reads."""
    shapes = Counter(tuple(s) for s in graph.meta.get("ep_expert_shapes", ()))
    paths = graph.meta.get("ep_expert_modules", ())
    inside: dict[str, list[int]] = {path: [] for path in paths}
    for op in graph.ops if paths else ():
        module = op.module
        while module and module not in inside:
            module = module.rpartition(".")[0]
        if module:
            inside[module].append(op.index)
    out = []
    for path in paths:
        fwd = [i for i in inside[path] if i < graph.backward_start]
        bwd = [i for i in inside[path] if i >= graph.backward_start]
        if not fwd or not bwd:
            continue
        owned = set()
        for i in range(fwd[0], fwd[-1] + 1):
            for tid in graph.ops[i].inputs:
                t = params.get(tid)
                if t is not None and tid not in owned and shapes[tuple(t.shape)] > 0:
                    shapes[tuple(t.shape)] -= 1
                    owned.add(tid)
        out.append((_ExpertRanges(path, (fwd[0], fwd[-1] + 1, bwd[0], bwd[-1] + 1)), owned))
    return out


class _State:
    """FSDP2's buffers at one instant; `instants` collects the totals seen while one op runs.
    `ranks` holds each unit's shard ranks: dp, or fewer for an experts unit (expert_shard_ranks).
    A unit sharded over one rank has no all-gather (FSDP2's world-size-1 path): its own pre-forward
    or pre-backward copies each shard into the unsharded parameter, so a prefetch does nothing and
    no output is held after the copy."""

    def __init__(self, units: list[FsdpUnit], ranks: list[int], keep_after_forward: int) -> None:
        self.units, self.ranks, self.keep_after_forward = units, ranks, keep_after_forward
        self.unsharded: set[int] = set()
        self.post_forward: set[int] = set()  # units holding a P/N shard between forward and backward
        self.gathered: dict[int, int] = {}  # unit -> all-gather output bytes
        self.held: int | None = None  # forward's previous all-gather output
        self.reduce_input = 0
        self.grads = defaultdict(int)  # unit -> unsharded gradient bytes beyond what the simulator counts
        self.instants: list[dict[str, int]] = []

    def snap(self, parameter: int = 0, gradient: int = 0) -> None:
        param = sum(self.units[u].param_bytes for u in self.unsharded) + sum(self.gathered.values())
        param += sum(self.units[u].param_bytes // self.keep_after_forward for u in self.post_forward)
        grad = sum(self.grads.values()) + self.reduce_input
        self.instants.append({"parameter": param + parameter, "gradient": grad + gradient})

    def unshard(self, u: int, copy_in: bool) -> None:
        if u in self.unsharded or u in self.gathered or self.ranks[u] == 1:
            return
        self.gathered[u] = self.units[u].param_bytes
        if copy_in:
            self.snap(parameter=self.units[u].param_bytes // self.ranks[u])
        self.snap()

    def copy_out(self, u: int, forward: bool, copy_in: bool) -> None:
        local = self.ranks[u] == 1 and u not in self.unsharded
        if u not in self.gathered and not local:
            return
        if forward and self.held is not None:
            del self.gathered[self.held]
            self.held = None
        self.post_forward.discard(u)  # the all-gather read the post-forward shard; copy-out frees it
        self.unsharded.add(u)
        if local and copy_in:  # the shard cast (or copied to the device) while it is copied in
            self.snap(parameter=self.units[u].param_bytes)
        self.snap()
        if local:
            return
        if forward:
            self.held = u
        else:
            del self.gathered[u]

    def end_forward(self) -> None:
        if self.held is not None:
            del self.gathered[self.held]
            self.held = None
        self.snap()

    def reshard_after_forward(self, u: int) -> None:
        if self.keep_after_forward == 1:
            return
        self.unsharded.discard(u)
        if self.keep_after_forward < self.ranks[u]:
            self.post_forward.add(u)
        self.snap()

    def reduce(self, u: int, reduce_bytes: int, staged_output_bytes: int) -> None:
        """Post-backward: reshard, free the previous input, copy the gradients in and free them,
        reduce-scatter into the output. The simulator already counts the sharded gradients; an
        output in another dtype than theirs, or bound for the host, is extra while it lives."""
        self.unsharded.discard(u)
        self.reduce_input = reduce_bytes
        self.snap()
        self.grads[u] = 0
        self.snap(gradient=staged_output_bytes)


def _events(units: list[FsdpUnit]) -> tuple[dict[int, list], dict[int, list]]:
    before: dict[int, list[tuple[str, int]]] = defaultdict(list)
    after: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for k, u in enumerate(units[:-1]):
        before[u.fwd_start].append(("forward", k))
        after[u.fwd_end - 1].append(("forward", k))
        before[u.bwd_start].append(("backward", k))
        after[u.bwd_end - 1].append(("backward", k))
    return before, after


def fsdp_itemsizes(graph: OpGraph, config: TrainConfig) -> tuple[int, int]:
    """Bytes per element FSDP2 all-gathers parameters in (the traced dtype) and reduce-scatters
    gradients in (`mp_reduce_dtype`, else the all-gather dtype, as FSDP2 defaults)."""
    gathered = _DTYPE_BYTES.get(graph.param_dtype, 4)
    return gathered, _DTYPE_BYTES[config.mp_reduce_dtype] if config.mp_reduce_dtype else gathered


def fsdp_buffers(graph: OpGraph, config: TrainConfig, gradient_scale: float) -> dict[int, dict[str, int]]:
    """Op index -> extra per-rank bytes FSDP2 holds at that op (its highest instant there).

    `gradient_scale` is the simulator's per-rank bytes of each traced gradient byte (the sharded
    gradient it counts from the op that produces it); until the unit's reduce-scatter the
    difference to the unsharded gradient is added here. Kept while the graph lives (read-only).
    """
    if config.shard_ranks == 1 or config.zero_stage < 3:
        return {}
    return memo("fsdp_buffers", graph, (config, gradient_scale), lambda: _fsdp_buffers(graph, config, gradient_scale))


def _fsdp_buffers(graph: OpGraph, config: TrainConfig, gradient_scale: float) -> dict[int, dict[str, int]]:
    dp = config.shard_ranks  # FSDP2 shards over dp × cp (torchtitan's dp_shard_cp mesh)
    units = fsdp_units(graph, dp)
    root = len(units) - 1
    raf = config.reshard_after_forward
    keep = dp if raf is True else 1 if raf is False else int(raf)
    experts, expert_ranks = set(graph.meta.get("ep_expert_modules", ())), expert_shard_ranks(graph, dp)
    state = _State(units, [expert_ranks if u.path in experts else dp for u in units], keep)
    traced_itemsize, reduce_itemsize = fsdp_itemsizes(graph, config)
    master_itemsize = get_precision(config.precision).param_dtype.itemsize
    copy_in = traced_itemsize != master_itemsize or config.cpu_offload

    # a later micro-batch of gradient accumulation: the simulator frees each new gradient at once (it
    # is added into the held sharded one), while FSDP2 keeps it unsharded until the unit's
    # reduce-scatter, whose sharded output is then added in
    accumulating = config.grad_accum_steps > 1
    held_fraction = 1.0 if accumulating else 1.0 - gradient_scale
    grad_owner = _gradient_owners(graph, units)
    before, after = _events(units)
    last_block = root - 1
    out: dict[int, dict[str, int]] = {}
    for op in graph.ops:
        i = op.index
        state.instants = []
        if i == 0:
            state.unshard(root, copy_in)
            state.copy_out(root, True, copy_in)
        if i == graph.backward_start and last_block >= 0:
            state.unshard(last_block, copy_in)
        for kind, k in before.get(i, ()):
            state.unshard(k, copy_in)
            state.copy_out(k, kind == "forward", copy_in)
            if kind == "backward" and k > 0:
                state.unshard(k - 1, copy_in)
        for tid in op.allocs:
            if tid in grad_owner:
                state.grads[grad_owner[tid]] += int(graph.tensors[tid].nbytes * held_fraction)
        state.snap()
        for kind, k in after.get(i, ()):
            if kind == "forward" and k != root:
                state.reshard_after_forward(k)
            else:
                _reduce(state, k, reduce_itemsize, traced_itemsize, master_itemsize, config.cpu_offload, accumulating)
        if i == graph.backward_start - 1:
            state.end_forward()
        if i == len(graph.ops) - 1:
            _reduce(state, root, reduce_itemsize, traced_itemsize, master_itemsize, config.cpu_offload, accumulating)
            state.reduce_input = 0
            state.snap()
        out[i] = max(state.instants, key=lambda d: d["parameter"] + d["gradient"])
    return out


def _reduce(
    state: _State,
    u: int,
    reduce_itemsize: int,
    traced_itemsize: int,
    master_itemsize: int,
    to_host: bool,
    accumulating: bool,
) -> None:
    """Reduce-scatter in the reduce dtype; the sharded gradients take the master weights' dtype (or,
    `accumulating`, the output is added into those held)."""
    reduce_bytes = state.units[u].param_bytes * reduce_itemsize // traced_itemsize
    staged_output = to_host or reduce_itemsize != master_itemsize or accumulating
    staged = reduce_bytes // state.ranks[u] if staged_output else 0
    state.reduce(u, reduce_bytes, staged)


def _gradient_owners(graph: OpGraph, units: Iterable[FsdpUnit]) -> dict[int, int]:
    """Gradient storage -> the unit whose backward produced it (the root for the rest)."""
    units = list(units)
    root = len(units) - 1
    owners = {}
    for t in graph.tensors.values():
        if t.category == "gradient" and t.alloc_op >= 0:
            owners[t.id] = next((k for k, u in enumerate(units[:-1]) if u.bwd_start <= t.alloc_op < u.bwd_end), root)
    return owners
