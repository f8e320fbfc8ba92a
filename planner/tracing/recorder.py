"""Trace one training step on fake tensors into an :class:`OpGraph`.

Two passes over the same fake model, nothing allocated for real:

1. forward, loss and backward under a recording dispatch mode (tracing/dispatch.py): every aten op in order, the
   storages it creates, and when each storage dies (weakref finalizers fire the moment CPython
   drops the last reference). `saved_tensors_hooks` report exactly which storages autograd saves.
2. the same forward with saved tensors discarded: where each forward storage would die if
   autograd did not hold it. The simulator needs that to model recompute and offload.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from costmodels.memory import get_precision
from memplan_compat import tree_leaves
from planner.config import TrainConfig
from planner.errors import SpecError, TraceError
from planner.tracing.blocks import (
    container_paths,
    find_region_paths,
    is_segment,
    looped_over,
    module_signature,
    segment_children,
)
from planner.tracing.depth import BlockRun, FoldError, fold_trace, repeated_run
from planner.tracing.dispatch import OpRecorder, local_tensor
from planner.tracing.fake_build import fake_model
from planner.tracing.fingerprint import model_fingerprint
from planner.tracing.graph import OpGraph, OpNode, Region, TensorInfo
from planner.tracing.specs import ModelSpec, resolve_spec
from planner.tracing.static_size import as_int

__all__ = [
    "FULL_TRACE_ENV",
    "TraceCache",
    "TraceError",
    "cast_parameters",
    "fold_run",
    "forward_context",
    "loss_of",
    "run_step_inputs",
    "trace",
    "trace_for",
    "trace_key",
    "trace_model",
]

FULL_TRACE_ENV = "MEMPLAN_FULL_TRACE"  # "1": trace every block (no depth folding), to check a fold or time one
MIXED_DTENSOR = "got mixed torch.Tensor and DTensor"  # DTensor refusing an op on a plain and a sharded tensor


def loss_of(output: Any) -> torch.Tensor:
    """The loss of a step: the output when it is a scalar, else its `.loss`, else the sum of its
    first tensor."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    for leaf in tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.sum()
    raise TraceError("the model returned no floating-point tensor to use as a loss")


def run_step_inputs(model: nn.Module, inputs: tuple | dict) -> Any:
    """Call the model with positional (tuple) or keyword (dict) inputs."""
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def forward_context(precision: str) -> Any:
    autocast_dtype = get_precision(precision).autocast_dtype
    if autocast_dtype is None:
        return nullcontext()
    return torch.autocast("cpu", dtype=autocast_dtype)


def _untraceable(rec: OpRecorder, spec_name: str, exc: Exception) -> TraceError:
    op, module = rec.current
    where = f"{op} in module '{module or '<root>'}'" if op else "before the first op"
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, TraceError):
        return TraceError(f"cannot trace model '{spec_name}' on fake tensors: {where}: {msg}")
    return TraceError(
        f"cannot trace model '{spec_name}' on fake tensors: {where} raised {type(exc).__name__}: {msg[:200]}; {_hint(exc)}"
    )


def _hint(exc: Exception) -> str:
    """What to do: fake tensors' own refusals (a shape that depends on data) differ from the model's
    code refusing the inputs memplan built."""
    if type(exc).__module__.startswith(("torch._subclasses", "torch.fx.experimental")):
        return "memplan needs ops with static output shapes (no .item()/.nonzero() on data, no data-dependent control flow)"
    if MIXED_DTENSOR in str(exc):
        return (
            "the tensor-parallel plan leaves a plain tensor meeting a sharded one in this op (e.g. a bias added to "
            "vocabulary-sharded logits): try --no-loss-parallel, or give your own plan with --tp-plan PATH.py:FUNC"
        )
    return (
        "check that --batch-size and --seq-len suit the model (a vision model's --seq-len is its image side), "
        "or trace it from a spec that builds its own inputs"
    )


def _run(
    model,
    inputs,
    rec: OpRecorder,
    precision: str,
    spec_name: str,
    saved_hooks: tuple[Callable, Callable],
    backward: bool,
) -> tuple[int, torch.Tensor]:
    """Run forward (+ backward) under `rec`; returns the first backward op's index and the loss
    (which a training loop holds through the optimizer step)."""
    try:
        with rec.tracker, rec, torch.autograd.graph.saved_tensors_hooks(*saved_hooks):
            with forward_context(precision):
                loss = loss_of(run_step_inputs(model, inputs))
            backward_start = len(rec.ops)
            if backward:
                rec.phase = "backward"
                rec.active.clear()
                loss.backward()
    except SpecError:
        raise
    except Exception as exc:
        raise _untraceable(rec, spec_name, exc) from exc
    return backward_start, loss


