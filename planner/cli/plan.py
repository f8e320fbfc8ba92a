"""`memplan plan`: solve which activations to keep, recompute or offload under a budget."""

from __future__ import annotations

from costmodels.hardware import get_device
from planner.budgets import budget_request, usable_bytes
from planner.cli import report
from planner.cli.guard import guarded_imports
from planner.cli.options import add_model_options, config_from_args, write_json
from planner.config import DEFAULT_RESERVE, DEFAULT_TIME_LIMIT_S
from planner.units import format_bytes

__all__ = ["register", "run", "budget_for"]

EXAMPLE = (
    "memplan plan --model llama-70b --gpu h100-80gb --seq-len 4096 --precision bf16-mixed "
    "--zero 3 --dp 32 --out plan.json\n"
    "  memplan plan --model llama-7b-tiny --batch-size 8 --seq-len 256 --budget 36MiB --offload disk "
    "--out plan.json\n"
    "  memplan plan --model llama-70b-tiny --batch-size 4 --seq-len 64 --pp 2 --pp-schedule 1f1b --budget 90% "
    "--out stages.json"
)


def register(add) -> None:
    p = add("plan", "solve which activations to keep, recompute or offload under a memory budget", run, EXAMPLE)
    add_model_options(p, default_gpu="cpu")
    p.add_argument(
        "--budget",
        help="peak-memory budget: a size (40GiB, 123456789B) or a percentage of the no-plan "
        "peak (60%%) (default: GPU capacity less --reserve)",
    )
    p.add_argument(
        "--reserve",
        type=float,
        default=DEFAULT_RESERVE,
        help="fraction of the GPU kept free when --budget is not given",
    )
    p.add_argument("--offload", default="none", help="allow offloading to: none, cpu, disk")
    p.add_argument(
        "--strategy",
        default="optimal",
        help="optimal, none, full, every-N (e.g. every-2), sqrt, op-sac (torch's op-level SAC), "
        "op-sac-alt (torchtitan's: also recomputes every second matmul), megatron-selective",
    )
    p.add_argument("--keep", action="append", default=[], metavar="GLOB", help="never recompute modules matching GLOB")
    p.add_argument(
        "--recompute", action="append", default=[], metavar="GLOB", help="always recompute modules matching GLOB"
    )
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S, help="solver time limit in seconds")
    p.add_argument("--out", required=True, help="plan file to write (JSON)")
    p.add_argument(
        "--plot", metavar="PNG", help="write the step's memory without and with the plan on one plot (one --seq-len)"
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="plan for torch.compile: activation_memory_budget per block or for the whole model (writes a compiled plan)",
    )
    p.add_argument(  # its values are checked by plan_compiled (planner.solver.compiled.SCOPES: torch to import)
        "--compile-scope",
        default="auto",
        metavar="SCOPE",
        help="with --compile: 'blocks' compiles each block at its own budget, 'model' the whole model at "
        "one budget, 'auto' whichever recomputes less",
    )


def budget_for(args) -> int | str:
    """--budget (bytes, or a percentage of the no-plan peak left as '60%'), else the GPU's capacity
    less the --reserve fraction."""
    if args.budget:
        return budget_request(args.budget)
    return usable_bytes(get_device(args.gpu).memory_bytes, args.reserve)


def _plan_one(args, config, budget: int | str):
    with guarded_imports():
        from planner.api import plan_model
        from planner.tracing.moe import describe_routing
    plan, rows, baseline = plan_model(
        args.model,
        config,
        budget,
        strategy=args.strategy,
        offload=args.offload,
        keep=args.keep,
        recompute=args.recompute,
        time_limit_s=args.time_limit,
    )
    lines = [
        [r.strategy, format_bytes(r.peak_bytes), f"{r.overhead * 100:.1f}%", "yes" if r.fits else "no"] for r in rows
    ]
    lines.append(
        [
            f"{plan.strategy} (chosen)",
            format_bytes(plan.predicted.peak_bytes),
            f"{plan.predicted.overhead * 100:.1f}%",
            "yes",
        ]
    )
    print(
        f"{args.model} seq {config.seq_len} batch {config.batch_size} {config.precision} on {config.gpu}: "
        f"budget {format_bytes(plan.budget_bytes)}, no-plan peak {format_bytes(baseline)}"
    )
    print(report.table(["strategy", "peak", "overhead", "fits"], lines))
    if "moe_routing" in plan.config:
        print(describe_routing(plan.config["moe_routing"]))
    if plan.predicted.hidden_recompute_s > 0:
        print(
            f"recompute {plan.predicted.recompute_s:.4g}s, of which {plan.predicted.hidden_recompute_s:.4g}s runs "
            "while a block's backward waits for its next all-gather (it adds nothing to the step)"
        )
    s = plan.solver
    print(
        f"solver: {s.status}, added time {s.objective:.4g}s, bound {s.bound:.4g}s, gap {s.gap * 100:.2f}%, "
        f"{s.wall_s:.1f}s; {len(plan.decisions)} decisions"
    )
    return plan, rows


