"""Train under FSDP2 (and tensor parallel) with a memplan plan; compare each rank's measured peak with its prediction.

    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py
    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py --model gpt2-tiny --reshard-after-forward false
    torchrun --standalone --nproc-per-node 4 examples/train_fsdp.py --tp 2          # dp 2 x tp 2
    torchrun --standalone --nproc-per-node 4 examples/train_fsdp.py --tp 2 --auto   # each rank plans itself

gloo on CPU, nccl on CUDA. Rank 0 traces the model on fake tensors (before the process group
starts: tensor parallel is traced under a fake one), simulates every rank of the `--zero 3`
step over `--dp` = ranks / `--tp` and solves a plan for a budget `--fraction` of the way from
model states to the worst rank's no-plan peak (or loads `--plan`); it broadcasts the plan JSON.
Every rank then builds the model and composes as torchtitan does: the tensor-parallel plan on the
``tp`` mesh dimension, then the memplan plan (activation checkpointing), then ``fully_shard`` on
each block and the root over ``dp``. With ``--auto`` each rank plans at the checkpointing step
itself: ``auto_checkpoint`` on its tensor-parallel model, for the same budget. It trains a few steps (under ``loss_parallel()`` with
``--tp``) and reports its peak: live tensor bytes on CPU, ``torch.cuda.max_memory_allocated`` on CUDA.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from planner import apply_plan, auto_checkpoint, load_plan, resolve_spec
from planner.api import plan_model, simulate_layout
from planner.config import TrainConfig
from planner.errors import InfeasibleBudget
from planner.runtime.parallel_verify import LocalBytesTracker
from planner.runtime.shard import ShardedBytesTracker, measure_sharded_step, shard_model
from planner.runtime.verify import make_optimizer
from planner.tracing.blocks import find_region_paths
from planner.tracing.parallel.tp_plans import step_context, tp_plan_for
from planner.tracing.recorder import loss_of, run_step_inputs
from planner.units import format_bytes


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-7b-tiny", help="memplan preset or PATH.py:FUNC")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument(
        "--fraction",
        type=float,
        default=0.6,
        help="budget: this fraction of the way from model states to the no-plan peak",
    )
    p.add_argument("--plan", help="load this plan instead of solving one")
    p.add_argument("--auto", action="store_true", help="each rank plans its own model with auto_checkpoint")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (sequence and loss parallel on)")
    p.add_argument("--reshard-after-forward", default="true", choices=["true", "false"])
    p.add_argument("--steps", type=int, default=3, help="measured training steps after one warm-up step")
    return p.parse_args()


def make_plan(spec: str, config: TrainConfig, fraction: float, plan_path: str | None, auto: bool) -> dict:
    """Rank 0: the plan as JSON, with the worst rank's no-plan peak and every rank's prediction
    (with `auto`, only the budget and the no-plan peak: each rank plans itself)."""
    base = simulate_layout(spec, config)
    states = sum(base.worst.timeline.model_states.values())
    budget = int(states + fraction * (base.peak_bytes - states))
    if auto:
        return {"budget": budget, "baseline": base.peak_bytes}
    if plan_path:
        plan = load_plan(plan_path)
    else:
        try:
            plan = plan_model(spec, config, budget)[0]
        except InfeasibleBudget as e:  # FSDP2's own buffers are out of any plan's reach
            print(f"budget {format_bytes(budget)} is below reach; planning for the lowest peak instead")
            budget = e.smallest_peak_bytes
            plan = plan_model(spec, config, budget)[0]
    planned = simulate_layout(spec, config, plan)
    by_rank = {r: role.peak_bytes for role in planned.roles for r in role.ranks}
    return {
        "plan": plan.to_dict(),
        "budget": budget,
        "baseline": base.peak_bytes,
        "predicted": [by_rank[r] for r in range(config.world_size)],
    }


def cuda_peak(model, inputs, config: TrainConfig, steps: int) -> int:
    optimizer = make_optimizer(model.parameters(), config.optimizer)
    peaks = []
    for step in range(steps + 1):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with step_context(config):
            loss_of(run_step_inputs(model, inputs)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step:
            peaks.append(torch.cuda.max_memory_allocated())
    return min(peaks)


def main() -> None:
    args = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the {world} ranks; use a --tp that divides --nproc-per-node")
    config = TrainConfig(
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        zero_stage=3,
        dp=world // args.tp,
        tp=args.tp,
        reshard_after_forward=args.reshard_after_forward == "true",
    )
    # Rank 0 plans before the real process group starts: tensor parallel is traced under a fake one.
    payload = [make_plan(args.model, config, args.fraction, args.plan, args.auto) if rank == 0 else None]
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    dist.broadcast_object_list(payload, src=0)
    shared = payload[0]

    torch.manual_seed(0)
    model, inputs = resolve_spec(args.model).build(args.batch_size, args.seq_len)
    if cuda:
        model = model.cuda()
        inputs = (
            tuple(t.cuda() for t in inputs) if isinstance(inputs, tuple) else {k: v.cuda() for k, v in inputs.items()}
        )
    mesh = init_device_mesh("cuda" if cuda else "cpu", (config.dp, config.tp), mesh_dim_names=("dp", "tp"))
    units = find_region_paths(model)
    if config.tp > 1:
        tp_plan_for(config)(model, mesh["tp"])
    # after TP, before fully_shard, as torchtitan orders them
    if args.auto:
        options = {"zero_stage": 3, "dp": config.dp, "reshard_after_forward": config.reshard_after_forward}
        try:
            handle = auto_checkpoint(model, inputs, shared["budget"], **options)
        except InfeasibleBudget as e:  # as make_plan: FSDP2's own buffers are out of any plan's reach
            shared["budget"] = e.smallest_peak_bytes
            handle = auto_checkpoint(model, inputs, shared["budget"], **options)
        shared["predicted"] = [None] * world
        dist.all_gather_object(shared["predicted"], handle.plan.predicted.peak_bytes)
    else:
        apply_plan(model, load_plan(shared["plan"]))
    if config.dp > 1:
        shard_model(model, units, config, mesh=mesh["dp"])
    if cuda:
        peak = cuda_peak(model, inputs, config, args.steps)
    else:
        tracker = LocalBytesTracker if config.tp > 1 else ShardedBytesTracker  # TP: count DTensors' local shards
        peak = measure_sharded_step(model, inputs, config, steps=args.steps, tracker=tracker).peak_bytes

    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        layout = f"dp {config.dp} x tp {config.tp}" if config.tp > 1 else "FSDP2"
        print(
            f"{args.model} {layout} on {world} {'GPUs (nccl)' if cuda else 'CPU ranks (gloo)'}: "
            f"worst rank's no-plan peak {format_bytes(shared['baseline'])}, budget {format_bytes(shared['budget'])}"
        )
        for r, (measured, predicted) in enumerate(zip(peaks, shared["predicted"])):
            error = (predicted - measured) / measured
            print(
                f"rank {r}: measured peak {format_bytes(measured)} ({measured} B), predicted "
                f"{format_bytes(predicted)} ({predicted} B, {error:+.2%})"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