def _phase_of_forward_ops(ops: list[OpNode], backward_start: int) -> list[OpNode]:
    """Forward ops in the root module after the last op of any submodule are the loss."""
    last_child = max((op.index for op in ops[:backward_start] if op.module), default=-1)
    out = []
    for op in ops:
        if op.index < backward_start and op.index > last_child and last_child >= 0:
            op = OpNode(**{**op.__dict__, "phase": "loss"})
        out.append(op)
    return out


def _regions(
    model: nn.Module, graph: OpGraph, param_bytes_of: Callable[[nn.Module], int], blocks: Sequence[str] = ()
) -> list[Region]:
    """The checkpointable blocks with their forward and backward op ranges.

    When module hooks cannot see a block's backward (an in-place op on its output rebases the
    grad_fn the hook was on), the backward range comes from the block's saved storages instead:
    from the first backward op that reads one to the last op before one is freed.
    """
    regions = []
    first_use = graph.first_backward_use()
    for path in _called_blocks(model, find_region_paths(model, blocks), set(graph.meta["looped_over"])):
        if path in graph.meta["shared_modules"]:  # its calls are several spans, not one block
            continue
        modules = (
            [model.get_submodule(c) for c in segment_children(model, path)]
            if is_segment(path)
            else [model.get_submodule(path)]
        )
        ops = graph.ops_in_module(path)
        fwd = [i for i in ops if i < graph.backward_start]
        bwd = [i for i in ops if i >= graph.backward_start]
        if fwd and not bwd:
            saved = [
                t
                for t in graph.tensors.values()
                if t.saved_by and min(fwd) <= t.alloc_op <= max(fwd) and t.free_op is not None
            ]
            bwd = [first_use[t.id] for t in saved if t.id in first_use] + [t.free_op - 1 for t in saved]
        if not fwd or not bwd:
            continue
        signature = "+".join(module_signature(m) for m in modules)
        regions.append(
            Region(
                path, signature, sum(param_bytes_of(m) for m in modules), min(fwd), max(fwd) + 1, min(bwd), max(bwd) + 1
            )
        )
    return regions


def _called_blocks(model: nn.Module, paths: list[str], looped: set[str]) -> list[str]:
    """The blocks, with one the model loops over without calling replaced by its children."""
    out: list[str] = []
    for path in paths:
        if path in looped:
            children = [f"{path}.{name}" for name, _ in model.get_submodule(path).named_children()]
            out += _called_blocks(model, children, looped)
        else:
            out.append(path)
    return out


def trace_model(
    model: nn.Module,
    inputs: tuple | dict,
    *,
    precision: str = "fp32",
    name: str = "model",
    lifetimes: bool = True,
    blocks: Sequence[str] = (),
    fold: bool = True,
) -> OpGraph:
    """Trace a model whose parameters and inputs are fake tensors of the active FakeTensorMode.

    `lifetimes=False` skips the second forward (natural lifetimes): enough to simulate without a
    plan, not to plan. `blocks` (globs over module paths) names the checkpointable blocks; by
    default they are found by structure. With `fold`, a long run of identical blocks is traced
    through a shallow copy of the model and extended to full depth, checked (tracing/depth.py);
    the environment variable MEMPLAN_FULL_TRACE=1 turns folding off everywhere (every block traced).
    """

    def once() -> OpGraph:
        for p in model.parameters():  # a trace's backward leaves gradients; the next starts without
            p.grad = None
        return _trace_once(model, inputs, precision=precision, name=name, lifetimes=lifetimes, blocks=blocks)

    run = fold_run(model, blocks) if fold else None
    graph, unfolded_because = None, None
    if run is not None:
        try:
            graph = fold_trace(model, run, once)
        except FoldError as exc:
            unfolded_because = str(exc)
    if graph is None:
        graph = once()
        looped, shared = set(graph.meta.pop("looped_over")), set(graph.meta["shared_modules"])
        if unfolded_because is not None:
            graph.meta["unfolded_because"] = unfolded_because
    else:
        graph.meta.update(
            fingerprint=model_fingerprint(model), num_modules=sum(1 for _ in model.modules()), folded=run.length
        )
        looped = _across_run(graph.meta.pop("looped_over"), run)
        shared = _across_run(graph.meta["shared_modules"], run)
    graph.meta["shared_modules"] = sorted(shared)
    # modules a plan cannot wrap as one span: no forward of their own, one the model loops over
    # without calling, or one called several times per step (a layer shared across depths)
    graph.meta["containers"] = sorted(set(container_paths(model)) | looped | shared)
    return graph


