"""Storage a real kernel leaves behind where its fake (meta) kernel says otherwise."""

from __future__ import annotations

from typing import Any

import torch

from planner.tracing.static_size import as_int

__all__ = ["kernel_storage_bytes"]

# ATen's mse_loss / smooth_l1_loss / huber_loss compute the unreduced loss and reduce it into the
# same buffer (Loss.cpp), so the scalar they return keeps the full-size storage alive. Fake
# tensors get a 4-byte storage; the real kernels do not.
_REDUCED_INTO_UNREDUCED = ("aten.mse_loss.default", "aten.smooth_l1_loss.default", "aten.huber_loss.default")
_ONEDNN_LSTM = "aten.mkldnn_rnn_layer.default"
_PAGE_BYTES = 4096
_CACHE_LINE_BYTES = 64


def kernel_storage_bytes(func: Any, args: tuple, out: torch.Tensor, nbytes: int) -> int:
    """Storage bytes the real kernel leaves behind for `out`: the unreduced buffer of a reduced loss,
    oneDNN's LSTM workspace (the fake kernel returns an empty one)."""
    name = str(func)
    if name in _REDUCED_INTO_UNREDUCED and out.dim() == 0:
        numel = 1
        for d in torch.broadcast_shapes(args[0].shape, args[1].shape):
            numel *= as_int(d, "a loss input")
        return max(nbytes, numel * out.element_size())
    if name == _ONEDNN_LSTM and out.dtype == torch.uint8 and args[15]:  # the workspace of a training step
        steps, batch, features = (as_int(d, "an LSTM input") for d in args[0].shape)  # time-major here
        return max(nbytes, onednn_lstm_workspace_bytes(steps, batch, features, as_int(args[10], "a hidden size")))
    return nbytes


def _padded_leading_dim(elements: int, element_bytes: int = 4) -> int:
    """oneDNN's leading dimension for a row of `elements`: whole cache lines, one more where a row
    would be a multiple of 1 KiB (4K aliasing)."""
    per_line = _CACHE_LINE_BYTES // element_bytes
    padded = -(-elements // per_line) * per_line
    return padded + per_line if (padded * element_bytes) % 1024 == 0 else padded


def onednn_lstm_workspace_bytes(steps: int, batch: int, input_size: int, hidden_size: int) -> int:
    """The workspace oneDNN's LSTM layer keeps for its backward (fp32, one layer, one direction):
    its gates and hidden states per step, then the layer's states, cell states and their gradients
    over steps + 1 and two layers' worth, each buffer starting on a page. Fitted to torch 2.13's
    oneDNN to the byte on 23 shapes (tests/test_trace.py checks five); bf16 keeps less, so it is an
    upper bound there."""
    states = _padded_leading_dim(max(input_size, hidden_size))
    buffers = [
        steps * batch * _padded_leading_dim(4 * hidden_size) * 4,  # gates
        steps * batch * _padded_leading_dim(hidden_size) * 4,  # hidden states
    ]
    for leading_dim in (states, hidden_size, states, states, hidden_size):  # states, cell states, gradients
        buffers.append(2 * (steps + 1) * batch * leading_dim * 4)
    offset = 0
    for size in buffers:
        offset = -(-offset // _PAGE_BYTES) * _PAGE_BYTES + size
    return -(-offset // _PAGE_BYTES) * _PAGE_BYTES
