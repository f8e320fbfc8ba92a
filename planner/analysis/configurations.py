"""The cheapest way to train a step: GPU count, sharding, 8-bit optimizer states, host offload, a
checkpoint plan and micro-batching, ranked by GPU-hours per million tokens.

Every configuration is simulated: memory per GPU from the step simulator, time from the roofline op
times plus what data parallelism and offload add. One trace serves every GPU count (a ZeRO-3 trace
does not depend on dp); micro-batches need a trace each, so only a few are tried.

Host offload (FSDP2's ``CPUOffloadPolicy``) is priced as planner.simulation.step_time describes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass

from planner.config import TrainConfig
from planner.errors import InfeasibleBudget, SolverTimeout
from planner.simulation.step import Timeline, simulate
from planner.simulation.step_time import host_offload_s, host_states
from planner.solver.baselines import strategy_choices
from planner.solver.planning import solve
from planner.tracing.graph import OpGraph

__all__ = ["HOST_MEMORY_BYTES_PER_GPU", "Configuration", "ConfigurationReport", "cheapest_configuration"]

GROWTH_STEPS = 1  # powers of two tried above the smallest GPU count that fits
HOST_MEMORY_BYTES_PER_GPU = 256 * 2**30  # a DGX H100/H200's 2 TiB of host memory shared by 8 GPUs


@dataclass(frozen=True)
class Configuration:
    """One way to run the step and what it costs."""

    gpus: int
    optimizer: str
    cpu_offload: bool
    plan: bool
    micro_batch: int
    accumulation: int
    fits: bool
    peak_bytes: int
    host_bytes: int  # model states this GPU's rank keeps in host memory (host offload)
    step_s: float
    tokens_per_s_per_gpu: float
    gpu_hours_per_million_tokens: float
    recompute_overhead: float

    @property
    def label(self) -> str:
        parts = [f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}", self.optimizer]
        if self.cpu_offload:
            parts.append("host offload")
        parts.append("plan" if self.plan else "no plan")
        if self.accumulation > 1:
            parts.append(f"micro-batch {self.micro_batch} x {self.accumulation}")
        return ", ".join(parts)

    def to_dict(self) -> dict:
        return {**asdict(self), "label": self.label}


@dataclass(frozen=True)
class ConfigurationReport:
    """Every configuration tried, and the one with the fewest GPU-hours among those that fit."""

    configurations: tuple[Configuration, ...]
    recommended: Configuration | None
    budget_bytes: int
    config: dict

    def to_dict(self) -> dict:
        return {
            "configurations": [c.to_dict() for c in self.configurations],
            "recommended": None if self.recommended is None else self.recommended.to_dict(),
            "budget_bytes": self.budget_bytes,
            "config": dict(self.config),
        }


def _sharded(config: TrainConfig, gpus: int, optimizer: str, cpu_offload: bool) -> TrainConfig:
    """ZeRO-3 (FSDP2) over `gpus`; one GPU runs unsharded unless its states live on the host."""
    sharded = gpus > 1 or cpu_offload
    return config.with_(zero_stage=3 if sharded else 0, dp=gpus, optimizer=optimizer, cpu_offload=cpu_offload)


class _Evaluator:
    """Simulates and solves configurations of one traced micro-batch."""

    def __init__(self, graph: OpGraph, base: TrainConfig, budget: int, time_limit_s: float) -> None:
        self.graph, self.base, self.budget, self.time_limit_s = graph, base, budget, time_limit_s
        self._timelines: dict[tuple[TrainConfig, bool], Timeline] = {}

    def evaluate(
        self, gpus: int, optimizer: str, cpu_offload: bool, plan: bool, accumulation: int, batch_per_gpu: int
    ) -> Configuration:
        config = _sharded(self.base, gpus, optimizer, cpu_offload)
        bare = self._simulate(config, full_recompute=False)
        timeline, overhead = bare, 0.0
        plan = plan and bare.peak_bytes > self.budget  # a plan only where the step does not fit as it is
        if plan:
            timeline = self._planned(config)
            overhead = 0.0 if timeline is None else timeline.costs.overhead
        host_bytes = self._host_bytes(config)
        fits = timeline is not None and timeline.peak_bytes <= self.budget and host_bytes <= HOST_MEMORY_BYTES_PER_GPU
        timeline = timeline or bare
        micro_s = timeline.costs.step_s + (host_offload_s(self.graph, config) if cpu_offload else 0.0)
        step_s = micro_s * accumulation
        tokens_per_gpu = batch_per_gpu * config.seq_len
        rate = tokens_per_gpu / step_s if step_s > 0 else 0.0
        return Configuration(
            gpus=gpus,
            optimizer=optimizer,
            cpu_offload=cpu_offload,
            plan=plan,
            micro_batch=config.batch_size,
            accumulation=accumulation,
            fits=fits,
            peak_bytes=timeline.peak_bytes,
            host_bytes=host_bytes,
            step_s=step_s,
            tokens_per_s_per_gpu=rate,
            gpu_hours_per_million_tokens=1e6 / (rate * 3600) if rate else float("inf"),
            recompute_overhead=overhead,
        )

    def fits(self, gpus: int, optimizer: str, cpu_offload: bool, plan: bool) -> bool:
        """Cheap test: without a plan by simulation, with a plan by full recompute; host offload's
        states within a GPU's share of host memory."""
        config = _sharded(self.base, gpus, optimizer, cpu_offload)
        if self._host_bytes(config) > HOST_MEMORY_BYTES_PER_GPU:
            return False
        return self._simulate(config, full_recompute=plan).peak_bytes <= self.budget

    def _host_bytes(self, config: TrainConfig) -> int:
        """Model states this GPU's rank keeps in host memory (host offload; else 0)."""
        if not config.cpu_offload:
            return 0
        host = host_states(self.graph, config)
        return host.parameter + host.gradient + host.optimizer

    def _simulate(self, config: TrainConfig, full_recompute: bool) -> Timeline:
        """The step without a plan or with every block recomputed, once per configuration."""
        key = (config, full_recompute)
        if key not in self._timelines:
            choices = strategy_choices(self.graph, "full") if full_recompute else ()
            self._timelines[key] = simulate(self.graph, config, choices=choices)
        return self._timelines[key]

    def _planned(self, config: TrainConfig) -> Timeline | None:
        """The cheapest plan that fits (None when none does)."""
        full = self._simulate(config, full_recompute=True)
        if full.peak_bytes > self.budget:
            return None
        try:
            plan = solve(self.graph, config, self.budget, time_limit_s=self.time_limit_s)
        except InfeasibleBudget:
            return None
        except SolverTimeout:
            return full
        return simulate(self.graph, config, plan=plan)


