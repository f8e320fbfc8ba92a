"""Context parallel on fake tensors: torch's own ``context_parallel`` and ring attention, run per rank.

``torch.distributed.tensor.experimental.context_parallel`` (torch 2.13,
``_context_parallel/_attention.py``) does two things, and the trace runs both as they are:

- it shards the step's sequence buffers in place (here: the model's ``[batch, seq, ...]`` inputs,
  as torchtitan passes ``inputs`` and ``labels``), load-balanced when the sequence splits into
  ``2·cp`` chunks: rank ``r`` keeps chunks ``r`` and ``2·cp−1−r`` (``_HeadTailLoadBalancer``);
- it patches ``F.scaled_dot_product_attention`` to run q, k, v as ``Shard(2)`` DTensors over the cp
  mesh, and DTensor sends the flash / efficient / cuDNN SDPA ops to ring attention
  (``_templated_ring_attention`` and ``_templated_ring_attention_backward``): per ring step the
  local K and V are concatenated and exchanged (one all-gather of every rank's K/V by default,
  ``set_rotate_method("alltoall")`` for a permute per step), each step's out and logsumexp merge
  in fp32, and backward exchanges K/V again and rotates dK/dV (all-to-all) around the ring.

For a GPU target the trace runs the target's kernel op (planner/tracing/attention.py), which
torch's own handlers send to ring attention with that kernel as the per-step op. On a CPU target
SDPA dispatches to ``_scaled_dot_product_flash_attention_for_cpu``, which has no DTensor
sharding strategy, so ``context_parallel`` cannot run on CPU at all. memplan hands that op pair to
torch's own ring functions with the CPU flash kernel as the per-step op (the same ``(out,
logsumexp)`` shapes as CUDA's flash op): the ring's loop, exchange buffers and merges are torch's,
on fake tensors under the fake process group. What autograd saves is the SDPA node's q, k, v, out
and logsumexp, all local (``s / cp`` long). Nothing here is fake-tensor specific: on real CPU
tensors under gloo the same route runs context parallel for ``memplan verify --cp``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

import memplan_compat
from memplan_compat import tree_leaves
from planner.errors import TraceError
from planner.tracing.recorder import MIXED_DTENSOR

__all__ = ["RingAttentionCalls", "context_parallel_step", "sequence_buffers"]

_SEQ_DIM = 2  # q, k, v are (batch, heads, seq, head_dim); torch's ring hardcodes the same
_aten = torch.ops.aten
_FORWARD = _aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
# The GPU kernels' ops, which torch's context_parallel itself sends to ring attention.
_TORCH_RING_OPS = frozenset(
    getattr(_aten, f"_scaled_dot_product_{kernel}_attention{part}").default
    for kernel in ("flash", "efficient", "cudnn")
    for part in ("", "_backward")
)


@dataclass
class RingAttentionCalls:
    """How many SDPA calls ran as ring attention, forward and backward."""

    forward: int = 0
    backward: int = 0


def sequence_buffers(inputs: tuple | dict, seq_len: int) -> list[torch.Tensor]:
    """The inputs ``context_parallel`` shards: tensors laid out ``[batch, seq, ...]`` (ids, labels,
    masks), sequence dim 1."""
    return [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == seq_len]


def _shard_spec(local: torch.Tensor, mesh: DeviceMesh):
    """The DTensor spec of a ring output: sharded on the sequence dim over the cp mesh."""
    shape = list(local.shape)
    shape[_SEQ_DIM] *= mesh.size()
    meta = memplan_compat.TensorMeta(torch.Size(shape), local.stride(), local.dtype)
    return memplan_compat.DTensorSpec(mesh, (Shard(_SEQ_DIM),), tensor_meta=meta)


def _argument(args: list, kwargs: dict, index: int, name: str, default=None):
    return args[index] if index < len(args) else kwargs.get(name, default)


_MASKED = (
    "context parallel runs attention without a mask (torch's ring attention takes no attn_mask); this model "
    "passes one to scaled_dot_product_attention: use causal attention (is_causal=True) for --cp"
)


_OFF_RING = (
    "scaled_dot_product_attention ran without ring attention under --cp: torch chose its math kernel for this "
    "call, which would gather the whole sequence on every rank"
)
_DROPOUT = (
    "context parallel on a CPU target runs ring attention over the CPU flash kernel, which has no dropout, and this "
    "model's attention uses dropout_p={p}: set its attention dropout to 0 (transformers: attn_pdrop / "
    "attention_dropout in the config) or simulate for a GPU (--gpu)"
)
_NOT_CAUSAL = (
    "context parallel's load-balanced ring attention needs causal attention (is_causal=True), and torch refuses this "
    "model's ({reason}); drop --cp for this model"
)
_EFFICIENT_CHUNKS = (
    "torch's ring attention over the efficient-attention kernel (this GPU's kernel for fp32 attention) fails when a "
    "rank's sequence chunks are not a multiple of 32 long (the kernel pads its logsumexp to 32 rows, and the ring's "
    "merge cannot broadcast it; the real step fails the same way): use a --seq-len that is a multiple of 64 x --cp, "
    "or --precision bf16-mixed (flash attention)"
)


def _ring_refusal(op_call, exc: RuntimeError) -> TraceError | None:
    """What torch's ring attention refusing `op_call` means for the user, where memplan knows."""
    message = str(exc)
    if "is_causal" in message:
        return TraceError(_NOT_CAUSAL.format(reason=message.splitlines()[0]))
    if "efficient" in op_call.name() and "broadcast" in message:
        return TraceError(_EFFICIENT_CHUNKS)
    return None


