"""`fit --layouts`: the whole-layout search (planner/analysis/layouts.py) and its step time
(planner/simulation/step_time.py), on a small Llama with budgets that force several GPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import run

from planner.analysis.layouts import search_layouts
from planner.api import simulate_layout, simulate_model
from planner.config import TrainConfig

SPEC = "llama-70b-tiny"  # 4 blocks, 16 query / 2 key-value heads: tp 1 and 2, pp up to 2
CONFIG = TrainConfig(batch_size=1, seq_len=64, gpu="h100-80gb")
MiB = 2**20
REQUIRED = (
    "gpus tp pp dp cp ep schedule microbatches stages_per_rank optimizer offload "
    "step_time_s tokens_per_s_per_gpu mfu peak_bytes"
).split()


def _simulates_to_its_peak(x, spec: str, tmp_path, capsys, *gpu: str) -> None:
    """The layout's flags, through `memplan simulate`, give its peak to the byte."""
    out = tmp_path / "rank.json"
    argv = ["simulate", "--model", spec, "--seq-len", "64", *gpu, *x.flags().split(), "--json", str(out)]
    code, _, err = run(argv, capsys)
    assert code == 0, err
    assert json.loads(out.read_text())["peak_bytes"] == x.peak_bytes, x.flags()


@pytest.fixture(scope="module")
def search():
    return search_layouts(
        SPEC, CONFIG, max_gpus=16, budget_bytes=6 * MiB, global_batch=32, allow_offload=False, allow_8bit=False
    )


def _config_of(x) -> TrainConfig:
    """The layout as memplan's flags give it."""
    c = CONFIG.with_(
        tp=x.tp, dp=x.dp, zero_stage=3, optimizer=x.optimizer, cpu_offload=x.offload, grad_accum_steps=x.accumulation
    )
    if x.pp == 1:
        return c
    return c.with_(
        pp=x.pp,
        pp_schedule=x.schedule,
        microbatches=x.microbatches,
        stages_per_rank=x.stages_per_rank,
        batch_size=x.microbatches,
        reshard_after_forward=False,
    )


def test_recommended_is_the_fewest_gpus_that_fit_and_the_fastest_on_them(search):
    best = search.recommended
    assert best is not None and best.fits and best.peak_bytes <= 6 * MiB
    assert best.gpus > 1  # one GPU cannot hold it under this budget
    assert not any(x.fits and x.gpus < best.gpus for x in search.layouts)
    same = [x for x in search.layouts if x.fits and x.gpus == best.gpus]
    assert best.tokens_per_s_per_gpu == max(x.tokens_per_s_per_gpu for x in same)


def test_layout_peaks_are_what_simulate_says_for_the_same_flags(search):
    checked = 0
    for x in search.layouts:
        if x.recompute != "none" or checked >= 4:
            continue
        config = _config_of(x)
        exact = simulate_layout(SPEC, config) if x.tp > 1 or x.pp > 1 else simulate_model(SPEC, config)
        assert exact.peak_bytes == x.peak_bytes, x.label
        checked += 1
    assert checked >= 2
    assert {x.pp for x in search.layouts} >= {1, 2} and {x.tp for x in search.layouts} >= {1, 2}


@pytest.mark.slow  # 20 s; the fast tier checks layout peaks against simulate (the test above)
def test_recipe_check_line_simulates_the_layout(search, tmp_path, capsys):
    """The recipe's `memplan simulate` line (its flags, --strategy included) gives the layout's peak."""
    picked = {}
    for x in search.layouts:  # one pipeline and one data-parallel layout per recompute level
        picked.setdefault((x.recompute, x.pp > 1, x.tp > 1), x)
    assert {r for r, _, _ in picked} >= {"none", "full"}
    for x in picked.values():
        _simulates_to_its_peak(x, SPEC, tmp_path, capsys, "--gpu", "h100-80gb")


def test_pareto_front_trades_gpus_for_time(search):
    front = search.pareto
    assert front and front[0].gpus == search.recommended.gpus
    for a, b in zip(front, front[1:]):
        assert a.gpus < b.gpus and b.time.step_s < a.time.step_s


