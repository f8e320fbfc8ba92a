"""Cut a traced step into pipeline stages at block boundaries (``graph.regions``).

Stage 0 also runs what comes before the first block (embeddings), the last stage what comes
after the last block (final norm, head, loss), as torchtitan cuts its models. Forward ops of
stage k are those from its first block's forward start to the next stage's; backward runs the
stages in reverse, cut where each stage's first block's backward ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.errors import MemplanError
from planner.tracing.graph import OpGraph

__all__ = ["StageCut", "blocks_per_stage", "cut_stages", "op_stages", "tied_gradients", "weight_gradient_ops"]


@dataclass(frozen=True)
class StageCut:
    """One stage: its blocks ``[block_start, block_end)`` and op ranges ``[start, end)``."""

    index: int
    block_start: int
    block_end: int
    fwd_start: int
    fwd_end: int
    bwd_start: int
    bwd_end: int

    @property
    def num_blocks(self) -> int:
        return self.block_end - self.block_start

    def to_dict(self) -> dict:
        return {"stage": self.index, "blocks": [self.block_start, self.block_end]}


def blocks_per_stage(num_blocks: int, num_stages: int, split: str = "uniform") -> tuple[int, ...]:
    """Blocks of each stage: ``uniform`` (as evenly as possible, earlier stages take the remainder)
    or an explicit "N1,N2,..." that must add up to the model's blocks with none empty."""
    if num_blocks < num_stages:
        raise MemplanError(
            f"the model has {num_blocks} blocks, too few for {num_stages} pipeline stages; "
            f"lower --pp or --stages-per-rank (each stage needs a block)"
        )
    split = split.strip()
    if split in ("uniform", "auto"):
        base, extra = divmod(num_blocks, num_stages)
        return tuple(base + (1 if k < extra else 0) for k in range(num_stages))
    counts = tuple(int(p) for p in split.split(","))
    if len(counts) != num_stages:
        raise MemplanError(f"--pp-split names {len(counts)} stages but the pipeline has {num_stages}")
    if any(c <= 0 for c in counts):
        raise MemplanError(f"--pp-split {split} leaves a stage empty; give every stage at least one block")
    if sum(counts) != num_blocks:
        raise MemplanError(
            f"--pp-split {split} adds up to {sum(counts)} blocks but the model has {num_blocks}; "
            "give block counts that add up"
        )
    return counts


def cut_stages(graph: OpGraph, counts: tuple[int, ...]) -> tuple[StageCut, ...]:
    """Op ranges of each stage for block counts per stage (regions in forward order)."""
    regions = sorted(graph.regions, key=lambda r: r.fwd_start)
    if sum(counts) != len(regions):
        raise MemplanError(f"a split of {sum(counts)} blocks does not match the model's {len(regions)}")
    firsts = np.cumsum((0,) + counts[:-1]).tolist()
    n, last = len(counts), len(counts) - 1
    cuts = []
    for k, first in enumerate(firsts):
        end_block = first + counts[k]
        cuts.append(
            StageCut(
                index=k,
                block_start=first,
                block_end=end_block,
                fwd_start=0 if k == 0 else regions[first].fwd_start,
                fwd_end=graph.backward_start if k == last else regions[end_block].fwd_start,
                bwd_start=graph.backward_start if k == last else regions[end_block].bwd_end,
                bwd_end=len(graph.ops) if k == 0 else regions[first].bwd_end,
            )
        )
    if n > 1 and any(c.fwd_start >= c.fwd_end or c.bwd_start >= c.bwd_end for c in cuts):
        raise MemplanError("the model's blocks do not run in order forward and in reverse backward; cannot cut stages")
    return tuple(cuts)


def op_stages(graph: OpGraph, cuts: tuple[StageCut, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(stage of each op, True where the op is in backward)."""
    stage = np.zeros(len(graph.ops), dtype=np.int64)
    backward = np.zeros(len(graph.ops), dtype=bool)
    for c in cuts:
        stage[c.fwd_start : c.fwd_end] = c.index
        stage[c.bwd_start : c.bwd_end] = c.index
        backward[c.bwd_start : c.bwd_end] = True
    return stage, backward


def weight_gradient_ops(graph: OpGraph) -> frozenset[int]:
    """Backward ops that only serve weight gradients (what a split backward's W runs): those that
    make a parameter's gradient, and those whose outputs only such ops read (computed once per graph)."""
    if "weight_gradient_ops" not in graph.derived:
        graph.derived["weight_gradient_ops"] = _weight_gradient_ops(graph)
    return graph.derived["weight_gradient_ops"]


def _weight_gradient_ops(graph: OpGraph) -> frozenset[int]:
    readers: dict[int, list[int]] = {}
    for op in graph.ops[graph.backward_start :]:
        for tid in op.inputs:
            readers.setdefault(tid, []).append(op.index)
    out: set[int] = set()
    for op in reversed(graph.ops[graph.backward_start :]):
        makes_grad = any(graph.tensors[t].category == "gradient" for t in op.allocs)
        used = [r for t in op.allocs for r in readers.get(t, ()) if r != op.index]
        if makes_grad or (op.allocs and used and all(r in out for r in used)):
            out.add(op.index)
    return frozenset(out)


_ACCUMULATING_ADD = "aten.add.Tensor"  # autograd's accumulation of a weight's second gradient


def tied_gradients(graph: OpGraph, stage_of: np.ndarray, in_bwd: np.ndarray) -> tuple[frozenset[int], frozenset[int]]:
    """(each stage's own gradient of a weight read on several stages, the sums that accumulate them).

    The whole-model trace of a model whose head is tied to its embeddings accumulates the head's
    gradient (made on the last stage) into the embeddings' (made on stage 0) with one add on stage 0.
    Pipeline stages hold their own copy of the weight (torchtitan's, torch's tracer's), each with
    its own gradient, so on each stage the gradient its backward makes is the weight's gradient and
    no stage makes the sum."""
    tensors = graph.tensors
    own: set[int] = set()
    sums: set[int] = set()
    for op in graph.ops:
        if not in_bwd[op.index] or op.name != _ACCUMULATING_ADD:
            continue
        grads = [t for t in op.allocs if tensors[t].category == "gradient" and tensors[t].free_op is None]
        parts = [t for t in op.inputs if t in tensors and tensors[t].alloc_op >= 0 and in_bwd[tensors[t].alloc_op]]
        if (
            len(grads) == 1
            and len(parts) == 2
            and all(tensors[t].nbytes == tensors[grads[0]].nbytes for t in parts)
            and any(stage_of[tensors[t].alloc_op] != stage_of[op.index] for t in parts)
        ):
            sums.add(grads[0])
            own.update(parts)
    return frozenset(own), frozenset(sums)
