"""Expert parallel: per-rank traces on fake tensors under a fake process group (the experts sharded
by the model's own EP plan or memplan's torchtitan-style one, tokens moved by all-to-all sized by
the routing assumption), and the same layouts measured on CPU gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
from cli_helpers import assert_user_error, run
from hypothesis import given
from hypothesis import strategies as st

from planner.config import TrainConfig
from planner.simulation.layout import simulate_ranks
from planner.tracing.moe import RoutingAssumption
from planner.tracing.parallel.rank_trace import ep_role_keys

HERE = Path(__file__).parent
TITAN_MOE = f"{HERE / 'ep_models.py'}:titan_moe"
MIXTRAL = f"hf:{HERE / 'data' / 'tiny_mixtral' / 'config.json'}"
QWEN3_MOE = f"hf:{HERE / 'data' / 'tiny_qwen3_moe' / 'config.json'}"
OLMOE = f"hf:{HERE / 'data' / 'tiny_olmoe' / 'config.json'}"
GRANITE_MOE = f"hf:{HERE / 'data' / 'tiny_granitemoe' / 'config.json'}"
TOLERANCE = 0.01  # the issue asks for 3% and aims at 1%


def _config(**layout) -> TrainConfig:
    return TrainConfig(batch_size=2, seq_len=64, gpu="cpu", **layout)


def _by_rank(layout) -> list[int]:
    by_rank = {r: role.peak_bytes for role in layout.roles for r in role.ranks}
    return [by_rank[r] for r in range(layout.config.world_size)]


def test_ep_role_keys_follow_the_routing_assumption():
    routing = RoutingAssumption(2.0, routers=1, experts=4, top_k=2, tokens=128)
    keys = ep_role_keys(routing, 2)
    assert sum(map(sum, keys)) == 128 * 2
    assert sum(keys[0]) > sum(keys[1])  # expert 0, the busiest, lives on EP rank 0
    assert ep_role_keys(RoutingAssumption(1.0, routers=1, experts=4, top_k=2, tokens=128), 2) == [(64, 64)] * 2


@pytest.mark.parametrize(
    "spec",
    [TITAN_MOE, pytest.param(MIXTRAL, marks=pytest.mark.slow), pytest.param(QWEN3_MOE, marks=pytest.mark.slow)],
    ids=["titan", "mixtral", "qwen3-moe"],
)
def test_ep_shards_experts_and_the_busiest_rank_receives_more(spec):
    from planner.api import simulate_model

    balanced = simulate_ranks(spec, _config(dp=2, ep=2)).to_dict()
    assert [r["ranks"] for r in balanced["ranks"]] == [[0, 1]]
    single = simulate_model(spec, _config()).to_dict()
    # each rank holds half of the experts: fewer parameters, and a peak below one unsharded rank
    assert balanced["model_states"]["parameter"] < single["model_states"]["parameter"]
    assert balanced["peak_bytes"] < single["peak_bytes"]
    skewed = simulate_ranks(spec, _config(dp=2, ep=2, moe_imbalance=2.0)).to_dict()
    assert [r["ranks"] for r in skewed["ranks"]] == [[0], [1]]
    rank0, rank1 = skewed["ranks"]
    assert rank0["peak_bytes"] > rank1["peak_bytes"] and skewed["worst_rank"] == 0
    assert rank0["coords"]["ep"] == 0 and rank1["coords"]["ep"] == 1
    assert not dist.is_initialized()


def test_a_sweep_and_a_single_rank_simulation_know_about_ep(capsys):
    from planner.api import simulate_model, simulate_sweep
    from planner.errors import TraceError

    config = _config(dp=2, ep=2, moe_imbalance=2.0)
    (swept,) = simulate_sweep(TITAN_MOE, [config])
    assert swept["peak_bytes"] == simulate_ranks(TITAN_MOE, config).peak_bytes
    with pytest.raises(TraceError, match="simulate_layout"):
        simulate_model(TITAN_MOE, config)


def test_ep_with_more_data_parallel_ranks_repeats_the_ep_roles():
    layout = simulate_ranks(TITAN_MOE, _config(dp=4, ep=2, moe_imbalance=2.0)).to_dict()
    assert [r["ranks"] for r in layout["ranks"]] == [[0, 2], [1, 3]]
    assert [r["coords"]["ep"] for r in layout["ranks"]] == [0, 1]


@pytest.mark.distributed
@pytest.mark.slow
def test_ep2_inside_fsdp2_on_4_gloo_ranks():
    """--dp 4 --ep 2 --zero 3: the experts sharded over EP 2 and FSDP2 over the 2 ranks holding the
    same experts, the rest over all 4; each rank within 1% of its prediction."""
    from ep_ranks import run_on_ranks

    config = _config(dp=4, ep=2, zero_stage=3, moe_imbalance=2.0)
    want = _by_rank(simulate_ranks(TITAN_MOE, config))
    peaks, grad_error = run_on_ranks([("titan", TITAN_MOE, config, None)], 4)["titan"]
    for rank, (w, got) in enumerate(zip(want, peaks)):
        assert abs(w - got) <= TOLERANCE * got, (rank, w, got)
    assert grad_error == 0.0


def test_experts_sharded_over_one_rank_are_copied_once_at_their_own_forward():
    """--dp 2 --ep 2 --zero 3 leaves each experts unit one rank to shard over: FSDP2 then gathers
    nothing (its world-size-1 path) and copies the shards into the unsharded parameters at the
    unit's pre-forward, one copy of its bytes, with no all-gather output held beside it."""
    from planner.simulation.fsdp import fsdp_buffers, fsdp_units
    from planner.simulation.layout import trace_roles

    config = _config(dp=2, ep=2, zero_stage=3)
    _, graphs = trace_roles(OLMOE, config)
    graph = next(iter(graphs.values()))
    experts = set(graph.meta["ep_expert_modules"])
    units = fsdp_units(graph, config.shard_ranks)
    root, extra = units[-1], fsdp_buffers(graph, config, 0.5)
    inside = [(u, next(b for b in units if u.path.startswith(f"{b.path}."))) for u in units if u.path in experts]
    assert len(inside) == 4
    for u, block in inside:  # the root, the block and its experts gathered, the experts once
        assert extra[u.fwd_start]["parameter"] == root.param_bytes + block.param_bytes + u.param_bytes


