"""Pipeline parallel: torch's schedules as action lists, the stage split, per-rank simulation, timing, CLI,
and (marked distributed) predicted against measured peaks on 2 gloo ranks."""

from __future__ import annotations

import json

import pytest
from cli_helpers import assert_user_error, run

from planner.config import PP_SCHEDULES, V_SHAPED_SCHEDULES, TrainConfig
from planner.errors import MemplanError
from planner.simulation.pipeline import max_in_flight, simulate_pipeline
from planner.simulation.pipeline_schedule import pipeline_schedule
from planner.simulation.pipeline_split import blocks_per_stage, cut_stages
from planner.simulation.pipeline_time import pipeline_time
from planner.tracing.recorder import trace

MULTI = ("interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble")


def _config(schedule: str, pp: int = 2, microbatches: int = 4, seq_len: int = 32, **kw) -> TrainConfig:
    v = 2 if schedule in MULTI else None
    return TrainConfig(
        batch_size=microbatches,
        seq_len=seq_len,
        pp=pp,
        pp_schedule=schedule,
        microbatches=microbatches,
        stages_per_rank=v,
        **kw,
    )


@pytest.mark.parametrize("schedule", list(PP_SCHEDULES))
def test_every_schedule_runs_each_microbatch_once_per_stage(schedule):
    s = pipeline_schedule(_config(schedule))
    for rank in range(s.pp):
        stages = s.stages(rank)
        want = (
            (rank, 2 * s.pp - 1 - rank)
            if schedule in V_SHAPED_SCHEDULES
            else tuple(rank + k * s.pp for k in range(s.num_stages // s.pp))
        )
        assert stages == tuple(sorted(want))
        acts = s.compute(rank)
        for stage in stages:
            for mb in range(s.microbatches):
                kinds = sorted(a.kind for a in acts if a.stage == stage and a.microbatch == mb)
                assert kinds in (["B", "F"], ["F", "I", "W"]), (stage, mb, kinds)


def test_one_f_one_b_holds_pp_minus_rank_microbatches_and_gpipe_all():
    one_f = pipeline_schedule(_config("1f1b"))
    gpipe = pipeline_schedule(_config("gpipe"))
    assert [max_in_flight(one_f, r) for r in range(2)] == [2, 1]
    assert [max_in_flight(gpipe, r) for r in range(2)] == [4, 4]
    # 1F1B's loop drops stage 0's first send request late (its send_work outlives the warm-up)
    assert one_f.released_after(0, 0, "F", 0) > [str(a) for a in one_f.compute(0)].index("0B0")


def test_single_stage_loop_keeps_each_output_until_the_next_forward_returns():
    """torch's GPipe and 1F1B loops hold the last forward's output in a local: under 1F1B the last
    stage's output of microbatch i lives until F of i + 1, past its own backward; the last one
    until the loop ends. The multi-stage runtime drops it with the action (None)."""
    schedule = pipeline_schedule(_config("1f1b"))
    actions = schedule.compute(1)
    forward = {a.microbatch: k for k, a in enumerate(actions) if a.kind == "F"}
    released = [schedule.output_released_after(1, 1, mb) for mb in range(4)]
    assert released == [forward[1], forward[2], forward[3], len(actions) - 1]
    assert pipeline_schedule(_config("interleaved-1f1b")).output_released_after(0, 0, 0) is None


def test_fsdp2_stages_resharding_after_forward_predict_the_bytes_gloo_ranks_measured():
    """The FSDP2 stage model, checked in the fast tier against what
    test_fsdp2_stages_match_gloo_ranks measured on 4 gloo ranks (pp rank 0 / 1): interleaved 1F1B
    (UNSHARD, a REDUCE_GRAD per stage mid-step, all-gather outputs, copy-outs) and 1F1B (the last
    stage's logits held by the loop), reshard_after_forward true, within 64 B."""
    from pp_ranks import PATH

    graph = trace(f"{PATH}:titan_llama", batch_size=1, seq_len=128, gathered_params=True)
    measured = {"interleaved-1f1b": (14_806_092, 11_983_716), "1f1b": (12_033_100, 9_243_492)}
    for schedule, peaks in measured.items():
        config = _config(schedule, seq_len=128, dp=2, zero_stage=3, reshard_after_forward=True)
        predicted = [r.peak_bytes for r in simulate_pipeline(graph, config).layout.roles]
        assert all(abs(p - m) <= 64 for p, m in zip(predicted, peaks, strict=True)), (schedule, predicted)


@pytest.mark.parametrize(
    ("schedule", "pp", "microbatches", "needle"),
    [("1f1b", 4, 2, "Number of microbatches (2)"), ("dualpipev", 4, 4, "DualPipeV requires")],
)
def test_schedule_torch_refuses_is_one_line(schedule, pp, microbatches, needle):
    with pytest.raises(MemplanError, match="torch refuses it") as info:
        pipeline_schedule(_config(schedule, pp=pp, microbatches=microbatches))
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_uniform_split_gives_earlier_stages_the_remainder():
    assert blocks_per_stage(10, 4) == (3, 3, 2, 2)
    assert blocks_per_stage(8, 4, "1,3,2,2") == (1, 3, 2, 2)
    for split, needle in [("3,3,3,3", "adds up to 12"), ("8", "names 1 stages")]:
        with pytest.raises(MemplanError, match=needle):
            blocks_per_stage(8, 4, split)
    with pytest.raises(MemplanError, match="too few"):
        blocks_per_stage(2, 4)


def test_cuts_cover_every_op_once():
    g = trace("llama-70b-tiny", batch_size=1, seq_len=32)
    cuts = cut_stages(g, (1, 2, 1))
    covered = sorted(i for c in cuts for i in [*range(c.fwd_start, c.fwd_end), *range(c.bwd_start, c.bwd_end)])
    assert covered == list(range(len(g.ops)))
    assert cuts[0].fwd_start == 0 and cuts[-1].fwd_end == g.backward_start and cuts[0].bwd_end == len(g.ops)


@pytest.fixture(scope="module")
def tiny_graph():
    return trace("llama-70b-tiny", batch_size=1, seq_len=64)


@pytest.mark.parametrize("schedule", list(PP_SCHEDULES))
def test_simulate_pipeline_every_schedule(tiny_graph, schedule):
    config = _config(schedule, dp=2, zero_stage=3)
    result = simulate_pipeline(tiny_graph, config)
    d = result.to_dict(max_points=50)
    assert len(d["ranks"]) == 2
    assert [r["ranks"] for r in d["ranks"]] == [[0, 1], [2, 3]]  # mesh [pp, dp]
    assert d["peak_bytes"] == max(r["peak_bytes"] for r in d["ranks"])
    assert d["worst_stage"] == d["ranks"][d["pipeline"]["worst_pp_rank"]]["stage"]
    assert 0.0 <= d["pipeline"]["bubble_fraction"] < 1.0
    for role in result.layout.roles:
        assert sum(role.timeline.breakdown_at_peak.values()) == role.peak_bytes


def test_first_stage_of_one_f_one_b_holds_more(tiny_graph):
    gpipe = simulate_pipeline(tiny_graph, _config("gpipe"))
    one_f = simulate_pipeline(tiny_graph, _config("1f1b"))
    assert one_f.layout.roles[0].peak_bytes > one_f.layout.roles[1].peak_bytes
    assert gpipe.layout.roles[0].peak_bytes > one_f.layout.roles[0].peak_bytes


def test_auto_split_lowers_the_worst_peak():
    g = trace("llama-13b-tiny", batch_size=1, seq_len=256)
    base = dict(batch_size=4, seq_len=256, pp=3, pp_schedule="1f1b", microbatches=4)
    uniform = simulate_pipeline(g, TrainConfig(**base))
    auto = simulate_pipeline(g, TrainConfig(**base, pp_split="auto"))
    assert sum(auto.blocks_per_stage) == 3 and min(auto.blocks_per_stage) >= 1
    assert auto.peak_bytes <= uniform.peak_bytes


def test_gpipe_bubble_is_p_minus_one_over_m_plus_p_minus_one():
    pp, m = 4, 8
    s = pipeline_schedule(_config("gpipe", pp=pp, microbatches=m))
    t = pipeline_time(s, {"F": (1.0,) * pp, "B": (2.0,) * pp, "I": (1.0,) * pp, "W": (1.0,) * pp})
    assert t.step_s == pytest.approx((m + pp - 1) * 3.0)
    assert t.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))


