"""Compile each block with its own `activation_memory_budget` (torch.compile's min-cut partitioner).

The partitioner reads `torch._functorch.config.activation_memory_budget` when it compiles a graph,
and Dynamo caches compiled code per code object, so blocks of one class would share the first
block's split. Each distinct budget therefore gets its own copy of a small trampoline function
(its own code object, so its own cache entry), compiled while that budget is set; blocks with the
same budget share it.

memplan's LiveBytesTracker does not see the buffers inductor's generated code allocates, so the
peak of a compiled step is measured from the profiler's memory events instead.

Shapes are static: blocks of one class but different shapes (a ResNet's stages) share a budget's
code object, and Dynamo's automatic dynamic shapes would otherwise recompile them with symbolic
sizes, whose kernels ran 25% slower here. Each block shape is then one cache entry, so the recompile
limit is raised to the number of blocks while they run.

Inductor's layout per module (blocks contiguous, a whole model as torch lays it out unless oneDNN
would get a gradient wrong) is planner.tracing.inductor_layout's rule, shared with the planner.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from memplan_compat import ProfilerMemoryAction as Action
from memplan_compat import dynamo_config, functorch_config, inductor_config
from planner.config import TrainConfig
from planner.runtime.tracker import LiveBytesTracker
from planner.runtime.verify import Measurement, run_training_step, track_step_start, warmed_up
from planner.tracing.hf import disable_kv_cache
from planner.tracing.inductor_layout import inductor_options

__all__ = [
    "CompiledBlocks",
    "budget_trampoline",
    "compile_blocks",
    "measure_compiled_step",
    "profiled_peak_bytes",
    "profiled_step",
]


def _trampoline(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return forward(*args, **kwargs)


def budget_trampoline(budget: float) -> Callable[..., Any]:
    """`f(forward, *args, **kwargs) -> forward(*args, **kwargs)`, with a code object of its own for
    this budget: Dynamo caches what it compiles apart from other budgets' code."""
    code = _trampoline.__code__.replace(co_name=f"block_budget_{round(budget * 1000)}")
    return types.FunctionType(code, _trampoline.__globals__, code.co_name)


class CompiledBlocks:
    """Blocks running compiled at their budgets; remove() restores their eager forwards."""

    def __init__(self, restore_use_cache: list[tuple[object, bool]], recompile_limit: int) -> None:
        self.recompile_limit = recompile_limit  # graphs per budget: one per block shape at most
        self._restore: list[tuple[nn.Module, Any]] = []
        self._restore_use_cache = restore_use_cache  # HF configs whose use_cache was on

    def install(self, module: nn.Module, path: str, budget: float, compiled: Callable[..., Any]) -> None:
        original, options = module.forward, inductor_options(path, module)

        def forward(*args: Any, **kwargs: Any) -> Any:
            with (
                functorch_config.patch(activation_memory_budget=budget),
                inductor_config.patch(options),
                dynamo_config.patch(recompile_limit=self.recompile_limit),
            ):
                return compiled(original, *args, **kwargs)

        self._restore.append((module, module.__dict__.get("forward")))
        module.forward = forward

    def remove(self) -> None:
        for module, previous in reversed(self._restore):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        self._restore.clear()
        for config, use_cache in self._restore_use_cache:
            config.use_cache = use_cache
        self._restore_use_cache = []


def compile_blocks(model: nn.Module, budgets: Mapping[str, float], backend: str = "inductor") -> CompiledBlocks:
    """Run each block (module path -> budget in [0, 1]) compiled with its own activation budget.
    A Hugging Face model's key/value cache is off meanwhile, as memplan planned the step."""
    for path, budget in budgets.items():
        if not 0.0 <= budget <= 1.0:
            raise ValueError(f"activation budget {budget} for '{path}' is outside [0, 1]; use a fraction")
    compiled: dict[float, Callable[..., Any]] = {}
    handle = CompiledBlocks(disable_kv_cache(model), max(dynamo_config.recompile_limit, len(budgets)))
    for path, budget in budgets.items():
        if budget not in compiled:
            compiled[budget] = torch.compile(budget_trampoline(budget), backend=backend, dynamic=False)
        handle.install(model.get_submodule(path), path, budget, compiled[budget])
    return handle


def profiled_peak_bytes(step: Callable[[], Any]) -> int:
    """Peak of the bytes allocated (and not yet freed) while `step` runs, from torch.profiler's memory
    timeline: it sees every allocation, inductor's included. Storages that exist before are not counted."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    live = peak = 0
    for _t, action, _key, nbytes in prof._memory_profile().timeline:
        if action == Action.CREATE:
            live += nbytes
        elif action == Action.DESTROY:
            live -= nbytes
        peak = max(peak, live)
    return peak


def profiled_step(model: nn.Module, inputs: Any, optimizer: Any, run: Callable[[], torch.Tensor]) -> Measurement:
    """Peak of one step `run()`: what exists before it (parameters, buffers, inputs, optimizer states,
    as memplan's tracker counts them) plus the profiler's peak during it."""
    start = track_step_start(LiveBytesTracker(), model, inputs, optimizer)
    loss: list[torch.Tensor] = []
    peak = profiled_peak_bytes(lambda: loss.append(run()))
    return Measurement(peak_bytes=start + peak, start_bytes=start, loss=float(loss[0].detach()))


def measure_compiled_step(model: nn.Module, inputs: Any, config: TrainConfig) -> Measurement:
    """Warm up one step (it compiles), then measure a second, steady-state step with the profiler."""
    optimizer = warmed_up(model, inputs, config)
    return profiled_step(
        model, inputs, optimizer, lambda: run_training_step(model, inputs, optimizer, config.precision)
    )
