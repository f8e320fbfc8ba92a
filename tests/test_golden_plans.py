"""Golden plans: the plans that memplan produces for six representative cases stay identical.

Regenerate (only on purpose, when a change is meant to alter plans):
    MEMPLAN_REGEN_GOLDEN=1 python -m pytest tests/test_golden_plans.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from models_for_tests import PATH

from planner.api import plan_model, trace_for
from planner.config import TrainConfig
from planner.simulation.step import simulate

GOLDEN = Path(__file__).parent / "golden"

# name -> (spec, config, fraction of the no-plan peak, strategy, offload)
SLOW_CASES = {"zero3-llama-7b"}  # a 7B trace: about 14 s
CASES = {
    "dense-llama": (f"{PATH}:llama_small", TrainConfig(batch_size=4, seq_len=256), 0.6, "optimal", None),
    "selective-gpt": (f"{PATH}:gpt_small", TrainConfig(batch_size=4, seq_len=256), 0.8, "optimal", None),
    "offload-disk": (f"{PATH}:llama_small", TrainConfig(batch_size=4, seq_len=256), 0.38, "optimal", "disk"),
    "zero3-llama-7b": (
        "llama-7b",
        TrainConfig(batch_size=1, seq_len=4096, precision="bf16-mixed", zero_stage=3, dp=8, gpu="h100-80gb"),
        0.5,
        "optimal",
        None,
    ),
    "flat-sequential": (f"{PATH}:flat_sequential", TrainConfig(batch_size=16, seq_len=128), 0.7, "optimal", None),
}
LADDER = ("gpt2-tiny", TrainConfig(batch_size=8, seq_len=128), (32, 64, 128), 0.85)
VOLATILE = ("memplan_version", "wall_s")


def _stable(d):
    if isinstance(d, dict):
        return {k: _stable(v) for k, v in d.items() if k not in VOLATILE}
    if isinstance(d, str):
        return d.replace(PATH, "models_for_tests.py")
    if isinstance(d, list):
        return [_stable(v) for v in d]
    return d


def _plan_dict(spec: str, config: TrainConfig, fraction: float, strategy: str, offload: str | None) -> dict:
    peak = simulate(trace_for(spec, config, lifetimes=False), config).peak_bytes
    plan, _, _ = plan_model(spec, config, int(fraction * peak), strategy=strategy, offload=offload)
    return _stable(plan.to_dict())


def _ladder_dict() -> dict:
    spec, config, lens, fraction = LADDER
    return {str(n): _plan_dict(spec, config.with_(seq_len=n), fraction, "optimal", None) for n in lens}


def _check(name: str, got: dict) -> None:
    path = GOLDEN / f"{name}.json"
    if os.environ.get("MEMPLAN_REGEN_GOLDEN"):
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    assert got == json.loads(path.read_text()), f"plan for {name} changed"


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in CASES])
def test_golden_plan(name):
    _check(name, _plan_dict(*CASES[name]))


def test_golden_ladder():
    _check("ladder-gpt2", _ladder_dict())
