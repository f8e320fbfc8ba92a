"""memplan: a simulation-first memory planner for PyTorch training.

    graph = planner.trace("llama-7b", batch_size=1, seq_len=4096, precision="bf16-mixed")
    config = planner.TrainConfig(batch_size=1, seq_len=4096, precision="bf16-mixed", gpu="h100-80gb")
    timeline = planner.simulate(graph, config)              # peak, phase, op and module at the peak
    plan = planner.solve(graph, config, budget_bytes=60 * 2**30)
    plan.save("plan.json")
    handle = planner.apply_plan(model, "plan.json")          # handle.remove() undoes it
"""

from planner.apply import PlanHandle, apply_plan
from planner.api import plan_model, simulate_model, verify_model
from planner.config import TrainConfig
from planner.graph import OpGraph
from planner.plan import Decision, Plan, PlanLadder, load_plan
from planner.planning import solve
from planner.simulate import Timeline, simulate
from planner.solve import InfeasibleBudget
from planner.spec import SpecError, list_presets, resolve_spec
from planner.trace import TraceError, trace

__all__ = [
    "Decision", "InfeasibleBudget", "OpGraph", "Plan", "PlanHandle", "PlanLadder", "SpecError", "Timeline",
    "TraceError", "TrainConfig", "apply_plan", "list_presets", "load_plan", "plan_model", "resolve_spec",
    "simulate", "simulate_model", "solve", "trace", "verify_model",
]
