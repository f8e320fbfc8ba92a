"""`memplan simulate` and `memplan verify` through planner.cli.main."""

from __future__ import annotations

import json

import pytest
from cli_helpers import assert_user_error, run

from planner.tracing.graph import CATEGORIES
from planner.tracing.specs import list_presets


def test_simulate_json(tmp_path, capsys):
    p = tmp_path / "out.json"
    code, out, err = run(["simulate", "--model", "llama-7b-tiny", "--seq-len", "32", "--json", str(p)], capsys)
    assert code == 0, err
    assert "peak" in out and f"wrote {p}" in out
    d = json.loads(p.read_text())
    for key in (
        "peak_bytes",
        "peak_phase",
        "peak_op",
        "peak_module",
        "breakdown_at_peak",
        "model_states",
        "num_parameters",
        "timeline",
        "config",
    ):
        assert key in d, key
    assert set(d["breakdown_at_peak"]) == set(CATEGORIES)
    assert sum(d["breakdown_at_peak"].values()) == d["peak_bytes"]
    assert set(d["model_states"]) >= {"parameter", "gradient", "optimizer"}
    assert d["num_parameters"] == 461440
    assert isinstance(d["timeline"], list) and d["timeline"]
    assert max(r["total_bytes"] for r in d["timeline"]) == d["peak_bytes"]
    assert d["peak_phase"] in ("forward", "loss", "backward", "optimizer")
    assert d["config"]["seq_len"] == 32 and d["config"]["batch_size"] == 1 and d["config"]["model"] == "llama-7b-tiny"


def test_simulate_options_reach_config(tmp_path, capsys):
    p = tmp_path / "out.json"
    code, _, err = run(
        [
            "simulate",
            "--model",
            "gpt2-tiny",
            "--seq-len",
            "16",
            "--batch-size",
            "3",
            "--gpu",
            "h100-80gb",
            "--precision",
            "bf16-mixed",
            "--optimizer",
            "sgd",
            "--zero",
            "2",
            "--dp",
            "4",
            "--json",
            str(p),
        ],
        capsys,
    )
    assert code == 0, err
    cfg = json.loads(p.read_text())["config"]
    assert cfg == {
        "batch_size": 3,
        "seq_len": 16,
        "precision": "bf16-mixed",
        "optimizer": "sgd",
        "zero_stage": 2,
        "dp": 4,
        "gpu": "h100-80gb",
        "model": "gpt2-tiny",
    }


def test_simulate_sweep(tmp_path, capsys):
    p = tmp_path / "sweep.json"
    code, out, err = run(["simulate", "--model", "llama-7b-tiny", "--seq-len", "16,32,64", "--json", str(p)], capsys)
    assert code == 0, err
    d = json.loads(p.read_text())
    assert len(d["sweep"]) == 3
    assert [r["config"]["seq_len"] for r in d["sweep"]] == [16, 32, 64]
    assert d["seq_lens"] == [16, 32, 64]
    assert "longest_fitting_seq_len" in d
    assert d["longest_fitting_seq_len"] == 64  # a few MiB fit in the cpu entry
    peaks = [r["peak_bytes"] for r in d["sweep"]]
    assert peaks == sorted(peaks)
    assert "longest sequence that fits" in out


def test_sweep_on_a_gpu(tmp_path, capsys):
    p = tmp_path / "sweep.json"
    code, out, err = run(
        ["simulate", "--model", "mlp-tiny", "--seq-len", "8,16", "--gpu", "h100-80gb", "--json", str(p)], capsys
    )
    assert code == 0, err
    assert json.loads(p.read_text())["longest_fitting_seq_len"] == 16


@pytest.mark.parametrize("seq", ["32", "16,32"])
def test_plot_writes_png(tmp_path, capsys, seq):
    pytest.importorskip("matplotlib")
    png = tmp_path / "curve.png"
    code, out, err = run(["simulate", "--model", "llama-7b-tiny", "--seq-len", seq, "--plot", str(png)], capsys)
    assert code == 0, err
    assert png.read_bytes().startswith(b"\x89PNG")
    assert f"wrote {png}" in out


def test_unknown_preset_lists_presets(capsys):
    code, out, err = run(["simulate", "--model", "llama-9000"], capsys)
    assert_user_error(code, err, ("simulate", "verify"), "llama-9000", "presets:")
    for name in list_presets():
        assert name in err


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_non_positive_batch_size(capsys, value):
    code, _, err = run(["simulate", "--model", "llama-7b-tiny", "--batch-size", value], capsys)
    assert_user_error(code, err, ("simulate", "verify"), "--batch-size")


