"""Train a pipeline (torch.distributed.pipelining) with memplan's stage plans; each rank's measured peak against its prediction.

    torchrun --standalone --nproc-per-node 2 examples/train_pipeline.py
    torchrun --standalone --nproc-per-node 2 examples/train_pipeline.py --schedule interleaved-1f1b
    torchrun --standalone --nproc-per-node 2 examples/train_pipeline.py --schedule gpipe --budget 70%
    torchrun --standalone --nproc-per-node 2 examples/train_pipeline.py --schedule interleaved-zero-bubble

CPU ranks under gloo. Rank 0 traces the model below (`llama`: an 8-layer Llama, the spec
``examples/train_pipeline.py:llama``) on fake tensors and solves a plan per pipeline stage
(``memplan plan --pp``) under one `--budget` for every rank, a percentage of the worst rank's
no-plan peak or bytes; it broadcasts the plans. Every rank then cuts its stage modules as
torchtitan does (layers under their own names, the embeddings on the first stage, norm and head
on the last), applies its stages' plans (``apply_plan(stage_module, plans, stage=i)``) and trains
`--steps` steps with ``schedule.step()`` under ``recompute_in_bubbles``: a stage that waits for a
gradient recomputes the block its plan runs early while it waits (GPipe, 1F1B, interleaved 1F1B,
looped BFS); under the zero-bubble schedules and DualPipeV a stage whose backward is split
recomputes once, in I, and holds what it made until W. Last, each rank measures one more step's peak of live tensor bytes and rank 0 prints
them against memplan's prediction.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, schedules

from planner import apply_plan, load_plan, recompute_in_bubbles
from planner.api import plan_pipeline_model, simulate_pipeline_model
from planner.config import PP_SCHEDULES, SINGLE_STAGE_SCHEDULES, TrainConfig
from planner.runtime.pipeline_verify import measure_schedule
from planner.runtime.verify import make_optimizer
from planner.tracing.models import Llama, LlamaConfig, LlamaStage, lm_loss
from planner.units import format_bytes

SPEC = f"{__file__}:llama"
VOCAB = 512


def llama(batch_size: int, seq_len: int):
    """The model memplan traces and every rank builds: vocab 512, hidden 256, 8 layers, 4 heads (2 kv)."""
    tokens = torch.randint(0, VOCAB, (batch_size, seq_len)), torch.randint(0, VOCAB, (batch_size, seq_len))
    return Llama(LlamaConfig(VOCAB, 256, 688, 8, 4, 2)), tokens


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedule", default="1f1b", choices=list(PP_SCHEDULES))
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step, split into --microbatches")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--budget", default="85%", help="per-rank budget: a percentage of the worst no-plan peak, or bytes")
    p.add_argument("--steps", type=int, default=3, help="training steps before the measured one")
    return p.parse_args()


def make_plans(config: TrainConfig, budget: str) -> dict:
    """Rank 0: the stage plans as JSON, with every rank's predicted peak under them."""
    _, plans, _ = plan_pipeline_model(SPEC, config, int(budget) if budget.isdigit() else budget)
    planned = simulate_pipeline_model(SPEC, config, plans)
    by_rank = {r: role.peak_bytes for role in planned.layout.roles for r in role.ranks}
    return {"plans": plans.to_dict(), "predicted": [by_rank[r] for r in range(config.world_size)]}


def main() -> None:
    args = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    multi = args.schedule not in SINGLE_STAGE_SCHEDULES
    config = TrainConfig(
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        pp=world,
        pp_schedule=args.schedule,
        microbatches=args.microbatches,
        stages_per_rank=2 if multi else None,
    )
    payload = [make_plans(config, args.budget) if rank == 0 else None]
    dist.init_process_group("gloo")
    dist.broadcast_object_list(payload, src=0)
    plans = load_plan(payload[0]["plans"])

    torch.manual_seed(0)  # the same weights and batch on every rank
    model, (ids, labels) = llama(args.batch_size, args.seq_len)
    last = len(plans.stages) - 1
    mine = [s for s in plans.stages if s.pp_rank == rank]
    modules = []
    for s in mine:  # a stage's blocks are consecutive layers: layers.i .. layers.j
        first = int(s.blocks[0].rsplit(".", 1)[1])
        modules.append(LlamaStage(model, first, first + len(s.blocks), s.stage == 0, s.stage == last, args.seq_len))
    handles = [apply_plan(m, plans, stage=s.stage) for m, s in zip(modules, mine)]
    stages = [PipelineStage(m, s.stage, last + 1, torch.device("cpu")) for m, s in zip(modules, mine)]
    cls = getattr(schedules, PP_SCHEDULES[args.schedule])
    schedule = cls(stages if multi else stages[0], args.microbatches, loss_fn=lm_loss)
    step_args = (ids,) if any(s.stage == 0 for s in mine) else ()
    step_kwargs = {"target": labels} if any(s.stage == last for s in mine) else {}
    optimizer = make_optimizer([p for m in modules for p in m.parameters()], config.optimizer)

    for _ in range(args.steps):
        with recompute_in_bubbles(schedule, handles):
            schedule.step(*step_args, **step_kwargs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    measured = measure_schedule(
        schedule, modules, stages, optimizer, step_args, step_kwargs, config, steps=1, handles=handles
    )
    peaks = [None] * world
    dist.all_gather_object(peaks, measured.peak_bytes)
    if rank == 0:
        early = {s.stage: list(s.early_recompute) for s in plans.stages if s.early_recompute}
        split = [s.stage for s in plans.stages if s.split_backward and s.plan.decisions]
        print(
            f"{args.schedule} on {world} CPU ranks (gloo), {args.microbatches} microbatches, budget "
            f"{format_bytes(plans.budget_bytes)}; recomputed while waiting for a gradient: {early or 'nothing'}; "
            f"split-backward stages recomputing once in I: {split or 'none'}"
        )
        for r, (meas, pred) in enumerate(zip(peaks, payload[0]["predicted"])):
            print(
                f"rank {r}: measured peak {format_bytes(meas)} ({meas} B), predicted "
                f"{format_bytes(pred)} ({pred} B, {(pred - meas) / meas:+.2%})"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
