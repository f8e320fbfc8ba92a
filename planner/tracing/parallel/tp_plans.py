"""Tensor-parallel plans: how a model is sharded over a TP mesh (``--tp-plan``).

- ``auto``: the model's own plan where it ships one (a transformers model whose config carries
  ``base_model_tp_plan``: transformers' own ``apply_tensor_parallelism`` applies it), else
  memplan's for the blocks it recognises (separate q/k/v or a fused projection in an attention
  whose layout it knows, or torch's ``nn.MultiheadAttention``, and an output projection, a gated or
  plain MLP, as ``nn.Linear`` or GPT-2's ``Conv1D``: memplan's Llama and GPT-2, torchtitan,
  Hugging Face Llama, GPT-2, OPT, GPT-Neo, BERT, ViT, XGLM, Bloom, Falcon, GPT-BigCode, MPT,
  Persimmon, torch's ``nn.Transformer`` layers), laid out as torchtitan does: embeddings rowwise
  with sequence-sharded output, norms ``SequenceParallel``, q/k/v and w1/w3 colwise (a fused q/k/v
  per head, planner/tracing/parallel/projection_styles.py; per-head ALiBi biases cut to the
  rank's heads; a norm over each head's features replicated, its gradients summed),
  o and w2 rowwise with sequence-sharded output, head colwise, learned positions replicated and
  cut to the rank's share of the sequence, a head tied to the embedding tied again to its shard; a
  torchtitan-style mixture-of-experts layer gathers its input whole, keeps its router replicated,
  runs its shared expert column- then row-parallel and its experts with the hidden dimension
  sharded (or leaves them to the expert-parallel plan), and reduce-scatters its partial output.
  With loss parallel (torchtitan's default) the logits stay sharded over the vocabulary and the
  step runs under torch's ``loss_parallel()`` (:func:`step_context`); without it they are gathered
  whole. Without sequence parallel the norms stay replicated and row-parallel outputs are
  all-reduced.
- ``PATH.py:FUNC`` / ``package.module:FUNC``: the user's ``FUNC(model, tp_mesh)``.

A plan is a callable ``plan(model, tp_mesh)``; the same one runs on the fake-tensor model of the
trace and on the real model of a verification run.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from planner.config import TrainConfig
from planner.errors import SequenceParallelUnsupported, SpecError
from planner.tracing.parallel.ep_plans import expert_hidden_dims, is_grouped_experts
from planner.tracing.parallel.expert_parallel import GroupedExpertsTensorParallel
from planner.tracing.parallel.multihead_attention import MultiheadAttentionParallel, check_multihead_attention
from planner.tracing.parallel.projection_styles import (
    ColwiseProjection,
    RowwiseProjection,
    SequenceShardedPositions,
    input_features,
    is_projection,
    output_features,
    rank_heads,
)
from planner.tracing.parallel.user_plans import user_plan

__all__ = [
    "TpPlan",
    "apply_tp_plan",
    "loss_parallel_context",
    "resolve_tp_plan",
    "step_context",
    "tp_plan_for",
]

TpPlan = Callable[[nn.Module, DeviceMesh], object]

# Child names of the pieces memplan recognises (its own Llama and GPT-2, torchtitan, Hugging Face
# Llama, GPT-2, OPT, GPT-Neo, BERT and ViT).
_QKV = (("q_proj", "k_proj", "v_proj"), ("wq", "wk", "wv"), ("query", "key", "value"))
_FUSED_QKV = ("c_attn", "qkv", "query_key_value", "Wqkv")  # one projection for q, k and v
# How the attentions memplan knows lay out a fused projection's output. A shape cannot tell the
# layouts apart, so a fused projection is recognised only in these.
# - concatenated, [q | k | v]: sharded per section (rank-major, projection_styles.py);
# - grouped, q, k and v side by side per head (Bloom, GPT-BigCode, Persimmon, GPT-NeoX, Falcon) or per
#   key-value group (Falcon's new decoder): a contiguous shard holds whole heads with their k and v.
_CONCATENATED, _GROUPED = "concatenated", "grouped"
_FUSED_QKV_LAYOUTS = {
    "GPT2Attention": _CONCATENATED,  # transformers' GPT-2, and the copies in ImageGPT and Decision Transformer
    "ImageGPTAttention": _CONCATENATED,
    "DecisionTransformerGPT2Attention": _CONCATENATED,
    "CausalSelfAttention": _CONCATENATED,  # memplan's GPT-2 preset, nanoGPT, minGPT
    "timm.models.vision_transformer.Attention": _CONCATENATED,
    "MptAttention": _CONCATENATED,
    "BloomAttention": _GROUPED,
    "GPTBigCodeAttention": _GROUPED,
    "PersimmonAttention": _GROUPED,
    "GPTNeoXAttention": _GROUPED,
    "FalconAttention": _GROUPED,
}
# Per-head attention biases an attention takes as an argument (ALiBi), cut to the rank's heads:
# attention class -> (argument, whether the batch is folded into the head dimension).
_HEAD_BIASES = {"BloomAttention": ("alibi", True), "MptAttention": ("position_bias", False)}
_OUT = ("o_proj", "wo", "out_proj", "dense", "c_proj", "proj")
_MLP = ("mlp", "feed_forward", "ffn")
_MOE = ("moe", "mlp", "feed_forward")  # a mixture-of-experts layer in the MLP's place (torchtitan: moe)
_SHARED = ("shared_experts", "shared_expert")
_UP = (("gate_proj", "up_proj"), ("w1", "w3"), ("up_proj",), ("fc1",), ("c_fc",), ("dense_h_to_4h",))
_DOWN = ("down_proj", "w2", "fc2", "c_proj", "dense_4h_to_h")
# (up, down) on the block itself: OPT's fc1 / fc2, BERT's and ViT's intermediate / output, torch's
# nn.TransformerEncoderLayer's linear1 / linear2.
_BLOCK_FEED_FORWARDS = ((("fc1",), "fc2"), (("intermediate.dense",), "output.dense"), (("linear1",), "linear2"))
_NORMS = (
    ("attn_norm", "mlp_norm"),
    ("attention_norm", "ffn_norm"),
    ("input_layernorm", "post_attention_layernorm"),
    ("ln_1", "ln_2"),
    ("norm_1", "norm_2"),
    ("ln_attn", "ln_mlp"),
    ("norm1", "norm2"),
)
_EMBEDDING = ("embed_tokens", "tok_embeddings", "wte", "word_embeddings")
_POSITIONS = ("wpe", "embed_positions", "position_embeddings")
_FINAL_NORM = ("norm", "ln_f", "norm_f", "final_layernorm")
_HEAD = ("lm_head", "output")
# Attributes holding a head count that a sharded attention must see as its local count.
_HEAD_COUNTS = (
    "num_heads",
    "num_kv_heads",
    "num_key_value_heads",
    "n_head",
    "n_heads",
    "n_kv_heads",
    "num_attention_heads",
    "kv_heads",
)
# Attributes that may hold the width of q (num_heads x head_dim): where they do, a sharded attention
# must see the rank's width (GPT-2 splits its fused output by it, XGLM reshapes heads back with it).
_QUERY_WIDTHS = ("split_size", "embed_dim", "hidden_size", "all_head_size", "inner_dim", "kv_dim")


def _gathered(x, device_mesh: DeviceMesh) -> DTensor:
    """`x` replicated over the TP mesh: a sequence-sharded plain tensor (or a DTensor) all-gathered."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
    return x.redistribute(placements=(Replicate(),))


