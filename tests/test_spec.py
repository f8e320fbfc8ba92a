"""Model specs: presets build and train for real and on fake tensors; spec strings resolve or fail clearly."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses import FakeTensorMode

from planner.errors import SpecError
from planner.tracing.models import KwargsLlama, Llama, LlamaConfig, repeat_kv
from planner.tracing.specs import PRESETS, ModelSpec, default_seq_len, list_presets, resolve_spec

TINY = [name for name in PRESETS if name.endswith("-tiny")]
BIG = {  # preset -> (expected parameter count, relative tolerance)
    "gpt2": (124.4e6, 1e-3),
    "llama-7b": (6.74e9, 1e-3),
    "llama-13b": (13.02e9, 1e-3),
    "llama-70b": (70_553_706_496, 2e-3),
    "mistral-7b": (7.24e9, 1e-3),
    "bert-base": (109.5e6, 1e-3),
    "resnet-small": (11.68e6, 1e-3),
}


def step(model: torch.nn.Module, inputs: tuple | dict) -> torch.Tensor:
    """Forward and backward; the loss is the output when scalar, else its .loss."""
    out = model(*inputs) if isinstance(inputs, tuple) else model(**inputs)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    assert loss.dim() == 0
    loss.backward()
    return loss


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------- presets


def test_every_big_preset_has_a_tiny_version() -> None:
    for name in ["gpt2", "llama-7b", "llama-13b", "llama-70b", "mistral-7b"]:
        assert name in PRESETS and f"{name}-tiny" in PRESETS
    assert {"bert-tiny", "bert-base", "resnet-tiny", "resnet-small", "mlp-tiny", "mlp-small", "kwargs-tiny"} <= set(
        list_presets()
    )


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_trains_for_real(name: str) -> None:
    model, inputs = resolve_spec(name).build(batch_size=2, seq_len=16)
    loss = step(model, inputs)
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_traces_on_fake_tensors(name: str) -> None:
    with FakeTensorMode():
        model, inputs = resolve_spec(name).build(batch_size=2, seq_len=64)
        step(model, inputs)


@pytest.mark.parametrize("name", BIG)
def test_big_preset_parameter_count_on_meta(name: str) -> None:
    expected, tolerance = BIG[name]
    with torch.device("meta"):
        model, inputs = PRESETS[name].build(batch_size=1, seq_len=128)
    assert num_params(model) == pytest.approx(expected, rel=tolerance)
    assert all(t.device.type == "meta" for t in inputs)


def test_llama_70b_builds_on_fake_tensors() -> None:
    with FakeTensorMode():
        model, (input_ids, labels) = PRESETS["llama-70b"].build(batch_size=1, seq_len=8192)
    assert num_params(model) == 70_553_706_496
    assert input_ids.shape == labels.shape == (1, 8192) and input_ids.dtype == torch.long


def test_gpt2_rejects_sequences_past_its_positions() -> None:
    with pytest.raises(SpecError, match="exceeds the model's 1024 positions"):
        PRESETS["gpt2"].build(batch_size=1, seq_len=1025)


# ----------------------------------------------------------------------------- model details


def test_grouped_kv_heads_match_sdpa_gqa() -> None:
    q, k, v = torch.randn(2, 8, 5, 4), torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)
    ours = F.scaled_dot_product_attention(q, repeat_kv(k, 8), repeat_kv(v, 8), is_causal=True)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ours, reference)


def test_kwargs_model_with_full_mask_matches_causal_llama() -> None:
    config = LlamaConfig(64, 32, 64, 2, 4, 2)
    plain, keyword = Llama(config), KwargsLlama(config)
    keyword.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 64, (2, 7))
    out = keyword(input_ids=ids, attention_mask=torch.ones(2, 7, dtype=torch.long), labels=ids)
    torch.testing.assert_close(out.logits, plain(ids))
    torch.testing.assert_close(out.loss, plain(ids, ids))


def test_tied_llama_shares_embedding_and_head() -> None:
    model = Llama(LlamaConfig(64, 32, 64, 1, 4, 4, tie_embeddings=True))
    assert model.lm_head.weight is model.embed_tokens.weight


# ----------------------------------------------------------------------------- spec strings


def write_module(tmp_path, body: str) -> str:
    path = tmp_path / "my_model.py"
    path.write_text(body)
    return str(path)


MODEL_FILE = """
import torch
from dataclasses import dataclass

@dataclass
class Size:
    n: int

def make(batch_size, seq_len):
    model = torch.nn.Linear(Size(4).n, 1)
    return model, (torch.randn(batch_size, seq_len, 4),)

