"""Test-only: run torch.distributed.pipelining on 2 gloo CPU ranks and measure each rank's live tensor bytes.

Spec strings f"{__file__}:NAME" build the two decoders the pipeline cases use (a hand-written
torchtitan-style Llama and a transformers LlamaForCausalLM from a tiny LlamaConfig; no
downloads). Each rank cuts its stage modules torchtitan-style (stage 0 holds the embeddings,
the last the final norm, head and loss), runs a warm-up step and then measured steps of
``schedule.step(..., return_outputs=False)`` plus the optimizer step under a LiveBytesTracker,
counting the parameters, optimizer states, its inputs and the stages' receive buffers up front.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from planner.runtime.parallel_verify import run_on_gloo_ranks
from planner.runtime.pipeline_verify import measure_schedule
from planner.runtime.tracker import LiveBytesTracker
from planner.runtime.verify import make_optimizer
from planner.tracing.models import Llama, LlamaConfig, LlamaStage, lm_loss

WORLD_SIZE = 2
PATH = __file__
VOCAB = 256


def _tokens(batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (batch_size, seq_len)), torch.randint(0, VOCAB, (batch_size, seq_len))


def titan_llama(batch_size: int, seq_len: int):
    """Hand-written torchtitan-style Llama: vocab 256, hidden 128, 4 layers, 4 heads (2 kv heads)."""
    return Llama(LlamaConfig(VOCAB, 128, 352, 4, 4, 2)), _tokens(batch_size, seq_len)


def hf_llama(batch_size: int, seq_len: int):
    """transformers LlamaForCausalLM from a tiny LlamaConfig: vocab 256, hidden 128, 4 layers."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    config = HFLlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_cache=False,
        attn_implementation="sdpa",
    )
    ids, labels = _tokens(batch_size, seq_len)
    return LlamaForCausalLM(config), {"input_ids": ids, "labels": labels}


class HFStage(nn.Module):
    """Decoder layers [first, end) of a LlamaForCausalLM, with rotary tables per forward."""

    def __init__(self, model, first: int, end: int, is_first: bool, is_last: bool, seq_len: int) -> None:
        super().__init__()
        inner = model.model
        self.seq_len = seq_len
        self.embed_tokens = inner.embed_tokens if is_first else None
        self.rotary_emb = inner.rotary_emb
        self.layers = nn.ModuleDict({str(i): inner.layers[i] for i in range(first, end)})
        self.norm = inner.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        position_ids = torch.arange(self.seq_len, device=h.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(h, position_ids)
        for layer in self.layers.values():
            h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings)
        return self.lm_head(self.norm(h)) if self.lm_head is not None else h


class MoEStage(nn.Module):
    """Layers [first, end) of the torchtitan-style MoE decoder (tests/ep_models.py), its rotary
    frequencies per forward; the embeddings on stage 0, norm and output on the last."""

    def __init__(self, model, first: int, end: int, is_first: bool, is_last: bool, seq_len: int) -> None:
        super().__init__()
        self.head_dim = model.head_dim
        self.seq_len = seq_len
        self.tok_embeddings = model.tok_embeddings if is_first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(first, end)})
        self.norm = model.norm if is_last else None
        self.output = model.output if is_last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        seqlen, d = self.seq_len, self.head_dim
        freqs = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=h.device).float() / d))
        freqs_cis = torch.polar(torch.ones(seqlen, freqs.numel()), torch.outer(torch.arange(seqlen).float(), freqs))
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        return self.output(self.norm(h)) if self.output is not None else h


def titan_moe(batch_size: int, seq_len: int):
    """The torchtitan-style MoE decoder of tests/ep_models.py (2 layers, 4 experts top-2, a shared expert)."""
    from ep_models import titan_moe as build

    return build(batch_size, seq_len)


def hf_mixtral(batch_size: int, seq_len: int):
    """transformers MixtralForCausalLM from tests/data/tiny_mixtral with 4 layers (4 experts top-2, hidden 64)."""
    import json
    from pathlib import Path

    from transformers import MixtralConfig, MixtralForCausalLM

    config = json.loads((Path(PATH).parent / "data" / "tiny_mixtral" / "config.json").read_text())
    config = MixtralConfig(**{**config, "num_hidden_layers": 4, "use_cache": False})
    ids, labels = _tokens(batch_size, seq_len)
    return MixtralForCausalLM(config), {"input_ids": ids, "labels": labels}


