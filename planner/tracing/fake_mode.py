"""The fake-tensor mode every memplan trace builds and runs its model in."""

from __future__ import annotations

from typing import Any

from memplan_compat import FakeTensorMode

__all__ = ["TraceFakeMode"]


class TraceFakeMode(FakeTensorMode):
    """torch's ``FakeTensorMode`` (non-fake inputs allowed) whose fake tensors survive ``copy.deepcopy``.

    torch's ``Tensor.__deepcopy__`` deep-copies a fake tensor's attributes, its mode among them, and
    views of the copy then get storages of their own: each transpose of a parameter of
    ``nn.TransformerEncoder`` (which deep-copies its layer) was counted as a new tensor, 15% over
    the measured peak. A copy of the mode is the mode.
    """

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)

    def __deepcopy__(self, memo: dict[int, Any]) -> TraceFakeMode:
        return self
