"""The model zoo's builders: Hugging Face architectures from tiny configs (no download) and a model
that keeps its layers as attributes. Each is a memplan model function, so
`--model benchmarks/zoo_models.py:llama` (or `benchmarks.zoo_models:llama`) traces it on fake tensors
and builds it for real."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 128
# The decoders' shared tiny shape: 2 layers, width 32, 4 heads, 256 positions.
TINY_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
)


def _tokens(batch_size: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, seq_len))


def _causal_lm(model: nn.Module, batch_size: int, seq_len: int) -> tuple[nn.Module, dict]:
    """Ids, an attention mask without padding (the eager run then skips the mask: the trace must
    too) and labels."""
    ids = _tokens(batch_size, seq_len)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": _tokens(batch_size, seq_len)}


def llama(batch_size: int, seq_len: int):
    import transformers as hf

    config = hf.LlamaConfig(**TINY_DECODER, num_key_value_heads=4)
    return _causal_lm(hf.LlamaForCausalLM(config), batch_size, seq_len)


def mistral(batch_size: int, seq_len: int):
    import transformers as hf

    config = hf.MistralConfig(**TINY_DECODER, num_key_value_heads=2, sliding_window=None)
    return _causal_lm(hf.MistralForCausalLM(config), batch_size, seq_len)


def phi(batch_size: int, seq_len: int):
    import transformers as hf

    config = hf.PhiConfig(**TINY_DECODER)
    return _causal_lm(hf.PhiForCausalLM(config), batch_size, seq_len)


def gpt_neox(batch_size: int, seq_len: int):
    import transformers as hf

    config = hf.GPTNeoXConfig(**TINY_DECODER)
    return _causal_lm(hf.GPTNeoXForCausalLM(config), batch_size, seq_len)


def gpt2(batch_size: int, seq_len: int):
    import transformers as hf

    config = hf.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, bos_token_id=0, eos_token_id=0
    )
    return _causal_lm(hf.GPT2LMHeadModel(config), batch_size, seq_len)


def bert(batch_size: int, seq_len: int):
    import transformers as hf

    config = hf.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
    )
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    mask[0, seq_len // 2 :] = 0  # padding: the eager path answers the mask checks from real values
    return hf.BertForMaskedLM(config), {
        "input_ids": _tokens(batch_size, seq_len),
        "attention_mask": mask,
        "labels": _tokens(batch_size, seq_len),
    }


def t5(batch_size: int, seq_len: int):
    import transformers as hf

    config = hf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
    )
    return _causal_lm(hf.T5ForConditionalGeneration(config), batch_size, seq_len)


def vit(batch_size: int, seq_len: int):
    """seq_len is the image side (patches of 4)."""
    import transformers as hf

    config = hf.ViTConfig(
        image_size=seq_len,
        patch_size=4,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_labels=10,
    )
    return hf.ViTForImageClassification(config), {
        "pixel_values": torch.randn(batch_size, 3, seq_len, seq_len),
        "labels": torch.randint(0, 10, (batch_size,)),
    }


def swin(batch_size: int, seq_len: int):
    """Shifted-window vision transformer; seq_len is the image side (patches of 4, windows of 7)."""
    import transformers as hf

    config = hf.SwinConfig(
        image_size=seq_len,
        patch_size=4,
        embed_dim=24,
        depths=[2, 2, 2],
        num_heads=[2, 4, 8],
        window_size=7,
        num_labels=10,
    )
    return hf.SwinForImageClassification(config), {
        "pixel_values": torch.randn(batch_size, 3, seq_len, seq_len),
        "labels": torch.randint(0, 10, (batch_size,)),
    }


def _mixtral_config():
    import transformers as hf

    return hf.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )


def mixtral(batch_size: int, seq_len: int):
    """transformers' default experts path (sort + grouped_mm: sizes do not depend on routing)."""
    import transformers as hf

    return _causal_lm(hf.MixtralForCausalLM(_mixtral_config()), batch_size, seq_len)


