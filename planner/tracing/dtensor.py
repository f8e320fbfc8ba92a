"""DTensor without importing it: torch.distributed.tensor costs half a second to import, and no
DTensor exists until something (a tensor-parallel plan, FSDP2) has imported it."""

from __future__ import annotations

import sys

__all__ = ["dtensor_type"]


def dtensor_type() -> type | None:
    """The DTensor class where torch.distributed.tensor is loaded, else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor
