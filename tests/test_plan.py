"""Tests for planner.plans.format: the versioned plan file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from planner.errors import PlanFileError
from planner.plans.format import (
    SCHEMA_VERSION,
    CompiledPlan,
    Decision,
    ModelInfo,
    Plan,
    PlanLadder,
    Predicted,
    SolverInfo,
    load_plan,
    plan_schema,
)
from planner.plans.identity import check_plan_matches, model_info
from planner.tracing.fingerprint import model_fingerprint


def make_model(hidden: int = 8) -> nn.Module:
    return nn.Sequential(
        nn.Linear(4, hidden), nn.LayerNorm(hidden), nn.ReLU(), nn.Sequential(nn.Linear(hidden, 4), nn.LayerNorm(4))
    )


CONFIG = {
    "batch_size": 2,
    "seq_len": 128,
    "precision": "bf16",
    "optimizer": "adamw",
    "zero_stage": 0,
    "dp": 1,
    "gpu": "H100-80GB",
}


def make_plan(
    seq_len: int = 128, decisions: tuple[Decision, ...] | None = None, model: nn.Module | None = None
) -> Plan:
    if decisions is None:
        decisions = (
            Decision("0", "keep"),
            Decision("3", "recompute"),
            Decision("3", "keep", op="aten.mm.default#0"),
            Decision("3", "offload", op="aten.native_layer_norm.default#0", target="cpu"),
            Decision("1", "offload", target="disk"),
        )
    return Plan(
        model=model_info(model if model is not None else make_model(), "tests:make_model"),
        config={**CONFIG, "seq_len": seq_len},
        budget_bytes=1 << 30,
        strategy="milp",
        decisions=decisions,
        predicted=Predicted(
            peak_bytes=900,
            baseline_peak_bytes=1200,
            recompute_flops=10**9,
            recompute_s=0.01,
            offload_bytes=64,
            exposed_offload_s=0.0,
            step_s=0.5,
            overhead=0.02,
        ),
        solver=SolverInfo(status="OPTIMAL", objective=1.5, bound=1.5, gap=0.0, wall_s=0.3),
    )


def write(tmp_path: Path, d: object, name: str = "plan.json") -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return p


# ------------------------------------------------------------------ round trips


def test_round_trip_through_file(tmp_path: Path) -> None:
    plan = make_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = load_plan(path)
    assert loaded == plan
    assert loaded.to_dict() == plan.to_dict()
    assert json.loads(path.read_text())["kind"] == "plan"
    assert load_plan(json.loads(json.dumps(plan.to_dict()))) == plan
    assert Plan.from_dict(plan.to_dict()) == plan


def test_save_is_stable(tmp_path: Path) -> None:
    plan = make_plan()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    plan.save(a)
    load_plan(a).save(b)
    assert a.read_text() == b.read_text()
    assert a.read_text().startswith('{\n  "budget_bytes"')


def test_accessors() -> None:
    plan = make_plan()
    assert plan.schema_version == SCHEMA_VERSION
    assert plan.memplan_version
    assert plan.recompute_modules() == ("3",)
    assert [d.module for d in plan.offload_decisions()] == ["3", "1"]
    ops = plan.op_decisions("3")
    assert set(ops) == {"aten.mm.default#0", "aten.native_layer_norm.default#0"}
    assert ops["aten.native_layer_norm.default#0"].target == "cpu"
    assert plan.op_decisions("0") == {}


def test_ladder_round_trip_and_plan_for(tmp_path: Path) -> None:
    ladder = PlanLadder(buckets=((2048, make_plan(2048)), (512, make_plan(512)), (1024, make_plan(1024))))
    assert [s for s, _ in ladder.buckets] == [512, 1024, 2048]
    path = tmp_path / "ladder.json"
    ladder.save(path)
    loaded = load_plan(path)
    assert isinstance(loaded, PlanLadder)
    assert loaded == ladder
    assert json.loads(path.read_text())["buckets"][0]["seq_len"] == 512

    def pick(n: int) -> tuple[int, bool]:
        plan, beyond = loaded.plan_for(n)
        return plan.config["seq_len"], beyond

    assert pick(1) == (512, False)
    assert pick(512) == (512, False)
    assert pick(513) == (1024, False)
    assert pick(2048) == (2048, False)
    assert pick(4096) == (2048, True)
    with pytest.raises(ValueError, match="positive integer"):
        loaded.plan_for(0)


def test_ladder_rejects_mixed_models() -> None:
    with pytest.raises(ValueError, match="same model"):
        PlanLadder(buckets=((512, make_plan(512)), (1024, make_plan(1024, model=make_model(16)))))


def test_ladder_rejects_mixed_models_in_file(tmp_path: Path) -> None:
    d = PlanLadder(buckets=((512, make_plan(512)), (1024, make_plan(1024)))).to_dict()
    d["buckets"][1]["plan"]["model"]["fingerprint"] = "sha256:" + "0" * 64
    with pytest.raises(ValueError, match="same model"):
        load_plan(write(tmp_path, d))


def test_ladder_rejects_empty_and_duplicates() -> None:
    with pytest.raises(ValueError, match="no buckets"):
        PlanLadder(buckets=())
    with pytest.raises(ValueError, match="distinct"):
        PlanLadder(buckets=((512, make_plan(512)), (512, make_plan(512))))


def test_from_dict_kind_mismatch() -> None:
    ladder = PlanLadder(buckets=((128, make_plan()),))
    with pytest.raises(ValueError, match=r"is a ladder \(PlanLadder\), not a single plan"):
        Plan.from_dict(ladder.to_dict())
    with pytest.raises(ValueError, match=r"is a single plan \(Plan\), not a ladder"):
        PlanLadder.from_dict(make_plan().to_dict())
    with pytest.raises(ValueError, match="is a single plan .*, not a compiled plan; use load_plan"):
        CompiledPlan.from_dict(make_plan().to_dict())


# ------------------------------------------------------------------ bad files


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"plan file .*nope\.json not found"):
        load_plan(tmp_path / "nope.json")


def test_malformed_json(tmp_path: Path) -> None:
    p = tmp_path / "plan.json"
    p.write_text('{"kind": "plan",\n  "schema_version": 1,,}')
    with pytest.raises(ValueError) as ei:
        load_plan(p)
    msg = str(ei.value)
    assert "is not valid JSON (line 2, column" in msg
    assert "re-export it with memplan plan" in msg
    assert "\n" not in msg


def test_truncated_file(tmp_path: Path) -> None:
    p = tmp_path / "plan.json"
    make_plan().save(p)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_plan(p)


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "plan.json"
    p.write_text("")
    with pytest.raises(ValueError, match=r"not valid JSON \(line 1, column 1\)"):
        load_plan(p)


def test_top_level_not_object(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must hold a JSON object"):
        load_plan(write(tmp_path, [1, 2]))


@pytest.mark.parametrize("version", [7, 0, "1", None])
def test_wrong_schema_version(tmp_path: Path, version: object) -> None:
    d = make_plan().to_dict()
    d["schema_version"] = version
    d["decisions"][0]["action"] = "maybe"  # version error must win over schema errors
    with pytest.raises(ValueError) as ei:
        load_plan(write(tmp_path, d))
    assert f"has schema_version {version!r}; this memplan reads version 1" in str(ei.value)
    assert "re-create it with memplan plan" in str(ei.value)


def test_wrong_schema_version_in_ladder(tmp_path: Path) -> None:
    d = PlanLadder(buckets=((128, make_plan()),)).to_dict()
    d["schema_version"] = 2
    with pytest.raises(ValueError, match="schema_version 2"):
        load_plan(write(tmp_path, d))


@pytest.mark.parametrize(
    "field", ["predicted", "solver", "model", "decisions", "budget_bytes", "memplan_version", "schema_version"]
)
def test_missing_field(tmp_path: Path, field: str) -> None:
    d = make_plan().to_dict()
    del d[field]
    with pytest.raises(ValueError, match=f"is invalid at \\(top level\\): '{field}' is a required"):
        load_plan(write(tmp_path, d))


def test_missing_nested_field(tmp_path: Path) -> None:
    d = make_plan().to_dict()
    del d["predicted"]["step_s"]
    with pytest.raises(ValueError, match="invalid at predicted: 'step_s' is a required property"):
        load_plan(write(tmp_path, d))
    d = make_plan().to_dict()
    del d["config"]["gpu"]
    with pytest.raises(ValueError, match="invalid at config: 'gpu' is a required property"):
        load_plan(d)


def test_bad_enum(tmp_path: Path) -> None:
    d = make_plan().to_dict()
    d["decisions"][0]["action"] = "maybe"
    p = write(tmp_path, d)
    with pytest.raises(ValueError) as ei:
        load_plan(p)
    assert str(ei.value) == (
        f"plan file {p} is invalid at decisions/0/action: 'maybe' is not one of ['keep', 'recompute', 'offload']"
    )


def test_bad_solver_status_and_kind(tmp_path: Path) -> None:
    d = make_plan().to_dict()
    d["solver"]["status"] = "DONE"
    with pytest.raises(ValueError, match="invalid at solver/status"):
        load_plan(d)
    d = make_plan().to_dict()
    d["kind"] = "plans"
    with pytest.raises(ValueError, match="invalid at kind"):
        load_plan(d)


def test_offload_without_target(tmp_path: Path) -> None:
    d = make_plan().to_dict()
    d["decisions"][4]["target"] = None
    with pytest.raises(ValueError, match="invalid at decisions/4/target"):
        load_plan(write(tmp_path, d))
    with pytest.raises(PlanFileError, match="invalid at decisions/0/target"):
        make_plan(decisions=(Decision("1", "offload"),))


def test_target_without_offload() -> None:
    d = make_plan().to_dict()
    d["decisions"][0]["target"] = "cpu"
    with pytest.raises(ValueError, match="invalid at decisions/0/target"):
        load_plan(d)
    with pytest.raises(PlanFileError, match="invalid at decisions/0/target"):
        make_plan(decisions=(Decision("1", "keep", target="cpu"),))


def test_unknown_keys_rejected_except_config(tmp_path: Path) -> None:
    d = make_plan().to_dict()
    d["predicted"]["extra"] = 1
    with pytest.raises(ValueError, match="Additional properties"):
        load_plan(d)
    d = make_plan().to_dict()
    d["config"]["grad_accum"] = 4
    assert load_plan(d).config["grad_accum"] == 4


def test_negative_bytes_rejected() -> None:
    d = make_plan().to_dict()
    d["predicted"]["peak_bytes"] = -1
    with pytest.raises(ValueError, match="invalid at predicted/peak_bytes"):
        load_plan(d)


def test_semantic_errors_are_value_errors() -> None:
    with pytest.raises(ValueError, match="two decisions for module '0'"):
        make_plan(decisions=(Decision("0", "keep"), Decision("0", "recompute")))
    with pytest.raises(ValueError, match="needs a whole-module recompute"):
        make_plan(decisions=(Decision("0", "keep", op="aten.mm.default#0"),))
    d = make_plan().to_dict()
    d["decisions"] = [d["decisions"][2]]  # op decision without its recompute parent
    with pytest.raises(ValueError, match="plan is invalid: op decision"):
        load_plan(d)
    with pytest.raises(PlanFileError, match="solver/gap must be a finite number"):
        dataclasses.replace(make_plan(), solver=SolverInfo("INFEASIBLE", 0.0, 0.0, float("inf"), 1.0))


def test_schema_is_valid_draft_2020_12() -> None:
    import jsonschema

    schema = plan_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(make_plan().to_dict())
    ladder = PlanLadder(buckets=((128, make_plan()),)).to_dict()
    jsonschema.Draft202012Validator(schema).validate(ladder)


# ------------------------------------------------------------------ fingerprint


def test_fingerprint_stable_across_real_meta_fake() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = model_fingerprint(make_model())
    assert real.startswith("sha256:") and len(real) == 71
    with torch.device("meta"):
        meta_model = make_model()
    assert next(meta_model.parameters()).is_meta
    assert model_fingerprint(meta_model) == real
    with FakeTensorMode():
        fake_model = make_model()
        assert model_fingerprint(fake_model) == real
        assert model_info(fake_model, "x").num_parameters == model_info(make_model(), "x").num_parameters
    assert model_fingerprint(make_model()) == real


def test_fingerprint_changes_with_shape_dtype_and_structure() -> None:
    base = model_fingerprint(make_model())
    assert model_fingerprint(make_model(16)) != base
    assert model_fingerprint(make_model().to(torch.float64)) != base
    renamed = make_model()
    renamed[2] = nn.GELU()  # same params, different class
    assert model_fingerprint(renamed) != base


def test_model_info_counts() -> None:
    info = model_info(make_model(), "spec")
    assert info.num_modules == 7  # root, 0, 1, 2, 3, 3.0, 3.1
    assert info.num_parameters == (4 * 8 + 8) + 16 + (8 * 4 + 4) + 8
    with pytest.raises(PlanFileError, match="invalid at model/fingerprint"):
        bad = ModelInfo(spec="s", fingerprint="md5:0", num_parameters=1, num_modules=1)
        dataclasses.replace(make_plan(), model=bad)


def test_check_plan_matches() -> None:
    check_plan_matches(make_plan(), make_model())
    other = nn.Sequential(make_model(), nn.Linear(4, 4))  # every path moves one level down
    plan = make_plan(
        decisions=(
            Decision("0", "keep"),
            Decision("3", "recompute"),
            Decision("9", "keep"),
            Decision("3.1", "keep"),
            Decision("3.0", "keep"),
            Decision("1", "keep"),
        )
    )
    with pytest.raises(ValueError) as ei:
        check_plan_matches(plan, other)
    msg = str(ei.value)
    # "0" and "1" exist in `other`; "3", "9", "3.1", "3.0" do not (first 3 listed)
    assert msg.startswith(
        "plan was made for a different model: 7 modules vs 9, "
        "100 vs 120 parameters, modules not found: 3, 9, 3.1 (+1 more); "
    )
    assert "re-plan with memplan plan --model tests:make_model" in msg
    assert "\n" not in msg


def test_check_plan_matches_same_counts_different_shapes() -> None:
    a = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))  # 30 + 28 params
    b = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    b[0].weight = nn.Parameter(torch.zeros(4, 6))  # same numel, transposed shape
    plan = make_plan(decisions=(), model=a)
    with pytest.raises(ValueError, match="different structure, shapes or dtypes"):
        check_plan_matches(plan, b)


def test_check_plan_matches_big_counts() -> None:
    plan = make_plan(decisions=(Decision("layers.7", "recompute"),))
    fake = dataclasses.replace(plan.model, num_parameters=1_200_000)
    plan = Plan(
        model=fake,
        config=plan.config,
        budget_bytes=1,
        strategy="milp",
        decisions=plan.decisions,
        predicted=plan.predicted,
        solver=plan.solver,
    )
    with torch.device("meta"):
        big = nn.Sequential(nn.Linear(1000, 3400))
    with pytest.raises(ValueError) as ei:
        check_plan_matches(plan, big)
    assert "7 modules vs 2, 1.2M vs 3.4M parameters, modules not found: layers.7;" in str(ei.value)


# ------------------------------------------------------------------ hypothesis

_name = st.text(alphabet="abcdefghij0123456789_", min_size=1, max_size=6)
_module = st.one_of(st.just(""), st.lists(_name, min_size=1, max_size=4).map(".".join))
_op = st.builds(
    lambda ns, n, i: f"aten.{ns}.{n}#{i}",
    st.sampled_from(["mm", "addmm", "gelu", "native_layer_norm"]),
    st.sampled_from(["default", "out"]),
    st.integers(0, 50),
)


@st.composite
def decision_lists(draw: st.DrawFn) -> tuple[Decision, ...]:
    modules = draw(st.lists(_module, unique=True, max_size=8))
    out: list[Decision] = []
    for m in modules:
        action = draw(st.sampled_from(["keep", "recompute", "offload"]))
        target = draw(st.sampled_from(["cpu", "disk"])) if action == "offload" else None
        out.append(Decision(m, action, None, target))
        if action == "recompute":
            for op in draw(st.lists(_op, unique=True, max_size=4)):
                a = draw(st.sampled_from(["keep", "offload"]))
                out.append(Decision(m, a, op, draw(st.sampled_from(["cpu", "disk"])) if a == "offload" else None))
    return tuple(draw(st.permutations(out)))


_MODEL = make_model()


@settings(max_examples=60, deadline=None)
@given(decisions=decision_lists())
def test_random_decisions_round_trip(decisions: tuple[Decision, ...]) -> None:
    plan = make_plan(decisions=decisions, model=_MODEL)
    text = json.dumps(plan.to_dict(), indent=2, sort_keys=True)
    loaded = load_plan(json.loads(text))
    assert loaded == plan
    assert loaded.decisions == decisions