def fold_run(model: nn.Module, blocks: Sequence[str] = ()) -> BlockRun | None:
    """The run of identical blocks :func:`trace_model` folds (None when it traces every block)."""
    if os.environ.get(FULL_TRACE_ENV) == "1":
        return None
    return repeated_run(model, find_region_paths(model, blocks))


def _across_run(paths: Sequence[str], run: BlockRun) -> set[str]:
    """Paths inside the blocks of a folded run, repeated in every block of the run (the shallow
    trace called only the first few)."""
    blocks = [run.path(k) for k in range(run.start, run.start + run.length)]
    out = set(paths)
    for path in paths:
        for block in blocks:
            if path.startswith(block + "."):
                rest = path[len(block) :]
                out.update(b + rest for b in blocks)
    return out


def _trace_once(
    model: nn.Module, inputs: tuple | dict, *, precision: str, name: str, lifetimes: bool, blocks: Sequence[str]
) -> OpGraph:
    params = [p for p in model.parameters()]
    param_dtype = str(params[0].dtype).replace("torch.", "") if params else "float32"

    def param_bytes_of(m: nn.Module) -> int:
        return sum(as_int(local_tensor(p).untyped_storage().nbytes(), "a parameter") for p in m.parameters())

    # Pass 2 first: natural lifetimes of forward storages when nothing is saved.
    natural_free_by_key: dict[tuple[int, int], int] = {}
    if lifetimes:
        natural = OpRecorder(model, with_costs=False)
        _register_preexisting(natural, model, inputs)
        _run(model, inputs, natural, precision, name, (lambda t: None, _no_unpack), backward=False)
        natural_free_by_key = _free_by_alloc_key(natural)

    rec = OpRecorder(model, with_costs=True)
    categories = _register_preexisting(rec, model, inputs)
    buffer_names = {rec.tid_of(b, -1)[0]: name for name, b in model.named_buffers()}
    packs: list[tuple[int, str, int]] = []  # (ops dispatched so far, module, storage) per save

    def pack(t: torch.Tensor) -> torch.Tensor:
        if rec.phase == "forward":
            tid, _ = rec.tid_of(t, len(rec.ops) - 1)
            packs.append((len(rec.ops), rec.module_path(), tid))
        return t

    backward_start, loss = _run(model, inputs, rec, precision, name, (pack, _identity), backward=True)
    saved_by = _savers(rec.ops, packs)
    for p in params:
        if p.grad is not None:
            categories[rec.tid_of(p.grad, -1)[0]] = "gradient"
    rec.recording = False  # storages alive now outlive the step
    del loss
    ops = _phase_of_forward_ops(rec.ops, backward_start)
    if lifetimes and len(natural.ops) > backward_start:
        raise TraceError(
            f"model '{name}' ran fewer ops on its second forward than on its first ({len(natural.ops)} then "
            f"{backward_start}): it keeps tensors across calls (a cache such as functools.lru_cache), which now "
            "hold fake tensors; run the model once for real in this process before tracing it, or turn the cache off"
        )
    if lifetimes and len(natural.ops) != backward_start:
        raise TraceError(
            f"model '{name}' ran a different forward twice ({len(natural.ops)} vs "
            f"{backward_start} ops); memplan needs a deterministic forward"
        )
    alloc_key = _alloc_keys(rec)
    tensors: dict[int, TensorInfo] = {}
    for tid, st in rec.storages.items():
        free_op = rec.frees.get(tid)
        category = categories.get(tid)
        if category is None:
            category = "activation" if saved_by.get(tid) else "temporary"
        natural_free = None
        if lifetimes and 0 <= st.alloc_op < backward_start:
            natural_free = min(natural_free_by_key.get(alloc_key[tid], backward_start), backward_start)
        tensors[tid] = TensorInfo(
            tid,
            st.nbytes,
            category,
            st.dtype,
            st.shape,
            st.alloc_op,
            free_op,
            natural_free,
            tuple(sorted(set(saved_by.get(tid, ())))),
        )
    # Inputs the step holds that autograd saved count as activations.
    for tid in list(tensors):
        t = tensors[tid]
        if categories.get(tid) == "input":
            tensors[tid] = TensorInfo(**{**t.__dict__, "category": "activation" if t.saved_by else "temporary"})
    _drop_parameter_saves(tensors)
    graph = OpGraph(
        ops=ops,
        tensors=tensors,
        regions=[],
        backward_start=backward_start,
        pack_events=tuple((n, module) for n, module, _ in packs),
        param_shapes=[tuple(as_int(d, "a parameter") for d in local_tensor(p).shape) for p in params],
        param_trainable=() if all(p.requires_grad for p in params) else tuple(p.requires_grad for p in params),
        param_dtype=param_dtype,
        meta={
            "model": name,
            "precision": precision,
            "fingerprint": model_fingerprint(model),
            "natural_lifetimes": lifetimes,
            "num_modules": sum(1 for _ in model.modules()),
            "buffer_writes": _buffer_writes(ops[:backward_start], buffer_names),
            "looped_over": looped_over(model, rec.calls),
            "shared_modules": sorted(path for path, n in rec.calls.items() if path and n > 1),
        },
    )
    graph.regions = _regions(model, graph, param_bytes_of, blocks)
    return graph


