"""How inductor lays out a module memplan compiles: one rule for the planner's estimate and the run.

Inductor's layout optimization is off for blocks: it re-lays each block's convolution inputs and
weights out as channels-last copies and saves those copies for the backward, and such blocks ran
slower. It stays on (torch's default) for the whole model (path WHOLE_MODEL): there the input is
re-laid once, and without it the convolutions held 45 MB more on the benchmark ResNet than inductor
estimated (the kernel library's own copies). It is off for a whole model too where oneDNN would
compute a convolution's weight gradient wrongly in channels-last (`onednn_faulty_convs`,
docs/safety.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["ONEDNN_CHANNEL_BLOCK", "WHOLE_MODEL", "inductor_options", "onednn_faulty_convs"]

WHOLE_MODEL = ""  # the module path of a plan that compiles the whole model (and its loss) at one budget


ONEDNN_CHANNEL_BLOCK = 16  # oneDNN's AVX-512 channel block (AVX2's is 8): fewer input channels are unsafe


def onednn_faulty_convs(module: nn.Module) -> list[str]:
    """Paths of the convolutions in `module` whose weight gradient oneDNN gets wrong in channels-last:
    1x1, strided, fewer than ONEDNN_CHANNEL_BLOCK input channels (per group), on CPU with oneDNN on.
    Its 1x1 weight-gradient kernels (`jit_avx512_common_1x1_convolution_bwd_weights`, AVX2's too)
    write past their workspace there: a crash, or wrong gradients without a word
    (https://github.com/uxlfoundation/oneDNN/issues/6035, open). Empty where oneDNN is off."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return []
    return [
        path
        for path, m in module.named_modules()
        if isinstance(m, nn.Conv2d)
        and m.kernel_size == (1, 1)
        and m.stride != (1, 1)
        and m.in_channels // m.groups < ONEDNN_CHANNEL_BLOCK
        and m.weight.device.type == "cpu"
    ]


def inductor_options(path: str, module: nn.Module) -> dict[str, Any]:
    """Inductor's config while `module`, at `path`, compiles (and while memplan estimates its peak):
    layout optimization off for blocks and for a whole model with `onednn_faulty_convs`."""
    if path != WHOLE_MODEL or onednn_faulty_convs(module):
        return {"layout_optimization": False}
    return {}
