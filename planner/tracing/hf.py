"""Hugging Face support: models from a config file, and what makes a model take, on fake
tensors, the path its eager run takes (transformers is an optional dependency).

- transformers treats a FakeTensor as "tracing" (`is_tracing`) and then builds causal masks and
  repeats key/value heads that the eager run skips: :func:`eager_transformers` tells it no.
- Weight initialisation does not change memory, and some of it (`trunc_normal_`) loops on data
  values: :func:`skip_init` turns `torch.nn.init` (and transformers' copy of it) into no-ops
  while a model builds for the trace.
- A key/value cache changes what a recompute runs: training, the trace and applied plans run
  without it (:func:`disable_kv_cache`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from pathlib import Path

import torch
from torch import nn

from planner.errors import SpecError
from planner.tracing.models import random_tokens

__all__ = [
    "disable_kv_cache",
    "eager_masks_under_export",
    "eager_transformers",
    "hf_builder",
    "hf_max_positions",
    "skip_init",
]


_LAYERDROP_ATTRIBUTES = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def _without_layerdrop(config: object) -> None:
    """LayerDrop skips each layer with a probability every step (its draw is no value a fake
    tensor has): the step is built with every layer, the one with the most memory."""
    for name in _LAYERDROP_ATTRIBUTES:
        if getattr(config, name, 0.0):
            setattr(config, name, 0.0)


def _task_model_class(config: object, config_path: str) -> type[nn.Module]:
    """The model class a config without a known architecture trains as: a seq2seq LM for an
    encoder-decoder, else the first of a causal LM, a masked LM, an image classifier."""
    import transformers

    auto_classes = [transformers.AutoModelForSeq2SeqLM] if getattr(config, "is_encoder_decoder", False) else []
    auto_classes += [
        transformers.AutoModelForCausalLM,
        transformers.AutoModelForMaskedLM,
        transformers.AutoModelForImageClassification,
    ]
    for auto_class in auto_classes:
        if type(config) in auto_class._model_mapping:
            return auto_class._model_mapping[type(config)]
    raise SpecError(
        f"Hugging Face config {config_path} names no architecture memplan can build, and its model type "
        f"{getattr(config, 'model_type', '?')!r} has no causal, seq2seq or masked LM nor image classifier; "
        'add the model class to it, e.g. "architectures": ["T5ForConditionalGeneration"]'
    )


def _check_inputs(model_class: type[nn.Module], config: object, config_path: str) -> None:
    """SpecError unless memplan can make the model's inputs: token ids (with a vocabulary) or images."""
    name = getattr(model_class, "main_input_name", "input_ids")
    vocab = getattr(config, "vocab_size", None)
    if name == "pixel_values" or (name == "input_ids" and vocab is not None):
        return
    takes = f"takes {name!r}" if name != "input_ids" else "has no vocab_size (a multimodal config)"
    raise SpecError(
        f"{model_class.__name__} ({config_path}) {takes}, and hf: specs make token ids or images only; "
        "give memplan a builder instead: --model PATH.py:FUNC returning (model, inputs)"
    )


def _build_hf(config_path: str, batch_size: int, seq_len: int) -> tuple[nn.Module, dict]:
    """The config's first architecture (else the model its type trains as: :func:`_task_model_class`)
    with random inputs: images of side seq_len for vision models, token ids and labels otherwise."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_path)
    _without_layerdrop(config)
    architecture = (getattr(config, "architectures", None) or [""])[0]
    model_class = getattr(transformers, architecture, None) or _task_model_class(config, config_path)
    _check_inputs(model_class, config, config_path)
    model = model_class(config)
    _check_learned_positions(model, config_path, seq_len, _max_positions(config))
    if model.main_input_name == "pixel_values":
        channels = getattr(config, "num_channels", 3)
        labels = torch.randint(0, max(1, getattr(config, "num_labels", 2)), (batch_size,))
        return model, {"pixel_values": torch.randn(batch_size, channels, seq_len, seq_len), "labels": labels}
    input_ids, labels = random_tokens(batch_size, seq_len, config.vocab_size)
    return model, {"input_ids": input_ids, "labels": labels}


def _max_positions(config: object) -> int | None:
    """max_position_embeddings (n_positions, n_ctx: the same in older configs), None if absent."""
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _check_learned_positions(model: nn.Module, config_path: str, seq_len: int, limit: int | None) -> None:
    """A SpecError when seq_len exceeds a table of learned positions (a rotary model's limit is soft:
    transformers runs it longer, so only a position embedding makes it a hard one)."""
    if limit is None or seq_len <= limit:
        return
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1].lower()
        if isinstance(module, nn.Embedding) and ("pos" in leaf or leaf == "wpe"):
            raise SpecError(
                f"sequence length {seq_len} exceeds the {limit} positions of {config_path}; "
                f"use --seq-len {limit} or less"
            )


def hf_max_positions(config_path: str) -> int | None:
    """The position limit a Hugging Face config states (max_position_embeddings / n_positions),
    None when it states none or cannot be read (building it then reports why)."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(config_path)
    except Exception:
        return None
    return _max_positions(config)


