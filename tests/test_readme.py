"""Every command in README.md runs: the `memplan ...` lines of its shell blocks and its Python blocks.

The fast test parses each command with memplan's own argparse parser (a renamed or removed flag
fails here in the fast tier); the slow one runs them all, in README order, in a temporary folder.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return [(m.group(1), m.group(2)) for m in _FENCE.finditer(text)]


def memplan_commands(text: str) -> list[list[str]]:
    """argv (without 'memplan') of every `memplan ...` line in the shell blocks; `\\` joins lines."""
    commands = []
    for lang, body in code_blocks(text):
        if lang not in ("bash", "sh", "shell", "console", ""):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("memplan "):
                commands.append(shlex.split(line, comments=True)[1:])
    return commands


def python_blocks(text: str) -> list[str]:
    return [body for lang, body in code_blocks(text) if lang == "python"]


def test_readme_is_short_and_names_the_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 150
    for target in ("make demo", "make test", "make test-all"):
        assert target in text
    assert len(memplan_commands(text)) >= 5


def test_readme_commands_parse():
    from planner.cli.main import _build_parser

    for argv in memplan_commands(README.read_text(encoding="utf-8")):
        try:
            _build_parser().parse_args(argv)
        except SystemExit as exc:  # argparse's usage error
            pytest.fail(f"README command does not parse (exit {exc.code}): memplan {shlex.join(argv)}")


@pytest.mark.slow
def test_readme_commands_run(tmp_path, monkeypatch, capsys):
    from planner.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    text = README.read_text(encoding="utf-8")
    for argv in memplan_commands(text):
        rc = main(argv)
        out = capsys.readouterr()
        assert rc == 0, f"memplan {shlex.join(argv)} exited {rc}:\n{out.out}\n{out.err}"
    for i, source in enumerate(python_blocks(text)):
        exec(compile(source, f"README.md python block {i}", "exec"), {"__name__": "__readme__"})
