"""The one CP-SAT configuration every memplan solve uses: the same plan on every run and machine."""

from __future__ import annotations

from ortools.sat.python import cp_model

__all__ = ["WALL_BACKSTOP_FACTOR", "deterministic_solver"]

WALL_BACKSTOP_FACTOR = 3.0
"""Wall-clock limit as a multiple of the deterministic limit: a backstop on a slow machine only."""


def deterministic_solver(time_limit: float) -> cp_model.CpSolver:
    """A CP-SAT solver limited by `time_limit` units of CP-SAT's deterministic time (about a second
    of one core each, but counted in work, so a limit that is hit stops at the same point on every
    run), with one worker and a fixed seed."""
    solver = cp_model.CpSolver()
    solver.parameters.max_deterministic_time = float(time_limit)
    solver.parameters.max_time_in_seconds = WALL_BACKSTOP_FACTOR * float(time_limit)
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    return solver
