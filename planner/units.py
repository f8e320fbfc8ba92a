"""Sizes and counts as people write them: parse '40GiB', format 1536 as '1.50 KiB'."""

from __future__ import annotations

import re

__all__ = ["fit_verdict", "format_bytes", "format_count", "over_budget", "parse_bytes"]

MAX_BYTES = 2**63
"""Sizes at or above this are refused (plans store int64 bytes)."""
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fit_verdict(peak_bytes: float, capacity_bytes: float) -> str:
    """The one wording of whether a peak fits: 'fits (headroom 1.50 GiB)' or 'does NOT fit (short by 2.00 GiB)'."""
    free = capacity_bytes - peak_bytes
    if free >= 0:
        return f"fits (headroom {format_bytes(free)})"
    return f"does NOT fit (short by {format_bytes(-free)})"


def over_budget(peak_bytes: float, budget_bytes: float) -> str:
    """The one wording of a peak above its budget: '42.00 GiB, over the budget 40.00 GiB by 2.00 GiB'."""
    return (
        f"{format_bytes(peak_bytes)}, over the budget {format_bytes(budget_bytes)} "
        f"by {format_bytes(peak_bytes - budget_bytes)}"
    )


def format_count(n: int) -> str:
    """124439808 -> '124.44M'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def parse_bytes(text: str) -> int:
    """'40GiB', '123456789B', '1.5 TB' -> bytes; ValueError that lists the accepted units."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(
            f"cannot read size '{text}'; write a number with a unit, e.g. 40GiB, 80GB, "
            "512MiB or 123456789B (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    if len(m.group(1)) > 24 or float(m.group(1)) * _UNITS[unit] >= MAX_BYTES:
        raise ValueError(f"size '{str(text).strip()[:40]}' is too large; sizes go up to 8 EiB (2**63 bytes)")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got '{text}'")
    return value
