"""Build a model spec on fake CPU tensors so that it runs the path its eager run takes."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from torch import nn

import memplan_compat
from costmodels.hardware import get_device
from planner.tracing.attention import TargetAttention
from planner.tracing.fake_mode import TraceFakeMode
from planner.tracing.hf import disable_kv_cache, eager_transformers, skip_init
from planner.tracing.moe import RoutingAssumption
from planner.tracing.shadow import ShadowMode
from planner.tracing.specs import ModelSpec

__all__ = ["fake_model"]


@contextmanager
def fake_model(
    spec: ModelSpec, batch_size: int, seq_len: int, moe_imbalance: float = 1.0, target: str = "cpu"
) -> Iterator[tuple[nn.Module, Any, RoutingAssumption]]:
    """(model, inputs, routing) built on fake tensors, in train mode; valid inside the block.

    The model builds without weight init (it does not change memory, and some init loops on
    data). Inside the block small integer/bool tensors keep real values that answer
    data-dependent checks, transformers is not told it is tracing, mixture-of-experts routing
    follows `moe_imbalance` (1.0: balanced), and the key/value cache is off, as in training.
    Attention runs the kernels the `target` device (a name or profile, see costmodels.hardware)
    picks: a GPU's, not the tracing CPU's (tracing/attention.py).
    """
    device = get_device(target)
    with ExitStack() as stack:
        # an op that fails on fake tensors becomes one line (TraceError); torch would also log its stack
        log = memplan_compat.fake_tensor_log
        stack.callback(log.setLevel, log.level)
        log.setLevel(logging.CRITICAL)
        fake_mode = stack.enter_context(TraceFakeMode())
        if device.is_cuda:
            stack.enter_context(TargetAttention(device))
        routing = RoutingAssumption(moe_imbalance)
        stack.enter_context(ShadowMode(fake_mode, route=routing))
        with skip_init(), warnings.catch_warnings():
            # torch's Tensor.__deepcopy__ reads a fake storage's data pointer (nn.TransformerEncoder
            # copies its layer) and warns that it means nothing; nothing here reads it
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            model, inputs = spec.build(batch_size=batch_size, seq_len=seq_len)
        stack.enter_context(eager_transformers())
        disable_kv_cache(model)
        model.train()
        yield model, inputs, routing