def test_ep_with_zero3_shards_experts_over_the_rest_of_dp():
    ep_only = simulate_ranks(TITAN_MOE, _config(dp=4, ep=2)).to_dict()
    fsdp = simulate_ranks(TITAN_MOE, _config(dp=4, ep=2, zero_stage=3)).to_dict()
    plain = simulate_ranks(TITAN_MOE, _config(dp=4, ep=4, zero_stage=3)).to_dict()
    assert fsdp["model_states"]["optimizer"] < ep_only["model_states"]["optimizer"]
    # ZeRO-3 states: every parameter's 1/dp, whatever --ep says
    assert fsdp["model_states"]["optimizer"] == plain["model_states"]["optimizer"]


def test_user_ep_plan_function(tmp_path):
    plan_file = tmp_path / "plan.py"
    plan_file.write_text(
        "from planner.tracing.parallel.expert_parallel import ExpertParallel\n"
        "from torch.distributed.tensor.parallel import parallelize_module\n"
        "def plan(model, ep_mesh):\n"
        "    for block in model.layers:\n"
        "        parallelize_module(block.moe.experts, ep_mesh, ExpertParallel())\n"
    )
    user = simulate_ranks(TITAN_MOE, _config(dp=2, ep=2, ep_plan=f"{plan_file}:plan"))
    auto = simulate_ranks(TITAN_MOE, _config(dp=2, ep=2))
    assert user.peak_bytes == auto.peak_bytes


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--model", TITAN_MOE, "--dp", "3", "--ep", "3"], ("--ep 3 does not divide the 4 experts", "--ep 2")),
        (["--model", MIXTRAL, "--dp", "3", "--ep", "3"], ("--ep 3 does not divide the 4 experts",)),
        (["--model", TITAN_MOE, "--dp", "3", "--ep", "2"], ("--ep 2 must divide --dp 3",)),
        (["--model", "llama-7b-tiny", "--dp", "2", "--ep", "2"], ("found no mixture-of-experts layers", "drop --ep")),
        (["--model", TITAN_MOE, "--dp", "2", "--ep", "2", "--zero", "2"], ("--zero 3",)),
    ],
    ids=["ep-experts", "ep-experts-hf", "ep-dp", "dense", "zero2"],
)
def test_ep_errors_are_one_line(capsys, argv, needles):
    code, _, err = run(["simulate", "--gpu", "cpu", "--seq-len", "64", *argv], capsys)
    assert_user_error(code, err, "simulate", *needles)
    assert not dist.is_initialized()


