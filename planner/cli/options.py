"""Options every subcommand shares: the model and training configuration, and JSON output."""

from __future__ import annotations

import argparse
import json

from costmodels.hardware import DEVICES
from costmodels.memory import OPTIMIZERS, PRECISIONS
from planner.config import CP_ROTATE_METHODS, MP_DTYPES, PP_SCHEDULES, TrainConfig
from planner.safe_io import clean, write_text

__all__ = [
    "positive_int",
    "reshard_after_forward",
    "seq_lens",
    "add_model_options",
    "add_layout_options",
    "config_from_args",
    "default_seq_len",
    "write_json",
]


MAX_COUNT = 2**31 - 1
"""Largest count (batch size, sequence length, GPUs) accepted on the command line."""


def positive_int(text: str) -> int:
    try:
        value = int(text) if len(text) <= 20 else None
    except ValueError:
        value = None
    if value is None or not 0 < value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected a positive integer up to {MAX_COUNT}, got '{clean(text, 40)}'")
    return value


def reshard_after_forward(text: str) -> bool | int:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected true, false or a group size N, got '{text}'") from None


def seq_lens(text: str) -> list[int]:
    values = [positive_int(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got '{text}'")
    return values


def add_model_options(p: argparse.ArgumentParser, sweep: bool = True, default_gpu: str = "cpu") -> None:
    p.add_argument(
        "--model", required=True, help="preset name, PATH.py:FUNC, package.module:FUNC or hf:PATH/config.json"
    )
    p.add_argument("--batch-size", type=positive_int, default=1, help="sequences (images) per step and device")
    p.add_argument(
        "--seq-len",
        type=seq_lens if sweep else positive_int,
        default=None,
        help="sequence length"
        + (" (a comma list: a sweep for simulate/verify, one plan per bucket for plan)" if sweep else "")
        + " (default: 512, or the model's position limit where smaller: 128 for gpt2-tiny)",
    )
    p.set_defaults(seq_len_sweep=sweep)
    p.add_argument("--gpu", default=default_gpu, help="target device: " + ", ".join(DEVICES))
    p.add_argument(
        "--device-profile",
        dest="gpu",
        default=argparse.SUPPRESS,
        metavar="FILE",
        help="target device from a profile JSON that memplan calibrate wrote (instead of --gpu)",
    )
    p.add_argument("--precision", default="fp32", help="one of: " + ", ".join(PRECISIONS))
    p.add_argument("--optimizer", default="adamw", help="one of: " + ", ".join(OPTIMIZERS))
    p.add_argument("--zero", type=int, default=0, dest="zero_stage", help="ZeRO stage 0-3 (3 = FSDP full shard)")
    p.add_argument("--dp", type=positive_int, default=1, help="data-parallel degree")
    p.add_argument(
        "--reshard-after-forward",
        type=reshard_after_forward,
        default=True,
        metavar="true|false|N",
        help="FSDP2 (--zero 3): free each block's gathered parameters after its forward (true), "
        "keep them until its backward (false) or keep a 1/N shard",
    )
    p.add_argument(
        "--mp-param-dtype",
        choices=sorted(MP_DTYPES),
        default=None,
        help="FSDP2 MixedPrecisionPolicy param_dtype (bfloat16 = --precision bf16-mixed)",
    )
    p.add_argument(
        "--mp-reduce-dtype",
        choices=sorted(MP_DTYPES),
        default=None,
        help="FSDP2 MixedPrecisionPolicy reduce_dtype (default: the param dtype, as FSDP2)",
    )
    p.add_argument(
        "--cpu-offload",
        action="store_true",
        help="FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer states on the host",
    )
    p.add_argument(
        "--moe-imbalance",
        type=float,
        default=1.0,
        metavar="F",
        help="mixture-of-experts routing the trace assumes: the busiest expert gets F times "
        "the mean tokens per expert (1.0: balanced)",
    )
    p.add_argument(
        "--blocks",
        default="",
        metavar="GLOB[,GLOB]",
        help="module paths of the checkpointable blocks, e.g. 'layer*' or 'encoder.block.*' "
        "(default: found by structure)",
    )
    p.add_argument(
        "--grad-accum",
        type=positive_int,
        default=1,
        dest="grad_accum_steps",
        metavar="N",
        help="micro-batches of --batch-size whose gradients accumulate before each optimizer step",
    )
    add_layout_options(p)
    p.add_argument("--json", dest="json_path", help="write the result as JSON to this path")


def add_layout_options(p: argparse.ArgumentParser) -> None:
    """Tensor, context, expert and pipeline parallel flags (mesh order [pp, dp, cp, tp])."""
    g = p.add_argument_group("parallel layout (mesh order pp, dp, cp, tp)")
    g.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (sequence parallel on)")
    g.add_argument(
        "--no-sp", dest="sequence_parallel", action="store_false", help="tensor parallel without sequence parallel"
    )
    g.add_argument(
        "--no-loss-parallel",
        dest="loss_parallel",
        action="store_false",
        help="tensor parallel with the logits gathered whole for the loss (default: loss on vocabulary shards)",
    )
    g.add_argument(
        "--tp-plan",
        default="auto",
        metavar="auto|SPEC",
        help="how the model is sharded: auto, or PATH.py:FUNC / package.module:FUNC, FUNC(model, tp_mesh)",
    )
    g.add_argument("--cp", type=positive_int, default=1, help="context-parallel degree (the sequence sharded)")
    g.add_argument(
        "--cp-rotate",
        default="allgather",
        choices=CP_ROTATE_METHODS,
        help="how ring attention exchanges K/V under --cp (torch's set_rotate_method; default allgather)",
    )
    g.add_argument("--ep", type=positive_int, default=1, help="expert-parallel degree, borrowed from dp × cp")
    g.add_argument(
        "--ep-plan",
        default="auto",
        metavar="auto|SPEC",
        help="how the experts are sharded: auto, or PATH.py:FUNC / package.module:FUNC, FUNC(model, ep_mesh)",
    )
    g.add_argument("--pp", type=positive_int, default=1, help="pipeline stages on this many ranks")
    g.add_argument(
        "--pp-schedule", default="1f1b", metavar="NAME", help="pipeline schedule: " + ", ".join(PP_SCHEDULES)
    )
    g.add_argument("--microbatches", type=positive_int, default=None, help="microbatches per step (default: --pp)")
    g.add_argument(
        "--stages-per-rank",
        type=positive_int,
        default=None,
        help="virtual pipeline stages per rank (default: 2 for zbv-zero-bubble and dualpipev, else 1)",
    )
    g.add_argument("--pp-split", default="uniform", metavar="uniform|auto|N1,N2,...", help="blocks per pipeline stage")


def default_seq_len(args) -> None:
    """Fill in --seq-len when not given: 512, or the model's position limit where smaller."""
    if not hasattr(args, "seq_len") or args.seq_len is not None:
        return
    seq = 512  # planner.tracing.specs.DEFAULT_SEQ_LEN; a command without a model imports nothing heavy
    if getattr(args, "model", None):
        from planner.tracing.specs import default_seq_len as model_default

        seq = model_default(args.model)
    args.seq_len = [seq] if getattr(args, "seq_len_sweep", True) else seq


def config_from_args(args, seq_len: int | None = None) -> TrainConfig:
    if getattr(args, "seq_len", 0) is None:
        default_seq_len(args)
    seq = seq_len if seq_len is not None else (args.seq_len[0] if isinstance(args.seq_len, list) else args.seq_len)
    return TrainConfig(
        batch_size=args.batch_size,
        seq_len=seq,
        precision=args.precision,
        optimizer=args.optimizer,
        zero_stage=args.zero_stage,
        dp=args.dp,
        gpu=args.gpu,
        moe_imbalance=args.moe_imbalance,
        reshard_after_forward=args.reshard_after_forward,
        mp_param_dtype=args.mp_param_dtype,
        mp_reduce_dtype=args.mp_reduce_dtype,
        cpu_offload=args.cpu_offload,
        blocks=tuple(g.strip() for g in args.blocks.split(",") if g.strip()),
        grad_accum_steps=args.grad_accum_steps,
        tp=args.tp,
        sequence_parallel=args.sequence_parallel,
        loss_parallel=args.loss_parallel,
        tp_plan=args.tp_plan,
        cp=args.cp,
        cp_rotate=args.cp_rotate,
        ep=args.ep,
        ep_plan=args.ep_plan,
        pp=args.pp,
        pp_schedule=args.pp_schedule,
        microbatches=args.microbatches,
        stages_per_rank=args.stages_per_rank,
        pp_split=args.pp_split,
    )


def write_json(path: str | None, payload: dict) -> None:
    if path:
        write_text(path, json.dumps(payload, indent=2, sort_keys=True))  # atomic; devices/FIFOs in place
        print(f"wrote {path}")
