"""Model specs: what memplan traces (on fake tensors) and builds for real (for verification).

A spec string is a preset name, `PATH.py:FUNC`, `package.module:FUNC` or `hf:PATH/config.json`.
FUNC is called as FUNC(batch_size=B, seq_len=S) and returns (model, inputs), inputs being a tuple of
positional arguments or a dict of keyword arguments. The caller enters any device or fake-tensor
context; building moves nothing to a device and downloads nothing.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from planner.errors import SpecError
from planner.tracing.hf import hf_builder, hf_max_positions
from planner.tracing.models import (
    GPT,
    MLP,
    ConvNet,
    ConvNetConfig,
    Encoder,
    EncoderConfig,
    GPTConfig,
    KwargsLlama,
    Llama,
    LlamaConfig,
    MLPConfig,
    random_tokens,
)

__all__ = ["DEFAULT_SEQ_LEN", "ModelSpec", "PRESETS", "default_seq_len", "list_presets", "resolve_spec"]

Inputs = tuple[Any, ...] | dict[str, Any]
SPEC_FORMS = "PATH.py:FUNC, package.module:FUNC, hf:PATH/config.json"
DEFAULT_SEQ_LEN = 512
"""Sequence length when none is given and the model's position limit is not smaller."""


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _describe(value: object) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(type(v).__name__ for v in value) + ")"
    return type(value).__name__


