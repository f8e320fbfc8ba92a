"""Which scaled-dot-product-attention kernel a target device runs for a call.

memplan traces on fake CPU tensors, where `F.scaled_dot_product_attention` picks what a CPU
picks: its flash kernel when q, k and v share a head size, else the math fallback that
materialises the s x s scores. A GPU picks differently (DeepSeek-V3's MLA, q/k 192 and v 128, runs
memory-efficient attention there), and what autograd saves follows the kernel. :func:`sdpa_kernel`
says which kernel `device` runs; tracing then calls that kernel's aten op.

Source: PyTorch's ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (``priority_order``,
``check_prefer_cudnn_attention``, ``can_use_flash_attention``, ``can_use_mem_efficient_attention``,
``can_use_cudnn_attention``, ``select_sdp_backend``) and the shared checks of ``sdp_utils_cpp.h``,
read at pytorch commit 001f694a (memplan runs torch 2.13, git cf30153c, whose CPU wheel ships no
CUDA source to diff against), and ``attention.cpp`` for what each kernel is called with. On CUDA:

- order: flash, memory-efficient, math, cuDNN; cuDNN first on sm90/sm10x with a cuDNN runtime
  newer than 9.15.0 (``check_prefer_cudnn_attention``). The presets leave the cuDNN version
  unknown (0), so cuDNN is never chosen; a calibrated profile records the real one.
- flash: sm80-sm121; fp16/bf16; no attn_mask; q, k, v head sizes equal and <= 256; causal only
  with s_q == s_k; with grad on sm86-89/sm120-121 head size <= 192 (or > 224 without dropout);
  grouped-query (enable_gqa) when q heads are a multiple of the shared k/v heads; last-dim stride 1.
- memory-efficient: sm50-sm121; fp16/bf16/fp32 (fp16/fp32 below sm80); q and k head sizes
  equal, q and v head sizes multiples of the GEMM alignment (8 for fp16/bf16 from sm80, 4 for
  fp32), no upper limit; storage offsets aligned to it; masks, dropout and grouped-query allowed.
- cuDNN: sm80-sm121; fp16/bf16; dropout a multiple of 1/16 (none on cuDNN 9.11-9.13); mask shape
  (L, S) or (B|1, H|1, L|1, S|1); batch and heads <= 65535; head sizes multiples of 8 and <= 128
  (256 on sm90/sm10x from cuDNN 9.22, 192/128 exactly from 9.11); with grad on those: q/k and v
  <= 128, 192/128 or 256/256; s_k != 1.
- math: everything else (3-D inputs, misaligned or mismatched head sizes).
ROCm (arch "gfx...", AOTriton >= 0.12): flash as above with head sizes up to 512;
memory-efficient with q and k head sizes equal, q and v up to 512 and multiples of 8 (4 in fp32),
no grouped-query; no cuDNN. A CPU target keeps what CPU torch does (:data:`NATIVE`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from costmodels.hardware import DeviceSpec

__all__ = ["CUDNN", "EFFICIENT", "FLASH", "HOST_OUTPUTS", "MATH", "NATIVE", "SdpaCall", "sdpa_kernel"]

FLASH = "flash"
EFFICIENT = "efficient"
CUDNN = "cudnn"
MATH = "math"
NATIVE = "native"  # the tracing CPU's own choice: the target is a CPU

_HALF = (torch.float16, torch.bfloat16)

HOST_OUTPUTS: dict[str, tuple[int, ...]] = {
    "aten._scaled_dot_product_flash_attention.default": (6, 7),
    "aten._scaled_dot_product_efficient_attention.default": (2, 3),
    "aten._scaled_dot_product_cudnn_attention.default": (6, 7),
}
"""Outputs of the fused GPU kernels that take no device memory, by position: the philox seed and
offset, empty host tensors without dropout (``_efficient_attention_forward`` in attention.cu,
``mha_fwd`` in flash_api.cpp) and a few bytes with it; their meta kernels allocate them."""


@dataclass(frozen=True)
class SdpaCall:
    """What the kernel choice reads from one `scaled_dot_product_attention` call."""

    query_shape: tuple[int, ...]
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]
    mask_shape: tuple[int, ...] | None = None  # None: no attn_mask
    mask_requires_grad: bool = False
    dropout_p: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False
    requires_grad: bool = False  # some input needs grad and grad mode is on
    last_dim_strides: tuple[int, int, int] = (1, 1, 1)
    storage_offsets: tuple[int, int, int] = (0, 0, 0)  # elements

    @property
    def head_dims(self) -> tuple[int, int, int]:
        return self.query_shape[-1], self.key_shape[-1], self.value_shape[-1]


def _sm(arch: str) -> tuple[int, int]:
    """(major, minor) of an "smXY" / "smXYZ" arch ("sm90" -> (9, 0), "sm120" -> (12, 0))."""
    digits = arch[2:]
    return int(digits[:-1]), int(digits[-1])


def _in_sm(sm: tuple[int, int], low: tuple[int, int], high: tuple[int, int]) -> bool:
    return low <= sm <= high


def _dense_4d(c: SdpaCall) -> bool:
    shapes = (c.query_shape, c.key_shape, c.value_shape)
    if any(len(s) != 4 for s in shapes):
        return False
    return c.query_shape[-2] > 0 and c.key_shape[-2] > 0  # check_nonzero_sequence_lengths_dense


def _heads_ok(c: SdpaCall, supports_gqa: bool) -> bool:
    """check_batch_size_and_num_heads_dense: equal batch; equal heads, or grouped-query heads."""
    (bq, hq), (bk, hk), (bv, hv) = c.query_shape[:2], c.key_shape[:2], c.value_shape[:2]
    if not bq == bk == bv:
        return False
    if c.enable_gqa and supports_gqa:
        return hk == hv and hq % hk == 0
    return hq == hk == hv


def _same_dtype(c: SdpaCall, allowed: tuple[torch.dtype, ...]) -> bool:
    return c.dtypes[0] == c.dtypes[1] == c.dtypes[2] and c.dtypes[0] in allowed


def _mask_shape_ok(c: SdpaCall) -> bool:
    """check_attn_mask_shape (cuDNN)."""
    if c.mask_shape is None:
        return True
    if c.mask_requires_grad:
        return False
    m, (b, h, s_q, _), s_k = c.mask_shape, c.query_shape, c.key_shape[2]
    if m[-2] not in (s_q, 1) or m[-1] not in (s_k, 1):
        return False
    return len(m) == 2 or (len(m) == 4 and m[0] in (1, b) and m[1] in (1, h))


def _can_flash_cuda(c: SdpaCall, sm: tuple[int, int]) -> bool:
    d_q, d_k, d_v = c.head_dims
    if c.mask_shape is not None or not (d_q == d_k == d_v and d_q <= 256):
        return False
    if not _in_sm(sm, (8, 0), (12, 1)):
        return False
    if c.requires_grad and (_in_sm(sm, (8, 6), (8, 9)) or _in_sm(sm, (12, 0), (12, 1))):
        if not (d_q <= 192 or (c.dropout_p == 0.0 and d_q > 224)):
            return False
    if c.is_causal and c.query_shape[2] != c.key_shape[2]:
        return False
    if not _same_dtype(c, _HALF) or not _heads_ok(c, supports_gqa=True):
        return False
    return all(s == 1 for s in c.last_dim_strides) or d_q == 1


def _gemm_alignment(c: SdpaCall, sm: tuple[int, int]) -> int:
    """minimum_gemm_alignment: elements a memory-efficient GEMM needs its rows aligned to."""
    half = c.dtypes[0] in _HALF
    tensor_cores = sm[0] >= 8 or (sm[0] >= 7 and half)
    alignment = 4 if sm[0] >= 8 else 1
    return max(alignment, 128 // (16 if half else 32)) if tensor_cores else alignment


def _can_efficient_cuda(c: SdpaCall, sm: tuple[int, int]) -> bool:
    if not _in_sm(sm, (5, 0), (12, 1)):
        return False
    d_q, d_k, d_v = c.head_dims
    align = _gemm_alignment(c, sm)
    if not (d_q == d_k and d_q % align == 0 and d_v % align == 0 and d_q > 0 and d_v > 0):
        return False
    if sm[0] >= 8 and any(offset % align for offset in c.storage_offsets):
        return False
    if not all(s == 1 for s in c.last_dim_strides) or not _heads_ok(c, supports_gqa=True):
        return False
    allowed = (torch.float16, torch.float32, torch.bfloat16) if sm[0] >= 8 else (torch.float16, torch.float32)
    return _same_dtype(c, allowed)


def _cudnn_head_dim_limit(c: SdpaCall, sm: tuple[int, int], version: int) -> int:
    sm90_or_10x = sm == (9, 0) or sm[0] == 10
    unsupported_sm107 = sm == (10, 7) and version <= 92500
    d_q, _, d_v = c.head_dims
    if sm90_or_10x and not unsupported_sm107 and version > 92200:
        return 256
    if sm90_or_10x and version >= 91100 and (d_q, d_v) == (192, 128):
        return 192
    return 128


def _can_cudnn(c: SdpaCall, sm: tuple[int, int], version: int) -> bool:
    if version < 90000 or (c.dropout_p > 0.0 and 91100 < version < 91400):
        return False
    if not _same_dtype(c, _HALF) or not _mask_shape_ok(c) or not _in_sm(sm, (8, 0), (12, 1)):
        return False
    if c.dropout_p * 16.0 != math.floor(c.dropout_p * 16.0):
        return False
    if not _heads_ok(c, supports_gqa=True) or not (all(s == 1 for s in c.last_dim_strides) or c.head_dims[0] == 1):
        return False
    b, h, s_q, d_q = c.query_shape
    s_k, d_v = c.key_shape[2], c.value_shape[3]
    if b > 65535 or h > 65535 or s_k == 1 or (c.dropout_p != 0.0 and s_q == 1):
        return False
    limit = _cudnn_head_dim_limit(c, sm, version)
    if d_q > limit or d_v > limit or d_q % 8 or d_v % 8:
        return False
    if c.requires_grad and limit == 256:  # check_cudnn_d256_bprop_head_dim
        return (d_q <= 128 and d_v <= 128) or (d_q, d_v) in ((192, 128), (256, 256))
    return True


def _rocm_kernel(c: SdpaCall) -> str:
    """ROCm with AOTriton >= 0.12: flash and memory-efficient both up to head size 512."""
    d_q, d_k, d_v = c.head_dims
    causal_ok = not c.is_causal or c.query_shape[2] == c.key_shape[2]
    flash_dims = d_q == d_k == d_v and d_q <= 512
    if c.mask_shape is None and flash_dims and causal_ok and _same_dtype(c, _HALF) and _heads_ok(c, True):
        return FLASH
    align = 8 if c.dtypes[0] in _HALF else 4
    aligned = d_q == d_k and 0 < d_q <= 512 and 0 < d_v <= 512 and d_q % align == 0 and d_v % align == 0
    if aligned and all(s == 1 for s in c.last_dim_strides) and _heads_ok(c, supports_gqa=False):
        if _same_dtype(c, (torch.float16, torch.float32, torch.bfloat16)):
            return EFFICIENT
    return MATH


def sdpa_kernel(device: DeviceSpec, call: SdpaCall) -> str:
    """The kernel `device` runs for `call`: FLASH, EFFICIENT, CUDNN, MATH, or NATIVE on a CPU
    target (CPU torch's own choice). A CUDA device of unknown arch is taken as sm80."""
    if not device.is_cuda:
        return NATIVE
    if not _dense_4d(call):
        return MATH
    arch = device.arch or "sm80"
    if arch.startswith("gfx"):
        return _rocm_kernel(call)
    sm = _sm(arch)
    version = device.cudnn_version
    prefer_cudnn = version > 91500 and sm[0] in (9, 10)
    checks = {
        CUDNN: lambda: _can_cudnn(call, sm, version),
        FLASH: lambda: _can_flash_cuda(call, sm),
        EFFICIENT: lambda: _can_efficient_cuda(call, sm),
        MATH: lambda: True,
    }
    order = (CUDNN, FLASH, EFFICIENT, MATH) if prefer_cudnn else (FLASH, EFFICIENT, MATH)
    return next(kernel for kernel in order if checks[kernel]())
