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
