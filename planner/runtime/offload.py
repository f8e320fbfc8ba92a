"""Offload of saved activations: to pinned host memory on a side stream (CUDA) or to files in a private
spill directory."""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["SPILL_PREFIX", "Spilled", "HostCopy", "pack_to_host", "spillable", "unpack_from_host", "storage_ptrs"]

SPILL_PREFIX = "memplan-spill-"


def storage_ptrs(tensors: Iterable[Any]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


def _dense(t: torch.Tensor) -> bool:
    """Whether `t` covers its memory exactly once in some dim order (a permuted contiguous tensor)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The values of any strided tensor (0-d, a view, non-contiguous, conjugated, any dtype) as bytes."""
    flat = t.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


class Spilled:
    """A saved tensor written to one raw file (mode 0600); the file goes when this record is read or freed."""

    def __init__(self, path: Path, t: torch.Tensor) -> None:
        self.path = path
        self.dtype = t.dtype
        self.shape = tuple(t.shape)
        self.device = t.device
        self.stride = None if t.is_contiguous() or not _dense(t) else tuple(t.stride())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            _raw_bytes(t).tofile(f)
        self.cleanup = weakref.finalize(self, Path.unlink, path, True)

    def load(self) -> torch.Tensor:
        if not self.path.exists():
            raise RuntimeError(
                f"spilled activation {self.path} is gone; keep the plan handle "
                "until backward has run (call remove() after the step)"
            )
        data = torch.from_numpy(np.fromfile(self.path, dtype=np.uint8))
        self.cleanup()
        if data.numel() == 0:  # an empty tensor: nothing to view as another dtype
            return torch.empty(self.shape, dtype=self.dtype, device=self.device)
        flat = data.view(self.dtype).reshape(self.shape)
        if self.stride is None:
            return flat.to(self.device)
        out = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        return out.copy_(flat)  # same strides as the saved tensor (a transpose stays one)


@dataclass(frozen=True)
class HostCopy:
    """A saved CUDA tensor copied to pinned host memory on a side stream."""

    host: torch.Tensor
    event: Any
    device: torch.device


def spillable(t: torch.Tensor) -> bool:
    """Whether `t` can be copied out and back as raw bytes: a plain strided tensor (not sparse,
    nested or a tensor subclass, which stay in memory)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and not t.is_nested


def pack_to_host(t: torch.Tensor, stream: Any) -> Any:
    if t.device.type != "cuda":
        return t.clone()  # nothing to move to; the planner never plans this
    host = torch.empty_like(t, device="cpu", pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(t.device))
    with torch.cuda.stream(stream):
        host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    t.record_stream(stream)
    return HostCopy(host, event, t.device)


def unpack_from_host(packed: Any) -> torch.Tensor:
    if not isinstance(packed, HostCopy):
        return packed
    torch.cuda.current_stream(packed.device).wait_event(packed.event)
    return packed.host.to(packed.device, non_blocking=True)