class _ReplicateFirstInput(ParallelStyle):
    """The module's first input, sequence-sharded, all-gathered to replicated (torchtitan's
    ``PrepareModuleInput(input_layouts=(Shard(1), ...), desired_input_layouts=(Replicate(), ...))``
    for any number of further inputs, which pass unchanged). The gather runs inside the module's
    forward, not in a pre-hook, so a plan that checkpoints the module recomputes it, as simulated."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # a partial of the bound forward: a deep copy of the model (a live trace's) calls its own copy
        module.forward = partial(_gathered_forward, module.forward, device_mesh)
        return module


def _first_input(forward: Callable, args: tuple, kwargs: dict) -> tuple[Any, Callable[[Any], Any]]:
    """(a module's first input, `forward` called with it replaced), whether it came positionally or
    by keyword (transformers' decoder layers call ``self_attn(hidden_states=...)``)."""
    if args:
        return args[0], lambda x: forward(x, *args[1:], **kwargs)
    name = next(iter(inspect.signature(forward).parameters))
    rest = {k: v for k, v in kwargs.items() if k != name}
    return kwargs[name], lambda x: forward(**{name: x}, **rest)


def _gathered_forward(forward: Callable, device_mesh: DeviceMesh, *args, **kwargs):
    x, call = _first_input(forward, args, kwargs)
    return call(_gathered(x, device_mesh))


class _MoeLayerParallel(ParallelStyle):
    """A mixture-of-experts layer under tensor parallel (torchtitan's ``PrepareModuleInputOutput``
    for it): its input, sequence-sharded, all-gathered and handed over as a plain tensor (the router
    and the experts see the whole sequence); its output, each TP rank's partial sum (the shared
    expert's row-parallel projection and the sharded experts), reduce-scattered back over the
    sequence (all-reduced without sequence parallel). Inside the forward, so a checkpointed layer
    recomputes the gather."""

    def __init__(self, sequence_parallel: bool) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.forward = partial(_moe_forward, module.forward, device_mesh, self.sequence_parallel)
        return module


def _moe_forward(forward: Callable, device_mesh: DeviceMesh, sequence_parallel: bool, *args, **kwargs):
    x, call = _first_input(forward, args, kwargs)
    if sequence_parallel or isinstance(x, DTensor):
        x = _gathered(x, device_mesh).to_local()
    out = DTensor.from_local(call(x), device_mesh, (Partial(),), run_check=False)
    return out.redistribute(placements=(Shard(1),) if sequence_parallel else (Replicate(),)).to_local()


def _child(module: nn.Module, names: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, nn.Module):
            return name, child
    return None


def _outside_blocks(model: nn.Module, blocks: list[_Block], names: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    """The first module named one of `names` outside the decoder blocks, at any depth: a
    transformers CausalLM keeps its embedding and final norm in ``model.model``, its head on top."""
    inside = tuple(b.path + "." for b in blocks)
    for path, module in model.named_modules():
        if path.rpartition(".")[2] in names and not path.startswith(inside):
            return path, module
    return None


@dataclass(frozen=True)
class _Block:
    """One recognised decoder block: the paths, relative to it, of its attention (the module that
    holds the head counts), q/k/v (one path when fused: `qkv_sections` is 3 where the fused output is
    ``[q | k | v]``, 1 where a contiguous shard holds whole heads) and output projections, its MLP (or
    mixture-of-experts layer:
    `experts` set, `up` / `down` those of its shared expert, if any; "" where the block holds its
    projections itself) with its up and down projections, and its two norms (None where not
    recognised: no sequence parallel there), the norms over each head's features in its attention, and
    whether that attention is an ``nn.MultiheadAttention`` (no q/k/v and output paths then)."""

    path: str
    attention: str
    qkv: tuple[str, ...]
    out: str
    mlp: str
    up: tuple[str, ...]
    down: str
    norms: tuple[str, str] | None
    experts: str | None = None
    qkv_sections: int = 1
    head_norms: tuple[str, ...] = ()
    multihead_attention: bool = False


def _linears(module: nn.Module, paths: tuple[str, ...]) -> bool:
    """Whether every dotted path under `module` is a projection (an nn.Linear or GPT-2's Conv1D)."""
    return all(is_projection(_at(module, p)) for p in paths)


def _at(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _joined(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _feed_forward(module: nn.Module, prefix: str = "") -> tuple[tuple[str, ...], str] | None:
    """(up, down) Linear paths, under `prefix`, of a feed-forward module (gated or not, or a
    sequence of two linears with an activation between: torchvision's ``MLPBlock``), or None where it
    holds parameters besides theirs (a learnable activation would see only the rank's hidden units)."""
    up = next((names for names in _UP if _linears(module, names)), None)
    down = next((name for name in _DOWN if _linears(module, (name,))), None)
    if (up is None or down is None) and isinstance(module, nn.Sequential):
        linears = [name for name, child in module.named_children() if isinstance(child, nn.Linear)]
        if len(linears) == 2:
            up, down = (linears[0],), linears[1]
    if up is None or down is None:
        return None
    projections = tuple(f"{name}." for name in (*up, down))
    if any(not name.startswith(projections) for name, _ in module.named_parameters()):
        return None
    return tuple(_joined(prefix, n) for n in up), _joined(prefix, down)


def _moe_layer(block: nn.Module) -> tuple[str, nn.Module] | None:
    """The torchtitan-style mixture-of-experts child of a block: grouped experts and a router."""
    for name in _MOE:
        child = getattr(block, name, None)
        experts = getattr(child, "experts", None)
        if isinstance(child, nn.Module) and is_grouped_experts(experts) and _child(child, ("router", "gate")):
            return name, child
    return None


def _attention(block: nn.Module) -> tuple[str, tuple[str, ...], str, int, tuple[str, ...], bool] | None:
    """(attention path, q/k/v paths, output projection path, q/k/v sections: 3 for a fused
    ``[q | k | v]``, norm paths: :func:`_head_norms`, whether it is an ``nn.MultiheadAttention``)
    within a block: the first module, the block's child or grandchild, that is an
    ``nn.MultiheadAttention`` (no projection paths: multihead_attention.py shards it) or has q/k/v projection
    children (or one fused projection, laid out as :data:`_FUSED_QKV_LAYOUTS` says); its output
    projection is its own child or, as BERT and ViT lay it out, ``output.dense`` beside it."""
    for path, module in block.named_modules():
        if not path or path.count(".") > 1:
            continue
        if isinstance(module, nn.MultiheadAttention):
            return path, (), "", 1, (), True
        qkv = next((names for names in _QKV if _linears(module, names)), None)
        layout = _fused_layout(module) if qkv is None else None
        if layout is not None:
            qkv = next(((name,) for name in _FUSED_QKV if _linears(module, (name,))), None)
        if qkv is None:
            continue
        parent = path.rpartition(".")[0]
        outs = [_joined(path, name) for name in _OUT] + ([_joined(parent, "output.dense")] if parent else [])
        out = next((o for o in outs if _linears(block, (o,))), None)
        if out is None:
            return None
        head_norms = _head_norms(block, path, (*(_joined(path, n) for n in qkv), out))
        if head_norms is None:
            return None
        sections = 3 if layout == _CONCATENATED else 1
        if sections == 3 and output_features(module.get_submodule(qkv[0])) != 3 * output_features(
            block.get_submodule(out)
        ):
            return None
        return path, tuple(_joined(path, n) for n in qkv), out, sections, head_norms, False
    return None


def _class_entry(table: dict[str, Any], module: nn.Module) -> Any:
    """`table`'s entry for `module`'s class, by name or by qualified name."""
    cls = type(module)
    return table.get(cls.__name__, table.get(f"{cls.__module__}.{cls.__name__}"))


def _fused_layout(attention: nn.Module) -> str | None:
    return _class_entry(_FUSED_QKV_LAYOUTS, attention)


def _head_norms(block: nn.Module, attention: str, projections: tuple[str, ...]) -> tuple[str, ...] | None:
    """Paths of the attention's norms over each head's features (Persimmon's q and k layernorms: one
    module as wide as a head), or None where it holds other parameters than these and its
    projections': per-head parameters (Swin's relative position bias table, StableLM's norm per
    head) or a norm over all heads (OLMo2's) would need sharding this plan does not do."""
    module = block.get_submodule(attention)
    norms = set()
    for name, param in module.named_parameters():
        if _joined(attention, name).startswith(tuple(p + "." for p in projections)):
            continue
        owner = name.rpartition(".")[0]
        one_module = owner and not any(part.isdigit() for part in owner.split("."))
        if not (one_module and "norm" in owner.lower() and param.shape == (getattr(module, "head_dim", None),)):
            return None
        norms.add(_joined(attention, owner))
    return tuple(sorted(norms))


def _recognise_block(path: str, block: nn.Module) -> _Block | None:
    found = _attention(block)
    if found is None:
        return None
    *attention, sections, head_norms, multihead = found
    details = {"qkv_sections": sections, "head_norms": head_norms, "multihead_attention": multihead}
    norms = next((pair for pair in _NORMS if all(isinstance(getattr(block, n, None), nn.Module) for n in pair)), None)
    if (moe := _moe_layer(block)) is not None:
        shared = _child(moe[1], _SHARED)
        ffn = _feed_forward(shared[1], _joined(moe[0], shared[0])) if shared is not None else None
        if shared is not None and ffn is None:
            return None
        up, down = ffn or ((), "")
        return _Block(path, *attention, moe[0], up, down, norms, _joined(moe[0], "experts"), **details)
    mlp = _child(block, _MLP)
    if mlp is not None and (ffn := _feed_forward(mlp[1], mlp[0])) is not None:
        return _Block(path, *attention, mlp[0], *ffn, norms, **details)
    for up, down in _BLOCK_FEED_FORWARDS:
        if _linears(block, (*up, down)):
            return _Block(path, *attention, "", up, down, norms, **details)
    return None


def decoder_blocks(model: nn.Module) -> list[_Block]:
    """The decoder blocks memplan recognises, in module order."""
    return [b for path, m in model.named_modules() if path and (b := _recognise_block(path, m)) is not None]


_HEAD_WORDS = {
    "num_heads": "attention heads",
    "n_head": "attention heads",
    "n_heads": "attention heads",
    "num_attention_heads": "attention heads",
    "num_kv_heads": "key-value heads",
    "n_kv_heads": "key-value heads",
    "num_key_value_heads": "key-value heads",
    "kv_heads": "key-value heads",
}


def check_heads(where: str, counts: dict[str, int], tp: int) -> None:
    """Tensor parallel shards whole heads: each count must divide by tp (one-line error naming a --tp that works)."""
    counts = {k: v for k, v in counts.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}
    for attr, count in counts.items():
        if count % tp:
            fits = max(d for d in range(1, tp) if all(c % d == 0 for c in counts.values()))
            raise SpecError(
                f"--tp {tp} does not divide the {count} {_HEAD_WORDS.get(attr, attr)} of {where}: tensor parallel "
                f"shards whole heads; use a --tp that divides every head count (e.g. --tp {fits})"
            )


def _memplan_plan(
    model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool, shard_experts: bool = True
) -> None:
    """torchtitan's layout on the recognised blocks (see the module docstring); a mixture-of-experts
    layer's experts are sharded here when `shard_experts` (else by the expert-parallel plan)."""
    tp = tp_mesh.size()
    blocks = decoder_blocks(model)
    if sequence_parallel and type(model).__module__.startswith("transformers."):
        raise SequenceParallelUnsupported(
            f"sequence parallel shards the embedding's output over the sequence, and transformers' "
            f"{type(model).__name__} reads the sequence length (its positions and mask) from it; pass --no-sp, or "
            "--tp-plan PATH.py:FUNC with your own plan"
        )
    for b in blocks:
        attention = model.get_submodule(f"{b.path}.{b.attention}")
        check_heads(f"{b.path}.{b.attention}", {a: getattr(attention, a, None) for a in _HEAD_COUNTS}, tp)
        if b.multihead_attention:
            check_multihead_attention(attention, f"{b.path}.{b.attention}")
        if (
            getattr(getattr(attention, "config", None), "alibi", False)
            and _class_entry(_HEAD_BIASES, attention) is None
        ):
            raise SequenceParallelUnsupported(
                f"{b.path}.{b.attention} adds per-head ALiBi biases through its attention mask, which --tp-plan auto "
                "does not cut to each rank's heads; pass --tp-plan PATH.py:FUNC with your own plan"
            )
    tied = _tied_groups(model)
    seq = Shard(1)
    top: dict[str, ParallelStyle] = {}
    if (emb := _outside_blocks(model, blocks, _EMBEDDING)) is not None and isinstance(emb[1], nn.Embedding):
        top[emb[0]] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sequence_parallel else None)
    elif sequence_parallel:
        raise SpecError(
            f"sequence parallel starts where the token embedding's output is cut over the sequence, and memplan "
            f"recognises no token embedding in {type(model).__name__}; pass --no-sp, or --tp-plan PATH.py:FUNC with "
            "your own plan"
        )
    positions = _outside_blocks(model, blocks, _POSITIONS)
    if sequence_parallel and positions is not None and isinstance(positions[1], nn.Embedding):
        top[positions[0]] = SequenceShardedPositions()
    if sequence_parallel and (norm := _outside_blocks(model, blocks, _FINAL_NORM)) is not None:
        top[norm[0]] = SequenceParallel()
    if (head := _outside_blocks(model, blocks, _HEAD)) is not None and isinstance(head[1], nn.Linear):
        top[head[0]] = ColwiseParallel(
            input_layouts=seq if sequence_parallel else Replicate(),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    for b in blocks:
        plan: dict[str, ParallelStyle] = {}
        for path in b.qkv:
            plan[path] = ColwiseProjection(sections=b.qkv_sections)
        if b.multihead_attention:
            plan[b.attention] = MultiheadAttentionParallel()
        for path in b.head_norms:
            # the rank's heads through a norm replicated on every rank: its input taken as sharded
            # on a dimension it does not normalise, so DTensor sums its gradients over the ranks
            plan[path] = SequenceParallel(sequence_dim=0, use_local_output=True)
        out_layout = seq if sequence_parallel else None
        if b.out:
            plan[b.out] = RowwiseProjection(output_layouts=out_layout)
        for path in b.up:
            plan[path] = ColwiseProjection()
        if b.down:  # a shared expert's output is the layer's partial sum, reduced with the experts'
            plan[b.down] = RowwiseProjection(output_layouts=out_layout if b.experts is None else Partial())
        if b.experts is not None:
            plan[b.mlp] = _MoeLayerParallel(sequence_parallel)
            experts = f"{b.path}.{b.experts}"
            if shard_experts:
                hidden = expert_hidden_dims(model.get_submodule(experts), experts)
                plan[b.experts] = GroupedExpertsTensorParallel(hidden)
        if sequence_parallel:
            if b.multihead_attention:
                raise SequenceParallelUnsupported(
                    f"{b.path}.{b.attention} is an nn.MultiheadAttention, which memplan's plan shards without sequence "
                    "parallel only; pass --no-sp, or --tp-plan PATH.py:FUNC with your own plan"
                )
            if b.norms is None or not b.mlp:
                raise SequenceParallelUnsupported(
                    f"sequence parallel runs a block's norms on sequence shards, and memplan does not recognise the "
                    f"norms and MLP of {b.path}; pass --no-sp, or --tp-plan PATH.py:FUNC with your own plan"
                )
            plan[b.norms[0]] = SequenceParallel()
            plan[b.norms[1]] = SequenceParallel()
            plan[b.attention] = _ReplicateFirstInput()
            if b.experts is None:
                plan[b.mlp] = _ReplicateFirstInput()
        query_width = input_features(model.get_submodule(f"{b.path}.{b.out}")) if b.out else 0
        parallelize_module(model.get_submodule(b.path), tp_mesh, plan)
        if not b.multihead_attention:  # the style computes the rank's heads itself
            _localise(model.get_submodule(f"{b.path}.{b.attention}"), tp_mesh, query_width)
    _keep_tied_whole(top, tied, sequence_parallel)
    if top:
        parallelize_module(model, tp_mesh, top)
    _tie_again(model, tied)


def _localise(attention: nn.Module, tp_mesh: DeviceMesh, query_width: int) -> None:
    """A sharded attention made to compute the rank's heads: its head counts and q widths divided by
    tp, and the per-head biases it takes (:data:`_HEAD_BIASES`) cut to the rank's heads."""
    tp = tp_mesh.size()
    if (bias := _class_entry(_HEAD_BIASES, attention)) is not None:
        heads = next(getattr(attention, a) for a in _HEAD_COUNTS if isinstance(getattr(attention, a, None), int))
        cut = partial(rank_heads, heads=heads, tp=tp, rank=tp_mesh.get_local_rank(), batch_folded=bias[1])
        attention.register_forward_pre_hook(partial(_cut_argument, bias[0], cut), with_kwargs=True)
    for attr in _HEAD_COUNTS:
        if isinstance(getattr(attention, attr, None), int):
            setattr(attention, attr, getattr(attention, attr) // tp)
    for attr in _QUERY_WIDTHS:
        if getattr(attention, attr, None) == query_width:
            setattr(attention, attr, query_width // tp)


def _cut_argument(name: str, cut: Callable, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook: the argument `name` (by keyword or position), where given, passed through `cut`."""
    if kwargs.get(name) is not None:
        kwargs[name] = cut(kwargs[name])
        return args, kwargs
    parameters = list(inspect.signature(type(module).forward).parameters)[1:]  # after self
    index = parameters.index(name) if name in parameters else len(args)
    if index < len(args) and args[index] is not None:
        args = (*args[:index], cut(args[index]), *args[index + 1 :])
    return args, kwargs


def _tied_groups(model: nn.Module) -> list[list[str]]:
    """Paths of the parameters that are one tensor (a head tied to its embedding), per tensor."""
    groups: dict[int, list[str]] = {}
    for path, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(path)
    return [paths for paths in groups.values() if len(paths) > 1]


def _keep_tied_whole(top: dict[str, ParallelStyle], groups: list[list[str]], sequence_parallel: bool) -> None:
    """Where a tied parameter's modules are not all sharded by `top` (BART's head shares the
    encoder's and decoder's embeddings), none of them is: each stays whole. Sequence parallel needs
    the embedding's output and the head's input sharded, so there it is refused in one line."""
    for paths in groups:
        modules = {path.rpartition(".")[0] for path in paths}
        if modules & top.keys() and not modules <= top.keys():
            if sequence_parallel:
                raise SequenceParallelUnsupported(
                    f"the parameter {paths[0]} is tied to {', '.join(paths[1:])}, which --tp-plan auto does not shard "
                    "alike, so it stays whole, and sequence parallel needs the embedding sharded; pass --no-sp, or "
                    "--tp-plan PATH.py:FUNC with your own plan"
                )
            for module in modules & top.keys():
                del top[module]


def _tie_again(model: nn.Module, groups: list[list[str]]) -> None:
    """Each tied group one tensor again: the first path's shard, where every path was sharded alike
    (an embedding rowwise and a head colwise both split the vocabulary)."""
    for owner, *others in groups:
        shard = model.get_parameter(owner)
        for path in others:
            other = model.get_parameter(path)
            if other is shard:
                continue
            if not (_placements(other) == _placements(shard) and other.shape == shard.shape):
                raise SpecError(
                    f"--tp-plan auto shards the tied parameters {owner} and {path} differently; pass --tp-plan "
                    "PATH.py:FUNC with your own plan"
                )
            parent, _, name = path.rpartition(".")
            model.get_submodule(parent).register_parameter(name, shard)


def _placements(param: nn.Parameter) -> tuple | None:
    return param.placements if isinstance(param, DTensor) else None


def _hf_plan(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """transformers' own plan, applied by transformers (``apply_tensor_parallelism``)."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    tp = tp_mesh.size()
    text = model.config.get_text_config()
    attrs = ("num_attention_heads", "num_key_value_heads")
    check_heads(type(model).__name__, {a: getattr(text, a, None) for a in attrs}, tp)
    plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=tp))
    # a tied parameter (lm_head.weight = embed_tokens.weight) is sharded once, as its owner's entry
    # says (both shard the vocabulary), and tied again to the shard
    tied = {path for _, *others in _tied_groups(model) for path in others}
    apply_tensor_parallelism(model, tp_mesh, {name: style for name, style in plan.items() if name not in tied})
    if tied:
        model.tie_weights()


def _has_hf_plan(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return bool(getattr(config, "base_model_tp_plan", None)) and hasattr(model, "_resolve_parallel_plans")


def _auto_plan(
    model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool, loss_parallel: bool, shard_experts: bool
) -> None:
    if _has_hf_plan(model):
        _hf_plan(model, tp_mesh)
        return
    if not decoder_blocks(model):
        raise SpecError(
            f"--tp-plan auto found no decoder blocks memplan recognises in {type(model).__name__} and the model "
            "ships no tensor-parallel plan; pass --tp-plan PATH.py:FUNC with FUNC(model, tp_mesh) calling "
            "parallelize_module"
        )
    _memplan_plan(model, tp_mesh, sequence_parallel, loss_parallel, shard_experts)


def resolve_tp_plan(
    spec: str, sequence_parallel: bool = True, loss_parallel: bool = False, shard_experts: bool = True
) -> TpPlan:
    """``auto`` or a ``PATH.py:FUNC`` / ``package.module:FUNC`` spec -> plan(model, tp_mesh); under
    expert parallel (`shard_experts` false) the experts are left to the EP plan."""
    if spec == "auto":
        return partial(
            _auto_plan, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, shard_experts=shard_experts
        )
    return user_plan("tp-plan", spec, "tp_mesh")


def apply_tp_plan(model: nn.Module, tp_mesh: DeviceMesh, plan: TpPlan) -> nn.Module:
    """Shard `model` in place over `tp_mesh` with `plan`; returns the model."""
    plan(model, tp_mesh)
    return model


def _runs_loss_parallel(tp: int, loss_parallel_asked: bool) -> bool:
    """Whether a step over `tp` tensor-parallel ranks computes its loss on vocabulary-sharded logits."""
    return tp > 1 and loss_parallel_asked


def tp_plan_for(config: TrainConfig) -> TpPlan:
    """The tensor-parallel plan a config names (its spec, sequence and loss parallel)."""
    return resolve_tp_plan(
        config.tp_plan, config.sequence_parallel, _runs_loss_parallel(config.tp, config.loss_parallel), config.ep == 1
    )


def step_context(config: TrainConfig) -> AbstractContextManager:
    """What a training step of this layout runs inside: torch's ``loss_parallel()`` when tensor
    parallel computes the loss on vocabulary-sharded logits (forward and backward), else nothing.
    A plan that leaves the logits whole is untouched by it (plain tensors never reach its handlers)."""
    return loss_parallel_context(config.tp, config.loss_parallel)


def loss_parallel_context(tp: int, loss_parallel_asked: bool) -> AbstractContextManager:
    """torch's ``loss_parallel()`` where :func:`_runs_loss_parallel`, else nothing."""
    return loss_parallel() if _runs_loss_parallel(tp, loss_parallel_asked) else nullcontext()
