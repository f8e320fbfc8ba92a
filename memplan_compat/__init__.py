"""Every private torch API memplan uses, in one table, with the torch versions it holds for.

memplan reads torch's internals where no public API says what it needs: fake tensors and dispatch
modes for tracing, pytree for walking inputs, the partitioner and inductor's scheduler for compiled
plans, the fake process group for per-rank traces. Each name here is imported on first use (PEP
562), so importing this module costs nothing and a command loads only the internals it touches
(inductor takes seconds). A torch release that moves one of them breaks here, in one place:
run ``tests/test_compat.py`` against it.
"""

from __future__ import annotations

import sys
from importlib import import_module
from importlib.util import find_spec, module_from_spec, spec_from_file_location
from pathlib import Path
from typing import Any

__all__ = ["TESTED_TORCH", "PRIVATE_APIS"]

TESTED_TORCH = ("2.13",)
"""torch releases (major.minor) the whole suite runs on; pyproject.toml pins the same range."""

_CP_ATTENTION = "torch.distributed.tensor.experimental._context_parallel._attention"

# name -> (module, attribute); attribute None: the module itself.
PRIVATE_APIS: dict[str, tuple[str, str | None]] = {
    # tracing on fake tensors
    "FakeTensor": ("torch._subclasses", "FakeTensor"),
    "FakeTensorMode": ("torch._subclasses", "FakeTensorMode"),
    "is_fake": ("torch._subclasses.fake_tensor", "is_fake"),
    "fake_tensor_log": ("torch._subclasses.fake_tensor", "log"),  # logs every failing meta kernel's stack
    "detect_fake_mode": ("torch._guards", "detect_fake_mode"),
    "OpOverload": ("torch._ops", "OpOverload"),
    "TorchDispatchMode": ("torch.utils._python_dispatch", "TorchDispatchMode"),
    "disable_current_modes": ("torch.utils._python_dispatch", "_disable_current_modes"),
    "is_traceable_wrapper_subclass": ("torch.utils._python_dispatch", "is_traceable_wrapper_subclass"),
    "ModTracker": ("torch.distributed._tools.mod_tracker", "ModTracker"),
    # pytree
    "tree_flatten": ("torch.utils._pytree", "tree_flatten"),
    "tree_leaves": ("torch.utils._pytree", "tree_leaves"),
    "tree_map": ("torch.utils._pytree", "tree_map"),
    # torch.compile: configs, the min-cut partitioner, inductor's lowering and memory estimate
    "dynamo_config": ("torch._dynamo.config", None),
    "functorch_config": ("torch._functorch.config", None),
    "inductor_config": ("torch._inductor.config", None),
    "default_partition": ("torch._functorch.partitioners", "default_partition"),
    "min_cut_rematerialization_partition": ("torch._functorch.partitioners", "min_cut_rematerialization_partition"),
    "compile_fx_inner": ("torch._inductor.compile_fx", "compile_fx_inner"),
    "select_decomp_table": ("torch._inductor.decomposition", "select_decomp_table"),
    "inductor_memory": ("torch._inductor.memory", None),
    "IRNode": ("torch._inductor.ir", "IRNode"),
    "V": ("torch._inductor.virtualized", "V"),
    # the profiler's memory events
    "ProfilerMemoryAction": ("torch.profiler._memory_profiler", "Action"),
    # per-rank traces without real ranks; DTensor's sharding propagation; the peer estimators
    "FakeStore": ("torch.testing._internal.distributed.fake_pg", "FakeStore"),
    "resolve_process_group": ("torch.distributed.distributed_c10d", "_resolve_process_group"),
    "all_to_all_single": ("torch.distributed._functional_collectives", "all_to_all_single"),
    "all_to_all_single_autograd": ("torch.distributed._functional_collectives", "all_to_all_single_autograd"),
    "ShardingPropagator": ("torch.distributed.tensor._sharding_prop", "ShardingPropagator"),
    "FSDPMemTracker": ("torch.distributed._tools.fsdp2_mem_tracker", "FSDPMemTracker"),
    # context parallel: torch's ring attention (forward, backward) and the DTensor spec its outputs carry
    "templated_ring_attention": (_CP_ATTENTION, "_templated_ring_attention"),
    "templated_ring_attention_backward": (_CP_ATTENTION, "_templated_ring_attention_backward"),
    "cp_options": (_CP_ATTENTION, "_cp_options"),
    "DTensorSpec": ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
    "TensorMeta": ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
}


# Modules whose package __init__ imports far more than they need: loaded from their file alone.
# (torch.distributed._tools' __init__ imports its runtime estimator, which imports inductor: a
# second of start-up for every trace, which needs only the module tracker.)
_STANDALONE = frozenset(("torch.distributed._tools.mod_tracker",))


def _load(module: str) -> Any:
    if module not in _STANDALONE or module in sys.modules:
        return import_module(module)
    package, _, leaf = module.rpartition(".")
    parent = find_spec(package.rpartition(".")[0]).submodule_search_locations[0]
    private = f"memplan_compat._{leaf}"
    if private not in sys.modules:
        spec = spec_from_file_location(private, Path(parent) / package.rpartition(".")[2] / f"{leaf}.py")
        loaded = module_from_spec(spec)
        sys.modules[private] = loaded
        spec.loader.exec_module(loaded)
    return sys.modules[private]


def __getattr__(name: str) -> Any:
    if name not in PRIVATE_APIS:
        raise AttributeError(f"module 'memplan_compat' has no attribute {name!r}")
    module, attribute = PRIVATE_APIS[name]
    value = _load(module) if attribute is None else getattr(_load(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PRIVATE_APIS))
