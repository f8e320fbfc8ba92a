"""Measured time and peak of eager training steps under each strategy, beside memplan's predictions.

`python -m benchmarks --measured-time [--quick]`. For GPT-, Llama- and ResNet-shaped models (steps
of about 1 s on a 2-core CPU; `--quick`: toy sizes), each strategy gets its own copy of the same
initial weights with its plan applied: none, full, every-2, op-sac, megatron-selective, and
op-sac-alt, memplan's optimal plan at 30/50/70% of the way from the model states to the no-plan peak; compiled:
the whole model under torch.compile (torch's defaults) at activation_memory_budget 0.3/0.5/0.7 (`compile-budget B`),
and memplan's compiled plan (scope auto, planner.solver.compiled) at the peak each of those
measured (`memplan compiled @B`). Compiled steps use inductor (`--quick`: aot_eager_decomp_partition,
the same min-cut partitioner without code generation).

- Processes: each model runs twice, the eager strategies in one process and the compiled ones in
  another (`RUNS`), each with its own none to measure overheads against. Every process has glibc
  told to keep freed memory (`ALLOCATOR_ENV`: no mmap per large block, no trim), as CUDA's caching
  allocator keeps its blocks. With glibc's defaults every step pays page faults for the memory it touches afresh, so
  keeping activations costs time that no GPU step pays, and on this CPU recomputing measured
  faster than keeping.
- Time: strategies run round-robin, one step each per round, so drifts of the machine hit all of
  them alike, in a new (seeded) order each round, so what a step leaves behind (caches, freed
  memory) does not fall on the same next strategy every round; each step is timed only when the machine is quiet (benchmarks/quiet.py) and the
  other processes' CPU time is recorded per step. Overhead = the median over rounds of a step's
  time over none's step in the same round, minus 1: pairing the steps of a round cancels the
  machine's drifts between rounds. Noise = half the interquartile range of those ratios (0 for none).
- Peak: eager, a separate warm-up and measured step under memplan's LiveBytesTracker (as `memplan
  verify`); compiled, the profiler's memory timeline (planner.runtime.compiled.profiled_peak_bytes).
- Gradients: the first step's gradients of every strategy against none's (same weights and data;
  rtol 1e-4 eager, 1e-3 compiled).
- Predictions come from the plan (simulated step on a device profile calibrated on this machine).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import Options, gb, pct, print_table, to_jsonable
from benchmarks.quiet import timed_quiet
from costmodels.calibration import FULL, QUICK, calibrate
from costmodels.hardware import profile_dict
from memplan_compat import functorch_config
from planner.config import TrainConfig
from planner.errors import InfeasibleBudget
from planner.plans.format import Plan
from planner.runtime.apply import apply_plan
from planner.runtime.compiled import budget_trampoline, compile_blocks, profiled_step
from planner.runtime.verify import make_optimizer, measure_step
from planner.simulation.partitioner import BUDGETS
from planner.simulation.step import simulate
from planner.solver.compiled import plan_compiled
from planner.solver.planning import solve
from planner.tracing.models import GPT, ConvNet, ConvNetConfig, GPTConfig, Llama, LlamaConfig
from planner.tracing.recorder import loss_of, run_step_inputs, trace

__all__ = ["run", "show"]

PATH = __file__
BASELINES = ("none", "full", "every-2", "op-sac", "op-sac-alt", "megatron-selective")
FRACTIONS = (0.3, 0.5, 0.7)  # memplan's budget: this far from the model states to the no-plan peak


def _tokens(batch_size: int, seq_len: int, vocab: int):
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, vocab, (batch_size, seq_len), generator=g) for _ in range(2))


def gpt_bench(batch_size: int, seq_len: int):
    """GPT-2 shaped: 6 layers, 256 wide, 4 heads, vocab 512."""
    config = GPTConfig(vocab_size=512, block_size=seq_len, n_layer=6, n_head=4, n_embd=256)
    return GPT(config), _tokens(batch_size, seq_len, 512)


def llama_bench(batch_size: int, seq_len: int):
    """Llama shaped: 6 layers, 256 wide, 704 MLP, 4 heads (2 kv heads), vocab 512."""
    return Llama(LlamaConfig(512, 256, 704, 6, 4, 2)), _tokens(batch_size, seq_len, 512)


def resnet_bench(batch_size: int, seq_len: int):
    """ResNet shaped: 3 stages of 2 blocks, 32-128 channels; seq_len is the image side."""
    return ConvNet(ConvNetConfig(channels=(32, 64, 128), blocks=(2, 2, 2), num_classes=10)), _images(
        batch_size, seq_len
    )


def gpt_toy(batch_size: int, seq_len: int):
    """--quick: GPT-2 shaped, 2 layers, 64 wide."""
    config = GPTConfig(vocab_size=64, block_size=seq_len, n_layer=2, n_head=2, n_embd=64)
    return GPT(config), _tokens(batch_size, seq_len, 64)


def llama_toy(batch_size: int, seq_len: int):
    """--quick: Llama shaped, 2 layers, 64 wide."""
    return Llama(LlamaConfig(64, 64, 128, 2, 2, 1)), _tokens(batch_size, seq_len, 64)


def resnet_toy(batch_size: int, seq_len: int):
    """--quick: ResNet shaped, 2 stages of 1 block, 16-32 channels (16 or more at every strided 1x1
    convolution: docs/safety.md)."""
    return ConvNet(ConvNetConfig(channels=(16, 32), blocks=(1, 1), num_classes=10)), _images(batch_size, seq_len)


def _images(batch_size: int, side: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch_size, 3, side, side, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


# name, (builder, batch, seq) full (steps of about 1 s on 2 cores), (builder, batch, seq) --quick
MODELS = [
    ("gpt", ("gpt_bench", 6, 512), ("gpt_toy", 2, 128)),
    ("llama", ("llama_bench", 6, 512), ("llama_toy", 2, 128)),
    ("resnet", ("resnet_bench", 48, 64), ("resnet_toy", 4, 32)),
]
ALLOCATOR_ENV = {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=68719476736"}
ROUNDS = 17  # the first warms up and is not kept
# Eager and compiled strategies run in separate processes, each against its own none: inductor's
# kernels leave OpenMP threads spinning after they return, which slowed the eager steps that followed
# them (noise 3-9% and overheads up to 9 points higher than in an eager-only process).
RUNS = ("eager", "compiled")


def _plans(graph, config: TrainConfig) -> dict[str, Plan | str]:
    """Strategy -> its plan (or why there is none)."""
    base = simulate(graph, config)
    states = sum(base.model_states.values())
    plans: dict[str, Plan | str] = {s: solve(graph, config, 10**15, strategy=s) for s in BASELINES}
    for f in FRACTIONS:
        budget = int(states + f * (base.peak_bytes - states))
        try:
            plans[f"memplan {f:.0%}"] = solve(graph, config, budget, time_limit_s=20.0)
        except InfeasibleBudget as exc:
            plans[f"memplan {f:.0%}"] = f"infeasible: {exc}"
    return plans


class _Runner:
    """One strategy's model copy (its plan installed), optimizer and timed steps."""

    def __init__(self, base: torch.nn.Module, inputs, config: TrainConfig, install: Callable) -> None:
        self.model = copy.deepcopy(base)
        self.handle = install(self.model)
        self.optimizer = make_optimizer(self.model.parameters(), config.optimizer)
        self.inputs = inputs
        self.steps = []

    def grads(self) -> list[torch.Tensor]:
        loss_of(run_step_inputs(self.model, self.inputs)).backward()
        out = [p.grad.detach().clone() for p in self.model.parameters() if p.grad is not None]
        self.optimizer.zero_grad(set_to_none=True)
        return out

    def step(self) -> None:
        self._run()

    def profiled_peak(self) -> int:
        """Peak of a steady compiled step from the profiler (LiveBytesTracker does not see inductor's
        buffers): a warm-up step first, so the optimizer's states exist as in every later step."""
        self._run()
        return profiled_step(self.model, self.inputs, self.optimizer, self._run).peak_bytes

    def _run(self) -> torch.Tensor:
        loss = loss_of(run_step_inputs(self.model, self.inputs))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def close(self) -> None:
        if self.handle is not None:
            self.handle.remove()


