"""Block detection: repeated layers, ResNet stages, ModuleDicts, flat Sequentials as segments."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.api import plan_model, verify_model
from planner.config import TrainConfig
from planner.runtime.apply import apply_plan
from planner.tracing.blocks import find_region_paths, parse_segment, segment_children
from planner.tracing.recorder import loss_of, run_step_inputs
from planner.tracing.specs import resolve_spec

FLAT = """
import torch
from torch import nn


def flat(batch_size, seq_len):
    layers = []
    for _ in range(8):
        layers += [nn.Linear(64, 64), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.Linear(64, 1)), (torch.randn(batch_size, seq_len, 64),)
"""


def test_presets_blocks_are_the_layers():
    with torch.device("meta"):
        llama, _ = resolve_spec("llama-7b-tiny").build(batch_size=1, seq_len=8)
        resnet, _ = resolve_spec("resnet-tiny").build(batch_size=1, seq_len=8)
    assert find_region_paths(llama) == [f"layers.{i}" for i in range(len(llama.layers))]
    assert all(p.startswith("stages.") for p in find_region_paths(resnet))
    assert not any(p.startswith("stem") for p in find_region_paths(resnet))


def test_module_dict_children_are_blocks():
    model = nn.Module()
    model.blocks = nn.ModuleDict(
        {f"b{i}": nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)) for i in range(3)}
    )
    assert find_region_paths(model) == ["blocks.b0", "blocks.b1", "blocks.b2"]


def test_flat_sequential_becomes_segments_of_repeated_patterns():
    layers = []
    for _ in range(9):
        layers += [nn.Linear(8, 8), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(8, 1))
    paths = find_region_paths(model)
    assert paths == ["0:6", "6:12", "12:18"]  # 9 repeats of (Linear, ReLU), 3 per segment
    assert parse_segment("6:12") == ("", 6, 12)
    assert segment_children(model, "6:12") == [str(k) for k in range(6, 12)]
    with pytest.raises(ValueError, match="nn.Sequential"):
        segment_children(model, "6:99")


def test_flat_sequential_plan_is_applied_exactly(tmp_path):
    path = tmp_path / "flat.py"
    path.write_text(FLAT)
    spec, config = f"{path}:flat", TrainConfig(batch_size=8, seq_len=128)
    _, _, baseline = plan_model(spec, config, 10**12)
    plan, _, _ = plan_model(spec, config, int(0.9 * baseline))
    assert any(parse_segment(d.module) for d in plan.decisions)
    result = verify_model(spec, config, plan)
    assert result.measured_bytes <= plan.budget_bytes
    assert abs(result.error) <= 0.03

    grads = []
    for planned in (False, True):
        torch.manual_seed(0)
        model, inputs = resolve_spec(spec).build(batch_size=2, seq_len=16)
        handle = apply_plan(model, plan) if planned else None
        loss_of(run_step_inputs(model, inputs)).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if handle is not None:
            handle.remove()
            assert "forward" not in model.__dict__
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
