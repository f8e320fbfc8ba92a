"""memplan: a simulation-first memory planner for PyTorch training.

graph = planner.trace("llama-7b", batch_size=1, seq_len=4096, precision="bf16-mixed")
config = planner.TrainConfig(batch_size=1, seq_len=4096, precision="bf16-mixed", gpu="h100-80gb")
timeline = planner.simulate(graph, config)               # peak, phase, op and module at the peak
plan = planner.solve(graph, config, 60 * 2**30)
plan.save("plan.json")
handle = planner.apply_plan(model, "plan.json")          # handle.remove() undoes it

Under torch.compile: plan = planner.plan_compiled("llama-7b", config, "60%"), then apply_plan as above.
"""

from importlib import import_module

# Public names and the modules that define them. They are imported on first use (PEP 562), so
# `import planner.cli.main` stays light and the CLI can end a Ctrl-C during the heavy imports
# (torch, OR-Tools: seconds) with one line; `from planner import X` works as before.
_EXPORTS = {
    "plan_model": "planner.api",
    "simulate_model": "planner.api",
    "verify_model": "planner.api",
    "TrainConfig": "planner.config",
    "InfeasibleBudget": "planner.errors",
    "SpecError": "planner.errors",
    "TraceError": "planner.errors",
    "CompiledPlan": "planner.plans.format",
    "Decision": "planner.plans.format",
    "Plan": "planner.plans.format",
    "PlanLadder": "planner.plans.format",
    "load_plan": "planner.plans.format",
    "PlanHandle": "planner.runtime.apply",
    "apply_plan": "planner.runtime.apply",
    "auto_checkpoint": "planner.runtime.auto",
    "recompute_in_bubbles": "planner.runtime.early_recompute",
    "plan_for": "planner.runtime.auto",
    "MemoryMonitor": "planner.runtime.monitor",
    "Timeline": "planner.simulation.step",
    "simulate": "planner.simulation.step",
    "plan_compiled": "planner.solver.compiled",
    "solve": "planner.solver.planning",
    "OpGraph": "planner.tracing.graph",
    "trace": "planner.tracing.recorder",
    "list_presets": "planner.tracing.specs",
    "resolve_spec": "planner.tracing.specs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
