"""The dispatch mode under which memplan runs a model on fake tensors: every aten op in order,
with the storages it reads, creates and writes in place, its module path (from a ModTracker, in
backward too) and its cost; weakref finalizers record the op after which each storage dies."""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import memplan_compat
from costmodels.attention import HOST_OUTPUTS
from costmodels.flops import op_bytes_accessed, op_flops
from memplan_compat import TorchDispatchMode, tree_leaves
from planner.errors import TraceError
from planner.tracing.dtensor import dtensor_type
from planner.tracing.graph import OpNode
from planner.tracing.kernel_storage import kernel_storage_bytes
from planner.tracing.module_tracker import ModuleTracker
from planner.tracing.static_size import as_int

__all__ = ["OpRecorder", "local_tensor"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, else the tensor itself."""
    dtensor = dtensor_type()
    return t._local_tensor if dtensor is not None and isinstance(t, dtensor) else t


_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default


class _HiddenPropagation:
    """While entered, DTensor's sharding propagation (which runs each op once more on global-shape
    fake tensors to learn the output's metadata, the first time it sees an op schema) is marked, so
    the recorder skips those ops: they are not part of what the rank computes. Re-entrant."""

    depth = 0  # recorders entered
    running = 0  # propagations in progress
    _original = None

    @classmethod
    def enter(cls) -> None:
        if cls.depth == 0 and dtensor_type() is not None:
            propagator = memplan_compat.ShardingPropagator
            cls._original = original = propagator._propagate_tensor_meta_non_cached

            def propagate(self, op_schema):
                cls.running += 1
                try:
                    return original(self, op_schema)
                finally:
                    cls.running -= 1

            propagator._propagate_tensor_meta_non_cached = propagate
        cls.depth += 1

    @classmethod
    def exit(cls) -> None:
        cls.depth -= 1
        if cls.depth == 0 and cls._original is not None:
            memplan_compat.ShardingPropagator._propagate_tensor_meta_non_cached = cls._original
            cls._original = None


@functools.cache
def _argument_names(func: Any) -> tuple[str, ...]:
    return tuple(a.name for a in func._schema.arguments)


def _variant(func: Any, args: tuple, kwargs: dict) -> str:
    """The op's string arguments as "name=value" pairs (GELU's approximate, ...), comma-joined."""
    names = _argument_names(func)
    pairs = [(names[i], v) for i, v in enumerate(args[: len(names)]) if isinstance(v, str)]
    pairs += [(k, v) for k, v in kwargs.items() if isinstance(v, str)]
    return ",".join(f"{k}={v}" for k, v in pairs)


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op writes in place (its schema marks them `Tensor(a!)`)."""
    if not func._schema.is_mutable:
        return []
    out = []
    for k, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[k] if k < len(args) else kwargs.get(arg.name)
            out += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return out


@dataclass
class _Storage:
    tid: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    alloc_op: int


