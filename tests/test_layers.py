"""Imports go one way: a module imports nothing from a layer above its own (../shared/DESIGN.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. analysis (diagnose, fit, snapshots, OOM messages: offline, on traces) sits below
# runtime (the live model), whose OOM report prices diagnose's remedies. The base layer (config, units, errors, safe_io, signals, compat) serves every
# package of planner/; costmodels/ and compat/ import nothing from planner/.
LAYERS = (
    "compat",
    "costmodels",
    "base",
    "tracing",
    "plans",
    "simulation",
    "solver",
    "analysis",
    "runtime",
    "integrations",
    "api",
    "cli",
)
BASE_MODULES = {"budgets", "config", "units", "errors", "safe_io", "signals"}


def layer_of(module: str) -> str | None:
    """The layer of a dotted module name inside this project, None for anything else."""
    parts = module.split(".")
    if parts[0] in ("memplan_compat", "costmodels"):
        return "compat" if parts[0] == "memplan_compat" else "costmodels"
    if parts[0] != "planner":
        return None
    if len(parts) == 1:
        return "api"  # planner/__init__.py: the public API
    name = parts[1]
    if name in BASE_MODULES:
        return "base"
    assert name in LAYERS, f"{module}: planner.{name} belongs to no layer; add it to LAYERS in {__file__}"
    return name


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, lazy ones inside functions included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def upward_imports() -> list[str]:
    violations = []
    for package in ("memplan_compat", "costmodels", "planner"):
        for path in sorted((ROOT / package).rglob("*.py")):
            here = layer_of(_module_name(path))
            for line, target in _imports(path):
                there = layer_of(target)
                if there is not None and LAYERS.index(there) > LAYERS.index(here):
                    violations.append(f"{path.relative_to(ROOT)}:{line} ({here}) imports {target} ({there})")
    return violations


def test_no_module_imports_from_a_layer_above():
    assert upward_imports() == []


def test_the_checker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from planner.cli.main import main\nimport planner.runtime.apply\n")
    found = [target for _, target in _imports(bad)]
    assert found == ["planner.cli.main", "planner.runtime.apply"]
    assert LAYERS.index(layer_of("planner.cli.main")) > LAYERS.index(layer_of("planner.tracing.graph"))
    assert layer_of("planner.config") == "base" and layer_of("torch.nn") is None
