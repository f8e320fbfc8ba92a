"""Train under FSDP2 with a memplan plan, and compare each rank's measured peak with memplan's prediction.

    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py
    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py --model gpt2-tiny --reshard-after-forward false

gloo on CPU, nccl on CUDA. Rank 0 traces the model on fake tensors, simulates the `--zero 3 --dp N`
step and solves a plan for a budget `--fraction` of the way from model states to the no-plan
peak (or loads `--plan`); it broadcasts the plan JSON. Every rank then builds the model, applies
the plan *before* sharding (as torchtitan orders activation checkpointing and FSDP), calls
``fully_shard`` on each block and then the root, trains a few steps and reports its peak: live
tensor bytes on CPU, ``torch.cuda.max_memory_allocated`` on CUDA.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from planner import apply_plan, load_plan, resolve_spec, simulate, solve
from planner.api import trace_for
from planner.config import TrainConfig
from planner.errors import InfeasibleBudget
from planner.runtime.shard import measure_sharded_step, shard_model
from planner.runtime.verify import make_optimizer
from planner.simulation.fsdp import fsdp_units
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
    p.add_argument("--reshard-after-forward", default="true", choices=["true", "false"])
    p.add_argument("--steps", type=int, default=3, help="measured training steps after one warm-up step")
    return p.parse_args()


def make_plan(spec: str, config: TrainConfig, fraction: float, plan_path: str | None) -> dict:
    """Rank 0: the plan as JSON, with the prediction and the FSDP units to shard."""
    graph = trace_for(spec, config)
    base = simulate(graph, config)
    states = sum(base.model_states.values())
    budget = int(states + fraction * (base.peak_bytes - states))
    if plan_path:
        plan = load_plan(plan_path)
    else:
        try:
            plan = solve(graph, config, budget)
        except InfeasibleBudget as e:  # FSDP2's own buffers are out of any plan's reach
            print(f"budget {format_bytes(budget)} is below reach; planning for the lowest peak instead")
            budget = e.smallest_peak_bytes
            plan = solve(graph, config, budget)
    predicted = simulate(graph, config, plan=plan).peak_bytes
    units = [u.path for u in fsdp_units(graph, config.dp)[:-1]]
    return {
        "plan": plan.to_dict(),
        "budget": budget,
        "baseline": base.peak_bytes,
        "predicted": predicted,
        "units": units,
    }


def cuda_peak(model, inputs, config: TrainConfig, steps: int) -> int:
    optimizer = make_optimizer(model.parameters(), config.optimizer)
    peaks = []
    for step in range(steps + 1):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss_of(run_step_inputs(model, inputs)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step:
            peaks.append(torch.cuda.max_memory_allocated())
    return min(peaks)


def main() -> None:
    args = parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = TrainConfig(
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        zero_stage=3,
        dp=world,
        reshard_after_forward=args.reshard_after_forward == "true",
    )
    payload = [make_plan(args.model, config, args.fraction, args.plan) if rank == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    shared = payload[0]

    torch.manual_seed(0)
    model, inputs = resolve_spec(args.model).build(args.batch_size, args.seq_len)
    if cuda:
        model = model.cuda()
        inputs = (
            tuple(t.cuda() for t in inputs) if isinstance(inputs, tuple) else {k: v.cuda() for k, v in inputs.items()}
        )
    apply_plan(model, load_plan(shared["plan"]))  # before fully_shard, as torchtitan orders AC and FSDP
    shard_model(model, shared["units"], config)
    if cuda:
        peak = cuda_peak(model, inputs, config, args.steps)
    else:
        peak = measure_sharded_step(model, inputs, config, steps=args.steps).peak_bytes

    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        print(
            f"{args.model} FSDP2 on {world} {'GPUs (nccl)' if cuda else 'CPU ranks (gloo)'}: "
            f"no-plan peak {format_bytes(shared['baseline'])}, budget {format_bytes(shared['budget'])}"
        )
        for r, measured in enumerate(peaks):
            error = (shared["predicted"] - measured) / measured
            print(
                f"rank {r}: measured peak {format_bytes(measured)} ({measured} B), predicted "
                f"{format_bytes(shared['predicted'])} ({error:+.2%})"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
