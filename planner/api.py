"""High-level entry points that go from a model spec to results (the CLI calls only these)."""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter
from collections.abc import Callable, Hashable
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from costmodels.memory import get_precision
from planner.budgets import parse_budget
from planner.config import DEFAULT_TIME_LIMIT_S, TrainConfig
from planner.errors import InfeasibleBudget, MemplanError, PlanFileError
from planner.plans.format import CompiledPlan, Plan, PlanLadder, StagePlans, load_plan
from planner.plans.identity import check_plan_matches
from planner.runtime.apply import apply_plan
from planner.runtime.verify import Measurement, measure_step
from planner.simulation.layout import is_tensor_parallel, layout_timeline, role_of, simulate_ranks, trace_roles
from planner.simulation.pipeline import PipelineTimeline, heaviest_role, simulate_pipeline_roles
from planner.simulation.ranks import LayoutTimeline, RankCoords
from planner.simulation.step import Timeline, simulate
from planner.solver.baselines import check_strategy, strategy_choices
from planner.tracing.graph import OpGraph
from planner.tracing.hf import disable_kv_cache
from planner.tracing.recorder import trace, trace_for
from planner.tracing.specs import resolve_spec
from planner.units import format_bytes, over_budget

__all__ = [
    "simulate_model",
    "simulate_layout",
    "LayoutVerifyResult",
    "verify_layout",
    "simulate_pipeline_model",
    "plan_pipeline_model",
    "VerifyResult",
    "verify_model",
    "runs_on_ranks",
    "plan_for_config",
    "trace_for",
    "plan_model",
    "check_plan_for_spec",
]


def plan_for_config(plan: Plan | PlanLadder | str | Path | None, seq_len: int) -> Plan | None:
    """The plan to use at a sequence length (a ladder picks its bucket)."""
    if plan is None:
        return None
    if isinstance(plan, (str, Path)):
        plan = load_plan(plan)
    if isinstance(plan, CompiledPlan):
        raise PlanFileError(
            "this is a compiled plan (torch.compile); its predicted peak is in the plan, "
            "and memplan verify --plan measures it"
        )
    if isinstance(plan, PlanLadder):
        return plan.plan_for(seq_len)[0]
    if isinstance(plan, StagePlans):
        raise PlanFileError(
            f"this plan file holds one plan per pipeline stage (--pp {plan.pp} --pp-schedule {plan.schedule}); "
            f"simulate it with --pp {plan.pp}, or apply one stage with apply_plan(stage_module, plan, stage=i)"
        )
    return plan


def _check_strategy(plan, strategy: str) -> None:
    check_strategy(strategy)
    if strategy == "optimal":
        raise MemplanError(
            "a simulation takes a fixed --strategy (full, selective, every-N, ...); solve with memplan plan"
        )
    if plan is not None and strategy != "none":
        raise MemplanError("simulate under a plan file or a --strategy, not both")


def simulate_model(
    spec: str, config: TrainConfig, plan: Plan | PlanLadder | str | None = None, strategy: str = "none"
) -> Timeline:
    """Trace a spec at the config's shapes and simulate one step (under a plan, or a fixed recompute
    `strategy` of planner.solver.baselines, if given)."""
    _check_strategy(plan, strategy)
    chosen = plan_for_config(plan, config.seq_len)
    graph = trace_for(spec, config, lifetimes=chosen is not None or strategy != "none")
    timeline = simulate(graph, config, plan=chosen, choices=strategy_choices(graph, strategy))
    timeline.config["model"] = spec
    return timeline


def simulate_layout(
    spec: str, config: TrainConfig, plan: Plan | PlanLadder | str | None = None, strategy: str = "none"
) -> LayoutTimeline | PipelineTimeline:
    """Every rank of a parallel layout: a pipeline (``config.pp > 1``, with FSDP2 on dp) or tensor
    parallel (TP, TP × FSDP2), one trace and timeline per distinct role (under a plan, or a fixed
    recompute `strategy`, if given)."""
    _check_strategy(plan, strategy)
    if config.pp > 1:
        return simulate_pipeline_model(spec, config, plan, strategy)
    if strategy != "none":
        keys, graphs = trace_roles(spec, config)
        choices = {key: strategy_choices(graph, strategy) for key, graph in graphs.items()}
        return layout_timeline(spec, config, keys, graphs, choices=choices)
    return simulate_ranks(spec, config, plan_for_config(plan, config.seq_len))