def mixtral_loop(batch_size: int, seq_len: int):
    """The eager per-expert loop (nonzero, where, index_add_): per-expert sizes follow routing."""
    import transformers as hf

    model = hf.MixtralForCausalLM(_mixtral_config())
    model.set_experts_implementation("eager")
    return _causal_lm(model, batch_size, seq_len)


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class AttributeLayers(nn.Module):
    """Layers kept as attributes `self.layer0`, `self.layer1`, ... and looped over in forward."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.depth = depth
        for i in range(depth):
            setattr(self, f"layer{i}", _Layer(width))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.depth):
            x = getattr(self, f"layer{i}")(x)
        return self.head(x).pow(2).mean()


def attribute_layers(batch_size: int, seq_len: int):
    return AttributeLayers(), (torch.randn(batch_size, seq_len, 32),)


class TorchSeq2Seq(nn.Module):
    """torch's own ``nn.Transformer`` (encoder and decoder layers deep-copied from one, as torch
    builds them), token embeddings and a head: source padding masked, the target causal."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, width)
        self.transformer = nn.Transformer(width, heads, 2, 2, 4 * width, dropout=0.0, batch_first=True)
        self.lm_head = nn.Linear(width, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_padding: torch.Tensor, labels: torch.Tensor):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        out = self.transformer(
            self.embed_tokens(src),
            self.embed_tokens(tgt),
            tgt_mask=causal,
            tgt_is_causal=True,
            src_key_padding_mask=src_padding,
            memory_key_padding_mask=src_padding,
        )
        return nn.functional.cross_entropy(self.lm_head(out).flatten(0, 1), labels.flatten())


def torch_transformer(batch_size: int, seq_len: int):
    padding = torch.zeros(batch_size, seq_len, dtype=torch.bool)
    padding[1:, seq_len // 2 :] = True  # every sequence but the first padded to half its length
    inputs = {"src": _tokens(batch_size, seq_len), "tgt": _tokens(batch_size, seq_len), "src_padding": padding}
    return TorchSeq2Seq(), inputs | {"labels": _tokens(batch_size, seq_len)}


class LstmLM(nn.Module):
    """A two-layer LSTM language model (oneDNN's LSTM on CPU keeps a workspace for its backward)."""

    def __init__(self, width: int = 64, hidden: int = 96) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, width)
        self.lstm = nn.LSTM(width, hidden, num_layers=2, batch_first=True)
        self.lm_head = nn.Linear(hidden, VOCAB)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed_tokens(tokens))
        return nn.functional.cross_entropy(self.lm_head(out).flatten(0, 1), labels.flatten())


def lstm(batch_size: int, seq_len: int):
    return LstmLM(), (_tokens(batch_size, seq_len), _tokens(batch_size, seq_len))


# The robustness sweep (benchmarks/results/2026-12-02-zoo-sweep.md): more architectures from tiny
# configs; benchmarks/zoo.py's ZOO runs the cheapest representative ones.
def _decoder(cls_name: str, config_name: str, **kw):
    import transformers as hf

    def build(batch_size: int, seq_len: int):
        args = {**TINY_DECODER, **kw}
        config = getattr(hf, config_name)(**args)
        return _causal_lm(getattr(hf, cls_name)(config), batch_size, seq_len)

    return build


qwen2 = _decoder("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2)
qwen3 = _decoder("Qwen3ForCausalLM", "Qwen3Config", num_key_value_heads=2, head_dim=8)
gemma2 = _decoder("Gemma2ForCausalLM", "Gemma2Config", num_key_value_heads=2, head_dim=8, sliding_window=16)
gemma3 = _decoder("Gemma3ForCausalLM", "Gemma3TextConfig", num_key_value_heads=2, head_dim=8, sliding_window=16)
stablelm = _decoder("StableLmForCausalLM", "StableLmConfig", num_key_value_heads=2)
phi3 = _decoder("Phi3ForCausalLM", "Phi3Config", num_key_value_heads=2, pad_token_id=0)
olmo = _decoder("OlmoForCausalLM", "OlmoConfig", num_key_value_heads=2, pad_token_id=0)
olmo2 = _decoder("Olmo2ForCausalLM", "Olmo2Config", num_key_value_heads=2, pad_token_id=0)
starcoder2 = _decoder("Starcoder2ForCausalLM", "Starcoder2Config", num_key_value_heads=2)
qwen2_moe = _decoder(
    "Qwen2MoeForCausalLM",
    "Qwen2MoeConfig",
    num_key_value_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
)
olmoe = _decoder(
    "OlmoeForCausalLM", "OlmoeConfig", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, pad_token_id=0
)


def falcon(batch_size, seq_len):
    import transformers as hf

    config = hf.FalconConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        new_decoder_architecture=False,
        multi_query=True,
    )
    return _causal_lm(hf.FalconForCausalLM(config), batch_size, seq_len)


