"""Classes of aten ops, as sets of OpOverloads, shared by the solver's options and the baselines.

A traced :class:`~planner.tracing.graph.OpNode` names its op as ``str(overload)``
(``"aten.mm.default"``); each class here is the set of such names of its overloads, so an op is
classified by exact overload (``op.name in MATMUL_OPS``), never by a substring of its name.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from memplan_compat import OpOverload

__all__ = [
    "COLLECTIVE_OPS",
    "ATTENTION_BACKWARD_OPS",
    "ATTENTION_CORE_OPS",
    "ATTENTION_OPS",
    "CONV_OPS",
    "EXTERN_KERNEL_OPS",
    "HEAVY_OPS",
    "LINEAR_MATMUL_OPS",
    "MATMUL_OPS",
    "OP_SAC_SAVE_OPS",
    "op_names",
]

aten = torch.ops.aten


def op_names(ops: Iterable[OpOverload]) -> frozenset[str]:
    """The names traced graphs give these overloads (``str(overload)``)."""
    return frozenset(str(op) for op in ops)


# Matmuls that a Linear layer dispatches to: torchtitan's alternating policy counts these.
LINEAR_MATMUL_OPS = op_names({aten.mm.default, aten.addmm.default})

MATMUL_OPS = LINEAR_MATMUL_OPS | op_names({aten.bmm.default, aten.baddbmm.default})

# Fused attention kernels (the outputs op-SAC saves; Megatron's selective recompute redoes them).
ATTENTION_OPS = op_names(
    {
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_fused_attention_overrideable.default,
        aten._flash_attention_forward.default,
        aten._efficient_attention_forward.default,
    }
)

# Their backward kernels (priced at the attention rate of a calibrated device, like the forward).
ATTENTION_BACKWARD_OPS = op_names(
    {
        aten._scaled_dot_product_flash_attention_backward.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        aten._scaled_dot_product_efficient_attention_backward.default,
        aten._scaled_dot_product_cudnn_attention_backward.default,
        aten._scaled_dot_product_fused_attention_overrideable_backward.default,
        aten._flash_attention_backward.default,
        aten._efficient_attention_backward.default,
    }
)

# The anchors of an attention core: fused attention, or the QK^T and PV batched matmuls and the
# softmax of an unfused one. The core is the run of ops from the first anchor to the last (scale,
# mask and attention dropout included): what Megatron's selective recompute recomputes.
ATTENTION_CORE_OPS = ATTENTION_OPS | op_names(
    {
        aten.bmm.default,
        aten.baddbmm.default,
        aten._softmax.default,
        aten.softmax.int,
        aten._safe_softmax.default,
    }
)

CONV_OPS = op_names(
    {
        aten.convolution.default,
        aten._convolution.default,
        aten.mkldnn_convolution.default,
        aten.cudnn_convolution.default,
    }
)

# Ops whose outputs cost the most time per byte to recompute.
HEAVY_OPS = MATMUL_OPS | CONV_OPS | ATTENTION_OPS

# Ops inductor calls the kernel library for; it fuses the others (pointwise ops, reductions) into
# kernels of its own.
EXTERN_KERNEL_OPS = HEAVY_OPS | ATTENTION_BACKWARD_OPS | op_names({aten.convolution_backward.default})

# torch's op-level SAC as torch.utils.checkpoint documents it and torchtitan's `_op_sac_save_list`:
# save matmul, attention and convolution outputs (and torchtitan's reduce-scatter and amax), recompute
# the rest.
OP_SAC_SAVE_OPS = HEAVY_OPS | op_names({aten.max.default, torch.ops._c10d_functional.reduce_scatter_tensor.default})


_c10d = torch.ops._c10d_functional
# Functional collectives a traced rank runs (tensor parallel's DTensor redistributions), by how many
# ring passes over which tensor they cost: the unsharded tensor is the output of an all-gather, the
# input of a reduce-scatter, an all-reduce or an all-to-all.
COLLECTIVE_OPS: dict[str, tuple[str, int]] = {
    str(_c10d.all_gather_into_tensor.default): ("output", 1),
    str(_c10d.reduce_scatter_tensor.default): ("input", 1),
    str(_c10d.all_reduce.default): ("input", 2),
    str(_c10d.all_to_all_single.default): ("input", 1),
}