@pytest.mark.slow  # 6 s; test_ep covers EP sharding in the fast tier
def test_tp_shards_the_experts_hidden_dimension_and_ep_their_count():
    """torchtitan-style MoE under TP 2 (experts' hidden dimension over tp), and TP 2 × EP 2 (the
    experts over ep, each also over tp): the TP ranks of an EP index share its role; the experts'
    local parameters shrink by tp, then by ep."""
    tp = simulate_ranks(TITAN_MOE, _config(tp=2)).to_dict()
    both = simulate_ranks(TITAN_MOE, _config(tp=2, dp=2, ep=2, moe_imbalance=2.0)).to_dict()
    ep = simulate_ranks(TITAN_MOE, _config(dp=2, ep=2, moe_imbalance=2.0)).to_dict()
    assert [r["ranks"] for r in both["ranks"]] == [[0, 1], [2, 3]]
    assert [r["coords"]["ep"] for r in both["ranks"]] == [0, 1]
    params = {name: r["model_states"]["parameter"] for name, r in (("tp", tp), ("both", both), ("ep", ep))}
    assert params["both"] < params["tp"] and params["both"] < params["ep"]
    assert not dist.is_initialized()


@pytest.mark.slow
def test_transformers_experts_stay_whole_on_each_tp_rank_and_fsdp2_shards_them_over_edp_and_tp():
    """Mixtral under TP 2 × EP 2 over dp 2: transformers' plan keeps each TP rank's experts whole
    (each runs its slice of the tokens), so with --zero 3 FSDP2 shards them over edp × tp (2 ranks
    here, edp being 1); torchtitan-style experts are already split over tp and shard over edp alone."""
    from planner.tracing.parallel.rank_trace import trace_tp_rank

    hf = _config(tp=2, dp=2, ep=2, zero_stage=3)
    assert trace_tp_rank(MIXTRAL, hf, 0)[0].meta["ep_expert_tp_replicas"] == 2
    assert trace_tp_rank(TITAN_MOE, hf, 0)[0].meta["ep_expert_tp_replicas"] == 1
    sharded = simulate_ranks(MIXTRAL, hf).to_dict()["model_states"]
    unsharded = simulate_ranks(MIXTRAL, hf.with_(zero_stage=0)).to_dict()["model_states"]
    ep_only = simulate_ranks(MIXTRAL, _config(dp=2, ep=2, zero_stage=3)).to_dict()["model_states"]
    assert sharded["parameter"] < unsharded["parameter"]
    assert sharded["parameter"] < ep_only["parameter"]  # the experts over 2 ranks, not over edp = 1
    assert not dist.is_initialized()


@given(
    local=st.integers(1, 64),
    edp=st.sampled_from([1, 2, 3, 4]),
    ep=st.sampled_from([1, 2, 4, 8]),
    replicas=st.sampled_from([1, 2, 4, 8]),
)
def test_an_expert_state_shape_sharded_over_dp_is_the_shard_fsdp2_keeps(local, edp, ep, replicas):
    """The stand-in shape sharded over the dp ranks gives each rank the rows FSDP2 gives it of the
    local experts sharded over edp × tp replicas (dim 0 padded)."""
    from planner.simulation.fsdp import expert_state_shape, padded_bytes

    shard_ranks, expert_ranks = edp * ep, edp * replicas
    shape = expert_state_shape((local, 3), shard_ranks, expert_ranks)
    kept = padded_bytes(shape, 2, shard_ranks) // shard_ranks
    assert kept == padded_bytes((local, 3), 2, expert_ranks) // expert_ranks


def test_diagnose_names_the_worst_expert_parallel_rank(capsys, tmp_path):
    out = tmp_path / "d.json"
    base = ["--model", TITAN_MOE, "--seq-len", "64", "--dp", "2", "--ep", "2", "--moe-imbalance", "2"]
    code, stdout, err = run(["diagnose", *base, "--json", str(out)], capsys)
    assert code == 0, err
    simulated = tmp_path / "s.json"
    code, _, err = run(["simulate", *base, "--json", str(simulated)], capsys)
    assert code == 0, err
    worst = json.loads(simulated.read_text())["worst_rank"]
    assert f"on rank {worst} (pp=0, dp=" in stdout
    assert json.loads(out.read_text())["peak_bytes"] == json.loads(simulated.read_text())["peak_bytes"]


