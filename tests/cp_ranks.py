"""Test-only: torch's ring attention, through memplan's CPU route, on real CPU gloo ranks against
one process's full attention (the same route the context-parallel trace records)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from planner.runtime.parallel_verify import run_on_gloo_ranks
from planner.tracing.parallel.context_parallel import context_parallel_step

B, H, S, D = 2, 4, 64, 16


def _worker(rank: int, world_size: int, rotate: str, queue) -> None:
    """Shard q, k, v and the output gradient as context_parallel shards its buffers (load-balanced),
    run causal SDPA forward and backward inside it, and compare with this rank's rows of the full run."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    full = [torch.randn(B, H, S, D) for _ in range(4)]  # q, k, v, grad of the output
    ref = [t.clone().requires_grad_() for t in full[:3]]
    (F.scaled_dot_product_attention(*ref, is_causal=True) * full[3]).sum().backward()
    # context_parallel shards [batch, seq, ...] buffers: hand it (b, s, h, d) views' copies, and
    # keep the original positions along to pick the reference rows
    positions = torch.arange(S).expand(B, S).contiguous()
    buffers = [t.transpose(1, 2).contiguous() for t in full] + [positions]
    with context_parallel_step(mesh, tuple(buffers), S, rotate) as calls:
        q, k, v = (b.transpose(1, 2).detach().clone().requires_grad_() for b in buffers[:3])
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (out * buffers[3].transpose(1, 2)).sum().backward()
        mine = buffers[4][0].clone()  # this rank's global positions (head-tail load-balanced)
    rows = [
        (out, F.scaled_dot_product_attention(*[t.detach() for t in ref], is_causal=True)),
        (q.grad, ref[0].grad),
        (k.grad, ref[1].grad),  # the ring brings dK/dV back to the rank that owns K/V
        (v.grad, ref[2].grad),
    ]
    error = max(float((got - want[:, :, mine]).abs().max()) for got, want in rows)
    queue.put((rank, error, calls.forward, calls.backward, mine.tolist()))


def ring_attention_errors(world_size: int, rotate: str = "allgather") -> list[tuple]:
    """(rank, largest |error| of out, dQ, dK and dV against full attention, ring calls forward, backward,
    the rank's global positions) for every rank."""
    return sorted(run_on_gloo_ranks(_worker, world_size, rotate, timeout_s=300))


def _auto_worker(rank: int, world_size: int, case: tuple, queue) -> None:
    """auto_checkpoint on this rank's model (before fully_shard), told the cp mesh; then its
    first gradients under context parallel against the same model without a plan, and its peak."""
    from torch.distributed.device_mesh import init_device_mesh

    from planner.runtime.auto import auto_checkpoint
    from planner.runtime.parallel_verify import build_parallel_model, measure_parallel_step
    from planner.tracing.recorder import loss_of, run_step_inputs

    spec, config, budget = case
    cp_mesh = init_device_mesh("cpu", (config.dp, config.cp, config.tp), mesh_dim_names=("dp", "cp", "tp"))["cp"]
    handles = []

    def checkpoint(model, inputs) -> None:
        options = {"zero_stage": config.zero_stage, "dp": config.dp, "gpu": "cpu", "cp_rotate": config.cp_rotate}
        lengths = (config.seq_len // 2, config.seq_len)  # it follows the step's length, not the shard's
        handles.append(auto_checkpoint(model, inputs, budget, cp_mesh=cp_mesh, seq_lens=lengths, **options))

    grads = []
    for plan_it in (False, True):
        model, inputs = build_parallel_model(spec, config, checkpoint=checkpoint if plan_it else None)
        with context_parallel_step(cp_mesh, inputs, config.seq_len, config.cp_rotate):
            loss_of(run_step_inputs(model, inputs)).backward()
            grads.append(
                [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
            )
            for p in model.parameters():
                p.grad = None
            peak = measure_parallel_step(model, inputs, config).peak_bytes
    error = max(float((a - b).abs().max()) for a, b in zip(*grads))
    queue.put((rank, peak, error, handles[0].plan.to_dict(), handles[0].last_seq_len))


def auto_checkpoint_on_cp_ranks(spec: str, config, budget: int) -> list[tuple]:
    """(rank, measured peak with auto_checkpoint's plan, largest |gradient difference| from the same
    step without a plan, the plan installed, the sequence length the handle saw) for every rank."""
    return sorted(run_on_gloo_ranks(_auto_worker, config.world_size, (spec, config, budget), timeout_s=600))