def _savers(ops: list[OpNode], packs: list[tuple[int, str, int]]) -> dict[int, list[int]]:
    """Storage -> forward ops whose autograd nodes saved it.

    Autograd saves an op's inputs before the op runs and its outputs after, so a save seen after
    n ops belongs to op n when op n reads the storage, else to op n - 1 (which produced it).
    """
    out: dict[int, list[int]] = defaultdict(list)
    for n, _, tid in packs:
        if n < len(ops) and tid in ops[n].inputs and not (n > 0 and tid in ops[n - 1].allocs):
            out[tid].append(n)
        else:
            out[tid].append(max(n - 1, 0))
    return out


def _identity(x):
    return x


def _no_unpack(_):
    raise RuntimeError("memplan's lifetime pass runs no backward")


def _register_preexisting(rec: OpRecorder, model: nn.Module, inputs) -> dict[int, str]:
    categories: dict[int, str] = {}
    for p in model.parameters():
        categories[rec.tid_of(p, -1)[0]] = "parameter"
    for b in model.buffers():
        categories.setdefault(rec.tid_of(b, -1)[0], "buffer")
    for t in tree_leaves(inputs):
        if isinstance(t, torch.Tensor):
            categories.setdefault(rec.tid_of(t, -1)[0], "input")
    return categories


def _alloc_keys(rec: OpRecorder) -> dict[int, tuple[int, int]]:
    """tid -> (allocating op, position among that op's allocations): aligns the two passes."""
    keys = {}
    for op in rec.ops:
        for k, tid in enumerate(op.allocs):
            keys[tid] = (op.index, k)
    return keys


def _free_by_alloc_key(rec: OpRecorder) -> dict[tuple[int, int], int]:
    keys = _alloc_keys(rec)
    return {keys[tid]: free for tid, free in rec.frees.items() if tid in keys}


# Ops that write inputs their schema does not mark `Tensor(a!)`: BatchNorm's running statistics.
_UNDECLARED_WRITES = frozenset(
    ("aten.native_batch_norm.default", "aten.cudnn_batch_norm.default", "aten.miopen_batch_norm.default")
)


def _buffer_writes(forward: list[OpNode], buffer_names: dict[int, str]) -> list[tuple[int, int, str]]:
    """(op index, storage, buffer name) for each buffer a forward op writes in place (for
    :meth:`OpGraph.buffers_written`). A batch-norm kernel writes the buffers it reads."""
    out = []
    for op in forward:
        written = op.inputs if op.name in _UNDECLARED_WRITES else op.mutates
        out += [(op.index, t, buffer_names[t]) for t in dict.fromkeys(written) if t in buffer_names]
    return out


