"""planner.runtime.dryrun: a plan run once on fake tensors before the real model runs it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from planner.config import TrainConfig
from planner.errors import PlanFileError
from planner.plans.format import Decision
from planner.runtime.dryrun import dry_run
from planner.solver.planning import solve
from planner.tracing.recorder import trace
from planner.tracing.specs import ModelSpec


class Stage(nn.Module):
    """Loops over its nn.Sequential instead of calling it (transformers' ResNetStage)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _stages(batch_size: int, seq_len: int):
    return nn.Sequential(Stage(), Stage()), (torch.randn(batch_size, seq_len, 8),)


def test_a_plan_on_a_module_whose_forward_never_runs_is_refused_in_one_line():
    """Wrapping the forward of a module the model loops over changes nothing: the step would run at
    the no-plan peak while the plan promised less. A hand-written plan naming one is refused."""
    spec = ModelSpec("stages", "stages looping over Sequentials", _stages)
    config = TrainConfig(batch_size=2, seq_len=8)
    plan = solve(trace(spec, batch_size=2, seq_len=8), config, 10**9)
    good = dataclasses.replace(plan, decisions=(Decision("0", "recompute"),))
    dry_run(spec, config, good)
    bad = dataclasses.replace(plan, decisions=(Decision("1.layers", "recompute"),))
    with pytest.raises(PlanFileError, match=r"^module '1.layers' never runs its own forward[^\n]*parent instead$"):
        dry_run(spec, config, bad)
