"""Test-only: run tensor-parallel cases on CPU gloo ranks and collect each rank's measured peak.

A case is (key, model spec, TrainConfig, plan dict or None); every case of one call runs on
config.world_size ranks (planner.runtime.parallel_verify.run_on_gloo_ranks). Each rank builds the
model from the same seed and shards it as memplan simulates it (the TP plan, the memplan plan,
then fully_shard on the dp submesh with --zero 3), checks its first gradients against one
unsharded process, then measures a steady-state step.
"""

from __future__ import annotations

import torch

from planner import load_plan
from planner.runtime.parallel_verify import build_parallel_model, measure_parallel_step, run_on_gloo_ranks
from planner.tracing.parallel.projection_styles import output_dim, rank_major_order
from planner.tracing.parallel.tp_plans import decoder_blocks, step_context
from planner.tracing.recorder import loss_of, run_step_inputs
from planner.tracing.specs import resolve_spec

TIMEOUT_S = 600


def _rank_major(grads: dict[str, torch.Tensor], ref: torch.nn.Module, tp: int) -> dict[str, torch.Tensor]:
    """One process's gradients in the row order memplan's plan stores a fused ``[q | k | v]``
    projection's parameters (and an ``nn.MultiheadAttention``'s ``in_proj``) in
    (projection_styles.rank_major_order); other gradients unchanged (a fused projection laid out per
    head is sharded in its own order)."""
    reordered: dict[str, int] = {}  # parameter name -> the dimension of its output features
    for b in decoder_blocks(ref):
        if b.multihead_attention:
            reordered |= {f"{b.path}.{b.attention}.in_proj_{name}": 0 for name in ("weight", "bias")}
        for q in b.qkv if b.qkv_sections == 3 else ():
            reordered |= {
                f"{b.path}.{q}.weight": output_dim(ref.get_submodule(f"{b.path}.{q}")),
                f"{b.path}.{q}.bias": 0,
            }
    out = {}
    for name, grad in grads.items():
        if name in reordered:
            dim = reordered[name]
            grad = grad.index_select(dim, rank_major_order(grad.shape[dim], 3, tp))
        out[name] = grad
    return out


def _grad_error(spec: str, config, sharded, inputs) -> float:
    """Largest |g - g_ref| / |g_ref| over parameters after one forward and backward (0 when allclose)."""
    torch.manual_seed(0)
    ref, _ = resolve_spec(spec).build(batch_size=config.batch_size, seq_len=config.seq_len)
    loss_of(run_step_inputs(ref, inputs)).backward()
    ref_grads = _rank_major({n: p.grad for n, p in ref.named_parameters()}, ref, config.tp)
    with step_context(config):
        loss_of(run_step_inputs(sharded, inputs)).backward()
    # a gradient that is zero in exact arithmetic (a key bias under softmax) is rounding noise: the
    # absolute tolerance follows the largest gradient of the model, not of that parameter
    atol = 1e-6 * max(float(g.abs().max()) for g in ref_grads.values()) + 1e-12
    worst = 0.0
    for name, p in sharded.named_parameters():
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        want = ref_grads[name]
        if not torch.allclose(got, want, rtol=1e-4, atol=atol):
            worst = max(worst, float(((got - want).abs() / (want.abs() + 1e-12)).max()))
    for p in sharded.parameters():
        p.grad = None
    return worst


def _worker(rank: int, world_size: int, cases: list, queue) -> None:
    for key, spec, config, plan in cases:
        plan = load_plan(plan) if plan is not None else None
        model, inputs = build_parallel_model(spec, config, plan)
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