def _refuse_pipeline(config: TrainConfig, command: str) -> None:
    """`command` does not handle pipelines yet: say so instead of planning one rank's whole model."""
    if config.pp > 1:
        raise MemplanError(
            f"memplan {command} does not handle --pp yet; simulate the pipeline with memplan simulate --pp {config.pp}"
        )


def _pipeline_roles(spec: str, config: TrainConfig) -> tuple[dict[Hashable, OpGraph], Callable[[RankCoords], Hashable]]:
    """The step traced at one microbatch's batch (what every stage is cut from), once per distinct
    role of a stage's ranks (tensor or expert parallel: trace_roles), and the role of each rank."""
    micro = config.batch_size // config.num_microbatches
    stage = config.with_(
        pp=1, pp_schedule="1f1b", pp_split="uniform", microbatches=None, stages_per_rank=None, batch_size=micro
    )
    if is_tensor_parallel(stage):
        keys, graphs = trace_roles(spec, stage)
        return dict(graphs), role_of(stage, keys)
    graph = trace(
        spec,
        batch_size=micro,
        seq_len=config.seq_len,
        precision=config.precision,
        gathered_params=config.zero_stage == 3,
        moe_imbalance=config.moe_imbalance,
        blocks=config.blocks,
        gpu=config.gpu,
    )
    return {(): graph}, lambda coords: ()


def _stage_plans_for(plan, config: TrainConfig) -> StagePlans:
    """A plan file for a pipeline: it must hold a plan per stage made for this schedule and --pp."""
    loaded = load_plan(plan) if isinstance(plan, (str, Path)) else plan
    if not isinstance(loaded, StagePlans):
        raise PlanFileError(
            "a pipeline runs a plan per stage; make one with memplan plan --pp N (this file holds one plan)"
        )
    if (
        loaded.pp != config.pp
        or loaded.schedule != config.pp_schedule
        or loaded.microbatches != config.num_microbatches
    ):
        raise PlanFileError(
            f"the stage plans are for --pp {loaded.pp} --pp-schedule {loaded.schedule} --microbatches "
            f"{loaded.microbatches}; simulate with those or re-plan with memplan plan --pp"
        )
    return loaded


def simulate_pipeline_model(
    spec: str, config: TrainConfig, plan: StagePlans | str | None = None, strategy: str = "none"
) -> PipelineTimeline:
    """Trace a spec once at one microbatch's batch and simulate every pipeline rank under the schedule
    (each stage under its plan, with stage plans from memplan plan --pp, or every stage under a
    fixed recompute `strategy`)."""
    _check_strategy(plan, strategy)
    stage_plans = _stage_plans_for(plan, config) if plan is not None else None
    graphs, key_of = _pipeline_roles(spec, config)
    from planner.solver.pipeline_plans import choices_of  # CP-SAT's stack only where a plan is read

    choices = {
        key: choices_of(graph, stage_plans) if stage_plans is not None else strategy_choices(graph, strategy)
        for key, graph in graphs.items()
    }
    if stage_plans is not None:
        config = config.with_(pp_split=",".join(str(len(s.blocks)) for s in stage_plans.stages))
    result = simulate_pipeline_roles(graphs, key_of, config, choices)
    for role in result.layout.roles:
        role.timeline.config["model"] = spec
    return result


