"""Table 5: wall time of `memplan simulate` as a subprocess (issue 2): one 70B point and a sweep."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import Options, print_table

ROOT = Path(__file__).resolve().parents[1]
BASE = ["simulate", "--model", "llama-70b", "--gpu", "h100-80gb", "--precision", "bf16-mixed", "--seq-len"]
CASES = [
    ("single", "4096", 15.0),
    ("sweep-4", "512,1024,2048,4096", 30.0),
    ("sweep-8", "512,1024,2048,4096,8192,16384,32768,65536", 30.0),
]
QUICK = ("single", "sweep-8")


def _command() -> list[str]:
    exe = ROOT / ".venv" / "bin" / "memplan"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "planner.cli.main"]


def run(opts: Options) -> list[dict]:
    rows = []
    cases = [c for c in CASES if c[0] in QUICK] if opts.quick else CASES
    for name, seqs, target in cases:
        t0 = time.perf_counter()
        p = subprocess.run(_command() + BASE + [seqs], cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        rows.append(
            {
                "case": name,
                "seq_lens": [int(s) for s in seqs.split(",")],
                "wall_s": round(wall, 2),
                "target_s": target,
                "meets_target": p.returncode == 0 and wall <= target,
                "returncode": p.returncode,
                "stderr_tail": p.stderr[-500:] if p.returncode else "",
            }
        )
    return rows


def show(rows: list[dict]) -> None:
    print_table(
        "speed: memplan simulate --model llama-70b --gpu h100-80gb --precision bf16-mixed",
        ["case", "points", "wall_s", "target_s", "meets target", "rc"],
        [
            [
                r["case"],
                len(r["seq_lens"]),
                f"{r['wall_s']:.1f}",
                f"{r['target_s']:.0f}",
                "yes" if r["meets_target"] else "no",
                r["returncode"],
            ]
            for r in rows
        ],
    )
