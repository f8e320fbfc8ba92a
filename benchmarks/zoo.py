"""Table: the model zoo. Hugging Face architectures built from tiny configs (no download) and a model
that keeps its layers as attributes: simulated peak against a real CPU step (fp32, AdamW), and a
plan at 60% of the way from model states to the no-plan peak, applied to the real model: its
measured peak against the budget, and its gradients against the model without a plan.

Each builder is a memplan model function (`benchmarks.zoo:NAME`), so the same spec is traced on
fake tensors and built for real.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from benchmarks.common import Options, print_table
from planner.api import trace_for
from planner.config import TrainConfig
from planner.runtime.apply import apply_plan
from planner.runtime.verify import measure_step
from planner.simulation.step import simulate
from planner.solver.planning import solve
from planner.tracing.hf import disable_kv_cache
from planner.tracing.recorder import loss_of, run_step_inputs
from planner.tracing.specs import resolve_spec
from planner.units import format_bytes

PLAN_FRACTION = 0.6  # of the way from model states to the no-plan peak
VOCAB = 128


def _tokens(batch_size: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch_size, seq_len))


def _causal_lm(model: nn.Module, batch_size: int, seq_len: int) -> tuple[nn.Module, dict]:
    """Ids, an attention mask without padding (the eager run then skips the mask: the trace must
    too) and labels."""
    ids = _tokens(batch_size, seq_len)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": _tokens(batch_size, seq_len)}


def llama(batch_size: int, seq_len: int):
    import transformers as hf

    config = hf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    return _causal_lm(hf.LlamaForCausalLM(config), batch_size, seq_len)


def mistral(batch_size: int, seq_len: int):
    import transformers as hf

    config = hf.MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=None,
    )
    return _causal_lm(hf.MistralForCausalLM(config), batch_size, seq_len)


def phi(batch_size: int, seq_len: int):
    import transformers as hf

    config = hf.PhiConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
    )
    return _causal_lm(hf.PhiForCausalLM(config), batch_size, seq_len)


def gpt_neox(batch_size: int, seq_len: int):
    import transformers as hf

    config = hf.GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
    )
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


# name, batch size, seq_len (vit: image side), tolerance of the no-plan prediction
ZOO = [
    ("llama", 4, 64, 0.01),
    ("mistral", 4, 64, 0.01),
    ("phi", 4, 64, 0.01),
    ("gpt_neox", 4, 64, 0.01),
    ("gpt2", 4, 64, 0.01),
    ("bert", 4, 64, 0.01),
    ("t5", 4, 32, 0.01),
    ("vit", 8, 32, 0.01),
    ("mixtral", 4, 64, 0.03),
    ("mixtral_loop", 4, 64, 0.03),
    ("attribute_layers", 8, 64, 0.01),
]


@dataclass(frozen=True)
class ZooRow:
    model: str
    predicted_bytes: int
    measured_bytes: int
    error: float  # (predicted - measured) / measured
    budget_bytes: int
    plan_decisions: int
    measured_with_plan_bytes: int
    over_budget: float  # (measured with plan - budget) / budget; <= 0 is within budget
    grads_equal: bool
    wall_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def _grads(model: nn.Module, inputs) -> list[torch.Tensor | None]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)  # the same dropout masks with and without the plan
    loss_of(run_step_inputs(model, inputs)).backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _same(a: list, b: list) -> bool:
    def close(x, y) -> bool:
        if x is None or y is None:
            return x is None and y is None
        return torch.allclose(x, y, rtol=1e-4, atol=1e-6)

    return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))


def measure_zoo_model(name: str, batch_size: int, seq_len: int) -> ZooRow:
    """Trace, simulate, plan at PLAN_FRACTION, then run the model for real with and without it."""
    t0 = time.perf_counter()
    spec = f"benchmarks.zoo:{name}"
    config = TrainConfig(batch_size=batch_size, seq_len=seq_len)
    graph = trace_for(spec, config)
    base = simulate(graph, config)
    states = sum(base.model_states.values())
    budget = int(states + PLAN_FRACTION * (base.peak_bytes - states))
    plan = solve(graph, config, budget)
    torch.manual_seed(0)
    model, inputs = resolve_spec(spec).build(batch_size=batch_size, seq_len=seq_len)
    disable_kv_cache(model)
    plain = _grads(model, inputs)
    handle = apply_plan(model, plan)
    try:
        planned = _grads(model, inputs)
        with_plan = measure_step(model, inputs, config).peak_bytes
    finally:
        handle.remove()
    measured = measure_step(model, inputs, config).peak_bytes
    return ZooRow(
        name,
        base.peak_bytes,
        measured,
        (base.peak_bytes - measured) / measured,
        budget,
        len(plan.decisions),
        with_plan,
        (with_plan - budget) / budget,
        _same(plain, planned),
        round(time.perf_counter() - t0, 2),
    )


def run(opts: Options) -> list[dict]:
    entries = opts.select(ZOO, quick_names=("llama", "t5", "mixtral_loop", "attribute_layers"))
    return [measure_zoo_model(name, b, s).to_dict() for name, b, s, _ in entries]


def show(rows: list[dict]) -> None:
    print_table(
        "Model zoo: simulated vs real CPU step (fp32 AdamW); plan at 60% from model states to the peak",
        ["model", "predicted", "measured", "error", "plan budget", "measured with plan", "vs budget", "grads equal"],
        [
            [
                r["model"],
                format_bytes(r["predicted_bytes"]),
                format_bytes(r["measured_bytes"]),
                f"{r['error'] * 100:+.2f}%",
                format_bytes(r["budget_bytes"]),
                format_bytes(r["measured_with_plan_bytes"]),
                f"{r['over_budget'] * 100:+.2f}%",
                "yes" if r["grads_equal"] else "NO",
            ]
            for r in rows
        ],
    )