def test_step_time_parts_add_up_and_rates_follow(search):
    for x in search.layouts:
        t = x.time
        parts = t.compute_s + t.exposed_communication_s + t.bubble_s + t.recompute_s + t.optimizer_s + t.offload_s
        assert parts == pytest.approx(t.step_s, rel=1e-9)
        assert x.tokens_per_s_per_gpu == pytest.approx(x.global_batch * x.seq_len / (t.step_s * x.gpus))
        assert 0 < x.mfu < 1
        if x.pp == 1:
            assert t.bubble_s == 0
        if x.tp > 1:
            assert t.exposed_communication_s > 0  # sequence parallel's gathers and scatters


def test_more_microbatches_per_pipeline_step_shrink_the_bubble():
    from costmodels.hardware import get_device
    from planner.simulation.pipeline import simulate_pipeline
    from planner.simulation.step_time import pipeline_step_time
    from planner.tracing.parallel.rank_trace import trace_tp_rank

    graph = trace_tp_rank(SPEC, CONFIG.with_(tp=2, zero_stage=3), rank=0)[0]
    rows = []
    for m in (2, 8):
        config = CONFIG.with_(tp=2, pp=2, microbatches=m, batch_size=m, dp=2, zero_stage=3, reshard_after_forward=False)
        pipeline = simulate_pipeline(graph, config)
        rows.append((pipeline_step_time(graph, config, pipeline, get_device(CONFIG.gpu)), pipeline.peak_bytes))
    (few, few_peak), (many, many_peak) = rows
    assert many.bubble_s / many.step_s < few.bubble_s / few.step_s
    assert many_peak > few_peak  # each microbatch of a step keeps a receive buffer (torch's pipelining)


def test_pinned_degrees_are_kept():
    r = search_layouts(SPEC, CONFIG.with_(tp=2), max_gpus=8, budget_bytes=6 * MiB, global_batch=32, allow_offload=False)
    assert r.layouts and all(x.tp == 2 for x in r.layouts)


@pytest.mark.slow  # 7 s: a whole search
def test_the_search_gives_the_garbage_collector_back_what_it_froze():
    import gc

    r = search_layouts(SPEC, CONFIG, max_gpus=4, budget_bytes=6 * MiB, global_batch=32, allow_offload=False)
    assert r.layouts and gc.get_freeze_count() == 0
    gc.freeze()  # a caller that keeps objects frozen itself keeps them, and the search moves nothing
    try:
        frozen = gc.get_freeze_count()
        search_layouts(SPEC, CONFIG, max_gpus=4, budget_bytes=MiB, global_batch=32, allow_offload=False)
        # not given back, and nothing new frozen (frozen objects may still die by reference count)
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_nothing_fits_says_what_binds_in_one_line():
    r = search_layouts(SPEC, CONFIG, max_gpus=4, budget_bytes=MiB, global_batch=32, allow_offload=False)
    assert r.recommended is None and r.why_none
    assert "\n" not in r.why_none and "raise --max-gpus" in r.why_none


def _small_gpu(tmp_path, memory_bytes: int) -> str:
    from dataclasses import asdict

    from costmodels.hardware import get_device

    device = {**asdict(get_device("h100-80gb")), "name": "small", "memory_bytes": memory_bytes}
    path = tmp_path / "small.json"
    path.write_text(json.dumps({"format": "memplan-device-profile/1", "device": device, "measured": {}}))
    return str(path)


def test_cli_json_and_recipe(tmp_path, capsys):
    gpu = _small_gpu(tmp_path, 7 * MiB)
    out = tmp_path / "layouts.json"
    args = ["fit", "--model", SPEC, "--seq-len", "64", "--gpu", gpu, "--layouts", "--max-gpus", "16"]
    code, stdout, err = run([*args, "--global-batch", "32", "--no-offload", "--json", str(out)], capsys)
    assert code == 0, err
    assert "recommended:" in stdout and "torchrun --nnodes 1" in stdout and "[parallelism]" in stdout
    payload = json.loads(out.read_text())
    assert payload["layouts"] and payload["recommended"]
    for row in payload["layouts"]:
        assert all(k in row for k in REQUIRED)
    rec = payload["recommended"]
    assert rec["fits"] and 0 < rec["mfu"] < 1
    assert payload["recipe"]["memplan"].startswith(
        f"memplan {'plan' if rec['recompute'] == 'plan' else 'simulate'} --model {SPEC} --seq-len 64"
    )


