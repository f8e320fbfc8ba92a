"""Where a traced functional collective is waited for: the first op that computes with its output.

A functional collective (``torch.ops._c10d_functional``) runs on its own stream and returns an
AsyncCollectiveTensor, which waits for the work on its first use. The trace records a wait right
after the collective, so the real wait is the first later op that reads the output and computes
(allocates, writes or has FLOPs): not the recorded wait, and not a view of the output.
"""

from __future__ import annotations

import torch

from planner.tracing.graph import OpGraph
from planner.tracing.op_classes import COLLECTIVE_OPS

__all__ = ["WAIT_OP", "collective_first_uses"]

WAIT_OP = str(torch.ops._c10d_functional.wait_tensor.default)


def collective_first_uses(graph: OpGraph) -> dict[int, int | None]:
    """Op index of each functional collective -> index of the op that first computes with its
    output (None when no op does). Kept while the graph lives (read-only)."""
    key = "collective_first_uses"
    if key not in graph.derived:
        issued = {op.outputs[0]: op.index for op in graph.ops if op.name in COLLECTIVE_OPS and op.outputs}
        first_use: dict[int, int | None] = dict.fromkeys(issued.values())
        for op in graph.ops if issued else ():
            if op.name == WAIT_OP or not (op.allocs or op.mutates or op.flops):
                continue
            for t in op.inputs:
                if t in issued and op.index > issued[t] and first_use[issued[t]] is None:
                    first_use[issued[t]] = op.index
        graph.derived[key] = first_use
    return graph.derived[key]
