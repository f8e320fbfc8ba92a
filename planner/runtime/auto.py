"""Plan a live model in one line: trace it on fake copies of its inputs, solve, apply.

    handle = planner.auto_checkpoint(model, (ids, labels), "60%")   # or 8 * 2**30, or "8GiB"
    handle.set_budget("6GiB")                                         # from the next forward on

Nothing real is allocated by planning: a fake copy of the model (parameters become fake CPU
tensors of the same shapes and dtypes, wherever the real ones live, meta included) runs one step
on fake copies of the batch. With `seq_lens` the handle follows the batch's sequence length: a
batch uses the plan of the smallest planned length at least as long; a longer batch is traced at
its own length (fake copies of that batch) and solved, and the plan is cached.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from costmodels.hardware import DEVICES
from memplan_compat import tree_leaves, tree_map
from planner.budgets import parse_budget
from planner.config import TrainConfig
from planner.errors import InfeasibleBudget, MemplanError
from planner.plans.format import Decision, Plan, PlanLadder, SolverInfo
from planner.runtime.apply import PlanHandle, apply_plan, batch_seq_len
from planner.runtime.live_trace import LiveTracer
from planner.simulation.costs import StepCosts
from planner.simulation.effects import SpanChoice, choices_from_decisions
from planner.simulation.step import Timeline, simulate
from planner.solver.cpsat import prepare_replan, replan_choices
from planner.solver.planning import make_plan, solve
from planner.tracing.graph import OpGraph
from planner.tracing.moe import describe_routing
from planner.tracing.parallel.live_layout import live_layout
from planner.units import format_bytes

__all__ = ["AutoHandle", "auto_checkpoint", "config_for", "plan_for"]

# Solver limit for re-plans made while training (set_budget, a monitor's switch, a new length): CP-SAT
# deterministic time; on a 32-block model it bounds the worst re-plan seen (6.5 s) to 2.5 s with the
# same predicted overhead.
REPLAN_TIME_LIMIT_S = 1.0
_CONFIG_FIELDS = (
    "precision",
    "optimizer",
    "zero_stage",
    "dp",
    "gpu",
    "grad_accum_steps",
    "moe_imbalance",
    "loss_parallel",
    "reshard_after_forward",
    "cp_rotate",
)
_PRECISION_OF_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16"}
# CUDA device names (torch.cuda.get_device_name) -> memplan device, longest match first.
_GPU_NAMES = (("H200", "h200"), ("H100", "h100-80gb"), ("L40S", "l40s"), ("MI300X", "mi300x"))


# The solver's advice names memplan's CLI flags; raised through this Python API it names arguments.
_PYTHON_WORDS = (
    (r"--precision (\S+?)([,;)]|$)", r"precision='\1'\2"),
    (r"--optimizer (\S+?)([,;)]|$)", r"optimizer='\1'\2"),
    (r"--zero (\d+) --dp (\w+)", r"zero_stage=\1, dp=\2"),
    (r"--offload (\w+)", r"offload='\1'"),
    (r"--blocks ('[^']*'|\S+)", r"blocks=[\1]"),
    (r"--time-limit", "time_limit_s"),
    (r"--budget", "budget"),
    (r"--gpu (\S+)", r"gpu='\1'"),
    (r"--moe-imbalance", "moe_imbalance"),
    (r"drop --cp\b", "drop cp_mesh"),  # context parallel is a mesh here, not a degree
    (r"--(dp|tp|cp|ep) (\d+)", r"\1=\2"),
    (r"--(dp|tp|cp|ep)\b", r"\1"),
)


def _python_words(message: str) -> str:
    """An error message with memplan's CLI flags replaced by this API's arguments."""
    for pattern, repl in _PYTHON_WORDS:
        message = re.sub(pattern, repl, message)
    return message


@contextmanager
def _python_api() -> Iterator[None]:
    """Re-raise memplan's errors in the words of the Python API (budget=, not --budget)."""
    try:
        yield
    except MemplanError as exc:
        if exc.args and isinstance(exc.args[0], str):
            exc.args = (_python_words(exc.args[0]), *exc.args[1:])
        raise


