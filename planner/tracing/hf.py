"""Hugging Face models from a config file (transformers is an optional dependency)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable

from torch import nn

from planner.errors import SpecError
from planner.tracing.models import random_tokens

__all__ = ["hf_builder"]


def _build_hf(config_path: str, batch_size: int, seq_len: int) -> tuple[nn.Module, dict]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_path)
    input_ids, labels = random_tokens(batch_size, seq_len, config.vocab_size)
    return AutoModelForCausalLM.from_config(config), {"input_ids": input_ids, "labels": labels}


def hf_builder(config_path: str) -> Callable[[int, int], tuple[nn.Module, dict]]:
    """build(batch_size, seq_len) for a Hugging Face causal LM config; SpecError when unusable."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise SpecError("hf: specs need the transformers package: pip install transformers") from e
    if not Path(config_path).exists():
        raise SpecError(f"Hugging Face config {config_path} not found; point hf: at a config.json or its folder")
    return partial(_build_hf, config_path)