def _eager(plan: Plan) -> Callable:
    return lambda model: apply_plan(model, plan) if plan.decisions else None


def _compiled(budgets: dict[str, float], backend: str) -> Callable:
    return lambda model: compile_blocks(model, budgets, backend)


def _compile_budget(budget: float, backend: str) -> Callable:
    """The whole model under torch.compile with torch's defaults and one activation_memory_budget."""

    def install(model: torch.nn.Module) -> None:
        compiled, original = torch.compile(budget_trampoline(budget), backend=backend), model.forward

        def forward(*args, **kwargs):
            with functorch_config.patch(activation_memory_budget=budget):
                return compiled(original, *args, **kwargs)

        model.forward = forward

    return install


def _peak(base: torch.nn.Module, plan: Plan, inputs, config: TrainConfig) -> int:
    model = copy.deepcopy(base)
    handle = apply_plan(model, plan) if plan.decisions else None
    try:
        return measure_step(model, inputs, config).peak_bytes
    finally:
        if handle is not None:
            handle.remove()


def _compiled_entries(spec: str, base, inputs, config: TrainConfig, quick: bool) -> dict[str, dict]:
    """compile-budget B (one global budget, the whole model compiled) and memplan's compiled plan at
    the peak compile-budget B measured: strategy -> {runner, predicted fields} or {failure}."""
    out: dict[str, dict] = {}
    backend = "aot_eager_decomp_partition" if quick else "inductor"
    for b in FRACTIONS[1:2] if quick else FRACTIONS:
        runner = _Runner(base, inputs, config, _compile_budget(b, backend))
        grads = runner.grads()  # compiles; before any optimizer step changes the weights
        peak = runner.profiled_peak()
        out[f"compile-budget {b}"] = {
            "runner": runner,
            "grads": grads,
            "measured_peak_bytes": peak,
            "budget_bytes": None,
        }
        try:
            plan = plan_compiled(spec, config, peak, budgets=(1.0, 0.5, 0.0) if quick else BUDGETS)
        except InfeasibleBudget as exc:
            out[f"memplan compiled @{b}"] = {"failure": f"infeasible: {exc}"}
            continue
        runner = _Runner(base, inputs, config, _compiled(plan.budgets, backend))
        out[f"memplan compiled @{b}"] = {
            "runner": runner,
            "grads": runner.grads(),  # compiles
            "measured_peak_bytes": runner.profiled_peak(),
            "budget_bytes": peak,
            "predicted_peak_bytes": plan.predicted.peak_bytes,
            "predicted_overhead": plan.predicted.overhead,
            "block_budgets": plan.budgets,
        }
    return out


