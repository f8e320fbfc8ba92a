"""Tests for planner.runtime.apply: applying plans (recompute, selective recompute, offload, ladders)."""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from planner.config import TrainConfig
from planner.plans.format import (
    Decision,
    ModelInfo,
    Plan,
    PlanLadder,
    Predicted,
    SolverInfo,
)
from planner.plans.identity import model_info
from planner.runtime.apply import apply_plan, batch_seq_len, returns_tensor
from planner.runtime.verify import measure_step
from planner.tracing.blocks import find_region_paths
from planner.tracing.recorder import loss_of, run_step_inputs
from planner.tracing.specs import resolve_spec

SEQ, BATCH = 32, 2
PREDICTED = Predicted(0, 0, 0, 0.0, 0, 0.0, 0.0, 0.0)
SOLVER = SolverInfo("NOT_SOLVED", 0.0, 0.0, 0.0, 0.0)


# ---------------------------------------------------------------- helpers


def build(spec: str, seq_len: int = SEQ, seed: int = 0) -> tuple[nn.Module, Any]:
    torch.manual_seed(seed)
    return resolve_spec(spec).build(batch_size=BATCH, seq_len=seq_len)


def make_plan(info: ModelInfo, decisions: tuple[Decision, ...], seq_len: int = SEQ) -> Plan:
    config = {
        "batch_size": BATCH,
        "seq_len": seq_len,
        "precision": "fp32",
        "optimizer": "adamw",
        "zero_stage": 0,
        "dp": 1,
        "gpu": "cpu",
    }
    return Plan(info, config, 0, "test", decisions, PREDICTED, SOLVER)


def recompute_all(model: nn.Module, spec: str, seq_len: int = SEQ) -> Plan:
    decisions = tuple(Decision(p, "recompute") for p in find_region_paths(model))
    return make_plan(model_info(model, spec), decisions, seq_len)


def offload_all(model: nn.Module, spec: str, target: str) -> Plan:
    decisions = tuple(Decision(p, "offload", target=target) for p in find_region_paths(model))
    return make_plan(model_info(model, spec), decisions)


