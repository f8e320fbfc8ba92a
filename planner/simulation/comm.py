"""Step time under FSDP2: all-gathers and reduce-scatters on one link, overlapped with compute as
FSDP2's prefetch allows.

The schedule follows FSDP2's defaults (``torch.distributed.fsdp.fully_shard``): the root's
parameters are gathered first, together with block 0's; while block i computes its forward, block
i + 1's all-gather runs (the CPU issues it ahead of the GPU). In backward each block prefetches the
all-gather of the block that runs next (explicit backward prefetch), and its gradients are
reduce-scattered as soon as its backward ends. All collectives share one link and run in the order
they are issued. Kernel-launch and collective-latency terms are left out.

A plan's recompute replays a block's forward at the start of that block's backward, on the compute
stream, while the link still carries the all-gather of the block that runs next and earlier
reduce-scatters: where the backward waits for that all-gather, the replay fills the wait and only
what exceeds it lengthens the step. (Tensor-parallel collectives are different: the compute stream
waits on them, so they are compute time here and hide nothing.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

from costmodels.hardware import DeviceSpec
from costmodels.runtime import collective_time_s
from planner.config import TrainConfig
from planner.simulation.fsdp import fsdp_itemsizes
from planner.simulation.memo import memo
from planner.tracing.graph import OpGraph

__all__ = [
    "BlockTimes",
    "CommSchedule",
    "block_recompute_s",
    "fsdp_communication",
    "fsdp_schedule",
    "step_communication",
    "unplanned_communication",
]


@dataclass(frozen=True)
class BlockTimes:
    """Seconds of one FSDP unit: its forward and backward compute, its all-gather and reduce-scatter."""

    forward_s: float
    backward_s: float
    gather_s: float
    reduce_s: float


@dataclass(frozen=True)
class CommSchedule:
    """Compute, communication and the part of communication that compute does not hide."""

    compute_s: float
    communication_s: float
    exposed_communication_s: float
    # per FSDP block (forward order): seconds the compute stream waits after the block's backward for
    # the next block's all-gather; compute added to that backward (its recompute) runs in the wait
    backward_wait_s: tuple[float, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)


class _Link:
    """One collective link: each transfer starts when issued and when the previous one is done."""

    def __init__(self) -> None:
        self.free_at_s = 0.0
        self.busy_s = 0.0

    def issue(self, at_s: float, duration_s: float) -> float:
        self.free_at_s = max(self.free_at_s, at_s) + duration_s
        self.busy_s += duration_s
        return self.free_at_s


def fsdp_schedule(
    blocks: Sequence[BlockTimes],
    *,
    root: BlockTimes,
    head_forward_s: float,
    head_backward_s: float,
    reshard_after_forward: bool = True,
) -> CommSchedule:
    """Makespan of one step of compute and collectives (see the module docstring).

    `root` holds the non-block ops before the blocks (its forward_s/backward_s: embedding forward and
    backward) and the root's collectives; `head_*_s` is the compute after the last block (final
    norm, head, loss) in forward and backward. Without `reshard_after_forward`, blocks stay gathered
    from forward to backward, so backward gathers nothing.
    """
    link = _Link()
    gathered = {}
    root_ready = link.issue(0.0, root.gather_s)
    if blocks:
        gathered[0] = link.issue(0.0, blocks[0].gather_s)
    t = root_ready + root.forward_s
    for i, block in enumerate(blocks):
        start = max(t, gathered[i])
        if i + 1 < len(blocks):
            gathered[i + 1] = link.issue(start, blocks[i + 1].gather_s)
        t = start + block.forward_s
    backward_start = t + head_forward_s
    t = backward_start + head_backward_s
    last = len(blocks) - 1
    if reshard_after_forward and blocks:
        gathered[last] = link.issue(backward_start, blocks[last].gather_s)
    waits = [0.0] * len(blocks)
    for i in range(last, -1, -1):
        start = max(t, gathered[i]) if reshard_after_forward else t
        if i < last:
            waits[i + 1] = start - t
        if reshard_after_forward and i > 0:
            gathered[i - 1] = link.issue(start, blocks[i - 1].gather_s)
        t = start + blocks[i].backward_s
        queued_s = link.free_at_s - t  # the link is busy this long after the block's backward ends
        link.issue(t, blocks[i].reduce_s)
    t += root.backward_s
    if blocks:  # block 0's backward is followed by the root's and the step's last reduce-scatters
        waits[0] = max(0.0, min(queued_s, link.free_at_s - t))
    end = max(t, link.issue(t, root.reduce_s))
    compute = (
        root.forward_s
        + root.backward_s
        + head_forward_s
        + head_backward_s
        + sum(b.forward_s + b.backward_s for b in blocks)
    )
    return CommSchedule(compute, link.busy_s, max(0.0, end - compute), tuple(waits))


def fsdp_communication(
    graph: OpGraph,
    times: np.ndarray,
    *,
    dp: int,
    device: DeviceSpec,
    reduce_bytes_per_gathered_byte: float = 1.0,
    reshard_after_forward: bool = True,
    stride: int = 1,
    recompute_s: Sequence[float] = (),
) -> CommSchedule:
    """The FSDP2 schedule of a traced step whose blocks are the FSDP units and the rest is the root.

    `times` are per-op seconds; gathered bytes are the blocks' traced parameter bytes (a ZeRO-3 trace
    holds parameters in the dtype FSDP gathers them in); reduce-scattered bytes scale them by
    `reduce_bytes_per_gathered_byte` (2.0 when bf16 parameters reduce gradients in fp32).
    `recompute_s[i]` is what a plan replays at the start of block i's backward (forward order).
    """
    regions = sorted(graph.regions, key=lambda r: r.fwd_start)
    if not regions:
        total = float(times.sum())
        return CommSchedule(total, 0.0, 0.0)
    param_bytes = sum(t.nbytes for t in graph.preexisting() if t.category == "parameter")
    root_bytes = max(0, param_bytes - sum(r.param_bytes for r in regions))

    def unit(forward_s: float, backward_s: float, gathered_bytes: int) -> BlockTimes:
        gather = collective_time_s(gathered_bytes, dp, device, stride)
        reduce = collective_time_s(int(gathered_bytes * reduce_bytes_per_gathered_byte), dp, device, stride)
        return BlockTimes(forward_s, backward_s, gather, reduce)

    blocks = [
        unit(float(times[r.fwd_start : r.fwd_end].sum()), float(times[r.bwd_start : r.bwd_end].sum()), r.param_bytes)
        for r in regions
    ]
    in_blocks = sum(b.forward_s + b.backward_s for b in blocks)
    first, last = regions[0], regions[-1]
    pre_forward = float(times[: first.fwd_start].sum())
    head_forward = float(times[last.fwd_end : graph.backward_start].sum())
    head_backward = float(times[graph.backward_start : min(r.bwd_start for r in regions)].sum())
    root_backward = float(times.sum()) - in_blocks - pre_forward - head_forward - head_backward
    root = unit(pre_forward, max(0.0, root_backward), root_bytes)
    blocks = [replace(b, backward_s=b.backward_s + r) for b, r in zip(blocks, recompute_s)] + blocks[len(recompute_s) :]
    return fsdp_schedule(
        blocks,
        root=root,
        head_forward_s=head_forward,
        head_backward_s=head_backward,
        reshard_after_forward=reshard_after_forward,
    )


def block_recompute_s(graph: OpGraph, replays: Iterable[tuple[int, float]]) -> list[float]:
    """Seconds replayed in each block's backward (graph.regions in forward order) from (first forward
    op of the replayed module, seconds) pairs; a module outside every block replays in none."""
    regions = sorted(graph.regions, key=lambda r: r.fwd_start)
    out = [0.0] * len(regions)
    for op, seconds in replays:
        for i, r in enumerate(regions):
            if r.fwd_start <= op < r.fwd_end:
                out[i] += seconds
                break
    return out


DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default gradient bucket


def step_communication(
    graph: OpGraph, times: np.ndarray, config: TrainConfig, device: DeviceSpec, recompute_s: Sequence[float] = ()
) -> CommSchedule:
    """Communication of one data-parallel step, with `recompute_s[i]` seconds of a plan's replays
    at the start of block i's backward (graph.regions in forward order) on the compute stream.

    ZeRO-3 is FSDP2's schedule (:func:`fsdp_communication`). Below it every gradient is all-reduced
    (DDP, ZeRO-1) or reduce-scattered with the updated parameters all-gathered after the step
    (ZeRO-2): two ring passes over the gradient bytes either way, in buckets that overlap the
    backward compute, so only what backward cannot hide and the last bucket are exposed. A partial
    reshard (`reshard_after_forward=N`) is priced as a full one: its backward all-gather stays in
    the node but moves the same bytes.
    """
    dp = config.shard_ranks  # ZeRO / FSDP2 groups span dp × cp (torchtitan's dp_shard_cp)
    if dp == 1:
        return CommSchedule(float(times.sum()), 0.0, 0.0)
    if config.zero_stage == 3:
        gathered_itemsize, reduce_itemsize = fsdp_itemsizes(graph, config)
        return fsdp_communication(
            graph,
            times,
            dp=dp,
            device=device,
            reduce_bytes_per_gathered_byte=reduce_itemsize / gathered_itemsize,
            reshard_after_forward=config.reshard_after_forward is not False,
            stride=config.tp,
            recompute_s=recompute_s,
        )
    grad_bytes = sum(t.nbytes for t in graph.tensors.values() if t.category == "gradient")
    stride = config.tp  # consecutive members of a dp × cp group are tp ranks apart
    comm = 2 * collective_time_s(grad_bytes, dp, device, stride)
    last_bucket = 2 * collective_time_s(min(grad_bytes, DDP_BUCKET_BYTES), dp, device, stride)
    replayed_s = float(sum(recompute_s))
    backward_s = float(times[graph.backward_start :].sum()) + replayed_s
    return CommSchedule(float(times.sum()) + replayed_s, comm, max(comm - backward_s, last_bucket))


def unplanned_communication(graph: OpGraph, times: np.ndarray, config: TrainConfig, device: DeviceSpec) -> CommSchedule:
    """:func:`step_communication` without a plan, computed once per graph, config and device (the
    simulator's baseline for hidden recompute, and the waits the planner prices recompute against)."""
    return memo("communication", graph, (config, device), lambda: step_communication(graph, times, config, device))
