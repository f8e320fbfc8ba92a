"""Human-readable output: byte formatting, tables and figures. Algorithms never print.

Torch-free at import (``table`` serves every command); a function that needs the planner's
modules imports them, already loaded by the command that calls it.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from planner.safe_io import write_bytes
from planner.units import fit_verdict, format_bytes, format_count

if TYPE_CHECKING:
    from planner.analysis.configurations import ConfigurationReport

__all__ = ["configurations_table", "plot_curves", "plot_sweep", "plot_timeline", "table", "timeline_table"]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned text table (numbers right-aligned)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def fmt(row: list[str], is_header: bool = False) -> str:
        out = []
        for i, c in enumerate(row):
            numeric = not is_header and re.fullmatch(r"[-+0-9.,%x ]+(B|KiB|MiB|GiB|TiB|s|ms)?", c) is not None
            out.append(c.rjust(widths[i]) if numeric else c.ljust(widths[i]))
        return "  ".join(out).rstrip()

    lines = [fmt(cells[0], True), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells[1:]]
    return "\n".join(lines)


def timeline_table(result: dict, capacity_bytes: int | None = None) -> str:
    """The peak and its breakdown from a Timeline.to_dict()-shaped result."""
    from planner.tracing.graph import CATEGORIES
    from planner.tracing.moe import describe_routing

    rows = [[c, format_bytes(result["breakdown_at_peak"][c])] for c in CATEGORIES]
    rows.append(["total (peak)", format_bytes(result["peak_bytes"])])
    lines = [*_ranks_lines(result)] if "ranks" in result else []
    lines += _pipeline_lines(result) if "pipeline" in result else []
    lines += [
        f"peak {format_bytes(result['peak_bytes'])} in {result['peak_phase']} at "
        f"{result['peak_op']} (module '{result['peak_module'] or '<root>'}')",
        table(["category", "at peak"], rows),
        "",
        "model states per device: "
        + ", ".join(f"{k} {format_bytes(v)}" for k, v in result["model_states"].items())
        + f"; {format_count(result['num_parameters'])} parameters",
    ]
    if "moe_routing" in result.get("config", {}):
        lines.append(describe_routing(result["config"]["moe_routing"]))
    if capacity_bytes:
        lines.append(
            f"device capacity {format_bytes(capacity_bytes)}: {fit_verdict(result['peak_bytes'], capacity_bytes)}"
        )
    return "\n".join(lines)


def _worst_rank_note(result: dict) -> str:
    """' (worst rank R of N)' for a layout's result, else ''."""
    if "ranks" not in result:
        return ""
    return f" (worst rank {result['worst_rank']} of {result['layout']['world_size']})"


def ranks_table(roles: Sequence[dict]) -> str:
    """A layout's rank roles (the ``"ranks"`` JSON entries): their ranks, coordinates and peak."""
    rows = []
    for role in roles:
        ranks = role["ranks"]
        shown = ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]},{ranks[1]},...,{ranks[-1]}"
        coords = " ".join(f"{k}={v}" for k, v in role["coords"].items())
        rows.append([shown, coords, format_bytes(role["peak_bytes"]), role["peak_phase"], role["peak_op"]])
    return table(["ranks", "coords (first)", "peak", "phase", "op at peak"], rows)


def _ranks_lines(result: dict) -> list[str]:
    """A layout's roles (their ranks, coordinates, peak) and which rank is the worst."""
    layout = " × ".join(f"{d} {result['layout'][d]}" for d in ("pp", "dp", "cp", "tp") if result["layout"][d] > 1)
    if result["layout"].get("ep", 1) > 1:
        layout += f", ep {result['layout']['ep']} within dp × cp"
    return [
        f"{result['layout']['world_size']} ranks ({layout}), {len(result['ranks'])} distinct; worst rank "
        f"{result['worst_rank']}, whose step is shown below",
        ranks_table(result["ranks"]),
        "",
    ]


def _pipeline_lines(result: dict) -> list[str]:
    """A pipeline's schedule, split, each pp rank's stages, in-flight microbatches and peak, and its bubble."""
    pl = result["pipeline"]
    stages = {role["coords"]["pp"]: role["stage"] for role in result["ranks"]}
    rows = [
        [r, ",".join(map(str, stages[r])), pl["in_flight"][r], format_bytes(peak), pl["peak_actions"][r]]
        for r, peak in enumerate(pl["peak_bytes_per_pp_rank"])
    ]
    return [
        f"pipeline {pl['schedule']}: {pl['pp']} ranks × {pl['stages_per_rank']} stages, {pl['microbatches']} "
        f"microbatches, blocks per stage {','.join(map(str, pl['blocks_per_stage']))}; step {pl['step_s'] * 1e3:.1f} ms, "
        f"bubble {pl['bubble_fraction'] * 100:.1f}%, first/last stage peak {pl['first_last_ratio']:.2f}",
        table(["pp rank", "stages", "in flight", "peak", "action at peak"], rows),
        *(f"warning: {w}" for w in pl.get("warnings", ())),
        "",
    ]


