"""Table: the model zoo. Hugging Face architectures built from tiny configs (no download) and a model
that keeps its layers as attributes: simulated peak against a real CPU step (fp32, AdamW), and a
plan at 60% of the way from model states to the no-plan peak, applied to the real model: its
measured peak against the budget, and its gradients against the model without a plan.

The builders live in benchmarks/zoo_models.py (`benchmarks.zoo_models:NAME`): the same spec is traced
on fake tensors and built for real.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from benchmarks.common import Options, print_table
from planner.api import trace_for
from planner.config import TrainConfig
from planner.errors import InfeasibleBudget
from planner.runtime.apply import apply_plan
from planner.runtime.verify import measure_step
from planner.simulation.step import simulate
from planner.solver.planning import solve
from planner.tracing.hf import disable_kv_cache
from planner.tracing.recorder import loss_of, run_step_inputs
from planner.tracing.specs import resolve_spec
from planner.units import format_bytes

PLAN_FRACTION = 0.6  # of the way from model states to the no-plan peak
# name, batch size, seq_len (vision models: image side), tolerance of the no-plan prediction
ZOO = [
    ("llama", 4, 64, 0.01),
    ("mistral", 4, 64, 0.01),
    ("phi", 4, 64, 0.01),
    ("gpt_neox", 4, 64, 0.01),
    ("gpt2", 4, 64, 0.01),
    ("bert", 4, 64, 0.01),
    ("t5", 4, 32, 0.01),
    ("vit", 8, 32, 0.01),
    ("swin", 2, 112, 0.01),
    ("mixtral", 4, 64, 0.03),
    ("mixtral_loop", 4, 64, 0.03),
    ("attribute_layers", 8, 64, 0.01),
    ("resnet", 4, 32, 0.01),  # a stage loops over its nn.Sequential without calling it
    ("deberta_v2", 4, 64, 0.01),  # a recompute that holds more than keeping during its backward
    ("qwen2_moe", 4, 64, 0.03),  # routed experts plus a gated shared expert
    ("whisper", 2, 32, 0.01),  # audio encoder-decoder (seq_len: encoder positions)
    ("mamba", 4, 32, 0.01),  # state-space blocks, no attention
    ("torch_transformer", 4, 32, 0.01),  # torch's nn.Transformer: deep-copied layers, padding masks
]


@dataclass(frozen=True)
class ZooRow:
    model: str
    predicted_bytes: int
    measured_bytes: int
    error: float  # (predicted - measured) / measured
    budget_bytes: int
    plan_decisions: int
    measured_with_plan_bytes: int
    over_budget: float  # (measured with plan - budget) / budget; <= 0 is within budget
    grads_equal: bool
    wall_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def _grads(model: nn.Module, inputs) -> list[torch.Tensor | None]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)  # the same dropout masks with and without the plan
    loss_of(run_step_inputs(model, inputs)).backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same(a: list, b: list) -> bool:
    def close(x, y) -> bool:
        if x is None or y is None:
            return x is None and y is None
        return torch.allclose(x, y, rtol=1e-4, atol=1e-6)

    return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))


def measure_zoo_model(name: str, batch_size: int, seq_len: int) -> ZooRow:
    """Trace, simulate, plan at PLAN_FRACTION, then run the model for real with and without it."""
    t0 = time.perf_counter()
    spec = f"benchmarks.zoo_models:{name}"
    config = TrainConfig(batch_size=batch_size, seq_len=seq_len)
    graph = trace_for(spec, config)
    base = simulate(graph, config)
    states = sum(base.model_states.values())
    budget = int(states + PLAN_FRACTION * (base.peak_bytes - states))
    try:
        plan = solve(graph, config, budget)
    except InfeasibleBudget as e:  # what blocks cannot recompute sets a floor above it: the tightest plan
        budget = e.smallest_peak_bytes
        plan = solve(graph, config, budget)
    torch.manual_seed(0)
    model, inputs = resolve_spec(spec).build(batch_size=batch_size, seq_len=seq_len)
    disable_kv_cache(model)
    plain = _grads(model, inputs)
    handle = apply_plan(model, plan)
    try:
        planned = _grads(model, inputs)
        with_plan = measure_step(model, inputs, config).peak_bytes
    finally:
        handle.remove()
    measured = measure_step(model, inputs, config).peak_bytes
    return ZooRow(
        name,
        base.peak_bytes,
        measured,
        (base.peak_bytes - measured) / measured,
        budget,
        len(plan.decisions),
        with_plan,
        (with_plan - budget) / budget,
        _same(plain, planned),
        round(time.perf_counter() - t0, 2),
    )


def run(opts: Options) -> list[dict]:
    entries = opts.select(ZOO, quick_names=("llama", "t5", "mixtral_loop", "attribute_layers"))
    return [measure_zoo_model(name, b, s).to_dict() for name, b, s, _ in entries]


def show(rows: list[dict]) -> None:
    print_table(
        "Model zoo: simulated vs real CPU step (fp32 AdamW); plan at 60% from model states to the peak",
        ["model", "predicted", "measured", "error", "plan budget", "measured with plan", "vs budget", "grads equal"],
        [
            [
                r["model"],
                format_bytes(r["predicted_bytes"]),
                format_bytes(r["measured_bytes"]),
                f"{r['error'] * 100:+.2f}%",
                format_bytes(r["budget_bytes"]),
                format_bytes(r["measured_with_plan_bytes"]),
                f"{r['over_budget'] * 100:+.2f}%",
                "yes" if r["grads_equal"] else "NO",
            ]
            for r in rows
        ],
    )
