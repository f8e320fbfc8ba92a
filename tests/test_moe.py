"""The routing memplan assumes for mixture-of-experts models (tracing/moe.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from planner.errors import MemplanError
from planner.tracing.moe import RoutingAssumption, routed_indices


@given(tokens=st.integers(1, 64), experts=st.integers(2, 16), top_k=st.integers(1, 4), imbalance=st.floats(1.0, 8.0))
def test_routed_indices_are_valid_and_size_the_busiest_expert(tokens, experts, top_k, imbalance):
    top_k = min(top_k, experts - 1)
    indices = routed_indices(tokens, experts, top_k, imbalance)
    assert indices.shape == (tokens, top_k)
    assert int(indices.min()) >= 0 and int(indices.max()) < experts
    assert all(len(set(row.tolist())) == top_k for row in indices)  # a token picks an expert once
    counts = indices.flatten().bincount(minlength=experts)
    assert int(counts[0]) == min(tokens, round(imbalance * tokens * top_k / experts))
    assert int(counts.sum()) == tokens * top_k  # whatever the routing
    if imbalance == 1.0:
        assert float((counts.float() - tokens * top_k / experts).abs().max()) <= 1.5


def _routed_by_loop(tokens: int, experts: int, top_k: int, imbalance: float) -> list[list[int]]:
    """The routing rule written as a loop over tokens (the vectorized one must equal it)."""
    if top_k >= experts or experts < 2:
        return [[k % experts for k in range(top_k)] for _ in range(tokens)]
    busiest = min(tokens, max(0, round(imbalance * tokens * top_k / experts)))
    rows, cursor = [], 0
    for t in range(tokens):
        row = [0] if t < busiest else []
        while len(row) < top_k:
            row.append(1 + cursor % (experts - 1))
            cursor += 1
        rows.append(row)
    return rows


@given(tokens=st.integers(1, 80), experts=st.integers(1, 20), top_k=st.integers(1, 9), imbalance=st.floats(0.0, 30.0))
def test_routed_indices_follow_the_round_robin_rule(tokens, experts, top_k, imbalance):
    indices = routed_indices(tokens, experts, top_k, imbalance)
    assert indices.tolist() == _routed_by_loop(tokens, experts, top_k, imbalance)
    indices.fill_(-1)  # a caller's writes do not reach the next call's indices
    assert routed_indices(tokens, experts, top_k, imbalance).tolist() == _routed_by_loop(
        tokens, experts, top_k, imbalance
    )


def test_routed_indices_are_real_inside_a_fake_tensor_mode():
    from memplan_compat import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        inside = routed_indices(64, 8, 2, 2.0)
    assert not isinstance(inside, FakeTensor) and inside.tolist() == _routed_by_loop(64, 8, 2, 2.0)
    assert not isinstance(routed_indices(64, 8, 2, 2.0), FakeTensor)  # nor does the cache keep a fake one


def test_imbalance_below_one_is_refused():
    with pytest.raises(MemplanError, match="--moe-imbalance"):
        RoutingAssumption(0.5)
