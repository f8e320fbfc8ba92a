"""memplan calibrate: a tiny measurement, the device profile round trip, and --device-profile."""

from __future__ import annotations

import json

import pytest
import torch
from cli_helpers import assert_user_error, run
from models_for_tests import PATH

from costmodels.calibration import QUICK, calibrate
from costmodels.hardware import get_device, load_device_profile, profile_dict
from costmodels.runtime import COMPUTE_EFFICIENCY, op_time_s
from planner.units import format_bytes


@pytest.fixture(scope="module")
def tiny():
    return calibrate(QUICK, device="cpu")


def test_calibration_measures_positive_rates(tiny):
    m = tiny.measured()
    assert set(m) == {
        "fp32_matmul_flops_per_s",
        "bf16_matmul_flops_per_s",
        "attention_flops_per_s",
        "pointwise_bytes_per_s",
        "host_link_bytes_per_s",
        "disk_write_bytes_per_s",
        "disk_read_bytes_per_s",
        "wall_s",
    }
    assert all(v > 0 for v in m.values()) and m["wall_s"] < 20
    d = tiny.device
    assert not d.is_cuda and d.disk_bytes_per_s == min(m["disk_write_bytes_per_s"], m["disk_read_bytes_per_s"])
    # the roofline reproduces the measured matmul rate: a compute-bound op takes flops / measured rate
    flops = 10**12
    assert op_time_s(flops, 0, torch.float32, d) == pytest.approx(flops / m["fp32_matmul_flops_per_s"], rel=1e-3)
    assert op_time_s(flops, 0, torch.float32, d, attention=True) == pytest.approx(
        flops / m["attention_flops_per_s"], rel=1e-3
    )
    assert d.fp32_flops_per_s == pytest.approx(m["fp32_matmul_flops_per_s"] / COMPUTE_EFFICIENCY)


def test_profile_round_trip_and_errors(tiny, tmp_path):
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(profile_dict(tiny.device, tiny.measured())))
    assert load_device_profile(path) == tiny.device == get_device(str(path))
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not a memplan device profile"):
        get_device(str(bad))
    with pytest.raises(ValueError, match="does not exist"):
        get_device(str(tmp_path / "missing.json"))


def test_cli_calibrate_then_device_profile(tmp_path, capsys):
    path = tmp_path / "dev.json"
    code, out, err = run(["calibrate", "--quick", "--device", "cpu", "--out", str(path)], capsys)
    assert code == 0, err
    assert "fp32 matmul" in out and "disk read" in out
    profile = json.loads(path.read_text())
    spec = f"{PATH}:gpt_small"
    code, out, err = run(["simulate", "--model", spec, "--seq-len", "32", "--device-profile", str(path)], capsys)
    assert code == 0, err
    assert f"device capacity {format_bytes(profile['device']['memory_bytes'])}" in out  # the profile's device
    code, _, err = run(["simulate", "--model", spec, "--device-profile", str(tmp_path / "none.json")], capsys)
    assert_user_error(code, err, "simulate", "does not exist")
