"""Which plan of a :class:`planner.plans.format.StagePlans` a pipeline stage module follows.

A stage module (torchtitan cuts its model into one per stage, keeping the block names: stage 1 of
a Llama holds ``layers.2``, ``layers.3``) runs the decisions of its stage's plan, with module paths
of the whole model re-rooted to the stage module: the longest tail of each path the stage module
has (``model.layers.2`` -> ``layers.2`` for a transformers decoder cut into ``HFStage``-like
modules). The stage's blocks must all be there; the plan is then checked against the stage
module, not the whole model's fingerprint (a stage module is not the model).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from planner.errors import PlanFileError
from planner.plans.format import Plan, StagePlans
from planner.plans.identity import model_info

__all__ = ["stage_plan_for_module"]


def _rooted(path: str, names: set[str]) -> str | None:
    parts = path.split(".")
    for k in range(len(parts)):
        tail = ".".join(parts[k:])
        if tail in names:
            return tail
    return None


def stage_plan_for_module(module: nn.Module, plans: StagePlans, stage: int | None) -> tuple[Plan, frozenset[str], bool]:
    """The plan of pipeline stage `stage`, with its module paths on `module` (a stage module or the
    whole model), the modules it recomputes early (StagePlan.early_recompute), on `module` too, and
    whether the stage's backward is split (StagePlan.split_backward).
    Raises PlanFileError when `stage` is missing or the module lacks the stage's blocks."""
    if stage is None:
        raise PlanFileError(
            f"this plan file holds one plan per pipeline stage ({len(plans.stages)} stages); "
            "pass the stage: apply_plan(stage_module, plan, stage=i)"
        )
    sp = plans.plan_for_stage(stage)
    names = {name for name, _ in module.named_modules()}
    rename = {}
    for block in sp.blocks:
        rooted = _rooted(block, names)
        if rooted is None:
            raise PlanFileError(
                f"the module has no '{block}', a block of pipeline stage {stage}; apply stage {stage}'s plan to "
                "the module that runs that stage"
            )
        rename[block] = rooted

    def moved(path: str) -> str:
        for block, rooted in rename.items():
            if path == block or path.startswith(block + "."):
                return rooted + path[len(block) :]
        return path

    decisions = tuple(dataclasses.replace(d, module=moved(d.module)) for d in sp.plan.decisions)
    plan = dataclasses.replace(sp.plan, decisions=decisions, model=model_info(module, sp.plan.model.spec))
    return plan, frozenset(moved(p) for p in sp.early_recompute), sp.split_backward
