import pytest
import torch

from costmodels import (
    DEVICES,
    DeviceSpec,
    collective_time_s,
    get_device,
    op_time_s,
    transfer_time_s,
)
from costmodels.runtime import COLLECTIVE_EFFICIENCY

REQUIRED = ("cpu", "a100-40gb", "a100-80gb", "h100-80gb", "h200", "l40s", "mi300x")


def test_required_devices_present_and_sane():
    for name in REQUIRED:
        d = DEVICES[name]
        assert d.name == name
        assert d.bf16_flops_per_s >= d.fp32_flops_per_s > 0
        assert d.hbm_bytes_per_s >= d.host_link_bytes_per_s > 0
        assert d.disk_bytes_per_s > 0 and d.memory_bytes > 16 * 2**30
    assert not DEVICES["cpu"].is_cuda and DEVICES["h100-80gb"].is_cuda
    assert DEVICES["cpu"].host_link_bytes_per_s == DEVICES["cpu"].hbm_bytes_per_s
    assert DEVICES["h200"].memory_bytes > DEVICES["h100-80gb"].memory_bytes
    assert DEVICES["mi300x"].memory_bytes > DEVICES["h200"].memory_bytes


def test_get_device_case_insensitive_and_errors():
    assert get_device("H100-80GB") is DEVICES["h100-80gb"]
    with pytest.raises(ValueError, match="unknown gpu 'tpu'; choose one of: cpu"):
        get_device("tpu")


def test_device_to_dict_and_frozen():
    d = get_device("a100-80gb")
    assert d.to_dict()["memory_bytes"] == 80 * 2**30
    assert DeviceSpec(**d.to_dict()) == d
    with pytest.raises(AttributeError):
        d.name = "x"  # type: ignore[misc]


def test_op_time_roofline():
    h100 = get_device("h100-80gb")
    # compute bound: 1e12 FLOPs in bf16
    t = op_time_s(10**12, 0, torch.bfloat16, h100)
    assert t == pytest.approx(1e12 / (0.7 * h100.bf16_flops_per_s) + 5e-6)
    # fp32 uses the fp32 peak
    assert op_time_s(10**12, 0, torch.float32, h100) > 10 * t
    # memory bound
    t = op_time_s(1, 10**9, torch.bfloat16, h100)
    assert t == pytest.approx(1e9 / (0.8 * h100.hbm_bytes_per_s) + 5e-6)
    assert op_time_s(0, 0, torch.float32, get_device("cpu")) == pytest.approx(2e-6)
    with pytest.raises(ValueError):
        op_time_s(-1, 0, torch.float32, h100)


def test_transfer_time():
    h100 = get_device("h100-80gb")
    assert transfer_time_s(50 * 10**9, h100, "cpu") == pytest.approx(1.0)
    assert transfer_time_s(3 * 10**9, h100, "disk") == pytest.approx(1.0)
    with pytest.raises(ValueError, match="choose one of: cpu, disk"):
        transfer_time_s(1, h100, "nvme")


def test_collective_time_ring_bound_and_links():
    h100 = get_device("h100-80gb")
    assert collective_time_s(10**9, 1, h100) == 0.0
    # 8 GPUs in one node: 7/8 of the bytes over NVLink at 80% of 450 GB/s
    assert collective_time_s(8 * 10**9, 8, h100) == pytest.approx(7e9 / (COLLECTIVE_EFFICIENCY * 450e9))
    # 16 GPUs span two nodes: the ring runs at the network's 50 GB/s per GPU
    assert collective_time_s(16 * 10**9, 16, h100) == pytest.approx(15e9 / (COLLECTIVE_EFFICIENCY * 50e9))
    assert all(d.interconnect_bytes_per_s >= d.network_bytes_per_s for d in DEVICES.values() if d.is_cuda)
    with pytest.raises(ValueError):
        collective_time_s(-1, 2, h100)
