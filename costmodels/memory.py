"""Model-state memory: parameters, gradients, optimizer states and optimizer-step temporaries.

Optimizer state layouts follow torch.optim (AdamW, SGD, Adafactor) and bitsandbytes AdamW8bit;
ZeRO sharding follows DeepSpeed (stage 1: optimizer states, 2: + gradients, 3: + parameters).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Shape = tuple[int, ...]

OPTIMIZERS = ("adamw", "adamw-8bit", "sgd", "adafactor", "none")
STEP_SCALAR_BYTES = 4  # torch.optim keeps state['step'] as a 0-dim float32 tensor
BNB_BLOCK_SIZE = 256  # bitsandbytes blockwise quantisation block (one fp32 absmax per block)
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps 32-bit states for tensors smaller than this


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of a torch dtype (its itemsize)."""
    return dtype.itemsize


_DTYPE_BYTES_NAMES = ("float64", "float32", "bfloat16", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")
"""The torch dtypes in DTYPE_BYTES, by name: the module imports torch only when a dtype is asked for."""


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def __getattr__(name: str) -> Any:  # PEP 562: DTYPE_BYTES, a dict keyed by torch dtypes, built on first use
    if name != "DTYPE_BYTES":
        raise AttributeError(f"module 'costmodels.memory' has no attribute {name!r}")
    table = {_torch_dtype(n): dtype_bytes(_torch_dtype(n)) for n in _DTYPE_BYTES_NAMES}
    globals()[name] = table
    return table


@dataclass(frozen=True)
class Precision:
    """Parameter dtype and optional autocast compute dtype, kept as torch dtype names ("bfloat16")."""

    name: str
    param_dtype_name: str
    autocast_dtype_name: str | None

    @property
    def param_dtype(self) -> torch.dtype:
        return _torch_dtype(self.param_dtype_name)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return None if self.autocast_dtype_name is None else _torch_dtype(self.autocast_dtype_name)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "param_dtype": self.param_dtype_name, "autocast_dtype": self.autocast_dtype_name}


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", "float32", None),
    "bf16": Precision("bf16", "bfloat16", None),
    "bf16-mixed": Precision("bf16-mixed", "float32", "bfloat16"),
    "fp16-mixed": Precision("fp16-mixed", "float32", "float16"),
}


