"""FLOP and byte counts of single aten op calls.

Matmul/conv/attention FLOPs come from ``torch.utils.flop_counter.flop_registry`` (the formulas
``FlopCounterMode`` uses, keyed by OpOverloadPacket and called with ``out_val=``). Every other op
producing a floating tensor is estimated at 1 FLOP per output element (elementwise/reduction).
Views, aliases, factories, fills and pure copies count 0 FLOPs (they only move/describe bytes).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from memplan_compat import tree_flatten

# Ops that produce data without arithmetic: factories, fills and copies (name of the packet).
_ZERO_FLOP_NAMES = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "zeros",
        "zeros_like",
        "new_zeros",
        "ones",
        "ones_like",
        "new_ones",
        "full",
        "full_like",
        "new_full",
        "fill",
        "fill_",
        "zero",
        "zero_",
        "scalar_tensor",
        "arange",
        "linspace",
        "logspace",
        "eye",
        "tensor",
        "copy",
        "copy_",
        "_to_copy",
        "clone",
        "contiguous",
        "to",
        "_copy_from",
        "_copy_from_and_resize",
        "lift_fresh",
        "lift_fresh_copy",
        "detach_copy",
        "view_copy",
        "_unsafe_view",
        "reshape",
        "resize_",
        "set_",
        "index_select",
        "cat",
        "stack",
        "gather",
        "scatter",
        "embedding",
        "_local_scalar_dense",
    }
)


def _is_view(func: Any) -> bool:
    """True when the schema says some output aliases an input without writing (a view)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _numel(t: torch.Tensor) -> int:
    return int(math.prod(int(s) for s in t.shape))


def _float_output_elements(out: Any) -> int:
    return sum(
        _numel(t)
        for t in tree_flatten(out)[0]
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    )


def _cpu_flash_attention_flops(name: str, args: Any) -> int | None:
    """CPU flash attention (the path fake CPU tensors take) is missing from torch's FLOP table:
    forward is two batched matmuls of 2*b*h*s_q*s_kv*d FLOPs each, backward five (as the CUDA
    flash kernels are counted by FlopCounterMode)."""
    if name == "_scaled_dot_product_flash_attention_for_cpu":
        q, k = args[0], args[1]
        factor = 2
    elif name == "_scaled_dot_product_flash_attention_for_cpu_backward":
        q, k = args[1], args[2]
        factor = 5
    else:
        return None
    b, h, s_q, d = (int(x) for x in q.shape)
    s_kv = int(k.shape[-2])
    return factor * 2 * b * h * s_q * s_kv * d


def op_flops(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """FLOPs of one aten op call; never raises (falls back to the output-elements rule)."""
    try:
        packet = getattr(func, "overloadpacket", func)
        attention = _cpu_flash_attention_flops(getattr(packet, "__name__", "").split(".")[-1], args)
        if attention is not None:
            return attention
        formula = flop_registry.get(packet)
        if formula is not None:
            return int(formula(*(args or ()), **(kwargs or {}), out_val=out))
        name = getattr(packet, "__name__", "") or ""
        if _is_view(func) or name.split(".")[-1] in _ZERO_FLOP_NAMES:
            return 0
        tensor_inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if not tensor_inputs:  # factory (randn, rand, ...) without inputs to compute on
            return 0
    except Exception:
        pass
    try:
        return _float_output_elements(out)
    except Exception:
        return 0


def op_bytes_accessed(args: Any, out: Any) -> int:
    """Bytes of tensor inputs plus outputs (each tensor object counted once), for a roofline."""
    total = 0
    seen: set[int] = set()
    for t in tree_flatten((args, out))[0]:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            try:
                total += _numel(t) * t.element_size()
            except Exception:
                continue
    return total