def test_ep_plan_function_that_raises_is_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def plan(model, ep_mesh):\n    raise RuntimeError('boom')\n")
    argv = ["--model", TITAN_MOE, "--dp", "2", "--ep", "2", "--ep-plan", f"{bad}:plan"]
    code, _, err = run(["simulate", "--gpu", "cpu", "--seq-len", "64", *argv], capsys)
    assert_user_error(code, err, "simulate", "ep-plan function", "raised RuntimeError: boom")
    assert not dist.is_initialized()


def test_cli_json_ranks_carry_ep_coords(capsys, tmp_path):
    out = tmp_path / "ep.json"
    argv = ["--model", TITAN_MOE, "--batch-size", "2", "--dp", "2", "--ep", "2", "--moe-imbalance", "2"]
    code, stdout, _ = run(["simulate", "--gpu", "cpu", "--seq-len", "64", *argv, "--json", str(out)], capsys)
    assert code == 0
    result = json.loads(out.read_text())
    assert [(r["ranks"], r["coords"]["ep"]) for r in result["ranks"]] == [([0], 0), ([1], 1)]
    assert result["layout"]["ep"] == 2 and result["peak_bytes"] == max(r["peak_bytes"] for r in result["ranks"])
    assert f"worst rank {result['worst_rank']}" in stdout


# ---------------------------------------------------------------------------------------- gloo ranks

GLOO_SPECS = {"titan": TITAN_MOE, "mixtral": MIXTRAL}
PLAN_FRACTION = 0.85  # budget: this much of the no-plan peak of the worst rank


@pytest.mark.distributed
@pytest.mark.slow
def test_ep2_per_rank_peak_plans_and_gradients_match_gloo_ranks():
    """EP=2 on 2 gloo ranks (balanced and skewed routing, and inside FSDP2 with --zero 3): each rank's
    measured peak within 1% of its prediction, gradients allclose to one process; a plan solved for
    the busiest rank keeps both ranks within the budget."""
    from ep_ranks import run_on_ranks

    from planner.api import plan_model

    predicted, cases, budgets = {}, [], {}
    for imbalance, zero in ((1.0, 0), (2.0, 0), (2.0, 3)):
        config = _config(dp=2, ep=2, moe_imbalance=imbalance, zero_stage=zero)
        for name, spec in GLOO_SPECS.items():
            key = f"{name}-imbalance-{imbalance:g}" + ("-fsdp2" if zero else "")
            predicted[key] = _by_rank(simulate_ranks(spec, config))
            cases.append((key, spec, config, None))
    config = _config(dp=2, ep=2, moe_imbalance=2.0)
    for name, spec in GLOO_SPECS.items():
        key = f"{name}-plan"
        budgets[key] = int(PLAN_FRACTION * simulate_ranks(spec, config).peak_bytes)
        plan, _, _ = plan_model(spec, config, budgets[key], time_limit_s=5.0)
        predicted[key] = _by_rank(simulate_ranks(spec, config, plan))
        cases.append((key, spec, config, plan.to_dict()))
    measured = run_on_ranks(cases, 2)
    for key, want in predicted.items():
        peaks, grad_error = measured[key]
        for rank, (w, got) in enumerate(zip(want, peaks)):
            assert abs(w - got) <= TOLERANCE * got, (key, rank, w, got)
            assert key not in budgets or got <= budgets[key] * (1 + TOLERANCE), (key, rank, got, budgets[key])
        assert grad_error == 0.0, (key, grad_error)
    assert predicted["titan-imbalance-2"][0] > predicted["titan-imbalance-2"][1]


@pytest.mark.distributed
@pytest.mark.slow
def test_experts_fsdp2_shards_over_one_rank_match_gloo_ranks():
    """transformers' OLMoE and GraniteMoE under --dp 2 --ep 2 --zero 3 (each experts unit sharded over
    one rank, copied rather than all-gathered), in fp32 and bf16-mixed: every rank within 0.1% of
    its prediction (measured: within 120 B; 1.2% over before the world-size-1 path was modelled),
    fp32 gradients allclose to one process."""
    from ep_ranks import run_on_ranks

    cases = [
        (f"{name}-{precision}", spec, _config(dp=2, ep=2, zero_stage=3, precision=precision))
        for name, spec in {"olmoe": OLMOE, "granitemoe": GRANITE_MOE}.items()
        for precision in ("fp32", "bf16-mixed")
    ]
    measured = run_on_ranks([(*case, None) for case in cases], 2)
    for key, spec, config in cases:
        peaks, grad_error = measured[key]
        for rank, (want, got) in enumerate(zip(_by_rank(simulate_ranks(spec, config)), peaks)):
            assert abs(want - got) <= 0.001 * got, (key, rank, want, got)
        assert config.precision != "fp32" or grad_error == 0.0, (key, grad_error)  # bf16 steps differ from fp32