def test_simulate_cli_pipeline_json(tmp_path, capsys):
    p = tmp_path / "pp.json"
    argv = ["simulate", "--model", "llama-70b-tiny", "--seq-len", "32", "--batch-size", "4", "--pp", "2"]
    code, out, err = run(
        [*argv, "--pp-schedule", "interleaved-1f1b", "--stages-per-rank", "2", "--json", str(p)], capsys
    )
    assert code == 0, err
    assert "pipeline interleaved-1f1b" in out
    d = json.loads(p.read_text())
    assert [r["stage"] for r in d["ranks"]] == [[0, 2], [1, 3]]


def test_simulate_cli_pipeline_with_tensor_parallel(tmp_path, capsys):
    """--tp 2 --pp 2: each stage's ranks are a tensor-parallel group (mesh [pp, dp, cp, tp]) holding
    about half the stage's parameters, and a stage's peak drops by about half."""
    argv = ["simulate", "--model", "llama-70b-tiny", "--seq-len", "32", "--batch-size", "4", "--pp", "2"]
    stages = {}
    for tp in (1, 2):
        p = tmp_path / f"tp{tp}.json"
        code, _, err = run([*argv, "--tp", str(tp), "--json", str(p)], capsys)
        assert code == 0, err
        stages[tp] = json.loads(p.read_text())["ranks"]
    assert [r["ranks"] for r in stages[2]] == [[0, 1], [2, 3]]
    for whole, sharded in zip(stages[1], stages[2], strict=True):
        params = whole["breakdown_at_peak"]["parameter"], sharded["breakdown_at_peak"]["parameter"]
        assert params[0] / 2 <= params[1] < 0.6 * params[0]  # norms stay replicated
        assert sharded["peak_bytes"] < 0.6 * whole["peak_bytes"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--microbatches", "1", "--batch-size", "1"], "Number of microbatches (1)"),
        (["--pp-split", "3,2"], "adds up to 5"),
        (["--pp-schedule", "nope"], "unknown --pp-schedule"),
        (["--pp", "8"], "too few"),
    ],
)
def test_simulate_cli_pipeline_errors(capsys, extra, needle):
    argv = ["simulate", "--model", "llama-70b-tiny", "--seq-len", "32", "--batch-size", "8", "--pp", "2"]
    code, _, err = run([*argv, *extra], capsys)
    assert_user_error(code, err, "simulate", needle)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--precision", "bf16-mixed"], "fp32 or bf16"),
        (["--dp", "2"], "add --zero 3"),
        (["--tp", "2"], "drop --tp, --cp and --ep"),
    ],
)
def test_verify_pipeline_refusals_are_one_line(capsys, extra, needle):
    argv = ["verify", "--model", "llama-70b-tiny", "--seq-len", "32", "--batch-size", "4", "--pp", "2"]
    code, _, err = run([*argv, *extra], capsys)
    assert_user_error(code, err, "verify", needle)


