"""FSDP2 under a pipeline (``--pp N --dp M --zero 3``): each stage's buffers as
``torch.distributed.pipelining`` runs an FSDP2 stage module (stage.py, schedules.py, torch 2.13).

Each stage module is its own FSDP2 root over its blocks (torchtitan: ``fully_shard`` per block, then
the stage). Every backward runs with ``set_reshard_after_backward(False)`` and
``set_requires_gradient_sync(False)``; the stage's ``REDUCE_GRAD``, right after its last backward,
reduce-scatters the gradients and reshards. So, per stage:

- a forward gathers the root and each block not gathered yet; a unit it all-gathers keeps its
  all-gather output until the next unit's copy-out, the last one until the root's forward ends
  (FSDP2's ``all_gather_state``); post-forward reshards every block, and the root too (an explicit
  ``reshard_after_forward`` covers it), unless ``reshard_after_forward`` is false;
- a backward gathers the root at its pre-backward (on the last stage after the loss's own backward,
  then it prefetches the last block; elsewhere right after the last block's, both hooks on the
  stage's output) and each block, prefetched when the one after it starts; each copy-out holds the
  output and the parameters at once; everything stays gathered until the next forward (or
  ``REDUCE_GRAD``);
- gradients stay unsharded, in the traced dtype (the reduce dtype where it differs), from the op
  that makes them until ``REDUCE_GRAD``; a later microbatch's gradient is a transient added into
  them;
- ``REDUCE_GRAD`` reduce-scatters block by block (the last first), each through an input buffer of
  its unsharded gradients in the reduce dtype, and frees them.

A multi-stage schedule (interleaved, looped, V-shaped) runs on torch's runtime, which adds UNSHARD
and RESHARD actions: before each compute action the next three distinct stages it will run are
all-gathered whole (every FSDP2 module), and the first compute of such a stage waits each all-gather
in turn, until the runtime evicts them (:func:`unshard_plan`).

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
from planner.simulation.step import gradient_accumulated_at
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
    # (bwd ops,) those of a later microbatch's gradients live at each op: each from the op that makes
    # it to AccumulateGrad's, which adds it into the one held (planner.simulation.step.gradient_accumulated_at)
    accumulating_at: np.ndarray
    reduce_input_bytes: tuple[int, ...]  # each block's reduce-scatter input; the root's last
    keep_after_forward: bool
    # per block: prefetched in backward (an all-gather over more than one rank); a unit sharded over
    # one rank (the experts when ep = dp) is copied whole when its own backward starts
    prefetched: tuple[bool, ...]
    # the root's pre-backward: before the last block's when the stage's output is made by root ops
    # after its blocks (the last stage's norm and head; it then prefetches the last block), else right
    # after it (both hooks on the same output, the block's registered first)
    root_first: bool
    root_bwd_start: int  # the op the root's pre-backward runs before (the last stage's loss backward first)
    root_fwd_end: int  # the op after the root's forward (the last stage's loss is outside the stage module)

    @property
    def gradient_bytes(self) -> int:
        return int(self.grad_at.sum())

    @property
    def unit_gradient_bytes(self) -> tuple[int, ...]:
        """The extra gradient bytes of each block (made in its backward), then the root's (the rest)."""
        rel = [(lo - self.cut.bwd_start, hi - self.cut.bwd_start) for lo, hi in self.block_bwd]
        blocks = [int(self.grad_at[lo:hi].sum()) for lo, hi in rel]
        return (*blocks, self.gradient_bytes - sum(blocks))


