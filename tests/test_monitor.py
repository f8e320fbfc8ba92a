"""planner.runtime.monitor: per-step log, online adjustment, OOM reports (CPU, live-bytes tracker)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from models_for_tests import llama_small

from planner.errors import MemplanError
from planner.runtime.auto import auto_checkpoint
from planner.runtime.live_trace import LiveTracer
from planner.runtime.monitor import MemoryMonitor

ROOT = Path(__file__).resolve().parents[1]


def _ids(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 64, (batch, length))


def _train_step(model, optimizer, ids):
    model(ids, ids).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_growing_sequence_stays_in_budget_and_plans_follow_with_unchanged_gradients(tmp_path):
    torch.manual_seed(0)
    reference, inputs = llama_small(2, 512)
    model = copy.deepcopy(reference)
    handle = auto_checkpoint(model, inputs, "100%", seq_lens=[64, 128, 256, 512])
    states = handle.model_states_bytes
    budget = handle.set_budget(int(states + 0.6 * (handle.baseline_peak_bytes - states))).budget_bytes
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, foreach=False)
    lengths = [64, 128, 256, 512, 256, 128, 64]
    log = tmp_path / "mem.jsonl"
    with MemoryMonitor(log, handle, adapt=True) as monitor:
        for length in lengths:
            ids = _ids(length)
            with monitor.step((ids, ids)):
                _train_step(model, optimizer, ids)
            _train_step(reference, ref_optimizer, ids)  # same updates: the gradients were the same
            for got, want in zip(model.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    lines = _lines(log)
    assert [r["step"] for r in lines] == list(range(len(lengths)))
    assert [r["seq_len"] for r in lines] == lengths
    assert all(r["measured_peak_bytes"] <= budget == r["budget_bytes"] for r in lines)
    assert all(abs(r["drift"]) <= 0.03 for r in lines[1:])  # step 0 has no optimizer states yet
    overhead = [r["plan"]["predicted_overhead"] for r in lines]
    assert overhead[:4] == sorted(overhead[:4]) and overhead[3] > overhead[0]  # tightens as it grows
    assert overhead[3:] == sorted(overhead[3:], reverse=True) and overhead[-1] < overhead[3]  # relaxes
    reasons = [s["reason"] for r in lines for s in r["switches"]]
    assert any("sequence length 512" in r for r in reasons) and any("sequence length 64" in r for r in reasons)
    assert all("live_bytes" in r and r["device"] == "cpu" for r in lines)
    handle.remove()


@pytest.mark.slow
def test_measured_drift_tightens_then_slack_relaxes(tmp_path):
    torch.manual_seed(0)
    model, _ = llama_small(2, 128)
    handle = auto_checkpoint(model, (_ids(128), _ids(128)), "100%")
    states = handle.model_states_bytes
    handle.set_budget(int(states + 0.6 * (handle.baseline_peak_bytes - states)))
    budget = handle.budget_bytes
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    with MemoryMonitor(tmp_path / "mem.jsonl", handle, reserve=0.05, adapt=True, relax_after=2) as monitor:
        assert handle.target_bytes == int(0.95 * budget)
        for step in range(7):
            ids = _ids(128)
            with monitor.step((ids, ids)):
                extra = torch.empty(int(0.05 * budget) // 4) if step == 1 else None  # memory the plan cannot see
                _train_step(model, optimizer, ids)
                del extra
    records = monitor.records
    assert all(r.measured_peak_bytes <= budget for r in records)
    assert "tighten" in records[1].switches[0]["reason"]
    tightened = records[1].switches[0]["target_bytes"]
    assert tightened < int(0.95 * budget) and records[2].target_bytes == tightened
    assert records[2].measured_peak_bytes <= tightened
    relaxed = [s for r in records[2:] for s in r.switches if "relax" in s["reason"]]
    assert relaxed and relaxed[0]["target_bytes"] > tightened
    handle.remove()


@pytest.mark.slow
def test_oom_inside_a_step_writes_a_report_and_reaches_the_caller(tmp_path):
    torch.manual_seed(0)
    model, inputs = llama_small(2, 64)
    handle = auto_checkpoint(model, inputs, "100%")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    message = "CUDA out of memory. Tried to allocate 2.00 GiB."

    def fail(*_):
        raise torch.OutOfMemoryError(message)

    with MemoryMonitor(tmp_path / "mem.jsonl", handle) as monitor:
        with monitor.step(inputs):
            _train_step(model, optimizer, inputs[0])
        hook = model.layers[2].mlp.register_forward_pre_hook(fail)
        with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate"):
            with monitor.step(inputs):
                _train_step(model, optimizer, inputs[0])
        hook.remove()
    report = json.loads((tmp_path / "memplan-oom-step1.json").read_text())
    assert report["verdict"] == "iteration" and report["module"] == "layers.2.mlp"
    assert report["requested_bytes"] is None or report["requested_bytes"] == 2 * 2**30
    assert report["live_bytes"] > 0 and report["predicted_breakdown"]["parameter"] > 0
    assert report["remedies"] and {"name", "fits", "peak_bytes"} <= set(report["remedies"][0])
    text = (tmp_path / "memplan-oom-step1.txt").read_text()
    assert "iteration" in text and "layers.2.mlp" in text
    assert len(_lines(tmp_path / "mem.jsonl")) == 1
    handle.remove()


def test_oom_before_any_module_is_an_init_failure(tmp_path):
    model, inputs = llama_small(2, 16)
    with MemoryMonitor(tmp_path / "mem.jsonl", model=model) as monitor:
        with pytest.raises(torch.OutOfMemoryError):
            with monitor.step(inputs):
                raise torch.OutOfMemoryError("out of memory while moving the model")
    report = json.loads((tmp_path / "memplan-oom-step0.json").read_text())
    assert report["verdict"] == "init" and report["module"] is None and report["remedies"] == []


def test_bad_use_is_a_one_line_error(tmp_path):
    with pytest.raises(MemplanError, match="adapt=True needs"):
        MemoryMonitor(tmp_path / "m.jsonl", adapt=True)
    with pytest.raises(MemplanError, match="reserve"):
        MemoryMonitor(tmp_path / "m.jsonl", reserve=0.7)
    with pytest.raises(MemplanError, match="context manager"):
        MemoryMonitor(tmp_path / "m.jsonl").begin_step()


def test_gpu_check_exits_cleanly_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: benchmarks/gpu_check.py runs for real")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "no GPU" in done.stdout


def test_memplan_work_inside_a_step_is_not_measured(tmp_path):
    model, _ = llama_small(2, 16)
    held = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])
    with MemoryMonitor(tmp_path / "mem.jsonl", model=model) as monitor:
        with monitor.step():
            tracer = LiveTracer(model, "fp32")  # fake copies of every parameter, made inside the step
        with monitor.step():
            with monitor.paused():
                scratch = torch.empty(2**20)
                time.sleep(0.3)
            del scratch
    assert tracer.fake_model is not None
    assert [r.measured_peak_bytes for r in monitor.records] == [held, held]
    assert monitor.records[1].step_s < 0.3  # paused time is not the step's


@pytest.mark.slow
def test_first_step_and_every_retarget_are_logged_honestly(tmp_path):
    torch.manual_seed(0)
    model, _ = llama_small(2, 64)
    handle = auto_checkpoint(model, (_ids(64), _ids(64)), "100%")
    budget = handle.budget_bytes
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    with MemoryMonitor(tmp_path / "mem.jsonl", handle, adapt=True) as monitor:
        for step in range(2):
            ids = _ids(64)
            with monitor.step((ids, ids)):
                extra = torch.empty(int(0.2 * budget) // 4) if step == 1 else None  # 20% the plan cannot see
                _train_step(model, optimizer, ids)
                del extra
    first, second = monitor.records
    assert first.drift is None and "optimizer state" in first.note and second.note is None
    assert first.switches[0]["reason"] == "keep 5% of the budget free"  # the first retarget is logged
    over = (second.measured_peak_bytes - budget) / budget
    assert over > 0.05 and f"{over:.1%} over the budget" in second.switches[0]["reason"]
    handle.remove()


@pytest.mark.slow
def test_an_accumulated_step_is_measured_as_the_plan_predicts(tmp_path):
    torch.manual_seed(0)
    model, _ = llama_small(2, 64)
    handle = auto_checkpoint(model, (_ids(64), _ids(64)), "100%", grad_accum_steps=3)
    states = handle.model_states_bytes
    budget = handle.set_budget(int(states + 0.6 * (handle.baseline_peak_bytes - states))).budget_bytes
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    with MemoryMonitor(tmp_path / "mem.jsonl", handle) as monitor:
        for _ in range(3):
            with monitor.step():  # one optimizer step: three micro-batches
                for _ in range(3):
                    ids = _ids(64)
                    (model(ids, ids) / 3).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    records = monitor.records
    assert records[0].drift is None and all(abs(r.drift) <= 0.03 for r in records[1:]), records
    assert all(r.measured_peak_bytes <= budget for r in records)
    handle.remove()