def test_verify_pipeline_refuses_custom_autograd_functions(capsys):
    """torch's pipeline tracer inlines a custom autograd Function into its forward's ops, which save
    more than the Function does (Bloom's traced stages measured 44% more than predicted for its
    eager ones): refused before any rank starts, naming the Function."""
    argv = ["verify", "--model", "tests/models_for_tests.py:custom_function", "--seq-len", "32", "--batch-size", "4"]
    code, _, err = run([*argv, "--pp", "2"], capsys)
    assert_user_error(code, err, "verify", "custom autograd Functions (_SquaredTanh)", "your own stage modules")


@pytest.mark.parametrize(  # one split and one whole backward in the fast tier (4-5 s each)
    "schedule",
    [s if s == "zbv-zero-bubble" else pytest.param(s, marks=pytest.mark.slow) for s in PP_SCHEDULES],
)
def test_split_backward_with_fsdp2_resharding_is_warned_in_simulate_and_refused_by_verify(tmp_path, capsys, schedule):
    """Only the schedules that split a stage's backward (I, then W) under FSDP2 resharding after
    forward get the warning (simulate's text and JSON) and verify's one-line refusal; resharding
    after forward false, or no FSDP2, gets neither."""
    v = "2" if schedule in (*MULTI, *V_SHAPED_SCHEDULES) else "1"
    argv = ["--model", "llama-70b-tiny", "--seq-len", "32", "--batch-size", "4", "--pp", "2", "--microbatches", "4"]
    argv += ["--pp-schedule", schedule, "--stages-per-rank", v, "--gpu", "cpu"]
    split = schedule in ("interleaved-zero-bubble", "zbv-zero-bubble", "dualpipev")
    for extra, warned in (
        (["--dp", "2", "--zero", "3"], split),
        (["--dp", "2", "--zero", "3", "--reshard-after-forward", "false"], False),
        ([], False),
    ):
        out = tmp_path / "sim.json"
        code, text, err = run(["simulate", *argv, *extra, "--json", str(out)], capsys)
        assert code == 0, err
        assert ("warning: torch's" in text) == warned, (extra, text)
        assert bool(json.loads(out.read_text())["pipeline"]["warnings"]) == warned
        if warned:
            code, _, err = run(["verify", *argv, *extra], capsys)
            assert_user_error(code, err, "verify", "--reshard-after-forward false")


def test_a_weight_tied_across_stages_has_a_gradient_on_each():
    """GPT-2's head is tied to its embeddings: the whole-model trace accumulates the head's gradient
    (last stage) into the embeddings' (stage 0) with one add. Each stage holds its own copy, so
    each keeps the gradient its backward makes, and no stage makes the sum."""
    from planner.simulation.pipeline_split import op_stages, tied_gradients

    graph = trace("gpt2-tiny", batch_size=2, seq_len=32)
    stage_of, in_bwd = op_stages(graph, cut_stages(graph, blocks_per_stage(len(graph.regions), 2)))
    own, sums = tied_gradients(graph, stage_of, in_bwd)
    vocab_table = 256 * 64 * 4
    assert [graph.tensors[t].nbytes for t in sums] == [vocab_table]
    assert sorted(int(stage_of[graph.tensors[t].alloc_op]) for t in own) == [0, 1]
    untied = trace("llama-7b-tiny", batch_size=2, seq_len=32)
    stage_of, in_bwd = op_stages(untied, cut_stages(untied, blocks_per_stage(len(untied.regions), 2)))
    assert tied_gradients(untied, stage_of, in_bwd) == (frozenset(), frozenset())


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-7b-tiny", "tests/pp_ranks.py:hf_llama", "gpt2-tiny"])
def test_verify_pipeline_cli_measures_every_pp_rank(tmp_path, capsys, model):
    """`memplan verify --pp 2` cuts any model with torch's pipeline tracer where the simulation cuts it
    and measures each pp rank on gloo: within 2% of the prediction (the traced stages send what
    crosses a cut, e.g. rotary tables, where torchtitan's stages recompute it), under a stage plan too.
    GPT-2's head, tied to its embeddings, is a copy on each end of the pipeline (the traced stage 0
    drops the copy of the head it never runs)."""
    base = ["--model", model, "--seq-len", "64", "--batch-size", "4", "--pp", "2", "--pp-schedule", "1f1b"]
    plan = tmp_path / "plan.json"
    code, _, err = run(["plan", *base, "--budget", "95%", "--out", str(plan)], capsys)
    assert code == 0, err
    for extra in ([], ["--plan", str(plan)]):
        out = tmp_path / "verify.json"
        code, _, err = run(["verify", *base, *extra, "--json", str(out)], capsys)
        assert code == 0, err
        (result,) = json.loads(out.read_text())["results"]
        assert len(result["measured_bytes"]) == 2
        assert all(abs(e) < 0.02 for e in result["errors"]), result


