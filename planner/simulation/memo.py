"""Results computed from a traced graph, kept for the most recent keys while the graph lives
(a layout search asks for the same ones across microbatch counts and recompute levels)."""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable, Hashable
from typing import TypeVar

from planner.tracing.graph import OpGraph

__all__ = ["memo"]

T = TypeVar("T")
ENTRIES_PER_KIND = 8

_CACHES: dict[str, dict[tuple, tuple[weakref.ref, object]]] = defaultdict(dict)


def memo(kind: str, graph: OpGraph, key: Hashable, make: Callable[[], T]) -> T:
    """`make()` for (graph, key) of this kind, reused while the graph lives; callers treat it as read-only."""
    cache = _CACHES[kind]
    full = (id(graph), key)
    hit = cache.get(full)
    if hit is not None and hit[0]() is graph:
        cache[full] = cache.pop(full)  # most recently used last
        return hit[1]  # type: ignore[return-value]
    value = make()
    while len(cache) >= ENTRIES_PER_KIND:
        del cache[next(iter(cache))]
    cache[full] = (weakref.ref(graph), value)
    weakref.finalize(graph, cache.pop, full, None)
    return value
