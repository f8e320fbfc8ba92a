"""The versioned plan file of memplan.

A plan says, for one model and training config, which activations to keep, recompute
(activation checkpointing) or offload. A ladder holds one plan per sequence-length bucket for the
same model. Files are JSON, validated against ``planner/plans/schema/plan.schema.json`` (Draft
2020-12); a plan built in Python is checked against the same schema. ``__post_init__`` checks only
what the schema cannot say (finite numbers, one decision per module or op, op decisions under a
recompute, ladder buckets that agree). Dataclasses serialise with :func:`dataclasses.asdict`, and
one loader reads both kinds.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from dataclasses import replace as dataclasses_replace
from functools import lru_cache
from importlib import metadata, resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

from planner.errors import PlanFileError
from planner.safe_io import JSON_MAX_BYTES, clean, loads_json, read_bounded, write_text

if TYPE_CHECKING:
    import jsonschema

__all__ = [
    "SCHEMA_VERSION",
    "Decision",
    "Predicted",
    "SolverInfo",
    "ModelInfo",
    "Plan",
    "PlanLadder",
    "load_plan",
    "plan_schema",
    "CompiledPoint",
    "CompiledPrediction",
    "CompiledPlan",
    "StagePlan",
    "StagePlans",
]

SCHEMA_VERSION = 1
KINDS = ("plan", "ladder", "compiled", "stages")

Action = Literal["keep", "recompute", "offload"]
Target = Literal["cpu", "disk"]
PathLike = Union[str, "os.PathLike[str]"]


def _memplan_version() -> str:
    try:
        return metadata.version("memplan")
    except metadata.PackageNotFoundError:
        return "0.1.0"


@lru_cache(maxsize=1)
def plan_schema() -> dict[str, Any]:
    """Return the plan JSON schema shipped as package data."""
    text = resources.files("planner.plans").joinpath("schema/plan.schema.json").read_text("utf-8")
    return json.loads(text)


@lru_cache(maxsize=len(KINDS))
def _validator(kind: str) -> jsonschema.Draft202012Validator:
    # Validate against the branch chosen by "kind" so errors point at the real
    # problem instead of "not valid under any of the given schemas".
    root = {k: v for k, v in plan_schema().items() if k != "oneOf"}
    root["$ref"] = f"#/$defs/{kind}"
    import jsonschema  # 90 ms to import: only commands that read or write a plan pay it

    return jsonschema.Draft202012Validator(root)


def _validate(d: Any, label: str) -> str:
    """Check version then schema of a plan dict; return its kind. Raises PlanFileError."""
    if not isinstance(d, dict):
        raise PlanFileError(f"{label} must hold a JSON object, got {type(d).__name__}; re-create it with memplan plan")
    version = d.get("schema_version")
    if "schema_version" in d and (type(version) is not int or version != SCHEMA_VERSION):
        raise PlanFileError(
            f"{label} has schema_version {version!r}; this memplan reads version "
            f"{SCHEMA_VERSION}: re-create it with memplan plan"
        )
    kind = d.get("kind")
    if kind not in KINDS:
        raise PlanFileError(f"{label} is invalid at kind: {kind!r} is not one of {list(KINDS)}")
    from jsonschema.exceptions import best_match

    err = best_match(_validator(kind).iter_errors(d))
    if err is not None:
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        raise PlanFileError(f"{label} is invalid at {where}: {err.message}")
    _check_finite(d, "")
    return kind


def _check_finite(value: Any, where: str) -> None:
    """JSON Schema cannot refuse inf and nan: every number of a plan must be finite."""
    if isinstance(value, float) and not math.isfinite(value):
        raise PlanFileError(f"{where.lstrip('/')} must be a finite number, got {value}; use a finite value")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_finite(v, f"{where}/{k}")
    elif isinstance(value, list):
        for k, v in enumerate(value):
            _check_finite(v, f"{where}/{k}")


def _json_copy(config: Mapping[str, Any]) -> dict[str, Any]:
    """A plain JSON copy of a plan's config, so the plan round-trips exactly."""
    try:
        return json.loads(json.dumps(dict(config), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise PlanFileError(f"plan config must be JSON-serializable: {e}") from None


def _plain(obj: Any) -> Any:
    """A dataclass as plain JSON data (tuples become lists, numpy scalars Python numbers)."""

    def scalar(x: Any) -> Any:
        if hasattr(x, "item"):
            return x.item()
        raise TypeError(f"{type(x).__name__} is not JSON-serializable")

    return json.loads(json.dumps(asdict(obj), default=scalar))


@dataclass(frozen=True)
class Decision:
    """What to do with the activations of one module (op=None) or one op occurrence."""

    module: str
    action: Action
    op: str | None = None
    target: Target | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Predicted:
    """Cost-model predictions for a plan."""

    peak_bytes: int
    baseline_peak_bytes: int
    recompute_flops: int
    recompute_s: float
    offload_bytes: int
    exposed_offload_s: float
    step_s: float
    overhead: float  # added time / step time
    hidden_recompute_s: float = 0.0  # recompute run while the step waited on communication

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SolverInfo:
    """How the plan was found (baselines use status NOT_SOLVED); objective and bound in seconds."""

    status: str
    objective: float
    bound: float
    gap: float
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ModelInfo:
    """Identity of the model a plan was made for."""

    spec: str
    fingerprint: str
    num_parameters: int
    num_modules: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    """One memory plan for one model, training config and memory budget."""

    model: ModelInfo
    config: dict[str, Any]
    budget_bytes: int
    strategy: str
    decisions: tuple[Decision, ...]
    predicted: Predicted
    solver: SolverInfo
    schema_version: int = SCHEMA_VERSION
    memplan_version: str = field(default_factory=_memplan_version)

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", _json_copy(self.config))
        object.__setattr__(self, "decisions", tuple(self.decisions))
        _validate(self.to_dict(), "plan")
        seen: set[tuple[str, str | None]] = set()
        recomputed = set(self.recompute_modules())
        for dec in self.decisions:
            key = (dec.module, dec.op)
            if key in seen:
                what = f"module {dec.module!r}" + (f" op {dec.op!r}" if dec.op else "")
                raise PlanFileError(f"plan has two decisions for {what}; keep one")
            seen.add(key)
            if dec.op is not None and dec.module not in recomputed:
                raise PlanFileError(
                    f"op decision {dec.op!r} in module {dec.module!r} needs a "
                    "whole-module recompute decision for that module; add one"
                )

    def recompute_modules(self) -> tuple[str, ...]:
        """Module paths checkpointed as a whole, in decision order."""
        return tuple(d.module for d in self.decisions if d.op is None and d.action == "recompute")

    def offload_decisions(self) -> tuple[Decision, ...]:
        """All offload decisions (whole-module and op-level)."""
        return tuple(d for d in self.decisions if d.action == "offload")

    def op_decisions(self, module: str) -> dict[str, Decision]:
        """Op-level decisions inside ``module``, keyed by op occurrence."""
        return {d.op: d for d in self.decisions if d.module == module and d.op is not None}

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "plan", **_plain(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, label: str = "plan") -> Plan:
        """Validate ``d`` against the schema and build a Plan. Raises PlanFileError."""
        return _load(d, label, "plan")

    def save(self, path: PathLike) -> None:
        _save(self.to_dict(), path)


@dataclass(frozen=True)
class PlanLadder:
    """One plan per sequence-length bucket, all for the same model."""

    buckets: tuple[tuple[int, Plan], ...]
    schema_version: int = SCHEMA_VERSION
    memplan_version: str = field(default_factory=_memplan_version)

    def __post_init__(self) -> None:
        buckets = tuple(sorted(((int(s), p) for s, p in self.buckets), key=lambda b: b[0]))
        if not buckets:
            raise PlanFileError("plan ladder has no buckets; give at least one (seq_len, plan)")
        seq_lens = [s for s, _ in buckets]
        if seq_lens[0] < 1 or len(set(seq_lens)) != len(seq_lens):
            raise PlanFileError(f"ladder bucket seq_lens must be distinct and >= 1, got {seq_lens}")
        fp = buckets[0][1].model.fingerprint
        for s, p in buckets:
            if p.model.fingerprint != fp:
                raise PlanFileError(
                    f"ladder bucket {s} is for model {p.model.fingerprint[:19]}, not "
                    f"{fp[:19]}; all buckets must plan the same model"
                )
            if p.config.get("seq_len") != s:
                raise PlanFileError(
                    f"ladder bucket {s} holds a plan made for seq_len "
                    f"{p.config.get('seq_len')}; plan each bucket at its seq_len"
                )
        object.__setattr__(self, "buckets", buckets)
        _validate(self.to_dict(), "plan ladder")

    @property
    def kind(self) -> str:
        return "ladder"

    def plan_for(self, seq_len: int) -> tuple[Plan, bool]:
        """Plan of the smallest bucket >= seq_len; (longest bucket's plan, True) beyond it."""
        if type(seq_len) is bool or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive integer, got {seq_len!r}")
        for s, p in self.buckets:
            if s >= seq_len:
                return p, False
        return self.buckets[-1][1], True

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "ladder",
            "schema_version": self.schema_version,
            "memplan_version": self.memplan_version,
            "buckets": [{"seq_len": s, "plan": p.to_dict()} for s, p in self.buckets],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, label: str = "plan ladder") -> PlanLadder:
        """Validate ``d`` against the schema and build a PlanLadder. Raises PlanFileError."""
        return _load(d, label, "ladder")

    def save(self, path: PathLike) -> None:
        _save(self.to_dict(), path)


@dataclass(frozen=True)
class CompiledPoint:
    """One split of a block by torch.compile's partitioner: what it saves and what its backward recomputes."""

    budget: float  # activation_memory_budget
    saved_bytes: int
    recompute_s: float
    recompute_flops: int
    backward_bytes: int  # peak its backward graph holds: saved tensors, recomputed ones and gradients
    forward_bytes: int  # peak its forward graph allocates: saved tensors, outputs and temporaries


@dataclass(frozen=True)
class CompiledPrediction:
    """What memplan predicts for a compiled step under the plan."""

    peak_bytes: int
    baseline_peak_bytes: int  # the eager step without a plan
    recompute_s: float
    # added time over the eager step without a plan: recompute_s, less what the whole model's compile
    # saves fusing the ops outside its blocks (below zero where that saves more)
    overhead: float


@dataclass(frozen=True)
class CompiledPlan:
    """A plan for training under torch.compile: each block's `activation_memory_budget` for the min-cut
    partitioner (module path -> fraction), with each block signature's frontier of splits."""

    model: ModelInfo
    config: dict[str, Any]
    budget_bytes: int
    budgets: dict[str, float]
    predicted: CompiledPrediction
    frontiers: dict[str, tuple[CompiledPoint, ...]]  # block signature -> its splits
    schema_version: int = SCHEMA_VERSION
    memplan_version: str = field(default_factory=_memplan_version)

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", _json_copy(self.config))
        object.__setattr__(self, "budgets", dict(self.budgets))
        object.__setattr__(self, "frontiers", {k: tuple(v) for k, v in self.frontiers.items()})
        _validate(self.to_dict(), "compiled plan")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "compiled", **_plain(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, label: str = "compiled plan") -> CompiledPlan:
        """Validate ``d`` against the schema and build a CompiledPlan. Raises PlanFileError."""
        return _load(d, label, "compiled")

    def save(self, path: PathLike) -> None:
        _save(self.to_dict(), path)


@dataclass(frozen=True)
class StagePlan:
    """The plan of one pipeline stage: its pp rank, microbatches in flight there, its blocks."""

    stage: int
    pp_rank: int
    in_flight: int
    blocks: tuple[str, ...]  # module paths of the stage's blocks in the whole model
    plan: Plan
    # modules (whole-model paths) whose recompute runs while the stage waits for a backward's
    # gradient, before that backward (planner.runtime.early_recompute); the rest recompute in it
    early_recompute: tuple[str, ...] = ()
    # the schedule splits this stage's backward into I then W (zero-bubble schedules, stages past
    # the first): its modules recompute whole, once in I, and hold what they make until W
    split_backward: bool = False


@dataclass(frozen=True)
class StagePlans:
    """One plan per pipeline stage, all for the same model, schedule and budget (kind 'stages')."""

    schedule: str
    pp: int
    microbatches: int
    budget_bytes: int
    stages: tuple[StagePlan, ...]
    schema_version: int = SCHEMA_VERSION
    memplan_version: str = field(default_factory=_memplan_version)

    def __post_init__(self) -> None:
        stages = tuple(
            sorted(
                (
                    dataclasses_replace(s, blocks=tuple(s.blocks), early_recompute=tuple(s.early_recompute))
                    for s in self.stages
                ),
                key=lambda s: s.stage,
            )
        )
        object.__setattr__(self, "stages", stages)
        if [s.stage for s in stages] != list(range(len(stages))):
            raise PlanFileError(
                f"stage plans must cover stages 0..{len(stages) - 1} once each, got {[s.stage for s in stages]}"
            )
        fps = {s.plan.model.fingerprint for s in stages}
        if len(fps) > 1:
            raise PlanFileError("stage plans are for different models; plan every stage of one model together")
        for s in stages:
            outside = [d.module for d in s.plan.decisions if not _under(d.module, s.blocks)]
            recomputed = {d.module for d in s.plan.decisions if d.action == "recompute" and d.op is None}
            recomputed -= {d.module for d in s.plan.decisions if d.action == "keep"}
            stray = [m for m in s.early_recompute if m not in recomputed]
            if stray:
                raise PlanFileError(
                    f"stage {s.stage}'s plan runs {stray[0]!r} early, but does not recompute it whole; re-plan with "
                    "memplan plan --pp"
                )
            if outside:
                raise PlanFileError(
                    f"stage {s.stage}'s plan names module {outside[0]!r}, which is not in its blocks; re-plan with "
                    "memplan plan --pp"
                )
            selective = [d.module for d in s.plan.decisions if d.op is not None and d.action == "keep"]
            if s.split_backward and selective:
                raise PlanFileError(
                    f"stage {s.stage}'s backward is split (I then W), where a module recomputes whole, but its plan "
                    f"recomputes {selective[0]!r} selectively; re-plan with memplan plan --pp"
                )
        _validate(self.to_dict(), "stage plans")

    @property
    def kind(self) -> str:
        return "stages"

    def plan_for_stage(self, stage: int) -> StagePlan:
        """The plan of pipeline stage `stage`; ValueError naming the stages there are."""
        if type(stage) is bool or not isinstance(stage, int) or not 0 <= stage < len(self.stages):
            raise PlanFileError(f"stage must be one of 0..{len(self.stages) - 1} for these stage plans, got {stage!r}")
        return self.stages[stage]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "stages",
            "schema_version": self.schema_version,
            "memplan_version": self.memplan_version,
            "schedule": self.schedule,
            "pp": self.pp,
            "microbatches": self.microbatches,
            "budget_bytes": self.budget_bytes,
            "stages": [
                {
                    "stage": s.stage,
                    "pp_rank": s.pp_rank,
                    "in_flight": s.in_flight,
                    "blocks": list(s.blocks),
                    "plan": s.plan.to_dict(),
                    **({"early_recompute": list(s.early_recompute)} if s.early_recompute else {}),
                    **({"split_backward": True} if s.split_backward else {}),
                }
                for s in self.stages
            ],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, label: str = "stage plans") -> StagePlans:
        """Validate ``d`` against the schema and build StagePlans. Raises PlanFileError."""
        return _load(d, label, "stages")

    def save(self, path: PathLike) -> None:
        _save(self.to_dict(), path)