def _off_ring(args: tuple, kwargs: dict) -> TraceError:
    """The refusal of an SDPA call that did not reach ring attention: attention dropout, where it
    has some, is why."""
    dropout_p = float(_argument(list(args), kwargs, 4, "dropout_p", 0.0))
    return TraceError(_DROPOUT.format(p=dropout_p) if dropout_p > 0 else _OFF_RING)


def _guarded(sdpa, calls: RingAttentionCalls):
    """F.scaled_dot_product_attention as context_parallel patched it, refusing an attention mask
    up front (torch would fail later, on a mask of the wrong local shape), and a call that does not
    reach ring attention (torch's math kernel, which a CPU target takes for attention dropout)."""

    def guarded(*args, **kwargs):
        if _argument(list(args), kwargs, 3, "attn_mask") is not None:
            raise TraceError(_MASKED)
        forward_calls = calls.forward
        try:
            out = sdpa(*args, **kwargs)
        except RuntimeError as exc:
            if MIXED_DTENSOR in str(exc):  # the math kernel on the sharded q, k, v
                raise _off_ring(args, kwargs) from exc
            raise
        if calls.forward == forward_calls:
            raise _off_ring(args, kwargs)
        return out

    return guarded


def _counting(torch_handler, calls: RingAttentionCalls):
    """torch's own ring-attention handler of a GPU kernel's op (what a GPU target's trace runs,
    planner/tracing/attention.py), counting its calls."""

    def handle(op_call, args, kwargs):
        if op_call.name().endswith("_backward"):
            calls.backward += 1
        else:
            calls.forward += 1
        try:
            return torch_handler(op_call, args, kwargs)
        except RuntimeError as exc:
            refusal = _ring_refusal(op_call, exc)
            if refusal is None:
                raise
            raise refusal from exc

    return handle


def _ring_handler(calls: RingAttentionCalls):
    """A DTensor custom-op handler for the CPU flash pair: torch's ring attention on the local shards."""

    def handle(op_call, args, kwargs):
        info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        mesh, local, local_kwargs = info.compute_mesh, list(info.local_args), dict(info.local_kwargs)
        if local_kwargs.get("attn_mask") is not None:
            raise TraceError(_MASKED)
        group, scale = mesh.get_group(), local_kwargs.get("scale")
        try:
            if op_call is _FORWARD:
                calls.forward += 1
                q, k, v = local[:3]
                results = memplan_compat.templated_ring_attention(
                    group,
                    _SEQ_DIM,
                    _FORWARD,
                    query=q,
                    key=k,
                    value=v,
                    is_causal=_argument(local, local_kwargs, 4, "is_causal", False),
                    dropout_p=_argument(local, local_kwargs, 3, "dropout_p", 0.0),
                    scale=scale,
                )
            else:
                calls.backward += 1
                grad_out, q, k, v, out, lse, dropout_p, is_causal = local[:8]
                results = memplan_compat.templated_ring_attention_backward(
                    group,
                    _SEQ_DIM,
                    _BACKWARD,
                    grad_out=grad_out,
                    grad_out_name="grad_out",
                    query=q,
                    key=k,
                    value=v,
                    out=out,
                    logsumexp=lse,
                    is_causal=is_causal,
                    dropout_p=dropout_p,
                    scale=scale,
                )
        except (NotImplementedError, RuntimeError) as exc:
            refusal = _ring_refusal(op_call, exc)
            if refusal is None:
                raise
            raise refusal from exc
        return tuple(DTensor(t, _shard_spec(t, mesh), requires_grad=t.requires_grad) for t in results)

    return handle


@contextmanager
def context_parallel_step(
    cp_mesh: DeviceMesh, inputs: tuple | dict, seq_len: int, rotate_method: str = "allgather"
) -> Iterator[RingAttentionCalls]:
    """While inside: the sequence inputs hold this rank's shard and SDPA runs as torch's ring
    attention over `cp_mesh` (fake tensors under the fake process group, or real ones under gloo).
    Yields the ring-attention call counts; the inputs are restored on exit, and a step that ran no
    scaled_dot_product_attention for it to shard is a TraceError. `rotate_method` is torch's
    ``set_rotate_method`` name (planner.config.CP_ROTATE_METHODS)."""
    from torch.distributed.tensor.experimental import context_parallel

    buffers = sequence_buffers(inputs, seq_len)
    if not buffers:
        raise TraceError(
            f"context parallel shards the sequence of the model's inputs, and none is laid out [batch, {seq_len}, ...]; "
            "drop --cp or give the model token inputs of --seq-len"
        )
    options = memplan_compat.cp_options
    rotate = type(options.rotate_method)
    old_rotate = options.rotate_method
    options.rotate_method = rotate.ALL_GATHER if rotate_method == "allgather" else rotate.ALL_TO_ALL
    calls = RingAttentionCalls()
    try:
        with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers)):
            dispatcher = DTensor._op_dispatcher
            handlers, patched = dispatcher._custom_op_handlers, F.scaled_dot_product_attention
            handle = _ring_handler(calls)
            counted = {op: _counting(h, calls) for op, h in handlers.items() if op in _TORCH_RING_OPS}
            dispatcher._custom_op_handlers = {**handlers, **counted, _FORWARD: handle, _BACKWARD: handle}
            F.scaled_dot_product_attention = _guarded(patched, calls)
            try:
                yield calls
            finally:
                F.scaled_dot_product_attention = patched
                dispatcher._custom_op_handlers = handlers
    finally:
        options.rotate_method = old_rotate
    if calls.forward == 0:
        raise TraceError(
            "the model calls no torch.nn.functional.scaled_dot_product_attention, which is what context parallel "
            "shards; drop --cp, or use a model with SDPA attention (transformers: attn_implementation='sdpa')"
        )
