"""A planned step leaves the model's state as the unplanned step does.

After 3 AdamW steps, planned vs unplanned: parameters, gradients, every buffer (BatchNorm's running
statistics and num_batches_tracked included) and the optimizer's states are bit-equal (torch.equal),
for every way memplan recomputes: whole block, selective (kept ops), child module, flat-Sequential
segment, and the solver's own plans. A recompute runs the forward's ops again in the same order on
the same values, so nothing is reordered and no tolerance is needed. Blocks compiled at their own
activation budgets (torch.compile's partitioner recomputes inside the compiled backward) are checked
too; only their comparison with eager needs a tolerance (see that test).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import planner
from planner.config import TrainConfig
from planner.plans.format import Decision, Plan
from planner.plans.identity import model_info
from planner.runtime.apply import PlanHandle, apply_plan
from planner.runtime.compiled import compile_blocks
from planner.runtime.dryrun import dry_run
from planner.tracing.blocks import find_region_paths
from planner.tracing.recorder import loss_of, run_step_inputs, trace
from planner.tracing.specs import resolve_spec
from tests.test_apply import make_plan

STEPS = 3
BATCH = 2
State = dict[str, dict[str, torch.Tensor]]


# ---------------------------------------------------------------- helpers


def train(model: nn.Module, batches: list[Any], install: Callable[[nn.Module], Any] | None = None) -> State:
    """Run one AdamW step per batch (with what `install` returns in force, removed after); the state
    the steps leave."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = None if install is None else install(model)
    try:
        for inputs in batches:
            optimizer.zero_grad(set_to_none=True)
            loss_of(run_step_inputs(model, inputs)).backward()
            optimizer.step()
    finally:
        if handle is not None:
            handle.remove()
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        "parameter": {n: p.detach().clone() for n, p in model.named_parameters()},
        "gradient": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "buffer": {n: b.clone() for n, b in model.named_buffers()},
        "optimizer": {f"{names[id(p)]}.{k}": v.clone() for p, s in optimizer.state.items() for k, v in s.items()},
    }


def assert_same_state(got: State, want: State) -> None:
    for kind, tensors in want.items():
        assert got[kind].keys() == tensors.keys(), kind
        for name, t in tensors.items():
            assert torch.equal(got[kind][name], t), (
                f"{kind} {name} differs by {(got[kind][name].double() - t.double()).abs().max()}"
            )
    assert want["buffer"] and want["optimizer"] and want["gradient"]


Maker = Callable[[], tuple[nn.Module, list[Any]]]


@functools.cache
def unplanned(make: Maker) -> State:
    model, batches = make()
    return train(model, batches)


def check_plan(make: Maker, plan_of: Callable[[nn.Module], Plan]) -> None:
    """The plan's 3 steps leave the same state as 3 unplanned steps from the same start."""
    model, batches = make()
    plan = plan_of(model)
    assert any(d.action == "recompute" for d in plan.decisions)
    assert_same_state(train(model, batches, lambda m: apply_plan(m, plan)), unplanned(make))


def hand_plan(model: nn.Module, name: str, decisions: list[Decision]) -> Plan:
    return make_plan(model_info(model, name), tuple(decisions))


def whole(model: nn.Module) -> list[Decision]:
    return [Decision(p, "recompute") for p in find_region_paths(model)]


def selective(model: nn.Module, kept: str) -> list[Decision]:
    return whole(model) + [Decision(p, "keep", op=kept) for p in find_region_paths(model)]


# ---------------------------------------------------------------- a ResNet with BatchNorm

RESNET = "resnet-tiny"


def resnet() -> tuple[nn.Module, list[Any]]:
    torch.manual_seed(0)
    model, _ = resolve_spec(RESNET).build(batch_size=BATCH, seq_len=16)
    batches = [resolve_spec(RESNET).build(batch_size=BATCH, seq_len=16)[1] for _ in range(STEPS)]
    return model, batches