def _moe_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _hf_loss(vocab_size: int):
    from transformers.loss.loss_utils import ForCausalLMLoss

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ForCausalLMLoss(logits, labels, vocab_size)

    return loss_fn


def _stage_modules(builder: str, model, counts: list[int], stage_ids: list[int], seq_len: int):
    firsts = [sum(counts[:k]) for k in range(len(counts))]
    cls = {"hf_llama": HFStage, "hf_mixtral": HFStage, "titan_moe": MoEStage}.get(builder, LlamaStage)
    last = len(counts) - 1
    return [cls(model, firsts[s], firsts[s] + counts[s], s == 0, s == last, seq_len) for s in stage_ids]


def measure_case(rank: int, builder: str, config, counts: list[int], steps: int, plans: dict | None = None) -> int:
    """This rank's lowest peak live bytes over `steps` measured steps (after a warm-up step); `plans`:
    a plan per stage (memplan plan --pp, as a dict) applied to each stage module."""
    from torch.distributed.pipelining import PipelineStage, schedules

    from planner.config import PP_SCHEDULES
    from planner.simulation.pipeline_schedule import stages_of_rank

    torch.manual_seed(0)
    model, inputs = globals()[builder](config.batch_size, config.seq_len)
    ids, labels = (inputs["input_ids"], inputs["labels"]) if isinstance(inputs, dict) else inputs
    model.train()
    v = config.num_stages_per_rank
    num_stages = config.pp * v
    sharded = config.zero_stage >= 3 and config.dp > 1
    pp_rank, group, tracker_cls = rank, None, LiveBytesTracker
    if sharded or config.ep > 1 or config.tp > 1:
        # mesh [pp, dp, tp] as torchtitan, dp as [edp, ep] (expert parallel borrows data-parallel ranks)
        from torch.distributed.device_mesh import init_device_mesh

        from planner.runtime.parallel_verify import LocalBytesTracker
        from planner.runtime.shard import ShardedBytesTracker, fsdp_kwargs

        shape, names = (config.pp, config.dp // config.ep, config.ep, config.tp), ("pp", "edp", "ep", "tp")
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        dp_mesh = mesh["edp", "ep"]._flatten("dp")
        pp_rank, group = rank // (config.dp * config.tp), mesh["pp"].get_group()
        tracker_cls = LocalBytesTracker if config.ep > 1 or config.tp > 1 else ShardedBytesTracker
    if config.tp > 1:  # the model sharded over tp before the stages are cut (they share the modules)
        from planner.tracing.parallel.tp_plans import tp_plan_for

        tp_plan_for(config)(model, mesh["tp"])
    experts: list[str] = []
    if config.ep > 1:  # the experts sharded over ep before the stages are cut (they share the modules)
        from planner.tracing.parallel.ep_plans import expert_paths, resolve_ep_plan

        resolve_ep_plan(config.ep_plan)(model, mesh["edp", "ep", "tp"])
        experts = expert_paths(model)
    stage_ids = list(stages_of_rank(pp_rank, config.pp, v, config.pp_schedule))
    modules = _stage_modules(builder, model, counts, stage_ids, config.seq_len)
    handles = []
    if plans is not None:
        from planner.plans.format import load_plan
        from planner.runtime.apply import apply_plan

        loaded = load_plan(plans)
        handles = [apply_plan(m, loaded, stage=s) for m, s in zip(modules, stage_ids)]
    if sharded:
        from torch.distributed.fsdp import fully_shard

        kwargs = {**fsdp_kwargs(config), "mesh": dp_mesh}
        for m in modules:
            inside = set(m.modules())
            for path in experts:  # torchtitan: the experts over the dp / ep ranks holding the same ones, first
                if model.get_submodule(path) in inside:
                    fully_shard(model.get_submodule(path), **{**kwargs, "mesh": mesh["edp"]})
            for layer in m.layers.values():
                fully_shard(layer, **kwargs)
            fully_shard(m, **kwargs)
    stages = [PipelineStage(m, s, num_stages, torch.device("cpu"), group=group) for m, s in zip(modules, stage_ids)]
    hf = lambda: _hf_loss(model.config.vocab_size)  # noqa: E731
    loss_fn = {"hf_llama": hf, "hf_mixtral": hf, "titan_moe": lambda: _moe_loss}.get(builder, lambda: lm_loss)()
    cls = getattr(schedules, PP_SCHEDULES[config.pp_schedule])
    multi = not issubclass(cls, schedules.PipelineScheduleSingle)
    sched = cls(stages if multi else stages[0], config.num_microbatches, loss_fn=loss_fn)
    optimizer = make_optimizer([p for m in modules for p in m.parameters()], config.optimizer)
    step_args = (ids,) if 0 in stage_ids else ()
    step_kwargs = {"target": labels} if num_stages - 1 in stage_ids else {}
    from planner.runtime.routing import assumed_routing
    from planner.tracing.parallel.tp_plans import step_context

    with assumed_routing(config.moe_imbalance) if config.ep > 1 else nullcontext(), step_context(config):
        return measure_schedule(
            sched,
            modules,
            stages,
            optimizer,
            step_args,
            step_kwargs,
            config,
            steps=steps,
            tracker_cls=tracker_cls,
            handles=handles,
        ).peak_bytes


def _gradient_worker(rank: int, world_size: int, config, queue) -> None:
    """One step of the torchtitan-style Llama cut into equal stages, FSDP2 over dp as torchtitan
    shards a stage; per stage of this rank: (parameters, without a gradient, gradient norms)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, schedules

    from planner.config import PP_SCHEDULES
    from planner.simulation.pipeline_schedule import stages_of_rank

    torch.manual_seed(0)
    model, (ids, labels) = titan_llama(config.batch_size, config.seq_len)
    mesh = init_device_mesh("cpu", (config.pp, config.dp), mesh_dim_names=("pp", "dp"))
    num_stages = config.pp * config.num_stages_per_rank
    stage_ids = list(stages_of_rank(rank // config.dp, config.pp, config.num_stages_per_rank, config.pp_schedule))
    counts = [len(model.layers) // num_stages] * num_stages
    modules = _stage_modules("titan_llama", model, counts, stage_ids, config.seq_len)
    for m in modules:
        for layer in m.layers.values():
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=config.reshard_after_forward)
        fully_shard(m, mesh=mesh["dp"], reshard_after_forward=config.reshard_after_forward)
    group = mesh["pp"].get_group()
    stages = [PipelineStage(m, s, num_stages, torch.device("cpu"), group=group) for m, s in zip(modules, stage_ids)]
    cls = getattr(schedules, PP_SCHEDULES[config.pp_schedule])
    multi = not issubclass(cls, schedules.PipelineScheduleSingle)
    schedule = cls(stages if multi else stages[0], config.num_microbatches, loss_fn=lm_loss)
    schedule.step(*((ids,) if 0 in stage_ids else ()), **({"target": labels} if num_stages - 1 in stage_ids else {}))
    out = {}
    for s, m in zip(stage_ids, modules):
        grads = [p.grad.full_tensor() for p in m.parameters() if p.grad is not None]
        out[s] = (len(list(m.parameters())), len(list(m.parameters())) - len(grads), [g.norm().item() for g in grads])
    queue.put((rank, out))


def stage_gradients(config) -> dict[int, tuple[int, int, list[float]]]:
    """Stage -> (parameters, parameters without a gradient, gradient norms) after one step of
    `config`'s schedule on pp × dp gloo ranks (dp rank 0's view; the gradients are reduced)."""
    items = dict(run_on_gloo_ranks(_gradient_worker, config.pp * config.dp, config, timeout_s=300))
    return {s: v for r in range(0, config.pp * config.dp, config.dp) for s, v in items[r].items()}


def _worker(rank: int, world_size: int, cases: list, queue) -> None:
    for key, builder, config, counts, steps, *plans in cases:
        queue.put((key, rank, measure_case(rank, builder, config, counts, steps, *plans)))


def run_on_ranks(cases: list, timeout_s: float = 240.0, world_size: int = WORLD_SIZE) -> dict[str, list[int]]:
    """key -> measured peak bytes per global rank; each case is (key, builder, TrainConfig, blocks
    per stage, measured steps), all on `world_size` ranks (pp x dp). A run that gives no result
    within `timeout_s` (a gloo hang) is killed and fails."""
    results: dict[str, list[int]] = {}
    for key, rank, peak in run_on_gloo_ranks(_worker, world_size, cases, timeout_s):
        results.setdefault(key, [0] * world_size)[rank] = peak
    return results


def case(
    key: str, builder: str, config, counts: list[int], steps: int = 3, plans: dict | None = None
) -> tuple[Any, ...]:
    return (key, builder, config, counts, steps) if plans is None else (key, builder, config, counts, steps, plans)
