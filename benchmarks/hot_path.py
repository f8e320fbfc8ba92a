"""Hot path (issue 21, item 7): wall time of `memplan simulate` and `memplan plan` as subprocesses on
big models, with depth folding (the default) against a full trace of every block
(MEMPLAN_FULL_TRACE=1), run side by side and interleaved, the median of RUNS runs each (one for llama-405b and DeepSeek-V3).

Models: the llama-7b, llama-70b and llama-405b presets, and transformers' DeepSeek-V3 config at its
defaults (671B: 61 layers, 256 routed experts, MLA), written to a config.json and traced from it.
Every job: seq 4096, bf16-mixed, h100-80gb, FSDP2 (`--zero 3`) over 64 GPUs (DeepSeek-V3: 256);
`plan` asks for 90% of the unplanned peak. Targets (issue 21): llama-70b simulate under 5 s and
plan under 10 s; DeepSeek-V3 simulate under 15 s.

python -m benchmarks.hot_path [--quick] [--out DIR]  (or python -m benchmarks --only hot_path)
--quick: llama-70b only, one run each.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import Options, print_table, standalone_main
from planner.tracing.recorder import FULL_TRACE_ENV

ROOT = Path(__file__).resolve().parents[1]
RUNS = 3
JOB = ["--gpu", "h100-80gb", "--seq-len", "4096", "--precision", "bf16-mixed", "--zero", "3"]
MODELS = [  # (name, --model, --dp, runs): one run of each mode for the two biggest (their full traces take minutes)
    ("llama-7b", "llama-7b", 64, RUNS),
    ("llama-70b", "llama-70b", 64, RUNS),
    ("llama-405b", "llama-405b", 64, 1),
    ("deepseek-v3", "DEEPSEEK", 256, 1),
]
QUICK = ("llama-70b",)
TARGETS_S = {("llama-70b", "simulate"): 5.0, ("llama-70b", "plan"): 10.0, ("deepseek-v3", "simulate"): 15.0}
MODES = {"folded": {}, "full trace": {FULL_TRACE_ENV: "1"}}


def _deepseek_config(folder: Path) -> str:
    from transformers import DeepseekV3Config

    path = folder / "deepseek-v3" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    config = DeepseekV3Config().to_dict()
    config["architectures"] = ["DeepseekV3ForCausalLM"]
    path.write_text(json.dumps(config))
    return f"hf:{path}"


def _command() -> list[str]:
    exe = ROOT / ".venv" / "bin" / "memplan"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "planner.cli.main"]


def _run(argv: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    done = subprocess.run(_command() + argv, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})
    return time.perf_counter() - t0, done


def run(opts: Options) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, dp, runs in opts.select(MODELS, QUICK):
            runs = 1 if opts.quick else runs
            spec = _deepseek_config(Path(tmp)) if model == "DEEPSEEK" else model
            base = ["--model", spec, *JOB, "--dp", str(dp)]
            commands = {
                "simulate": ["simulate", *base],
                "plan": ["plan", *base, "--budget", "90%", "--out", str(Path(tmp) / f"{name}.json")],
            }
            for command, argv in commands.items():
                walls: dict[str, list[float]] = {m: [] for m in MODES}
                errors: dict[str, str] = {}
                for _ in range(runs):
                    for mode, env in MODES.items():  # interleaved: the machine's drift hits both
                        wall, done = _run(argv, env)
                        walls[mode].append(round(wall, 2))
                        if done.returncode:
                            errors[mode] = done.stderr.strip().splitlines()[-1][-300:] if done.stderr else "failed"
                folded, full = (statistics.median(walls[m]) for m in MODES)
                target = TARGETS_S.get((name, command))
                rows.append(
                    {
                        "model": name,
                        "command": command,
                        "dp": dp,
                        "folded_s": folded,
                        "full_trace_s": full,
                        "speedup": full / folded if folded else None,
                        "walls": walls,
                        "target_s": target,
                        "meets_target": None if target is None else (not errors and folded <= target),
                        "errors": errors,
                    }
                )
    return rows


def show(rows: list[dict]) -> None:
    print_table(
        f"hot path: memplan CLI wall time, {' '.join(JOB)} --dp N (median; folded = default)",
        ["model", "command", "dp", "folded", "full trace", "speedup", "target", "meets", "error"],
        [
            [
                r["model"],
                r["command"],
                r["dp"],
                f"{r['folded_s']:.1f} s",
                f"{r['full_trace_s']:.1f} s",
                "-" if r["speedup"] is None else f"x{r['speedup']:.1f}",
                "-" if r["target_s"] is None else f"{r['target_s']:.0f} s",
                "-" if r["meets_target"] is None else ("yes" if r["meets_target"] else "no"),
                "; ".join(f"{m}: {e}" for m, e in r["errors"].items()) or "-",
            ]
            for r in rows
        ],
    )


if __name__ == "__main__":
    standalone_main("hot_path", __doc__, run, show)