def opt(batch_size, seq_len):
    import transformers as hf

    config = hf.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        word_embed_proj_dim=32,
        max_position_embeddings=256,
        pad_token_id=1,
    )
    return _causal_lm(hf.OPTForCausalLM(config), batch_size, seq_len)


def bloom(batch_size, seq_len):
    import transformers as hf

    config = hf.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)
    return _causal_lm(hf.BloomForCausalLM(config), batch_size, seq_len)


def gptj(batch_size, seq_len):
    import transformers as hf

    config = hf.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=256)
    return _causal_lm(hf.GPTJForCausalLM(config), batch_size, seq_len)


def _masked(model, batch_size, seq_len, pad=True):
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    if pad:
        mask[0, seq_len // 2 :] = 0
    return model, {
        "input_ids": torch.randint(3, VOCAB, (batch_size, seq_len)),
        "attention_mask": mask,
        "labels": _tokens(batch_size, seq_len),
    }


def distilbert(batch_size, seq_len):
    import transformers as hf

    config = hf.DistilBertConfig(
        vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=256
    )
    return _masked(hf.DistilBertForMaskedLM(config), batch_size, seq_len)


def roberta(batch_size, seq_len):
    import transformers as hf

    config = hf.RobertaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=260,
    )
    return _masked(hf.RobertaForMaskedLM(config), batch_size, seq_len)


def deberta_v2(batch_size, seq_len):
    import transformers as hf

    config = hf.DebertaV2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
    )
    return _masked(hf.DebertaV2ForMaskedLM(config), batch_size, seq_len)


def bart(batch_size, seq_len):
    import transformers as hf

    config = hf.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=256,
    )
    return _causal_lm(hf.BartForConditionalGeneration(config), batch_size, seq_len)


def whisper(batch_size, seq_len):
    import transformers as hf

    config = hf.WhisperConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=16,
        max_source_positions=seq_len,
        max_target_positions=256,
        decoder_start_token_id=1,
        pad_token_id=0,
    )
    return hf.WhisperForConditionalGeneration(config), {
        "input_features": torch.randn(batch_size, 16, 2 * seq_len),
        "labels": _tokens(batch_size, 16),
    }


def _image(model, batch_size, side, labels=10):
    return model, {
        "pixel_values": torch.randn(batch_size, 3, side, side),
        "labels": torch.randint(0, labels, (batch_size,)),
    }


def convnext(batch_size, seq_len):
    import transformers as hf

    config = hf.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=10, image_size=seq_len)
    return _image(hf.ConvNextForImageClassification(config), batch_size, seq_len)


def resnet(batch_size, seq_len):
    import transformers as hf

    config = hf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
    return _image(hf.ResNetForImageClassification(config), batch_size, seq_len)


def mobilenet_v2(batch_size, seq_len):
    import transformers as hf

    config = hf.MobileNetV2Config(depth_multiplier=0.35, image_size=seq_len, num_labels=10)
    return _image(hf.MobileNetV2ForImageClassification(config), batch_size, seq_len)


def deit(batch_size, seq_len):
    import transformers as hf

    config = hf.DeiTConfig(
        image_size=seq_len,
        patch_size=4,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_labels=10,
    )
    return _image(hf.DeiTForImageClassification(config), batch_size, seq_len)


