"""A user's sharding function named on the command line (``--tp-plan`` / ``--ep-plan``): loaded
from ``PATH.py:FUNC`` or ``package.module:FUNC``, and called with one-line errors."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from planner.errors import SpecError
from planner.tracing.specs import resolve_spec

__all__ = ["user_plan"]


def _call(flag: str, spec: str, mesh_name: str, func: Callable, model: nn.Module, mesh: DeviceMesh) -> None:
    try:
        func(model, mesh)
    except SpecError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise SpecError(
            f"{flag} function '{spec}' raised {type(e).__name__}: {first}; fix FUNC(model, {mesh_name}) or use "
            f"--{flag} auto"
        ) from e


def user_plan(flag: str, spec: str, mesh_name: str) -> Callable[[nn.Module, DeviceMesh], None]:
    """plan(model, mesh) calling the FUNC of `spec` (`flag` is 'tp-plan' or 'ep-plan', `mesh_name`
    how FUNC names its mesh argument); a one-line SpecError for a spec that names no function."""
    if ":" not in spec:
        raise SpecError(f"--{flag} must be auto, PATH.py:FUNC or package.module:FUNC, got '{spec}'")
    func_name = spec.rpartition(":")[2]
    try:  # the spec loader imports the file or module and finds FUNC
        func = resolve_spec(spec).builder
    except SpecError as e:
        raise SpecError(
            f"--{flag}: " + str(e).replace(f"{func_name}(batch_size=B, seq_len=S)", f"{func_name}(model, {mesh_name})")
        ) from e
    return partial(_call, flag, spec, mesh_name, func)
