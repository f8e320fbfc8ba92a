"""`memplan` command line: wires subcommands to the public API, prints reports.

Every user error (bad spec, bad size, infeasible budget, malformed plan) ends as one line on
stderr and exit code 2. Building the parser imports nothing heavy; a command imports torch and
OR-Tools when it runs. A Ctrl-C, while importing too (planner.cli.guard), is one line and exit 130.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable

from planner.cli.guard import guarded_imports

try:  # light, but a loaded machine may take a while: a Ctrl-C meanwhile is one line and 130 too
    with guarded_imports():
        from planner.cli import apply, calibrate, diagnose, fit, plan, simulate, verify, watch
        from planner.cli.options import default_seq_len
        from planner.errors import MemplanError
        from planner.safe_io import clean
except KeyboardInterrupt:
    sys.stderr.write("memplan: interrupted\n")
    raise SystemExit(130) from None

__all__ = ["main", "run_command"]

SUBCOMMANDS = (simulate, verify, plan, apply, diagnose, fit, calibrate, watch)


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (exit 2), not the whole usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The example epilog as written, and each optional flag's default in --help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if isinstance(default, list) and len(default) == 1:
            default = default[0]
        if (
            action.required
            or not action.option_strings
            or default is argparse.SUPPRESS
            or default in (None, False, "", [], ())
            or "%(default)" in text
        ):
            return text
        return f"{text} (default: {str(default).replace('%', '%%')})"


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memplan", description="Simulation-first memory planner for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str, fn: Callable, example: str) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name, help=help_text, description=help_text, epilog="example:\n  " + example, formatter_class=_HelpFormatter
        )
        p.set_defaults(fn=fn)
        return p

    for command in SUBCOMMANDS:
        command.register(add)
    return parser


ERROR_MAX_CHARS = 1000
"""Longest error line printed (messages may quote file contents; those are capped and cleaned)."""


def main(argv: list[str] | None = None) -> int:
    command = "memplan"
    try:
        args = _build_parser().parse_args(argv)
        command = f"memplan {args.command}"
        default_seq_len(args)  # --seq-len not given: 512, or the model's position limit where smaller
        args.fn(args)
        sys.stdout.flush()  # a closed pipe fails here, inside the try, not at interpreter exit
    except BrokenPipeError:  # output piped into `head` and closed: not an error (an OSError, so first)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit-time flush must not fail
        return 0
    except (MemplanError, ValueError) as exc:  # memplan's errors; any other ValueError too, for safety
        print(f"{command}: error: {clean(' '.join(str(exc).split()), ERROR_MAX_CHARS)}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path that cannot be read or written
        where = f" '{clean(exc.filename)}'" if exc.filename else ""
        print(f"{command}: error: {clean(exc.strerror or exc)}{where}; check the path", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return 130
    return 0


GC_THRESHOLDS = (50_000, 20, 20)
"""The garbage-collector thresholds of the commands that only trace on fake tensors (CPython's are
700, 10, 10). A trace makes millions of short-lived objects, and with the default thresholds
collections took 12-17% of a llama-70b `simulate` (0.64 of 5.3 s) or `plan` (1.7 of 10 s); with
these, 0.2-0.5 s, at the same peak memory."""

FAKE_ONLY_COMMANDS = ("simulate", "plan", "fit", "diagnose")
"""Commands that run no real model: the others (verify, calibrate, ...) measure real steps, whose
tensors must be freed when a default collection would free them."""


def run_command() -> int:
    """The ``memplan`` executable: :func:`main` in a process of its own, whose garbage collector
    runs less often for FAKE_ONLY_COMMANDS (GC_THRESHOLDS). Callers of :func:`main` keep theirs."""
    if sys.argv[1:2] and sys.argv[1] in FAKE_ONLY_COMMANDS:
        gc.set_threshold(*GC_THRESHOLDS)
    return main()


if __name__ == "__main__":
    sys.exit(run_command())