def hf_builder(config_path: str) -> Callable[[int, int], tuple[nn.Module, dict]]:
    """build(batch_size, seq_len) for a Hugging Face config (its `architectures`, else its task model;
    seq_len is the image side of a vision model); SpecError when unusable."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise SpecError("hf: specs need the transformers package: pip install transformers") from e
    if not Path(config_path).exists():
        raise SpecError(f"Hugging Face config {config_path} not found; point hf: at a config.json or its folder")
    return partial(_build_hf, config_path)


_INIT_NAMES = tuple(
    n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_") and callable(getattr(nn.init, n))
)
_HF_IMPORT_UTILS = "transformers.utils.import_utils"
_HF_INIT = "transformers.initialization"
_HF_MASKING = "transformers.masking_utils"


def _false(*_args) -> bool:
    return False


def _none(*_args) -> None:
    return None


@contextmanager
def _replaced(module_name: str, replacements: dict[str, object]) -> Iterator[None]:
    """While active, the named attributes of a loaded transformers module are `replacements`
    (nothing changes where the module is not loaded or lacks one of them: another version)."""
    module = sys.modules.get(module_name)
    if module is None or not all(hasattr(module, name) for name in replacements):
        yield
        return
    originals = {name: getattr(module, name) for name in replacements}
    for name, value in replacements.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(module, name, original)


def eager_transformers() -> AbstractContextManager[None]:
    """While active, transformers does not see fake tensors as a sign of tracing."""
    return _replaced(_HF_IMPORT_UTILS, {"is_fake_tensor": _false})


def eager_masks_under_export() -> AbstractContextManager[None]:
    """While active, transformers builds the attention mask under torch.export as it does in eager
    for a step whose inputs give no positions and no padding mask (sequences neither packed nor padded).

    Exporting, transformers cannot read values, so it assumes sequences may be packed and
    materialises the causal mask it skips in eager; with a mask SDPA cannot take grouped key/value
    heads either, so each layer repeats them. A traced pipeline stage would then save a float mask
    and repeated keys and values per layer and microbatch that the eager step never makes.
    """
    # not exporting (the mask may be skipped), and no packed sequences
    return _replaced(_HF_MASKING, {"is_torchdynamo_exporting": _false, "find_packed_sequence_indices": _none})


def _keep(tensor: torch.Tensor, *_args, **_kwargs) -> torch.Tensor:
    return tensor


@contextmanager
def skip_init() -> Iterator[None]:
    """While active, `torch.nn.init.*_` functions (and transformers' table of them) do nothing.

    transformers records torch's init functions when it is imported; if it is first imported
    inside this context, its table is put back to torch's functions on exit.
    """
    originals = {name: getattr(nn.init, name) for name in _INIT_NAMES}
    hf_init = sys.modules.get(_HF_INIT)
    hf_originals = dict(getattr(hf_init, "TORCH_INIT_FUNCTIONS", {}))
    for name in _INIT_NAMES:
        setattr(nn.init, name, _keep)
    hf_table = getattr(hf_init, "TORCH_INIT_FUNCTIONS", None)
    if hf_table is not None:
        for name in hf_table:
            hf_table[name] = _keep
    try:
        yield
    finally:
        for name, func in originals.items():
            setattr(nn.init, name, func)
        hf_table = getattr(sys.modules.get(_HF_INIT), "TORCH_INIT_FUNCTIONS", None)
        if hf_table is not None:
            for name, func in hf_table.items():
                if func is _keep:
                    hf_table[name] = hf_originals.get(name, originals.get(name, func))


def _configs_of(model: nn.Module) -> list[object]:
    """Every distinct config object a model's modules hold (an encoder-decoder has several)."""
    seen: dict[int, object] = {}
    for module in model.modules():
        for attr in ("config", "generation_config"):
            config = getattr(module, attr, None)
            if config is not None and hasattr(config, "use_cache"):
                seen.setdefault(id(config), config)
    return list(seen.values())


def disable_kv_cache(model: nn.Module) -> list[tuple[object, bool]]:
    """Turn `use_cache` off on every config object of a model (HF); returns what to restore."""
    changed = []
    for config in _configs_of(model):
        if config.use_cache:
            changed.append((config, config.use_cache))
            config.use_cache = False
    return changed