def bad_return(batch_size, seq_len):
    return torch.nn.Linear(4, 1)

def fails(batch_size, seq_len):
    raise ValueError("no such size\\nsecond line")

not_a_function = 3
"""


def test_file_function_spec_builds(tmp_path) -> None:
    path = write_module(tmp_path, MODEL_FILE)
    spec = resolve_spec(f"{path}:make")
    assert isinstance(spec, ModelSpec) and spec.name == f"{path}:make"
    model, (x,) = spec.build(batch_size=3, seq_len=5)
    assert model(x).shape == (3, 5, 1)


def test_module_function_spec_builds(tmp_path, monkeypatch) -> None:
    write_module(tmp_path, MODEL_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    model, (x,) = resolve_spec("my_model:make").build(batch_size=2, seq_len=3)
    assert model(x).shape == (2, 3, 1)
    sys.modules.pop("my_model")


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("no-such-model", "unknown model 'no-such-model'; presets: gpt2, "),
        ("no-such-model", "or use PATH.py:FUNC, package.module:FUNC, hf:PATH/config.json"),
        ("missing/file.py:make", "model file missing/file.py not found"),
        ("no_such_package.models:make", "cannot import module no_such_package.models: ModuleNotFoundError"),
        ("planner.tracing.specs:no_such_function", "module planner.tracing.specs has no function 'no_such_function'"),
    ],
)
def test_bad_spec_strings(spec: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        resolve_spec(spec)
    assert words in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("func", "words"),
    [
        ("nope", "has no function 'nope'"),
        ("not_a_function", "has no function 'not_a_function'"),
    ],
)
def test_file_without_the_function(tmp_path, func: str, words: str) -> None:
    path = write_module(tmp_path, MODEL_FILE)
    with pytest.raises(SpecError) as err:
        resolve_spec(f"{path}:{func}")
    assert str(err.value).startswith(f"file {path} {words}")


def test_file_that_fails_to_import(tmp_path) -> None:
    path = write_module(tmp_path, "import no_such_package\n")
    with pytest.raises(SpecError, match="cannot import .*my_model.py: ModuleNotFoundError"):
        resolve_spec(f"{path}:make")


def test_function_errors_and_bad_returns(tmp_path) -> None:
    path = write_module(tmp_path, MODEL_FILE)
    with pytest.raises(SpecError) as err:
        resolve_spec(f"{path}:fails").build(batch_size=1, seq_len=1)
    assert str(err.value) == f"model function '{path}:fails' raised ValueError: no such size"
    with pytest.raises(SpecError, match=r"must return \(nn.Module, tuple or dict of inputs\), got Linear"):
        resolve_spec(f"{path}:bad_return").build(batch_size=1, seq_len=1)


@pytest.mark.parametrize(
    ("batch_size", "seq_len", "words"),
    [
        (0, 8, "batch size must be a positive integer, got 0"),
        (2, -1, "sequence length must be a positive integer, got -1"),
        (2.0, 8, "batch size must be a positive integer, got 2.0"),
    ],
)
def test_build_rejects_bad_sizes(batch_size, seq_len, words: str) -> None:
    with pytest.raises(SpecError, match=words):
        PRESETS["mlp-tiny"].build(batch_size=batch_size, seq_len=seq_len)


def test_hf_spec_without_transformers(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(SpecError, match="hf: specs need the transformers package: pip install transformers"):
        resolve_spec(f"hf:{tmp_path}/config.json")


def test_hf_spec_with_a_missing_config_is_one_line(tmp_path) -> None:
    """Building real Hugging Face models from configs is tested in tests/test_hf.py and tests/test_zoo.py."""
    with pytest.raises(SpecError, match="Hugging Face config .*missing.json not found"):
        resolve_spec(f"hf:{tmp_path}/missing.json")


def test_default_seq_len_is_512_or_the_models_position_limit(tmp_path):
    assert default_seq_len("gpt2-tiny") == 128
    assert default_seq_len("gpt2") == 512  # 1024 positions: 512 stays the default
    assert default_seq_len("llama-7b-tiny") == 512  # rotary: no limit
    assert default_seq_len("tests/none.py:build") == 512  # user files are not imported for this
    pytest.importorskip("transformers")
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 128, "n_positions": 64}
    gpt2 |= {"n_embd": 32, "n_layer": 1, "n_head": 2}
    (tmp_path / "config.json").write_text(json.dumps(gpt2))
    spec = f"hf:{tmp_path / 'config.json'}"
    assert default_seq_len(spec) == 64
    with pytest.raises(SpecError, match="exceeds the 64 positions.*--seq-len 64"):
        resolve_spec(spec).build(1, 65)
