"""Tests for planner.analysis.diagnose: verdict classes, ranked simulated remedies, allocator estimate."""

from __future__ import annotations

from pathlib import Path

import pytest

from costmodels.hardware import get_device
from planner.analysis.diagnose import (
    VERDICTS,
    Diagnosis,
    allocator_estimate,
    allocator_events,
    diagnose,
    diagnose_oom_message,
    diagnose_snapshot,
)
from planner.api import trace_for
from planner.config import TrainConfig
from planner.simulation.step import simulate

A100 = get_device("a100-40gb").memory_bytes


@pytest.fixture(scope="module")
def oom_iteration() -> Diagnosis:
    # gpt2 fp32, 40 x 1024 tokens: model states ~1.9 GiB, activations far beyond 40 GiB.
    return diagnose("gpt2", TrainConfig(batch_size=40, seq_len=1024, gpu="a100-40gb"), time_limit_s=5.0)


@pytest.mark.slow
def test_oom_init_when_model_states_exceed_the_device() -> None:
    d = diagnose("llama-7b", TrainConfig(batch_size=1, seq_len=128, gpu="a100-40gb"))
    assert d.verdict == "oom-init"
    assert d.model_state_bytes == sum(d.model_states.values()) > A100
    assert "model states" in d.summary
    assert d.longest_fitting_seq_len is None
    names = [r.name for r in d.remedies]
    assert "checkpoint plan" not in names and "mixed precision" not in names  # cannot cut model states
    zero = next(r for r in d.remedies if r.name == "ZeRO-3 / FSDP")
    assert zero.fits and zero.config_changes["zero_stage"] == 3 and zero.config_changes["dp"] in (2, 4, 8)
    assert d.remedies[0] is zero  # the only remedy that fits ranks first


@pytest.mark.slow
def test_oom_iteration_names_the_peak_and_the_longest_fitting_sequence(oom_iteration: Diagnosis) -> None:
    d = oom_iteration
    assert d.verdict == "oom-iteration"
    assert d.model_state_bytes < A100 < d.peak_bytes and d.headroom_bytes < 0
    assert d.peak_phase in ("forward", "loss", "backward") and d.peak_op
    seq = d.longest_fitting_seq_len
    assert seq is not None and 1 <= seq < 1024
    config = TrainConfig(batch_size=40, seq_len=seq, gpu="a100-40gb")
    assert simulate(trace_for("gpt2", config), config).peak_bytes <= A100
    assert str(seq) in d.summary


@pytest.mark.slow
def test_remedies_are_simulated_and_ranked(oom_iteration: Diagnosis) -> None:
    remedies = oom_iteration.remedies
    names = {r.name for r in remedies}
    assert {
        "mixed precision",
        "8-bit optimizer",
        "ZeRO-3 / FSDP",
        "checkpoint plan",
        "offload plan",
        "gradient accumulation",
    } <= names
    for r in remedies:
        assert r.peak_bytes > 0 and r.fits == (r.peak_bytes <= A100)
        assert r.peak_bytes != oom_iteration.peak_bytes or not r.fits
    keys = [(not r.fits, r.overhead) for r in remedies]
    assert keys == sorted(keys)
    assert remedies[0].fits
    plan = next(r for r in remedies if r.name == "checkpoint plan")
    assert plan.fits and plan.overhead > 0 and plan.peak_bytes <= 0.95 * A100
    accumulate = next(r for r in remedies if r.name == "gradient accumulation")
    assert accumulate.config_changes["batch_size"] * accumulate.config_changes["accumulation_steps"] == 40
    mixed = next(r for r in remedies if r.name == "mixed precision")
    assert mixed.config_changes == {"precision": "bf16-mixed"}
    d = oom_iteration.to_dict()
    assert d["verdict"] == "oom-iteration" and len(d["remedies"]) == len(remedies)
    assert set(d["remedies"][0]) == {"name", "description", "config_changes", "peak_bytes", "fits", "overhead", "note"}


def test_fits_on_a_large_device() -> None:
    d = diagnose("gpt2-tiny", TrainConfig(batch_size=1, seq_len=64, gpu="h100-80gb"))
    assert d.verdict == "fits"
    assert d.remedies == ()
    assert d.headroom_bytes >= d.expected_overhead_bytes


@pytest.mark.slow
def test_at_risk_when_headroom_is_below_the_allocator_overhead() -> None:
    # gpt2 fp32, batch 34 on a100-40gb: the peak crosses the capacity just below seq 1024; the first
    # length that fits (steps of 16 tokens ~ 0.4% of the device) leaves less than 2% headroom.
    for seq in range(1024, 768, -16):
        config = TrainConfig(batch_size=34, seq_len=seq, gpu="a100-40gb")
        if simulate(trace_for("gpt2", config), config).peak_bytes <= A100:
            break
    d = diagnose("gpt2", config, remedies=False)
    assert d.verdict == "at-risk", (seq, d.headroom_bytes)
    assert 0 <= d.headroom_bytes < d.expected_overhead_bytes
    assert d.expected_overhead_bytes >= int(0.02 * A100)
    assert d.allocator["expected_reserved_bytes"] > A100
    assert "headroom" in d.summary


