"""The versioned plan file of memplan.

A plan says, for one model and training config, which activations to keep,
recompute (activation checkpointing) or offload. A ladder holds one plan per
sequence-length bucket for the same model. Files are JSON, validated against
``planner/plans/schema/plan.schema.json`` (Draft 2020-12).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata, resources
from pathlib import Path
from typing import Any, Literal, Mapping, Union

import jsonschema
import jsonschema.exceptions

from planner.errors import PlanFileError
from planner.safe_io import JSON_MAX_BYTES, clean, loads_json, read_bounded, write_text
from planner.tracing.fingerprint import (
    is_segment_of,
    model_fingerprint,
    num_parameters,
)

__all__ = [
    "SCHEMA_VERSION",
    "ACTIONS",
    "TARGETS",
    "SOLVER_STATUSES",
    "Decision",
    "Predicted",
    "SolverInfo",
    "ModelInfo",
    "Plan",
    "PlanLadder",
    "load_plan",
    "plan_schema",
    "model_fingerprint",
    "model_info",
    "check_plan_matches",
]

SCHEMA_VERSION = 1
ACTIONS = ("keep", "recompute", "offload")
TARGETS = ("cpu", "disk")
SOLVER_STATUSES = ("OPTIMAL", "FEASIBLE", "INFEASIBLE", "NOT_SOLVED")
CONFIG_KEYS = ("batch_size", "seq_len", "precision", "optimizer", "zero_stage", "dp", "gpu")

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


@lru_cache(maxsize=2)
def _validator(kind: str) -> jsonschema.Draft202012Validator:
    # Validate against the branch chosen by "kind" so errors point at the real
    # problem instead of "not valid under any of the given schemas".
    root = {k: v for k, v in plan_schema().items() if k != "oneOf"}
    root["$ref"] = f"#/$defs/{kind}"
    return jsonschema.Draft202012Validator(root)


def _json_path(path: Any) -> str:
    parts = [str(p) for p in path]
    return "/".join(parts) if parts else "(top level)"


def _validate(d: Any, label: str) -> str:
    """Check version then schema of a plan dict; return its kind. Raises ValueError."""
    if not isinstance(d, dict):
        raise ValueError(f"{label} must hold a JSON object, got {type(d).__name__}; "
                         "re-create it with memplan plan")
    version = d.get("schema_version")
    if "schema_version" in d and (type(version) is not int or version != SCHEMA_VERSION):
        raise ValueError(f"{label} has schema_version {version!r}; this memplan reads version "
                         f"{SCHEMA_VERSION}: re-create it with memplan plan")
    kind = d.get("kind")
    if kind not in ("plan", "ladder"):
        raise ValueError(f"{label} is invalid at kind: {kind!r} is not one of ['plan', 'ladder']")
    err = jsonschema.exceptions.best_match(_validator(kind).iter_errors(d))
    if err is not None:
        raise ValueError(f"{label} is invalid at {_json_path(err.absolute_path)}: {err.message}")
    return kind


def _finite(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}; use a finite value")
    return value


def _nonneg_int(name: str, value: int) -> int:
    if type(value) is bool or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Decision:
    """What to do with the activations of one module (op=None) or one op occurrence."""

    module: str
    action: Action
    op: str | None = None
    target: Target | None = None

    def __post_init__(self) -> None:
        where = f"decision for module {self.module!r}" + (f" op {self.op!r}" if self.op else "")
        if self.action not in ACTIONS:
            raise ValueError(f"{where} has action {self.action!r}; use one of {list(ACTIONS)}")
        if self.action == "offload" and self.target not in TARGETS:
            raise ValueError(f"{where} offloads without a valid target ({self.target!r}); "
                             f"set target to one of {list(TARGETS)}")
        if self.action != "offload" and self.target is not None:
            raise ValueError(f"{where} has target {self.target!r} but action {self.action!r}; "
                             "only offload decisions take a target")
        if self.op is not None and ("#" not in self.op or not self.op.rsplit("#", 1)[1].isdigit()):
            raise ValueError(f"{where} has a malformed op; name it like 'aten.mm.default#2'")

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "action": self.action, "op": self.op, "target": self.target}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Decision:
        return cls(module=d["module"], action=d["action"], op=d.get("op"), target=d.get("target"))


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

    def __post_init__(self) -> None:
        for name in ("peak_bytes", "baseline_peak_bytes", "recompute_flops", "offload_bytes"):
            object.__setattr__(self, name, _nonneg_int(f"predicted.{name}", getattr(self, name)))
        for name in ("recompute_s", "exposed_offload_s", "step_s", "overhead"):
            object.__setattr__(self, name, _finite(f"predicted.{name}", getattr(self, name)))

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Predicted:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class SolverInfo:
    """How the plan was found (baselines use status NOT_SOLVED)."""

    status: str
    objective: float
    bound: float
    gap: float
    wall_s: float

    def __post_init__(self) -> None:
        if self.status not in SOLVER_STATUSES:
            raise ValueError(f"solver status {self.status!r} is unknown; use one of "
                             f"{list(SOLVER_STATUSES)}")
        for name in ("objective", "bound", "gap", "wall_s"):
            object.__setattr__(self, name, _finite(f"solver.{name}", getattr(self, name)))

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SolverInfo:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class ModelInfo:
    """Identity of the model a plan was made for."""

    spec: str
    fingerprint: str
    num_parameters: int
    num_modules: int

    def __post_init__(self) -> None:
        fp = self.fingerprint
        if not (isinstance(fp, str) and fp.startswith("sha256:") and len(fp) == 71):
            raise ValueError(f"model fingerprint {fp!r} is malformed; compute it with "
                             "model_fingerprint(model)")
        _nonneg_int("model.num_parameters", self.num_parameters)
        _nonneg_int("model.num_modules", self.num_modules)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelInfo:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


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
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(f"plan has schema_version {self.schema_version!r}; this memplan "
                             f"writes version {SCHEMA_VERSION}")
        try:  # deep copy as plain JSON so the plan round-trips exactly
            config = json.loads(json.dumps(dict(self.config), allow_nan=False))
        except (TypeError, ValueError) as e:
            raise ValueError(f"plan config must be JSON-serializable: {e}") from None
        missing = [k for k in CONFIG_KEYS if k not in config]
        if missing:
            raise ValueError(f"plan config is missing {', '.join(missing)}; "
                             f"give all of {', '.join(CONFIG_KEYS)}")
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "budget_bytes", _nonneg_int("budget_bytes", self.budget_bytes))
        object.__setattr__(self, "decisions", tuple(self.decisions))
        seen: set[tuple[str, str | None]] = set()
        recomputed = self.recompute_modules()
        for dec in self.decisions:
            key = (dec.module, dec.op)
            if key in seen:
                what = f"module {dec.module!r}" + (f" op {dec.op!r}" if dec.op else "")
                raise ValueError(f"plan has two decisions for {what}; keep one")
            seen.add(key)
            if dec.op is not None and dec.module not in recomputed:
                raise ValueError(f"op decision {dec.op!r} in module {dec.module!r} needs a "
                                 "whole-module recompute decision for that module; add one")

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
        return {
            "kind": "plan",
            "schema_version": self.schema_version,
            "memplan_version": self.memplan_version,
            "model": self.model.to_dict(),
            "config": json.loads(json.dumps(self.config)),
            "budget_bytes": self.budget_bytes,
            "strategy": self.strategy,
            "decisions": [d.to_dict() for d in self.decisions],
            "predicted": self.predicted.to_dict(),
            "solver": self.solver.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, label: str = "plan") -> Plan:
        """Validate ``d`` against the schema and build a Plan. Raises ValueError."""
        kind = _validate(d, label)
        if kind != "plan":
            raise ValueError(f"{label} is a ladder, not a single plan; use PlanLadder or load_plan")
        return _wrap(label, _plan_from_valid, d)

    def save(self, path: PathLike) -> None:
        _save(self.to_dict(), path)


def _plan_from_valid(d: Mapping[str, Any]) -> Plan:
    return Plan(
        model=ModelInfo.from_dict(d["model"]),
        config=d["config"],
        budget_bytes=d["budget_bytes"],
        strategy=d["strategy"],
        decisions=tuple(Decision.from_dict(x) for x in d["decisions"]),
        predicted=Predicted.from_dict(d["predicted"]),
        solver=SolverInfo.from_dict(d["solver"]),
        schema_version=d["schema_version"],
        memplan_version=d["memplan_version"],
    )


@dataclass(frozen=True)
class PlanLadder:
    """One plan per sequence-length bucket, all for the same model."""

    buckets: tuple[tuple[int, Plan], ...]
    schema_version: int = SCHEMA_VERSION
    memplan_version: str = field(default_factory=_memplan_version)
    kind: Literal["ladder"] = "ladder"

    def __post_init__(self) -> None:
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(f"ladder has schema_version {self.schema_version!r}; this memplan "
                             f"writes version {SCHEMA_VERSION}")
        if self.kind != "ladder":
            raise ValueError(f"ladder kind must be 'ladder', got {self.kind!r}")
        buckets = tuple(sorted(((int(s), p) for s, p in self.buckets), key=lambda b: b[0]))
        if not buckets:
            raise ValueError("plan ladder has no buckets; give at least one (seq_len, plan)")
        seq_lens = [s for s, _ in buckets]
        if seq_lens[0] < 1 or len(set(seq_lens)) != len(seq_lens):
            raise ValueError(f"ladder bucket seq_lens must be distinct and >= 1, got {seq_lens}")
        fp = buckets[0][1].model.fingerprint
        for s, p in buckets:
            if p.model.fingerprint != fp:
                raise ValueError(f"ladder bucket {s} is for model {p.model.fingerprint[:19]}, not "
                                 f"{fp[:19]}; all buckets must plan the same model")
            if p.config.get("seq_len") != s:
                raise ValueError(f"ladder bucket {s} holds a plan made for seq_len "
                                 f"{p.config.get('seq_len')}; plan each bucket at its seq_len")
        object.__setattr__(self, "buckets", buckets)

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
        """Validate ``d`` against the schema and build a PlanLadder. Raises ValueError."""
        kind = _validate(d, label)
        if kind != "ladder":
            raise ValueError(f"{label} is a single plan, not a ladder; use Plan or load_plan")
        return _wrap(label, _ladder_from_valid, d)

    def save(self, path: PathLike) -> None:
        _save(self.to_dict(), path)


def _ladder_from_valid(d: Mapping[str, Any]) -> PlanLadder:
    return PlanLadder(
        buckets=tuple((b["seq_len"], _plan_from_valid(b["plan"])) for b in d["buckets"]),
        schema_version=d["schema_version"],
        memplan_version=d["memplan_version"],
    )


def _wrap(label: str, build: Any, d: Mapping[str, Any]) -> Any:
    try:
        return build(d)
    except ValueError as e:
        raise ValueError(f"{label} is invalid: {e}") from None


def _save(d: dict[str, Any], path: PathLike) -> None:
    write_text(path, json.dumps(d, indent=2, sort_keys=True, allow_nan=False) + "\n")


def load_plan(path_or_dict: PathLike | Mapping[str, Any]) -> Plan | PlanLadder:
    """Load a plan or ladder from a JSON file or an already-parsed dict. Raises ValueError."""
    if isinstance(path_or_dict, Mapping):
        d: Any = dict(path_or_dict)
        label = "plan"
    else:
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
    kind = _validate(d, label)
    return _wrap(label, _plan_from_valid if kind == "plan" else _ladder_from_valid, d)


# ---------------------------------------------------------------- model identity










def model_info(model: Any, spec: str) -> ModelInfo:
    """ModelInfo for ``model`` built from ``spec``."""
    return ModelInfo(
        spec=spec,
        fingerprint=model_fingerprint(model),
        num_parameters=num_parameters(model),
        num_modules=sum(1 for _ in model.named_modules()),
    )


def _human(n: int) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.1f}{suffix}"
    return str(n)


def check_plan_matches(plan: Plan, model: Any) -> None:
    """Raise ValueError saying what differs when ``plan`` was made for another model."""
    info = model_info(model, plan.model.spec)
    names = {name for name, _ in model.named_modules()}
    missing = list(dict.fromkeys(d.module for d in plan.decisions
                                 if d.module not in names and not is_segment_of(model, d.module)))
    if info.fingerprint == plan.model.fingerprint and not missing:
        return
    parts = []
    if plan.model.num_modules != info.num_modules:
        parts.append(f"{plan.model.num_modules} modules vs {info.num_modules}")
    if plan.model.num_parameters != info.num_parameters:
        parts.append(f"{_human(plan.model.num_parameters)} vs "
                     f"{_human(info.num_parameters)} parameters")
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        parts.append(f"modules not found: {', '.join(missing[:3])}{more}")
    if not parts:
        parts.append("same module and parameter counts but different structure, shapes or "
                     f"dtypes ({plan.model.fingerprint[:19]} vs {info.fingerprint[:19]})")
    spec = plan.model.spec or "<model>"
    raise ValueError(f"plan was made for a different model: {', '.join(parts)}; "
                     f"re-plan with memplan plan --model {spec}")
