"""Run a real training step on this machine and measure the peak of live tensor bytes.

The measurement does not use the trace or the simulator: a dispatch mode counts each storage
an op creates and a weakref finalizer subtracts it when CPython frees it; everything that exists
before the step (parameters, buffers, optimizer states, inputs) is counted up front.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
from torch import nn

from costmodels.memory import get_precision
from planner.config import TrainConfig
from planner.runtime.tracker import LiveBytesTracker
from planner.tracing.recorder import loss_of, run_step_inputs

__all__ = [
    "Measurement",
    "make_optimizer",
    "measure_step",
    "run_training_step",
    "track_step_start",
    "tracked_step",
    "warmed_up",
]


@dataclass(frozen=True)
class Measurement:
    """Peak of live tensor bytes over one measured step (after a warm-up step)."""

    peak_bytes: int
    start_bytes: int
    loss: float

    def to_dict(self) -> dict:
        return asdict(self)


def make_optimizer(params, name: str) -> torch.optim.Optimizer | None:
    """The torch optimizer memplan's accounting describes (CPU, single-tensor path)."""
    params = [p for p in params if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=False)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-3, foreach=False)
    if name == "none":
        return None
    raise ValueError(f"optimizer '{name}' cannot run on this machine; verify with adamw, sgd, adafactor or none")


def run_training_step(model: nn.Module, inputs, optimizer, precision: str, grad_accum_steps: int = 1) -> torch.Tensor:
    """One training step as memplan measures it: `grad_accum_steps` forwards and backwards of
    `inputs` (their gradients accumulate, each loss scaled by 1/steps), then the optimizer step;
    returns the last micro-batch's loss."""
    autocast_dtype = get_precision(precision).autocast_dtype
    for _ in range(grad_accum_steps):
        ctx = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None else nullcontext()
        with ctx:
            loss = loss_of(run_step_inputs(model, inputs))
        (loss / grad_accum_steps if grad_accum_steps > 1 else loss).backward()
    if optimizer is not None:
        optimizer.step()
    return loss


def warmed_up(model: nn.Module, inputs, config: TrainConfig) -> torch.optim.Optimizer | None:
    """Run one training step (it creates the optimizer's states, and compiles compiled blocks) and
    clear the gradients, so the next step is a steady one; returns the optimizer."""
    optimizer = make_optimizer(model.parameters(), config.optimizer)
    model.train()
    for p in model.parameters():
        p.grad = None
    run_training_step(model, inputs, optimizer, config.precision, config.grad_accum_steps)
    for p in model.parameters():
        p.grad = None
    return optimizer


def track_step_start(tracker: LiveBytesTracker, model: nn.Module, inputs, optimizer) -> int:
    """Track what is live when a step starts (parameters, buffers, inputs, optimizer states); its bytes."""
    tracker.track_all(
        [
            list(model.parameters()),
            list(model.buffers()),
            inputs,
            optimizer.state_dict()["state"] if optimizer is not None else [],
        ]
    )
    return tracker.live_bytes


def measure_step(model: nn.Module, inputs, config: TrainConfig) -> Measurement:
    """Warm up one step, then measure the peak live bytes of a second, steady-state step."""
    optimizer = warmed_up(model, inputs, config)
    return tracked_step(
        LiveBytesTracker(),
        model,
        inputs,
        optimizer,
        lambda: run_training_step(model, inputs, optimizer, config.precision, config.grad_accum_steps),
    )


def tracked_step(
    tracker: LiveBytesTracker, model: nn.Module, inputs, optimizer, run: Callable[[], torch.Tensor]
) -> Measurement:
    """Peak live bytes of one step `run()` under `tracker`, with the model's parameters and buffers,
    the inputs and the optimizer's states live from the start."""
    start = track_step_start(tracker, model, inputs, optimizer)
    with tracker:
        loss = run()
        tracker.sample()
    return Measurement(peak_bytes=tracker.peak_bytes, start_bytes=start, loss=float(loss.detach()))