def _gpu_of(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    if param is None or param.device.type in ("cpu", "meta"):
        return "cpu"
    name = torch.cuda.get_device_name(param.device) if param.device.type == "cuda" else str(param.device)
    if "A100" in name:
        total = torch.cuda.get_device_properties(param.device).total_memory
        return "a100-80gb" if total > 48 * 2**30 else "a100-40gb"
    for key, device in _GPU_NAMES:
        if key in name:
            return device
    raise MemplanError(f"memplan has no cost model for device '{name}'; pass gpu= one of {', '.join(DEVICES)}")


def config_for(model: nn.Module, inputs: tuple | dict, cp_mesh: DeviceMesh | None = None, **config: Any) -> TrainConfig:
    """The TrainConfig of one step: shapes from the inputs (the whole sequence under context
    parallel over `cp_mesh`), precision and gpu from the model unless given."""
    unknown = sorted(set(config) - set(_CONFIG_FIELDS))
    if unknown:
        hint = "; context parallel: pass cp_mesh= (the mesh context_parallel shards over)" if "cp" in unknown else ""
        raise MemplanError(f"unknown option(s) {', '.join(unknown)}; pass any of {', '.join(_CONFIG_FIELDS)}{hint}")
    layout = live_layout(model)  # a model parallelize_module sharded is traced as this rank's share
    tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    if not tensors:
        raise MemplanError("the inputs hold no tensor; pass the example batch as a tuple or dict of tensors")
    batch_size = int(tensors[0].shape[0]) if tensors[0].dim() else 1
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    seq_len = batch_seq_len(args, kwargs) if any(t.dim() >= 2 for t in tensors) else 1
    if "precision" not in config:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        if dtype not in _PRECISION_OF_DTYPE:
            raise MemplanError(f"parameters are {dtype}; pass precision= one of fp32, bf16, bf16-mixed, fp16-mixed")
        config["precision"] = _PRECISION_OF_DTYPE[dtype]
    config.setdefault("gpu", _gpu_of(model))
    try:
        parallel = {"tp": layout.tp, "ep": layout.ep} if layout else {}
        if cp_mesh is not None:
            parallel["cp"] = cp_mesh.size()
        return TrainConfig(batch_size=batch_size, seq_len=seq_len, **parallel, **config)
    except MemplanError:
        raise
    except ValueError as exc:
        raise MemplanError(str(exc)) from exc


def _as_inputs(inputs: Any) -> tuple | dict:
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs)
    if isinstance(inputs, Mapping):
        return dict(inputs)
    raise MemplanError(
        f"inputs must be a tensor, a tuple of positional or a dict of keyword arguments, got {type(inputs).__name__}"
    )


