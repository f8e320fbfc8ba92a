"""Ctrl-C after and during a CP-SAT solve (issue 10): the caller's SIGINT handler survives every
solve, so a training script interrupted later still runs its `finally` and removes spill files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from planner.config import TrainConfig
from planner.errors import InfeasibleBudget
from planner.simulation.step import simulate
from planner.solver.cpsat import solve_choices

CONFIG = TrainConfig(batch_size=1, seq_len=32)


def between(graph, config: TrainConfig = CONFIG) -> int:
    """A budget halfway between the smallest reachable peak and the no-plan peak."""
    with pytest.raises(InfeasibleBudget) as info:
        solve_choices(graph, config, 1, time_limit_s=5)
    return (info.value.smallest_peak_bytes + simulate(graph, config).peak_bytes) // 2


def test_python_sigint_handler_works_after_a_solve(traced) -> None:
    graph = traced("gpt2-tiny", 1, 32)
    budget = between(graph)
    seen: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        solve_choices(graph, CONFIG, budget, time_limit_s=5)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [signal.SIGINT]


def test_ctrl_c_during_a_solve_stops_it_and_raises(traced) -> None:
    graph = traced("llama-7b-tiny", 1, 32)
    budget = between(graph)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    start = time.perf_counter()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        while time.perf_counter() - start < 20:  # keep solving until the interrupt lands
            solve_choices(graph, CONFIG, budget, time_limit_s=60)
    timer.cancel()
    assert time.perf_counter() - start < 30
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch
    from offload_models import GatedNet, offload_plan
    from planner.config import TrainConfig
    from planner.runtime.apply import apply_plan
    from planner.simulation.step import simulate
    from planner.solver.cpsat import solve_choices
    from planner.tracing.recorder import trace
    config = TrainConfig(batch_size=1, seq_len=16)
    graph = trace("gpt2-tiny", batch_size=1, seq_len=16)
    try:
        solve_choices(graph, config, 1, time_limit_s=5)
    except ValueError as e:
        smallest = e.smallest_peak_bytes
    solve_choices(graph, config, (smallest + simulate(graph, config).peak_bytes) // 2, time_limit_s=5)
    model = GatedNet()
    handle = apply_plan(model, offload_plan(model, ["blocks.0", "blocks.1"], "disk"), spill_dir={spill!r})
    try:
        loss = model(torch.tensor([[1, 5, 7, 2], [9, 4, 0, 6]]))
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C before backward
        loss.backward()
    finally:
        handle.remove()
        print("finally ran", flush=True)
""")


@pytest.mark.slow
def test_sigint_after_a_solve_runs_finally_and_removes_spill_files(tmp_path: Path) -> None:
    code = _SCRIPT.format(tests=str(Path(__file__).parent), spill=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "finally ran" in done.stdout, done.stderr[-2000:]
    assert "KeyboardInterrupt" in done.stderr
    assert list(tmp_path.iterdir()) == []
