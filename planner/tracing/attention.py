"""Scaled-dot-product attention as the target device runs it, on fake CPU tensors.

On fake CPU tensors `F.scaled_dot_product_attention` takes the CPU's kernel: its flash kernel, or
the math fallback (the s x s scores saved for backward) where the CPU flash kernel does not apply,
e.g. a value head size unlike the query's (DeepSeek-V3's MLA). While a :class:`TargetAttention`
is active, every SDPA call runs the aten op of the kernel the target GPU picks
(:func:`costmodels.attention.sdpa_kernel`), prepared as ATen's `scaled_dot_product_attention`
prepares it (``attention.cpp``: boolean masks made additive, a memory-efficient mask expanded and
its last dimension padded to 16, flash head sizes padded to 8), so the trace records the
kernel's own outputs (output, logsumexp) and autograd saves what it saves on the GPU. Their meta
kernels run on fake tensors; a CPU target gets no mode at all.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from costmodels.attention import CUDNN, EFFICIENT, FLASH, MATH, SdpaCall, sdpa_kernel
from costmodels.hardware import DeviceSpec

__all__ = ["TargetAttention"]

aten = torch.ops.aten
_SDPA = F.scaled_dot_product_attention
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _call_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, a: dict) -> SdpaCall:
    qkv = (q, k, v)
    return SdpaCall(
        query_shape=tuple(int(d) for d in q.shape),
        key_shape=tuple(int(d) for d in k.shape),
        value_shape=tuple(int(d) for d in v.shape),
        dtypes=(q.dtype, k.dtype, v.dtype),
        mask_shape=None if mask is None else tuple(int(d) for d in mask.shape),
        mask_requires_grad=mask is not None and mask.requires_grad,
        dropout_p=float(a["dropout_p"]),
        is_causal=bool(a["is_causal"]),
        enable_gqa=bool(a["enable_gqa"]),
        requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in qkv),
        last_dim_strides=tuple(int(t.stride(-1)) if t.dim() else 1 for t in qkv),
        storage_offsets=tuple(int(t.storage_offset()) for t in qkv),
    )


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """convert_boolean_attn_mask: a boolean mask (True attends) becomes 0 / -inf in `dtype`."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    minus_inf = torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device)
    return torch.where(mask.logical_not(), minus_inf, torch.scalar_tensor(0.0, dtype=dtype, device=mask.device))


def _efficient_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """preprocess_mask: expanded to (b, h, s_q, s_kv); last dimension padded to 16 (then sliced
    back), or made contiguous when a stride is not a multiple of 16."""
    mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    last = int(mask.shape[-1])
    if last % 16:
        return F.pad(mask, (0, 16 - last % 16))[..., :last]
    if any(int(s) % 16 for s in mask.stride()[:3]):
        return mask.contiguous()
    return mask


def _pad_to_8(t: torch.Tensor) -> torch.Tensor:
    d = int(t.shape[-1])
    return t if d % 8 == 0 else F.pad(t, (0, 8 - d % 8))


def _repeat_heads(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Grouped-query key/value repeated to the query's heads, as the math path repeats them: the
    memory-efficient op's backward (its meta kernel) returns key/value grads with the query's
    heads, so it cannot take fewer; a kernel broadcasting the heads would save less (bounded
    above here)."""
    groups = int(q.shape[-3]) // int(t.shape[-3])
    return t if groups == 1 else t.repeat_interleave(groups, dim=-3)


def _autocast(tensors: list[Any]) -> list[Any]:
    """CPU autocast casts SDPA's floating inputs to its dtype (the op runs below autocast here)."""
    if not torch.is_autocast_enabled("cpu"):
        return tensors
    dtype = torch.get_autocast_dtype("cpu")
    return [
        t.to(dtype)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in (dtype, torch.float64)
        else t
        for t in tensors
    ]


def target_sdpa(device: DeviceSpec, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`F.scaled_dot_product_attention(*args, **kwargs)` through the kernel `device` picks."""
    a = {**_DEFAULTS, **dict(zip(_PARAMS, args)), **kwargs}
    q, k, v, mask = _autocast([a["query"], a["key"], a["value"], a["attn_mask"]])
    kernel = sdpa_kernel(device, _call_of(q, k, v, mask, a))
    dropout_p, is_causal, scale = float(a["dropout_p"]), bool(a["is_causal"]), a["scale"]
    needs_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if kernel == FLASH:
        head_dim = int(q.shape[-1])
        scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        out = aten._scaled_dot_product_flash_attention(
            _pad_to_8(q), _pad_to_8(k), _pad_to_8(v), dropout_p, is_causal, False, scale=scale
        )[0]
        return out if int(out.shape[-1]) == head_dim else out[..., :head_dim]
    mask = _additive(mask, q.dtype)
    if kernel == EFFICIENT:
        mask = None if mask is None else _efficient_mask(mask, q, k)
        k, v = _repeat_heads(k, q), _repeat_heads(v, q)
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, needs_lse, dropout_p, is_causal, scale=scale
        )[0]
    if kernel == CUDNN:
        return aten._scaled_dot_product_cudnn_attention(
            q, k, v, mask, needs_lse, dropout_p, is_causal, False, scale=scale
        )[0]
    assert kernel == MATH, kernel
    return aten._scaled_dot_product_attention_math(
        q, k, v, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=bool(a["enable_gqa"])
    )[0]


class TargetAttention(TorchFunctionMode):
    """While active, `F.scaled_dot_product_attention` runs the kernel a CUDA `device` runs."""

    def __init__(self, device: DeviceSpec) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return target_sdpa(self.device, *args, **kwargs)
        return func(*args, **kwargs)
