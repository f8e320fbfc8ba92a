"""What a budget means: bytes, a size ('8GiB') or a percentage of the no-plan peak ('60%'); and
the bytes a device (or a budget) leaves usable once a reserve fraction is kept free."""

from __future__ import annotations

import re

from planner.errors import MemplanError
from planner.units import parse_bytes

__all__ = ["budget_request", "parse_budget", "usable_bytes"]

_BARE_FRACTION = re.compile(r"0*\.[0-9]+|0*1(\.0*)?")


def budget_request(budget: int | str) -> int | str:
    """A budget checked before the no-plan peak is known: bytes for an int or a size, the
    stripped text for a percentage (resolved by :func:`parse_budget`)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise MemplanError(
            f"budget must be bytes (int), a size such as '8GiB' or a percentage of the "
            f"no-plan peak such as '60%', got {budget!r}"
        )
    if isinstance(budget, int):
        if budget <= 0:
            raise MemplanError(f"budget must be positive, got {budget}")
        return budget
    text = budget.strip()
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            percent = -1.0
        if not 0 < percent <= 100:
            raise MemplanError(f"budget percentage must be in (0, 100], got '{budget}'")
        return text
    if _BARE_FRACTION.fullmatch(text):
        raise MemplanError(
            f"budget '{budget}' is a bare fraction; write a percentage of the no-plan peak such as "
            f"'{float(text):.0%}', or a size such as '8GiB' or bytes (an int)"
        )
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise MemplanError(str(exc)) from exc


def parse_budget(budget: int | str, baseline_peak_bytes: int) -> int:
    """Bytes from an int, a size with a unit ('8GiB') or a percentage of the no-plan peak ('60%')."""
    request = budget_request(budget)
    if isinstance(request, int):
        return request
    return int(baseline_peak_bytes * float(request[:-1]) / 100)


def usable_bytes(total_bytes: int, reserve: float) -> int:
    """`total_bytes` less the `reserve` fraction kept free (for the allocator and the CUDA context)."""
    if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or not 0 <= reserve < 1:
        raise MemplanError(f"reserve must be a fraction in [0, 1), got {reserve!r}")
    return int(total_bytes * (1 - reserve))
