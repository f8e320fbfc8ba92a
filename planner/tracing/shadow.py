"""Real values for the small tensors a forward branches on, while everything else stays fake.

Token ids, positions, attention masks and routing indices are small integer or boolean tensors.
Models branch on them (`if mask.all()`, `for e in expert_hit`, `torch.where(mask)`), which fake
tensors cannot answer. A :class:`ShadowMode` keeps a real *shadow* of every such tensor: factory
ops of integer/bool dtype, constant float factories (a mask of ones a decoder makes when given
none) and ops whose tensor inputs all have shadows run once more on the real shadows (cheap: they
are small). Reading a value (`.item()`, `bool()`) is answered from the shadow;
an op with a data-dependent output size (`nonzero`, boolean indexing) gets a fake output of the
size its real result has. Reading a value that has no shadow is a one-line :class:`TraceError`
naming the op and the source line.

A collective on shadowed tensors (the token counts an expert-parallel dispatch exchanges before
its all-to-all) is answered under the *symmetric-rank* assumption: every rank of the group holds
what this rank holds (they route by the same assumption), so an all-to-all brings this rank's own
chunk from every peer and an all-gather repeats this rank's input.
"""

from __future__ import annotations

import itertools
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from memplan_compat import FakeTensor, FakeTensorMode, TorchDispatchMode, tree_leaves, tree_map
from memplan_compat import disable_current_modes as _disable_current_modes
from planner.errors import TraceError
from planner.tracing.dtensor import dtensor_type

__all__ = ["ShadowMode", "source_line"]

# Shadows are kept up to these sizes (elements): masks and ids of long sequences stay cheap.
MAX_SHADOW_INT_NUMEL = 1 << 24
MAX_SHADOW_FLOAT_NUMEL = 1 << 20

_READ_OPS = (
    "aten._local_scalar_dense.default",
    "aten.is_nonzero.default",
    "aten.equal.default",
)
# Factories whose values do not depend on anything (a mask of ones a decoder makes when given none):
# their floating-point outputs get shadows too, an uninitialised or random one (a weight) does not.
_CONSTANT_FACTORIES = frozenset(
    f"aten.{name}"
    for name in (
        "ones.default",
        "zeros.default",
        "full.default",
        "scalar_tensor.default",
        "arange.default",
        "arange.start",
        "arange.start_step",
        "linspace.default",
        "eye.default",
    )
)
_REWRITTEN_OPS = ("aten.index.Tensor", "aten._grouped_mm.default", "aten.topk.default")
# Collectives answered for shadowed inputs (symmetric ranks): op -> (input position, output position
# or None for the returned tensor).
_COLLECTIVES = {
    "c10d.alltoall_base_.default": (1, 0),
    "_c10d_functional.all_to_all_single.default": (0, None),
    "_c10d_functional.all_gather_into_tensor.default": (0, None),
}
_DYNAMIC_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
_OWN_DIRS = tuple(os.path.dirname(p) + os.sep for p in (torch.__file__, os.path.dirname(__file__)))


def source_line() -> str:
    """'file.py:LINE' of the innermost frame outside torch and memplan's tracing code."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(_OWN_DIRS) and "contextlib" not in frame.filename:
            return f"{os.path.basename(frame.filename)}:{frame.lineno} ({(frame.line or '').strip()[:80]})"
    return "an unknown line"


def _tensors(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors among an aten op's arguments (at most one list deep)."""
    for arg in itertools.chain(args, kwargs.values()):
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, (list, tuple)):
            yield from (t for t in arg if isinstance(t, torch.Tensor))


_SPECIAL: dict[Any, bool] = {}


def _special(func) -> bool:
    """Ops that need more than 'shadow the outputs when every input has a shadow' (cached)."""
    special = _SPECIAL.get(func)
    if special is None:
        special = (
            str(func) in _READ_OPS + _REWRITTEN_OPS
            or str(func) in _COLLECTIVES
            or func._schema.is_mutable
            or any(tag in func.tags for tag in _DYNAMIC_TAGS)
        )
        _SPECIAL[func] = special
    return special


def _small(t: torch.Tensor) -> bool:
    limit = MAX_SHADOW_FLOAT_NUMEL if t.is_floating_point() or t.is_complex() else MAX_SHADOW_INT_NUMEL
    return t.numel() <= limit


