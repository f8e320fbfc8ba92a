"""oneDNN's 1x1 strided weight-gradient bug (uxlfoundation/oneDNN#6035, docs/safety.md): a probe in a
subprocess that skips, saying so, where this CPU has it; memplan's whole-model compile refusing
channels-last for the convolutions that reach it."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch
from torch import nn

from planner.tracing.inductor_layout import WHOLE_MODEL, inductor_options, onednn_faulty_convs
from planner.tracing.models import ConvNet, ConvNetConfig

# the repro, its weight gradient against float64 contiguous: prints the relative error
PROBE = """
import torch
from torch import nn
torch.manual_seed(0)
conv = nn.Conv2d({in_channels}, 16, 1, stride=2, bias=False)
x = torch.randn(4, {in_channels}, 128, 128)
reference = conv.weight.detach().double().requires_grad_()
nn.functional.conv2d(x.double(), reference, stride=2).sum().backward()
conv = conv.to(memory_format=torch.channels_last)
conv(x.to(memory_format=torch.channels_last)).sum().backward()
print(float((conv.weight.grad.double() - reference.grad).abs().max() / reference.grad.abs().max()))
"""
TOLERANCE = 1e-4  # fp32 sums of 16k terms: 2e-7 measured where the kernel is sound


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch is built without oneDNN")
@pytest.mark.parametrize("in_channels", [8, 4], ids=["avx512-block", "avx2-block"])
def test_cpu_has_no_onednn_1x1_strided_bug(in_channels: int) -> None:
    """8 input channels are below AVX-512's channel block (16), 4 below AVX2's (8)."""
    run = subprocess.run(
        [sys.executable, "-c", PROBE.format(in_channels=in_channels)], capture_output=True, text=True, timeout=120
    )
    bug = f"this CPU has oneDNN's channels-last 1x1 stride-2 weight-gradient bug at {in_channels} input channels"
    if run.returncode < 0:
        pytest.skip(f"{bug}: the probe died of {signal.Signals(-run.returncode).name}")
    assert run.returncode == 0, run.stderr
    error = float(run.stdout.split()[-1])
    if not error <= TOLERANCE:
        pytest.skip(f"{bug}: its weight gradient is off by {error:.3g} (relative)")


def _resnet(first_channels: int) -> ConvNet:
    """Two stages; the second's strided 1x1 shortcut has `first_channels` input channels."""
    return ConvNet(ConvNetConfig(channels=(first_channels, 32), blocks=(1, 1), num_classes=10))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch is built without oneDNN")
def test_whole_model_refuses_channels_last_for_faulty_convs() -> None:
    few, enough = _resnet(8), _resnet(16)
    assert onednn_faulty_convs(few) == ["stages.1.0.downsample.0"]
    assert inductor_options(WHOLE_MODEL, few) == {"layout_optimization": False}
    assert onednn_faulty_convs(enough) == [] and inductor_options(WHOLE_MODEL, enough) == {}  # torch's default
    assert inductor_options("stages.0.0", enough) == {"layout_optimization": False}  # blocks: always off
    unstrided = nn.Sequential(nn.Conv2d(4, 16, 1), nn.Conv2d(16, 16, 3, stride=2))
    assert onednn_faulty_convs(unstrided) == []
    with torch.backends.mkldnn.flags(enabled=False):
        assert onednn_faulty_convs(few) == [] and inductor_options(WHOLE_MODEL, few) == {}


def resnet_few_channels(batch_size: int, seq_len: int) -> tuple[ConvNet, tuple[torch.Tensor, torch.Tensor]]:
    """Spec f"{__file__}:resnet_few_channels": a strided 1x1 shortcut with 8 input channels."""
    images = torch.randn(batch_size, 3, seq_len, seq_len)
    return _resnet(8), (images, torch.randint(0, 10, (batch_size,)))


@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch is built without oneDNN")
def test_whole_model_prediction_uses_the_layout_it_runs_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """plan_compiled estimates the whole model's peak with layout optimization off, as compile_blocks runs it."""
    from planner.config import TrainConfig
    from planner.solver import compiled

    seen: list[dict] = []

    def recording(*args, **kwargs):
        seen.append(dict(args[5]))
        return frontier(*args, **kwargs)

    frontier = compiled.block_frontier
    monkeypatch.setattr(compiled, "block_frontier", recording)
    config = TrainConfig(batch_size=2, seq_len=16)
    compiled.plan_compiled(f"{__file__}:resnet_few_channels", config, 10**12, budgets=(1.0,), scope="model")
    assert seen == [{"layout_optimization": False}]
