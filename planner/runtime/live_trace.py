"""Trace a live model at the shapes of real batches, on a fake copy (nothing real is allocated).

The copy is made once: parameters and buffers become fake CPU tensors of the same shapes, strides
and dtypes, wherever the real ones live (meta included). Each batch is copied as fake tensors, its
small integer tensors (ids, positions, masks) keeping real values that answer data-dependent
checks, as planner.tracing.recorder.trace does for specs. A model that ``parallelize_module``
sharded keeps its DTensors' meshes and placements around fake local shards, so the trace is this
rank's (planner/tracing/parallel/live_layout.py). Under context parallel (a ``cp_mesh``) each step
runs inside torch's ``context_parallel`` over that mesh, on the full-length fake batch, as the
training step runs it on the real one (planner/tracing/parallel/context_parallel.py).
"""

from __future__ import annotations

import copy
import types
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from costmodels.hardware import get_device
from costmodels.memory import get_precision
from memplan_compat import FakeTensor, tree_leaves, tree_map
from memplan_compat import disable_current_modes as _disable_current_modes
from planner.errors import MemplanError, TraceError
from planner.runtime.apply import batch_seq_len
from planner.tracing.attention import TargetAttention
from planner.tracing.fake_mode import TraceFakeMode
from planner.tracing.graph import OpGraph
from planner.tracing.hf import disable_kv_cache, eager_transformers
from planner.tracing.moe import RoutingAssumption
from planner.tracing.parallel.context_parallel import context_parallel_step
from planner.tracing.parallel.live_layout import fake_dtensor, live_layout
from planner.tracing.parallel.tp_plans import loss_parallel_context
from planner.tracing.recorder import trace_model
from planner.tracing.shadow import ShadowMode

__all__ = ["LiveTracer"]


@contextmanager
def _outside_autocast() -> Iterator[None]:
    """Run as if no autocast region were open (a caller's forward may be in one): each of the trace's
    own autocast passes must be outermost, or casts cached by the first would be missing from the second."""
    depth = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    for _ in range(depth):
        torch.autocast_decrement_nesting()
    enabled = {device: torch.is_autocast_enabled(device) for device in ("cpu", "cuda")}
    for device in enabled:
        torch.set_autocast_enabled(device, False)
    try:
        yield
    finally:
        for device, on in enabled.items():
            torch.set_autocast_enabled(device, on)
        for _ in range(depth):
            torch.autocast_increment_nesting()


@contextmanager
def _copying_live_model() -> Iterator[None]:
    """Inside, a deep copy of a module shares its device meshes (and their process groups) and
    copies functions' closures and default arguments: a forward replaced by a closure over the
    module's own bound forward (transformers' tensor-parallel styles, a user's wrapper) then calls
    the copy, not the original, whose real parameters a trace would not see."""
    own_mesh_copy = DeviceMesh.__dict__.get("__deepcopy__")
    own_function_copy = copy._deepcopy_dispatch[types.FunctionType]
    DeviceMesh.__deepcopy__ = lambda self, memo: self  # type: ignore[method-assign]
    copy._deepcopy_dispatch[types.FunctionType] = _copy_function
    try:
        yield
    finally:
        copy._deepcopy_dispatch[types.FunctionType] = own_function_copy
        if own_mesh_copy is None:
            del DeviceMesh.__deepcopy__
        else:
            DeviceMesh.__deepcopy__ = own_mesh_copy  # type: ignore[method-assign]


def _copy_function(fn: types.FunctionType, memo: dict[int, Any]) -> types.FunctionType:
    """A function with its closure's contents and default arguments deep-copied (one with neither is itself)."""
    if not fn.__closure__ and not fn.__defaults__ and not fn.__kwdefaults__:
        return fn
    cells = tuple(types.CellType() for _ in fn.__closure__ or ())
    copied = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, None, cells or None)
    memo[id(fn)] = copied
    copied.__defaults__ = copy.deepcopy(fn.__defaults__, memo)
    copied.__kwdefaults__ = copy.deepcopy(fn.__kwdefaults__, memo)
    copied.__dict__.update(fn.__dict__)
    for old, new in zip(fn.__closure__ or (), cells):
        try:
            contents = old.cell_contents
        except ValueError:  # a cell not filled yet
            continue
        new.cell_contents = copy.deepcopy(contents, memo)
    return copied


