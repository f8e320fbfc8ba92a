"""Shared helpers for the CLI tests: run `memplan` in-process and check one-line user errors."""

from __future__ import annotations

from planner.cli.main import main


def run(argv, capsys):
    """main(argv) -> (exit code, stdout, stderr); argparse usage errors exit via SystemExit."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code, err, commands, *needles):
    """Exit code 2, one stderr line `memplan COMMAND: error: ...` (COMMAND one of `commands`), no traceback."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    commands = (commands,) if isinstance(commands, str) else tuple(commands)
    assert any(lines[0].startswith(f"memplan {c}: error:") for c in commands), err
    for n in needles:
        assert n in lines[0], (n, err)
