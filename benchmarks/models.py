"""Second-size and benchmark-only model specs, used as `benchmarks/models.py:FUNC`.

Every function is FUNC(batch_size=B, seq_len=S) -> (model, inputs), built from planner.tracing.models configs.
"""

from __future__ import annotations

from pathlib import Path

from planner.tracing.models import (
    ConvNetConfig,
    EncoderConfig,
    GPTConfig,
    LlamaConfig,
    MLPConfig,
)
from planner.tracing.specs import (
    _build_convnet,
    _build_encoder,
    _build_gpt,
    _build_kwargs_llama,
    _build_llama,
    _build_mlp,
)

FILE = str(Path(__file__).resolve())


def spec(func: str) -> str:
    """The spec string of one of this file's functions."""
    return f"{FILE}:{func}"


# -- accuracy: a bigger size of every tiny preset (more layers and wider) ----------------------
def llama_small(batch_size: int, seq_len: int):
    return _build_llama(LlamaConfig(256, 192, 512, 4, 6, 6), batch_size, seq_len)


def mistral_small(batch_size: int, seq_len: int):
    return _build_llama(LlamaConfig(256, 192, 640, 4, 12, 4), batch_size, seq_len)


def gpt2_small(batch_size: int, seq_len: int):
    return _build_gpt(GPTConfig(vocab_size=256, block_size=512, n_layer=4, n_head=4, n_embd=128), batch_size, seq_len)


def bert_small(batch_size: int, seq_len: int):
    return _build_encoder(EncoderConfig(512, 192, 4, 4, 768, 512), batch_size, seq_len)


def resnet_small(batch_size: int, seq_len: int):
    return _build_convnet(
        ConvNetConfig(channels=(16, 32, 64, 128), blocks=(2, 2, 2, 2), num_classes=10), batch_size, seq_len
    )


def mlp_small(batch_size: int, seq_len: int):
    return _build_mlp(MLPConfig(64, 256, 4, 64), batch_size, seq_len)


def kwargs_small(batch_size: int, seq_len: int):
    return _build_kwargs_llama(LlamaConfig(256, 128, 344, 4, 4, 2), batch_size, seq_len)


# -- quality: small models whose activations dominate the peak (small vocab, many layers) ------
def llama_act(batch_size: int, seq_len: int):
    return _build_llama(LlamaConfig(64, 128, 344, 16, 4, 4), batch_size, seq_len)


def gpt2_act(batch_size: int, seq_len: int):
    return _build_gpt(GPTConfig(vocab_size=64, block_size=1024, n_layer=16, n_head=4, n_embd=128), batch_size, seq_len)


def resnet_act(batch_size: int, seq_len: int):
    return _build_convnet(
        ConvNetConfig(channels=(16, 32, 64, 64), blocks=(8, 4, 4, 4), num_classes=10), batch_size, seq_len
    )


def mlp_act(batch_size: int, seq_len: int):
    return _build_mlp(MLPConfig(64, 256, 16, 64), batch_size, seq_len)


# -- solver scaling and GPU check: Llama-shaped, hidden 1024 ----------------------------------
def _llama_1024(layers: int, batch_size: int, seq_len: int):
    return _build_llama(LlamaConfig(4096, 1024, 2816, layers, 16, 16), batch_size, seq_len)


def llama_1024_L2(batch_size: int, seq_len: int):
    return _llama_1024(2, batch_size, seq_len)


def llama_1024_L8(batch_size: int, seq_len: int):
    return _llama_1024(8, batch_size, seq_len)


def llama_1024_L16(batch_size: int, seq_len: int):
    return _llama_1024(16, batch_size, seq_len)


def llama_1024_L32(batch_size: int, seq_len: int):
    return _llama_1024(32, batch_size, seq_len)


def llama_1024_L64(batch_size: int, seq_len: int):
    return _llama_1024(64, batch_size, seq_len)


def llama_1024_L128(batch_size: int, seq_len: int):
    return _llama_1024(128, batch_size, seq_len)


# -- pipeline bubbles measured on gloo: enough compute per block that a recompute outlasts the messages
def llama_pipe(batch_size: int, seq_len: int):
    return _build_llama(LlamaConfig(1024, 512, 1408, 8, 8, 8), batch_size, seq_len)