def _save_png(fig, path: str) -> None:
    """Write `fig` as PNG to exactly `path` (matplotlib would add '.png' to a name without it):
    atomic for a file, in place for a device or FIFO, refused for a directory."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    write_bytes(path, buf.getvalue())


def _plot_unit(largest_bytes: int) -> tuple[str, int]:
    """The unit that scales a plot to its curve (a tiny model is not a flat line in GiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest_bytes >= size:
            return unit, size
    return "B", 1


def _capacity_line(ax, capacity_bytes: int | None, largest_bytes: int, size: int) -> str:
    """Draw the capacity line when it is on the curve's scale (at most twice its top); else
    return a note for the title."""
    if not capacity_bytes:
        return ""
    if capacity_bytes <= 2 * largest_bytes:
        ax.axhline(capacity_bytes / size, color="red", linestyle="--", label="device capacity")
        return ""
    return f" (device capacity {format_bytes(capacity_bytes)}, off the scale)"


def plot_timeline(result: dict, path: str, capacity_bytes: int | None = None) -> None:
    """Stacked area of memory by category over the step, written as PNG."""
    import matplotlib

    from planner.tracing.graph import CATEGORIES

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(result["timeline"])
    rows += [rows[-1]] * max(1, len(rows) // 50)  # the optimizer step is one sample: give it width
    x = list(range(len(rows)))
    unit, size = _plot_unit(result["peak_bytes"])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.stackplot(x, *[[r[c] / size for r in rows] for c in CATEGORIES], labels=CATEGORIES, alpha=0.85)
    note = _capacity_line(ax, capacity_bytes, result["peak_bytes"], size)
    phases = [r["phase"] for r in rows]
    for k, phase in enumerate(("loss", "backward", "optimizer")):
        if phase in phases:
            ax.axvline(phases.index(phase), color="gray", linewidth=0.8)
            ax.text(phases.index(phase), ax.get_ylim()[1] * (0.97 - 0.05 * k), " " + phase, fontsize=8, va="top")
    cfg = result.get("config", {})
    ax.set_title(
        f"{cfg.get('model', '')} batch {cfg.get('batch_size')} seq {cfg.get('seq_len')} "
        f"{cfg.get('precision')} on {cfg.get('gpu')}: peak {format_bytes(result['peak_bytes'])}"
        f"{_worst_rank_note(result)}{note}"
    )
    ax.set_xlabel("step progress (samples, in execution order)")
    ax.set_ylabel(unit)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)


def plot_curves(curves: dict[str, dict], path: str, budget_bytes: int, capacity_bytes: int | None, title: str) -> None:
    """Total memory of several simulated steps (Timeline.to_dict() results) over step progress
    (0 to 1, since a plan's replays add samples), with the budget and capacity lines, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    largest = max(r["peak_bytes"] for r in curves.values())
    unit, size = _plot_unit(largest)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, result in curves.items():
        rows = result["timeline"]
        x = [k / max(1, len(rows) - 1) for k in range(len(rows))]
        ax.plot(x, [r["total_bytes"] / size for r in rows], label=f"{label}: peak {format_bytes(result['peak_bytes'])}")
    ax.axhline(budget_bytes / size, color="green", linestyle=":", label=f"budget {format_bytes(budget_bytes)}")
    note = _capacity_line(ax, capacity_bytes, largest, size)
    ax.set_xlabel("step progress (forward, loss, backward, optimizer)")
    ax.set_ylabel(unit)
    ax.set_title(title + note, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)


def plot_sweep(
    seq_lens: Sequence[int], peaks: Sequence[int], path: str, capacity_bytes: int | None, title: str
) -> None:
    """Peak against sequence length with the device capacity line, written as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, size = _plot_unit(max(peaks))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(seq_lens, [p / size for p in peaks], marker="o", label="predicted peak")
    note = _capacity_line(ax, capacity_bytes, max(peaks), size)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel(unit)
    ax.set_title(title + note)
    ax.legend()
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)


def configurations_table(report: ConfigurationReport, max_rows: int) -> str:
    """The cheapest configurations that fit (fewest GPU-hours first) and the recommendation."""
    fitting = sorted(
        (c for c in report.configurations if c.fits), key=lambda c: (c.gpu_hours_per_million_tokens, c.gpus)
    )
    rows = [
        [
            c.gpus,
            c.optimizer,
            "yes" if c.cpu_offload else "no",
            "yes" if c.plan else "no",
            f"{c.micro_batch} x {c.accumulation}",
            format_bytes(c.peak_bytes),
            format_bytes(c.host_bytes) if c.cpu_offload else "-",
            f"{c.step_s:.3g} s",
            f"{c.tokens_per_s_per_gpu:,.0f}",
            f"{c.gpu_hours_per_million_tokens:.3g}",
        ]
        for c in fitting[:max_rows]
    ]
    lines = [f"configurations that fit ({len(fitting)} of {len(report.configurations)} tried; fewest GPU-hours first):"]
    if rows:
        lines.append(
            table(
                [
                    "GPUs",
                    "optimizer",
                    "host offload",
                    "plan",
                    "micro-batch x steps",
                    "peak / GPU",
                    "host / GPU",
                    "step time",
                    "tokens/s/GPU",
                    "GPU-h / M tokens",
                ],
                rows,
            )
        )
    best = report.recommended
    lines.append(
        f"recommended: {best.label} ({best.gpu_hours_per_million_tokens:.3g} GPU-hours per million tokens)"
        if best
        else f"recommended: none fits{_host_bound(report)}; raise --max-gpus, shorten the sequence or the batch"
    )
    return "\n".join(lines)


def _host_bound(report: ConfigurationReport) -> str:
    """' (host offload fits the GPU on 8 GPUs but needs ...)' where only host memory binds, else ''."""
    from planner.analysis.configurations import HOST_MEMORY_BYTES_PER_GPU

    held = [
        c
        for c in report.configurations
        if c.cpu_offload and c.peak_bytes <= report.budget_bytes and c.host_bytes > HOST_MEMORY_BYTES_PER_GPU
    ]
    if not held:
        return ""
    least = min(held, key=lambda c: c.host_bytes)
    return (
        f" (host offload fits the GPU on {least.gpus} GPU{'s' if least.gpus > 1 else ''} but needs "
        f"{format_bytes(least.host_bytes)} of host memory per GPU, more than {format_bytes(HOST_MEMORY_BYTES_PER_GPU)})"
    )