def plan_pipeline_model(
    spec: str,
    config: TrainConfig,
    budget_bytes: int | str,
    *,
    keep=(),
    recompute=(),
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
):
    """A plan per pipeline stage under one budget for every pp rank: (PipelinePlan, StagePlans, the
    same choices as one plan for all stages, replayed: PipelineEvaluation). `budget_bytes` may be a
    percentage of the worst rank's no-plan peak."""
    graphs, key_of = _pipeline_roles(spec, config)
    heaviest = heaviest_role(graphs, config)
    graph = graphs[heaviest]  # the heaviest role's plan is checked on the others
    if isinstance(budget_bytes, str):
        baseline = simulate_pipeline_roles(graphs, key_of, config, heaviest=heaviest)
        budget_bytes = parse_budget(budget_bytes, baseline.peak_bytes)
    from planner.solver.pipeline_plans import (
        choices_of,
        evaluate_pipeline,
        solve_pipeline_split,
        stage_plans,
        uniform_choices,
    )

    result, config = solve_pipeline_split(
        graph, config, budget_bytes, keep=keep, recompute=recompute, time_limit_s=time_limit_s
    )
    plans = stage_plans(graph, config, result)
    if len(graphs) > 1:
        every = {key: choices_of(g, plans) for key, g in graphs.items()}
        over = [
            r
            for r in simulate_pipeline_roles(graphs, key_of, config, every).layout.roles
            if r.peak_bytes > budget_bytes
        ]
        if over:
            raise InfeasibleBudget(
                f"the stage plans made for the heaviest role leave rank {over[0].ranks[0]} "
                f"({over[0].coords.to_dict()}) at {over_budget(over[0].peak_bytes, budget_bytes)}; raise --budget",
                smallest_peak_bytes=over[0].peak_bytes,
            )
    uniform = evaluate_pipeline(graph, config, uniform_choices(graph, config, result), result.cuts)
    return result, plans, uniform


def diagnose_layout_model(spec: str, config: TrainConfig, *, time_limit_s: float = DEFAULT_TIME_LIMIT_S):
    """Diagnose a parallel job (``config`` with tp, cp, ep or pp > 1) on its worst rank, with its
    remedies simulated on every rank (planner.analysis.diagnose_layout.diagnose_layout)."""
    from planner.analysis.diagnose_layout import PlannedLayout, diagnose_layout

    def plan(new: TrainConfig, budget_bytes: int) -> PlannedLayout:
        if new.pp > 1:
            result, plans, _ = plan_pipeline_model(spec, new, budget_bytes, time_limit_s=time_limit_s)
            added = result.step_s_with / result.step_s_without - 1.0 if result.step_s_without > 0 else 0.0
            decisions = sum(len(stage.plan.decisions) for stage in plans.stages)
            return PlannedLayout(max(r.peak_with for r in result.ranks), added, decisions)
        planned, _, _ = plan_model(spec, new, budget_bytes, time_limit_s=time_limit_s)
        return PlannedLayout(planned.predicted.peak_bytes, planned.predicted.overhead, len(planned.decisions))

    return diagnose_layout(spec, config, lambda new: simulate_layout(spec, new), plan)


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


def verify_model(
    spec: str, config: TrainConfig, plan: Plan | PlanLadder | str | None = None, seed: int = 0
) -> VerifyResult:
    """Build the real model on CPU, run a warm-up and a measured step, compare with the simulator.
    One process: a layout whose ranks differ from it (:func:`runs_on_ranks`) is verify_layout's."""
    if runs_on_ranks(config):
        raise MemplanError("this layout's ranks each hold a share of the model; verify it with verify_layout")
    if config.shard_ranks > 1 and config.zero_stage in (1, 2):
        raise MemplanError(
            f"verify measures ZeRO-3 (FSDP2) on gloo ranks, not --zero {config.zero_stage}, which is simulated only; "
            "use --zero 3, or --zero 0 to measure one process"
        )
    if config.gpu != "cpu":
        raise ValueError(f"verify runs on this machine's CPU; use --gpu cpu (got {config.gpu})")
    if get_precision(config.precision).autocast_dtype == torch.float16:
        raise ValueError("fp16-mixed cannot be verified on CPU; use fp32, bf16 or bf16-mixed")
    plan_path = str(plan) if isinstance(plan, (str, Path)) else None
    if isinstance(plan, (str, Path)):
        plan = load_plan(plan)
    compiled = isinstance(plan, CompiledPlan)
    predicted = plan.predicted.peak_bytes if compiled else simulate_model(spec, config, plan).peak_bytes
    torch.manual_seed(seed)
    model, inputs = resolve_spec(spec).build(batch_size=config.batch_size, seq_len=config.seq_len)
    model.to(get_precision(config.precision).param_dtype)
    disable_kv_cache(model)  # as the trace and an applied plan run it
    handle = apply_plan(model, plan) if plan is not None else None
    try:
        if compiled:  # the profiler sees the buffers inductor allocates
            from planner.runtime.compiled import measure_compiled_step  # torch.compile's stack, only here

            measured: Measurement = measure_compiled_step(model, inputs, config)
        else:
            from planner.runtime.dryrun import planned_errors

            with planned_errors(plan) if plan is not None else nullcontext():
                measured = measure_step(model, inputs, config)
    finally:
        if handle is not None:
            handle.remove()
    error = (predicted - measured.peak_bytes) / measured.peak_bytes
    return VerifyResult(spec, predicted, measured.peak_bytes, error, measured.loss, config.to_dict(), plan_path)


