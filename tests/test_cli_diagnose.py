"""`memplan diagnose` and `memplan fit` through planner.cli.main."""

from __future__ import annotations

import json

import pytest
from cli_helpers import assert_user_error, run

SNAPSHOTS = "tests/data/snapshots"
OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
    "1.23 GiB is free. Including non-PyTorch memory, this process has 77.90 GiB memory in use. Of the "
    "allocated memory 74.50 GiB is allocated by PyTorch, and 2.40 GiB is reserved by PyTorch but unallocated."
)


@pytest.mark.slow
def test_diagnose_model_prints_verdict_and_remedies(tmp_path, capsys):
    p = tmp_path / "d.json"
    # gpt2-tiny with 32768 x 128 tokens overflows an A100 40GB in activations only (cheap to trace).
    code, out, err = run(
        [
            "diagnose",
            "--model",
            "gpt2-tiny",
            "--gpu",
            "a100-40gb",
            "--batch-size",
            "32768",
            "--seq-len",
            "128",
            "--time-limit",
            "5",
            "--json",
            str(p),
        ],
        capsys,
    )
    assert code == 0, err
    assert "verdict: oom-iteration" in out and "remedies" in out and "checkpoint plan" in out
    assert "new peak" in out and "time cost" in out
    d = json.loads(p.read_text())
    assert d["verdict"] == "oom-iteration" and d["remedies"][0]["fits"]
    assert d["longest_fitting_seq_len"] < 128


def test_diagnose_a_pipeline_names_its_worst_rank(tmp_path, capsys):
    p = tmp_path / "d.json"
    argv = ["diagnose", "--model", "llama-7b-tiny", "--gpu", "a100-40gb", "--seq-len", "64", "--batch-size", "4"]
    code, out, err = run([*argv, "--pp", "2", "--dp", "2", "--zero", "3", "--json", str(p)], capsys)
    assert code == 0, err
    assert "ZeRO-3 dp 2 --pp 2 (4 GPUs)" in out and "verdict: fits" in out and "on rank 0 (pp=0" in out
    d = json.loads(p.read_text())
    assert d["verdict"] == "fits" and d["config"]["pp"] == 2 and d["remedies"] == []
    assert [r["coords"]["pp"] for r in d["ranks"]] == [0, 1] and "coords (first)" in out


def test_diagnose_fits(capsys):
    code, out, err = run(["diagnose", "--model", "gpt2-tiny", "--gpu", "h100-80gb", "--seq-len", "64"], capsys)
    assert code == 0, err
    assert "verdict: fits" in out and "remedies" not in out


def test_diagnose_snapshot_without_model(tmp_path, capsys):
    p = tmp_path / "s.json"
    for name in ("current_small.pickle", "legacy_segments.pickle"):
        code, out, err = run(["diagnose", "--snapshot", f"{SNAPSHOTS}/{name}", "--json", str(p)], capsys)
        assert code == 0, err
        assert "reserved" in out and "fragmentation" in out
        assert json.loads(p.read_text())["reserved_bytes"] > 0


def test_diagnose_oom_message_without_model(capsys):
    code, out, err = run(["diagnose", "--oom-message", OOM], capsys)
    assert code == 0, err
    assert out.startswith("verdict: ")


def test_diagnose_needs_an_input(capsys):
    code, _, err = run(["diagnose"], capsys)
    assert_user_error(code, err, "diagnose", "--model SPEC", "--snapshot FILE", "--oom-message TEXT")


def test_diagnose_bad_inputs_are_one_line_errors(tmp_path, capsys):
    code, _, err = run(["diagnose", "--snapshot", str(tmp_path / "missing.pickle")], capsys)
    assert_user_error(code, err, "diagnose")
    code, _, err = run(["diagnose", "--oom-message", "segfault"], capsys)
    assert_user_error(code, err, "diagnose", "out-of-memory")


def test_fit_prints_gpu_counts_and_json(tmp_path, capsys):
    p = tmp_path / "f.json"
    code, out, err = run(
        [
            "fit",
            "--model",
            "gpt2-tiny",
            "--gpu",
            "a100-40gb",
            "--batch-size",
            "32768",
            "--seq-len",
            "128",
            "--max-gpus",
            "8",
            "--time-limit",
            "5",
            "--json",
            str(p),
        ],
        capsys,
    )
    assert code == 0, err
    assert "without a plan" in out and "with the best plan" in out
    d = json.loads(p.read_text())
    assert d["min_gpus_without_plan"] is None and d["min_gpus_with_plan"] == 1
    assert "does not fit on up to 8 GPUs without a plan" in out
    assert "configurations that fit" in out and "recommended: " in out and "GPU-h / M tokens" in out
    best = d["configurations"]["recommended"]
    assert best["fits"] and best["peak_bytes"] <= d["budget_bytes"]
    assert {c["micro_batch"] for c in d["configurations"]["configurations"]} == {32768, 16384, 8192}


@pytest.mark.slow
def test_fit_largest_on_n_gpus(tmp_path, capsys):
    p = tmp_path / "l.json"
    code, out, err = run(
        [
            "fit",
            "--model",
            "gpt2-tiny",
            "--gpu",
            "h100-80gb",
            "--seq-len",
            "64",
            "--batch-size",
            "512",
            "--gpus",
            "2",
            "--json",
            str(p),
        ],
        capsys,
    )
    assert code == 0, err
    assert "largest batch size" in out and "largest seq len" in out
    d = json.loads(p.read_text())
    assert d["gpus"] == 2 and d["config"]["zero_stage"] == 3
    assert d["largest_seq_len"]["without_plan"] == 128  # gpt2-tiny has 128 positions
    assert d["largest_batch_size"]["with_plan"] >= d["largest_batch_size"]["without_plan"] >= 512


def test_fit_bad_gpu_count(capsys):
    code, _, err = run(["fit", "--model", "gpt2-tiny", "--gpus", "0"], capsys)
    assert_user_error(code, err, "fit", "gpus")