def _auto_worker(rank: int, world_size: int, cases: list, queue) -> None:
    """auto_checkpoint on the TP- (and EP-) sharded model of each rank (before fully_shard, torchtitan's order)."""
    from ep_ranks import _grad_error as ep_grad_error

    from planner.runtime.auto import auto_checkpoint

    for key, spec, config, budget in cases:
        handles = []

        def checkpoint(model, inputs, config=config, budget=budget, handles=handles) -> None:
            options = {
                "zero_stage": config.zero_stage,
                "dp": config.dp,
                "gpu": "cpu",
                "moe_imbalance": config.moe_imbalance,
            }
            handles.append(auto_checkpoint(model, inputs, budget, loss_parallel=config.loss_parallel, **options))

        model, inputs = build_parallel_model(spec, config, checkpoint=checkpoint)
        grad_error = (ep_grad_error if config.ep > 1 else _grad_error)(spec, config, model, inputs)
        peak = measure_parallel_step(model, inputs, config).peak_bytes
        plan = handles[0].plan.to_dict()
        handles[0].set_budget(handles[0].budget_bytes + 1)  # a new plan, on the model fully_shard wrapped
        handles[0].install()
        assert handles[0].plan.budget_bytes == plan["budget_bytes"] + 1
        queue.put((key, rank, peak, grad_error, plan))


def run_auto_on_ranks(cases: list, world_size: int, timeout_s: float = TIMEOUT_S) -> dict[str, tuple[list, float]]:
    """Cases (key, spec, config, budget): key -> (per global rank (measured peak, plan dict), worst gradient error)."""
    out: dict[str, list] = {}
    errors: dict[str, float] = {}
    for key, rank, peak, grad_error, plan in run_on_gloo_ranks(_auto_worker, world_size, cases, timeout_s):
        out.setdefault(key, [None] * world_size)[rank] = (peak, plan)
        errors[key] = max(errors.get(key, 0.0), grad_error)
    return {key: (out[key], errors[key]) for key in out}


def assert_auto_matches_plan(specs: dict[str, str], config, fraction: float, tolerance: float) -> None:
    """Every rank's auto_checkpoint (budget: `fraction` of the worst rank's unplanned peak) installs
    `memplan plan`'s decisions, peaks within `tolerance` of its prediction and of the budget, with
    gradients allclose to one process."""
    from planner.api import plan_model
    from planner.plans.format import load_plan
    from planner.simulation.layout import simulate_ranks

    cases = [
        (key, spec, config, int(fraction * simulate_ranks(spec, config).peak_bytes)) for key, spec in specs.items()
    ]
    measured = run_auto_on_ranks(cases, config.world_size)
    for key, spec, _, budget in cases:
        ranks, grad_error = measured[key]
        want, _, _ = plan_model(spec, config, budget, time_limit_s=5.0)
        by_rank = {r: role.peak_bytes for role in simulate_ranks(spec, config, want).roles for r in role.ranks}
        for rank, (peak, plan) in enumerate(ranks):
            assert load_plan(plan).decisions == want.decisions, (key, rank)
            assert abs(peak - by_rank[rank]) <= tolerance * peak, (key, rank, peak, by_rank[rank])
            assert peak <= budget * (1 + tolerance), (key, rank, peak, budget)
        assert grad_error == 0.0, (key, grad_error)


def _auto_failure_worker(rank: int, world_size: int, case: tuple, queue) -> None:
    """auto_checkpoint on each rank's sharded model; reports what it raised (None if nothing)."""
    from planner.runtime.auto import auto_checkpoint

    spec, config, budget = case
    model, inputs = build_parallel_model(spec, config)
    try:
        auto_checkpoint(model, inputs, budget, dp=config.dp, gpu="cpu", moe_imbalance=config.moe_imbalance)
        queue.put((rank, None, ""))
    except Exception as exc:
        queue.put((rank, type(exc).__name__, str(exc)))


def auto_failures_on_ranks(spec: str, config, budget: int, timeout_s: float = TIMEOUT_S) -> dict[int, tuple]:
    """Global rank -> (exception type name or None, message) of auto_checkpoint on every rank."""
    return {
        rank: (kind, message)
        for rank, kind, message in run_on_gloo_ranks(
            _auto_failure_worker, config.world_size, (spec, config, budget), timeout_s
        )
    }
