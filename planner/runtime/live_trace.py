"""Trace a live model at the shapes of real batches, on a fake copy (nothing real is allocated).

The copy is made once: parameters and buffers become fake CPU tensors of the same shapes, strides
and dtypes, wherever the real ones live (meta included). Each batch is copied as fake tensors, its
small integer tensors (ids, positions, masks) keeping real values that answer data-dependent
checks, as planner.tracing.recorder.trace does for specs.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from costmodels.hardware import get_device
from costmodels.memory import get_precision
from memplan_compat import FakeTensor, FakeTensorMode, tree_leaves, tree_map
from memplan_compat import disable_current_modes as _disable_current_modes
from planner.errors import MemplanError, TraceError
from planner.runtime.apply import batch_seq_len
from planner.tracing.attention import TargetAttention
from planner.tracing.graph import OpGraph
from planner.tracing.hf import disable_kv_cache, eager_transformers
from planner.tracing.moe import RoutingAssumption
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
        self.fake_mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
        self.routing = RoutingAssumption(moe_imbalance)  # mixture-of-experts routing (tracing/moe.py)
        self.shadow = ShadowMode(self.fake_mode, route=self.routing)
        memo: dict[int, Any] = {}
        with _disable_current_modes():  # a monitor's live-bytes counter must not see the copy
            with self.fake_mode:
                for t in [*model.parameters(), *model.buffers()]:
                    fake = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
                    memo[id(t)] = (
                        nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
                    )
            try:
                self.fake_model = copy.deepcopy(model, memo)
            except Exception as exc:
                raise TraceError(
                    f"cannot copy the model for tracing ({type(exc).__name__}: {exc}); "
                    "plan it from a spec with planner.trace instead"
                ) from exc
        disable_kv_cache(self.fake_model)
        self.fake_model.train()
        self.fake_inputs: dict[int, tuple | dict] = {}  # seq_len -> the fake batch last traced there

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
            graph = trace_model(
                self.fake_model, fake_inputs, precision=precision or self.precision, name=self.name, blocks=self.blocks
            )
        for p in self.fake_model.parameters():
            p.grad = None
        tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
        args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
        seq_len = batch_seq_len(args, kwargs) if any(t.dim() >= 2 for t in tensors) else 1
        graph.meta.update(batch_size=int(tensors[0].shape[0]) if tensors and tensors[0].dim() else 1, seq_len=seq_len)
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
