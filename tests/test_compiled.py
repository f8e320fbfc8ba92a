"""Compiled training: the partitioner's per-block frontier on fake tensors, the per-block choice,
and blocks compiled at their own activation budgets."""

from __future__ import annotations

import copy
import itertools
import json
import shutil

import pytest
import torch
from cli_helpers import run
from hypothesis import given, settings
from hypothesis import strategies as st
from models_for_tests import PATH, gpt_small, llama_small, resnet_small
from torch import nn
from torch._dynamo.utils import counters
from torch._subclasses import FakeTensorMode

from costmodels.hardware import get_device
from planner.api import trace_for
from planner.config import TrainConfig
from planner.errors import InfeasibleBudget, PlanFileError, SpecError
from planner.plans.format import CompiledPlan, CompiledPoint, load_plan
from planner.runtime.apply import apply_plan
from planner.runtime.compiled import compile_blocks, measure_compiled_step, profiled_peak_bytes, profiled_step
from planner.runtime.tracker import LiveBytesTracker
from planner.runtime.verify import measure_step, run_training_step, warmed_up
from planner.simulation.partitioner import block_call, block_frontier
from planner.simulation.step import simulate
from planner.solver.compiled import Window, choose_budgets, plan_compiled
from planner.solver.planning import solve
from planner.tracing.models import MLPBlock

BATCH, SEQ = 2, 32
COMPILED_GRAD_RTOL = 5e-3  # a compiled step's gradient error in norm, relative to the float64 gradient


@pytest.mark.compile
@pytest.mark.parametrize("build, path", [(gpt_small, "h.0"), (resnet_small, "stages.0.0")])
def test_frontier_trades_saved_bytes_for_recompute(build, path):
    with FakeTensorMode(allow_non_fake_inputs=True):
        model, inputs = build(BATCH, SEQ)
        args, kwargs = block_call(model, inputs, path)
        frontier = block_frontier(model.get_submodule(path), args, kwargs, get_device("cpu"), budgets=(1.0, 0.5, 0.0))
    assert frontier[0].budget == 1.0 and frontier[0].recompute_s == 0.0 and frontier[0].saved_bytes > 0
    assert frontier[-1].saved_bytes == 0 < frontier[-1].recompute_flops  # budget 0: recompute all, keep inputs
    for a, b in itertools.pairwise(frontier):
        assert a.recompute_s <= b.recompute_s and a.saved_bytes > b.saved_bytes


def test_block_call_names_a_block_the_model_runs():
    model, inputs = gpt_small(BATCH, SEQ)
    args, _ = block_call(model, inputs, "h.1")
    assert args[0].shape == (BATCH, SEQ, 64)
    unused = torch.nn.Linear(64, 64)
    model.add_module("unused", unused)
    with pytest.raises(ValueError, match="never calls"):
        block_call(model, inputs, "unused")


points = st.lists(st.tuples(st.integers(0, 100), st.integers(0, 100)), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None)
@given(st.lists(points, min_size=1, max_size=3), st.integers(0, 300))
def test_choice_is_the_cheapest_that_fits(raw, cap):
    frontiers = [[CompiledPoint(1.0, s, t * 1e-6, 0, s, s) for s, t in block] for block in raw]
    fits = [c for c in itertools.product(*frontiers) if sum(p.saved_bytes for p in c) <= cap]
    if not fits:
        with pytest.raises(InfeasibleBudget):
            choose_budgets(frontiers, [Window((), tuple(range(len(frontiers))), (), cap)])
        return
    chosen = choose_budgets(frontiers, [Window((), tuple(range(len(frontiers))), (), cap)])
    assert sum(p.saved_bytes for p in chosen) <= cap
    assert sum(p.recompute_s for p in chosen) == pytest.approx(min(sum(p.recompute_s for p in c) for c in fits))