def runs_on_ranks(config: TrainConfig) -> bool:
    """Whether verifying `config` needs its ranks as processes (verify_layout): tensor, context,
    expert or pipeline parallel, or FSDP2 sharding over data-parallel ranks."""
    parallel = config.tp > 1 or config.cp > 1 or config.ep > 1 or config.pp > 1
    return parallel or (config.shard_ranks > 1 and config.zero_stage == 3)


@dataclass(frozen=True)
class LayoutVerifyResult:
    """Predicted against measured peak of every rank of a parallel layout, each a CPU gloo process."""

    model: str
    predicted_bytes: list[int]  # per global rank
    measured_bytes: list[int]
    errors: list[float]  # (predicted - measured) / measured per rank
    config: dict
    plan: str | None
    # parameters the tensor-parallel ranks should hold alike and do not after the measured steps
    diverged_parameters: list[str] = field(default_factory=list)

    @property
    def worst_error(self) -> float:
        return max(self.errors, key=abs)

    def to_dict(self) -> dict:
        return {**asdict(self), "worst_error": self.worst_error}


def verify_layout(
    spec: str, config: TrainConfig, plan: str | None = None, timeout_s: float = 600.0
) -> LayoutVerifyResult:
    """Run the layout on ``config.world_size`` CPU processes under gloo (the TP or EP plan, the memplan
    plan, FSDP2 with --zero 3) and compare each rank's measured peak with its prediction."""
    if config.gpu != "cpu":
        raise ValueError(f"verify runs on this machine's CPU; use --gpu cpu (got {config.gpu})")
    if config.cpu_offload:
        raise MemplanError(
            "verify runs on CPU gloo ranks, where FSDP2's CPUOffloadPolicy cannot run (it copies to an "
            "accelerator); drop --cpu-offload (memplan simulate predicts it)"
        )
    dtensor_params = config.tp > 1 or config.ep > 1 or (config.zero_stage == 3 and config.shard_ranks > 1)
    if config.optimizer == "adafactor" and dtensor_params:
        raise MemplanError(
            "torch.optim.Adafactor cannot step DTensor parameters (FSDP2, tensor or expert parallel) in torch "
            "2.13: its in-place pow_ on a norm-partial tensor fails; verify with --optimizer adamw or sgd"
        )
    if config.pp > 1:
        return _verify_pipeline(spec, config, plan, timeout_s)
    loaded = plan_for_config(plan, config.seq_len)
    layout = simulate_layout(spec, config, loaded)
    by_rank = {r: role.peak_bytes for role in layout.roles for r in role.ranks}
    predicted = [by_rank[r] for r in range(config.world_size)]
    from planner.runtime.parallel_verify import measure_on_gloo_ranks  # torch.distributed's stack

    measured, diverged = measure_on_gloo_ranks(
        spec, config, loaded.to_dict() if loaded is not None else None, timeout_s
    )
    errors = [(p - m) / m for p, m in zip(predicted, measured)]
    return LayoutVerifyResult(
        spec, predicted, measured, errors, config.to_dict(), str(plan) if plan else None, diverged
    )


