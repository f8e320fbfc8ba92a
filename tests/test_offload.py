"""Offload of any saved tensor (issue 10): 0-d, views, non-contiguous, integer and bool; spill
files 0600; the spill directory goes on exceptions, KeyboardInterrupt, exit and SIGTERM."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from offload_models import GatedNet, offload_plan

from planner.runtime import cleanup
from planner.runtime.apply import apply_plan
from planner.runtime.offload import Spilled

IDX = torch.tensor([[1, 5, 7, 2], [9, 4, 0, 6]])


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    model.zero_grad()
    model(IDX).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("target", ["disk", "cpu"])
@pytest.mark.parametrize("paths", [["blocks.0", "blocks.1"], [""]], ids=["gated-blocks", "root"])
def test_offload_gated_residual_and_root_same_gradients(target: str, paths: list[str], tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GatedNet()
    expected = grads(model)
    with apply_plan(model, offload_plan(model, paths, target), spill_dir=tmp_path):
        got = grads(model)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor(2.5),  # 0-d: view(torch.uint8) used to fail
        lambda: torch.arange(12.0).reshape(3, 4).T,  # a transpose keeps its strides
        lambda: torch.arange(20.0)[::3],  # a strided view
        lambda: torch.arange(-5, 5, dtype=torch.int64).reshape(2, 5),
        lambda: torch.tensor([True, False, True]),
        lambda: torch.arange(6, dtype=torch.int8).reshape(2, 3)[:, 1:],
        lambda: torch.randn(3, dtype=torch.complex64).conj(),  # a lazy conjugate
        lambda: torch.randn(2, 3, dtype=torch.bfloat16),
        lambda: torch.empty(0, 3),
    ],
)
def test_spilled_round_trip_any_tensor(make, tmp_path: Path) -> None:
    t = make()
    spilled = Spilled(tmp_path / "0.bin", t)
    assert stat.S_IMODE(os.stat(tmp_path / "0.bin").st_mode) == 0o600
    back = spilled.load()
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t.resolve_conj())
    assert not (tmp_path / "0.bin").exists()


def test_spill_directory_removed_when_forward_raises(tmp_path: Path) -> None:
    model = GatedNet()
    handle = apply_plan(model, offload_plan(model, ["blocks.0", "blocks.1"], "disk"), spill_dir=tmp_path)
    spill_dir = handle.spill_dir
    assert spill_dir is not None and spill_dir in cleanup.tracked()
    with pytest.raises(KeyboardInterrupt), handle:
        model(IDX)
        raise KeyboardInterrupt
    assert not spill_dir.exists() and spill_dir not in cleanup.tracked()


_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    import torch
    from offload_models import GatedNet, offload_plan
    from planner.runtime.apply import apply_plan
    model = GatedNet()
    handle = apply_plan(model, offload_plan(model, ["blocks.0", "blocks.1"], "disk"), spill_dir={spill!r})
    loss = model(torch.tensor([[1, 5, 7, 2], [9, 4, 0, 6]]))  # spill files now exist
    print(len(os.listdir(handle.spill_dir)), flush=True)
    {ending}
""")


def _child(tmp_path: Path, ending: str) -> subprocess.Popen:
    code = _CHILD.format(tests=str(Path(__file__).parent), spill=str(tmp_path), ending=ending)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_spill_directory_removed_on_sigterm(tmp_path: Path) -> None:
    child = _child(tmp_path, "time.sleep(60)")
    assert int(child.stdout.readline()) > 0 and len(list(tmp_path.iterdir())) == 1
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == -signal.SIGTERM  # the default action still ends the process
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_spill_directory_removed_at_exit_without_remove(tmp_path: Path) -> None:
    child = _child(tmp_path, "raise KeyboardInterrupt")
    child.communicate(timeout=60)
    assert child.returncode != 0
    assert list(tmp_path.iterdir()) == []


def test_forked_child_leaves_the_parents_spill_directory(tmp_path: Path) -> None:
    spill = tmp_path / "memplan-spill-x"
    spill.mkdir()
    cleanup.track(spill)
    try:
        pid = os.fork()
        if pid == 0:  # a DataLoader worker that is terminated, or exits normally
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        assert spill.exists() and spill in cleanup.tracked()
    finally:
        cleanup.untrack(spill)