def get_precision(name: str) -> Precision:
    """Look up a precision by name."""
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; choose one of: {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def check_optimizer(name: str) -> str:
    """Return name if it is a known optimizer."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZERS)}")
    return name


def _numel(shape: Sequence[int]) -> int:
    return int(math.prod(shape))


def _adafactor_state_elements(shape: Shape) -> int:
    """torch.optim.Adafactor: row_var (..., r, 1) + col_var (..., 1, c) if ndim >= 2, else full variance."""
    if len(shape) >= 2:
        lead = _numel(shape[:-2])
        return lead * (shape[-2] + shape[-1])
    return _numel(shape)


def optimizer_state_bytes(param_shapes: Sequence[Shape], param_dtype: torch.dtype, optimizer: str) -> int:
    """Total optimizer-state bytes of the unsharded model.

    adamw: exp_avg + exp_avg_sq in param dtype + fp32 step scalar per tensor (torch.optim.AdamW).
    adamw-8bit: two uint8 states + one fp32 absmax per 256-element block per state (bitsandbytes);
      tensors under 4096 elements keep two fp32 states. bnb's step is a Python int (0 bytes).
    sgd: one momentum buffer in param dtype (momentum=0.9 assumed; momentum=0 keeps none).
    adafactor: factored second moment (row + col) for ndim >= 2, full for ndim < 2, no first
      moment (beta1=None), fp32 step scalar (torch.optim.Adafactor).
    """
    check_optimizer(optimizer)
    es = dtype_bytes(param_dtype)
    total = 0
    for shape in param_shapes:
        n = _numel(shape)
        if optimizer == "adamw":
            total += 2 * n * es + STEP_SCALAR_BYTES
        elif optimizer == "adamw-8bit":
            if n < BNB_MIN_8BIT_SIZE:
                total += 2 * n * 4
            else:
                total += 2 * (n + 4 * math.ceil(n / BNB_BLOCK_SIZE))
        elif optimizer == "sgd":
            total += n * es
        elif optimizer == "adafactor":
            total += _adafactor_state_elements(shape) * es + STEP_SCALAR_BYTES
    return total


def _adamw_single_tensor_peak(sizes: Sequence[int]) -> int:
    """_single_tensor_adam: denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps).

    While computing the division for tensor i, sqrt(i), the quotient(i) and the previous
    iteration's denom (still bound to the local) are live: peak = max_i 2*b_i + b_{i-1}.
    """
    peak, prev = 0, 0
    for b in sizes:
        peak = max(peak, 2 * b + prev)
        prev = b
    return peak


def _adafactor_single_tensor_peak(shapes: Sequence[Shape], es: int) -> int:
    """Replays the local-variable lifetimes of torch.optim._adafactor._single_tensor_adafactor.

    Locals that survive across iterations: update (== var_estimate), row_mean, col_mean (ndim >= 2)
    and grad_squared (ndim < 2); each is freed only when rebound. Norm results are 0-dim temporaries.
    """
    cur = peak = 0
    update = row_mean = col_mean = grad_sq = 0

    def bump(extra: int) -> None:
        nonlocal peak
        peak = max(peak, cur + extra)

    for shape in shapes:
        b = _numel(shape) * es
        bump(es)  # param.norm(2)
        if len(shape) >= 2:
            lead = _numel(shape[:-2])
            new_row, new_col = lead * shape[-2] * es, lead * shape[-1] * es
            bump(new_row)
            cur += new_row - row_mean
            row_mean = new_row
            bump(new_col)
            cur += new_col - col_mean
            col_mean = new_col
            cur += b  # var_estimate = row_var @ col_var
            bump(lead * es)  # row_var.mean(dim=-2)
        else:
            bump(b)
            cur += b - grad_sq  # grad_squared = grad * grad
            grad_sq = b
            cur += b  # var_estimate = variance.clone()
            bump(0)
        cur -= update  # update = var_estimate.clamp_().rsqrt_() drops the previous update
        update = b
        bump(es)  # update.norm(2)
    return peak


def _adafactor_foreach_peak(shapes: Sequence[Shape], es: int) -> int:
    """Replays torch.optim._adafactor._multi_tensor_adafactor (one device/dtype).

    Params are grouped by ndim >= 2 in order of first appearance. Per group, the lists row_means,
    col_means (ndim >= 2) or grads_squared (ndim < 2) are freed before var_estimates (one copy of
    the group) is made; row_var_means (prod(leading) elements each) live beside var_estimates. The
    previous group's updates stay bound until `updates = var_estimates` of the next group.
    """
    groups: dict[bool, list[Shape]] = {}
    for shape in shapes:
        groups.setdefault(len(shape) >= 2, []).append(shape)
    peak = prev = 0
    for multidim, group in groups.items():
        size = sum(_numel(s) for s in group) * es
        if multidim:
            leads = [_numel(s[:-2]) for s in group]
            rows = sum(lead * s[-2] for lead, s in zip(leads, group)) * es
            cols = sum(lead * s[-1] for lead, s in zip(leads, group)) * es
            peak = max(peak, prev + max(rows, cols), prev + size + sum(leads) * es)
        else:
            peak = max(peak, prev + size)
        peak = max(peak, size + es)  # update.norm(2) after the previous updates are dropped
        prev = size
    return peak


def optimizer_step_temporary_bytes(
    param_shapes: Sequence[Shape], param_dtype: torch.dtype, optimizer: str, foreach: bool
) -> int:
    """Peak bytes the optimizer step allocates beyond its states (measured on torch 2.13 CPU).

    adamw: single-tensor see _adamw_single_tensor_peak (exact); foreach: _foreach_sqrt over all
      exp_avg_sq of the (device, dtype) group = one copy of all params (then in-place div/add).
    adafactor: single-tensor see _adafactor_single_tensor_peak, foreach see _adafactor_foreach_peak
      (both exact replays; the foreach peak is ~ one copy of all params).
    sgd: 0 (momentum buffer updated in place, both paths).
    adamw-8bit: estimate, one fp32 copy of the largest parameter (dequantised state).
    """
    check_optimizer(optimizer)
    es = dtype_bytes(param_dtype)
    sizes = [_numel(s) * es for s in param_shapes]
    if not sizes or optimizer in ("sgd", "none"):
        return 0
    if optimizer == "adamw-8bit":
        return 4 * max(_numel(s) for s in param_shapes)
    shapes = [tuple(s) for s in param_shapes]
    if optimizer == "adamw":
        return sum(sizes) if foreach else _adamw_single_tensor_peak(sizes)
    if foreach:
        return _adafactor_foreach_peak(shapes, es)
    return _adafactor_single_tensor_peak(shapes, es)


@dataclass(frozen=True)
class ModelStates:
    """Per-device model-state bytes after ZeRO sharding; num_parameters is the unsharded count."""

    num_parameters: int
    parameter: int
    gradient: int
    optimizer: int
    optimizer_step_temporary: int

    @property
    def total(self) -> int:
        return self.parameter + self.gradient + self.optimizer

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def _shard(nbytes: int, dp: int, sharded: bool) -> int:
    return -(-nbytes // dp) if sharded else nbytes


def model_state_bytes(
    param_shapes: Sequence[Shape],
    precision: Precision,
    optimizer: str,
    zero_stage: int = 0,
    dp: int = 1,
    foreach: bool = False,
    trainable_shapes: Sequence[Shape] | None = None,
) -> ModelStates:
    """Parameters and gradients in precision.param_dtype; ZeRO stage k shards by dp (ceil). Only the
    `trainable_shapes` (default: all parameters) have gradients and optimizer states."""
    check_optimizer(optimizer)
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"invalid zero_stage {zero_stage!r}; choose one of: 0, 1, 2, 3")
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"invalid dp {dp!r}; expected an integer >= 1")
    dt = precision.param_dtype
    n = sum(_numel(s) for s in param_shapes)
    param = n * dtype_bytes(dt)
    trained = param_shapes if trainable_shapes is None else trainable_shapes
    grad = sum(_numel(s) for s in trained) * dtype_bytes(dt)
    return ModelStates(
        num_parameters=n,
        parameter=_shard(param, dp, zero_stage >= 3),
        gradient=_shard(grad, dp, zero_stage >= 2),
        optimizer=_shard(optimizer_state_bytes(trained, dt, optimizer), dp, zero_stage >= 1),
        optimizer_step_temporary=_shard(
            optimizer_step_temporary_bytes(trained, dt, optimizer, foreach), dp, zero_stage >= 1
        ),
    )
