"""Shared helpers: run options, selection by --models, timing, number formatting, table printing."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from planner.cli.report import table
from planner.tracing.graph import CATEGORIES
from planner.units import format_bytes


@dataclass(frozen=True)
class Options:
    quick: bool = False
    models: tuple[str, ...] = ()  # empty: the table's default set

    def select(self, entries: list, quick_names: tuple[str, ...] | None = None) -> list:
        """Entries (first item is the name) picked by --models, else the quick or full default set."""
        if self.models:
            return [e for e in entries if e[0] in self.models]
        if self.quick and quick_names is not None:
            return [e for e in entries if e[0] in quick_names]
        return entries


@contextmanager
def timer(out: dict, key: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        out[key] = round(time.perf_counter() - t0, 3)


def saved_activation_bytes(timeline) -> int:
    """Activation bytes live when backward starts: what the forward keeps for backward."""
    fwd = [k for k, p in enumerate(timeline.phases) if p in ("forward", "loss")]
    return int(timeline.by_category[fwd[-1], CATEGORIES.index("activation")]) if fwd else 0


def graph_flops(graph) -> int:
    return int(sum(op.flops for op in graph.ops))


def pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x * 100:.{digits}f}%"


def gb(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def print_table(title: str, headers, rows) -> None:
    print(f"\n== {title} ==")
    print(table(headers, rows))


def to_jsonable(x):
    if isinstance(x, dict):
        return {k: to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def standalone_main(name: str, doc: str, run, show, argv: list[str] | None = None) -> list:
    """`python -m benchmarks.NAME [--quick] [--out DIR]`: run, write DIR/NAME.json, print the table;
    returns the rows."""
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=doc.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the reduced set")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help=f"folder for {name}.json")
    args = p.parse_args(argv)
    rows = run(Options(quick=args.quick))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(to_jsonable(rows), indent=1))
    show(rows)
    print(f"wrote {out / f'{name}.json'}")
    return rows