def beit(batch_size, seq_len):
    import transformers as hf

    config = hf.BeitConfig(
        image_size=seq_len,
        patch_size=4,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_labels=10,
        use_relative_position_bias=True,
    )
    return _image(hf.BeitForImageClassification(config), batch_size, seq_len)


def segformer(batch_size, seq_len):
    import transformers as hf

    config = hf.SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[16, 32],
        num_attention_heads=[1, 2],
        decoder_hidden_size=32,
        num_labels=10,
        patch_sizes=[7, 3],
        strides=[4, 2],
    )
    return _image(hf.SegformerForImageClassification(config), batch_size, seq_len)


def mamba(batch_size, seq_len):
    import transformers as hf

    config = hf.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4
    )
    ids = _tokens(batch_size, seq_len)
    return hf.MambaForCausalLM(config), {"input_ids": ids, "labels": _tokens(batch_size, seq_len)}


qwen3_moe = _decoder(
    "Qwen3MoeForCausalLM",
    "Qwen3MoeConfig",
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)
gemma = _decoder("GemmaForCausalLM", "GemmaConfig", num_key_value_heads=1, head_dim=8)


def llama_padded(batch_size, seq_len):
    model, inputs = llama(batch_size, seq_len)
    inputs["attention_mask"][0, : seq_len // 4] = 0  # left padding: the eager path builds a mask
    return model, inputs


def albert(batch_size, seq_len):
    import transformers as hf

    config = hf.AlbertConfig(
        vocab_size=VOCAB,
        embedding_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
    )
    return _masked(hf.AlbertForMaskedLM(config), batch_size, seq_len)


def electra(batch_size, seq_len):
    import transformers as hf

    config = hf.ElectraConfig(
        vocab_size=VOCAB,
        embedding_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
    )
    return _masked(hf.ElectraForMaskedLM(config), batch_size, seq_len)


def mbart(batch_size, seq_len):
    import transformers as hf

    config = hf.MBartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=256,
    )
    return _causal_lm(hf.MBartForConditionalGeneration(config), batch_size, seq_len)


def regnet(batch_size, seq_len):
    import transformers as hf

    config = hf.RegNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 2], groups_width=8, num_labels=10)
    return _image(hf.RegNetForImageClassification(config), batch_size, seq_len)


def dinov2(batch_size, seq_len):
    import transformers as hf

    config = hf.Dinov2Config(
        image_size=seq_len,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        mlp_ratio=2,
        num_labels=10,
    )
    return _image(hf.Dinov2ForImageClassification(config), batch_size, seq_len)


def swinv2(batch_size, seq_len):
    import transformers as hf

    config = hf.Swinv2Config(
        image_size=seq_len, patch_size=4, embed_dim=24, depths=[2, 2], num_heads=[2, 4], window_size=4, num_labels=10
    )
    return _image(hf.Swinv2ForImageClassification(config), batch_size, seq_len)


def efficientnet(batch_size, seq_len):
    import transformers as hf

    config = hf.EfficientNetConfig(
        image_size=seq_len, width_coefficient=0.25, depth_coefficient=0.25, num_labels=10, hidden_dim=320
    )
    return _image(hf.EfficientNetForImageClassification(config), batch_size, seq_len)


def mobilevit(batch_size, seq_len):
    import transformers as hf

    config = hf.MobileViTConfig(
        image_size=seq_len, hidden_sizes=[32, 32, 32], neck_hidden_sizes=[8, 8, 16, 16, 16, 32, 64], num_labels=10
    )
    return _image(hf.MobileViTForImageClassification(config), batch_size, seq_len)


def poolformer(batch_size, seq_len):
    import transformers as hf

    config = hf.PoolFormerConfig(
        hidden_sizes=[16, 32],
        depths=[1, 1],
        num_encoder_blocks=2,
        patch_sizes=[7, 3],
        strides=[4, 2],
        padding=[2, 1],
        num_labels=10,
    )
    return _image(hf.PoolFormerForImageClassification(config), batch_size, seq_len)
