"""CLI startup: wall time of `memplan --help`, each subcommand's --help and `diagnose --oom-message`
as subprocesses, the median of RUNS runs each, against the targets of issue 21 (0.5 s and 1 s).

python -m benchmarks.cli_startup [--quick] [--out DIR]  (or python -m benchmarks --only startup)
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import Options, print_table, standalone_main
from planner.cli.main import SUBCOMMANDS

ROOT = Path(__file__).resolve().parents[1]
HELP_TARGET_S = 0.5
OOM_TARGET_S = 1.0
RUNS = 5
QUICK_RUNS = 3
OOM_MESSAGE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
    "of 79.19 GiB of which 1.20 GiB is free. Of the allocated memory 70.10 GiB is allocated by PyTorch, "
    "and 6.50 GiB is reserved by PyTorch but unallocated."
)
COMMANDS = [module.__name__.rsplit(".", 1)[-1] for module in SUBCOMMANDS]  # each module is named as its command
CASES = [
    ("--help", ["--help"], HELP_TARGET_S),
    *((f"{c} --help", [c, "--help"], HELP_TARGET_S) for c in COMMANDS),
    ("diagnose --oom-message", ["diagnose", "--oom-message", OOM_MESSAGE], OOM_TARGET_S),
]


def _command() -> list[str]:
    exe = ROOT / ".venv" / "bin" / "memplan"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "planner.cli.main"]


def _wall_s(argv: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    done = subprocess.run(_command() + argv, cwd=ROOT, capture_output=True, text=True)
    return time.perf_counter() - t0, done


def run(opts: Options) -> list[dict]:
    runs = QUICK_RUNS if opts.quick else RUNS
    rows = []
    for name, argv, target_s in CASES:
        walls, returncodes, stderr = [], set(), ""
        for _ in range(runs):
            wall_s, done = _wall_s(argv)
            walls.append(round(wall_s, 3))
            returncodes.add(done.returncode)
            stderr = stderr or (done.stderr[-500:] if done.returncode else "")
        median_s = statistics.median(walls)
        ok = returncodes == {0}
        rows.append(
            {
                "case": name,
                "median_s": round(median_s, 3),
                "runs_s": walls,
                "target_s": target_s,
                "meets_target": ok and median_s <= target_s,
                "returncode": max(returncodes),
                "stderr_tail": stderr,
            }
        )
    return rows


def show(rows: list[dict]) -> None:
    print_table(
        f"startup: memplan as a subprocess (median of {len(rows[0]['runs_s'])} runs)",
        ["case", "median_s", "min_s", "max_s", "target_s", "meets target", "rc"],
        [
            [
                r["case"],
                f"{r['median_s']:.3f}",
                f"{min(r['runs_s']):.3f}",
                f"{max(r['runs_s']):.3f}",
                f"{r['target_s']:.1f}",
                "yes" if r["meets_target"] else "no",
                r["returncode"],
            ]
            for r in rows
        ],
    )


def main(argv: list[str] | None = None) -> int:
    rows = standalone_main("cli_startup", __doc__, run, show, argv)
    return 0 if all(r["meets_target"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
