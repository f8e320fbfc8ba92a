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


def test_imbalance_below_one_is_refused():
    with pytest.raises(MemplanError, match="--moe-imbalance"):
        RoutingAssumption(0.5)
