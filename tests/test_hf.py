"""Hugging Face models through `hf:PATH/config.json` (runs only where transformers is installed)."""

from __future__ import annotations

import json
import warnings

import pytest

pytest.importorskip("transformers")

from planner.api import plan_model, verify_model  # noqa: E402
from planner.config import TrainConfig  # noqa: E402
from planner.errors import SpecError  # noqa: E402
from planner.tracing.hf import hf_builder, skip_init  # noqa: E402
from planner.tracing.recorder import trace  # noqa: E402

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


@pytest.fixture()
def hf_spec(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return f"hf:{tmp_path / 'config.json'}"


def test_hf_llama_prediction_within_3_percent(hf_spec):
    result = verify_model(hf_spec, TrainConfig(batch_size=8, seq_len=128))
    assert abs(result.error) <= 0.03, result


def test_hf_trace_prints_no_module_tracker_false_alarm(hf_spec):
    # transformers' hub kernels nest two `Func` modules; torch's ModTracker warns (and swaps the
    # process's warnings.formatwarning) at every such call
    formatwarning = warnings.formatwarning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace(hf_spec, batch_size=2, seq_len=16)
    assert not [w for w in caught if "module hierarchy" in str(w.message)]
    assert warnings.formatwarning is formatwarning


def test_hf_llama_plan_fits_and_is_predicted(hf_spec):
    config = TrainConfig(batch_size=8, seq_len=128)
    _, _, baseline = plan_model(hf_spec, config, 10**12)
    plan, _, _ = plan_model(hf_spec, config, int(0.6 * baseline))
    assert plan.decisions
    result = verify_model(hf_spec, config, plan)
    assert result.measured_bytes <= plan.budget_bytes
    assert abs(result.error) <= 0.03, result


VIT = {
    "architectures": ["ViTForImageClassification"],
    "model_type": "vit",
    "image_size": 32,
    "patch_size": 8,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_labels": 10,
}


def test_hf_config_builds_its_architecture_with_its_inputs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(VIT))  # a vision model: seq_len is the image side
    result = verify_model(f"hf:{tmp_path / 'config.json'}", TrainConfig(batch_size=4, seq_len=32))
    assert abs(result.error) <= 0.01, result


T5 = {
    "model_type": "t5",
    "vocab_size": 512,
    "d_model": 32,
    "d_ff": 64,
    "d_kv": 8,
    "num_layers": 2,
    "num_heads": 4,
    "decoder_start_token_id": 0,
}
M2M100 = {  # LayerDrop on, as in the released configs
    "model_type": "m2m_100",
    "vocab_size": 512,
    "d_model": 32,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "max_position_embeddings": 64,
    "encoder_layerdrop": 0.05,
    "decoder_layerdrop": 0.05,
}


@pytest.mark.parametrize(
    ("config", "model_class"),
    [
        ({k: v for k, v in VIT.items() if k != "architectures"}, "ViTForImageClassification"),
        (T5, "T5ForConditionalGeneration"),
        ({**T5, "model_type": "mt5"}, "MT5ForConditionalGeneration"),
        ({**VIT, "architectures": [], "model_type": "bert", "vocab_size": 64}, "BertLMHeadModel"),
    ],
)
def test_hf_config_without_an_architecture_builds_the_model_its_type_trains_as(tmp_path, config, model_class):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with skip_init():
        model, _ = hf_builder(str(tmp_path / "config.json"))(1, 16)
    assert type(model).__name__ == model_class


def test_hf_seq2seq_config_without_an_architecture_and_with_layerdrop_is_predicted_exactly(tmp_path):
    # the step is built with every layer (LayerDrop's draw is no value a fake tensor has)
    (tmp_path / "config.json").write_text(json.dumps(M2M100))
    result = verify_model(f"hf:{tmp_path / 'config.json'}", TrainConfig(batch_size=2, seq_len=32))
    assert abs(result.error) <= 0.01, result


def test_hf_config_of_a_type_with_no_trainable_head_says_what_to_add(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "encodec"}))
    with pytest.raises(SpecError, match="'encodec' has no causal.*\"architectures\""):
        verify_model(f"hf:{tmp_path / 'config.json'}", TrainConfig(batch_size=1, seq_len=32))


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"model_type": "wav2vec2", "architectures": ["Wav2Vec2ForCTC"]}, "Wav2Vec2ForCTC .* takes 'input_values'"),
        ({"model_type": "clip", "architectures": ["CLIPModel"]}, "CLIPModel .* has no vocab_size"),
    ],
)
def test_hf_config_whose_inputs_memplan_cannot_make_says_to_write_a_builder(tmp_path, config, needle):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SpecError, match=f"{needle}.*--model PATH.py:FUNC"):
        hf_builder(str(tmp_path / "config.json"))(1, 16)


BART = f"hf:{__import__('pathlib').Path(__file__).parent / 'data' / 'bart_tiny' / 'config.json'}"


def test_hf_encoder_decoder_traces_and_is_predicted_within_3_percent():
    # BART's decoder makes its own float mask of ones; transformers' masking_utils reads it
    # (`padding_mask.sum() == numel`): its real value answers, it is no model data
    result = verify_model(BART, TrainConfig(batch_size=2, seq_len=64))
    assert abs(result.error) <= 0.03, result


@pytest.mark.slow
def test_hf_encoder_decoder_plan_fits_and_is_predicted():
    config = TrainConfig(batch_size=2, seq_len=64)
    _, _, baseline = plan_model(BART, config, 10**12)
    plan, _, _ = plan_model(BART, config, int(0.8 * baseline))
    assert plan.decisions
    result = verify_model(BART, config, plan)
    assert result.measured_bytes <= plan.budget_bytes
    assert abs(result.error) <= 0.03, result