class OpRecorder(TorchDispatchMode):
    """Records aten ops and storage lifetimes; module paths come from a ModuleTracker."""

    def __init__(self, model: nn.Module, with_costs: bool) -> None:
        super().__init__()
        self.fqn = {id(m): name for name, m in model.named_modules()}
        self.active: list[str] = []  # modules entered and not yet left, innermost last
        self.calls: Counter[str] = Counter()  # forward calls per module (called, not just looped over)
        self.tracker = ModuleTracker()
        self.tracker.register_user_hooks(self._enter, self._leave, self._enter, self._leave)
        self.with_costs = with_costs
        self.ops: list[OpNode] = []
        self.storages: dict[int, _Storage] = {}
        self.frees: dict[int, int] = {}
        self._live: dict[int, int] = {}  # id(storage object) -> tid, only while alive
        self._next_tid = 0
        self.phase = "forward"
        self.recording = True
        self.current = ("", "")

    def __enter__(self):
        _HiddenPropagation.enter()
        return super().__enter__()

    def __exit__(self, *exc):
        _HiddenPropagation.exit()
        return super().__exit__(*exc)

    # -- storages -----------------------------------------------------------------------
    def _on_free(self, key: int, tid: int) -> None:
        self._live.pop(key, None)
        if self.recording:
            self.frees[tid] = len(self.ops)

    def tid_of(self, t: torch.Tensor, alloc_op: int, func=None, args=(), host: bool = False) -> tuple[int, bool]:
        """The storage id of `t` (a DTensor's local shard), registering it as new (allocated at
        `alloc_op`) if unseen; a `host` output (HOST_OUTPUTS) takes no device bytes."""
        t = local_tensor(t)
        st = t.untyped_storage()
        key = id(st)
        tid = self._live.get(key)
        if tid is not None:
            return tid, False
        tid = self._next_tid
        self._next_tid += 1
        self._live[key] = tid
        nbytes = 0 if host else as_int(st.nbytes(), "a tensor")
        if func is not None:
            nbytes = kernel_storage_bytes(func, args, t, nbytes)
        self.storages[tid] = _Storage(
            tid,
            nbytes,
            str(t.dtype).replace("torch.", ""),
            tuple(as_int(d, "a tensor") for d in t.shape),
            alloc_op,
        )
        weakref.finalize(st, self._on_free, key, tid)
        return tid, True

    # -- module attribution (forward and backward hooks of a ModTracker) ---------------------
    def _enter(self, module: nn.Module, *_) -> None:
        owns_parameters = isinstance(module, nn.Module) and next(module.parameters(recurse=False), None) is not None
        if owns_parameters and id(module) not in self.fqn:
            raise TraceError(
                f"the forward calls a {type(module).__name__} with parameters that is not part of the traced model "
                "(a forward replaced by a closure over another model's module?); its parameters would go uncounted"
            )
        name = self._name(module)
        self.active.append(name)
        if self.phase == "forward" and id(module) in self.fqn:
            self.calls[name] += 1

    def _name(self, module: nn.Module) -> str:
        """A model module's path. A parameterless module outside the model (a function a library turned into
        a module, such as transformers' hub-kernel rotary embedding) runs as part of its caller."""
        return self.fqn[id(module)] if id(module) in self.fqn else self.module_path()

    def _leave(self, module: nn.Module, *_) -> None:
        name = self._name(module)  # an outside module's entry repeats its caller's path, innermost last
        for k in range(len(self.active) - 1, -1, -1):
            if self.active[k] == name:
                del self.active[k]
                return

    def module_path(self) -> str:
        """The innermost module running now. In backward a module whose inputs need no grad
        (an embedding) is never left, so the most recently entered one wins."""
        return self.active[-1] if self.active else ""

    # -- dispatch -----------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtensor = dtensor_type()
        if dtensor is not None and dtensor in types:  # DTensor desugars into the local ops this rank runs; record those
            return NotImplemented
        if _HiddenPropagation.running:
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        module = self.module_path()
        self.current = (str(func), module)
        # wait_tensor returns its input in eager; the fake kernel would make a second buffer.
        out = args[0] if func is _WAIT_TENSOR else func(*args, **kwargs)
        out_tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not out_tensors:  # metadata queries (prim.device, sym_size, ...) allocate nothing
            return out
        index = len(self.ops)
        inputs = tuple(
            dict.fromkeys(self.tid_of(t, -1)[0] for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        )
        outputs, allocs, dtype = [], [], ""
        host = {id(out[k]) for k in HOST_OUTPUTS.get(self.current[0], ())}
        for t in out_tensors:
            tid, new = self.tid_of(t, index, func, args, host=id(t) in host)
            outputs.append(tid)
            if new:
                allocs.append(tid)
            dtype = dtype or str(t.dtype).replace("torch.", "")
        flops = bytes_accessed = 0
        if self.with_costs:
            flops = op_flops(func, args, kwargs, out)
            bytes_accessed = op_bytes_accessed((args, kwargs), out)
        mutates = tuple(dict.fromkeys(self.tid_of(t, -1)[0] for t in _written(func, args, kwargs)))
        self.ops.append(
            OpNode(
                index,
                str(func),
                self.phase,
                module,
                int(flops),
                int(bytes_accessed),
                dtype,
                inputs,
                tuple(dict.fromkeys(outputs)),
                tuple(allocs),
                mutates,
                _variant(func, args, kwargs),
            )
        )
        return out
