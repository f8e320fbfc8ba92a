"""A model's identity for plan files: sha256 over its module structure and tensor metadata."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from planner.tracing.blocks import segment_children

__all__ = ["model_fingerprint", "is_segment_of", "num_parameters"]


def _structure(model: Any) -> dict[str, Any]:
    modules = sorted([name, type(m).__qualname__] for name, m in model.named_modules())
    tensors = []
    for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:  # metadata only: works for fake and meta tensors
            tensors.append([kind, name, [str(s) for s in t.shape], str(t.dtype)])
    return {"modules": modules, "tensors": sorted(tensors)}


def is_segment_of(model: Any, path: str) -> bool:
    """Whether `path` (PARENT.I:J) names consecutive children of one of the model's nn.Sequential."""
    try:
        segment_children(model, path)
    except ValueError:
        return False
    return True


def model_fingerprint(model: Any) -> str:
    """sha256 over module paths/classes and parameter/buffer names, shapes and dtypes."""
    blob = json.dumps(_structure(model), sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(blob.encode("utf-8")).hexdigest()


def num_parameters(model: Any) -> int:
    return sum(int(p.numel()) for p in model.parameters())