@pytest.mark.slow  # 4 s; test_nothing_fits_says_what_binds_in_one_line stays fast
def test_cli_what_binds(tmp_path, capsys):
    gpu = _small_gpu(tmp_path, MiB)
    code, stdout, err = run(
        ["fit", "--model", SPEC, "--seq-len", "64", "--gpu", gpu, "--layouts", "--max-gpus", "4", "--no-offload"],
        capsys,
    )
    assert code == 0, err
    line = next(s for s in stdout.splitlines() if s.startswith("no layout fits"))
    assert "raise --max-gpus" in line


@pytest.mark.slow  # 4 s; test_pinned_degrees_are_kept keeps pinned degrees in the fast tier
def test_cli_pinned_pp_searches_layouts_with_it(tmp_path, capsys):
    gpu = _small_gpu(tmp_path, 7 * MiB)
    out = tmp_path / "layouts.json"
    argv = ["fit", "--model", SPEC, "--seq-len", "64", "--gpu", gpu, "--pp", "2", "--max-gpus", "8"]
    code, _, err = run([*argv, "--global-batch", "32", "--no-offload", "--json", str(out)], capsys)
    assert code == 0, err
    rows = json.loads(out.read_text())["layouts"]
    assert rows and all(row["pp"] == 2 for row in rows)


def test_torchtitan_recipe_runs_the_layouts_batches(search):
    """torchtitan accumulates global / (local x dp) steps: the recipe's local batch must give the
    layout's accumulation steps, and its pipeline microbatches the layout's."""
    import tomllib

    from planner.analysis.layouts import launch_recipe

    for x in search.layouts:
        toml = tomllib.loads(launch_recipe(x, SPEC, 8, CONFIG)["torchtitan_toml"])
        local, dp = toml["training"]["local_batch_size"], toml["parallelism"]["data_parallel_shard_degree"]
        assert toml["training"]["global_batch_size"] // (local * dp) == x.accumulation
        if x.pp > 1:
            assert local // toml["parallelism"]["pipeline_parallel_microbatch_size"] == x.microbatches


@pytest.mark.parametrize(
    ("pinned", "needle"),
    [
        (["--tp", "3"], "powers of two"),
        (["--pp", "64"], "two blocks a stage"),
        (["--tp", "16", "--gpus-per-node", "8"], "tensor parallel stays in a node"),
        (["--pp", "2", "--microbatches", "4"], "chooses --microbatches"),
        (["--layouts", "--gpus", "8"], "--gpus"),
    ],
)
def test_cli_pins_it_cannot_search_are_one_line(capsys, pinned, needle):
    from cli_helpers import assert_user_error

    code, _, err = run(["fit", "--model", SPEC, "--seq-len", "64", "--gpu", "h100-80gb", *pinned], capsys)
    assert_user_error(code, err, "fit", needle)


MIXTRAL = f"hf:{Path(__file__).parent / 'data' / 'tiny_mixtral' / 'config.json'}"


@pytest.mark.slow
def test_a_mixture_of_experts_searches_expert_parallel(tmp_path, capsys):
    """A MoE's layouts include expert parallel over the data-parallel ranks (FSDP2 on the rest);
    `--ep N` pins it, and the recipe's check line gives a layout's peak to the byte."""
    mixtral = TrainConfig(batch_size=2, seq_len=64)
    found = search_layouts(MIXTRAL, mixtral, max_gpus=4, budget_bytes=2**30, global_batch=16)
    assert {x.ep for x in found.layouts} >= {1, 2, 4} and all(x.dp % x.ep == 0 for x in found.layouts)
    pinned = search_layouts(MIXTRAL, mixtral.with_(dp=2, ep=2), max_gpus=4, budget_bytes=2**30, global_batch=16)
    assert pinned.layouts and {x.ep for x in pinned.layouts} == {2}
    _simulates_to_its_peak(max(pinned.layouts, key=lambda x: x.peak_bytes), MIXTRAL, tmp_path, capsys)