@pytest.mark.compile
def test_blocks_compiled_at_their_budgets():
    torch.manual_seed(0)
    model, inputs = gpt_small(BATCH, SEQ)
    reference = copy.deepcopy(model)
    budgets = {"h.0": 1.0, "h.1": 0.0, "h.2": 1.0, "h.3": 0.0}
    handle = compile_blocks(model, budgets, backend="aot_eager_decomp_partition")  # min-cut, no codegen
    saved: dict[str, dict[int, int]] = {p: {} for p in budgets}  # block -> storage -> bytes
    current: list[str | None] = [None]
    for p in budgets:
        block = model.get_submodule(p)
        block.register_forward_pre_hook(lambda _m, _a, p=p: current.__setitem__(0, p))
        block.register_forward_hook(lambda _m, _a, _o: current.__setitem__(0, None))
    params = {q.untyped_storage().data_ptr() for q in model.parameters()}

    def pack(t):
        if current[0] is not None and t.untyped_storage().data_ptr() not in params:
            saved[current[0]][t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*inputs)
    loss.backward()
    reference(*inputs).backward()
    saved_bytes = {p: sum(s.values()) for p, s in saved.items()}
    block_input = BATCH * SEQ * 64 * 4
    assert saved_bytes["h.1"] == saved_bytes["h.3"] == block_input  # budget 0: only the block's input stays
    assert saved_bytes["h.0"] == saved_bytes["h.2"] > 4 * block_input
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)
    handle.remove()
    assert "forward" not in model.h[0].__dict__
    with pytest.raises(ValueError, match="outside"):
        compile_blocks(model, {"h.0": 1.5})


@pytest.mark.compile
def test_blocks_of_one_class_compile_statically_per_shape():
    """Blocks at one budget share a code object; each block shape gets its own static graph (no
    recompile with symbolic sizes), past Dynamo's default recompile limit of 8."""
    widths = [8 + 4 * i for i in range(11)]
    model = nn.Sequential(*(MLPBlock(a, b) for a, b in zip(widths, widths[1:])))
    handle = compile_blocks(model, {str(i): 1.0 for i in range(len(model))}, backend="aot_eager")
    counters.clear()
    model(torch.randn(2, widths[0])).sum().backward()
    handle.remove()
    assert counters["stats"]["unique_graphs"] == len(model) == 10


@pytest.mark.compile
def test_profiled_peak_matches_the_tracker_in_eager_and_drops_compiled():
    torch.manual_seed(0)
    model, inputs = gpt_small(BATCH, SEQ)
    model(*inputs).backward()  # warm-up: gradients exist from here on

    def step():
        model(*inputs).backward()

    tracker = LiveBytesTracker()
    tracker.track_all([list(model.parameters()), [p.grad for p in model.parameters()], inputs])
    start = tracker.live_bytes
    with tracker:
        step()
    eager = profiled_peak_bytes(step)
    assert eager == tracker.peak_bytes - start
    handle = compile_blocks(model, {f"h.{i}": 0.0 for i in range(4)}, backend="aot_eager_decomp_partition")
    step()  # compiles
    assert profiled_peak_bytes(step) < eager
    handle.remove()