def _verify_pipeline(spec: str, config: TrainConfig, plan: str | None, timeout_s: float) -> LayoutVerifyResult:
    """Every rank of a pipeline (alone, or with FSDP2 on its data-parallel ranks), its stages cut by
    torch's pipeline tracer where the simulation cuts them (planner/runtime/pipeline_verify.py)."""
    from planner.runtime.pipeline_verify import measure_pipeline_on_gloo_ranks  # torch.distributed's stack

    stage_plans = _stage_plans_for(plan, config) if plan is not None else None
    timeline = simulate_pipeline_model(spec, config, stage_plans)
    if timeline.warnings:  # the real step would not be the simulated one
        raise MemplanError(timeline.warnings[0])
    by_rank = {r: role.peak_bytes for role in timeline.layout.roles for r in role.ranks}
    predicted = [by_rank[r] for r in range(config.world_size)]
    sent = stage_plans.to_dict() if stage_plans is not None else None
    measured = [
        m.peak_bytes for m in measure_pipeline_on_gloo_ranks(spec, config, timeline.blocks_per_stage, sent, timeout_s)
    ]
    errors = [(p - m) / m for p, m in zip(predicted, measured)]
    return LayoutVerifyResult(spec, predicted, measured, errors, config.to_dict(), plan)


def plan_model(
    spec: str,
    config: TrainConfig,
    budget_bytes: int | str,
    *,
    strategy: str = "optimal",
    offload: str | None = None,
    keep=(),
    recompute=(),
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
):
    """Trace, compare the baseline strategies and solve: (plan, comparison rows, no-plan peak).
    `budget_bytes` may be a percentage of the no-plan peak ('60%'). With `config.compile`, the plan
    is a CompiledPlan of per-block activation budgets (no comparison rows)."""
    _refuse_pipeline(config, "plan")
    if config.compile:
        from planner.solver.compiled import plan_compiled  # torch.compile's stack, only here

        plan = plan_compiled(spec, config, budget_bytes, time_limit_s=time_limit_s)
        return plan, [], plan.predicted.baseline_peak_bytes
    roles = trace_roles(spec, config) if is_tensor_parallel(config) else None
    graph = _worst_role(config, roles[1]) if roles else trace_for(spec, config)
    if isinstance(budget_bytes, str):
        budget_bytes = parse_budget(budget_bytes, simulate(graph, config).peak_bytes)
    if not graph.regions:
        _check_without_blocks(graph, config, budget_bytes)
    from planner.solver.planning import solve

    plan = solve(
        graph,
        config,
        budget_bytes,
        strategy=strategy,
        offload=offload,
        keep=keep,
        recompute=recompute,
        time_limit_s=time_limit_s,
    )
    if roles:
        _check_every_rank(spec, config, roles, plan, budget_bytes)
    from planner.solver.planning import compare_strategies

    rows = compare_strategies(graph, config, budget_bytes)
    return plan, rows, plan.predicted.baseline_peak_bytes


def _worst_role(config: TrainConfig, graphs: dict) -> OpGraph:
    """The graph of the rank role whose no-plan peak is highest: a plan solved for it holds on the others."""
    return max(graphs.values(), key=lambda g: simulate(g, config).peak_bytes)


def _check_every_rank(spec: str, config: TrainConfig, roles: tuple, plan: Plan, budget_bytes: int) -> None:
    """A plan solved for the worst rank, simulated on every rank role: each must hold the budget."""
    layout = layout_timeline(spec, config, *roles, plan=plan)
    over = [r for r in layout.roles if r.peak_bytes > budget_bytes]
    if over:
        raise InfeasibleBudget(
            f"the plan for the worst rank leaves rank {over[0].ranks[0]} at "
            f"{over_budget(over[0].peak_bytes, budget_bytes)}; raise the budget or use --tp-plan with even shards",
            smallest_peak_bytes=layout.peak_bytes,
        )


def _check_without_blocks(graph, config: TrainConfig, budget_bytes: int) -> None:
    """A model without blocks cannot lower its peak: say what would make it plannable."""
    peak = simulate(graph, config).peak_bytes
    if budget_bytes >= peak:
        return
    paths = sorted({op.module for op in graph.ops[: graph.backward_start] if op.module})
    nested = [p.split(".")[0] for p in paths if "." in p]
    example = f"{nested[0]}.*" if nested else (paths[0] if paths else "layer*")
    raise InfeasibleBudget(
        f"budget {format_bytes(budget_bytes)} is below the no-plan peak {format_bytes(peak)} and memplan "
        "found no blocks to recompute or offload in this model (it looks for the children of "
        "nn.ModuleList/Sequential/ModuleDict and for repeated submodules of the same structure); name "
        f"them with --blocks GLOB (module paths, e.g. --blocks '{example}'), or cut model states "
        "(--precision bf16-mixed, --optimizer adamw-8bit, --zero 3 --dp N)",
        smallest_peak_bytes=peak,
    )