RESNET_PLANS: dict[str, Callable[[nn.Module], list[Decision]]] = {
    "whole": whole,
    "selective": lambda m: selective(m, "aten.convolution.default#1"),
    "child": lambda m: [Decision("stages.1.0.downsample", "recompute"), Decision("stages.2.0.bn1", "recompute")],
    "segment": lambda m: [Decision("stem.0:2", "recompute")],
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", RESNET_PLANS)
def test_resnet_batchnorm_state_equal(strategy: str) -> None:
    check_plan(resnet, lambda m: hand_plan(m, RESNET, RESNET_PLANS[strategy](m)))


def test_resnet_buffer_writes_seen_by_trace_and_restored_by_runtime() -> None:
    """The trace names the buffers each block writes in forward; the runtime finds the same ones
    and, after one planned step, BatchNorm has counted one batch, as without a plan."""
    graph = trace(RESNET, batch_size=BATCH, seq_len=16)
    model, batches = resnet()
    handle = apply_plan(model, hand_plan(model, RESNET, whole(model)))
    assert isinstance(handle, PlanHandle)
    with handle:
        loss_of(run_step_inputs(model, batches[0])).backward()
        for path in find_region_paths(model):
            written = graph.buffers_written(path)
            assert {n.rsplit(".", 1)[1] for n in written} == {"running_mean", "running_var", "num_batches_tracked"}
            assert set(handle.written_buffers(path)) == set(written)
    assert all(int(m.num_batches_tracked) == 1 for m in model.modules() if isinstance(m, nn.BatchNorm2d))


@pytest.mark.slow
def test_batchnorm_frozen_then_trained_keeps_state() -> None:
    """A block whose BatchNorm first runs in eval mode (writes nothing), then in training, is
    restored in both: what a block writes is learned per train/eval mode."""

    def steps(model: nn.Module, batches: list[Any], plan: Plan | None) -> State:
        install = None if plan is None else lambda m: apply_plan(m, plan)
        model.eval()
        train(model, batches[:1], install)
        model.train()
        return train(model, batches[1:], install)

    reference, batches = resnet()
    want = steps(reference, batches, None)
    model, _ = resnet()
    assert_same_state(steps(model, batches, hand_plan(model, RESNET, whole(model))), want)


def test_dry_run_on_fake_tensors_with_batchnorm_recompute() -> None:
    spec = resolve_spec(RESNET)
    model, _ = spec.build(batch_size=BATCH, seq_len=16)
    dry_run(spec, TrainConfig(batch_size=BATCH, seq_len=16), hand_plan(model, RESNET, whole(model)))


@pytest.mark.slow
def test_resnet_solver_plan_state_equal() -> None:
    images = resolve_spec(RESNET).build(batch_size=4, seq_len=64)[1]  # activations set the peak
    check_plan(resnet, lambda m: planner.plan_for(m, images, "90%", time_limit_s=5))


@pytest.mark.slow
@pytest.mark.compile
def test_compiled_blocks_update_batchnorm_once() -> None:
    """torch.compile's partitioner recomputes inside the backward graph, and AOTAutograd applies
    buffer writes once, in the forward graph: a block compiled at activation budget 0 (recompute
    all it can) leaves the state bit-equal to budget 1 (recompute nothing), and num_batches_tracked
    equal to eager's. Against eager, the decomposed BatchNorm sums in another order: running
    statistics agree to float32 rounding (1.6e-7 seen), so that comparison is allclose."""

    def compiled(budget: float) -> Callable[[nn.Module], Any]:
        def install(model: nn.Module) -> Any:
            budgets = dict.fromkeys(find_region_paths(model), budget)
            return compile_blocks(model, budgets, backend="aot_eager_decomp_partition")

        return install

    states = []
    for budget in (0.0, 1.0):
        model, batches = resnet()
        states.append(train(model, batches, compiled(budget)))
    assert_same_state(states[0], states[1])
    for name, want in unplanned(resnet)["buffer"].items():
        torch.testing.assert_close(states[0]["buffer"][name], want, rtol=1e-5, atol=1e-6, msg=name)
        if name.endswith("num_batches_tracked"):
            assert torch.equal(states[0]["buffer"][name], want), name


# ---------------------------------------------------------------- buffers a forward reads and writes


class Stateful(nn.Module):
    """Writes two buffers in forward that its output depends on: a call counter in place, and a
    running mean of its input by rebinding."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = torch.tanh(self.linear(x - self.mean)) * self.calls
        self.mean = 0.9 * self.mean + 0.1 * x.detach().mean((0, 1))
        return y


class StatefulNet(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Stateful(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x.square().mean()


def stateful() -> tuple[nn.Module, list[Any]]:
    torch.manual_seed(0)
    return StatefulNet(), [(torch.randn(BATCH, 8, 16),) for _ in range(STEPS)]


STATEFUL_PLANS: dict[str, Callable[[nn.Module], list[Decision]]] = {
    "whole": whole,
    "selective": lambda m: selective(m, "aten.addmm.default#0"),
    "child": lambda m: [Decision("layers.1.linear", "recompute")],
}


@pytest.mark.parametrize("strategy", STATEFUL_PLANS)
def test_buffers_the_output_reads_are_replayed_from_their_forward_state(strategy: str) -> None:
    """The recompute reads the counter and the mean the forward read (else the gradients change)
    and leaves both as the forward left them."""
    check_plan(stateful, lambda m: hand_plan(m, "stateful", STATEFUL_PLANS[strategy](m)))


# ---------------------------------------------------------------- transformers decoders

VOCAB, SEQ = 128, 32


def tokens(batch_size: int = BATCH, seq_len: int = SEQ) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch_size, seq_len))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, VOCAB, ids.shape)}


def llama() -> tuple[nn.Module, list[Any]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(config), [tokens() for _ in range(STEPS)]


def qwen3_moe() -> tuple[nn.Module, list[Any]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    return transformers.Qwen3MoeForCausalLM(config), [tokens() for _ in range(STEPS)]


DECODER_PLANS: dict[str, Callable[[nn.Module], Plan]] = {
    "whole": lambda m: hand_plan(m, "decoder", whole(m)),
    "selective": lambda m: hand_plan(m, "decoder", selective(m, "aten.mm.default#0")),
    "child": lambda m: hand_plan(
        m, "decoder", [Decision("model.layers.0.mlp", "recompute"), Decision("model.layers.1.self_attn", "recompute")]
    ),
    # at 4 x 64 activations, not the optimizer's states, set the peak
    "solver": lambda m: planner.plan_for(m, tokens(4, 64), "80%", time_limit_s=5),
}
DECODERS = {"llama": llama, "qwen3-moe": qwen3_moe}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", DECODER_PLANS)
@pytest.mark.parametrize("decoder", DECODERS)
def test_decoder_state_equal(decoder: str, strategy: str) -> None:
    check_plan(DECODERS[decoder], DECODER_PLANS[strategy])
