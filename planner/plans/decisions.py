"""How a plan's decisions read, for the simulator and for apply_plan alike.

A plan names modules by path and ops by ``aten.name.overload#k``: the k-th call of that overload
in the module's forward. :class:`OpKeys` numbers the calls, both over a traced graph
(:func:`planner.simulation.effects.op_keys`) and live in a selective-checkpoint policy
(:mod:`planner.runtime.apply`); :func:`module_plans` is the one reading of the decisions.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from planner.plans.format import Decision

__all__ = ["ModulePlan", "OpKeys", "module_plans"]


@dataclass(frozen=True)
class ModulePlan:
    """What one module's forward does under a plan: recompute (keeping the outputs of `keep_ops`)
    or offload (to `target`). `named_ops` are all op keys the plan decides for the module."""

    action: str
    target: str | None = None
    keep_ops: frozenset[str] = frozenset()
    named_ops: frozenset[str] = frozenset()


class OpKeys:
    """Numbers the calls of each op overload in one forward: ``next_key(name)`` gives
    ``name#0``, then ``name#1``, ... (`name` as the trace writes it, ``str(overload)``)."""

    def __init__(self) -> None:
        self._calls: dict[str, int] = defaultdict(int)

    def next_key(self, name: str) -> str:
        k = self._calls[name]
        self._calls[name] = k + 1
        return f"{name}#{k}"


def module_plans(decisions: Iterable[Decision]) -> dict[str, ModulePlan]:
    """Module path -> ModulePlan for the whole-module decisions that change anything, in decision
    order. Op-level "keep" decisions of a recomputed module are its kept ops; any other op-level
    action means recompute; an offloaded module keeps nothing."""
    decisions = list(decisions)
    ops: dict[str, dict[str, str]] = defaultdict(dict)  # module -> op key -> action
    for d in decisions:
        if d.op is not None:
            ops[d.module][d.op] = d.action
    out: dict[str, ModulePlan] = {}
    for d in decisions:
        if d.op is not None or d.action == "keep":
            continue
        named = ops.get(d.module, {})
        keep = frozenset(op for op, action in named.items() if action == "keep" and d.action == "recompute")
        out[d.module] = ModulePlan(d.action, d.target, keep, frozenset(named))
    return out
