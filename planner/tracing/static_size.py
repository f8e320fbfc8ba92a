"""Sizes a trace needs as plain integers."""

from __future__ import annotations

from typing import Any

from planner.errors import TraceError

__all__ = ["as_int"]


def as_int(value: Any, what: str) -> int:
    """`value` (an int or a backed symbolic size) as an int; a data-dependent size is a TraceError."""
    try:
        return int(value)
    except Exception as exc:  # a data-dependent (unbacked) size cannot become an int
        raise TraceError(f"{what} has a data-dependent size ({value}); memplan needs static shapes") from exc
