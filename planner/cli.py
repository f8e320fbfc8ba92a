"""`memplan` command line: wires subcommands to the public API, prints reports.

Every user error (bad spec, bad size, infeasible budget, malformed plan) ends as one line on
stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable

from costmodels.hardware import DEVICES, get_device
from costmodels.memory import OPTIMIZERS, PRECISIONS
from planner.config import TrainConfig
from planner import report

__all__ = ["main"]

EXAMPLES = {
    "simulate": "memplan simulate --model llama-7b --gpu h100-80gb --seq-len 4096 --precision bf16-mixed\n"
                "  memplan simulate --model gpt2 --seq-len 512,1024,2048 --gpu a100-40gb --plot sweep.png",
    "verify": "memplan verify --model llama-7b-tiny --batch-size 2 --seq-len 64\n"
              "  memplan verify --model gpt2-tiny --seq-len 64 --plan plan.json",
    "plan": "memplan plan --model llama-70b --gpu h100-80gb --seq-len 4096 --precision bf16-mixed "
            "--zero 3 --dp 32 --out plan.json\n"
            "  memplan plan --model llama-7b-tiny --seq-len 64 --budget 6MiB --offload disk --out plan.json",
    "apply": "memplan apply --model llama-7b-tiny --seq-len 64 --plan plan.json",
    "diagnose": "memplan diagnose --model llama-7b --gpu a100-40gb --seq-len 4096\n"
                "  memplan diagnose --snapshot snapshot.pickle\n"
                "  memplan diagnose --oom-message \"CUDA out of memory. Tried to allocate ...\"",
    "fit": "memplan fit --model llama-70b --gpu h100-80gb --seq-len 4096 --precision bf16-mixed",
}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _seq_lens(text: str) -> list[int]:
    return [_positive_int(part) for part in text.split(",") if part.strip()]


def _add_model_options(p: argparse.ArgumentParser, sweep: bool = True, default_gpu: str = "cpu") -> None:
    p.add_argument("--model", required=True, help="preset name, PATH.py:FUNC, package.module:FUNC or hf:PATH/config.json")
    p.add_argument("--batch-size", type=_positive_int, default=1)
    p.add_argument("--seq-len", type=_seq_lens if sweep else _positive_int, default=[512] if sweep else 512,
                   help="sequence length" + (" (a comma list: a sweep for simulate/verify, one plan per "
                                             "bucket for plan)" if sweep else ""))
    p.add_argument("--gpu", default=default_gpu, help="target device: " + ", ".join(DEVICES))
    p.add_argument("--precision", default="fp32", help="one of: " + ", ".join(PRECISIONS))
    p.add_argument("--optimizer", default="adamw", help="one of: " + ", ".join(OPTIMIZERS))
    p.add_argument("--zero", type=int, default=0, dest="zero_stage", help="ZeRO stage 0-3 (3 = FSDP full shard)")
    p.add_argument("--dp", type=_positive_int, default=1, help="data-parallel degree")
    p.add_argument("--json", dest="json_path", help="write the result as JSON to this path")


def _config(args, seq_len: int | None = None) -> TrainConfig:
    seq = seq_len if seq_len is not None else (args.seq_len[0] if isinstance(args.seq_len, list) else args.seq_len)
    return TrainConfig(batch_size=args.batch_size, seq_len=seq, precision=args.precision,
                       optimizer=args.optimizer, zero_stage=args.zero_stage, dp=args.dp, gpu=args.gpu)


def _write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True))
        print(f"wrote {path}")


# -- subcommands -------------------------------------------------------------------------------
def cmd_simulate(args) -> None:
    from planner.api import simulate_model, simulate_sweep

    capacity = get_device(args.gpu).memory_bytes
    if len(args.seq_len) == 1:
        result = simulate_model(args.model, _config(args), args.plan).to_dict()
        print(report.timeline_table(result, capacity))
        _write_json(args.json_path, result)
        if args.plot:
            report.plot_timeline(result, args.plot, capacity)
            print(f"wrote {args.plot}")
        return
    results = simulate_sweep(args.model, [_config(args, s) for s in args.seq_len], args.plan)
    fitting = [s for s, r in zip(args.seq_len, results) if r["peak_bytes"] <= capacity]
    rows = [[s, report.format_bytes(r["peak_bytes"]), r["peak_phase"], r["peak_op"],
             "yes" if r["peak_bytes"] <= capacity else "no"] for s, r in zip(args.seq_len, results)]
    print(report.table(["seq_len", "peak", "phase", "op at peak", f"fits {args.gpu}"], rows))
    longest = max(fitting) if fitting else None
    print(f"longest sequence that fits on {args.gpu} ({report.format_bytes(capacity)}): "
          f"{longest if longest else 'none of those tried'}")
    _write_json(args.json_path, {"sweep": results, "seq_lens": args.seq_len,
                                 "longest_fitting_seq_len": longest, "capacity_bytes": capacity})
    if args.plot:
        report.plot_sweep(args.seq_len, [r["peak_bytes"] for r in results], args.plot, capacity,
                          f"{args.model} on {args.gpu}, batch {args.batch_size}, {args.precision}")
        print(f"wrote {args.plot}")


def cmd_verify(args) -> None:
    from planner.api import verify_model

    if args.gpu != "cpu":
        raise ValueError(f"verify runs the real model on this machine's CPU; drop --gpu {args.gpu}")
    results = [verify_model(args.model, _config(args, s), args.plan) for s in args.seq_len]
    rows = [[r.config["seq_len"], report.format_bytes(r.predicted_bytes), report.format_bytes(r.measured_bytes),
             f"{r.error * 100:+.2f}%"] for r in results]
    print(f"{args.model}: predicted vs measured peak of live tensor bytes (CPU, {args.precision}, {args.optimizer})")
    print(report.table(["seq_len", "predicted", "measured", "error"], rows))
    _write_json(args.json_path, {"results": [r.to_dict() for r in results]})


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (exit 2), not the whole usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memplan", description="Simulation-first memory planner for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str, fn: Callable) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, epilog="example:\n  " + EXAMPLES[name],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(fn=fn)
        return p

    p = add("simulate", "simulate one training step's memory", cmd_simulate)
    _add_model_options(p)
    p.add_argument("--plan", help="simulate under this plan file")
    p.add_argument("--plot", help="write the memory curve (or the sweep) as PNG")

    p = add("verify", "run a real step on CPU and compare measured with predicted peak", cmd_verify)
    _add_model_options(p)
    p.add_argument("--plan", help="apply this plan to the real model first")

    from planner import cli_plan, cli_diagnose  # subcommands with more options live in their own modules

    cli_plan.register(add, _add_model_options, _config, _write_json)
    cli_diagnose.register(add, _add_model_options, _config, _write_json)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        args.fn(args)
    except ValueError as exc:
        message = " ".join(str(exc).split())
        print(f"memplan {args.command}: error: {message}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path that cannot be read or written
        where = f" '{exc.filename}'" if exc.filename else ""
        print(f"memplan {args.command}: error: {exc.strerror or exc}{where}; check the path", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and closed: not an error
        sys.stdout = open(os.devnull, "w")
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