def _under(module: str, blocks: tuple[str, ...]) -> bool:
    return any(module == b or module.startswith(b + ".") for b in blocks)


def _load(d: Any, label: str, want: str | None = None) -> Plan | PlanLadder | CompiledPlan | StagePlans:
    """The one loader: validate a plan, ladder or compiled plan dict, then build its dataclasses."""
    kind = _validate(d, label)
    if want is not None and kind != want:
        names = {
            "plan": "a single plan (Plan)",
            "ladder": "a ladder (PlanLadder)",
            "compiled": "a compiled plan",
            "stages": "a plan per pipeline stage (StagePlans)",
        }
        raise PlanFileError(f"{label} is {names[kind]}, not {names[want]}; use load_plan")
    try:
        if kind == "plan":
            return _plan(d)
        if kind == "compiled":
            return _compiled(d)
        if kind == "stages":
            return _stages(d)
        return PlanLadder(
            tuple((b["seq_len"], _plan(b["plan"])) for b in d["buckets"]), d["schema_version"], d["memplan_version"]
        )
    except PlanFileError as e:
        raise PlanFileError(f"{label} is invalid: {e}") from None


def _plan(d: Mapping[str, Any]) -> Plan:
    parts = {"model": ModelInfo, "predicted": Predicted, "solver": SolverInfo}
    fields = {k: v for k, v in d.items() if k != "kind"}
    fields.update({k: cls(**d[k]) for k, cls in parts.items()})
    fields["decisions"] = tuple(Decision(**x) for x in d["decisions"])
    return Plan(**fields)