@pytest.mark.distributed
@pytest.mark.slow
def test_tp_with_and_without_ep_matches_gloo_ranks():
    """The torchtitan-style MoE under TP 2 (2 ranks) and TP 2 × EP 2 over dp 2 (4 ranks; skewed
    routing, with and without FSDP2), and Mixtral (transformers' plans) under TP 2 × EP 2: each rank
    within 1% of its prediction (measured: titan within 70 B, Mixtral within 0.3%), gradients
    allclose to one process."""
    from ep_ranks import run_on_ranks

    layouts = {
        2: {"tp2": _config(tp=2)},
        4: {
            "tp2-ep2": _config(tp=2, dp=2, ep=2, moe_imbalance=2.0),
            "tp2-ep2-fsdp2": _config(tp=2, dp=2, ep=2, zero_stage=3, moe_imbalance=2.0),
        },
    }
    specs = {2: [TITAN_MOE], 4: [TITAN_MOE, MIXTRAL]}
    for world, configs in layouts.items():
        cases = [(f"{key}-{spec}", spec, c) for key, c in configs.items() for spec in specs[world]]
        measured = run_on_ranks([(*case, None) for case in cases], world)
        for key, spec, config in cases:
            peaks, grad_error = measured[key]
            for rank, (want, got) in enumerate(zip(_by_rank(simulate_ranks(spec, config)), peaks)):
                assert abs(want - got) <= TOLERANCE * got, (key, rank, want, got)
            assert grad_error == 0.0, (key, grad_error)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "specs"),
    [
        ({"dp": 2, "ep": 2}, {"titan-moe": TITAN_MOE, "mixtral": MIXTRAL}),
        ({"dp": 2, "ep": 2, "zero_stage": 3}, {"titan-moe": TITAN_MOE}),
        ({"tp": 2, "dp": 2, "ep": 2}, {"titan-moe": TITAN_MOE, "mixtral": MIXTRAL}),
    ],
    ids=["ep2", "ep2-zero3", "tp2xep2"],
)
def test_auto_checkpoint_on_an_expert_parallel_model_matches_gloo_ranks(layout, specs):
    """auto_checkpoint after the EP (and TP) plan, before fully_shard, under --moe-imbalance 2: the EP
    ranks' traces differ, all install the plan of the heaviest (the one `memplan plan` solves), each
    within 1% of its prediction and the budget, gradients allclose to one process."""
    from tp_ranks import assert_auto_matches_plan

    assert_auto_matches_plan(specs, _config(moe_imbalance=2.0, **layout), 0.85, TOLERANCE)


@pytest.mark.distributed
@pytest.mark.slow
def test_auto_checkpoint_stops_every_rank_when_one_cannot_plan():
    """Under --moe-imbalance 2 a budget the light EP rank reaches and the busy one does not: every rank
    raises InfeasibleBudget in one line (none waits for the other in the ranks' agreement)."""
    from tp_ranks import auto_failures_on_ranks

    from planner.errors import InfeasibleBudget
    from planner.solver.planning import solve
    from planner.tracing.parallel.rank_trace import trace_tp_rank

    config = _config(dp=2, ep=2, moe_imbalance=2.0)
    smallest = []
    for rank in range(2):
        with pytest.raises(InfeasibleBudget) as info:
            solve(trace_tp_rank(TITAN_MOE, config, rank)[0], config, 1)
        smallest.append(info.value.smallest_peak_bytes)
    assert smallest[1] < smallest[0]
    failures = auto_failures_on_ranks(TITAN_MOE, config, (smallest[0] + smallest[1]) // 2)
    assert {kind for kind, _ in failures.values()} == {"InfeasibleBudget"}, failures
    assert failures[1][1].startswith("on rank 0: ") and all("\n" not in m for _, m in failures.values())