def _model_rows(name: str, builder: str, batch: int, seq: int, profile: str, opts: Options, run: str) -> list[dict]:
    """The rows of one run: "eager" (none, the baselines, memplan's plans) or "compiled" (none, then
    compile-budget B and memplan compiled @B), each strategy timed round-robin in this process."""
    config = TrainConfig(batch_size=batch, seq_len=seq, gpu=profile)
    spec = f"{PATH}:{builder}"
    graph = trace(spec, batch_size=batch, seq_len=seq)
    plans = _plans(graph, config) if run == "eager" else {"none": solve(graph, config, 10**15, strategy="none")}
    torch.manual_seed(0)
    base, inputs = globals()[builder](batch, seq)
    base.train()
    entries: dict[str, dict] = {}
    for s, plan in plans.items():
        if not isinstance(plan, Plan):
            entries[s] = {"failure": plan}
            continue
        entries[s] = {
            "runner": _Runner(base, inputs, config, _eager(plan)),
            "measured_peak_bytes": _peak(base, plan, inputs, config),
            "predicted_peak_bytes": plan.predicted.peak_bytes,
            "predicted_overhead": plan.predicted.overhead,
            "budget_bytes": plan.budget_bytes if s.startswith("memplan") else None,
        }
    if run == "compiled":
        entries |= _compiled_entries(spec, base, inputs, config, opts.quick)
    runners = {s: e["runner"] for s, e in entries.items() if "runner" in e}
    reference = runners["none"].grads()
    for s, r in runners.items():  # eager recomputes exactly; compiled kernels may round differently
        got = entries[s].pop("grads", None) or r.grads()
        tol = 1e-3 if s.startswith(("compile", "memplan compiled")) else 1e-4
        entries[s]["grads_equal"] = len(got) == len(reference) and all(
            torch.allclose(a, b, rtol=tol, atol=tol * 1e-2) for a, b in zip(got, reference)
        )
    rounds = 2 if opts.quick else ROUNDS
    attempts = 1 if opts.quick else 10
    order, strategies = np.random.default_rng(0), list(runners.values())
    for k in range(rounds):  # round-robin, in a new order each round; the first warms up and is not kept
        for i in order.permutation(len(strategies)):
            r = strategies[i]
            t = timed_quiet(r.step, attempts)
            if k:
                r.steps.append(t)
    for r in runners.values():
        r.close()
    none_walls = np.array([t.wall_s for t in runners["none"].steps])
    rows = []
    for s, e in entries.items():
        row = {"model": name, "batch_size": batch, "seq_len": seq, "run": run, "strategy": s}
        runner = e.pop("runner", None)
        if runner is None:
            rows.append({**row, **e})
            continue
        walls = np.array([t.wall_s for t in runner.steps])
        q1, ratio, q3 = np.percentile(walls / none_walls, [25, 50, 75])  # step k of each ran in round k
        rows.append(
            {
                **row,
                **e,
                "measured_overhead": float(ratio - 1),
                "noise": float((q3 - q1) / 2),
                "median_step_s": float(np.median(walls)),
                "steps": [t.to_dict() for t in runner.steps],
            }
        )
    return rows


