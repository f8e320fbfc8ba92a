"""memplan's errors: every user-facing failure is a :class:`MemplanError` with a one-line message
that says what to do. The CLI prints it as one line and exits with code 2."""

from __future__ import annotations

__all__ = [
    "MemplanError",
    "SpecError",
    "SequenceParallelUnsupported",
    "TraceError",
    "PlanFileError",
    "InfeasibleBudget",
    "SolverTimeout",
]


class MemplanError(ValueError):
    """Root of memplan's errors (a ValueError, so callers that catch ValueError keep working)."""


class SpecError(MemplanError):
    """A model spec that cannot be resolved or built."""


class SequenceParallelUnsupported(SpecError):
    """A tensor-parallel plan that runs only without sequence parallel (``--no-sp``) on this model."""


class TraceError(MemplanError):
    """The model could not be traced on fake tensors."""


class PlanFileError(MemplanError):
    """A plan file that is malformed, from another schema version, or does not match the model."""


class InfeasibleBudget(MemplanError):
    """No plan in the search space fits the budget; `smallest_peak_bytes` is the lowest peak
    memplan can reach (None when not computed)."""

    def __init__(self, message: str, smallest_peak_bytes: int | None = None) -> None:
        super().__init__(message)
        self.smallest_peak_bytes = smallest_peak_bytes


class SolverTimeout(MemplanError):
    """The solver found no plan within its time limit."""