def test_non_positive_seq_len(capsys):
    code, _, err = run(["simulate", "--model", "llama-7b-tiny", "--seq-len", "32,0"], capsys)
    assert_user_error(code, err, ("simulate", "verify"), "--seq-len")


def test_unknown_gpu(capsys):
    code, _, err = run(["simulate", "--model", "llama-7b-tiny", "--seq-len", "16", "--gpu", "tpu-v9"], capsys)
    assert_user_error(code, err, ("simulate", "verify"), "tpu-v9", "h100-80gb")


def test_unknown_precision(capsys):
    code, _, err = run(["simulate", "--model", "llama-7b-tiny", "--seq-len", "16", "--precision", "fp8"], capsys)
    assert_user_error(code, err, ("simulate", "verify"), "fp8", "bf16-mixed")


def test_unknown_optimizer(capsys):
    code, _, err = run(["simulate", "--model", "llama-7b-tiny", "--seq-len", "16", "--optimizer", "lion"], capsys)
    assert_user_error(code, err, ("simulate", "verify"), "lion", "adamw")


def test_bad_zero_stage(capsys):
    code, _, err = run(["simulate", "--model", "llama-7b-tiny", "--seq-len", "16", "--zero", "5"], capsys)
    assert_user_error(code, err, ("simulate", "verify"), "zero")


def test_seq_len_beyond_positions(capsys):
    code, _, err = run(["simulate", "--model", "gpt2-tiny", "--seq-len", "4096"], capsys)
    assert_user_error(code, err, ("simulate", "verify"), "4096", "128")


def test_file_function_missing(capsys, bad_models):
    code, _, err = run(["simulate", "--model", f"{bad_models}:nope", "--seq-len", "4"], capsys)
    assert_user_error(code, err, ("simulate", "verify"), "nope")


def test_file_missing(capsys, tmp_path):
    code, _, err = run(["simulate", "--model", f"{tmp_path}/absent.py:build", "--seq-len", "4"], capsys)
    assert_user_error(code, err, ("simulate", "verify"), "not found")


def test_file_function_raises(capsys, bad_models):
    code, _, err = run(["simulate", "--model", f"{bad_models}:raises", "--seq-len", "4"], capsys)
    assert_user_error(code, err, ("simulate", "verify"), "raises", "boom from the model function")


@pytest.mark.parametrize("func", ["item_model", "nonzero_model"])
def test_untraceable_model(capsys, bad_models, func):
    code, _, err = run(["simulate", "--model", f"{bad_models}:{func}", "--seq-len", "4"], capsys)
    assert_user_error(code, err, "simulate")
    assert "data-dependent" in err


def test_file_model_simulates(tmp_path, capsys, bad_models):
    p = tmp_path / "out.json"
    code, _, err = run(["simulate", "--model", f"{bad_models}:good_model", "--seq-len", "4", "--json", str(p)], capsys)
    assert code == 0, err
    assert json.loads(p.read_text())["num_parameters"] == 8 * 16 + 16 + 16 * 8 + 8


def test_pure_bf16_simulates(tmp_path, capsys):
    p = tmp_path / "out.json"
    code, _, err = run(
        ["simulate", "--model", "llama-7b-tiny", "--seq-len", "16", "--precision", "bf16", "--json", str(p)], capsys
    )
    assert code == 0, err
    assert json.loads(p.read_text())["model_states"]["parameter"] == 2 * 461440


def test_verify_prints_predicted_vs_measured(tmp_path, capsys):
    p = tmp_path / "verify.json"
    code, out, err = run(["verify", "--model", "llama-7b-tiny", "--seq-len", "32", "--json", str(p)], capsys)
    assert code == 0, err
    assert "predicted" in out and "measured" in out and "error" in out
    (result,) = json.loads(p.read_text())["results"]
    assert result["model"] == "llama-7b-tiny" and result["config"]["seq_len"] == 32
    assert abs(result["error"]) <= 0.03
    assert f"{result['error'] * 100:+.2f}%" in out


def test_verify_rejects_gpu(capsys):
    code, _, err = run(["verify", "--model", "llama-7b-tiny", "--seq-len", "16", "--gpu", "h100-80gb"], capsys)
    assert_user_error(code, err, ("simulate", "verify"), "CPU")


def test_verify_rejects_8bit(capsys):
    code, _, err = run(["verify", "--model", "llama-7b-tiny", "--seq-len", "16", "--optimizer", "adamw-8bit"], capsys)
    assert_user_error(code, err, ("simulate", "verify"), "adamw-8bit")