def run(args) -> None:
    budget = budget_for(args)
    with guarded_imports():
        from planner.cli.compiled import run_compiled
        from planner.plans.format import PlanLadder
    if args.compile:
        return run_compiled(args, config_from_args(args).with_(compile=True), budget)
    if config_from_args(args).pp > 1:
        return _plan_pipeline(args, config_from_args(args), budget)
    if args.plot and len(args.seq_len) > 1:
        raise ValueError("--plot draws one plan; give one --seq-len")
    solved = {s: _plan_one(args, config_from_args(args, s), budget) for s in args.seq_len}
    plans = [(s, plan) for s, (plan, _) in solved.items()]
    if len(plans) == 1:
        plan = plans[0][1]
    else:
        plan = PlanLadder(buckets=tuple(plans))
    plan.save(args.out)
    print(f"wrote {args.out}")
    if args.plot:
        _plot_with_and_without(args, plan)
    strategies = {str(s): [r.to_dict() for r in rows] for s, (_, rows) in solved.items()}
    write_json(args.json_path, {"plan": plan.to_dict(), "strategies": strategies})  # and the table printed above


def _plan_pipeline(args, config, budget: int | str) -> None:
    """`plan --pp N`: a plan per stage, each stage rank's peak within the same budget."""
    if len(args.seq_len) > 1:
        raise ValueError("memplan plan --pp plans one --seq-len; give one")
    if args.plot:
        raise ValueError(
            "memplan plan --pp draws no --plot; simulate the stage plans with memplan simulate --pp --plan"
        )
    if args.strategy != "optimal":
        raise ValueError(f"memplan plan --pp solves each stage (--strategy optimal), not --strategy {args.strategy}")
    if args.offload not in (None, "none"):
        raise ValueError("memplan plan --pp recomputes only; drop --offload")
    with guarded_imports():
        from planner.api import plan_pipeline_model
        from planner.simulation.pipeline_fsdp import split_backward_gradient_hazard
        from planner.simulation.pipeline_schedule import pipeline_schedule
    result, plans, uniform = plan_pipeline_model(
        args.model, config, budget, keep=args.keep, recompute=args.recompute, time_limit_s=args.time_limit
    )
    base_s, step_s = result.step_s_without, result.step_s_with

    def pct(x: float) -> str:
        return f"{x / base_s * 100:.1f}%" if base_s > 0 else "0.0%"

    print(
        f"{args.model} seq {config.seq_len} batch {config.batch_size} {config.precision} on {config.gpu}, "
        f"--pp {config.pp} {config.pp_schedule}, {config.num_microbatches} microbatches: budget "
        f"{format_bytes(result.budget_bytes)} for every rank"
    )
    hazard = split_backward_gradient_hazard(config, pipeline_schedule(config))
    if hazard:
        print(f"warning: {hazard}")
    rows = []
    for r, peak_u in zip(result.ranks, uniform.peaks):
        recomputed = [n for n in r.option_names if n != "keep"]
        rows.append(
            [
                ",".join(map(str, r.stages)),
                r.rank,
                r.in_flight,
                format_bytes(r.peak_without),
                format_bytes(r.peak_with),
                f"{r.recompute_s:.4g}s",
                f"{len(recomputed)}/{len(r.option_names)}",
                format_bytes(peak_u),
            ]
        )
    headers = ["stage", "pp rank", "in flight", "no-plan peak", "peak", "recompute", "blocks", "one-plan peak"]
    print(report.table(headers, rows))
    print(
        f"step {base_s:.4g}s -> {step_s:.4g}s with a plan per stage (+{pct(step_s - base_s)}); one plan for all "
        f"stages: {uniform.step_s:.4g}s (+{pct(uniform.step_s - base_s)})"
    )
    plans.save(args.out)
    print(f"wrote {args.out}")
    print("apply it on each stage's module with: handle = planner.apply_plan(stage_module, 'PLAN.json', stage=i)")
    one_plan = {
        "peaks_bytes": list(uniform.peaks),
        "recompute_s": list(uniform.recompute_s),
        "step_s": uniform.step_s,
        "fits": all(p <= result.budget_bytes for p in uniform.peaks),
    }
    write_json(args.json_path, {"plan": plans.to_dict(), "pipeline": result.to_dict(), "one_plan_for_all": one_plan})


def _plot_with_and_without(args, plan) -> None:
    """The no-plan and the planned step's total memory over the step, with the budget line."""
    from planner.api import simulate_model

    config = config_from_args(args)
    curves = {
        "no plan": simulate_model(args.model, config).to_dict(),
        "with the plan": simulate_model(args.model, config, plan).to_dict(),
    }
    title = f"{args.model} batch {config.batch_size} seq {config.seq_len} {config.precision} on {config.gpu}"
    report.plot_curves(curves, args.plot, plan.budget_bytes, get_device(args.gpu).memory_bytes, title)
    print(f"wrote {args.plot}")
