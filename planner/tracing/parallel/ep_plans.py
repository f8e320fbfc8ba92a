"""Expert-parallel plans: how a mixture-of-experts model's experts are sharded over an EP mesh (``--ep-plan``).

- ``auto``: the model's own plan where it ships one (a transformers model whose config carries
  ``base_model_ep_plan``, e.g. Mixtral, Qwen3-MoE, DeepSeek-V3: transformers' own
  ``apply_expert_parallelism`` shards the fused experts and installs its all-to-all dispatch), else
  memplan's for the torchtitan-style grouped experts it recognises (``forward(x,
  num_tokens_per_expert)``, every expert on dim 0 of each parameter), sharded with
  :class:`~planner.tracing.parallel.expert_parallel.ExpertParallel`. Routers and shared experts stay
  replicated.
- ``PATH.py:FUNC`` / ``package.module:FUNC``: the user's ``FUNC(model, ep_mesh)``.

A resolved plan is called ``plan(model, ep_mesh, tp_mesh)`` (the TP mesh: the ranks that hold the
same batch, which transformers' dispatch needs); the same one runs on the fake-tensor model of a
trace and on the real model of a verification run.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from planner.errors import SpecError
from planner.tracing.parallel.expert_parallel import ExpertParallel
from planner.tracing.parallel.user_plans import user_plan

__all__ = ["EpPlan", "expert_modules", "resolve_ep_plan"]

EpPlan = Callable[[nn.Module, DeviceMesh, DeviceMesh], object]


def _is_grouped_experts(module: nn.Module) -> bool:
    """torchtitan's GroupedExperts shape: forward(x, num_tokens_per_expert), params [num_experts, ...]."""
    n = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    if not isinstance(n, int) or not params or any(p.dim() < 2 or p.shape[0] != n for p in params):
        return False
    try:
        return "num_tokens_per_expert" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _hf_expert_plan(model: nn.Module, ep: int) -> dict[str, str] | None:
    """transformers' resolved EP plan (module/parameter name -> style), None when the model ships none."""
    config = getattr(model, "config", None)
    if not getattr(config, "base_model_ep_plan", None) or not hasattr(model, "_resolve_parallel_plans"):
        return None
    from transformers.distributed import DistributedConfig

    _, plan, _ = model._resolve_parallel_plans(DistributedConfig(ep_size=ep, fsdp_size=ep))
    return plan or None


def expert_modules(model: nn.Module, ep: int = 2) -> dict[str, int]:
    """Module path -> expert count of every experts module memplan's auto plan shards."""
    hf = _hf_expert_plan(model, ep)
    if hf is not None:
        return {
            name: int(getattr(model.get_submodule(name), "num_experts", 0))
            for name, style in hf.items()
            if style == "ep_dispatch_experts"
        }
    return {name: m.num_experts for name, m in model.named_modules() if _is_grouped_experts(m)}


def _check_experts(experts: dict[str, int], ep: int) -> None:
    for path, count in experts.items():
        if count % ep:
            fits = max(d for d in range(1, ep) if all(c % d == 0 for c in experts.values()))
            raise SpecError(
                f"--ep {ep} does not divide the {count} experts of {path}: expert parallel gives each rank whole "
                f"experts; use a --ep that divides the expert count (e.g. --ep {fits})"
            )


def _auto_plan(model: nn.Module, ep_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> None:
    ep = ep_mesh.size()
    experts = expert_modules(model, ep)
    if not experts:
        raise SpecError(
            f"--ep-plan auto found no mixture-of-experts layers memplan recognises in {type(model).__name__}: "
            "--ep shards experts; drop --ep for a dense model, or pass --ep-plan PATH.py:FUNC with "
            "FUNC(model, ep_mesh)"
        )
    _check_experts(experts, ep)
    hf = _hf_expert_plan(model, ep)
    if hf is not None:
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        apply_expert_parallelism(model, ep_mesh, tp_mesh, hf)
        return
    for path in experts:
        ExpertParallel()._apply(model.get_submodule(path), ep_mesh)


def resolve_ep_plan(spec: str) -> EpPlan:
    """``auto`` or a ``PATH.py:FUNC`` / ``package.module:FUNC`` spec -> plan(model, ep_mesh, tp_mesh)."""
    if spec == "auto":
        return _auto_plan
    plan = user_plan("ep-plan", spec, "ep_mesh")
    return lambda model, ep_mesh, tp_mesh: plan(model, ep_mesh)
