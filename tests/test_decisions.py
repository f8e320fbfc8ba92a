"""planner.plans.decisions: the one reading of a plan's decisions and the op-call keys."""

from __future__ import annotations

from planner.plans.decisions import ModulePlan, OpKeys, module_plans
from planner.plans.format import Decision


def test_op_keys_number_each_overload_separately() -> None:
    keys = OpKeys()
    names = ["aten.mm.default", "aten.relu.default", "aten.mm.default", "aten.mm.default"]
    assert [keys.next_key(n) for n in names] == [
        "aten.mm.default#0",
        "aten.relu.default#0",
        "aten.mm.default#1",
        "aten.mm.default#2",
    ]


def test_module_plans_read_whole_module_and_op_decisions() -> None:
    decisions = [
        Decision("layers.0", "recompute", None, None),
        Decision("layers.0", "keep", "aten.mm.default#0", None),
        Decision("layers.0", "recompute", "aten.relu.default#0", None),
        Decision("layers.1", "keep", None, None),
        Decision("layers.2", "offload", None, "disk"),
    ]
    assert module_plans(decisions) == {
        "layers.0": ModulePlan(
            "recompute", None, frozenset({"aten.mm.default#0"}), frozenset({"aten.mm.default#0", "aten.relu.default#0"})
        ),
        "layers.2": ModulePlan("offload", "disk"),
    }
