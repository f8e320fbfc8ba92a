"""The whole layout of a training job: GPU count, tensor parallel, pipeline stages and schedule,
FSDP2 over the rest, optimizer-state precision, host offload and recompute, searched with exact
per-rank memory and a step time that knows where ranks wait.

Every layout keeps the job's global batch (sequences per optimizer step) and micro-batch size:
``dp`` replicas each run ``global_batch / (dp · micro_batch)`` microbatches, through the pipeline
when ``pp > 1`` (several pipeline steps with gradient accumulation where one step does not take
them all), as gradient-accumulation steps otherwise; a layout's peak is its heaviest step's. One tensor-parallel rank is traced per
degree (the first rank; a long stack of blocks traces through a shallow copy, tracing/depth.py),
whatever the GPU count; every layout is a simulation of that graph: planner.simulation.step with
FSDP2 over ``dp`` for ``pp = 1``, planner.simulation.pipeline with the schedule's own action list
otherwise, timed by planner.simulation.step_time. Recompute is none, selective (the attention core,
Megatron-style) or full per block, the first that fits; the recommended layout then gets the
solver's plan where it recomputes.

GPU counts are powers of two from 1. A layout is pruned before it is simulated when its model
states alone cannot fit (parameters, gradients and optimizer states spread over tp · pp · dp), and
the search stops `GROWTH` doublings past the first count on which any layout fits.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TypeVar

from costmodels.hardware import DeviceSpec, get_device
from costmodels.memory import get_precision
from costmodels.runtime import peak_flops_per_s
from planner.analysis.configurations import HOST_MEMORY_BYTES_PER_GPU
from planner.config import TrainConfig
from planner.errors import InfeasibleBudget, MemplanError, SequenceParallelUnsupported, SolverTimeout, TraceError
from planner.simulation.costs import model_states_for
from planner.simulation.layout import trace_roles
from planner.simulation.pipeline import simulate_pipeline
from planner.simulation.step import simulate
from planner.simulation.step_time import StepTime, data_parallel_step_time, host_states, pipeline_step_time
from planner.solver.baselines import strategy_choices
from planner.solver.pipeline_plans import solve_pipeline
from planner.solver.planning import solve
from planner.tracing.graph import OpGraph
from planner.tracing.parallel.rank_trace import trace_tp_rank
from planner.tracing.recorder import trace_for
from planner.units import format_bytes, over_budget

__all__ = [
    "DEFAULT_GLOBAL_BATCH_TOKENS",
    "HOST_MEMORY_BYTES_PER_GPU",
    "Layout",
    "LayoutSearch",
    "default_global_batch",
    "launch_recipe",
    "search_layouts",
]

DEFAULT_GLOBAL_BATCH_TOKENS = 4 * 2**20  # about 4M tokens per optimizer step, as Llama 2 and 3 pretrain
TENSOR_PARALLEL = (1, 2, 4, 8, 16)  # degrees tried, up to the GPUs of one node
SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2))  # (schedule, stages per rank) tried for pp > 1
RECOMPUTE = ("none", "selective", "full")  # tried in this order; the first that fits is kept
CONTEXT_PARALLEL_FROM_SEQ_LEN = 32768  # context parallel is tried from this sequence length (or pinned)
GROWTH = 2  # doublings of the GPU count searched past the first that fits


@dataclass(frozen=True)
class Layout:
    """One way to run the job, its worst rank's peak and its step time."""

    gpus: int
    tp: int
    pp: int
    dp: int
    schedule: str | None
    microbatches: int  # pipeline microbatches per schedule step (1 without a pipeline)
    accumulation: int  # schedule steps (or forward-backward micro-steps) per optimizer step
    stages_per_rank: int
    micro_batch_size: int
    global_batch: int
    seq_len: int
    optimizer: str
    offload: bool
    recompute: str  # none | selective | full | plan
    fits: bool
    peak_bytes: int
    budget_bytes: int
    host_bytes: int  # model states each GPU's rank keeps in host memory (offload)
    time: StepTime
    tokens_per_s_per_gpu: float
    mfu: float
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = True  # under tp > 1 (off where the model's plan cannot run it)

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.peak_bytes

    @property
    def label(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}", f"dp{self.dp}"] + ([f"ep{self.ep}"] if self.ep > 1 else [])
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        if self.pp > 1:
            parts.append(f"{self.schedule} x{self.microbatches}")
        if self.accumulation > 1:
            parts.append(f"accum {self.accumulation}")
        return " ".join(parts)

    def flags(self) -> str:
        """memplan's flags for this layout (simulate, plan and verify take them)."""
        out = [f"--batch-size {self.micro_batch_size * (self.microbatches if self.pp > 1 else 1)}"]
        if self.tp > 1:
            out.append(f"--tp {self.tp}" + ("" if self.sequence_parallel else " --no-sp"))
        if self.cp > 1:
            out.append(f"--cp {self.cp}")
        if self.pp > 1:
            out += [f"--pp {self.pp}", f"--pp-schedule {self.schedule}", f"--microbatches {self.microbatches}"]
            if self.stages_per_rank > 1:
                out.append(f"--stages-per-rank {self.stages_per_rank}")
        if self.accumulation > 1:
            out.append(f"--grad-accum {self.accumulation}")
        if self.dp * self.cp > 1 or self.offload:
            out.append(f"--dp {self.dp} --zero 3")
            if self.ep > 1:
                out.append(f"--ep {self.ep}")
            if self.pp > 1:  # as config_for: a stage stays gathered across its microbatches
                out.append("--reshard-after-forward false")
        if self.offload:
            out.append("--cpu-offload")
        if self.optimizer != "adamw":
            out.append(f"--optimizer {self.optimizer}")
        if self.recompute in ("full", "selective"):  # a plan is a file: launch_recipe makes it
            out.append(f"--strategy {self.recompute}")
        return " ".join(out)

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "time"}
        out.update(
            step_time_s=self.time.step_s,
            time=self.time.to_dict(),
            headroom_bytes=self.headroom_bytes,
            label=self.label,
            flags=self.flags(),
        )
        return out