def fewest_gpus(fits: Callable[[int], bool], limit: int) -> int | None:
    """Smallest GPU count n in 1..limit with fits(n), None when none does; peaks only fall as GPUs
    are added (monotone), so: `limit` first, then powers of two, then bisection."""
    if not fits(limit):  # one test settles that none fits
        return None
    low, high = 0, 1  # low does not fit (0: nothing below), high is the next count to try
    while not fits(high):  # ends by `limit` at the latest
        low, high = high, min(high * 2, limit)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def _counts_to_try(evaluator: _Evaluator, optimizer: str, cpu_offload: bool, plan: bool, max_gpus: int) -> list[int]:
    """The smallest GPU count that fits, then the powers of two above it, up to `GROWTH_STEPS` of
    them; only `max_gpus`, to show how far off it is, when none fits."""
    fewest = fewest_gpus(lambda n: evaluator.fits(n, optimizer, cpu_offload, plan), max_gpus)
    if fewest is None:
        return [max_gpus]
    above = 1 << fewest.bit_length()
    return [fewest] + [above << k for k in range(GROWTH_STEPS) if above << k <= max_gpus]


def cheapest_configuration(
    trace_micro_batch: Callable[[int], OpGraph],
    config: TrainConfig,
    budget_bytes: int,
    *,
    max_gpus: int = 4096,
    time_limit_s: float = 5.0,
    micro_batches: int = 2,
) -> ConfigurationReport:
    """Search GPU counts (powers of two) x optimizer states (the config's, and 8-bit when it is AdamW) x
    host offload x plan x micro-batch (the config's batch halved up to `micro_batches` times, with
    gradient accumulation keeping the batch), and rank what fits by GPU-hours per million tokens.

    For each combination, GPU counts start at the smallest that fits and grow to the next powers of
    two, since more GPUs can need less recompute but pay more communication."""
    optimizers = [config.optimizer] + (["adamw-8bit"] if config.optimizer == "adamw" else [])
    micro_sizes = [
        config.batch_size >> k
        for k in range(micro_batches + 1)
        if config.batch_size >> k >= 1 and config.batch_size % (config.batch_size >> k) == 0
    ]
    rows: list[Configuration] = []
    for micro in micro_sizes:
        evaluator = _Evaluator(trace_micro_batch(micro), config.with_(batch_size=micro), budget_bytes, time_limit_s)
        for optimizer, cpu_offload, plan in itertools.product(optimizers, (False, True), (False, True)):
            for gpus in _counts_to_try(evaluator, optimizer, cpu_offload, plan, max_gpus):
                row = evaluator.evaluate(
                    gpus, optimizer, cpu_offload, plan, config.batch_size // micro, config.batch_size
                )
                if row not in rows:  # with a plan where none is needed: the same as without
                    rows.append(row)
    fitting = [r for r in rows if r.fits]
    best = min(fitting, key=lambda r: (r.gpu_hours_per_million_tokens, r.gpus)) if fitting else None
    return ConfigurationReport(tuple(rows), best, budget_bytes, config.to_dict())
