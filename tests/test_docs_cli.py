"""docs/cli.md is the parser's help, word for word: it cannot drift from the CLI."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _generator():
    spec = importlib.util.spec_from_file_location("memplan_docs_gen_cli", DOCS / "gen_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_matches_the_parser():
    gen = _generator()
    committed = (DOCS / "cli.md").read_text(encoding="utf-8")
    assert committed == gen.render(), "docs/cli.md is out of date: run .venv/bin/python docs/gen_cli.py"


def test_cli_reference_has_every_subcommand():
    from planner.cli.main import _build_parser

    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    sub = _generator()._subparsers(_build_parser())
    for name in sub.choices:
        assert f"## memplan {name}\n" in text
