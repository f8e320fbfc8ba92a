"""Shard a real model with FSDP2 the way memplan predicts it, and measure one rank's step.

Order, as torchtitan applies activation checkpointing and FSDP: ``planner.apply_plan(model, plan)``
first (it replaces the forward of the modules it names), then :func:`shard_model`, which calls
``fully_shard`` on every block memplan's trace found (a flat-Sequential segment is one grouped
unit) and then on the root. A checkpointed block's recompute runs inside its backward, while
FSDP2 holds its parameters unsharded anyway, so the plan adds no FSDP buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from costmodels.memory import get_precision
from planner.config import TrainConfig
from planner.runtime.tracker import LiveBytesTracker
from planner.runtime.verify import Measurement, make_optimizer, run_training_step, tracked_step
from planner.tracing.blocks import is_segment, segment_children
from planner.tracing.parallel.tp_plans import step_context

__all__ = ["ShardedBytesTracker", "fsdp_kwargs", "measure_sharded_step", "shard_model"]


class ShardedBytesTracker(LiveBytesTracker):
    """Live bytes of one rank: counts a DTensor's local shard, and storages FSDP2 resizes in place.

    FSDP2 frees and re-allocates unsharded parameters with ``UntypedStorage.resize_``, which no
    dispatch mode sees; while tracking, ``resize_`` is wrapped to update the count.
    """

    def track(self, t: torch.Tensor) -> None:
        super().track(t._local_tensor if isinstance(t, DTensor) else t)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        if self._resize(id(storage), storage.nbytes()):
            self.sample()

    def __enter__(self):
        original = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int):
            out = original(storage, size)
            self._resized(storage)
            return out

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        return super().__exit__(*exc)


def fsdp_kwargs(config: TrainConfig) -> dict:
    """``fully_shard`` keyword arguments for a config: reshard_after_forward, mp_policy, offload_policy."""
    kwargs: dict = {"reshard_after_forward": config.reshard_after_forward}
    param_dtype = get_precision(config.precision).autocast_dtype
    reduce_dtype = getattr(torch, config.mp_reduce_dtype) if config.mp_reduce_dtype else None
    if param_dtype is not None or reduce_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if config.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    return kwargs


def shard_model(model: nn.Module, unit_paths: Sequence[str], config: TrainConfig, **extra) -> nn.Module:
    """``fully_shard`` each unit (a module path or a PARENT.I:J segment), then the root; `extra`
    goes to every call (a ``mesh``, say)."""
    kwargs = {**fsdp_kwargs(config), **extra}
    for path in unit_paths:
        if is_segment(path):
            fully_shard([model.get_submodule(c) for c in segment_children(model, path)], **kwargs)
        else:
            fully_shard(model.get_submodule(path), **kwargs)
    fully_shard(model, **kwargs)
    return model


def _step(model: nn.Module, inputs, optimizer, grad_accum_steps: int) -> torch.Tensor:
    """:func:`run_training_step` without autocast (a sharded model computes in its own dtypes and
    FSDP2's mixed-precision policy), then the gradients cleared."""
    loss = run_training_step(model, inputs, optimizer, "fp32", grad_accum_steps)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    return loss


def measure_sharded_step(
    model: nn.Module, inputs, config: TrainConfig, steps: int = 5, tracker: type[LiveBytesTracker] = ShardedBytesTracker
) -> Measurement:
    """This rank's peak live bytes over a steady-state step of a sharded model (after a warm-up).

    Gloo's worker thread can drop its reference to a collective's buffer a moment after the call
    returns, which now and then adds one block's buffer to a step; the lowest of `steps` measured
    steps is the step without that race. `tracker` is the class that counts a step's live bytes.
    """
    optimizer = make_optimizer(model.parameters(), config.optimizer)
    model.train()
    accum = config.grad_accum_steps
    with step_context(config):
        _step(model, inputs, optimizer, accum)
        runs = [
            tracked_step(tracker(), model, inputs, optimizer, lambda: _step(model, inputs, optimizer, accum))
            for _ in range(steps)
        ]
    return min(runs, key=lambda m: m.peak_bytes)
