"""The model zoo: Hugging Face architectures from tiny configs and attribute layers, traced on fake
tensors, compared with a real CPU step, planned at 60% and applied (benchmarks/zoo.py)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

from benchmarks.zoo import ZOO, measure_zoo_model  # noqa: E402
from planner.api import trace_for  # noqa: E402
from planner.config import TrainConfig  # noqa: E402
from planner.errors import PlanFileError, TraceError  # noqa: E402
from planner.plans.format import Decision  # noqa: E402
from planner.runtime.apply import apply_plan  # noqa: E402
from planner.runtime.compiled import compile_blocks  # noqa: E402
from planner.runtime.dryrun import dry_run  # noqa: E402
from planner.solver.compiled import plan_compiled  # noqa: E402
from planner.solver.planning import solve  # noqa: E402
from planner.tracing.specs import resolve_spec  # noqa: E402
from tests.cli_helpers import assert_user_error, run  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize(("name", "batch_size", "seq_len", "tolerance"), ZOO, ids=[z[0] for z in ZOO])
def test_zoo_model_is_predicted_and_its_plan_runs(name, batch_size, seq_len, tolerance):
    row = measure_zoo_model(name, batch_size, seq_len)
    assert abs(row.error) <= tolerance, row
    assert row.plan_decisions > 0, row
    assert row.over_budget <= 0.02, row
    assert row.grads_equal, row


def test_moe_routing_assumption_is_recorded_and_sizes_the_busiest_expert():
    config = TrainConfig(batch_size=2, seq_len=32)
    balanced = trace_for("benchmarks.zoo_models:mixtral_loop", config)
    skewed = trace_for("benchmarks.zoo_models:mixtral_loop", config.with_(moe_imbalance=2.0))
    routing = balanced.meta["moe"]
    assert routing["routers"] == 2 and routing["experts"] == 4 and routing["top_k"] == 2
    assert routing["busiest_expert_rows"] == routing["mean_rows_per_expert"] == 2 * 32 * 2 / 4
    assert skewed.meta["moe"]["busiest_expert_rows"] == 2 * routing["mean_rows_per_expert"]

    def expert_matmul_rows(graph):  # rows of each expert's matmuls in the per-expert loop
        return {
            graph.tensors[t].shape[0]
            for op in graph.ops[: graph.backward_start]
            if op.module.startswith("model.layers.0.mlp.experts") and op.name.startswith("aten.mm")
            for t in op.allocs
        }

    assert expert_matmul_rows(balanced) == {32}
    assert max(expert_matmul_rows(skewed)) == 64
    # the routed rows sum to tokens x top-k either way: same saved activations, same op count
    assert len(skewed.ops) == len(balanced.ops)
    plan = solve(skewed, config.with_(moe_imbalance=2.0), 10**9)
    assert plan.config["moe_routing"]["imbalance"] == 2.0 and plan.config["moe_imbalance"] == 2.0


def _mixtral_plan(config):
    return solve(trace_for("benchmarks.zoo_models:mixtral", config), config, 10**9)


def test_plan_that_caches_a_mutated_tensor_is_refused_naming_module_and_decision():
    config = TrainConfig(batch_size=2, seq_len=16)
    plan = _mixtral_plan(config)
    # transformers divides the router's top-k weights in place: caching them cannot work
    bad = dataclasses.replace(
        plan,
        decisions=(Decision("model.layers.0", "recompute"), Decision("model.layers.0", "keep", "aten.topk.default#0")),
    )
    with pytest.raises(PlanFileError, match=r"module 'model.layers.0' \(recompute keeping aten.topk.default#0\)"):
        dry_run(resolve_spec("benchmarks.zoo_models:mixtral"), config, bad)


def test_apply_and_verify_refuse_a_failing_plan_in_one_line(tmp_path, capsys):
    config = TrainConfig(batch_size=2, seq_len=16)
    plan = _mixtral_plan(config)
    bad = dataclasses.replace(
        plan,
        decisions=(Decision("model.layers.1", "recompute"), Decision("model.layers.1", "keep", "aten.topk.default#0")),
    )
    path = tmp_path / "bad.json"
    bad.save(path)
    code, _, err = run(
        [
            "apply",
            "--model",
            "benchmarks.zoo_models:mixtral",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--plan",
            str(path),
        ],
        capsys,
    )
    assert_user_error(code, err, "apply", "model.layers.1", "mutated")
    code, _, err = run(
        [
            "verify",
            "--model",
            "benchmarks.zoo_models:mixtral",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--plan",
            str(path),
        ],
        capsys,
    )
    assert_user_error(code, err, "verify", "model.layers.1", "mutated")


def test_apply_plan_turns_the_cache_off_on_every_config_and_restores_it():
    config = TrainConfig(batch_size=2, seq_len=16)
    graph = trace_for("benchmarks.zoo_models:t5", config)
    plan = solve(graph, config, 10**9)
    plan = dataclasses.replace(plan, decisions=(Decision("decoder.block.0", "recompute"),))
    model, _ = resolve_spec("benchmarks.zoo_models:t5").build(batch_size=2, seq_len=16)
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "use_cache")}
    before = {k: c.use_cache for k, c in configs.items()}
    assert sum(before.values()) >= 2  # the model's and the decoder stack's own config
    handle = apply_plan(model, plan)
    assert not any(c.use_cache for c in configs.values())
    handle.remove()
    assert {k: c.use_cache for k, c in configs.items()} == before


@pytest.mark.compile
def test_compiled_plans_for_transformers_models():
    """Hugging Face blocks split on fake tensors with the key/value cache off (a cache passed in would
    grow on every call); compile_blocks turns it off and restores it; a block the partitioner cannot
    split (Mixtral's grouped_mm runs fp32 only under memplan's own trace) is a one-line error."""
    config = TrainConfig(batch_size=2, seq_len=32)
    plan = plan_compiled("benchmarks.zoo_models:llama", config, "95%")
    assert plan.budgets and plan.predicted.peak_bytes <= plan.budget_bytes
    model, _ = resolve_spec("benchmarks.zoo_models:llama").build(batch_size=2, seq_len=32)
    model.config.use_cache = True
    handle = compile_blocks(model, plan.budgets, "aot_eager_decomp_partition")
    assert model.config.use_cache is False
    handle.remove()
    assert model.config.use_cache is True
    with pytest.raises(TraceError, match="could not split block 'model.layers.0'.*without --compile"):
        plan_compiled("benchmarks.zoo_models:mixtral", config, "95%")
