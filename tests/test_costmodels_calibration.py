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
from planner.config import TrainConfig
from planner.simulation.effects import choices_from_decisions, recompute_stop
from planner.solver.planning import solve
from planner.tracing.recorder import trace_for
from planner.units import format_bytes


@pytest.fixture(scope="module")
def tiny():
    return calibrate(QUICK, device="cpu")


@pytest.mark.slow
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
        "selective_op_overhead_s",
        "replay_op_overhead_s",
        "op_flops_per_s",
        "op_s_per_element",
        "wall_s",
    }
    host = ("selective_op_overhead_s", "replay_op_overhead_s")
    rates = {k: v for k, v in m.items() if not isinstance(v, dict) and k not in host}
    assert all(v > 0 for v in rates.values()) and m["wall_s"] < 20 and all(m[k] >= 0 for k in host)
    assert set(m["op_flops_per_s"]) == {"aten.convolution.default", "aten.convolution_backward.default"}
    assert {"aten.gelu.default", "aten.gelu.default[approximate=tanh]", "aten.native_batch_norm.default"} <= set(
        m["op_s_per_element"]
    )
    assert all(v > 0 for table in ("op_flops_per_s", "op_s_per_element") for v in m[table].values())
    d = tiny.device
    assert not d.is_cuda and d.disk_bytes_per_s == min(m["disk_write_bytes_per_s"], m["disk_read_bytes_per_s"])
    # the roofline reproduces the measured matmul rate: a compute-bound op takes flops / measured rate
    flops = 10**12
    assert op_time_s(flops, 0, torch.float32, d) == pytest.approx(flops / m["fp32_matmul_flops_per_s"], rel=1e-3)
    assert op_time_s(flops, 0, torch.float32, d, attention=True) == pytest.approx(
        flops / m["attention_flops_per_s"], rel=1e-3
    )
    assert d.fp32_flops_per_s == pytest.approx(m["fp32_matmul_flops_per_s"] / COMPUTE_EFFICIENCY)
    # ops measured one by one run at their own rate; the elementwise floor looks up the variant first
    conv = m["op_flops_per_s"]["aten.convolution.default"]
    assert op_time_s(flops, 0, torch.float32, d, name="aten.convolution.default") == pytest.approx(
        flops / conv, rel=1e-3
    )
    per = m["op_s_per_element"]
    n = 10**9
    for variant in ("", "approximate=tanh"):
        key = f"aten.gelu.default[{variant}]" if variant else "aten.gelu.default"
        got = op_time_s(0, 0, torch.float32, d, name="aten.gelu.default", elements=n, variant=variant)
        assert got == pytest.approx(n * per[key], rel=1e-3)
    assert op_time_s(0, 0, torch.float32, d, name="aten.gelu.default", variant="approximate=none") == pytest.approx(
        op_time_s(0, 0, torch.float32, d, name="aten.gelu.default")
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("selective_op_overhead_s", -1.0),
        ("replay_op_overhead_s", 2.0),
        ("op_s_per_element", {"aten.gelu.default": -1e-9}),
        ("op_flops_per_s", {"aten.convolution.default": 0.0}),
        ("op_s_per_element", {"aten.gelu.default": "fast"}),
        ("op_flops_per_s", [1, 2, 3]),
    ],
)
def test_profile_refuses_bad_op_rates(tiny, tmp_path, field, value):
    d = profile_dict(tiny.device, tiny.measured())
    d["device"][field] = value
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="device profile"):
        get_device(str(path))


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


def test_checkpoint_host_time_is_priced_per_op_and_pass(tiny, tmp_path):
    """A selective plan pays the calibrated dispatch time for every forward op of each span and
    every op its recompute reaches; a plain checkpoint pays the replay time for every op its
    recompute reaches; CUDA devices pay neither."""
    graph = trace_for(f"{PATH}:gpt_small", TrainConfig(batch_size=2, seq_len=32))
    plans = {}
    for name, overhead, cuda in (("zero", 0.0, False), ("cpu", 1e-3, False), ("cuda", 1e-3, True)):
        d = profile_dict(tiny.device, tiny.measured())
        d["device"].update(selective_op_overhead_s=overhead, replay_op_overhead_s=overhead / 4, is_cuda=cuda)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(d))
        config = TrainConfig(batch_size=2, seq_len=32, gpu=str(path))
        plans[name] = {s: solve(graph, config, 10**12, strategy=s) for s in ("op-sac", "full")}

    def added_s(strategy: str, device: str) -> float:
        return plans[device][strategy].predicted.recompute_s - plans["zero"][strategy].predicted.recompute_s

    selective = choices_from_decisions(graph, plans["cpu"]["op-sac"].decisions)
    assert selective and all(c.keep_ops for c in selective)
    passes = sum(
        (c.span.fwd_end - c.span.fwd_start) + (recompute_stop(graph, c.span) - c.span.fwd_start) for c in selective
    )
    assert added_s("op-sac", "cpu") == pytest.approx(1e-3 * passes)
    plain = choices_from_decisions(graph, plans["cpu"]["full"].decisions)
    assert plain and not any(c.keep_ops for c in plain)
    replayed = sum(recompute_stop(graph, c.span) - c.span.fwd_start for c in plain)
    assert added_s("full", "cpu") == pytest.approx(1e-3 / 4 * replayed)
    # CUDA: only the op times differ (launch overhead), no checkpointing host time
    assert added_s("op-sac", "cuda") < 1e-3 and added_s("full", "cuda") < 1e-3
