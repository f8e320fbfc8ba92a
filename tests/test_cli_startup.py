"""`memplan --help` starts at once: building the parser, every --help and `diagnose --oom-message`
import no heavy library (not timed here: benchmarks/cli_startup.py times them)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

HEAVY = ("torch", "numpy", "ortools", "matplotlib", "transformers")

_SCRIPT = textwrap.dedent("""
    import contextlib, io, sys
    from planner.cli.main import SUBCOMMANDS, _build_parser, main

    parser = _build_parser()
    names = [[]] + [[c.__name__.rsplit(".", 1)[-1]] for c in SUBCOMMANDS]
    for argv in names:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                parser.parse_args(argv + ["--help"])
            except SystemExit as exc:
                assert exc.code == 0, (argv, exc.code)
        assert "usage: memplan" in out.getvalue(), argv
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["diagnose", "--oom-message", "CUDA out of memory. Tried to allocate 2.00 GiB"]) == 0
    print(" ".join(m for m in {heavy!r} if m in sys.modules))
""")


def test_help_and_oom_message_import_nothing_heavy() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(heavy=HEAVY)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", f"imported by --help: {done.stdout.strip()}"


def test_the_fake_only_commands_collect_garbage_less_often_and_main_leaves_the_callers_collector() -> None:
    script = textwrap.dedent("""
        import contextlib, gc, io, sys
        from planner.cli.main import GC_THRESHOLDS, main, run_command

        before = gc.get_threshold()
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["diagnose", "--oom-message", "CUDA out of memory. Tried to allocate 2.00 GiB"]) == 0
        assert gc.get_threshold() == before
        sys.argv = ["memplan", "diagnose", "--oom-message", "CUDA out of memory. Tried to allocate 2.00 GiB"]
        with contextlib.redirect_stdout(io.StringIO()):
            assert run_command() == 0
        assert gc.get_threshold() == GC_THRESHOLDS != before
        gc.set_threshold(*before)
        sys.argv = ["memplan", "verify", "--help"]  # a command that measures real steps keeps the defaults
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                run_command()
            except SystemExit:
                pass
        assert gc.get_threshold() == before
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