def _check_positive(what: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(f"{what} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    builder: Callable[..., tuple[nn.Module, Inputs]]
    max_positions: int | None = None
    """The longest sequence the model takes (learned positions), None when it has no such limit."""

    def build(self, batch_size: int, seq_len: int) -> tuple[nn.Module, Inputs]:
        """Build (model, inputs) in the caller's device/fake context; any failure becomes a SpecError."""
        _check_positive("batch size", batch_size)
        _check_positive("sequence length", seq_len)
        try:
            built = self.builder(batch_size=batch_size, seq_len=seq_len)
        except SpecError:
            raise
        except Exception as e:
            raise SpecError(f"model function '{self.name}' raised {_one_line(e)}") from e
        if not (
            isinstance(built, tuple)
            and len(built) == 2
            and isinstance(built[0], nn.Module)
            and isinstance(built[1], (tuple, dict))
        ):
            raise SpecError(
                f"model function '{self.name}' must return (nn.Module, tuple or dict of inputs), got {_describe(built)}"
            )
        return built


# ----------------------------------------------------------------------------- preset builders


def _check_positions(seq_len: int, max_positions: int) -> None:
    if seq_len > max_positions:
        raise SpecError(
            f"sequence length {seq_len} exceeds the model's {max_positions} positions; use --seq-len {max_positions} or less"
        )


def _build_llama(config: LlamaConfig, batch_size: int, seq_len: int) -> tuple[nn.Module, Inputs]:
    return Llama(config), random_tokens(batch_size, seq_len, config.vocab_size)


def _build_kwargs_llama(config: LlamaConfig, batch_size: int, seq_len: int) -> tuple[nn.Module, Inputs]:
    input_ids, labels = random_tokens(batch_size, seq_len, config.vocab_size)
    attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    return KwargsLlama(config), {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _build_gpt(config: GPTConfig, batch_size: int, seq_len: int) -> tuple[nn.Module, Inputs]:
    _check_positions(seq_len, config.block_size)
    return GPT(config), random_tokens(batch_size, seq_len, config.vocab_size)


def _build_encoder(config: EncoderConfig, batch_size: int, seq_len: int) -> tuple[nn.Module, Inputs]:
    _check_positions(seq_len, config.max_positions)
    return Encoder(config), random_tokens(batch_size, seq_len, config.vocab_size)


def _build_convnet(config: ConvNetConfig, batch_size: int, seq_len: int) -> tuple[nn.Module, Inputs]:
    images = torch.randn(batch_size, config.in_channels, seq_len, seq_len)  # seq_len is the image side
    targets = torch.randint(0, config.num_classes, (batch_size,))
    return ConvNet(config), (images, targets)


def _build_mlp(config: MLPConfig, batch_size: int, seq_len: int) -> tuple[nn.Module, Inputs]:
    x = torch.randn(batch_size, seq_len, config.in_features)
    target = torch.randn(batch_size, seq_len, config.out_features)
    return MLP(config), (x, target)


# ----------------------------------------------------------------------------- presets


def _gpt_spec(name: str, description: str, config: GPTConfig) -> ModelSpec:
    return ModelSpec(name, description, partial(_build_gpt, config), config.block_size)


def _encoder_spec(name: str, description: str, config: EncoderConfig) -> ModelSpec:
    return ModelSpec(name, description, partial(_build_encoder, config), config.max_positions)


def _llama(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int, theta: float = 1e4) -> LlamaConfig:
    return LlamaConfig(vocab, hidden, inter, layers, heads, kv, rope_theta=theta)


_PRESET_LIST = [
    _gpt_spec("gpt2", "GPT-2 124M: 12 layers, 768 wide, 12 heads, 1024 positions", GPTConfig()),
    _gpt_spec(
        "gpt2-medium",
        "GPT-2 355M: 24 layers, 1024 wide, 16 heads, 1024 positions",
        GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    ),
    _gpt_spec(
        "gpt2-tiny",
        "GPT-2 architecture, 2 layers, 64 wide, vocab 256, 128 positions",
        GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=64),
    ),
    ModelSpec(
        "llama-7b",
        "Llama-2-7B: 32 layers, hidden 4096, 32 heads",
        partial(_build_llama, _llama(32000, 4096, 11008, 32, 32, 32)),
    ),
    ModelSpec(
        "llama-7b-tiny",
        "Llama-2-7B architecture, 2 layers, hidden 128, vocab 256",
        partial(_build_llama, _llama(256, 128, 344, 2, 4, 4)),
    ),
    ModelSpec(
        "llama-13b",
        "Llama-2-13B: 40 layers, hidden 5120, 40 heads",
        partial(_build_llama, _llama(32000, 5120, 13824, 40, 40, 40)),
    ),
    ModelSpec(
        "llama-13b-tiny",
        "Llama-2-13B architecture, 3 layers, hidden 160, vocab 256",
        partial(_build_llama, _llama(256, 160, 432, 3, 5, 5)),
    ),
    ModelSpec(
        "llama-70b",
        "Llama-3-70B: 80 layers, hidden 8192, 64 query / 8 key-value heads, vocab 128256",
        partial(_build_llama, _llama(128256, 8192, 28672, 80, 64, 8, 5e5)),
    ),
    ModelSpec(
        "llama-405b",
        "Llama-3.1-405B: 126 layers, hidden 16384, 128 query / 8 key-value heads, vocab 128256",
        partial(_build_llama, _llama(128256, 16384, 53248, 126, 128, 8, 5e5)),
    ),
    ModelSpec(
        "llama-70b-tiny",
        "Llama-3-70B architecture, 4 layers, hidden 128, 16 query / 2 key-value heads",
        partial(_build_llama, _llama(512, 128, 448, 4, 16, 2, 5e5)),
    ),
    ModelSpec(
        "mistral-7b",
        "Mistral-7B: 32 layers, hidden 4096, 32 query / 8 key-value heads (no sliding window)",
        partial(_build_llama, _llama(32000, 4096, 14336, 32, 32, 8)),
    ),
    ModelSpec(
        "mistral-7b-tiny",
        "Mistral-7B architecture, 2 layers, hidden 128, 8 query / 2 key-value heads",
        partial(_build_llama, _llama(256, 128, 448, 2, 8, 2)),
    ),
    _encoder_spec(
        "bert-base", "BERT-base-style encoder with masked-LM head: 12 layers, 768 wide, 512 positions", EncoderConfig()
    ),
    _encoder_spec("bert-tiny", "BERT-style encoder, 2 layers, 128 wide, vocab 512", EncoderConfig(512, 128, 2, 2, 512)),
    ModelSpec(
        "resnet-small",
        "ResNet-18-like CNN, 1000 classes; seq_len is the image side",
        partial(_build_convnet, ConvNetConfig()),
    ),
    ModelSpec(
        "resnet-tiny",
        "ResNet with 3 stages of one block, 16-64 channels, 10 classes; seq_len is the image side",
        partial(_build_convnet, ConvNetConfig(channels=(16, 32, 64), blocks=(1, 1, 1), num_classes=10)),
    ),
    ModelSpec(
        "mlp-small",
        "MLP, 8 blocks of 2048, 512 features in and out; input (B, seq_len, 512)",
        partial(_build_mlp, MLPConfig(512, 2048, 8, 512)),
    ),
    ModelSpec(
        "mlp-tiny",
        "MLP, 2 blocks of 64, 32 features in and out; input (B, seq_len, 32)",
        partial(_build_mlp, MLPConfig(32, 64, 2, 32)),
    ),
    ModelSpec(
        "kwargs-tiny",
        "Llama-like decoder called with keywords input_ids, attention_mask, labels; returns .loss",
        partial(_build_kwargs_llama, _llama(256, 64, 172, 2, 4, 2)),
    ),
]
PRESETS: dict[str, ModelSpec] = {spec.name: spec for spec in _PRESET_LIST}


def list_presets() -> list[str]:
    return list(PRESETS)


# ----------------------------------------------------------------------------- resolving spec strings

_module_ids = itertools.count()


def _function_spec(spec: str, owner: str, module: object, func_name: str) -> ModelSpec:
    func = getattr(module, func_name, None)
    if not callable(func):
        raise SpecError(f"{owner} has no function '{func_name}'; memplan calls {func_name}(batch_size=B, seq_len=S)")
    return ModelSpec(spec, f"{func_name} from {owner}", func)


def _file_spec(spec: str, path: str, func_name: str) -> ModelSpec:
    file = Path(path)
    if not file.is_file():
        raise SpecError(f"model file {path} not found; check the path in '{spec}'")
    module_name = f"_memplan_spec_{file.stem}_{next(_module_ids)}"
    module_spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise SpecError(f"cannot import {path}: {_one_line(e)}") from e
    return _function_spec(spec, f"file {path}", module, func_name)


def _module_spec(spec: str, module_name: str, func_name: str) -> ModelSpec:
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise SpecError(f"cannot import module {module_name}: {_one_line(e)}") from e
    return _function_spec(spec, f"module {module_name}", module, func_name)


def resolve_spec(spec: str) -> ModelSpec:
    """A preset name, PATH.py:FUNC, package.module:FUNC or hf:PATH/config.json -> ModelSpec."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec.startswith("hf:"):
        config_path = spec.removeprefix("hf:")
        builder = hf_builder(config_path)
        return ModelSpec(spec, f"Hugging Face causal LM from {config_path}", builder, hf_max_positions(config_path))
    target, sep, func_name = spec.rpartition(":")
    if not sep:
        raise SpecError(f"unknown model '{spec}'; presets: {', '.join(PRESETS)}; or use {SPEC_FORMS}")
    if target.endswith(".py"):
        return _file_spec(spec, target, func_name)
    return _module_spec(spec, target, func_name)


def default_seq_len(spec: str) -> int:
    """The sequence length a command uses when none is given: DEFAULT_SEQ_LEN, or the model's
    position limit when smaller (presets and hf: configs; other specs are not imported for this)."""
    if spec in PRESETS or spec.startswith("hf:"):
        limit = resolve_spec(spec).max_positions
        if limit is not None:
            return min(DEFAULT_SEQ_LEN, limit)
    return DEFAULT_SEQ_LEN
