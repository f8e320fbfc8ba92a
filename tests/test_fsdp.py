"""Real FSDP2 (fully_shard per block, then the root) on 2 gloo CPU ranks against memplan's
`--zero 3 --dp 2` prediction, without and with a plan applied before sharding.

One spawn runs every case; the file takes about a minute on 2 cores.
"""

from __future__ import annotations

import models_for_tests as M
import pytest
import torch
from cli_helpers import assert_user_error, run
from fsdp_ranks import WORLD_SIZE, run_on_ranks

from planner.api import trace_for
from planner.config import TrainConfig
from planner.errors import InfeasibleBudget
from planner.simulation.fsdp import fsdp_buffers, fsdp_units, padded_bytes
from planner.simulation.step import simulate
from planner.solver.planning import solve

SHAPES = {"gpt_small": (2, 32), "llama_small": (2, 32), "resnet_small": (2, 16)}  # (batch, seq or side)
PEAK_CASES = [
    ("gpt", "gpt_small", {}),
    ("gpt-no-reshard", "gpt_small", {"reshard_after_forward": False}),
    ("llama", "llama_small", {}),
    ("llama-no-reshard", "llama_small", {"reshard_after_forward": False}),
    ("llama-bf16", "llama_small", {"mp_param_dtype": "bfloat16"}),
    ("resnet", "resnet_small", {}),
    ("resnet-no-reshard", "resnet_small", {"reshard_after_forward": False}),
]
PLAN_CASES = [("gpt-plan", "gpt_small"), ("llama-plan", "llama_small"), ("resnet-plan", "resnet_small")]
# Known gap, found when resnet_small widened to 16-32 channels (docs/safety.md): under FSDP2 with
# resharding after forward, rank 0's prediction is 2.5% (32,936 B: about two stage-1 activations)
# above the measured peak, with or without a plan. Strict: the test fails once the gap is closed.
RESNET_GAP = pytest.mark.xfail(strict=True, reason="FSDP2 resnet_small at 16-32 channels: predicted 2.5% high")
KNOWN_GAPS = {"resnet": RESNET_GAP, "resnet-plan": RESNET_GAP}
PLAN_FRACTION = 0.6  # budget: 60% of the way from model states to the no-plan peak, or the lowest reachable


def _config(builder: str, **fsdp) -> TrainConfig:
    batch_size, seq_len = SHAPES[builder]
    return TrainConfig(batch_size=batch_size, seq_len=seq_len, zero_stage=3, dp=WORLD_SIZE, **fsdp)


def _unit_paths(graph) -> list[str]:
    return [u.path for u in fsdp_units(graph, WORLD_SIZE)[:-1]]


@pytest.fixture(scope="module")
def runs():
    """Predictions and plans here, then every case on 2 ranks in one spawn."""
    cases, expected = [], {}
    for key, builder, fsdp in PEAK_CASES:
        config = _config(builder, **fsdp)
        graph = trace_for(f"{M.PATH}:{builder}", config)
        expected[key] = {"predicted": simulate(graph, config).peak_bytes}
        cases.append((key, builder, config, None, _unit_paths(graph)))
    for key, builder in PLAN_CASES:
        config = _config(builder)
        graph = trace_for(f"{M.PATH}:{builder}", config)
        base = simulate(graph, config)
        states = sum(base.model_states.values())
        budget = int(states + PLAN_FRACTION * (base.peak_bytes - states))
        try:
            plan = solve(graph, config, budget, time_limit_s=5.0)
        except InfeasibleBudget as e:  # FSDP2's buffers are out of the plan's reach: the tightest plan
            budget = e.smallest_peak_bytes
            plan = solve(graph, config, budget, time_limit_s=5.0)
        expected[key] = {"predicted": plan.predicted.peak_bytes, "budget": budget, "baseline": base.peak_bytes}
        cases.append((key, builder, config, plan.to_dict(), _unit_paths(graph)))
    measured = run_on_ranks(cases)
    return {key: {**expected[key], **measured[key]} for key in expected}


@pytest.mark.distributed
@pytest.mark.parametrize("key", [pytest.param(c[0], marks=KNOWN_GAPS.get(c[0], ())) for c in PEAK_CASES])
def test_per_rank_peak_matches_prediction(runs, key):
    if key.endswith("bf16") and not torch.backends.mkldnn.is_available():
        pytest.skip("this CPU has no bf16 kernels")
    r = runs[key]
    for rank, peak in enumerate(r["peaks"]):
        error = (r["predicted"] - peak) / peak
        assert abs(error) <= 0.01, f"{key} rank {rank}: predicted {r['predicted']}, measured {peak} ({error:+.2%})"