def _calibrated_profile(folder: Path, quick: bool) -> Path:
    """Calibrate this machine (in a process with ALLOCATOR_ENV, as the models run) into folder/device.json."""
    profile = folder / "device.json"
    _in_own_process(["--calibrate", str(profile)] + (["--quick"] if quick else []))
    return profile


def _in_own_process(argv: list[str]) -> None:
    env = {**os.environ, **ALLOCATOR_ENV}
    subprocess.run([sys.executable, "-m", "benchmarks.measured_time", *argv], env=env, check=True)


def run(opts: Options) -> list[dict]:
    folder = Path(tempfile.mkdtemp(prefix="memplan-bench-"))
    profile = _calibrated_profile(folder, opts.quick)
    rows = []
    for name, _full, _quick in opts.select(MODELS):
        for run_kind in RUNS:
            out = folder / f"{name}-{run_kind}.json"
            argv = ["--model", name, "--run", run_kind, "--profile", str(profile), "--out", str(out)]
            _in_own_process(argv + ["--quick"] * opts.quick)
            rows += json.loads(out.read_text())
    return rows


def _main(argv: list[str] | None = None) -> None:
    """One model's rows (or the calibration) in this process: run by `run` with ALLOCATOR_ENV set."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.measured_time")
    p.add_argument("--calibrate", metavar="PROFILE")
    p.add_argument("--model", choices=[m[0] for m in MODELS])
    p.add_argument("--run", choices=RUNS)
    p.add_argument("--profile")
    p.add_argument("--out")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.calibrate:
        cal = calibrate(QUICK if args.quick else FULL)
        Path(args.calibrate).write_text(json.dumps(profile_dict(cal.device, cal.measured())))
        return
    _name, full, quick = next(m for m in MODELS if m[0] == args.model)
    builder, batch, seq = quick if args.quick else full
    rows = _model_rows(args.model, builder, batch, seq, args.profile, Options(quick=args.quick), args.run)
    Path(args.out).write_text(json.dumps(to_jsonable(rows)))


def show(rows: list[dict]) -> None:
    def quiet(r):
        steps = r.get("steps", [])
        return f"{sum(t['quiet'] for t in steps)}/{len(steps)}" if steps else "-"

    def other(r):
        steps = r.get("steps", [])
        return f"{np.mean([t['other_cpu_s'] for t in steps]):.3f}" if steps else "-"

    print_table(
        "measured time: CPU fp32 AdamW steps, strategies interleaved round-robin in each run",
        [
            "model",
            "run",
            "strategy",
            "budget",
            "meas. peak",
            "pred. peak",
            "meas. overhead",
            "pred. overhead",
            "grads equal",
            "noise",
            "step s",
            "quiet",
            "other CPU s",
        ],
        [
            [
                r["model"],
                r["run"],
                r["strategy"],
                gb(r.get("budget_bytes")),
                gb(r.get("measured_peak_bytes")),
                gb(r.get("predicted_peak_bytes")),
                pct(r.get("measured_overhead")),
                pct(r.get("predicted_overhead")),
                str(r.get("grads_equal", "-")),
                pct(r.get("noise")),
                f"{r['median_step_s']:.3f}" if "median_step_s" in r else r.get("failure", "-")[:40],
                quiet(r),
                other(r),
            ]
            for r in rows
        ],
    )


if __name__ == "__main__":
    _main()
