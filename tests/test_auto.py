"""planner.runtime.auto: plan a live model in one line, re-plan for a new budget, follow lengths."""

from __future__ import annotations

import copy

import pytest
import torch
from models_for_tests import gpt_small, llama_small, resnet_small

from planner.budgets import parse_budget
from planner.errors import InfeasibleBudget, MemplanError
from planner.runtime.auto import auto_checkpoint, config_for, plan_for
from planner.runtime.verify import measure_step
from planner.tracing.recorder import loss_of

# (builder, batch, seq): shapes where the solver's cheapest plan fills the budget to within 2%
CASES = [(llama_small, 2, 128), (gpt_small, 4, 64), (resnet_small, 2, 32)]


def _grads(model, inputs):
    for p in model.parameters():
        p.grad = None
    loss_of(model(*inputs)).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("build,batch,seq", CASES, ids=[c[0].__name__ for c in CASES])
def test_budget_60_percent_is_met_with_same_grads_and_lower_budget_holds(build, batch, seq):
    torch.manual_seed(0)
    reference, inputs = build(batch, seq)
    model = copy.deepcopy(reference)
    handle = auto_checkpoint(model, inputs, "100%")
    states, baseline = handle.model_states_bytes, handle.baseline_peak_bytes
    budget = int(states + 0.6 * (baseline - states))
    handle.set_budget(budget)
    assert handle.plan.decisions, "a plan at 60% must recompute something"
    for got, want in zip(_grads(model, inputs), _grads(reference, inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    measured = measure_step(model, inputs, handle.config).peak_bytes
    assert 0.98 * budget <= measured <= budget, (measured, budget)

    with pytest.raises(InfeasibleBudget) as infeasible:
        handle.set_budget(states)
    assert handle.budget_bytes == budget  # a failed re-plan changes nothing
    lower = (infeasible.value.smallest_peak_bytes + measured) // 2
    plan = handle.set_budget(lower)
    assert plan is handle.plan and plan.budget_bytes == lower == handle.budget_bytes
    assert measure_step(model, inputs, handle.config).peak_bytes <= lower
    handle.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.slow
def test_set_budget_waits_for_the_next_forward():
    torch.manual_seed(0)
    reference, inputs = llama_small(2, 64)
    model = copy.deepcopy(reference)
    handle = auto_checkpoint(model, inputs, "100%")
    assert not handle.plan.decisions
    loss = loss_of(model(*inputs))
    states = handle.model_states_bytes
    tight = handle.set_budget(int(states + 0.5 * (handle.baseline_peak_bytes - states)))  # inside the step
    assert tight.decisions and not handle._applied._active
    loss.backward()
    assert handle._applied._active == {}
    _grads(model, inputs)
    assert handle._applied._active, "the next forward runs the new plan"
    for got, want in zip(_grads(model, inputs), _grads(reference, inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    handle.remove()


@pytest.mark.slow
def test_follows_sequence_length_and_caches_longer_ones():
    torch.manual_seed(0)
    model, inputs = llama_small(2, 32)
    handle = auto_checkpoint(model, inputs, 10**12, seq_lens=[32, 64])
    assert handle.planned_lengths == [32, 64]
    ids = torch.randint(0, 64, (2, 48))
    model(ids, ids)
    assert handle.seq_len == 64 and handle.last_seq_len == 48  # the smallest planned length >= 48
    ids = torch.randint(0, 64, (2, 80))
    model(ids, ids)
    assert handle.planned_lengths == [32, 64, 80] and handle.seq_len == 80
    events = handle.drain_events()
    assert [e["plan_seq_len"] for e in events] == [64, 80] and "traced" in events[1]["reason"]
    graph = handle.graph_at(80)
    model(ids, ids)
    assert handle.graph_at(80) is graph and not handle.drain_events()
    handle.remove()


def test_plan_for_applies_nothing_and_works_on_meta_parameters():
    with torch.device("meta"):
        model, _ = gpt_small(8, 64)
    inputs = gpt_small(8, 64)[1]
    plan = plan_for(model, inputs, "80%")
    assert plan.decisions and plan.predicted.peak_bytes <= plan.budget_bytes
    assert plan.config["gpu"] == "cpu" and plan.config["seq_len"] == 64 and plan.config["batch_size"] == 8
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(p.device.type == "meta" for p in model.parameters())


def test_budget_forms_and_errors():
    assert parse_budget(1000, 4000) == 1000
    assert parse_budget("60%", 4000) == 2400
    assert parse_budget("1KiB", 4000) == 1024
    for bad in ("abc", 0, "150%", "0%", True, 1.5):
        with pytest.raises(MemplanError):
            parse_budget(bad, 4000)
    with pytest.raises(MemplanError, match="bare fraction.*'60%'.*bytes"):
        parse_budget("0.6", 4000)


def test_config_defaults_and_bad_options():
    model, inputs = llama_small(2, 128)
    config = config_for(model, inputs)
    assert (config.batch_size, config.seq_len, config.precision, config.gpu) == (2, 128, "fp32", "cpu")
    assert config_for(model, inputs, optimizer="sgd").optimizer == "sgd"
    assert config_for(model, inputs, grad_accum_steps=4).grad_accum_steps == 4
    with pytest.raises(MemplanError, match="unknown option"):
        config_for(model, inputs, batch=3)
    with pytest.raises(MemplanError, match="pass cp_mesh="):  # context parallel needs the mesh it runs on
        config_for(model, inputs, cp=2)
    with pytest.raises(MemplanError, match="precision"):
        auto_checkpoint(model, inputs, "80%", precision="bf16")
    with pytest.raises(MemplanError, match="inputs"):
        auto_checkpoint(model, "not a batch", "80%")
    handle = auto_checkpoint(model, inputs, "80%")
    with pytest.raises(MemplanError, match="already has a memplan plan"):
        auto_checkpoint(model, inputs, "80%")
    with pytest.raises(InfeasibleBudget) as infeasible:  # raised from Python: names arguments, not flags
        handle.set_budget(handle.model_states_bytes)
    message = str(infeasible.value)
    assert "--" not in message and "raise budget" in message and "precision='bf16-mixed'" in message
    handle.remove()


@pytest.mark.slow
def test_moe_routing_assumption_is_taken_and_stored_in_the_plan():
    pytest.importorskip("transformers")
    from benchmarks.zoo_models import mixtral_loop

    torch.manual_seed(0)
    model, inputs = mixtral_loop(2, 32)
    plan = plan_for(model, inputs, "95%", gpu="cpu", moe_imbalance=2.0)
    routing = plan.config["moe_routing"]  # as memplan plan stores it
    assert plan.config["moe_imbalance"] == 2.0 and routing["imbalance"] == 2.0
    assert routing["routers"] == 2 and routing["busiest_expert_rows"] == 2 * routing["mean_rows_per_expert"]
    with auto_checkpoint(model, inputs, "95%", gpu="cpu") as handle:
        assert handle.plan.config["moe_routing"]["imbalance"] == 1.0
        assert "balanced (moe_imbalance)" in handle.routing and "--" not in handle.routing
    with pytest.raises(MemplanError, match="moe_imbalance|MoE imbalance"):
        plan_for(model, inputs, "80%", gpu="cpu", moe_imbalance=0.5)


def test_a_tensor_parallel_model_is_planned_as_its_rank_share():
    """After parallelize_module the live trace is this rank's share, made by the model's own TP hooks:
    the same plan as `memplan plan --tp 2` makes on its fake process group."""
    from planner.api import plan_model
    from planner.config import TrainConfig
    from planner.simulation.layout import simulate_ranks
    from planner.tracing.parallel.rank_trace import fake_process_group, layout_mesh
    from planner.tracing.parallel.tp_plans import tp_plan_for
    from planner.tracing.specs import resolve_spec

    config = TrainConfig(batch_size=2, seq_len=64, gpu="cpu", tp=2)
    budget = int(0.92 * simulate_ranks("llama-7b-tiny", config).peak_bytes)
    want, _, _ = plan_model("llama-7b-tiny", config, budget, time_limit_s=5.0)
    with fake_process_group(0, 2):
        model, inputs = resolve_spec("llama-7b-tiny").build(batch_size=2, seq_len=64)
        tp_plan_for(config)(model, layout_mesh(config)["tp"])
        got = plan_for(model, inputs, budget, time_limit_s=5.0)
    assert got.config["tp"] == 2
    assert got.decisions == want.decisions and got.predicted.peak_bytes == want.predicted.peak_bytes


def _closure_forwards(model: torch.nn.Module) -> None:
    """Replace each Linear's forward by a closure over its bound forward (transformers' TP styles do)
    or by a function holding it as a default argument."""

    def closure(own):
        def forward(*args, **kwargs):
            return own(*args, **kwargs)

        return forward

    for k, module in enumerate(m for m in model.modules() if isinstance(m, torch.nn.Linear)):
        if k % 2:
            module.forward = closure(module.forward)
        else:

            def forward(*args, own=module.forward, **kwargs):
                return own(*args, **kwargs)

            module.forward = forward


def test_a_forward_replaced_by_a_closure_runs_on_the_copy():
    """The fake copy's closures are copied with it: the trace sees the copy's fake parameters, so the
    plan is the plain model's (before, the closure ran the original module on real parameters)."""
    torch.manual_seed(0)
    plain, inputs = llama_small(2, 64)
    wrapped = copy.deepcopy(plain)
    _closure_forwards(wrapped)
    want, got = plan_for(plain, inputs, "90%"), plan_for(wrapped, inputs, "90%")
    assert got.predicted == want.predicted and got.decisions == want.decisions


def test_a_module_outside_the_model_is_one_line():
    """A forward that calls a module with parameters the model does not hold: its parameters would go uncounted."""

    class Outside(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(16, 16)
            self.__dict__["helper"] = torch.nn.Linear(16, 16)  # not a registered submodule

        def forward(self, x):
            return self.helper(self.inner(x)).sum()

    with pytest.raises(MemplanError, match="not part of the traced model"):
        plan_for(Outside(), (torch.randn(2, 16),), "80%")


def test_a_fully_sharded_model_is_refused_in_one_line():
    from torch.distributed.fsdp import fully_shard

    from planner.tracing.parallel.rank_trace import fake_process_group

    model, inputs = llama_small(2, 64)
    with fake_process_group(0, 2):
        fully_shard(model)
        with pytest.raises(MemplanError, match="before fully_shard"):
            plan_for(model, inputs, "80%")


@pytest.mark.slow  # 6 s; the TP rank share stays in the fast tier
def test_an_expert_parallel_model_is_planned_as_its_rank_share():
    """Experts sharded over an ep mesh: the live trace is this EP rank's share under the routing
    assumption; rank 0, the busiest under --moe-imbalance 2, plans as `memplan plan --ep 2` does."""
    from pathlib import Path

    from planner.api import plan_model
    from planner.config import TrainConfig
    from planner.simulation.layout import simulate_ranks
    from planner.tracing.parallel.ep_plans import resolve_ep_plan
    from planner.tracing.parallel.rank_trace import ep_mesh, fake_process_group
    from planner.tracing.specs import resolve_spec

    spec = f"{Path(__file__).parent / 'ep_models.py'}:titan_moe"
    config = TrainConfig(batch_size=2, seq_len=64, gpu="cpu", dp=2, ep=2, moe_imbalance=2.0)
    budget = int(0.85 * simulate_ranks(spec, config).peak_bytes)
    want, _, _ = plan_model(spec, config, budget, time_limit_s=5.0)
    with fake_process_group(0, 2):
        model, inputs = resolve_spec(spec).build(2, 64)
        resolve_ep_plan(config.ep_plan)(model, ep_mesh(config))
        got = plan_for(model, inputs, budget, dp=2, moe_imbalance=2.0, time_limit_s=5.0)
        with pytest.raises(MemplanError, match=r"ep=2 must divide dp=1 .* use a dp that ep divides"):
            plan_for(model, inputs, budget)  # the data-parallel degree the experts borrow from is the caller's
    assert (got.config["ep"], got.config["dp"]) == (2, 2)
    assert got.decisions == want.decisions and got.predicted.peak_bytes == want.predicted.peak_bytes