@pytest.mark.distributed
@pytest.mark.parametrize("key", [pytest.param(c[0], marks=KNOWN_GAPS.get(c[0], ())) for c in PLAN_CASES])
def test_plan_applied_before_sharding_holds_its_budget(runs, key):
    r = runs[key]
    assert r["budget"] < r["baseline"]
    for rank, peak in enumerate(r["peaks"]):
        assert peak <= 1.02 * r["budget"], f"{key} rank {rank}: measured {peak} over budget {r['budget']}"
        assert abs(r["predicted"] - peak) / peak <= 0.01, (
            f"{key} rank {rank}: predicted {r['predicted']}, measured {peak}"
        )
    assert r["grad_error"] == 0.0, f"{key}: gradients differ from one process (rel {r['grad_error']:.2e})"


# ----------------------------------------------------------------------------- the model, without ranks


@pytest.fixture(scope="module")
def tiny_graph():
    return trace_for("llama-7b-tiny", TrainConfig(batch_size=2, seq_len=16, zero_stage=3, dp=4))


def test_dim0_padding_to_a_multiple_of_dp():
    assert padded_bytes((5, 3), 4, 2) == 6 * 3 * 4
    assert padded_bytes((8,), 2, 4) == 8 * 2
    assert padded_bytes((), 4, 2) == 8


def test_units_are_the_blocks_then_the_root(tiny_graph):
    units = fsdp_units(tiny_graph, 4)
    assert [u.path for u in units] == [r.path for r in sorted(tiny_graph.regions, key=lambda r: r.fwd_start)] + [""]
    traced = sum(t.nbytes for t in tiny_graph.preexisting() if t.category == "parameter")
    assert sum(u.param_bytes for u in units) >= traced


def test_resharding_less_keeps_more(tiny_graph):
    config = TrainConfig(batch_size=2, seq_len=16, zero_stage=3, dp=4)
    peaks = [simulate(tiny_graph, config.with_(reshard_after_forward=r)).peak_bytes for r in (True, 2, False)]
    # an int N keeps a 1/N shard from forward to backward, where it is all-gathered from again
    assert peaks[0] <= peaks[1] and peaks[0] < peaks[2]
    assert fsdp_buffers(tiny_graph, config.with_(dp=1), 1.0) == {}


def test_cpu_offload_moves_model_states_to_the_host(tiny_graph):
    config = TrainConfig(batch_size=2, seq_len=16, zero_stage=3, dp=4)
    offloaded = simulate(tiny_graph, config.with_(cpu_offload=True))
    assert sum(offloaded.model_states.values()) == 0
    assert offloaded.peak_bytes < simulate(tiny_graph, config).peak_bytes


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"reshard_after_forward": False}, "--zero 3"),
        ({"zero_stage": 3, "dp": 4, "reshard_after_forward": 3}, "divisor of dp"),
        ({"zero_stage": 3, "mp_reduce_dtype": "int8"}, "mp reduce dtype"),
        ({"zero_stage": 3, "mp_param_dtype": "bfloat16", "precision": "fp16-mixed"}, "contradicts"),
    ],
)
def test_fsdp_options_are_checked(changes, needle):
    with pytest.raises(ValueError, match=needle):
        TrainConfig(**changes)


def test_fsdp_options_map_and_stay_out_of_default_configs():
    config = TrainConfig(zero_stage=3, dp=2, mp_param_dtype="bfloat16")
    assert config.precision == "bf16-mixed"
    assert "reshard_after_forward" not in TrainConfig(zero_stage=3, dp=2).to_dict()
    assert TrainConfig(zero_stage=3, dp=2, reshard_after_forward=False).to_dict()["reshard_after_forward"] is False


def test_cli_flags(capsys):
    code, out, _ = run(
        [
            "simulate",
            "--model",
            "llama-7b-tiny",
            "--seq-len",
            "16",
            "--zero",
            "3",
            "--dp",
            "4",
            "--reshard-after-forward",
            "2",
            "--mp-reduce-dtype",
            "float32",
        ],
        capsys,
    )
    assert code == 0
    code, _, err = run(["simulate", "--model", "llama-7b-tiny", "--seq-len", "16", "--cpu-offload"], capsys)
    assert_user_error(code, err, ("simulate",), "--zero 3")
