"""memplan: a simulation-first memory planner for PyTorch training.

    graph = planner.tracing.recorder("llama-7b", batch_size=1, seq_len=4096, precision="bf16-mixed")
    config = planner.TrainConfig(batch_size=1, seq_len=4096, precision="bf16-mixed", gpu="h100-80gb")
    timeline = planner.simulation.step(graph, config)              # peak, phase, op and module at the peak
    plan = planner.solver.cpsat(graph, config, budget_bytes=60 * 2**30)
    plan.save("plan.json")
    handle = planner.apply_plan(model, "plan.json")          # handle.remove() undoes it
"""

from planner.api import plan_model, simulate_model, verify_model
from planner.config import TrainConfig
from planner.errors import InfeasibleBudget, SpecError, TraceError
from planner.plans.format import Decision, Plan, PlanLadder, load_plan
from planner.runtime.apply import PlanHandle, apply_plan
from planner.runtime.auto import auto_checkpoint, plan_for
from planner.runtime.monitor import MemoryMonitor
from planner.simulation.step import Timeline, simulate
from planner.solver.planning import solve
from planner.tracing.graph import OpGraph
from planner.tracing.recorder import trace
from planner.tracing.specs import list_presets, resolve_spec

__all__ = [
    "Decision", "InfeasibleBudget", "MemoryMonitor", "OpGraph", "Plan", "PlanHandle", "PlanLadder", "SpecError",
    "Timeline", "TraceError", "TrainConfig", "apply_plan", "auto_checkpoint", "list_presets", "load_plan",
    "plan_for", "plan_model", "resolve_spec", "simulate", "simulate_model", "solve", "trace", "verify_model",
]
