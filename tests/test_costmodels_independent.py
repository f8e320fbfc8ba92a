"""costmodels/ imports nothing from planner/: checked in its source and in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

COSTMODELS = Path(__file__).resolve().parent.parent / "costmodels"


def _imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
    return out


def test_no_costmodels_source_imports_planner() -> None:
    files = sorted(COSTMODELS.rglob("*.py"))
    assert files
    offenders = {
        str(f.relative_to(COSTMODELS)): sorted(m for m in _imported_modules(f) if m.split(".")[0] == "planner")
        for f in files
    }
    assert {f: m for f, m in offenders.items() if m} == {}


def test_importing_costmodels_loads_no_planner_module() -> None:
    modules = sorted(p.stem for p in COSTMODELS.glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module('costmodels.' + name)\n"
        "print(sorted(m for m in sys.modules if m == 'planner' or m.startswith('planner.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=COSTMODELS.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