def _fake_state(t: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor (a DTensor: around a fake local shard) like a parameter or buffer; call under the fake mode."""
    local = t.to_local() if isinstance(t, DTensor) else t
    fake = torch.empty_strided(tuple(local.shape), tuple(local.stride()), dtype=local.dtype, device="cpu")
    if isinstance(t, DTensor):
        fake = fake_dtensor(t, fake)
    return nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake


class LiveTracer:
    """Traces a live model at the shapes of real batches, on a fake copy made once (no real memory)."""

    def __init__(
        self,
        model: nn.Module,
        precision: str,
        *,
        name: str = "model",
        blocks: Sequence[str] = (),
        moe_imbalance: float = 1.0,
        gpu: str = "cpu",
        loss_parallel: bool = True,
        cp_mesh: DeviceMesh | None = None,
        cp_rotate: str = "allgather",
    ) -> None:
        if any(getattr(m.__dict__.get("forward"), "_memplan_wrapper", False) for m in model.modules()):
            raise MemplanError("this model already has a memplan plan applied; call remove() on its handle first")
        param_dtype = get_precision(precision).param_dtype
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if dtypes and dtypes != {param_dtype}:
            raise MemplanError(
                f"precision '{precision}' keeps parameters in {param_dtype} but the model's are "
                f"{', '.join(sorted(map(str, dtypes)))}; cast the model or pass another precision"
            )
        self.precision = precision
        self.target = get_device(gpu)  # attention runs the kernels this device picks (tracing/attention.py)
        self.name = name
        self.blocks = tuple(blocks)
        self.fake_mode = TraceFakeMode()
        self.routing = RoutingAssumption(moe_imbalance)  # mixture-of-experts routing (tracing/moe.py)
        self.shadow = ShadowMode(self.fake_mode, route=self.routing)
        self.layout = live_layout(model)
        self.loss_parallel = loss_parallel
        self.cp_mesh = cp_mesh if cp_mesh is not None and cp_mesh.size() > 1 else None
        self.cp_rotate = cp_rotate
        memo: dict[int, Any] = {}
        with _disable_current_modes():  # a monitor's live-bytes counter must not see the copy
            with self.fake_mode:
                for t in [*model.parameters(), *model.buffers()]:
                    memo[id(t)] = _fake_state(t)
            try:
                with _copying_live_model():
                    self.fake_model = copy.deepcopy(model, memo)
            except Exception as exc:
                raise TraceError(
                    f"cannot copy the model for tracing ({type(exc).__name__}: {exc}); "
                    "plan it from a spec with planner.trace instead"
                ) from exc
        disable_kv_cache(self.fake_model)
        self.fake_model.train()
        self.fake_inputs: dict[int, tuple | dict] = {}  # seq_len -> the fake batch last traced there

    def _step_context(self) -> AbstractContextManager:
        """torch's loss_parallel() around a tensor-parallel step that computes its loss on
        vocabulary-sharded logits (the user's step does; plain logits are untouched by it)."""
        return loss_parallel_context(self.layout.tp if self.layout is not None else 1, self.loss_parallel)

    @property
    def distributed(self) -> bool:
        """Whether each rank traces its own share (tensor, expert or context parallel): its ranks
        then agree on one plan, because a recompute runs the share's collectives."""
        return self.layout is not None or self.cp_mesh is not None

    @property
    def cp(self) -> int:
        """Context-parallel ranks the sequence is sharded over (1 without a ``cp_mesh``)."""
        return self.cp_mesh.size() if self.cp_mesh is not None else 1

    def _fake(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor):
            return t
        if t.is_floating_point() or t.is_complex():
            with self.fake_mode:
                return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
        real = t.detach().to("cpu")  # ids, positions, masks: small, and their values steer the forward
        fake = self.fake_mode.from_tensor(real, static_shapes=True)
        self.shadow.shadows[fake] = real
        return fake

    def trace(self, inputs: tuple | dict, precision: str | None = None) -> OpGraph:
        """One forward, loss and backward of the fake copy on fake copies of `inputs` (real or fake)."""
        for p in self.fake_model.parameters():
            p.grad = None
        self.routing.routers = 0
        tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
        args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
        seq_len = batch_seq_len(args, kwargs) if any(t.dim() >= 2 for t in tensors) else 1
        with ExitStack() as stack:
            stack.enter_context(_disable_current_modes())  # a monitor's live-bytes counter must not see this
            stack.enter_context(torch.enable_grad())
            stack.enter_context(_outside_autocast())
            fake_inputs = tree_map(self._fake, inputs)
            stack.enter_context(self.fake_mode)
            stack.enter_context(self.shadow)
            stack.enter_context(eager_transformers())
            if self.target.is_cuda:
                stack.enter_context(TargetAttention(self.target))
            stack.enter_context(self._step_context())
            if self.cp_mesh is not None:
                stack.enter_context(context_parallel_step(self.cp_mesh, fake_inputs, seq_len, self.cp_rotate))
            graph = trace_model(
                self.fake_model, fake_inputs, precision=precision or self.precision, name=self.name, blocks=self.blocks
            )
        for p in self.fake_model.parameters():
            p.grad = None
        graph.meta.update(batch_size=int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 1, seq_len=seq_len)
        if self.layout is not None:
            graph.meta.update(self.layout.meta())
        if self.cp_mesh is not None:
            members = self.cp_mesh.mesh.flatten().tolist()  # the ring's group, priced on its link (costs.py)
            ring_group = {self.cp_mesh.get_group().group_name: (self.cp, members[1] - members[0])}
            graph.meta.update(cp=self.cp, cp_index=self.cp_mesh.get_local_rank(), cp_rotate=self.cp_rotate)
            graph.meta["groups"] = {**graph.meta.get("groups", {}), **ring_group}
        if self.routing.routers:  # as planner.tracing.recorder.trace: the routers of one forward
            self.routing.routers = sum(op.name == "aten.topk.default" for op in graph.ops[: graph.backward_start])
            graph.meta["moe"] = self.routing.to_dict()
        self.fake_inputs[seq_len] = fake_inputs
        return graph

    def retrace(self, seq_len: int, batch_size: int, precision: str | None = None) -> OpGraph:
        """Trace again the batch last traced at `seq_len`, cut to its first `batch_size` samples."""
        inputs = self.fake_inputs[seq_len]
        first = next(t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor))
        full = int(first.shape[0]) if first.dim() else 1

        def cut(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == full:
                return t[:batch_size].clone()
            return t

        with self.fake_mode, self.shadow:
            smaller = tree_map(cut, inputs)
        return self.trace(smaller, precision)
