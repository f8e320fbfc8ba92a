"""`memplan` command line: wires subcommands to the public API, prints reports.

Every user error (bad spec, bad size, infeasible budget, malformed plan) ends as one line on
stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from planner.cli import apply, calibrate, diagnose, fit, plan, simulate, verify
from planner.errors import MemplanError

__all__ = ["main"]

SUBCOMMANDS = (simulate, verify, plan, apply, diagnose, fit, calibrate)


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
        if (action.required or not action.option_strings or default is argparse.SUPPRESS
                or default in (None, False, "", [], ()) or "%(default)" in text):
            return text
        return f"{text} (default: {str(default).replace('%', '%%')})"


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memplan", description="Simulation-first memory planner for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help_text: str, fn: Callable, example: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, epilog="example:\n  " + example,
                           formatter_class=_HelpFormatter)
        p.set_defaults(fn=fn)
        return p

    for command in SUBCOMMANDS:
        command.register(add)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        args.fn(args)
    except (MemplanError, ValueError) as exc:  # memplan's errors; any other ValueError too, for safety
        message = " ".join(str(exc).split())
        print(f"memplan {args.command}: error: {message}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path that cannot be read or written
        where = f" '{exc.filename}'" if exc.filename else ""
        print(f"memplan {args.command}: error: {exc.strerror or exc}{where}; check the path", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and closed: not an error
        sys.stdout = open(os.devnull, "w")
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