class AutoHandle:
    """A live model's plans: one per planned sequence length, re-solved when the budget changes.

    `budget_bytes` is the user's budget; plans are solved for `target_bytes` (at most the budget),
    which a MemoryMonitor with adapt=True lowers to keep a reserve and raises back. A change takes
    effect at the next forward of the model, never inside a step.
    """

    def __init__(
        self,
        model: nn.Module,
        tracer: LiveTracer,
        config: TrainConfig,
        graphs: Mapping[int, OpGraph],
        budget: int | str,
        *,
        follow: bool = False,
        solve_options: Mapping[str, Any] | None = None,
        replan_time_limit_s: float = REPLAN_TIME_LIMIT_S,
    ) -> None:
        self.model = model
        self.tracer = tracer
        self.config = config
        self.follow = follow
        self.solve_options = dict(solve_options or {})
        self._graphs: dict[int, OpGraph] = dict(graphs)
        self._plans: dict[tuple[int, int], Plan] = {}
        baseline = simulate(self._graphs[config.seq_len], config)
        self._baselines: dict[int, Timeline] = {config.seq_len: baseline}
        self._choices: dict[int, tuple[Plan, tuple[SpanChoice, ...]]] = {}  # id(plan) -> (plan, its choices)
        self.baseline_peak_bytes = baseline.peak_bytes
        self.model_states_bytes = sum(baseline.model_states.values())
        self.budget_bytes = self._agreed(parse_budget(budget, self.baseline_peak_bytes))
        self.target_bytes = self.budget_bytes
        self.seq_len = config.seq_len  # the planned length whose plan is in force
        self.last_seq_len: int | None = None  # the last training batch's length (when following)
        self._events: list[dict[str, Any]] = []
        self._in_force = self._solved_on_every_rank(lambda: self.plan_at(config.seq_len))
        self.solve_options["time_limit_s"] = replan_time_limit_s
        self._agreed_plans: dict[tuple[int, int], Plan] = {}  # (length, target) -> the plan all ranks install
        self._in_force = self._agree(self._in_force)
        self._applied: PlanHandle = apply_plan(model, self._in_force)
        self._installed = self._in_force
        self._hook = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    # -- plans --------------------------------------------------------------------------------
    @property
    def planned_lengths(self) -> list[int]:
        return sorted(self._graphs)

    def graph_at(self, seq_len: int) -> OpGraph:
        return self._graphs[seq_len]

    def plan_at(self, seq_len: int, target_bytes: int | None = None) -> Plan:
        """The plan for a planned length under a target (default the current one); solved once, cached.

        A length's first plan is CP-SAT's; a later one (only the budget changed) is re-planned in
        milliseconds from the cached per-block options, starting from the cached plan of the
        nearest larger budget and from keeping everything (planner.solver.cpsat.replan_choices),
        and by CP-SAT when that fails."""
        target = self.target_bytes if target_bytes is None else target_bytes
        key = (seq_len, target)
        if key not in self._plans:
            graph = self._graphs[seq_len]
            config = self.config.with_(seq_len=seq_len, batch_size=int(graph.meta["batch_size"]))
            solved = sorted((b, plan) for (n, b), plan in self._plans.items() if n == seq_len and b >= target)
            replan = (
                self._replan(graph, config, target, solved[0][1] if solved else None)
                if any(n == seq_len for n, _ in self._plans)
                else None
            )
            if replan is None:
                replan = solve(graph, config, target, **self.solve_options)
                prepare_replan(graph, config, self.solve_options.get("offload"))
            self._plans[key] = replan
        return self._plans[key]

    def _replan(self, graph: OpGraph, config: TrainConfig, target: int, start: Plan | None) -> Plan | None:
        """The greedy re-plan for a new target as a Plan (status FEASIBLE: not proven optimal)."""
        offload = self.solve_options.get("offload")
        start_choices = self._choices_of(graph, start) if start is not None else ()
        found = replan_choices(graph, config, target, start_choices, offload=offload)
        if found is None:
            return None
        if config.seq_len not in self._baselines:
            self._baselines[config.seq_len] = simulate(graph, config)
        base = self._baselines[config.seq_len]
        costs = StepCosts(
            step_s=base.costs.step_s + config.grad_accum_steps * found.added_s,
            recompute_flops=found.recompute_flops,
            recompute_s=found.recompute_s,
            offload_bytes=found.offload_bytes,
            exposed_offload_s=found.exposed_offload_s,
        )
        solver = SolverInfo(
            status="FEASIBLE",
            objective=found.added_s,
            bound=0.0,
            gap=1.0 if found.added_s else 0.0,
            wall_s=found.wall_s,
        )
        plan = make_plan(
            graph, config, target, "optimal", found.choices, found.peak_bytes, costs, base.peak_bytes, solver
        )
        self._choices[id(plan)] = (plan, found.choices)
        return plan

    def _choices_of(self, graph: OpGraph, plan: Plan) -> tuple[SpanChoice, ...]:
        """A cached plan's span choices (resolved from its decisions once)."""
        if id(plan) not in self._choices:
            self._choices[id(plan)] = (plan, tuple(choices_from_decisions(graph, plan.decisions)))
        return self._choices[id(plan)][1]

    @property
    def plan(self) -> Plan:
        """The plan in force: the one the next forward uses unless the batch's length changes."""
        return self._in_force

    @property
    def routing(self) -> str | None:
        """The mixture-of-experts routing the plan in force assumes (moe_imbalance=), as one line;
        None for a model without routers. The plan's config holds it too, as `moe_routing`."""
        routing = self._in_force.config.get("moe_routing")
        return None if routing is None else _python_words(describe_routing(routing))

    @property
    def predicted_peak_bytes(self) -> int:
        return self._in_force.predicted.peak_bytes

    def bucket_for(self, seq_len: int) -> int | None:
        """The smallest planned length at least `seq_len`; None when every planned one is shorter."""
        return next((n for n in self.planned_lengths if n >= seq_len), None)

    @_python_api()
    def set_budget(self, budget: int | str) -> Plan:
        """Re-plan for a new budget (bytes, '6GiB' or a percentage of the example's no-plan peak)
        from the cached traces; the next forward uses it. Returns the plan for the current length."""
        budget_bytes = parse_budget(budget, self.baseline_peak_bytes)
        self._in_force = self.plan_at(self.seq_len, budget_bytes)
        self.budget_bytes = self.target_bytes = budget_bytes
        return self._in_force

    @_python_api()
    def set_target(self, target_bytes: int) -> Plan:
        """Solve plans for `target_bytes` (capped at the budget) from now on: the monitor's lever."""
        target = min(int(target_bytes), self.budget_bytes)
        self._in_force = self.plan_at(self.seq_len, target)
        self.target_bytes = target
        return self._in_force

    # -- the ranks of a parallel model plan alike ----------------------------------------------------
    def _agreed(self, *values: int) -> Any:
        """The smallest of each value over all ranks (the values unchanged for a model that is not
        parallel): a recompute's collectives run on every rank, so they solve for one target."""
        if not self.tracer.distributed:
            return values[0] if len(values) == 1 else values
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        agreed = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        out = tuple(int(v) for v in agreed.tolist())
        return out[0] if len(out) == 1 else out

    def _solved_on_every_rank(self, solve: Callable[[], Plan]) -> Plan:
        """`solve()` on this rank; for a parallel model a failure on any rank is raised on every rank
        (the others would otherwise wait for it in the next agreement), as that rank's error."""
        if not self.tracer.distributed:
            return solve()
        try:
            plan, failure = solve(), None
        except MemplanError as exc:
            plan, failure = None, exc
        if self._agreed(0 if failure is not None else 1):
            return plan
        reports: list[Any] = [None] * dist.get_world_size()
        infeasible = isinstance(failure, InfeasibleBudget)
        report = None if failure is None else (str(failure), infeasible, getattr(failure, "smallest_peak_bytes", None))
        dist.all_gather_object(reports, report)
        if failure is not None:
            raise failure
        rank, (message, infeasible, smallest) = next((r, rep) for r, rep in enumerate(reports) if rep is not None)
        if infeasible:
            raise InfeasibleBudget(f"on rank {rank}: {message}", smallest_peak_bytes=smallest)
        raise MemplanError(f"on rank {rank}: {message}")

    def _agree(self, plan: Plan) -> Plan:
        """The plan every rank installs for the current (length, target), agreed once per pair.

        A recompute's collectives (tensor parallel's gathers, expert parallel's all-to-all) run on
        every rank, so all recompute alike. Ranks whose traces differ (uneven shards, expert-parallel
        ranks under moe_imbalance) may solve differently: all take the plan of the rank heaviest
        without one, as `memplan plan` solves for the worst rank; each simulates it on its own trace,
        and one it leaves over the target stops them all in one line."""
        if not self.tracer.distributed:
            return plan
        key = (self.seq_len, self.target_bytes)
        if key not in self._agreed_plans:
            offers: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(offers, (plan.predicted.baseline_peak_bytes, plan.decisions))
            decisions = max(offers, key=lambda offer: offer[0])[1]  # the heaviest without a plan (the first on a tie)
            agreed = plan if decisions == plan.decisions else self._plan_from(plan, decisions)
            margin = self._agreed(plan.budget_bytes - agreed.predicted.peak_bytes)
            if margin < 0:
                raise MemplanError(
                    f"the plan solved for the heaviest rank leaves another {format_bytes(-margin)} over the target "
                    f"{format_bytes(plan.budget_bytes)}; lower the budget or plan every rank with `memplan plan`"
                )
            self._agreed_plans[key] = agreed
        return self._agreed_plans[key]

    def _plan_from(self, plan: Plan, decisions: Sequence[Decision]) -> Plan:
        """Another rank's decisions as this rank's plan: simulated on this rank's trace."""
        seq_len = int(plan.config["seq_len"])
        graph = self._graphs[seq_len]
        config = self.config.with_(seq_len=seq_len, batch_size=int(graph.meta["batch_size"]))
        choices = tuple(choices_from_decisions(graph, decisions))
        timeline = simulate(graph, config, choices=choices)
        agreed = make_plan(
            graph,
            config,
            plan.budget_bytes,
            plan.strategy,
            choices,
            timeline.peak_bytes,
            timeline.costs,
            plan.predicted.baseline_peak_bytes,
            plan.solver,
        )
        self._choices[id(agreed)] = (agreed, choices)
        return agreed

    # -- following the batch ----------------------------------------------------------------
    def _before_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation saves nothing for backward: any plan will do
        # inside context_parallel the model sees its rank's shard: 1/cp of the step's sequence
        seq_len = batch_seq_len(args, kwargs) * self.tracer.cp if self.follow else 0
        if self.tracer.distributed:  # a change on one rank (a monitor's target) is made on all
            target, minus_len = self._agreed(self.target_bytes, -seq_len)
            seq_len = -minus_len
            if target != self.target_bytes:
                self._solved_on_every_rank(lambda: self.set_target(target))
        if self.follow:
            self.last_seq_len = seq_len
            bucket = self.bucket_for(seq_len)
            traced = bucket is None
            if traced:
                if args and kwargs:
                    raise MemplanError(
                        "cannot trace a batch passed both positionally and by keyword; "
                        "pass seq_lens= covering every length instead"
                    )
                batch = tuple(args) if args else dict(kwargs)
                if self.tracer.cp > 1:  # a whole sequence of that length, the shard tiled
                    batch = _at_length(batch, seq_len // self.tracer.cp, seq_len)
                self._graphs[seq_len] = self.tracer.trace(batch)
                bucket = seq_len
            if bucket != self.seq_len:
                reason = f"sequence length {seq_len}: plan for length {bucket}"
                self._events.append(
                    {
                        "reason": reason + (" (traced and solved now)" if traced else ""),
                        "from_seq_len": self.seq_len,
                        "plan_seq_len": bucket,
                    }
                )
            self.seq_len = bucket
            with _python_api():
                self._in_force = self._solved_on_every_rank(lambda: self._plan_within_budget(bucket))
        self.install()

    def install(self) -> None:
        """Put the plan in force on the model now: between steps, or just before a forward."""
        self._in_force = self._agree(self._in_force)
        if self._in_force is not self._installed:
            self._applied.use_plan(self._in_force)
            self._installed = self._in_force

    def _plan_within_budget(self, seq_len: int) -> Plan:
        """The plan at the target; when the target (a monitor's reserve) cannot be met at this length,
        the plan at the full budget. Raises InfeasibleBudget when even the budget cannot be met."""
        try:
            return self.plan_at(seq_len)
        except InfeasibleBudget:
            if self.target_bytes >= self.budget_bytes:
                raise
        self._events.append(
            {
                "reason": f"length {seq_len} cannot keep the target {format_bytes(self.target_bytes)}: "
                f"plan for the budget {format_bytes(self.budget_bytes)}",
                "plan_seq_len": seq_len,
            }
        )
        return self.plan_at(seq_len, self.budget_bytes)

    def drain_events(self) -> list[dict[str, Any]]:
        """Plan switches made by following the sequence length since the last call (for a monitor)."""
        events, self._events = self._events, []
        return events

    def remove(self) -> None:
        """Restore the model (idempotent)."""
        self._hook.remove()
        self._applied.remove()

    @property
    def removed(self) -> bool:
        return self._applied.removed

    def __enter__(self) -> AutoHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _at_length(inputs: tuple | dict, seq_len: int, new_len: int) -> tuple | dict:
    """The example batch stretched along dim 1 to `new_len` (values tiled, so ids stay valid)."""

    def stretch(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[1] != seq_len:
            return t
        reps = -(-new_len // seq_len)
        return t.repeat(1, reps, *([1] * (t.dim() - 2)))[:, :new_len]

    return tree_map(stretch, inputs)


def _trace_all(
    model: nn.Module,
    inputs: Any,
    seq_lens: Sequence[int] | PlanLadder,
    blocks: Sequence[str],
    cp_mesh: DeviceMesh | None,
    config: Mapping[str, Any],
) -> tuple[TrainConfig, LiveTracer, dict[int, OpGraph]]:
    inputs = _as_inputs(inputs)
    train_config = config_for(model, inputs, cp_mesh, **config)
    tracer = LiveTracer(
        model,
        train_config.precision,
        name=type(model).__name__,
        blocks=blocks,
        moe_imbalance=train_config.moe_imbalance,
        gpu=train_config.gpu,
        loss_parallel=train_config.loss_parallel,
        cp_mesh=cp_mesh,
        cp_rotate=train_config.cp_rotate,
    )
    graphs = {train_config.seq_len: tracer.trace(inputs)}
    lengths = [n for n, _ in seq_lens.buckets] if isinstance(seq_lens, PlanLadder) else list(seq_lens)
    for n in lengths:
        if not isinstance(n, int) or n <= 0:
            raise MemplanError(f"seq_lens must be positive integers, got {n!r}")
        if n not in graphs:
            stretched = _at_length(inputs, train_config.seq_len, n)
            graphs[n] = tracer.trace(stretched)
    return train_config, tracer, graphs


@_python_api()
def plan_for(
    model: nn.Module,
    inputs: Any,
    budget: int | str,
    *,
    blocks: Sequence[str] = (),
    offload: str | None = None,
    time_limit_s: float = 10.0,
    cp_mesh: DeviceMesh | None = None,
    **config: Any,
) -> Plan:
    """The plan auto_checkpoint would apply, without applying it (see auto_checkpoint)."""
    train_config, _, graphs = _trace_all(model, inputs, (), blocks, cp_mesh, config)
    graph = graphs[train_config.seq_len]
    budget_bytes = parse_budget(budget, simulate(graph, train_config).peak_bytes)
    return solve(graph, train_config, budget_bytes, offload=offload, time_limit_s=time_limit_s)


@_python_api()
def auto_checkpoint(
    model: nn.Module,
    inputs: Any,
    budget: int | str,
    *,
    seq_lens: Sequence[int] | PlanLadder = (),
    blocks: Sequence[str] = (),
    offload: str | None = None,
    time_limit_s: float = 10.0,
    replan_time_limit_s: float = REPLAN_TIME_LIMIT_S,
    cp_mesh: DeviceMesh | None = None,
    **config: Any,
) -> AutoHandle:
    """Trace `model` on fake copies of `inputs`, solve under `budget` and apply the plan.

    `budget`: bytes, a size such as '8GiB', or a percentage of the no-plan peak such as '60%'.
    `config`: TrainConfig fields (precision, optimizer, zero_stage, dp, gpu, grad_accum_steps,
    moe_imbalance: the routing a mixture-of-experts trace assumes, stored in the plan's config as
    `moe_routing` and told by `handle.routing`);
    loss_parallel: whether a tensor-parallel step computes its loss under torch's loss_parallel());
    precision and gpu default to the model's dtype and device, shapes come from `inputs` (one
    micro-batch: with grad_accum_steps N the plan holds the gradients of N - 1 earlier ones). With `seq_lens` (a list or
    a PlanLadder's lengths) the handle follows the batch's sequence length (dim 1 of its first
    tensor with 2+ dims), and solves and caches a plan for any longer batch it meets.
    `time_limit_s` bounds the first solve; `replan_time_limit_s` every later one (set_budget, a
    monitor's switch, a new length), which runs between or inside training steps.
    Call it on every rank after ``parallelize_module`` and the expert-parallel plan, before
    ``fully_shard`` (torchtitan's order): a tensor- or expert-parallel model is traced as this
    rank's share, and all ranks install one plan (the one of the rank heaviest without a plan).
    Under context parallel pass `cp_mesh`, the mesh the step's ``context_parallel`` shards over, and
    the whole batch as `inputs` (what the step hands context_parallel): each rank plans its share.
    """
    train_config, tracer, graphs = _trace_all(model, inputs, seq_lens, blocks, cp_mesh, config)
    follow = bool(list(seq_lens.buckets) if isinstance(seq_lens, PlanLadder) else list(seq_lens))
    return AutoHandle(
        model,
        tracer,
        train_config,
        graphs,
        budget,
        follow=follow,
        solve_options={"offload": offload, "time_limit_s": time_limit_s},
        replan_time_limit_s=replan_time_limit_s,
    )
