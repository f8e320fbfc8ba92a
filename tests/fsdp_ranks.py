"""Test-only: run FSDP2 cases on 2 gloo CPU ranks (planner.runtime.parallel_verify.run_on_gloo_ranks)
and collect per-rank results.

A case is (key, builder name in models_for_tests, TrainConfig, plan dict or None, unit paths).
Each rank builds the model from the same seed, applies the plan (if any), shards it with
planner.runtime.shard_model, checks its first step's gradients against an unsharded copy
(plan cases) and measures a steady-state step.
"""

from __future__ import annotations

from typing import Any

import models_for_tests as M
import torch

from planner import apply_plan, load_plan
from planner.runtime.parallel_verify import run_on_gloo_ranks
from planner.runtime.shard import measure_sharded_step, shard_model
from planner.tracing.recorder import loss_of, run_step_inputs

WORLD_SIZE = 2


def build(builder: str, batch_size: int, seq_len: int):
    torch.manual_seed(0)
    return getattr(M, builder)(batch_size, seq_len)


def _grad_error(builder: str, config, sharded) -> float:
    """Largest |g - g_ref| / (|g_ref| max) over parameters after one forward and backward."""
    ref, inputs = build(builder, config.batch_size, config.seq_len)
    if config.precision != "fp32":
        return float("nan")
    loss_of(run_step_inputs(ref, inputs)).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    loss_of(run_step_inputs(sharded, inputs)).backward()
    worst = 0.0
    for name, p in sharded.named_parameters():
        got = p.grad.full_tensor()
        want = ref_grads[name]
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()) + 1e-12):
            worst = max(worst, float(((got - want).abs() / (want.abs() + 1e-12)).max()))
    for p in sharded.parameters():
        p.grad = None
    return worst


def _worker(rank: int, world_size: int, cases: list, queue) -> None:
    for key, builder, config, plan, unit_paths in cases:
        model, inputs = build(builder, config.batch_size, config.seq_len)
        if plan is not None:
            apply_plan(model, load_plan(plan))
        shard_model(model, unit_paths, config)
        grad_error = _grad_error(builder, config, model) if plan is not None else 0.0
        measured = measure_sharded_step(model, inputs, config)
        queue.put((key, rank, measured.peak_bytes, grad_error))


def run_on_ranks(cases: list) -> dict[str, dict[str, Any]]:
    """key -> {"peaks": [rank 0, rank 1], "grad_error": worst over ranks}."""
    results: dict[str, dict[str, Any]] = {}
    for key, rank, peak, grad_error in run_on_gloo_ranks(_worker, WORLD_SIZE, cases):
        entry = results.setdefault(key, {"peaks": [0] * WORLD_SIZE, "grad_error": 0.0})
        entry["peaks"][rank] = peak
        entry["grad_error"] = max(entry["grad_error"], grad_error)
    return results