def _drop_parameter_saves(tensors: dict[int, TensorInfo]) -> None:
    """Parameters and buffers saved by autograd (an mm saves its weight) are not activations."""
    for tid, t in tensors.items():
        if t.category in ("parameter", "buffer", "gradient") and t.saved_by:
            tensors[tid] = TensorInfo(**{**t.__dict__, "saved_by": ()})


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """model.to(dtype) for floating parameters and buffers of a model built to be traced; works on
    fake tensors, where Module.to cannot swap parameter tensors. Parameters get new, uninitialised
    storage (their values are not kept: a traced model's weights skip init; one op each instead of
    a copy's three, -45% on llama-70b's 723); buffers are cast with their values. A parameter shared
    by several modules (tied weights) stays one parameter."""
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_floating_point():
                if id(p) not in cast:
                    cast[id(p)] = nn.Parameter(torch.empty_like(p, dtype=dtype), requires_grad=p.requires_grad)
                setattr(module, name, cast[id(p)])
        for name, b in list(module.named_buffers(recurse=False)):
            if b is not None and b.is_floating_point():
                module.register_buffer(name, b.to(dtype), persistent=name not in module._non_persistent_buffers_set)


def trace(
    spec: str | ModelSpec,
    *,
    batch_size: int = 1,
    seq_len: int = 512,
    precision: str = "fp32",
    gathered_params: bool = False,
    lifetimes: bool = True,
    moe_imbalance: float = 1.0,
    blocks: Sequence[str] = (),
    gpu: str = "cpu",
) -> OpGraph:
    """Trace one forward, loss and backward of a model spec on fake CPU tensors.

    Nothing is allocated: a 70B model traces on a laptop. The precision decides the parameter
    dtype and the autocast dtype of the forward. With `gathered_params` (ZeRO-3/FSDP) a mixed
    precision runs as FSDP's MixedPrecisionPolicy does: parameters gathered in the compute dtype,
    no autocast (the simulator puts the fp32 master weights back).

    The model builds without weight init and runs the path its eager run takes: small integer and
    boolean tensors (ids, positions, masks) keep real values that answer data-dependent checks;
    mixture-of-experts routing follows `moe_imbalance` (1.0: balanced, see tracing/moe.py),
    recorded in `graph.meta["moe"]`. The key/value cache is off, as in training. Attention runs
    the kernels the `gpu` (the target device) picks, as it allocates and saves them there.
    """
    model_spec = resolve_spec(spec) if isinstance(spec, str) else spec
    prec = get_precision(precision)
    param_dtype, traced_precision = prec.param_dtype, precision
    if gathered_params and prec.autocast_dtype is not None:
        param_dtype, traced_precision = prec.autocast_dtype, "fp32"
    with fake_model(model_spec, batch_size, seq_len, moe_imbalance, gpu) as (model, inputs, routing):
        if param_dtype != torch.float32:
            cast_parameters(model, param_dtype)
        graph = trace_model(
            model, inputs, precision=traced_precision, name=model_spec.name, lifetimes=lifetimes, blocks=blocks
        )
        graph.meta["precision"] = precision
    if routing.routers:  # the lifetime pass ran the routers too: count those of one forward
        routing.routers = sum(op.name == "aten.topk.default" for op in graph.ops[: graph.backward_start])
        graph.meta["moe"] = routing.to_dict()
    graph.meta.update(batch_size=batch_size, seq_len=seq_len)
    return graph


def trace_key(config: TrainConfig) -> tuple:
    """What :func:`trace_for` reads from a config: configs with equal keys have the same trace."""
    return (
        config.batch_size,
        config.seq_len,
        config.precision,
        config.zero_stage == 3,
        config.moe_imbalance,
        tuple(config.blocks),
        config.gpu,
    )


class TraceCache:
    """Traces of one model, one per :func:`trace_key` (searches that revisit a config trace it once)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self._graphs: dict[tuple, OpGraph] = {}

    def __call__(self, config: TrainConfig) -> OpGraph:
        key = trace_key(config)
        if key not in self._graphs:
            self._graphs[key] = trace_for(self.spec, config)
        return self._graphs[key]

    @property
    def count(self) -> int:
        """Traces made so far."""
        return len(self._graphs)


def trace_for(spec: str, config: TrainConfig, lifetimes: bool = True):
    """The trace a config needs (ZeRO-3 traces parameters as FSDP gathers them)."""
    return trace(
        spec,
        batch_size=config.batch_size,
        seq_len=config.seq_len,
        precision=config.precision,
        gathered_params=config.zero_stage == 3,
        lifetimes=lifetimes,
        moe_imbalance=config.moe_imbalance,
        blocks=config.blocks,
        gpu=config.gpu,
    )
