"""Expert-parallel plans: how a mixture-of-experts model's experts are sharded over an EP mesh (``--ep-plan``).

- ``auto``: the model's own plan where it ships one (a transformers model whose config carries
  ``base_model_ep_plan``, e.g. Mixtral, Qwen3-MoE, DeepSeek-V3: transformers' own
  ``apply_expert_parallelism`` shards the fused experts and installs its all-to-all dispatch), else
  memplan's for the torchtitan-style grouped experts it recognises (``forward(x,
  num_tokens_per_expert)``, every expert on dim 0 of each parameter), sharded with
  :class:`~planner.tracing.parallel.expert_parallel.ExpertParallel`. Routers and shared experts stay
  replicated.
- ``PATH.py:FUNC`` / ``package.module:FUNC``: the user's ``FUNC(model, ep_mesh)``.

Under tensor parallel (memplan's auto plan on torchtitan-style experts) each rank's experts are
also sharded over the TP ranks, as torchtitan's ``ExpertTensorParallel``: EP over the ``ep``
dimension, the hidden dimension of every expert over ``tp``. transformers' plan keeps every expert
whole on each TP rank instead: the TP ranks split the batch they share, each sends its slice of the
tokens over ``ep`` (its dispatch), and FSDP2 shards those experts over ``edp × tp``
(:func:`expert_tp_replicas`).

A resolved plan is called ``plan(model, mesh)`` with the ``[edp, ep, tp]`` mesh of expert parallel
(the TP dimension: the ranks that hold the same batch, which transformers' dispatch needs); the
same one runs on the fake-tensor model of a trace and on the real model of a verification run.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from planner.errors import SpecError
from planner.tracing.parallel.expert_parallel import ExpertParallel
from planner.tracing.parallel.user_plans import user_plan

__all__ = [
    "EpPlan",
    "expert_hidden_dims",
    "expert_modules",
    "expert_paths",
    "expert_tp_replicas",
    "expert_trace_meta",
    "is_expert_param",
    "is_grouped_experts",
    "resolve_ep_plan",
]

EpPlan = Callable[[nn.Module, DeviceMesh], object]


def is_grouped_experts(module: object) -> bool:
    """torchtitan's GroupedExperts shape: forward(x, num_tokens_per_expert), params [num_experts, ...]."""
    if not isinstance(module, nn.Module):
        return False
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
    return {name: m.num_experts for name, m in model.named_modules() if is_grouped_experts(m)}


def _check_experts(experts: dict[str, int], ep: int) -> None:
    for path, count in experts.items():
        if count % ep:
            fits = max(d for d in range(1, ep) if all(c % d == 0 for c in experts.values()))
            raise SpecError(
                f"--ep {ep} does not divide the {count} experts of {path}: expert parallel gives each rank whole "
                f"experts; use a --ep that divides the expert count (e.g. --ep {fits})"
            )


def _auto_plan(model: nn.Module, mesh: DeviceMesh) -> None:
    ep_mesh, tp_mesh = mesh["ep"], mesh["tp"]
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
        experts_module = model.get_submodule(path)
        if tp_mesh.size() > 1:
            ExpertParallel(hidden_dims=expert_hidden_dims(experts_module, path))._apply(
                experts_module, mesh["ep", "tp"]
            )
        else:
            ExpertParallel()._apply(experts_module, ep_mesh)


def is_expert_param(p: object) -> bool:
    """Whether a parameter is sharded by expert parallel (a DTensor on a mesh with an ``ep`` dimension)."""
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())


def expert_paths(model: nn.Module) -> list[str]:
    """Paths of the modules that hold expert-parallel parameters, sorted."""
    return sorted({n.rpartition(".")[0] for n, p in model.named_parameters() if is_expert_param(p)})


def expert_tp_replicas(model: nn.Module, tp: int) -> int:
    """How many tensor-parallel ranks hold the same experts: 1 when the EP plan shards the experts
    over ``tp`` too (memplan's on torchtitan-style experts), else ``tp`` (transformers': each TP rank
    keeps its experts whole and runs its slice of the tokens)."""
    for p in model.parameters():
        if is_expert_param(p):
            names = p.device_mesh.mesh_dim_names
            if "tp" in names and p.placements[names.index("tp")].is_shard():
                return 1
    return tp


def expert_trace_meta(model: nn.Module, ep: int, ep_plan: str, tp: int = 1) -> dict[str, object]:
    """What a rank's trace records of its expert sharding: the degree, the plan, which parameters are
    experts', their local shapes, the modules holding them and the TP ranks holding the same experts
    (costs.model_states_for and the FSDP2 model read them)."""
    params = list(model.parameters())
    return {
        "ep": ep,
        "ep_plan": ep_plan,
        "ep_expert_tp_replicas": expert_tp_replicas(model, tp),
        "ep_expert_params": tuple(is_expert_param(p) for p in params),
        "ep_expert_shapes": [tuple(p.to_local().shape) for p in params if is_expert_param(p)],
        "ep_expert_modules": expert_paths(model),
    }


def expert_hidden_dims(module: nn.Module, path: str) -> dict[str, int]:
    """Parameter name -> the dimension tensor parallel shards of torchtitan's grouped experts (w1 and
    w3 ``[experts, hidden, dim]``: 1; w2 ``[experts, dim, hidden]``: 2); a one-line error for others."""
    names = {n for n, _ in module.named_parameters(recurse=False)}
    if names != {"w1", "w2", "w3"}:
        raise SpecError(
            f"--tp with --ep: memplan shards torchtitan's grouped experts (w1, w2, w3) over tensor parallel, and "
            f"{path} holds {', '.join(sorted(names))}; pass --ep-plan PATH.py:FUNC with FUNC(model, ep_mesh)"
        )
    return {"w1": 1, "w2": 2, "w3": 1}


def resolve_ep_plan(spec: str) -> EpPlan:
    """``auto`` or a ``PATH.py:FUNC`` / ``package.module:FUNC`` spec -> plan(model, mesh) over the
    ``[edp, ep, tp]`` mesh (a user's FUNC gets its ``ep`` dimension)."""
    if spec == "auto":
        return _auto_plan
    plan = user_plan("ep-plan", spec, "ep_mesh")
    return lambda model, mesh: plan(model, mesh["ep"])