def stage_fsdp(
    graph: OpGraph, config: TrainConfig, cut: StageCut, sizes: dict[int, int], sums: frozenset[int]
) -> StageFsdp:
    """`cut`'s FSDP2 units; `sizes` are the programs' (sharded) storage bytes; `sums`, the gradients
    no stage makes (:func:`planner.simulation.pipeline_split.tied_gradients`)."""
    # the stage's FSDP2 units in post-forward order: its blocks (and, under expert parallel, the experts
    # modules nested in them, each its own unit); the root comes last in fsdp_units
    blocks = [u for u in fsdp_units(graph, config.shard_ranks)[:-1] if cut.fwd_start <= u.fwd_start < cut.fwd_end]
    traced_itemsize, reduce_itemsize = fsdp_itemsizes(graph, config)
    accumulate = max(1.0, reduce_itemsize / traced_itemsize)  # FSDP2 accumulates in the reduce dtype
    grad_at = np.zeros(cut.bwd_end - cut.bwd_start, dtype=np.int64)
    accumulating = np.zeros(cut.bwd_end - cut.bwd_start + 1, dtype=np.int64)  # +bytes where made, -bytes after added
    added_at = gradient_accumulated_at(graph)
    for t in graph.tensors.values():
        a = t.alloc_op
        if t.category == "gradient" and t.free_op is None and cut.bwd_start <= a < cut.bwd_end and t.id not in sums:
            extra = int(t.nbytes * accumulate) - sizes[t.id]
            grad_at[a - cut.bwd_start] += extra
            accumulating[a - cut.bwd_start] += extra
            accumulating[min(added_at.get(t.id, a), cut.bwd_end - 1) - cut.bwd_start + 1] -= extra
    root = _root_bytes(graph, config.shard_ranks, cut)
    last_fwd_end, last_bwd_start = (
        (blocks[-1].fwd_end, blocks[-1].bwd_start) if blocks else (cut.fwd_start, cut.bwd_start)
    )
    root_first = any(op.phase == "forward" for op in graph.ops[last_fwd_end : cut.fwd_end])
    loss_start = next((i for i in range(cut.fwd_start, cut.fwd_end) if graph.ops[i].phase == "loss"), None)
    has_loss = loss_start is not None
    own_backward = (i for i in range(cut.bwd_start, cut.bwd_end) if graph.ops[i].module or not has_loss)
    return StageFsdp(
        cut=cut,
        block_bytes=tuple(u.param_bytes for u in blocks),
        block_fwd=tuple((u.fwd_start, u.fwd_end) for u in blocks),
        block_bwd=tuple((u.bwd_start, u.bwd_end) for u in blocks),
        root_bytes=root,
        grad_at=grad_at,
        accumulating_at=np.cumsum(accumulating[:-1]),
        reduce_input_bytes=tuple(
            b * reduce_itemsize // traced_itemsize for b in (*(u.param_bytes for u in blocks), root)
        ),
        keep_after_forward=config.reshard_after_forward is False,
        prefetched=tuple(
            u.path not in graph.meta.get("ep_expert_modules", ()) or expert_shard_ranks(graph, config.shard_ranks) > 1
            for u in blocks
        ),
        root_first=root_first,
        root_bwd_start=next(own_backward, cut.bwd_start) if root_first else last_bwd_start,
        root_fwd_end=cut.fwd_end if loss_start is None else loss_start,
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


@dataclass(frozen=True)
class ActionExtras:
    """FSDP2's bytes beyond the programs' during one action: (parameter, gradient) at each op, and
    at the instants just before the ops at positions `copy_out_at`, where a unit is copied out of
    its all-gather output (both live)."""

    parameter: np.ndarray
    gradient: np.ndarray
    copy_out_at: np.ndarray  # positions in the action's ops
    copy_out_bytes: np.ndarray  # (instants, 2): parameter and gradient bytes at each


def _position(ops: np.ndarray, op: int) -> int | None:
    """The position of `op` among an action's ops, or None."""
    found = np.flatnonzero(ops == op)
    return int(found[0]) if len(found) else None


class StageFsdpState:
    """What one stage's FSDP2 holds as a rank runs its actions: which blocks and whether its root are
    gathered, whether its gradients exist. :meth:`extras` gives the bytes beyond the programs' at
    each op of an action."""

    def __init__(self, fsdp: StageFsdp) -> None:
        self.fsdp = fsdp
        self.gathered = (False,) * len(fsdp.block_bytes)
        self.root = False
        self.grads = False
        self.awaiting = False  # unsharded by UNSHARD; its first compute waits for the all-gathers
        self._cache: dict[tuple, ActionExtras] = {}

    def unshard(self) -> None:
        """The multi-stage runtime's UNSHARD: every FSDP2 module of the stage gathered (FSDP2's own
        hooks still reshard them after a forward when ``reshard_after_forward`` says so)."""
        self.gathered, self.root, self.awaiting = (True,) * len(self.gathered), True, True

    def reshard(self) -> None:
        """The multi-stage runtime's RESHARD."""
        self.gathered, self.root, self.awaiting = (False,) * len(self.gathered), False, False

    def reduced(self) -> None:
        """After REDUCE_GRAD: the gradients reduce-scattered into the sharded ones, every unit resharded."""
        self.reshard()
        self.grads = False

    def extras(self, kind: str, ops: np.ndarray) -> ActionExtras:
        """The bytes beyond the programs' during this action (F, B, I or W); the state then moves past it."""
        key = (kind, self.gathered, self.root, self.grads, self.awaiting, len(ops))
        if key not in self._cache:
            self._cache[key] = self._extras(kind, ops)
        self.awaiting = False
        if kind == "F":  # post-forward reshards (an explicit reshard_after_forward covers the root too)
            keep = self.fsdp.keep_after_forward
            self.gathered, self.root = (keep,) * len(self.gathered), keep
        else:  # reshard_after_backward is off until REDUCE_GRAD
            self.gathered, self.root = (True,) * len(self.gathered), True
            self.grads = self.grads or kind in ("B", "W")
        return self._cache[key]

    def _extras(self, kind: str, ops: np.ndarray) -> ActionExtras:
        f = self.fsdp
        everywhere = np.ones(len(ops), dtype=bool)
        if kind == "F":  # the root's post-forward frees the last all-gather output (and reshards it)
            in_root = ops < f.root_fwd_end
            param = np.where(in_root | f.keep_after_forward, f.root_bytes, 0) + np.where(
                in_root, self._forward_outputs(ops), 0
            )
        elif self.root:
            param = np.full(len(ops), f.root_bytes, dtype=np.int64)
        else:
            param = np.where(ops >= f.root_bwd_start, f.root_bytes, 0)
        last = len(f.block_bytes) - 1
        for k, nbytes in enumerate(f.block_bytes):
            if kind == "F":
                start, end = f.block_fwd[k]
                kept = everywhere if f.keep_after_forward else ops < end
                held = kept if self.gathered[k] else (ops >= start) & kept
            else:  # a backward gathers a block at its start, prefetched when the one after it (or the root) starts
                if not f.prefetched[k] or (k == last and not (f.root_first and f.root_bytes)):
                    start = f.block_bwd[k][0]
                else:
                    start = f.block_bwd[k + 1][0] if k < last else f.root_bwd_start
                held = everywhere if self.gathered[k] else ops >= start
            param += np.where(held, nbytes, 0)
        grad = np.zeros(len(ops), dtype=np.int64)
        made = np.zeros(len(ops), dtype=np.int64)
        if kind in ("F", "I") and self.grads:  # a later microbatch's forward or I: the unsharded gradients wait
            grad += f.gradient_bytes
        elif kind in ("B", "W"):
            inside = (ops >= f.cut.bwd_start) & (ops < f.cut.bwd_end)
            rel = np.clip(ops - f.cut.bwd_start, 0, len(f.grad_at) - 1)
            # accumulated into: a later microbatch's gradient is a transient until AccumulateGrad adds it in
            made = np.where(inside, f.accumulating_at[rel] if self.grads else f.grad_at[rel], 0)
            grad = f.gradient_bytes + made if self.grads else np.where(inside, np.cumsum(f.grad_at)[rel], 0)
        at, instants = self._copy_outs(kind, ops, param, grad - made)
        return ActionExtras(param, grad, np.array(at, dtype=np.int64), np.array(instants, dtype=np.int64))

    def _copy_outs(
        self, kind: str, ops: np.ndarray, param: np.ndarray, grad_before: np.ndarray
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """The copy-outs a forward's ops do not show, each an instant before an op where a unit's
        all-gather output and its parameters are both live: after UNSHARD, the stage's first action
        waits each unit in turn before it starts; a backward copies the root out at its pre-backward
        and each block before its first op (before it prefetches the block ahead). A unit already
        gathered, or sharded over one rank, copies nothing out."""
        f = self.fsdp
        if self.awaiting:
            units = [f.root_bytes, *(b for b, p in zip(f.block_bytes, f.prefetched) if p)]
            return [0], [(f.root_bytes + sum(f.block_bytes) + max(units), int(grad_before[0]))]
        if kind == "F":
            return [], []
        last = len(f.block_bytes) - 1
        gather_root = not self.root and f.root_bytes > 0
        at: list[int] = []
        instants: list[tuple[int, int]] = []
        for k, nbytes in enumerate(f.block_bytes):
            j = _position(ops, f.block_bwd[k][0])
            if self.gathered[k] or not f.prefetched[k] or j is None:
                continue
            ahead = k > 0 and f.prefetched[k - 1] and not self.gathered[k - 1]  # prefetched after the copy-out
            root_later = gather_root and k == last and not f.root_first  # gathered right after this block's
            not_yet = (f.block_bytes[k - 1] if ahead else 0) + (f.root_bytes if root_later else 0)
            at.append(j)
            instants.append((int(param[j]) + nbytes - not_yet, int(grad_before[j])))
        j = _position(ops, f.root_bwd_start)
        if gather_root and j is not None:
            blocks = sum(b for b, g in zip(f.block_bytes, self.gathered) if g)
            if not f.root_first and last >= 0 and not self.gathered[last]:
                blocks += f.block_bytes[last]  # copied out just before
            at.append(j)
            instants.append((2 * f.root_bytes + blocks, int(grad_before[j])))
        return at, instants

    def _forward_outputs(self, ops: np.ndarray) -> np.ndarray:
        """The all-gather output a forward holds at each op: a unit gathered in forward keeps its
        output until the next unit's copy-out, the last one until the root's forward ends
        (FSDP2's all_gather_state); a unit gathered before the forward (UNSHARD, or kept) has none,
        and a unit sharded over one rank copies its shard and holds none."""
        f = self.fsdp
        held = np.full(len(ops), 0 if self.root else f.root_bytes, dtype=np.int64)
        for k in sorted(range(len(f.block_bytes)), key=lambda k: f.block_fwd[k][0]):  # in pre-forward order
            if not self.gathered[k]:
                held = np.where(ops >= f.block_fwd[k][0], f.block_bytes[k] if f.prefetched[k] else 0, held)
        return held

    def held_bytes(self) -> tuple[int, int]:
        """(gathered parameter bytes, extra gradient bytes) held now."""
        f = self.fsdp
        param = (f.root_bytes if self.root else 0) + sum(b for b, g in zip(f.block_bytes, self.gathered) if g)
        return param, f.gradient_bytes if self.grads else 0
