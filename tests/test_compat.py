"""torch's private APIs are reached through memplan_compat alone, and each one resolves here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import memplan_compat

ROOT = Path(__file__).resolve().parents[1]


def _is_private(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "torch" and any(p.startswith("_") for p in parts[1:])


def private_imports() -> list[str]:
    found = []
    for package in ("costmodels", "planner", "benchmarks", "examples"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if _is_private(n)]
    return found


def test_no_module_imports_a_private_torch_module_directly():
    assert private_imports() == []


@pytest.mark.parametrize("name", sorted(memplan_compat.PRIVATE_APIS))
def test_every_private_api_resolves_on_this_torch(name):
    assert getattr(memplan_compat, name) is not None


def test_this_torch_is_a_tested_release():
    assert ".".join(torch.__version__.split("+")[0].split(".")[:2]) in memplan_compat.TESTED_TORCH