@dataclass(frozen=True)
class LayoutSearch:
    """Every layout simulated, the Pareto front of those that fit, and the recommended one."""

    layouts: tuple[Layout, ...]
    pareto: tuple[Layout, ...]
    recommended: Layout | None
    why_none: str | None  # what binds when no layout fits
    skipped: dict[int, str]  # tensor-parallel degree -> why it cannot run this model
    search_s: float
    config: dict
    recipe: dict | None = None
    recommended_plan: dict | None = field(default=None)

    def to_dict(self) -> dict:
        return {
            "layouts": [x.to_dict() for x in self.layouts],
            "pareto": [x.to_dict() for x in self.pareto],
            "recommended": None if self.recommended is None else self.recommended.to_dict(),
            "recipe": self.recipe,
            "recommended_plan": self.recommended_plan,
            "why_none": self.why_none,
            "skipped_tp": {str(k): v for k, v in self.skipped.items()},
            "search_s": self.search_s,
            "config": dict(self.config),
        }


def default_global_batch(config: TrainConfig) -> int:
    """About DEFAULT_GLOBAL_BATCH_TOKENS tokens in whole micro-batches (a power of two of them)."""
    micro = max(1, DEFAULT_GLOBAL_BATCH_TOKENS // (config.seq_len * config.batch_size))
    return config.batch_size * (1 << (micro.bit_length() - 1))


_Traced = TypeVar("_Traced")


def _powers_of_two(limit: int) -> list[int]:
    return [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]


class _Search:
    """Traces per tensor-parallel degree, and the simulation of one layout from them."""

    def __init__(self, spec: str, config: TrainConfig, budget: int, device: DeviceSpec, global_batch: int) -> None:
        self.spec, self.base, self.budget, self.device, self.global_batch = spec, config, budget, device, global_batch
        self.graphs: dict[tuple[int, int, int], OpGraph] = {}  # (tp, ep, cp) -> the traced (worst) rank's graph
        self.skipped: dict[int, str] = {}
        self.without_sp: set[int] = set()  # tp degrees whose plan runs without sequence parallel
        self.skipped_roles: dict[tuple[int, int, int], str] = {}  # (tp, ep, cp) -> why it cannot be traced
        dtype = get_precision(config.precision).autocast_dtype or get_precision(config.precision).param_dtype
        self.peak_flops = peak_flops_per_s(dtype, device)
        self.flops_per_sequence = 0.0
        self.lightest_states: tuple[int, str] | None = None  # the lightest pruned layout's states per GPU
        self.allow_offload, self.allow_8bit = True, True
        self.choices: dict[tuple, tuple] = {}  # (tp, ep, cp, recompute level) -> its span choices

    def pruned(self, graph: OpGraph, gpus: int, tp: int, pp: int, dp: int, optimizer: str, cp: int = 1) -> bool:
        """Whether the model states alone of this layout exceed the budget (recorded for what binds)."""
        states = self.states_lower_bound(graph, pp, dp * cp, optimizer)  # FSDP2 shards over dp × cp
        if states <= self.budget:
            return False
        label = f"{gpus} GPUs as tp{tp} pp{pp} dp{dp}" + (f" cp{cp}" if cp > 1 else "") + f", {optimizer}"
        if self.lightest_states is None or states < self.lightest_states[0]:
            self.lightest_states = (states, label)
        return True

    def graph(self, tp: int) -> OpGraph | None:
        if (tp, 1, 1) in self.graphs or tp in self.skipped:
            return self.graphs.get((tp, 1, 1))
        try:
            traced = self.base.with_(tp=tp, dp=1, zero_stage=3)
            if tp == 1:
                graph = trace_for(self.spec, traced)
            else:
                graph = self._with_or_without_sp(traced, lambda c: trace_tp_rank(self.spec, c, rank=0)[0])
        except (TraceError, MemplanError, ValueError, RuntimeError) as exc:
            self.skipped[tp] = " ".join(str(exc).split())[:200]
            return None
        self.graphs[(tp, 1, 1)] = graph
        if tp == 1:
            self.flops_per_sequence = sum(op.flops for op in graph.ops) / self.base.batch_size
        return graph

    def sequence_parallel(self, tp: int) -> bool:
        """Whether layouts at `tp` run sequence parallel: as asked, unless the model's plan cannot."""
        return self.base.sequence_parallel and tp not in self.without_sp

    def _with_or_without_sp(self, traced: TrainConfig, trace_layout: Callable[[TrainConfig], _Traced]) -> _Traced:
        """`trace_layout` of `traced`, or, where sequence parallel is asked for and the model's plan
        cannot run it (a transformers model that ships no plan, a model without a recognised token
        embedding), of `traced` without it, as --no-sp would run (remembered per tp degree)."""
        if traced.tp in self.without_sp:
            return trace_layout(traced.with_(sequence_parallel=False))
        try:
            return trace_layout(traced)
        except SequenceParallelUnsupported:
            self.without_sp.add(traced.tp)
            return trace_layout(traced.with_(sequence_parallel=False))

    def expert_graph(self, ep: int, tp: int = 1, cp: int = 1) -> OpGraph | None:
        """The busiest expert-parallel role's graph at degrees (tp, ep, cp), expert parallel borrowing
        dp × cp ranks (traced once, whatever the GPU count)."""
        traced = self.base.with_(tp=tp, cp=cp, dp=ep // math.gcd(ep, cp), ep=ep, zero_stage=3)
        return self._heaviest_role((tp, ep, cp), traced)

    def context_graph(self, tp: int, cp: int) -> OpGraph | None:
        """The heaviest context-parallel rank's graph at degrees (tp, cp) (every cp index traced: each
        runs its own ring steps), whatever the GPU count."""
        return self._heaviest_role((tp, 1, cp), self.base.with_(tp=tp, cp=cp, dp=1, zero_stage=3))

    def _heaviest_role(self, key: tuple[int, int, int], traced: TrainConfig) -> OpGraph | None:
        """Every role of the layout `traced` traced once, the one with the highest peak kept under
        `key` (tp, ep, cp); None, with the reason kept in `skipped_roles`, when it cannot be traced."""
        if key in self.graphs or key in self.skipped_roles:
            return self.graphs.get(key)
        try:
            _, graphs = self._with_or_without_sp(traced, lambda c: trace_roles(self.spec, c))
        except (TraceError, MemplanError, ValueError, RuntimeError) as exc:
            self.skipped_roles[key] = " ".join(str(exc).split())[:200]
            return None
        self.graphs[key] = max(graphs.values(), key=lambda g: simulate(g, traced).peak_bytes)
        return self.graphs[key]

    def states_could_fit(self, gpus: int) -> bool:
        """Whether the model states, FSDP2-sharded over all `gpus` under the lightest optimizer the
        search may use (not offloaded), fit the budget: no layout on `gpus` holds fewer without host offload."""
        optimizer = "adamw-8bit" if self.base.optimizer == "adamw" and self.allow_8bit else self.base.optimizer
        return self.states_lower_bound(self.graphs[(1, 1, 1)], 1, gpus, optimizer) <= self.budget

    def states_lower_bound(self, graph: OpGraph, pp: int, dp: int, optimizer: str) -> int:
        """Model-state bytes of the lightest rank: the traced rank's states over pp stages and dp shards."""
        states = model_states_for(graph, self.base.with_(zero_stage=3, dp=dp, optimizer=optimizer))
        return states.total // pp

    def config_for(
        self,
        tp: int,
        pp: int,
        dp: int,
        schedule: str | None,
        v: int,
        microbatches: int,
        accumulation: int,
        optimizer: str,
        offload: bool,
        ep: int = 1,
        cp: int = 1,
    ) -> TrainConfig:
        c = self.base.with_(
            tp=tp,
            sequence_parallel=self.sequence_parallel(tp),
            dp=dp,
            ep=ep,
            cp=cp,
            zero_stage=3,
            optimizer=optimizer,
            cpu_offload=offload,
            grad_accum_steps=accumulation,
        )
        if pp == 1:
            return c
        return c.with_(
            pp=pp,
            pp_schedule=schedule,
            microbatches=microbatches,
            stages_per_rank=v,
            batch_size=self.base.batch_size * microbatches,
            reshard_after_forward=False,  # torchtitan keeps a stage gathered across its microbatches
        )

    def evaluate(
        self,
        gpus: int,
        tp: int,
        pp: int,
        schedule: str | None,
        v: int,
        microbatches: int,
        optimizer: str,
        offload: bool,
        recompute: str,
        ep: int = 1,
        cp: int = 1,
    ) -> Layout | None:
        """One layout simulated: FSDP2 over dp (× cp), `microbatches` per pipeline step (1 without pp),
        as many steps as the global batch needs per optimizer step."""
        graph = self.graphs[(tp, ep, cp)]
        dp = gpus // (tp * pp * cp)
        accumulation = self.global_batch // (dp * self.base.batch_size * microbatches)
        config = self.config_for(tp, pp, dp, schedule, v, microbatches, accumulation, optimizer, offload, ep, cp)
        key = (tp, ep, cp, recompute)
        if key not in self.choices:
            self.choices[key] = () if recompute == "none" else tuple(strategy_choices(graph, recompute))
        choices = self.choices[key]
        if recompute != "none" and not choices:
            return None  # the model has no blocks to recompute
        try:
            if pp == 1:
                timeline = simulate(graph, config, choices=choices)
                peak = timeline.peak_bytes
                step = data_parallel_step_time(graph, config, timeline, self.device)
            else:
                # a uniform level runs as the recipe launches it: torchtitan's checkpointing, in backward
                pipeline = simulate_pipeline(graph, config, choices, memplan_runtime=False)
                peak = pipeline.peak_bytes
                step = repeated(pipeline_step_time(graph, config, pipeline, self.device, choices), accumulation)
        except (MemplanError, ValueError):  # a schedule torch refuses for this shape
            return None
        return self.layout(
            gpus, tp, pp, schedule, v, microbatches, accumulation, optimizer, offload, recompute, peak, step, ep, cp
        )

    def layout(
        self,
        gpus,
        tp,
        pp,
        schedule,
        v,
        microbatches,
        accumulation,
        optimizer,
        offload,
        recompute,
        peak,
        step,
        ep=1,
        cp=1,
    ) -> Layout:
        host = 0
        if offload:
            config = self.config_for(tp, 1, gpus // (tp * cp), None, 1, 1, accumulation, optimizer, offload, ep, cp)
            s = host_states(self.graphs[(tp, ep, cp)], config)
            host = s.parameter + s.gradient + s.optimizer
        tokens = self.global_batch * self.base.seq_len
        flops = self.flops_per_sequence * self.global_batch
        return Layout(
            gpus=gpus,
            tp=tp,
            pp=pp,
            dp=gpus // (tp * pp * cp),
            schedule=schedule,
            microbatches=microbatches,
            accumulation=accumulation,
            stages_per_rank=v,
            micro_batch_size=self.base.batch_size,
            global_batch=self.global_batch,
            seq_len=self.base.seq_len,
            optimizer=optimizer,
            offload=offload,
            recompute=recompute,
            fits=peak <= self.budget and host <= HOST_MEMORY_BYTES_PER_GPU,
            peak_bytes=peak,
            budget_bytes=self.budget,
            host_bytes=host,
            time=step,
            tokens_per_s_per_gpu=tokens / (step.step_s * gpus) if step.step_s > 0 else 0.0,
            mfu=flops / (step.step_s * gpus * self.peak_flops) if step.step_s > 0 else 0.0,
            ep=ep,
            cp=cp,
            sequence_parallel=self.sequence_parallel(tp),
        )


def repeated(step: StepTime, times: int) -> StepTime:
    """`times` pipeline steps before one optimizer step: everything but the optimizer repeats."""
    return StepTime(
        step_s=times * (step.step_s - step.optimizer_s) + step.optimizer_s,
        compute_s=times * step.compute_s,
        exposed_communication_s=times * step.exposed_communication_s,
        bubble_s=times * step.bubble_s,
        recompute_s=times * step.recompute_s,
        optimizer_s=step.optimizer_s,
        offload_s=times * step.offload_s,
    )


def _expert_degrees(search: _Search, gpus: int, fixed: TrainConfig) -> list[int]:
    """Expert-parallel degrees above 1 for a mixture-of-experts model, not yet traced: powers of two
    dividing its experts, up to the GPU count over the tensor- and context-parallel degrees of `fixed`."""
    experts = search.graphs[(1, 1, 1)].meta.get("moe", {}).get("experts", 0)
    if not experts or gpus % (fixed.tp * fixed.cp):
        return []
    return [
        ep for ep in _powers_of_two(min(gpus // fixed.tp, experts))[1:] if experts % ep == 0 and fixed.ep in (1, ep)
    ]


def _expert_shapes(
    search: _Search, gpus: int, fixed: TrainConfig, lightest_only: bool = False
) -> list[tuple[int, int, int, int, str | None, int]]:
    """Expert-parallel shapes at the tensor- and context-parallel degrees of `fixed`, EP borrowing each
    stage's dp × cp ranks: without a pipeline every degree they hold (unless `lightest_only`), inside
    one only the largest that traces (the fewest experts per rank)."""
    tp, cp = fixed.tp, fixed.cp
    degrees = _expert_degrees(search, gpus, fixed)
    out = []
    for pp in _powers_of_two(gpus // (tp * cp)) if degrees else []:
        dp = gpus // (tp * pp * cp)
        held = [ep for ep in degrees if dp * cp % ep == 0]
        if fixed.pp not in (1, pp) or not held:
            continue
        traced = ((ep, g) for ep in reversed(held) if (g := search.expert_graph(ep, tp, cp)) is not None)
        tried = [next(traced, None)] if pp > 1 or lightest_only else list(traced)[::-1]
        for ep, graph in filter(None, tried):
            out += [(tp, ep, cp, *p) for p in _pipelines(search, dp, pp, len(graph.regions))]
    return out


def _tensor_expert_shapes(
    search: _Search, gpus: int, gpus_per_node: int, fixed: TrainConfig
) -> list[tuple[int, int, int, int, str | None, int]]:
    """Expert parallel with tensor parallel above 1 where --tp does not pin it: each tp in a node at
    the largest EP degree (tensor parallel only buys memory here, at the cost of its collectives).
    The search asks for these only on a GPU count where no expert-parallel layout at tp 1 fits
    without host offload and the model states, sharded over every GPU, could: each (tp, ep) pair
    is a trace of its own."""
    if fixed.tp > 1 or not _expert_degrees(search, gpus, fixed) or not search.states_could_fit(gpus):
        return []
    out = []
    for tp in TENSOR_PARALLEL[1:]:
        if tp <= min(gpus, gpus_per_node) and gpus % (tp * fixed.cp) == 0 and search.graph(tp) is not None:
            out += _expert_shapes(search, gpus, fixed.with_(tp=tp), lightest_only=True)
    return out


def _context_degrees(search: _Search, gpus: int, gpus_per_node: int, fixed: TrainConfig) -> list[tuple[int, int]]:
    """(tp, cp) with context parallel above 1: the pinned --cp, else, from
    CONTEXT_PARALLEL_FROM_SEQ_LEN tokens a sequence, powers of two whose 2·cp chunks split the
    sequence; with the largest tensor-parallel degree in a node under which the model traces with
    context parallel (FSDP2 over the rest)."""
    if fixed.ep > 1 or (fixed.cp == 1 and search.base.seq_len < CONTEXT_PARALLEL_FROM_SEQ_LEN):
        return []
    tps = [tp for tp in TENSOR_PARALLEL if tp <= min(gpus, gpus_per_node) and fixed.tp in (1, tp)]
    for tp in reversed([tp for tp in tps if search.graph(tp) is not None]):
        out = [
            (tp, cp)
            for cp in _powers_of_two(gpus // tp)[1:]
            if fixed.cp in (1, cp) and search.base.seq_len % (2 * cp) == 0 and search.context_graph(tp, cp) is not None
        ]
        if out:
            return out
    return []


def _shapes(
    search: _Search, gpus: int, gpus_per_node: int, fixed: TrainConfig
) -> list[tuple[int, int, int, int, str | None, int]]:
    """(tp, ep, cp, pp, schedule, stages per rank) that tile `gpus` and split the global batch evenly;
    expert parallel borrows its ranks from each stage's data-parallel ones."""
    out = _expert_shapes(search, gpus, fixed)
    for tp, cp in _context_degrees(search, gpus, gpus_per_node, fixed):
        blocks = len(search.graphs[(tp, 1, cp)].regions)
        for pp in _powers_of_two(gpus // (tp * cp)):
            if fixed.pp in (1, pp):
                out += [(tp, 1, cp, *p) for p in _pipelines(search, gpus // (tp * cp * pp), pp, blocks)]
    for tp in TENSOR_PARALLEL:
        if fixed.ep > 1 or fixed.cp > 1:
            break
        if tp > min(gpus, gpus_per_node) or gpus % tp or (fixed.tp > 1 and tp != fixed.tp):
            continue
        graph = search.graph(tp)
        if graph is None:
            continue
        for pp in _powers_of_two(gpus // tp):
            if fixed.pp in (1, pp):
                out += [(tp, 1, 1, *p) for p in _pipelines(search, gpus // (tp * pp), pp, len(graph.regions))]
    return out


def _pipelines(search: _Search, dp: int, pp: int, blocks: int) -> list[tuple[int, str | None, int]]:
    """(pp, schedule, stages per rank) with `dp` replicas splitting the global batch evenly: no
    pipeline for pp 1; otherwise each schedule with at least two blocks a stage and whole rounds of
    microbatches."""
    batch = search.global_batch
    if batch % (dp * search.base.batch_size):
        return []
    if pp == 1:
        return [(1, None, 1)]
    m = batch // (dp * search.base.batch_size)
    return [(pp, s, v) for s, v in SCHEDULES if blocks >= 2 * pp * v and m % (pp * v) == 0]


MICROBATCH_ROUNDS = (4, 2, 1)  # microbatches per pipeline step tried, in rounds of pp · stages_per_rank


def _shape_layouts(
    search: _Search, gpus: int, tp: int, ep: int, cp: int, pp: int, schedule: str | None, v: int, config: TrainConfig
) -> list[Layout]:
    """The layouts simulated for one shape: for each optimizer/offload variant (cheapest first, until
    one fits), the lightest candidate first (full recompute, fewest microbatches), and when it fits,
    for each recompute level (least first) whose fewest microbatches fit, the most microbatches per
    pipeline step that fit, until a level fits with the most. Peaks only grow with less recompute
    and more microbatches, and time with more recompute and fewer microbatches, so nothing left out
    could be faster and fit."""
    graph = search.graphs[(tp, ep, cp)]
    dp = gpus // (tp * pp * cp)
    replica = search.global_batch // (dp * search.base.batch_size)  # micro-batches per replica and step
    rounds = [k * pp * v for k in MICROBATCH_ROUNDS if pp > 1 and replica % (k * pp * v) == 0] or [1]
    out: list[Layout] = []
    for optimizer, offload in _variants(config, pp, search):
        if not offload and search.pruned(graph, gpus, tp, pp, dp, optimizer, cp):
            continue

        def run(recompute: str, microbatches: int, optimizer=optimizer, offload=offload) -> Layout | None:
            x = search.evaluate(gpus, tp, pp, schedule, v, microbatches, optimizer, offload, recompute, ep, cp)
            if x is not None:
                out.append(x)
            return x

        lightest = run(RECOMPUTE[-1], rounds[-1])
        if lightest is None or not lightest.fits:
            continue
        for recompute in RECOMPUTE:
            fewest = lightest if recompute == RECOMPUTE[-1] else run(recompute, rounds[-1])
            if fewest is None or not fewest.fits:
                continue  # more microbatches only hold more
            best = rounds[-1]
            for microbatches in rounds[:-1]:
                x = run(recompute, microbatches)
                if x is not None and x.fits:
                    best = microbatches
                    break
            if best == rounds[0]:
                break  # the most microbatches with this little recompute: more recompute is only slower
        return out  # a lighter optimizer or host offload only costs time once this variant fits
    return out


def _variants(config: TrainConfig, pp: int, search: _Search) -> list[tuple[str, bool]]:
    """(optimizer, host offload), cheapest first: the config's, then 8-bit AdamW states, then host
    offload (data parallel only), each where the search allows it."""
    out = [(config.optimizer, False)]
    if config.optimizer == "adamw" and search.allow_8bit:
        out.append(("adamw-8bit", False))
    if pp == 1 and search.allow_offload:
        out.append((config.optimizer, True))
    return out


def _pareto(layouts: list[Layout]) -> list[Layout]:
    """Fitting layouts no other beats on both GPUs (fewer or equal) and step time (shorter)."""
    fitting = sorted((x for x in layouts if x.fits), key=lambda x: (x.gpus, x.time.step_s))
    front: list[Layout] = []
    for x in fitting:
        if not front or x.time.step_s < front[-1].time.step_s:
            if front and front[-1].gpus == x.gpus:
                continue
            front.append(x)
    return front


def _why_none(layouts: list[Layout], search: _Search, max_gpus: int, budget: int) -> str:
    """What binds: the lowest peak reached on the most GPUs tried, and what it is made of."""
    if not layouts and search.lightest_states is not None:
        states, label = search.lightest_states
        return (
            f"the model states alone are at least {over_budget(states, budget)} per GPU on the lightest "
            f"layout ({label}): raise --max-gpus"
        )
    if not layouts:
        return (
            f"no layout tiles up to {max_gpus} GPUs with this global batch; raise --max-gpus or give a --global-batch "
            "that the data-parallel degrees divide"
        )
    top = max(x.gpus for x in layouts)
    best = min((x for x in layouts if x.gpus == top), key=lambda x: x.peak_bytes)
    if best.peak_bytes <= budget:  # it fits on the GPU; the host cannot hold the offloaded states
        return (
            f"on {top} GPUs only host offload fits the GPU, and it needs {format_bytes(best.host_bytes)} of host memory "
            f"per GPU (more than {format_bytes(HOST_MEMORY_BYTES_PER_GPU)}); raise --max-gpus"
        )
    return (
        f"on {top} GPUs the lowest peak is {over_budget(best.peak_bytes, budget)} per GPU ({best.label}, "
        f"recompute {best.recompute}{', host offload' if best.offload else ''}): "
        "raise --max-gpus, shorten the sequence or the micro-batch"
    )


def search_layouts(
    spec: str,
    config: TrainConfig,
    *,
    max_gpus: int = 512,
    gpus_per_node: int | None = None,
    global_batch: int | None = None,
    budget_bytes: int,
    time_limit_s: float = 10.0,
    allow_offload: bool = True,
    allow_8bit: bool = True,
    progress: Callable[[int, int, str], None] | None = None,
) -> LayoutSearch:
    """Search layouts of `config`'s step on up to `max_gpus` GPUs of `config.gpu` (see the module
    docstring); `config.tp` / `config.pp` / `config.ep` above 1 pin those degrees (expert parallel
    is tried for a mixture-of-experts model, with FSDP2 and pipelines, and with tp where --tp pins
    it or where EP at tp 1 does not fit); `allow_offload` / `allow_8bit` let it try host offload
    and 8-bit AdamW states."""
    started = time.perf_counter()
    device = get_device(config.gpu)
    per_node = gpus_per_node or device.gpus_per_node
    batch = global_batch or default_global_batch(config)
    if batch % config.batch_size:
        raise MemplanError(
            f"--global-batch {batch} is not a multiple of the micro-batch --batch-size {config.batch_size}"
        )
    base = config.with_(
        tp=1, pp=1, dp=1, ep=1, cp=1, zero_stage=3, grad_accum_steps=1, microbatches=None, stages_per_rank=None
    )
    search = _Search(spec, base, budget_bytes, device, batch)
    search.allow_offload, search.allow_8bit = allow_offload, allow_8bit
    if search.graph(1) is None:
        raise MemplanError(f"memplan cannot trace {spec}: {search.skipped[1]}")
    _check_pinned(config, per_node, len(search.graphs[(1, 1, 1)].regions))
    layouts: list[Layout] = []
    first_fit: int | None = None
    counts = _powers_of_two(max_gpus)
    with _collections_skip_traces() as traced:
        for done, gpus in enumerate(counts):
            if first_fit is not None and gpus > first_fit << GROWTH:
                break
            if progress is not None:
                progress(done, len(counts), f"{gpus} GPUs")
            shapes = _shapes(search, gpus, per_node, config)  # traces each new degree's graph
            traced()
            for tp, ep, cp, pp, schedule, v in shapes:
                layouts += _shape_layouts(search, gpus, tp, ep, cp, pp, schedule, v, config)
            if not any(x.fits and x.gpus == gpus and x.ep > 1 and not x.offload for x in layouts):
                shapes = _tensor_expert_shapes(search, gpus, per_node, config)
                traced()
                for tp, ep, cp, pp, schedule, v in shapes:
                    layouts += _shape_layouts(search, gpus, tp, ep, cp, pp, schedule, v, config)
            if first_fit is None and any(x.fits and x.gpus == gpus for x in layouts):
                first_fit = gpus
    if progress is not None:
        progress(len(counts), len(counts), "done")
    fitting = [x for x in layouts if x.fits]
    recommended = min(fitting, key=lambda x: (x.gpus, -x.tokens_per_s_per_gpu)) if fitting else None
    plan = None
    if recommended is not None and recommended.recompute != "none":
        recommended, plan = _with_plan(search, recommended, time_limit_s)
        layouts.append(recommended)
    why = None if recommended is not None else _why_none(layouts, search, max_gpus, budget_bytes)
    return LayoutSearch(
        layouts=tuple(layouts),
        pareto=tuple(_pareto(layouts)),
        recommended=recommended,
        why_none=why,
        skipped=dict(search.skipped),
        search_s=time.perf_counter() - started,
        config={**config.to_dict(), "model": spec, "global_batch": batch, "gpus_per_node": per_node},
        recipe=None if recommended is None else launch_recipe(recommended, spec, per_node, config),
        recommended_plan=plan,
    )


@contextmanager
def _collections_skip_traces() -> Iterator[Callable[[], None]]:
    """A call that moves what exists now (the graphs traced so far: hundreds of thousands of
    objects that live until the search ends) out of the garbage collector's reach, so the
    collections that the simulations' short-lived objects trigger stop scanning them (llama-70b:
    6 s of collections in a 50 s search, 3 s with it); all collected as usual on exit. Nothing is
    moved where the caller keeps objects frozen (``gc.freeze``) itself."""
    own = gc.get_freeze_count() == 0
    try:
        yield gc.freeze if own else (lambda: None)
    finally:
        if own:
            gc.unfreeze()


def _check_pinned(config: TrainConfig, gpus_per_node: int, blocks: int) -> None:
    """A pinned --tp / --pp the search can reach, or one line that says why not."""
    for flag, degree in (("--tp", config.tp), ("--pp", config.pp)):
        if degree > 1 and degree & (degree - 1):
            raise MemplanError(f"{flag} {degree}: the layout search tries powers of two; pin {flag} 2, 4, 8, ...")
    if config.tp > gpus_per_node:
        raise MemplanError(
            f"--tp {config.tp} exceeds the {gpus_per_node} GPUs of a node of {config.gpu}: tensor parallel stays "
            "in a node; lower --tp or give --gpus-per-node"
        )
    if config.pp > 1 and blocks < 2 * config.pp:
        raise MemplanError(
            f"--pp {config.pp} needs at least two blocks a stage and the model has {blocks} blocks; lower --pp"
        )


def _with_plan(search: _Search, layout: Layout, time_limit_s: float) -> tuple[Layout, dict | None]:
    """The recommended layout with the solver's recompute plan in place of a uniform one, when it is faster."""
    graph = search.graphs[(layout.tp, layout.ep, layout.cp)]
    config = search.config_for(
        layout.tp,
        layout.pp,
        layout.dp,
        layout.schedule,
        layout.stages_per_rank,
        layout.microbatches,
        layout.accumulation,
        layout.optimizer,
        layout.offload,
        layout.ep,
        layout.cp,
    )
    try:
        if layout.pp == 1:
            plan = solve(graph, config, search.budget, time_limit_s=time_limit_s)
            timeline = simulate(graph, config, plan=plan)
            peak, step = timeline.peak_bytes, data_parallel_step_time(graph, config, timeline, search.device)
            summary = {"decisions": len(plan.decisions), "overhead": plan.predicted.overhead}
        else:
            pipeline_plan = solve_pipeline(graph, config, search.budget, time_limit_s=time_limit_s)
            pipeline = simulate_pipeline(graph, config, pipeline_plan.choices)
            peak = pipeline.peak_bytes
            one = pipeline_step_time(graph, config, pipeline, search.device, pipeline_plan.choices)
            step = repeated(one, layout.accumulation)
            summary = {
                "decisions": len(pipeline_plan.choices),
                "per_rank_recompute_s": [r.recompute_s for r in pipeline_plan.ranks],
                # run in a stage's wait for its gradient by planner.recompute_in_bubbles (docs/pipeline.md)
                "per_rank_hidden_recompute_s": list(pipeline_plan.hidden_recompute_s),
            }
    except (InfeasibleBudget, SolverTimeout, MemplanError):
        return layout, None
    if peak > search.budget or step.step_s >= layout.time.step_s:
        return layout, None
    tokens = layout.global_batch * layout.seq_len
    planned = Layout(
        **{
            **{k: getattr(layout, k) for k in Layout.__dataclass_fields__},
            "recompute": "plan",
            "peak_bytes": peak,
            "time": step,
            "tokens_per_s_per_gpu": tokens / (step.step_s * layout.gpus),
            "mfu": layout.mfu * layout.time.step_s / step.step_s,
        }
    )
    return planned, summary


_TORCHTITAN_SCHEDULES = {"1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B"}
_TORCHTITAN_AC = {
    "none": '"none"',
    "selective": '"selective"',
    "full": '"full"',
    "plan": "\"none\"  # memplan's plan recomputes instead: planner.apply_plan(model, fit --json's recommended_plan)",
}


def _check_line(layout: Layout, spec: str, config: TrainConfig) -> str:
    """The memplan command that simulates every rank of the layout (making its plan first, if it has one)."""
    job = (
        f"--model {spec} --seq-len {layout.seq_len} --precision {config.precision} --gpu {config.gpu} {layout.flags()}"
    )
    if layout.tp > 1 and not config.loss_parallel:
        job += " --no-loss-parallel"
    if layout.recompute != "plan":
        return f"memplan simulate {job}"
    plan = f"memplan plan {job} --budget {layout.budget_bytes}B --out layout_plan.json"
    return f"{plan} && memplan simulate {job} --plan layout_plan.json"


def launch_recipe(layout: Layout, spec: str, gpus_per_node: int, config: TrainConfig) -> dict:
    """How to launch a layout: torchrun, memplan's flags, and a torchtitan TOML fragment."""
    nodes = math.ceil(layout.gpus / gpus_per_node)
    per_node = min(layout.gpus, gpus_per_node)
    rdzv = " --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500" if nodes > 1 else ""
    toml = [
        "[parallelism]",
        f"data_parallel_shard_degree = {layout.dp}",
        f"tensor_parallel_degree = {layout.tp}",
        f"pipeline_parallel_degree = {layout.pp}",
    ]
    if layout.pp > 1:
        toml += [
            f'pipeline_parallel_schedule = "{_TORCHTITAN_SCHEDULES[layout.schedule]}"',
            f"pipeline_parallel_microbatch_size = {layout.micro_batch_size}",
        ]
    if layout.tp > 1 and not config.loss_parallel:
        toml.append("disable_loss_parallel = true")
    if layout.tp > 1 and not layout.sequence_parallel:
        toml.append("# the model's tensor-parallel plan runs without sequence parallel (memplan: --no-sp)")
    toml += [
        f"context_parallel_degree = {layout.cp}",
        f"expert_parallel_degree = {layout.ep}",
        "",
        "[training]",
        # torchtitan accumulates global / (local x dp) steps of local_batch_size sequences
        f"local_batch_size = {layout.micro_batch_size * layout.microbatches}",
        f"global_batch_size = {layout.global_batch}",
        f"seq_len = {layout.seq_len}",
        *(["enable_cpu_offload = true  # FSDP2 CPUOffloadPolicy"] if layout.offload else []),
        "",
        "[activation_checkpoint]",
        f"mode = {_TORCHTITAN_AC[layout.recompute]}",
    ]
    if layout.optimizer.endswith("-8bit"):
        toml += [
            "",
            "[optimizer]",
            f'name = "AdamW"  # memplan assumed {layout.optimizer} states: swap in an 8-bit AdamW',
        ]
    return {
        "torchrun": f"torchrun --nnodes {nodes} --nproc-per-node {per_node}{rdzv} train.py",
        "memplan": _check_line(layout, spec, config),
        "torchtitan_toml": "\n".join(toml),
    }