@pytest.mark.distributed
@pytest.mark.slow
def test_verify_pipeline_with_fsdp2_measures_every_rank_of_the_mesh(tmp_path, capsys):
    """`memplan verify --pp 2 --dp 2 --zero 3` on 4 gloo ranks (mesh [pp, dp]): the traced stages
    fully_shard per block, then per stage, over dp (torchtitan's pipeline with FSDP2, which keeps
    blocks gathered from forward to backward). Every rank within 2% of its prediction, under 1F1B
    and under ZBV (split backward, torch's multi-stage runtime with its UNSHARD/RESHARD actions)."""
    base = ["verify", "--model", "llama-70b-tiny", "--seq-len", "64", "--batch-size", "4", "--pp", "2"]
    base += ["--dp", "2", "--zero", "3", "--reshard-after-forward", "false", "--microbatches", "4"]
    for schedule, stages_per_rank in (("1f1b", "1"), ("zbv-zero-bubble", "2")):
        out = tmp_path / f"{schedule}.json"
        extra = ["--pp-schedule", schedule, "--stages-per-rank", stages_per_rank, "--json", str(out)]
        code, _, err = run([*base, *extra], capsys)
        assert code == 0, err
        (result,) = json.loads(out.read_text())["results"]
        assert len(result["measured_bytes"]) == 4
        assert result["predicted_bytes"][0] == result["predicted_bytes"][1] != result["predicted_bytes"][2]
        assert all(abs(e) < 0.02 for e in result["errors"]), (schedule, result)


@pytest.mark.distributed
@pytest.mark.slow
def test_verify_pipeline_with_fsdp2_holds_a_tied_weight_per_stage(tmp_path, capsys):
    """GPT-2's tied head under a pipeline with FSDP2: each stage holds its copy's unsharded gradient
    until its reduce (torch's pipelining runs FSDP2 without sync), and no stage the whole-model
    trace's sum of the two. Every rank within 1% (stage 0 was 2.1% over)."""
    out = tmp_path / "verify.json"
    argv = ["verify", "--model", "gpt2-tiny", "--seq-len", "32", "--batch-size", "4", "--pp", "2"]
    argv += ["--microbatches", "2", "--dp", "2", "--zero", "3", "--reshard-after-forward", "false"]
    code, _, err = run([*argv, "--json", str(out)], capsys)
    assert code == 0, err
    (result,) = json.loads(out.read_text())["results"]
    assert all(abs(e) < 0.01 for e in result["errors"]), result


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "model, schedule, pp, stages_per_rank, tolerance",
    [
        ("llama-70b-tiny", "interleaved-1f1b", 2, 2, 0.02),
        ("llama-70b-tiny", "dualpipev", 2, 2, 0.02),
        ("llama-70b-tiny", "looped-bfs", 4, 1, 0.02),
        ("tests/pp_ranks.py:hf_llama", "zbv-zero-bubble", 2, 2, 0.03),
    ],
)
def test_verify_pipeline_runs_multi_stage_schedules(tmp_path, capsys, model, schedule, pp, stages_per_rank, tolerance):
    """torch's multi-stage runtime hands a stage's outputs to the next stage only (a V schedule's
    middle stages on one rank by position): the traced stages relay what a later stage reads. Each
    pp rank is measured within `tolerance` of its prediction (transformers' stages also hold the
    rotary tables and labels they receive, where the simulation's stages make them). The traced last
    stage returns the logits beside the loss, so the schedule holds each microbatch's until its
    backward, as torchtitan's does: looped BFS's last stage holds all four at once."""
    out = tmp_path / "verify.json"
    argv = ["verify", "--model", model, "--seq-len", "64", "--batch-size", "4", "--pp", str(pp), "--microbatches", "4"]
    extra = ["--pp-schedule", schedule, "--stages-per-rank", str(stages_per_rank), "--json", str(out)]
    code, _, err = run([*argv, *extra], capsys)
    assert code == 0, err
    (result,) = json.loads(out.read_text())["results"]
    assert len(result["measured_bytes"]) == pp
    assert all(abs(e) < tolerance for e in result["errors"]), result


def test_simulate_sweep_simulates_the_pipeline(tmp_path, capsys):
    p = tmp_path / "sweep.json"
    argv = ["simulate", "--model", "llama-70b-tiny", "--seq-len", "32,64", "--batch-size", "4", "--pp", "2"]
    code, _, err = run([*argv, "--json", str(p)], capsys)
    assert code == 0, err
    assert all(len(r["ranks"]) == 2 for r in json.loads(p.read_text())["sweep"])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("builder", ["titan_llama", "hf_llama"])
