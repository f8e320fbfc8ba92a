"""Test-only: run expert-parallel cases on CPU gloo ranks and collect each rank's measured peak.

A case is (key, model spec, TrainConfig, plan dict or None); every case of one call runs on config.world_size ranks
(planner.runtime.parallel_verify.run_on_gloo_ranks). Each rank builds the model from the same seed
and the same batch, shards its experts with the EP plan memplan traced (then applies the memplan
plan, if any), routes tokens as the trace
assumed, checks its first gradients against one unsharded process, then measures a steady-state
step. Every rank holds the same batch, so an expert's gradient sums the same tokens from each of the
ep ranks: ep times the single process's; every other gradient equals the single process's. Where
the TP ranks keep their experts whole and each runs a slice of the tokens (transformers' plan),
their expert gradients are summed over tp first (FSDP2 does it with --zero 3; a data-parallel
reduction would do it without).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from planner import load_plan
from planner.runtime.parallel_verify import build_parallel_model, measure_parallel_step, run_on_gloo_ranks
from planner.runtime.routing import assumed_routing
from planner.tracing.parallel.ep_plans import expert_tp_replicas, is_expert_param
from planner.tracing.parallel.rank_trace import ep_mesh
from planner.tracing.parallel.tp_plans import step_context
from planner.tracing.recorder import loss_of, run_step_inputs
from planner.tracing.specs import resolve_spec

TIMEOUT_S = 600


def _grad_error(spec: str, config, sharded, inputs) -> float:
    """Largest relative gradient error against one process (0 when allclose)."""
    torch.manual_seed(0)
    ref, _ = resolve_spec(spec).build(batch_size=config.batch_size, seq_len=config.seq_len)
    with assumed_routing(config.moe_imbalance):
        loss_of(run_step_inputs(ref, inputs)).backward()
        with step_context(config):  # vocabulary-sharded logits under tensor parallel's loss parallel
            loss_of(run_step_inputs(sharded, inputs)).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    tp_slices = config.ep > 1 and config.zero_stage != 3 and expert_tp_replicas(sharded, config.tp) > 1
    tp_group = ep_mesh(config)["tp"].get_group() if tp_slices else None
    worst = 0.0
    for name, p in sharded.named_parameters():
        expert = is_expert_param(p)
        if expert and tp_group is not None:
            dist.all_reduce(p.grad.to_local(), group=tp_group)
        got = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = ref_grads[name] * (config.ep if expert else 1)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()) + 1e-12):
            worst = max(worst, float(((got - want).abs() / (want.abs() + 1e-12)).max()))
    for p in sharded.parameters():
        p.grad = None
    return worst


def _worker(rank: int, world_size: int, cases: list, queue) -> None:
    for key, spec, config, plan in cases:
        model, inputs = build_parallel_model(spec, config, load_plan(plan) if plan is not None else None)
        grad_error = _grad_error(spec, config, model, inputs)
        queue.put((key, rank, measure_parallel_step(model, inputs, config).peak_bytes, grad_error))


def run_on_ranks(cases: list, world_size: int, timeout_s: float = TIMEOUT_S) -> dict[str, tuple[list[int], float]]:
    """key -> (measured peak bytes of each global rank, worst gradient error over ranks)."""
    peaks: dict[str, list[int]] = {}
    errors: dict[str, float] = {}
    for key, rank, peak, grad_error in run_on_gloo_ranks(_worker, world_size, cases, timeout_s):
        peaks.setdefault(key, [0] * world_size)[rank] = peak
        errors[key] = max(errors.get(key, 0.0), grad_error)
    assert sorted(peaks) == sorted(c[0] for c in cases), "a case reported from no rank"
    return {key: (peaks[key], errors[key]) for key in peaks}