@pytest.mark.slow
def test_a_mixture_of_experts_searches_expert_parallel_inside_pipelines(tmp_path, capsys):
    """EP borrows each stage's data-parallel ranks: a 4-layer Mixtral's layouts include pp 2 × ep 2,
    and such a layout's flags simulate to its peak through the CLI, to the byte."""
    config = json.loads((Path(MIXTRAL[3:])).read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    spec = f"hf:{tmp_path / 'config.json'}"
    found = search_layouts(spec, TrainConfig(batch_size=2, seq_len=64), max_gpus=4, budget_bytes=2**30, global_batch=16)
    both = [x for x in found.layouts if x.pp > 1 and x.ep > 1]
    assert both and all(x.dp % x.ep == 0 for x in both)
    _simulates_to_its_peak(max(both, key=lambda x: x.peak_bytes), spec, tmp_path, capsys)


@pytest.mark.slow
def test_a_pinned_tp_searches_expert_parallel_with_tensor_parallel(tmp_path, capsys):
    """`--tp 2` on a torchtitan-style MoE: its expert-parallel layouts run at tp 2 (experts over ep,
    their hidden dimension over tp), and one's flags simulate to its peak, to the byte."""
    spec = f"{Path(__file__).parent / 'ep_models.py'}:titan_moe"
    config = TrainConfig(batch_size=2, seq_len=64, tp=2, gpu="h100-80gb")
    found = search_layouts(spec, config, max_gpus=8, budget_bytes=2**30, global_batch=16)
    experts = [x for x in found.layouts if x.ep > 1]
    assert experts and all(x.tp == 2 and x.dp % x.ep == 0 for x in found.layouts)
    _simulates_to_its_peak(max(experts, key=lambda x: x.peak_bytes), spec, tmp_path, capsys, "--gpu", "h100-80gb")


@pytest.mark.slow
def test_expert_parallel_takes_tensor_parallel_where_it_alone_does_not_fit(tmp_path, capsys):
    """Unpinned, tensor parallel joins expert parallel on a GPU count where no EP layout at tp 1 fits
    (AdamW states, no host offload: on 4 GPUs tp1 × ep4 peaks at 3.70 MB over a 3.5 MB budget);
    tp2 × ep2 fits there, and its flags simulate to its peak, to the byte. Where EP at tp 1 fits,
    no (tp, ep) pair is traced."""
    spec = f"{Path(__file__).parent / 'ep_models.py'}:titan_moe"
    config = TrainConfig(batch_size=2, seq_len=64, gpu="h100-80gb")
    kw = dict(max_gpus=8, global_batch=16, allow_offload=False, allow_8bit=False)
    tight = search_layouts(spec, config, budget_bytes=3_500_000, **kw)
    assert not any(x.fits and x.ep > 1 for x in tight.layouts if x.gpus == 4 and x.tp == 1)
    both = [x for x in tight.layouts if x.tp > 1 and x.ep > 1]
    assert both and all(x.gpus == 4 for x in both) and any(x.fits for x in both)
    _simulates_to_its_peak(max(both, key=lambda x: x.peak_bytes), spec, tmp_path, capsys, "--gpu", "h100-80gb")
    roomy = search_layouts(spec, config, budget_bytes=2**30, **kw)
    assert {x.ep for x in roomy.layouts} > {1} and not any(x.tp > 1 and x.ep > 1 for x in roomy.layouts)


def test_a_plan_that_cannot_run_sequence_parallel_is_searched_without_it(tmp_path, capsys):
    """transformers' GPT-2 ships no plan, and memplan's cannot shard its sequence (GPT-2 reads its
    positions from the embedding's output): fit's tensor-parallel layouts run without sequence
    parallel, and the recipe's check line says --no-sp and gives each layout's peak."""
    spec = f"hf:{Path(__file__).parent / 'data' / 'tiny_gpt2' / 'config.json'}"
    config = CONFIG.with_(batch_size=2, tp=2, loss_parallel=False)
    found = search_layouts(spec, config, max_gpus=4, budget_bytes=2**30, global_batch=8, allow_offload=False)
    assert found.layouts and all(x.tp == 2 and not x.sequence_parallel for x in found.layouts)
    x = found.layouts[0]
    assert "--tp 2 --no-sp" in x.flags()
    out = tmp_path / "rank.json"
    argv = ["simulate", "--model", spec, "--seq-len", "64", "--gpu", "h100-80gb", "--no-loss-parallel"]
    code, _, err = run([*argv, *x.flags().split(), "--json", str(out)], capsys)
    assert code == 0, err
    assert json.loads(out.read_text())["peak_bytes"] == x.peak_bytes