def step(model: nn.Module, inputs: Any, owner: nn.Module | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients (of `owner`'s parameters, default the model's) of one forward + backward."""
    owner = model if owner is None else owner
    owner.zero_grad(set_to_none=True)
    loss = loss_of(run_step_inputs(model, inputs))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in owner.named_parameters() if p.grad is not None}


def assert_same_step(got: tuple, want: tuple) -> None:
    assert torch.equal(got[0], want[0]) or torch.allclose(got[0], want[0], rtol=1e-6, atol=0)
    assert got[1].keys() == want[1].keys()
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-5, atol=1e-7, msg=name)


class OpCounter(TorchDispatchMode):
    """Counts ops by name; `keys` names them `op#k` inside `module` like memplan's trace."""

    def __init__(self, module: nn.Module | None = None) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.keys: list[str] = []
        self.inside = module is None
        if module is not None:
            self._hooks = [
                module.register_forward_pre_hook(lambda *_: self._set(True)),
                module.register_forward_hook(lambda *_: self._set(False)),
            ]

    def _set(self, value: bool) -> None:
        self.inside = value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside and any(isinstance(t, torch.Tensor) for t in tree_leaves(out)):
            name = str(func)
            self.keys.append(f"{name}#{sum(k.startswith(name + '#') for k in self.keys)}")
            self.counts[name] += 1
        return out


def forward_op_keys(model: nn.Module, inputs: Any, path: str) -> list[str]:
    counter = OpCounter(model.get_submodule(path))
    with torch.no_grad(), counter:
        run_step_inputs(model, inputs)
    for h in counter._hooks:
        h.remove()
    return counter.keys


def backward_counts(model: nn.Module, inputs: Any) -> Counter[str]:
    loss = loss_of(run_step_inputs(model, inputs))
    counter = OpCounter()
    with counter:
        loss.backward()
    return counter.counts


def first_matmul(keys: list[str]) -> str:
    for name in ("aten.mm.default", "aten.addmm.default", "aten.convolution.default"):
        if f"{name}#0" in keys:
            return f"{name}#0"
    raise AssertionError(f"no matmul in {keys}")


# ---------------------------------------------------------------- correctness

SPECS = ["llama-7b-tiny", "gpt2-tiny", "resnet-tiny"]


@pytest.mark.parametrize("spec", SPECS)
def test_full_recompute_same_gradients(spec: str) -> None:
    ref_model, inputs = build(spec)
    want = step(ref_model, inputs)
    model, _ = build(spec)
    with apply_plan(model, recompute_all(model, spec)):
        assert_same_step(step(model, inputs), want)


@pytest.mark.parametrize("spec", SPECS)
def test_selective_recompute_same_gradients_and_keeps_ops(spec: str) -> None:
    ref_model, inputs = build(spec)
    want = step(ref_model, inputs)
    model, _ = build(spec)
    paths = find_region_paths(model)
    kept = first_matmul(forward_op_keys(model, inputs, paths[-1]))
    name = kept.split("#")[0]
    full = recompute_all(model, spec)
    with apply_plan(model, full):
        step(model, inputs)
        full_count = backward_counts(model, inputs)[name]
    # a one-op block (resnet's stem conv) saves only its inputs, so backward never re-runs it
    keeps = tuple(
        Decision(p, "keep", op=kept)
        for p in paths
        if kept in (keys := forward_op_keys(model, inputs, p)) and len(keys) > 1
    )
    selective = make_plan(full.model, full.decisions + keeps)
    with apply_plan(model, selective):
        assert_same_step(step(model, inputs), want)
        # each kept occurrence is saved, not recomputed: the counter restarts per module and pass
        assert backward_counts(model, inputs)[name] == full_count - len(keeps)


@pytest.mark.parametrize("spec", SPECS)
def test_disk_offload_same_gradients_and_cleans_up(spec: str, tmp_path: Path) -> None:
    ref_model, inputs = build(spec)
    want = step(ref_model, inputs)
    model, _ = build(spec)
    handle = apply_plan(model, offload_all(model, spec, "disk"), spill_dir=tmp_path)
    assert handle.spill_dir is not None and handle.spill_dir.parent == tmp_path
    assert handle.spill_dir.name.startswith("memplan-spill-")
    loss = loss_of(run_step_inputs(model, inputs))
    assert any(handle.spill_dir.iterdir())  # activations were written
    loss.backward()
    assert not any(handle.spill_dir.iterdir())  # each file goes when read back
    assert_same_step(step(model, inputs), want)
    handle.remove()
    assert not handle.spill_dir.exists()


def test_disk_offload_files_go_when_graph_is_dropped() -> None:
    model, inputs = build("llama-7b-tiny")
    with apply_plan(model, offload_all(model, "llama-7b-tiny", "disk")) as handle:
        assert handle.spill_dir is not None
        assert handle.spill_dir.parent == Path(tempfile.gettempdir())
        loss = loss_of(run_step_inputs(model, inputs))
        assert any(handle.spill_dir.iterdir())
        del loss
        assert not any(handle.spill_dir.iterdir())
    assert not handle.spill_dir.exists()


def test_cpu_offload_on_cpu_same_gradients() -> None:
    ref_model, inputs = build("llama-7b-tiny")
    want = step(ref_model, inputs)
    model, _ = build("llama-7b-tiny")
    with apply_plan(model, offload_all(model, "llama-7b-tiny", "cpu")) as handle:
        assert handle.spill_dir is None
        assert_same_step(step(model, inputs), want)


def test_remove_restores_model() -> None:
    ref_model, inputs = build("llama-7b-tiny")
    model, _ = build("llama-7b-tiny")
    layer = model.get_submodule("layers.0")
    original = layer.forward
    handle = apply_plan(model, recompute_all(model, "llama-7b-tiny"))
    assert layer.forward != original and "forward" in layer.__dict__
    step(model, inputs)
    handle.remove()
    handle.remove()  # idempotent
    assert "forward" not in layer.__dict__ and layer.forward == original
    assert_same_step(step(model, inputs), step(ref_model, inputs))


def test_instance_forward_is_restored() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    own = model[0].forward
    model[0].forward = own  # a forward set on the instance stays the instance's after remove()
    info = model_info(model, "seq")
    with apply_plan(model, make_plan(info, (Decision("0", "recompute"),))):
        assert model[0].__dict__["forward"] is not own
    assert model[0].__dict__["forward"] is own


def test_plain_sequential_recompute_and_offload_from_file(tmp_path: Path) -> None:
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    x = torch.randn(3, 5, 4)
    want = step(make(), (x,))
    model = make()
    plan = make_plan(
        model_info(model, "seq"),
        (
            Decision("0", "recompute"),
            Decision("1", "offload", target="disk"),
            Decision("2", "recompute"),
            Decision("2", "keep", op="aten.addmm.default#0"),
        ),
    )
    path = tmp_path / "plan.json"
    plan.save(path)
    with apply_plan(model, str(path)):
        assert_same_step(step(model, (x,)), want)


def test_kwargs_model_recompute() -> None:
    spec = "kwargs-tiny"
    ref_model, inputs = build(spec)
    assert isinstance(inputs, dict)
    want = step(ref_model, inputs)
    model, _ = build(spec)
    with apply_plan(model, recompute_all(model, spec)):
        assert_same_step(step(model, inputs), want)


def test_double_apply_raises() -> None:
    model, _ = build("llama-7b-tiny")
    plan = recompute_all(model, "llama-7b-tiny")
    with apply_plan(model, plan):
        with pytest.raises(ValueError, match="already has a memplan plan applied"):
            apply_plan(model, plan)
        assert model.get_submodule("layers.0").__dict__.get("forward") is not None


def test_mismatched_plan_raises() -> None:
    other, _ = build("gpt2-tiny")
    model, _ = build("llama-7b-tiny")
    plan = make_plan(model_info(other, "gpt2-tiny"), (Decision("h.0", "recompute"),))
    with pytest.raises(ValueError, match="different model"):
        apply_plan(model, plan)
    assert "forward" not in model.get_submodule("layers.0").__dict__


def test_returns_tensor() -> None:
    assert returns_tensor(torch.ops.aten.mm.default)
    assert returns_tensor(torch.ops.aten.split.Tensor)
    assert not returns_tensor(torch.ops.aten.sym_size.int)


# ---------------------------------------------------------------- memory


@pytest.mark.slow
def test_recompute_and_disk_offload_lower_the_measured_peak() -> None:
    # llama-7b-tiny at 2 x 32 peaks in the AdamW step, where no activation is alive; gpt2-tiny does not
    spec = "gpt2-tiny"
    config = TrainConfig(batch_size=BATCH, seq_len=SEQ)
    model, inputs = build(spec)
    base = measure_step(model, inputs, config).peak_bytes
    with apply_plan(model, recompute_all(model, spec)):
        recompute = measure_step(model, inputs, config).peak_bytes
    with apply_plan(model, offload_all(model, spec, "disk")):
        disk = measure_step(model, inputs, config).peak_bytes
    assert recompute < base
    assert disk < base


# ---------------------------------------------------------------- ladders


def make_ladder(model: nn.Module, spec: str) -> PlanLadder:
    info = model_info(model, spec)
    return PlanLadder(((16, make_plan(info, (), 16)), (32, recompute_all(model, spec, 32))))


def test_ladder_picks_bucket_by_sequence_length() -> None:
    spec = "llama-7b-tiny"
    model, _ = build(spec)
    ladder = make_ladder(model, spec)
    mm = "aten.mm.default"
    with apply_plan(model, ladder) as handle:
        _, short = build(spec, 16)
        short_mm = backward_counts(model, short)[mm]
        assert (handle.active_seq_len, handle.active_bucket) == (16, 16)
        _, full = build(spec, 32)
        full_mm = backward_counts(model, full)[mm]
        assert (handle.active_seq_len, handle.active_bucket) == (32, 32)
        _, long = build(spec, 48)
        with pytest.warns(
            UserWarning,
            match="batch sequence length 48 is longer than the ladder's longest bucket 32; using that bucket's plan",
        ):
            long_mm = backward_counts(model, long)[mm]
        assert (handle.active_seq_len, handle.active_bucket) == (48, 32)
    plain, _ = build(spec)
    assert short_mm == backward_counts(plain, short)[mm]  # bucket 16: nothing recomputed
    assert full_mm > backward_counts(plain, full)[mm]  # bucket 32: recomputed
    assert long_mm > backward_counts(plain, long)[mm]


def test_ladder_decision_is_taken_at_forward_time() -> None:
    spec = "llama-7b-tiny"
    ref_model, inputs = build(spec)
    want = step(ref_model, inputs)
    model, _ = build(spec)
    with apply_plan(model, make_ladder(model, spec)) as handle:
        model.zero_grad(set_to_none=True)
        loss = loss_of(run_step_inputs(model, inputs))  # bucket 32: checkpointed
        _, short = build(spec, 16, seed=1)
        with torch.no_grad():
            run_step_inputs(model, short)  # switches to bucket 16 before the backward
        assert handle.active_bucket == 16
        loss.backward()
        got = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert_same_step(got, want)


def test_batch_seq_len_reads_first_2d_tensor() -> None:
    assert batch_seq_len((torch.zeros(3), torch.zeros(2, 7)), {}) == 7
    assert batch_seq_len((), {"mask": torch.zeros(2, 5), "ids": torch.zeros(2, 9)}) == 5
    with pytest.raises(ValueError, match="sequence length"):
        batch_seq_len((torch.zeros(3),), {})


# ---------------------------------------------------------------- torch.compile


@pytest.mark.compile
def test_compiled_planned_model_same_gradients() -> None:
    spec = "llama-7b-tiny"
    ref_model, inputs = build(spec)
    want = step(ref_model, inputs)
    model, _ = build(spec)
    try:
        compiled = torch.compile(model, backend="eager")
    except Exception as e:  # noqa: BLE001 - an unavailable compiler is a skip, not a failure
        pytest.skip(f"torch.compile is unavailable: {e}")
    plain_mm = backward_counts(ref_model, inputs)["aten.mm.default"]
    start = time.perf_counter()
    with apply_plan(model, recompute_all(model, spec)):
        got = step(compiled, inputs, owner=model)
        assert backward_counts(compiled, inputs)["aten.mm.default"] > plain_mm  # recomputed
    assert_same_step(got, want)
    assert time.perf_counter() - start < 60