def check_plan_for_spec(spec: str, config: TrainConfig, plan_path: str) -> str:
    """Build the model on the meta device, check the plan matches it, run it once on fake
    tensors (a plan that would fail is refused naming the module), describe what it wraps."""
    plan = load_plan(plan_path)
    with torch.device("meta"):
        model, _ = resolve_spec(spec).build(batch_size=config.batch_size, seq_len=config.seq_len)
    if isinstance(plan, CompiledPlan):
        check_plan_matches(plan, model)
        counts = Counter(plan.budgets.values())
        return (
            f"compiled plan matches {spec}: "
            + ", ".join(f"{n} blocks at activation_memory_budget {b:g}" for b, n in sorted(counts.items()))
            + f"; predicted peak {format_bytes(plan.predicted.peak_bytes)}, recompute "
            f"{plan.predicted.overhead * 100:.1f}% of the eager step\n"
            "apply it in your training script with: handle = planner.apply_plan(model, 'PLAN.json')"
        )
    if isinstance(plan, StagePlans):  # each stage's plan against the whole model it was cut from
        lines = []
        for sp in plan.stages:
            check_plan_matches(sp.plan, model)
            lines.append(
                f"stage {sp.stage} (pp rank {sp.pp_rank}, {sp.in_flight} microbatches in flight): "
                f"{len(sp.plan.recompute_modules())} of {len(sp.blocks)} blocks' modules recomputed; predicted peak "
                f"{format_bytes(sp.plan.predicted.peak_bytes)}"
                + (
                    f"; {', '.join(sp.early_recompute)} recomputed while it waits for a gradient"
                    if sp.early_recompute
                    else ""
                )
            )
        lines.append(
            "apply it on each stage's module with: handle = planner.apply_plan(stage_module, 'PLAN.json', stage=i)"
        )
        if any(sp.early_recompute for sp in plan.stages):
            lines.append(
                "and step the schedule under: with planner.recompute_in_bubbles(schedule, handles): ... "
                "(the handles of this rank's stages)"
            )
        return "\n".join(lines)
    plans = [p for _, p in plan.buckets] if isinstance(plan, PlanLadder) else [plan]
    lines = []
    for p in plans:
        if get_precision(p.config["precision"]).param_dtype != torch.float32:
            model.to(get_precision(p.config["precision"]).param_dtype)
        check_plan_matches(p, model)
        from planner.runtime.dryrun import dry_run

        dry_run(resolve_spec(spec), config.with_(seq_len=int(p.config["seq_len"])), p)
        kinds = Counter(d.action if d.op is None else f"{d.action} op" for d in p.decisions)
        lines.append(
            f"seq {p.config['seq_len']}: {p.strategy} plan matches {spec}; "
            + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))
            + f"; predicted peak {format_bytes(p.predicted.peak_bytes)}, overhead "
            f"{p.predicted.overhead * 100:.1f}%"
        )
    lines.append("apply it in your training script with: handle = planner.apply_plan(model, 'PLAN.json')")
    return "\n".join(lines)


def _simulate_dict(args: tuple[str, TrainConfig, str | None, str]) -> dict:
    spec, config, plan, strategy = args
    torch.set_num_threads(1)
    if config.pp > 1 or is_tensor_parallel(config):  # every rank; the worst one's timeline at the top level
        return simulate_layout(spec, config, plan, strategy).to_dict()
    return simulate_model(spec, config, plan, strategy).to_dict()


def simulate_sweep(
    spec: str,
    configs: list[TrainConfig],
    plan: str | None = None,
    workers: int | None = None,
    strategy: str = "none",
) -> list[dict]:
    """Simulate several configs (a sequence-length sweep), tracing them in parallel processes."""
    _check_strategy(plan, strategy)
    workers = min(len(configs), workers or os.cpu_count() or 1)
    jobs = [(spec, c, plan, strategy) for c in configs]
    if workers <= 1 or len(configs) <= 1:
        return [_simulate_dict(j) for j in jobs]
    resolve_spec(spec)  # fail fast, in this process, on an unknown spec
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_simulate_dict, jobs))
