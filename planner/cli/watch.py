"""`memplan watch`: a MemoryMonitor log as a table, and measured against predicted peak per step."""

from __future__ import annotations

import io
from pathlib import Path
from statistics import median

from planner.cli import report
from planner.cli.options import write_json
from planner.errors import MemplanError
from planner.safe_io import loads_json, read_bounded, write_bytes
from planner.units import format_bytes

__all__ = ["read_log", "register", "run", "summary"]

EXAMPLE = "memplan watch mem.jsonl --plot mem.png"
LOG_MAX_BYTES = 256 * 2**20
"""Largest monitor log read (about 300 bytes per step: close to a million steps)."""


def register(add) -> None:
    p = add(
        "watch", "show a training run's memory log (planner.MemoryMonitor) against memplan's prediction", run, EXAMPLE
    )
    p.add_argument("log", help="JSON-lines log written by planner.MemoryMonitor")
    p.add_argument("--plot", help="write measured vs predicted peak per step (budget and plan switches marked) as PNG")
    p.add_argument("--json", dest="json_path", help="write the summary as JSON")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_log(path: str | Path) -> list[dict]:
    """The step records of a monitor log; a line that is not a step record is a MemplanError."""
    records = []
    text = read_bounded(path, LOG_MAX_BYTES, "monitor log").decode("utf-8", "replace")
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:  # bounded depth and numbers: a damaged or hostile line is refused, not a traceback
            record = loads_json(line)
        except ValueError:
            record = None
        if not (
            isinstance(record, dict) and _number(record.get("measured_peak_bytes")) and _number(record.get("step"))
        ):
            raise MemplanError(
                f"{path} line {n} is not a memplan monitor record; pass the log that planner.MemoryMonitor writes"
            )
        records.append(record)
    if not records:
        raise MemplanError(f"{path} holds no steps; run a loop under planner.MemoryMonitor first")
    return records


def summary(records: list[dict]) -> dict:
    """Peak, budget excess, drift and plan switches over the whole log (a retarget that found no
    plan switched nothing: it is listed under failed_retargets)."""
    drifts = [r["drift"] for r in records if r.get("drift") is not None]
    over = [r["step"] for r in records if r.get("budget_bytes") and r["measured_peak_bytes"] > r["budget_bytes"]]
    return {
        "steps": len(records),
        "max_measured_peak_bytes": max(r["measured_peak_bytes"] for r in records),
        "steps_over_budget": over,
        "median_drift": median(drifts) if drifts else None,
        "max_abs_drift": max(map(abs, drifts)) if drifts else None,
        "switches": [{"step": r["step"], **s} for r in records for s in r.get("switches", []) if "failed" not in s],
        "failed_retargets": [{"step": r["step"], **s} for r in records for s in r.get("switches", []) if "failed" in s],
        "empty_cache_count": sum(bool(r.get("empty_cache")) for r in records),
        "total_step_s": sum(r.get("step_s", 0.0) for r in records),
    }


def _size(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def _rows(records: list[dict]) -> list[list[object]]:
    rows = []
    for r in records:
        plan = r.get("plan") or {}
        drift = r.get("drift")
        rows.append(
            [
                r["step"],
                r.get("seq_len") or "-",
                _size(r["measured_peak_bytes"]),
                _size(r.get("predicted_peak_bytes")),
                "-" if drift is None else f"{drift * 100:+.1f}%",
                _size(r.get("budget_bytes")),
                plan.get("recompute", "-"),
                f"{r.get('step_s', 0.0):.3f}",
                "; ".join(s["reason"] + (" (failed: no plan)" if "failed" in s else "") for s in r.get("switches", [])),
            ]
        )
    return rows


def plot(records: list[dict], path: str) -> None:
    """Measured and predicted peak per step, the budget, and a mark at every plan switch (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.plot(steps, [r["measured_peak_bytes"] / mib for r in records], marker="o", label="measured peak")
    predicted = [(r["step"], r["predicted_peak_bytes"] / mib) for r in records if r.get("predicted_peak_bytes")]
    if predicted:
        ax.plot(*zip(*predicted), marker="x", linestyle="--", label="predicted peak")
    budgets = [(r["step"], r["budget_bytes"] / mib) for r in records if r.get("budget_bytes")]
    if budgets:
        ax.step(*zip(*budgets), where="post", color="red", label="budget")
    for r in records:
        for k, s in enumerate(s for s in r.get("switches", []) if "failed" not in s):
            # a length switch runs in its own step; a monitor's retarget takes effect at the next one
            x = r["step"] - 0.5 if "plan_seq_len" in s else r["step"] + 0.5
            ax.axvline(x, color="gray", linewidth=0.8, linestyle=":")
            ax.annotate(
                s["reason"][:48],
                (x, 1 - 0.5 * k),
                xycoords=("data", "axes fraction"),
                fontsize=6,
                rotation=90,
                va="top",
                ha="right",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("MiB")
    ax.set_title("memplan watch: measured vs predicted peak per step (dotted: plan switches)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes(path, buf.getvalue())


def run(args) -> None:
    records = read_log(args.log)
    headers = ["step", "seq", "measured", "predicted", "drift", "budget", "recompute", "step s", "switch"]
    print(report.table(headers, _rows(records)))
    s = summary(records)
    over = s["steps_over_budget"]
    drift = "" if s["median_drift"] is None else f", median drift {s['median_drift'] * 100:+.2f}%"
    print(
        f"{s['steps']} steps, max measured peak {format_bytes(s['max_measured_peak_bytes'])}{drift}, "
        f"{len(s['switches'])} plan switches, "
        + (f"{len(s['failed_retargets'])} failed retargets, " if s["failed_retargets"] else "")
        + (f"over budget at steps {over}" if over else "no step over budget")
    )
    write_json(args.json_path, s)
    if args.plot:
        plot(records, args.plot)
        print(f"wrote {args.plot}")
