"""High-level entry points that go from a model spec to results (the CLI calls only these)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from costmodels.memory import get_precision
from planner.config import TrainConfig
from planner.plan import Plan, PlanLadder, load_plan
from planner.simulate import Timeline, simulate
from planner.spec import resolve_spec
from planner.trace import trace
from planner.verify import Measurement, measure_step

__all__ = ["simulate_model", "VerifyResult", "verify_model", "plan_for_config"]


def plan_for_config(plan: Plan | PlanLadder | str | Path | None, seq_len: int) -> Plan | None:
    """The plan to use at a sequence length (a ladder picks its bucket)."""
    if plan is None:
        return None
    if isinstance(plan, (str, Path)):
        plan = load_plan(plan)
    if isinstance(plan, PlanLadder):
        return plan.plan_for(seq_len)[0]
    return plan


def simulate_model(spec: str, config: TrainConfig, plan: Plan | PlanLadder | str | None = None) -> Timeline:
    """Trace a spec at the config's shapes and simulate one step (under a plan, if given)."""
    graph = trace(spec, batch_size=config.batch_size, seq_len=config.seq_len, precision=config.precision,
                  gathered_params=config.zero_stage == 3)
    timeline = simulate(graph, config, plan=plan_for_config(plan, config.seq_len))
    timeline.config["model"] = spec
    return timeline


@dataclass(frozen=True)
class VerifyResult:
    """Predicted against measured peak of one real step on this machine."""

    model: str
    predicted_bytes: int
    measured_bytes: int
    error: float  # (predicted - measured) / measured
    loss: float
    config: dict
    plan: str | None

    def to_dict(self) -> dict:
        return asdict(self)


def verify_model(spec: str, config: TrainConfig, plan: Plan | PlanLadder | str | None = None,
                 seed: int = 0) -> VerifyResult:
    """Build the real model on CPU, run a warm-up and a measured step, compare with the simulator."""
    from planner.apply import apply_plan

    if config.gpu != "cpu":
        raise ValueError(f"verify runs on this machine's CPU; use --gpu cpu (got {config.gpu})")
    if get_precision(config.precision).autocast_dtype == torch.float16:
        raise ValueError("fp16-mixed cannot be verified on CPU; use fp32, bf16 or bf16-mixed")
    plan_path = str(plan) if isinstance(plan, (str, Path)) else None
    if isinstance(plan, (str, Path)):
        plan = load_plan(plan)
    timeline = simulate_model(spec, config, plan)
    torch.manual_seed(seed)
    model, inputs = resolve_spec(spec).build(batch_size=config.batch_size, seq_len=config.seq_len)
    model.to(get_precision(config.precision).param_dtype)
    handle = apply_plan(model, plan) if plan is not None else None
    try:
        measured: Measurement = measure_step(model, inputs, config)
    finally:
        if handle is not None:
            handle.remove()
    error = (timeline.peak_bytes - measured.peak_bytes) / measured.peak_bytes
    return VerifyResult(spec, timeline.peak_bytes, measured.peak_bytes, error, measured.loss,
                        config.to_dict(), plan_path)