def _stages(d: Mapping[str, Any]) -> StagePlans:
    return StagePlans(
        schedule=d["schedule"],
        pp=d["pp"],
        microbatches=d["microbatches"],
        budget_bytes=d["budget_bytes"],
        stages=tuple(
            StagePlan(
                s["stage"],
                s["pp_rank"],
                s["in_flight"],
                tuple(s["blocks"]),
                _plan(s["plan"]),
                tuple(s.get("early_recompute", ())),
                s.get("split_backward", False),
            )
            for s in d["stages"]
        ),
        schema_version=d["schema_version"],
        memplan_version=d["memplan_version"],
    )


def _compiled(d: Mapping[str, Any]) -> CompiledPlan:
    return CompiledPlan(
        model=ModelInfo(**d["model"]),
        config=d["config"],
        budget_bytes=d["budget_bytes"],
        budgets=d["budgets"],
        predicted=CompiledPrediction(**d["predicted"]),
        frontiers={k: tuple(CompiledPoint(**p) for p in v) for k, v in d["frontiers"].items()},
        schema_version=d["schema_version"],
        memplan_version=d["memplan_version"],
    )


def _save(d: dict[str, Any], path: PathLike) -> None:
    write_text(path, json.dumps(d, indent=2, sort_keys=True, allow_nan=False) + "\n")


def load_plan(path_or_dict: PathLike | Mapping[str, Any]) -> Plan | PlanLadder | CompiledPlan | StagePlans:
    """Load a plan, ladder, compiled plan or plan per pipeline stage from a JSON file or an already-parsed dict. Raises PlanFileError."""
    if isinstance(path_or_dict, Mapping):
        return _load(dict(path_or_dict), "plan")
    path = Path(path_or_dict)
    label = f"plan file {clean(path)}"
    try:
        raw = read_bounded(path, JSON_MAX_BYTES, "plan file")
    except ValueError as e:
        raise PlanFileError(str(e)) from None
    try:  # bounded depth and numbers; duplicate keys refused
        d = loads_json(raw, label)
    except ValueError as e:
        raise PlanFileError(f"{e}; re-export it with memplan plan") from None
    return _load(d, label)