def test_pipeline_peaks_match_gloo_ranks(builder):
    """Every schedule runs on 2 gloo ranks; each pp rank's peak is within 0.1% of the measured one
    (the issue asks 3%, aim 1%; measured within 0.03%). A later microbatch's weight gradient held
    until AccumulateGrad, and a V schedule's hand-over to its own rank replacing the receive buffer
    when the output is made, were 1% under and 0.5% over."""
    import pp_ranks as P

    batch, seq, m = 4, 128, 4
    cases, predicted = [], {}
    graph = trace(f"{P.PATH}:{builder}", batch_size=batch // m, seq_len=seq)
    for schedule in PP_SCHEDULES:
        config = _config(schedule, microbatches=m, seq_len=seq)
        stages = 2 * config.num_stages_per_rank
        cases.append(P.case(schedule, builder, config, [4 // stages] * stages))
        predicted[schedule] = [r.peak_bytes for r in simulate_pipeline(graph, config).layout.roles]
    measured = P.run_on_ranks(cases, timeout_s=500)
    assert set(measured) == set(PP_SCHEDULES)
    for schedule, peaks in measured.items():
        for pred, meas in zip(predicted[schedule], peaks):
            assert abs(pred - meas) / meas < 0.001, (schedule, predicted[schedule], peaks)


@pytest.mark.distributed
@pytest.mark.slow
def test_gradient_accumulation_over_pipeline_steps_matches_gloo_ranks():
    """--grad-accum 2 with --pp 2: the later pipeline step starts with the gradients held; every
    rank's peak within 3% of the measured one (measured: to the byte), and above the single step's
    where the step peaks before its first backward."""
    import pp_ranks as P

    batch, seq, m = 4, 128, 4
    graph = trace(f"{P.PATH}:titan_llama", batch_size=batch // m, seq_len=seq)
    cases, predicted = [], {}
    for schedule in ("gpipe", "1f1b"):
        config = TrainConfig(batch_size=batch, seq_len=seq, pp=2, pp_schedule=schedule, microbatches=m)
        for steps in (1, 2):
            key = f"{schedule}-{steps}"
            c = config.with_(grad_accum_steps=steps)
            cases.append(P.case(key, "titan_llama", c, [2, 2]))
            predicted[key] = [r.peak_bytes for r in simulate_pipeline(graph, c).layout.roles]
    measured = P.run_on_ranks(cases, timeout_s=500)
    for key, peaks in measured.items():
        for pred, meas in zip(predicted[key], peaks, strict=True):
            assert abs(pred - meas) / meas < 0.03, (key, predicted[key], peaks)
    # GPipe peaks after every forward, before any gradient of the first step exists; 1F1B after its
    # first backward has allocated them
    assert max(predicted["gpipe-2"]) > max(predicted["gpipe-1"]) and max(measured["gpipe-2"]) > max(measured["gpipe-1"])


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp2_stages_match_gloo_ranks():
    """--pp 2 --dp 2 --zero 3 on 4 gloo ranks (mesh [pp, dp], fully_shard per block then per stage,
    as torchtitan): torch's pipelining keeps a stage's gradients unsharded until REDUCE_GRAD, right
    after its last backward; with reshard_after_forward true each forward reshards its blocks and
    root (the multi-stage runtime's UNSHARD too) and a backward gathers them again, through
    all-gather outputs a forward holds until the next copy-out. Every rank within 0.1% of the
    measured peak, for both reshard settings (measured: within 52 B)."""
    import pp_ranks as P

    batch, seq, m = 4, 128, 4
    graph = trace(f"{P.PATH}:titan_llama", batch_size=batch // m, seq_len=seq, gathered_params=True)
    cases, predicted = [], {}
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        for raf in (False, True):
            config = _config(schedule, microbatches=m, seq_len=seq, dp=2, zero_stage=3, reshard_after_forward=raf)
            key = f"{schedule}-{raf}"
            stages = 2 * config.num_stages_per_rank
            cases.append(P.case(key, "titan_llama", config, [4 // stages] * stages))
            per_pp = [r.peak_bytes for r in simulate_pipeline(graph, config).layout.roles]
            predicted[key] = [per_pp[r // 2] for r in range(4)]  # global rank r is pp rank r // dp
    measured = P.run_on_ranks(cases, timeout_s=500, world_size=4)
    for key, peaks in measured.items():
        errors = [(pred - meas) / meas for pred, meas in zip(predicted[key], peaks, strict=True)]
        assert max(map(abs, errors)) < 0.001, (key, predicted[key], peaks)


@pytest.mark.distributed
@pytest.mark.slow
def test_split_backward_with_fsdp2_resharding_after_forward_loses_gradients_as_the_warning_says():
    """The fact behind split_backward_gradient_hazard, on 4 gloo ranks with torchtitan-style stages:
    ZBV with FSDP2 resharding after forward leaves the last stage without gradients and another
    split stage with different ones; resharding after forward false gives 1F1B's gradients. A torch
    that fixes it fails here: then drop the warning."""
    import pp_ranks as P

    from planner.simulation.pipeline_fsdp import split_backward_gradient_hazard
    from planner.simulation.pipeline_schedule import pipeline_schedule

    base = dict(microbatches=4, seq_len=64, dp=2, zero_stage=3)
    reference = P.stage_gradients(_config("1f1b", **base, reshard_after_forward=False))
    runs = {
        raf: P.stage_gradients(_config("zbv-zero-bubble", **base, reshard_after_forward=raf)) for raf in (False, True)
    }
    assert all(missing == 0 for _, missing, _ in runs[False].values())
    assert runs[True][3][1] == runs[True][3][0]  # the last stage: no gradient at all
    assert runs[True][1][2] != pytest.approx(runs[False][1][2], rel=1e-3)
    assert sum(map(sum, (norms for _, _, norms in runs[False].values()))) == pytest.approx(
        sum(map(sum, (norms for _, _, norms in reference.values()))), rel=1e-4
    )
    config = _config("zbv-zero-bubble", **base)
    assert split_backward_gradient_hazard(config, pipeline_schedule(config))
    config = config.with_(reshard_after_forward=False)
    assert split_backward_gradient_hazard(config, pipeline_schedule(config)) is None


def _by_rank(layout) -> list[int]:
    by_rank = {r: role.peak_bytes for role in layout.roles for r in role.ranks}
    return [by_rank[r] for r in range(layout.config.world_size)]


def _moe_config(**kw) -> TrainConfig:
    base = dict(batch_size=4, seq_len=64, pp=2, microbatches=2, dp=2, ep=2, moe_imbalance=2.0, gpu="cpu")
    return TrainConfig(**{**base, **kw})


def test_expert_parallel_stages_are_one_role_per_pp_rank_and_ep_role():
    """--pp 2 --dp 2 --ep 2: each pp rank's two EP ranks receive different rows (the busiest expert
    lives on EP rank 0), so each (pp rank, EP index) is its own role, all under one split."""
    from pp_ranks import PATH

    from planner.api import simulate_pipeline_model

    spec = f"{PATH}:titan_moe"
    result = simulate_pipeline_model(spec, _moe_config(pp_schedule="gpipe", zero_stage=3)).to_dict()
    roles = result["ranks"]
    assert [r["ranks"] for r in roles] == [[0], [1], [2], [3]]
    assert [(r["coords"]["pp"], r["coords"]["ep"]) for r in roles] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert roles[0]["peak_bytes"] > roles[1]["peak_bytes"] and roles[2]["peak_bytes"] > roles[3]["peak_bytes"]
    assert result["pipeline"]["peak_bytes_per_pp_rank"] == [roles[0]["peak_bytes"], roles[2]["peak_bytes"]]
    assert result["peak_bytes"] == max(r["peak_bytes"] for r in roles)
    balanced = simulate_pipeline_model(spec, _moe_config(pp_schedule="gpipe", zero_stage=3, moe_imbalance=1.0))
    assert [r.ranks for r in balanced.layout.roles] == [(0, 1), (2, 3)]


def test_expert_parallel_blocks_keep_their_all_to_all_and_recompute_in_backward():
    """An expert-parallel block recomputes with its all-to-all outputs kept (selective checkpointing):
    it is not checkpointed whole, so its stage plan never lists it to run in the bubble, and the
    plan file loads (CI: stage 0's plan ran 'layers.0.moe' early and was refused)."""
    from pp_ranks import PATH

    from planner.api import plan_pipeline_model
    from planner.plans.format import load_plan

    _, plans, _ = plan_pipeline_model(f"{PATH}:titan_moe", _moe_config(pp_schedule="1f1b", zero_stage=3), "90%")
    kept = {d.module for s in plans.stages for d in s.plan.decisions if d.action == "keep"}
    assert kept, "an expert-parallel recompute keeps its all-to-all outputs"
    assert not {m for s in plans.stages for m in s.early_recompute} & kept
    assert load_plan(plans.to_dict()) == plans


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("builder", ["titan_moe", "hf_mixtral"])
def test_expert_parallel_stages_match_gloo_ranks(builder):
    """--pp 2 --dp 2 --ep 2 on 4 gloo ranks (mesh [pp, dp], the experts sharded over the dp ranks of
    each stage, then FSDP2 as torchtitan, resharding after forward or not): every rank within 1% of
    the measured peak (measured: within 0.03%); a plan per stage, made on the busiest EP role, keeps every rank within its budget and 3% of
    its prediction, as the pipeline plans of tests/test_pipeline_plans.py (measured: the busiest
    rank 1.8% above, in its recompute; the others to the byte). On the torchtitan-style MoE decoder
    and transformers' Mixtral (its own EP plan)."""
    import pp_ranks as P

    from planner.api import plan_pipeline_model, simulate_pipeline_model

    spec, split = f"{P.PATH}:{builder}", [1, 1] if builder == "titan_moe" else [2, 2]
    configs = {
        "gpipe-fsdp2": _moe_config(pp_schedule="gpipe", zero_stage=3, reshard_after_forward=False),
        "1f1b-fsdp2": _moe_config(pp_schedule="1f1b", zero_stage=3, reshard_after_forward=False),
        "1f1b-fsdp2-reshard": _moe_config(pp_schedule="1f1b", zero_stage=3, reshard_after_forward=True),
        "1f1b": _moe_config(pp_schedule="1f1b"),
    }
    cases = [P.case(key, builder, c, split) for key, c in configs.items()]
    predicted = {key: _by_rank(simulate_pipeline_model(spec, c).layout) for key, c in configs.items()}
    plan, plans, _ = plan_pipeline_model(spec, configs["1f1b-fsdp2"], "90%")
    cases.append(P.case("planned", builder, configs["1f1b-fsdp2"], split, plans=plans.to_dict()))
    predicted["planned"] = _by_rank(simulate_pipeline_model(spec, configs["1f1b-fsdp2"], plans).layout)
    measured = P.run_on_ranks(cases, timeout_s=500, world_size=4)
    for key in configs:
        for pred, meas in zip(predicted[key], measured[key], strict=True):
            assert abs(pred - meas) / meas < 0.01, (key, predicted[key], measured[key])
    for pred, meas in zip(predicted["planned"], measured["planned"], strict=True):
        assert abs(pred - meas) / meas < 0.03 and meas <= plan.budget_bytes * 1.03, (predicted["planned"], meas)
    assert max(predicted["planned"]) <= plan.budget_bytes < max(measured["1f1b-fsdp2"])


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_values_crossing_a_cut_are_sent_and_received_contiguous(schedule):
    """Point-to-point messages take contiguous tensors only: a block output that is a permuted view
    (as a vision model's) is sent through ``contiguous()`` and received into a contiguous buffer,
    whether or not the stages relay, and the traced step computes the loss it did."""
    import torch

    from planner.runtime.pipeline_verify import _returned, _traced_pipe

    spec = "tests/models_for_tests.py:channels_first"
    pipe, inputs, _ = _traced_pipe(spec, _config(schedule, microbatches=4, seq_len=16), (1, 1, 1, 1), seed=0)
    stages = [pipe.split_gm.get_submodule(n.target) for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    for k, stage in enumerate(stages):
        received = [n.meta["val"] for n in stage.graph.nodes if n.op == "placeholder"]
        sent = [v.meta["val"] for v in _returned(stage.graph)[1]] if k < len(stages) - 1 else []
        assert all(t.is_contiguous() for t in [*received[k == 0 :], *sent]), k
    micro = [t[:1] for t in inputs]
    with torch.no_grad():
        loss = torch.fx.Interpreter(pipe.split_gm).run(*micro)[0]
    assert loss.shape == () and torch.isfinite(loss)


@pytest.mark.distributed
@pytest.mark.slow
def test_verify_pipeline_sends_a_non_contiguous_boundary(tmp_path, capsys):
    """A model whose blocks hand on a permuted view (ConvNeXt's layout) runs under `memplan verify
    --pp 2` (gloo refused such a send before: "input tensor has to be contiguous"). Rank 0 within
    1%; the last rank 4.4% over: one microbatch's logits (16 KiB of 370 KiB here), which the simulated
    stage returns and torch holds until its backward, where the traced stage returns only the loss."""
    out = tmp_path / "verify.json"
    argv = ["verify", "--model", "tests/models_for_tests.py:channels_first", "--seq-len", "32", "--batch-size", "4"]
    code, _, err = run([*argv, "--pp", "2", "--pp-schedule", "1f1b", "--json", str(out)], capsys)
    assert code == 0, err
    (result,) = json.loads(out.read_text())["results"]
    assert abs(result["errors"][0]) < 0.01 and abs(result["errors"][1]) < 0.05, result


def test_traced_stages_attend_as_the_eager_step_does():
    """Exported, transformers would assume packed sequences and build the causal mask it skips in
    eager, and SDPA with a mask takes no grouped key/value heads: the traced stages would save a
    mask and repeated keys and values that the simulated (eager) step never makes."""
    import torch

    from planner.runtime.pipeline_verify import _traced_pipe

    pipe, _, _ = _traced_pipe("tests/pp_ranks.py:hf_llama", _config("1f1b", microbatches=2, seq_len=64), (2, 2), 0)
    calls = [
        node
        for module in pipe.split_gm.modules()
        if isinstance(getattr(module, "graph", None), torch.fx.Graph)
        for node in module.graph.nodes
        if node.target is torch.ops.aten.scaled_dot_product_attention.default
    ]
    assert len(calls) == 4  # one per layer
    for node in calls:
        assert node.args[3] is None and node.args[5] is True and node.kwargs["enable_gqa"], node  # no mask, causal


@pytest.mark.slow  # 6 s; the multi-stage verify runs relay traced stages end to end
def test_relayed_stages_take_exactly_their_predecessors_outputs_and_compute_the_same_loss():
    """What a multi-stage schedule needs of torch's traced stages: each stage after the first takes
    its predecessor's outputs, all and in order; the relayed step computes the loss it did."""
    import operator

    import torch

    from planner.runtime.pipeline_verify import _traced_pipe

    one = _config("1f1b", pp=4, microbatches=4, seq_len=64)  # four stages, one per rank: not relayed
    many = _config("interleaved-1f1b", microbatches=4, seq_len=64)  # four stages, two per rank
    direct, inputs, _ = _traced_pipe("tests/pp_ranks.py:hf_llama", one, (1, 1, 1, 1), seed=0)
    relayed, _, _ = _traced_pipe("tests/pp_ranks.py:hf_llama", many, (1, 1, 1, 1), seed=0)
    micro = [t[:1] for t in inputs]
    with torch.no_grad():
        losses = [torch.fx.Interpreter(pipe.split_gm).run(*micro)[0] for pipe in (direct, relayed)]
    assert torch.equal(*losses)
    stages = [n for n in relayed.split_gm.graph.nodes if n.op == "call_module"]
    skipping = [  # the unrelayed step sends some values past the next stage (labels, rotary tables)
        a
        for k, n in enumerate(n for n in direct.split_gm.graph.nodes if n.op == "call_module")
        for a in n.args
        if a.op != "placeholder" and a.args[0].name != f"submod_pp_{k - 1}"
    ]
    assert skipping
    for previous, stage in zip(stages, stages[1:]):
        outputs = [u for u in previous.users if u.target is operator.getitem]
        assert list(stage.args) == sorted(outputs, key=lambda u: u.args[1])
        returned = next(n for n in relayed.split_gm.get_submodule(previous.target).graph.nodes if n.op == "output")
        assert len(returned.args[0]) == len(stage.args)


@pytest.mark.slow  # 5 s
def test_traced_stages_make_the_step_constants_they_read():
    """A value that needs no gradient and is the same in every microbatch (transformers' rotary
    tables) is made on each stage that reads it, as torchtitan's stages make theirs, not sent:
    every stage after the first receives one floating value (the hidden state) and at most the
    labels; the step computes the eager model's loss."""
    import torch

    from planner.runtime.pipeline_verify import _example_of, _traced_pipe, _training_model
    from planner.tracing.recorder import loss_of

    config = _config("1f1b", pp=4, microbatches=4, seq_len=64)
    pipe, inputs, _ = _traced_pipe("tests/pp_ranks.py:hf_llama", config, (1, 1, 1, 1), seed=0)
    stages = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    for stage in stages[1:]:
        received = [_example_of(pipe.split_gm, a) for a in stage.args]
        assert sum(r.is_floating_point() for r in received) == 1, (stage, received)
        assert len(received) <= 2
    model, _, kwargs, micro = _training_model("tests/pp_ranks.py:hf_llama", config, seed=0)
    with torch.no_grad():
        traced = torch.fx.Interpreter(pipe.split_gm).run(*(t[:micro] for t in inputs))[0]
        eager = loss_of(model(**{k: v[:micro] for k, v in kwargs.items()}))
    torch.testing.assert_close(traced, eager)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("builder", ["titan_llama", "hf_llama"])
def test_tensor_parallel_stages_match_gloo_ranks(builder):
    """--pp 2 --tp 2 on 4 gloo ranks (mesh [pp, tp]: the model sharded with its TP plan, then cut into
    stages as torchtitan does; the torchtitan-style Llama with sequence parallel, transformers' Llama
    with its own plan), and --pp 2 --dp 2 --tp 2 --zero 3 on 8 (FSDP2 over the TP shards of each
    stage): every rank within 0.5% of the measured peak (measured: GPipe's last rank 0.11% over,
    every other rank within 0.05%); a plan per stage keeps every rank within its budget and 3% of
    its prediction."""
    import pp_ranks as P

    from planner.api import plan_pipeline_model, simulate_pipeline_model

    spec = f"{P.PATH}:{builder}"
    configs = {
        s: _config(s, microbatches=4, seq_len=128, tp=2)
        for s in ("gpipe", "1f1b", "interleaved-1f1b", "zbv-zero-bubble")
    }
    cases = [
        P.case(s, builder, c, [4 // (2 * c.num_stages_per_rank)] * 2 * c.num_stages_per_rank)
        for s, c in configs.items()
    ]
    predicted = {key: _by_rank(simulate_pipeline_model(spec, c).layout) for key, c in configs.items()}
    plan, plans, _ = plan_pipeline_model(spec, configs["1f1b"], "90%")
    cases.append(P.case("planned", builder, configs["1f1b"], [2, 2], plans=plans.to_dict()))
    predicted["planned"] = _by_rank(simulate_pipeline_model(spec, configs["1f1b"], plans).layout)
    measured = P.run_on_ranks(cases, timeout_s=500, world_size=4)
    three_d = _config("1f1b", microbatches=4, seq_len=128, tp=2, dp=2, zero_stage=3, reshard_after_forward=False)
    predicted["3d"] = _by_rank(simulate_pipeline_model(spec, three_d).layout)
    measured |= P.run_on_ranks([P.case("3d", builder, three_d, [2, 2])], timeout_s=500, world_size=8)
    for key in (*configs, "3d"):
        for pred, meas in zip(predicted[key], measured[key], strict=True):
            assert abs(pred - meas) / meas < 0.005, (key, predicted[key], measured[key])
    for pred, meas in zip(predicted["planned"], measured["planned"], strict=True):
        assert abs(pred - meas) / meas < 0.03 and meas <= plan.budget_bytes * 1.03, (predicted["planned"], meas)
    assert max(predicted["planned"]) <= plan.budget_bytes < max(measured["1f1b"])


@pytest.mark.distributed
@pytest.mark.slow
def test_verify_pp_splits_the_backward_of_stages_that_return_a_view(tmp_path, capsys):
    """OPT's decoder layers return a view (the residual sum reshaped); torch's split backward
    detaches each stage output in place, which a view refuses ("Can't detach views in-place"). The
    traced stages return such an output as a plain tensor over the same storage: ZBV zero-bubble
    runs, every rank within 5% of its prediction (the traced stages' known gap on the last stage)."""
    from pathlib import Path

    config = json.loads((Path(__file__).parent / "data" / "tiny_opt" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    out = tmp_path / "verify.json"
    argv = ["verify", "--model", f"hf:{tmp_path / 'config.json'}", "--seq-len", "64", "--batch-size", "4"]
    argv += ["--pp", "2", "--pp-schedule", "zbv-zero-bubble", "--stages-per-rank", "2", "--microbatches", "4"]
    code, _, err = run([*argv, "--json", str(out)], capsys)
    assert code == 0, err
    (result,) = json.loads(out.read_text())["results"]
    assert len(result["measured_bytes"]) == 2
    assert all(abs(e) < 0.05 for e in result["errors"]), result
