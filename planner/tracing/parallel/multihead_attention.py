"""``nn.MultiheadAttention`` under tensor parallel (torch's ``nn.TransformerEncoderLayer``,
torchvision's ViT): each rank computes its share of the heads.

torch's module keeps q, k and v in one parameter (``in_proj_weight``, rows ``[q | k | v]``) and
calls ``F.multi_head_attention_forward`` with its output projection's weight, so neither
``ColwiseParallel`` nor ``RowwiseParallel`` can reach them. :class:`MultiheadAttentionParallel`
shards ``in_proj_weight`` per section (rank-major, as a fused q/k/v projection,
projection_styles.py) and the output projection on its input features, and runs the attention
itself: the in-projection column-parallel (the input replicated, its gradient all-reduced), the
rank's heads through ``scaled_dot_product_attention``, the output projection row-parallel (its
partial sums all-reduced), as ``F.multi_head_attention_forward`` computes them for
``need_weights=False``.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from planner.errors import SpecError
from planner.tracing.parallel.projection_styles import ColwiseProjection, rank_heads

__all__ = ["MultiheadAttentionParallel", "check_multihead_attention"]


def check_multihead_attention(module: nn.MultiheadAttention, where: str) -> None:
    """One-line error where the module's layout is one this style does not shard."""
    if not module._qkv_same_embed_dim or module.bias_k is not None:
        raise SpecError(
            f"{where} is an nn.MultiheadAttention with separate key/value widths or add_bias_kv, which --tp-plan "
            "auto does not shard; pass --tp-plan PATH.py:FUNC with your own plan"
        )


class MultiheadAttentionParallel(ParallelStyle):
    """``nn.MultiheadAttention`` computing the rank's heads (see the module docstring)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # its own parameters are in_proj_weight / in_proj_bias: a fused [q | k | v] projection's
        ColwiseProjection(sections=3)._partition_projection_fn("", module, device_mesh)
        RowwiseParallel()._partition_linear_fn("out_proj", module.out_proj, device_mesh)
        module.forward = partial(_forward, module, device_mesh, module.num_heads // device_mesh.size())
        return module


def _forward(
    module: nn.MultiheadAttention,
    device_mesh: DeviceMesh,
    local_heads: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, None]:
    if need_weights:
        raise SpecError(
            "an nn.MultiheadAttention under tensor parallel returns no attention weights (each rank holds a share "
            "of the heads); call it with need_weights=False, or pass --tp-plan PATH.py:FUNC with your own plan"
        )
    packed = query is key and key is value  # self-attention: one projection, as torch's packed path
    if module.batch_first:
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))
    target, batch, _ = query.shape
    source = key.shape[0]
    q, k, v = _in_projection(module, device_mesh, (query,) if packed else (query, key, value))
    head_dim = q.shape[-1] // local_heads
    q, k, v = (x.reshape(x.shape[0], batch, local_heads, head_dim).permute(1, 2, 0, 3) for x in (q, k, v))
    mask = _rank_mask(attn_mask, key_padding_mask, q.dtype, batch, module.num_heads, device_mesh, target, source)
    dropout = module.dropout if module.training else 0.0
    attended = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal and mask is None
    )
    attended = attended.permute(2, 0, 1, 3).reshape(target, batch, local_heads * head_dim)
    out = module.out_proj
    partial_sums = DTensor.from_local(attended, device_mesh, (Shard(-1),), run_check=False)
    output = F.linear(partial_sums, out.weight, out.bias).redistribute(placements=(Replicate(),)).to_local()
    return (output.transpose(0, 1) if module.batch_first else output), None


def _in_projection(
    module: nn.MultiheadAttention, device_mesh: DeviceMesh, inputs: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """The rank's q, k and v: its rows of ``in_proj_weight`` (its q, k and v shares, in order)
    applied to the replicated input (one for self-attention), whose gradients DTensor all-reduces."""
    replicated = [DTensor.from_local(x, device_mesh, (Replicate(),), run_check=False) for x in inputs]
    weight, bias = module.in_proj_weight, module.in_proj_bias
    if len(inputs) == 1:
        return F.linear(replicated[0], weight, bias).to_local().chunk(3, dim=-1)
    weights = _local_sections(weight, device_mesh)
    biases = _local_sections(bias, device_mesh) if bias is not None else (None, None, None)
    return tuple(F.linear(x, w, b).to_local() for x, w, b in zip(replicated, weights, biases))


def _local_sections(param: DTensor, device_mesh: DeviceMesh) -> tuple[DTensor, ...]:
    """The q, k and v parameters of a rank-major ``[q | k | v]`` parameter, each sharded on dim 0."""
    return tuple(DTensor.from_local(x, device_mesh, (Shard(0),), run_check=False) for x in param.to_local().chunk(3))


def _rank_mask(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    dtype: torch.dtype,
    batch: int,
    heads: int,
    device_mesh: DeviceMesh,
    target: int,
    source: int,
) -> torch.Tensor | None:
    """The additive float mask (batch, rank's heads or 1, target, source) that ``attn_mask`` (2-D, or
    3-D per batch and head) and ``key_padding_mask`` (batch, source) make, as torch merges them."""
    masks = []
    if attn_mask is not None:
        mask = _additive(attn_mask, dtype)
        if mask.dim() == 3:  # (batch x heads, target, source)
            rank = device_mesh.get_local_rank()
            mask = rank_heads(mask, heads, device_mesh.size(), rank, batch_folded=True).view(batch, -1, target, source)
        masks.append(mask)
    if key_padding_mask is not None:
        masks.append(_additive(key_padding_mask, dtype).view(batch, 1, 1, source))
    if not masks:
        return None
    return masks[0] if len(masks) == 1 else masks[0] + masks[1]


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: not attended) as an additive float mask; a float mask as it is."""
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)
