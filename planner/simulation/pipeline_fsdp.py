"""FSDP2 under a pipeline (``--pp N --dp M --zero 3``): each stage's buffers as
``torch.distributed.pipelining`` runs an FSDP2 stage module (stage.py, torch 2.13).

Each stage module is its own FSDP2 root over its blocks (torchtitan: ``fully_shard`` per block, then
the stage). Every backward runs with ``set_reshard_after_backward(False)`` and
``set_requires_gradient_sync(False)``; the stage's ``REDUCE_GRAD`` after its last microbatch
reduce-scatters the gradients and reshards. So, per stage:

- the root's parameters (the stage's own, outside its blocks) are gathered at its first forward
  and stay gathered (FSDP2 never reshards a root after forward);
- a block is gathered at its forward; it is resharded after it with ``reshard_after_forward`` true
  and kept otherwise; a backward gathers it again (the next block in backward order is prefetched)
  and keeps it, so after a stage's first backward every block stays gathered until the next
  forward (true) or the end of the step (false);
- gradients stay unsharded, in the traced dtype (the reduce dtype where it differs), from the op
  that makes them until ``REDUCE_GRAD``; a later microbatch's gradient is a transient added into
  them;
- ``REDUCE_GRAD`` reduce-scatters block by block (the last first), each through an input buffer of
  its unsharded gradients in the reduce dtype, and frees them.

A multi-stage schedule (interleaved, looped, V-shaped) runs on torch's runtime, which adds UNSHARD
and RESHARD actions: before each compute action the next three distinct stages it will run are
gathered whole (every FSDP2 module) and kept, whatever ``reshard_after_forward`` says, until the
runtime evicts them (:func:`unshard_plan`).

The stage programs count sharded parameters and gradients (planner.simulation.costs.category_scale);
this module gives what FSDP2 holds beyond them, per op of each action.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.config import TrainConfig
from planner.simulation.fsdp import (
    expert_shard_ranks,
    fsdp_itemsizes,
    fsdp_units,
    padded_bytes,
    param_itemsize,
    param_owners,
)
from planner.simulation.pipeline_schedule import PipelineSchedule
from planner.simulation.pipeline_split import StageCut
from planner.tracing.graph import OpGraph

__all__ = [
    "ACTIVE_STAGES",
    "StageFsdp",
    "StageFsdpState",
    "split_backward_gradient_hazard",
    "stage_fsdp",
    "unshard_plan",
]

ACTIVE_STAGES = 3  # torch's _add_unshard_reshard(max_active_stages=3): stages a multi-stage rank keeps gathered


def split_backward_gradient_hazard(config: TrainConfig, schedule: PipelineSchedule) -> str | None:
    """Why torch would train this layout wrong, or None. A split backward (I, then W: the zero-bubble
    and DualPipeV schedules) under FSDP2 resharding after forward computes wrong weight gradients on
    the stages whose backward it splits, silently (torch 2.13, measured on gloo ranks with
    torchtitan-style stages and traced ones alike: the zero-bubble schedules leave the last stage
    none; stage 0, whose backward is one call, and the schedules without a split backward are right);
    resharding after forward false is right."""
    if config.zero_stage != 3 or config.reshard_after_forward is False or not schedule.split_stages:
        return None
    return (
        f"torch's {schedule.name} with FSDP2 resharding after forward computes wrong weight gradients on the "
        "stages whose backward it splits (none on the last stage under the zero-bubble schedules; measured on "
        "gloo ranks); train it with --reshard-after-forward false, torchtitan's setting for pipelines"
    )


def unshard_plan(stages: list[int]) -> list[tuple[list[int], list[int]]]:
    """Per compute action of a multi-stage rank (`stages`: each action's stage), the stages its
    runtime reshards and then unshards before it: the next ACTIVE_STAGES distinct stages ahead
    are kept gathered (torch.distributed.pipelining.schedules._add_unshard_reshard)."""
    aheads: list[list[int]] = [[] for _ in stages]  # the next distinct stages from each action on
    following: list[int] = []
    for i in range(len(stages) - 1, -1, -1):
        following = [stages[i], *(s for s in following if s != stages[i])][:ACTIVE_STAGES]
        aheads[i] = following
    active: list[int] = []
    out = []
    for ahead in aheads:
        evict = [s for s in active if s not in ahead]
        fetch = [s for s in ahead if s not in active]
        active = [s for s in active if s in ahead] + fetch
        out.append((evict, fetch))
    return out


@dataclass(frozen=True)
class StageFsdp:
    """One stage's FSDP2 units and gradients: blocks in forward order, the root's bytes, and the
    unsharded-minus-counted gradient bytes made at each backward op of the stage."""

    cut: StageCut
    block_bytes: tuple[int, ...]  # unsharded (gathered) bytes of each block
    block_fwd: tuple[tuple[int, int], ...]  # [start, end) op range of each block's forward
    block_bwd: tuple[tuple[int, int], ...]  # [start, end) of each block's backward
    root_bytes: int
    grad_at: np.ndarray  # (bwd ops,) gradient bytes beyond the counted (sharded) ones, made at each op
    reduce_input_bytes: tuple[int, ...]  # each block's reduce-scatter input; the root's last
    keep_after_forward: bool
    # per block: prefetched in backward (an all-gather over more than one rank); a unit sharded over
    # one rank (the experts when ep = dp) is copied whole when its own backward starts
    prefetched: tuple[bool, ...]

    @property
    def gradient_bytes(self) -> int:
        return int(self.grad_at.sum())

    @property
    def unit_gradient_bytes(self) -> tuple[int, ...]:
        """The extra gradient bytes of each block (made in its backward), then the root's (the rest)."""
        rel = [(lo - self.cut.bwd_start, hi - self.cut.bwd_start) for lo, hi in self.block_bwd]
        blocks = [int(self.grad_at[lo:hi].sum()) for lo, hi in rel]
        return (*blocks, self.gradient_bytes - sum(blocks))


def stage_fsdp(graph: OpGraph, config: TrainConfig, cut: StageCut, sizes: dict[int, int]) -> StageFsdp:
    """`cut`'s FSDP2 units; `sizes` are the programs' (sharded) storage bytes."""
    # the stage's FSDP2 units in post-forward order: its blocks (and, under expert parallel, the experts
    # modules nested in them, each its own unit); the root comes last in fsdp_units
    blocks = [u for u in fsdp_units(graph, config.shard_ranks)[:-1] if cut.fwd_start <= u.fwd_start < cut.fwd_end]
    traced_itemsize, reduce_itemsize = fsdp_itemsizes(graph, config)
    accumulate = max(1.0, reduce_itemsize / traced_itemsize)  # FSDP2 accumulates in the reduce dtype
    grad_at = np.zeros(cut.bwd_end - cut.bwd_start, dtype=np.int64)
    for t in graph.tensors.values():
        a = t.alloc_op
        if t.category == "gradient" and t.free_op is None and cut.bwd_start <= a < cut.bwd_end:
            grad_at[a - cut.bwd_start] += int(t.nbytes * accumulate) - sizes[t.id]
    root = _root_bytes(graph, config.shard_ranks, cut)
    return StageFsdp(
        cut=cut,
        block_bytes=tuple(u.param_bytes for u in blocks),
        block_fwd=tuple((u.fwd_start, u.fwd_end) for u in blocks),
        block_bwd=tuple((u.bwd_start, u.bwd_end) for u in blocks),
        root_bytes=root,
        grad_at=grad_at,
        reduce_input_bytes=tuple(
            b * reduce_itemsize // traced_itemsize for b in (*(u.param_bytes for u in blocks), root)
        ),
        keep_after_forward=config.reshard_after_forward is False,
        prefetched=tuple(
            u.path not in graph.meta.get("ep_expert_modules", ()) or expert_shard_ranks(graph, config.shard_ranks) > 1
            for u in blocks
        ),
    )


def _root_bytes(graph: OpGraph, dp: int, cut: StageCut) -> int:
    """Gathered bytes of the parameters this stage reads that no block owns (its root's)."""
    params = {t.id: t for t in graph.preexisting() if t.category == "parameter"}
    owned = param_owners(graph)
    read = {
        tid
        for lo, hi in ((cut.fwd_start, cut.fwd_end), (cut.bwd_start, cut.bwd_end))
        for op in graph.ops[lo:hi]
        for tid in op.inputs
        if tid in params and tid not in owned
    }
    return sum(padded_bytes(params[tid].shape, param_itemsize(params[tid]), dp) for tid in read)


class StageFsdpState:
    """What one stage's FSDP2 holds as a rank runs its actions: which blocks are gathered, whether
    its gradients exist. :meth:`extras` gives the bytes beyond the programs' at each op of an action."""

    def __init__(self, fsdp: StageFsdp) -> None:
        self.fsdp = fsdp
        self.gathered = (False,) * len(fsdp.block_bytes)
        self.root = False
        self.grads = False
        self.pinned = False  # unsharded by the schedule (UNSHARD): kept until its RESHARD
        self._cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def unshard(self) -> None:
        """The multi-stage runtime's UNSHARD: every FSDP2 module of the stage gathered, kept until RESHARD."""
        self.gathered, self.root, self.pinned = (True,) * len(self.gathered), True, True

    def reshard(self) -> None:
        """The multi-stage runtime's RESHARD."""
        self.gathered, self.root, self.pinned = (False,) * len(self.gathered), False, False

    def extras(self, kind: str, ops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(parameter, gradient) bytes beyond the programs' at each op of this action (F, B, I or W);
        the state then moves past it."""
        key = (kind, self.gathered, self.grads, self.pinned, len(ops))
        if key not in self._cache:
            self._cache[key] = self._extras(kind, ops)
        self.root = True
        if kind == "F":
            self.gathered = (self.fsdp.keep_after_forward or self.pinned,) * len(self.gathered)
        else:
            self.gathered = (True,) * len(self.gathered)
            self.grads = self.grads or kind in ("B", "W")
        return self._cache[key]

    def _extras(self, kind: str, ops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        f = self.fsdp
        everywhere = np.ones(len(ops), dtype=bool)
        param = np.full(len(ops), f.root_bytes, dtype=np.int64)
        for k, nbytes in enumerate(f.block_bytes):
            if kind == "F":
                start, end = f.block_fwd[k]
                kept = everywhere if f.keep_after_forward or self.pinned else ops < end
                held = kept if self.gathered[k] else (ops >= start) & kept
            else:  # a backward gathers the block at its start, prefetched when the next one starts
                ahead = k + 1 < len(f.block_bytes) and f.prefetched[k]
                start = f.block_bwd[k + 1][0] if ahead else f.block_bwd[k][0]
                held = everywhere if self.gathered[k] else ops >= start
            param += np.where(held, nbytes, 0)
        grad = np.zeros(len(ops), dtype=np.int64)
        if kind in ("B", "W"):
            inside = (ops >= f.cut.bwd_start) & (ops < f.cut.bwd_end)
            rel = np.clip(ops - f.cut.bwd_start, 0, len(f.grad_at) - 1)
            if self.grads:  # accumulated into: a later microbatch's gradient is a transient at its op
                grad = f.gradient_bytes + np.where(inside, f.grad_at[rel], 0)
            else:
                grad = np.where(inside, np.cumsum(f.grad_at)[rel], 0)
        return param, grad

    def held_bytes(self) -> tuple[int, int]:
        """(gathered parameter bytes, extra gradient bytes) held now."""
        f = self.fsdp
        param = (f.root_bytes if self.root else 0) + sum(b for b, g in zip(f.block_bytes, self.gathered) if g)
        return param, f.gradient_bytes if self.grads else 0