class ShadowMode(TorchDispatchMode):
    """Keeps real shadows of small integer/bool tensors under `fake_mode` (see the module doc).

    `route` may give the integer outputs of an op that has no shadow (a router's top-k indices)
    a shadow from an explicit assumption: route(func, args, out) -> shadows or None.
    """

    def __init__(
        self,
        fake_mode: FakeTensorMode,
        route: Callable[[Any, tuple, Any], list[torch.Tensor | None] | None] | None = None,
    ) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.route = route
        self.shadows: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def real(self, t: Any) -> Any:
        """The real value standing for `t` (itself when not fake); None when it has none."""
        if not isinstance(t, torch.Tensor):
            return t
        if not isinstance(t, FakeTensor):
            return t
        return self.shadows.get(t)

    def _all_real(self, args, kwargs) -> tuple[bool, Any, Any]:
        if any(self.real(t) is None for t in _tensors(args, kwargs)):
            return False, None, None
        return True, tree_map(self.real, args), tree_map(self.real, kwargs)

    def _run_real(self, func, args, kwargs) -> Any:
        with _disable_current_modes():
            return func(*args, **kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtensor = dtensor_type()
        if dtensor is not None and dtensor in types:  # shadow the local ops a DTensor op desugars into
            return NotImplemented
        kwargs = kwargs or {}
        if not _special(func) and any(  # the common case: an op on model data, nothing to shadow
            isinstance(t, FakeTensor) and t not in self.shadows for t in _tensors(args, kwargs)
        ):
            return func(*args, **kwargs)
        name = str(func)
        have, rargs, rkwargs = self._all_real(args, kwargs)
        if name in _READ_OPS:
            if not have:
                raise TraceError(
                    f"data-dependent control flow at {source_line()}: {name} reads the value of a "
                    "tensor computed from model data; memplan traces on fake tensors and can only "
                    "read integer/bool tensors derived from the inputs"
                )
            return self._run_real(func, rargs, rkwargs)
        dynamic = any(tag in func.tags for tag in _DYNAMIC_TAGS)
        if dynamic and have:
            return self._fakeify(self._run_real(func, rargs, rkwargs))
        if name == "aten.index.Tensor":
            args = (
                args[0],
                [j for i in args[1] for j in self._bool_index_as_long(i)],
                *args[2:],
            )
        if name == "aten._grouped_mm.default":
            out = _grouped_mm_fake(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        if dynamic and any(
            isinstance(d, torch.SymInt) for t in tree_leaves(out) if isinstance(t, torch.Tensor) for d in t.shape
        ):
            raise TraceError(
                f"data-dependent output size at {source_line()}: {name} on a tensor computed "
                "from model data; memplan needs static shapes here (mixture-of-experts routing "
                "is assumed from a router's top-k, see --moe-imbalance)"
            )
        if name in _COLLECTIVES:
            self._shadow_collective(name, args, out)
            return out
        self._shadow_outputs(func, args, out, have, rargs, rkwargs)
        return out

    def _shadow_collective(self, name: str, args: tuple, out: Any) -> None:
        """The real result of a collective on a shadowed input, every rank holding what this one holds."""
        source_at, out_at = _COLLECTIVES[name]
        target = out if out_at is None else args[out_at]
        source = self.real(args[source_at])
        if isinstance(target, torch.Tensor) and target in self.shadows:
            del self.shadows[target]
        if source is None or not isinstance(target, torch.Tensor):
            return
        with _disable_current_modes():
            real = _symmetric_result(name, args, source)
            if real is not None and real.numel() == target.numel():
                self.shadows[target] = real.reshape(target.shape).to(target.dtype)

    def _bool_index_as_long(self, index: Any) -> list[Any]:
        """A boolean index with a shadow becomes the long indices of its true elements (what
        indexing does with it), so the result has the size the real mask gives."""
        if not isinstance(index, torch.Tensor) or index.dtype != torch.bool or self.real(index) is None:
            return [index]
        positions = self._run_real(torch.ops.aten.nonzero.default, (self.real(index),), {})
        return [self._fakeify(p.contiguous()) for p in positions.unbind(1)]

    def _fakeify(self, real_out: Any) -> Any:
        def to_fake(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            fake = self.fake_mode.from_tensor(t, static_shapes=True)
            self.shadows[fake] = t
            return fake

        return tree_map(to_fake, real_out)

    def _shadow_outputs(self, func, args, out, have: bool, rargs, rkwargs) -> None:
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs:
            return
        has_inputs = any(isinstance(t, torch.Tensor) for t in tree_leaves((args, rkwargs)))
        factory_ok = (
            has_inputs
            or all(not (t.is_floating_point() or t.is_complex()) for t in outs)
            or str(func) in _CONSTANT_FACTORIES
        )
        if have and factory_ok and all(_small(t) for t in outs):
            real_out = self._run_real(func, rargs, rkwargs)
            for fake, real in zip(outs, [t for t in tree_leaves(real_out) if isinstance(t, torch.Tensor)]):
                self.shadows[fake] = real
            return
        if func._schema.is_mutable:  # an in-place op on data without shadows: shadows go stale
            for t in tree_leaves(args):
                if isinstance(t, torch.Tensor) and t in self.shadows:
                    del self.shadows[t]
        if self.route is not None:
            with _disable_current_modes():  # the assumed routing is real
                routed = self.route(func, args, out)
            if routed is not None:
                for fake, real in zip(outs, routed):
                    if real is not None:
                        self.shadows[fake] = real


def _group_of(name: str, args: tuple) -> tuple[int, int]:
    """(this rank's index in the collective's group, the group's size)."""
    from memplan_compat import resolve_process_group

    if name.startswith("c10d."):
        from torch.distributed import ProcessGroup

        group = args[2] if isinstance(args[2], ProcessGroup) else ProcessGroup.unbox(args[2])
    else:
        group = resolve_process_group(args[-1])
    return group.rank(), group.size()


def _symmetric_result(name: str, args: tuple, source: torch.Tensor) -> torch.Tensor | None:
    """What the collective `name` returns when every rank of its group holds `source`."""
    me, size = _group_of(name, args)
    if name == "_c10d_functional.all_gather_into_tensor.default":
        return torch.cat([source] * size)
    in_splits = list(args[4] if name.startswith("c10d.") else args[2]) or [source.shape[0] // size] * size
    if sum(in_splits) != source.shape[0]:
        return None
    mine = source.split(in_splits)[me]
    return torch.cat([mine] * size)


def _grouped_mm_fake(func, args, kwargs) -> torch.Tensor:
    """aten._grouped_mm's fake kernel accepts bf16 only; the CPU kernel also runs fp32. The output
    shape does not depend on the dtype: compute it in bf16, allocate it in the input dtype."""
    a, b = args[0], args[1]
    if a.dtype == torch.bfloat16:
        return func(*args, **kwargs)
    shape_out = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *args[2:], **kwargs)
    dtype = kwargs.get("out_dtype") or a.dtype
    return torch.empty(shape_out.shape, dtype=dtype, device=a.device)
