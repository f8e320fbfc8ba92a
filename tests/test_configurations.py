"""planner.analysis.configurations: the cheapest configuration that fits, by GPU-hours per million tokens."""

from __future__ import annotations

from functools import cache

import pytest
from models_for_tests import PATH

from costmodels.hardware import get_device
from planner.analysis.configurations import cheapest_configuration
from planner.api import trace_for
from planner.config import TrainConfig
from planner.simulation.step import simulate
from planner.simulation.step_time import host_offload_s

CONFIG = TrainConfig(batch_size=2, seq_len=256, gpu="a100-40gb")
SPEC = f"{PATH}:llama_small"


@cache
def graph(batch_size: int):
    return trace_for(SPEC, CONFIG.with_(batch_size=batch_size, zero_stage=3))


# Half of one GPU's no-plan peak: model states must be sharded or offloaded, or activations recomputed.
BUDGET = simulate(graph(2), CONFIG).peak_bytes // 2


@pytest.fixture(scope="module")
def report():
    return cheapest_configuration(graph, CONFIG, BUDGET, max_gpus=64, time_limit_s=2.0, micro_batches=1)


@pytest.mark.slow
def test_recommendation_is_the_fewest_gpu_hours_among_what_fits(report):
    fitting = [c for c in report.configurations if c.fits]
    assert fitting and report.recommended in fitting
    assert report.recommended.gpu_hours_per_million_tokens == min(c.gpu_hours_per_million_tokens for c in fitting)
    assert all(c.peak_bytes <= BUDGET for c in fitting)
    assert all(c.peak_bytes > BUDGET for c in report.configurations if not c.fits)


def test_every_dimension_is_searched(report):
    rows = report.configurations
    assert {c.optimizer for c in rows} == {"adamw", "adamw-8bit"}
    assert {c.cpu_offload for c in rows} == {False, True}
    assert {c.plan for c in rows} == {False, True}
    assert {(c.micro_batch, c.accumulation) for c in rows} == {(2, 1), (1, 2)}


def test_rates_follow_from_step_time(report):
    for c in report.configurations:
        assert c.tokens_per_s_per_gpu == pytest.approx(CONFIG.batch_size * CONFIG.seq_len / c.step_s)
        assert c.gpu_hours_per_million_tokens == pytest.approx(1e6 / (c.tokens_per_s_per_gpu * 3600))


def test_a_row_is_the_simulated_step():
    """Without a plan or offload, a row's peak and step time are the simulator's."""
    config = CONFIG.with_(zero_stage=3, dp=4)
    timeline = simulate(graph(2), config)
    report = cheapest_configuration(graph, CONFIG, BUDGET, max_gpus=4, time_limit_s=2.0, micro_batches=0)
    row = next(
        c for c in report.configurations if c.gpus == 4 and not c.plan and not c.cpu_offload and c.optimizer == "adamw"
    )
    assert row.peak_bytes == timeline.peak_bytes
    assert row.step_s == pytest.approx(timeline.costs.step_s)


def test_host_offload_time_counts_copies_and_the_host_step():
    config = CONFIG.with_(zero_stage=3, dp=8, cpu_offload=True)
    states = simulate(graph(2), config.with_(cpu_offload=False)).model_states  # what the host keeps
    device = get_device(config.gpu)
    expected = (2 * states["parameter"] + states["gradient"]) / device.host_link_bytes_per_s + 2 * sum(
        states.values()
    ) / 50e9
    assert host_offload_s(graph(2), config) == pytest.approx(expected)
    assert simulate(graph(2), config).model_states == {"parameter": 0, "gradient": 0, "optimizer": 0}


def test_gpu_counts_are_the_smallest_that_fit(report):
    """The first count of each combination fits and one fewer GPU does not (checked with full recompute)."""
    for c in report.configurations:
        if c.fits and c.gpus > 1 and c.gpus & (c.gpus - 1):  # not a power of two: found by bisection
            smaller = simulate(
                graph(c.micro_batch),
                CONFIG.with_(
                    batch_size=c.micro_batch,
                    zero_stage=3,
                    dp=c.gpus - 1,
                    optimizer=c.optimizer,
                    cpu_offload=c.cpu_offload,
                ),
            )
            assert smaller.peak_bytes > BUDGET or c.plan


def test_host_offload_needs_its_states_to_fit_in_a_gpus_share_of_host_memory(monkeypatch):
    """On one GPU at half the budget only host offload with a plan fits the GPU. Its offloaded
    states must also fit a GPU's share of host memory (fit recommended 1.85 TiB of host memory per
    GPU for llama-405b on 2 H100s); where only host memory binds, the recommendation line says so."""
    import planner.analysis.configurations as configurations
    from planner.cli.report import configurations_table

    def search():
        return cheapest_configuration(graph, CONFIG, BUDGET // 2, max_gpus=1, time_limit_s=2.0, micro_batches=0)

    free = search()
    best = free.recommended
    assert best is not None and best.cpu_offload and best.plan and best.host_bytes > 0
    monkeypatch.setattr(configurations, "HOST_MEMORY_BYTES_PER_GPU", best.host_bytes)
    assert search().recommended == best  # a limit it meets
    monkeypatch.setattr(configurations, "HOST_MEMORY_BYTES_PER_GPU", best.host_bytes - 1)
    bound = search()
    assert bound.recommended is None or bound.recommended.host_bytes < best.host_bytes
    assert all(not c.fits for c in bound.configurations if c.host_bytes >= best.host_bytes)
    monkeypatch.setattr(configurations, "HOST_MEMORY_BYTES_PER_GPU", 0)
    none = search()
    assert none.recommended is None
    assert "host offload fits the GPU on 1 GPU but needs" in configurations_table(none, 5).splitlines()[-1]