@pytest.mark.compile
def test_plan_compiled_fits_the_budget():
    spec, config = f"{PATH}:gpt_small", TrainConfig(batch_size=BATCH, seq_len=SEQ)
    peak = simulate(trace_for(spec, config), config).peak_bytes
    roomy = plan_compiled(spec, config, peak, budgets=(1.0, 0.5, 0.0), scope="blocks")
    assert set(roomy.budgets) == {f"h.{i}" for i in range(4)} and set(roomy.budgets.values()) == {1.0}
    # inductor's partitioner saves less than eager even at budget 1.0 (it recomputes fused pointwise ops)
    top = roomy.predicted.peak_bytes
    assert roomy.predicted.recompute_s == 0.0 and 0 < top <= peak == roomy.predicted.baseline_peak_bytes
    saved = roomy.frontiers[next(iter(roomy.frontiers))][0].saved_bytes
    tight = plan_compiled(spec, config, top - saved // 2, budgets=(1.0, 0.5, 0.0), scope="blocks")
    assert tight.predicted.peak_bytes <= top - saved // 2 and tight.predicted.recompute_s > 0
    assert sorted(tight.budgets.values())[0] < 1.0
    with pytest.raises(InfeasibleBudget, match="the compiled peak is"):
        plan_compiled(spec, config, top // 4, budgets=(1.0, 0.5, 0.0), scope="blocks")


@pytest.mark.compile
def test_compile_scopes_whole_model_or_blocks():
    """auto compiles the whole model where it recomputes least; the whole model is split below
    budget 1.0 too; a whole-model plan runs through compile_blocks with the root path."""
    spec, config = f"{PATH}:gpt_small", TrainConfig(batch_size=BATCH, seq_len=SEQ)
    budgets = (1.0, 0.5, 0.0)
    whole = plan_compiled(spec, config, 10**12, budgets=budgets, scope="model")
    assert whole.budgets == {"": 1.0} and whole.predicted.recompute_s == 0.0
    assert whole.predicted.overhead < 0  # it fuses the pointwise ops outside the blocks (norms, the loss)
    blocks = plan_compiled(spec, config, 10**12, budgets=budgets, scope="blocks")
    # the whole graph also recomputes the fused pointwise ops between blocks (norms, the head's input)
    assert whole.predicted.peak_bytes < blocks.predicted.peak_bytes
    top = whole.predicted.peak_bytes
    assert plan_compiled(spec, config, top, budgets=budgets).budgets == {"": 1.0}
    lower = plan_compiled(spec, config, top - 1, budgets=budgets, scope="model")
    assert lower.budgets[""] < 1.0 and lower.predicted.peak_bytes < top and lower.predicted.recompute_s > 0
    auto = plan_compiled(spec, config, top - 1, budgets=budgets)
    assert auto.predicted.peak_bytes < top and auto.predicted.recompute_s <= lower.predicted.recompute_s
    with pytest.raises(InfeasibleBudget, match="the compiled peak is"):
        plan_compiled(spec, config, top // 4, budgets=budgets, scope="model")
    with pytest.raises(SpecError, match="compile scope 'layers'"):
        plan_compiled(spec, config, 10**12, scope="layers")


@pytest.mark.compile
def test_a_model_without_blocks_compiles_whole():
    spec, config = f"{PATH}:two_layer", TrainConfig(batch_size=BATCH, seq_len=SEQ)
    assert plan_compiled(spec, config, 10**12).budgets == {"": 1.0}
    with pytest.raises(SpecError, match="no blocks.*--compile-scope model"):
        plan_compiled(spec, config, 10**12, scope="blocks")


@pytest.mark.compile
def test_cli_plan_compile_writes_block_budgets(tmp_path, capsys):
    out = tmp_path / "compiled.json"
    code, stdout, err = run(
        [
            "plan",
            "--model",
            f"{PATH}:gpt_small",
            "--batch-size",
            str(BATCH),
            "--seq-len",
            str(SEQ),
            "--budget",
            "99%",
            "--compile",
            "--compile-scope",
            "blocks",
            "--out",
            str(out),
        ],
        capsys,
    )
    assert code == 0, err
    plan = json.loads(out.read_text())
    assert plan["kind"] == "compiled" and plan["config"]["compile"] is True
    assert set(plan["budgets"]) == {f"h.{i}" for i in range(4)} and "activation_memory_budget" in stdout
    assert plan["predicted"]["peak_bytes"] <= plan["budget_bytes"]
    assert load_plan(out) == CompiledPlan.from_dict(plan)
    code, stdout, err = run(["apply", "--model", f"{PATH}:gpt_small", "--plan", str(out)], capsys)
    assert code == 0 and "compiled plan matches" in stdout, err
    code, _, err = run(["simulate", "--model", f"{PATH}:gpt_small", "--plan", str(out)], capsys)
    assert code == 2 and "compiled plan" in err and "Traceback" not in err


def _eager_scratch_bytes(build, config: TrainConfig) -> int:
    """What the profiler sees beyond the tracker on an eager step: scratch aten's kernels allocate
    inside an op (convolution backward)."""
    torch.manual_seed(0)
    eager, inputs = build(config.batch_size, config.seq_len)
    optimizer = warmed_up(eager, inputs, config)
    profiled = profiled_step(eager, inputs, optimizer, lambda: run_training_step(eager, inputs, optimizer, "fp32"))
    scratch = profiled.peak_bytes - measure_step(eager, inputs, config).peak_bytes
    assert 0 <= scratch < (0.03 if build is resnet_small else 0.001) * profiled.peak_bytes
    return scratch


def _as_double(inputs: tuple) -> tuple:
    return tuple(x.double() if x.is_floating_point() else x for x in inputs)


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
@pytest.mark.parametrize("build", [gpt_small, llama_small, resnet_small])
def test_compiled_plan_applies_and_its_peak_is_predicted(build, tmp_path):
    """apply_plan takes the compiled plan file; gradients match eager; under inductor the profiled
    peak of the step is the prediction, or up to 5% below it. The profiler also sees scratch that
    aten's kernels allocate inside an op (convolution backward), which neither the tracker nor
    memplan counts: it is measured on the eager step and added to the prediction."""
    batch, seq = 4, 128  # activations well above the optimizer step's peak
    spec, config = f"{PATH}:{build.__name__}", TrainConfig(batch_size=batch, seq_len=seq)
    scratch = _eager_scratch_bytes(build, config)
    top = plan_compiled(spec, config, 10**12, budgets=(1.0, 0.5, 0.0), scope="blocks").predicted.peak_bytes
    plan = plan_compiled(spec, config, int(0.9 * top), budgets=(1.0, 0.5, 0.0), scope="blocks")
    assert set(plan.budgets.values()) != {1.0}
    plan.save(tmp_path / "compiled.json")
    torch.manual_seed(0)
    model, inputs = build(batch, seq)
    reference = copy.deepcopy(model)
    exact = copy.deepcopy(model).double()
    handle = apply_plan(model, tmp_path / "compiled.json")
    for m, args in ((model, inputs), (reference, inputs), (exact, _as_double(inputs))):
        m(*args).backward()
    for p, q, r in zip(model.parameters(), reference.parameters(), exact.parameters()):
        # Against a float64 step, per parameter. Inductor's fp32 kernels reorder sums: on resnet_small
        # plain torch.compile of the same blocks is 2.2e-3 off (eager fp32: 2.1e-4), through BatchNorm.
        compiled_error, eager_error = (torch.linalg.norm(g.grad.double() - r.grad) for g in (p, q))
        assert compiled_error <= max(2 * eager_error, COMPILED_GRAD_RTOL * torch.linalg.norm(r.grad)), (
            compiled_error,
            eager_error,
        )
    measured = measure_compiled_step(model, inputs, config)
    error = (plan.predicted.peak_bytes + scratch - measured.peak_bytes) / measured.peak_bytes
    # exact where blocks recompute part of their split; a block at budget 0 recomputes its
    # activations one at a time in backward, which the prediction takes as all at once (safe side)
    assert -0.001 <= error <= 0.05, (plan.budgets, plan.predicted.peak_bytes, measured.peak_bytes)
    handle.remove()
    assert all("forward" not in model.get_submodule(path).__dict__ for path in plan.budgets)


@pytest.mark.compile
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler")
@pytest.mark.parametrize("below", [False, True], ids=["budget-1.0", "below-1.0"])
@pytest.mark.parametrize("build", [gpt_small, llama_small, resnet_small])
def test_whole_model_compiled_peak_is_predicted(build, below):
    """scope 'model', at budget 1.0 and at the split just below what 1.0 needs: under inductor the
    profiled peak is within 4% of the prediction plus the eager step's scratch (at 0.5 measured:
    GPT -3.2%, Llama +3.4%, ResNet -2.3%)."""
    config = TrainConfig(batch_size=4, seq_len=128)
    spec, budgets = f"{PATH}:{build.__name__}", (1.0, 0.5, 0.0)
    scratch = _eager_scratch_bytes(build, config)
    plan = plan_compiled(spec, config, 10**12, budgets=budgets, scope="model")
    if below:
        plan = plan_compiled(spec, config, plan.predicted.peak_bytes - 1, budgets=budgets, scope="model")
        assert plan.budgets[""] < 1.0
    torch.manual_seed(0)
    model, inputs = build(config.batch_size, config.seq_len)
    handle = compile_blocks(model, plan.budgets)
    measured = measure_compiled_step(model, inputs, config)
    handle.remove()
    error = (plan.predicted.peak_bytes + scratch - measured.peak_bytes) / measured.peak_bytes
    assert abs(error) <= 0.04, (plan.budgets, plan.predicted.peak_bytes, scratch, measured.peak_bytes)


@pytest.mark.compile
def test_compiled_plan_file_is_validated(tmp_path):
    spec, config = f"{PATH}:gpt_small", TrainConfig(batch_size=BATCH, seq_len=SEQ)
    plan = plan_compiled(spec, config, 10**12, budgets=(1.0, 0.0))
    assert CompiledPlan.from_dict(plan.to_dict()) == plan
    for change, where in (
        (lambda d: d["budgets"].update({"h.0": 1.5}), "budgets/h.0"),
        (lambda d: d["budgets"].clear(), "budgets"),
        (lambda d: d["predicted"].pop("peak_bytes"), "predicted"),
        (lambda d: d["frontiers"].update({"x": [{"budget": 0.5}]}), "frontiers/x/0"),
        (lambda d: d.update(schema_version=2), "schema_version"),
    ):
        d = plan.to_dict()
        change(d)
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(d))
        with pytest.raises(PlanFileError, match=where):
            load_plan(path)
    other, _ = resnet_small(BATCH, SEQ)
    with pytest.raises(PlanFileError, match="different model"):
        apply_plan(other, plan)
    with pytest.raises(SpecError, match="plan_compiled"):
        solve(trace_for(spec, config), config.with_(compile=True), 10**12)