def test_allocator_estimate_covers_the_simulated_peak() -> None:
    config = TrainConfig(batch_size=2, seq_len=64, gpu="a100-40gb")
    graph = trace_for("gpt2-tiny", config)
    estimate = allocator_estimate(graph, config)
    peak = simulate(graph, config).peak_bytes
    assert estimate.peak_reserved_bytes >= estimate.peak_allocated_bytes >= 0.9 * peak
    events = list(allocator_events(graph, config))
    live = {t for t, n in events if n > 0} - {t for t, n in events if n == 0}
    assert all(graph.tensors[t].free_op is None for t in live if t in graph.tensors)


def test_verdict_names() -> None:
    assert VERDICTS == ("oom-init", "oom-iteration", "at-risk", "fits")


def test_snapshot_and_oom_message_wrappers() -> None:
    report = diagnose_snapshot("tests/data/snapshots/current_small.pickle")
    assert report.reserved_bytes > 0
    text = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
        "1.23 GiB is free. Including non-PyTorch memory, this process has 77.90 GiB memory in use. Of the "
        "allocated memory 74.50 GiB is allocated by PyTorch, and 2.40 GiB is reserved by PyTorch but unallocated."
    )
    explained = diagnose_oom_message(text)
    assert explained.requested_bytes == 2 * 2**30
    with pytest.raises(ValueError):
        diagnose_oom_message("hello")


# -- parallel layouts (planner.analysis.diagnose_layout through planner.api) ------------------------
def _tiny_device(tmp_path, memory_bytes: int) -> str:
    """A device profile like an H100 with `memory_bytes` of memory (so a tiny model runs out)."""
    import json
    from dataclasses import replace

    from costmodels.hardware import get_device, profile_dict

    path = tmp_path / "tiny-gpu.json"
    device = replace(get_device("h100-80gb"), name="tiny-gpu", memory_bytes=memory_bytes)
    path.write_text(json.dumps(profile_dict(device, {})))
    return str(path)


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2, "microbatches": 4}])
def test_layout_diagnosis_names_the_worst_rank_and_simulates_each_remedy(tmp_path, layout) -> None:
    from planner.api import diagnose_layout_model, simulate_layout

    base = TrainConfig(batch_size=16, seq_len=64, **layout)  # activations well above the model states
    no_plan = simulate_layout("llama-7b-tiny", base.with_(gpu="h100-80gb")).peak_bytes
    config = base.with_(gpu=_tiny_device(tmp_path, int(no_plan * 0.9)))
    d = diagnose_layout_model("llama-7b-tiny", config, time_limit_s=5.0)
    assert d.verdict == "oom-iteration" and d.peak_bytes == no_plan
    assert "on rank 0 (pp=0" in d.summary
    names = [r.name for r in d.remedies]
    assert len(names) == len(set(names)) and {"8-bit optimizer", "FSDP over more GPUs", "checkpoint plan"} <= set(names)
    assert [r.fits for r in d.remedies] == sorted((r.fits for r in d.remedies), reverse=True)  # fitting first
    for r in d.remedies:
        assert r.fits == (r.peak_bytes <= d.capacity_bytes) or "smallest reachable" in r.note
        if r.name == "8-bit optimizer":  # a remedy's peak is its layout's every-rank simulation
            assert r.peak_bytes == simulate_layout("llama-7b-tiny", config.with_(optimizer="adamw-8bit")).peak_bytes
        if r.name == "FSDP over more GPUs":
            assert r.config_changes["dp"] == 2 and r.config_changes["zero_stage"] == 3
    plan = next(r for r in d.remedies if r.name == "checkpoint plan")
    assert plan.fits and plan.peak_bytes < no_plan


def test_layout_diagnosis_fits_on_a_large_device() -> None:
    from planner.api import diagnose_layout_model

    d = diagnose_layout_model("llama-7b-tiny", TrainConfig(batch_size=2, seq_len=32, tp=2, gpu="h100-80gb"))
    assert d.verdict == "fits" and not d.remedies and d.headroom_bytes > 0


def test_more_tensor_parallel_runs_without_sequence_parallel_where_the_plan_cannot(tmp_path) -> None:
    """transformers' GPT-2 under FSDP2: the "more tensor parallel" remedy runs its plan with --no-sp
    (memplan's plan cannot shard GPT-2's sequence) rather than being dropped."""
    from planner.api import diagnose_layout_model, simulate_layout

    spec = f"hf:{Path(__file__).parent / 'data' / 'tiny_gpt2' / 'config.json'}"
    base = TrainConfig(batch_size=16, seq_len=64, dp=2, zero_stage=3, loss_parallel=False)
    no_plan = simulate_layout(spec, base.with_(gpu="h100-80gb")).peak_bytes
    d = diagnose_layout_model(spec, base.with_(gpu=_tiny_device(tmp_path, int(no_plan * 0.9))), time_limit_s=5.0)
    tp = next(r for r in d.remedies if r.name == "more tensor parallel")
    assert tp.config_changes == {"tp": 2, "sequence_parallel": False} and "(--no-sp)" in tp.description
    assert tp.peak_bytes < no_plan
