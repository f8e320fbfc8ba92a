"""planner.units: sizes as people write them, with signs kept and magnitudes bounded."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.units import MAX_BYTES, fit_verdict, format_bytes, over_budget, parse_bytes


@pytest.mark.parametrize("n, text", [(-2 * 2**30, "-2.00 GiB"), (-100, "-100 B"), (1536, "1.50 KiB"), (0, "0 B")])
def test_format_bytes_keeps_the_sign(n: int, text: str) -> None:
    assert format_bytes(n) == text


@settings(derandomize=True, deadline=None)
@given(st.integers(-(2**62), 2**62))
def test_format_bytes_sign_matches(n: int) -> None:
    assert format_bytes(n).startswith("-") == (n < 0)


@pytest.mark.parametrize("text", ["9" * 5000 + "GiB", "9" * 30, "8EiB", "9000000TiB", "1" * 400 + ".5 TB"])
def test_huge_sizes_are_one_line_value_errors(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes(text)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_largest_size_is_accepted() -> None:
    assert parse_bytes("8388607TiB") < MAX_BYTES


@pytest.mark.parametrize(
    "peak, capacity, text",
    [
        (2**30, 3 * 2**30, "fits (headroom 2.00 GiB)"),
        (3 * 2**30, 3 * 2**30, "fits (headroom 0 B)"),
        (5 * 2**30, 3 * 2**30, "does NOT fit (short by 2.00 GiB)"),
    ],
)
def test_fit_verdict_is_one_wording(peak: int, capacity: int, text: str) -> None:
    assert fit_verdict(peak, capacity) == text


def test_over_budget_names_peak_budget_and_excess() -> None:
    assert over_budget(42 * 2**30, 40 * 2**30) == "42.00 GiB, over the budget 40.00 GiB by 2.00 GiB"
