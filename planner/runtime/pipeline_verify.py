"""Run a real model as the pipeline memplan simulates, and measure each pp rank's step.

Any model: torch.distributed.pipelining's tracer (``pipeline()``, torch.export) cuts the step at
the first block of every stage, as planner/simulation/pipeline_split.py cuts the trace — stage 0
also runs what comes before the first block, the last stage what comes after the last one and the
loss — and every value that crosses a cut is sent to the stage that reads it. The traced step
takes the step's inputs on stage 0 (each passed through a view there, so labels reach the loss
through the stages) and returns the loss (:func:`planner.tracing.recorder.loss_of`). For the
multi-stage schedules every value a later stage reads is relayed through the stages in between,
as those schedules hand a stage's outputs to the next stage only. Each rank
builds its stages, runs ``--microbatches`` microbatches under torch's schedule class for
``--pp-schedule``, a warm-up step and measured steps with the optimizer step, and reports the lowest
peak of live tensor bytes (parameters, optimizer states, the inputs it holds and the stages' receive
buffers counted from the start).
"""

from __future__ import annotations

import operator
import statistics
import time
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from costmodels.memory import get_precision
from planner.config import PP_SCHEDULES, SINGLE_STAGE_SCHEDULES, TrainConfig
from planner.errors import MemplanError
from planner.plans.format import load_plan
from planner.runtime.apply import PlanHandle, apply_plan
from planner.runtime.early_recompute import recompute_in_bubbles
from planner.runtime.parallel_verify import run_on_gloo_ranks
from planner.runtime.shard import ShardedBytesTracker
from planner.runtime.tracker import LiveBytesTracker
from planner.runtime.verify import make_optimizer
from planner.simulation.pipeline_schedule import stages_of_rank
from planner.tracing.blocks import find_region_paths
from planner.tracing.hf import disable_kv_cache, eager_masks_under_export
from planner.tracing.recorder import loss_of
from planner.tracing.specs import resolve_spec

__all__ = ["MEASURED_STEPS", "ScheduleMeasurement", "measure_pipeline_on_gloo_ranks", "measure_schedule"]


@dataclass(frozen=True)
class ScheduleMeasurement:
    """A rank's lowest peak of live tensor bytes over the measured steps and their median seconds."""

    peak_bytes: int
    step_s: float


MEASURED_STEPS = 2  # after one warm-up step; the lowest peak is reported


class _Step(nn.Module):
    """The model's step as one module: the inputs enter on the first stage; the last returns the
    loss and what the loss reads, the output of the model's last submodule to finish (the head's
    logits). torchtitan's last stage returns the logits and its loss function runs outside, so the
    schedule holds them from the stage's forward to its backward (as memplan simulates); returned
    beside the loss, the traced last stage's logits are held the same way."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self._last_output: list[torch.Tensor] = []  # a list: export refuses a tensor set on a module
        for _, module in list(model.named_modules())[1:]:
            module.register_forward_hook(self._remember)

    def _remember(self, module: nn.Module, args, output) -> None:
        if isinstance(output, torch.Tensor):
            self._last_output[:] = [output]

    def forward(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        args = [a.view(a.shape) if isinstance(a, torch.Tensor) else a for a in args]
        kwargs = {k: v.view(v.shape) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        self._last_output.clear()
        loss = loss_of(self.model(*args, **kwargs))
        read_by_loss = _owned(self._last_output[0]) if self._last_output else loss
        self._last_output.clear()
        return loss, read_by_loss


def _loss(output: tuple[torch.Tensor, torch.Tensor], target) -> torch.Tensor:
    """The schedule's loss function: the loss the traced last stage computed (:class:`_Step`)."""
    return output[0]


def _split_inputs(inputs) -> tuple[tuple, dict]:
    if isinstance(inputs, dict):
        return (), dict(inputs)
    return (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)), {}


def _microbatch(values, size: int, index: int = 0):
    """Microbatch `index` (of `size` samples) of every tensor in `values`."""
    return [v[index * size : (index + 1) * size] if isinstance(v, torch.Tensor) else v for v in values]


def measure_schedule(
    schedule,
    modules: list[nn.Module],
    stages: list,
    optimizer,
    step_args: tuple,
    step_kwargs: dict,
    config: TrainConfig,
    *,
    steps: int = MEASURED_STEPS,
    tracker_cls: type[LiveBytesTracker] = LiveBytesTracker,
    handles: Sequence[PlanHandle] = (),
) -> ScheduleMeasurement:
    """This rank's lowest peak of live tensor bytes over `steps` pipeline steps (each
    ``grad_accum_steps`` schedule steps and the optimizer step) after a warm-up step, counting its
    stage modules' parameters and buffers, optimizer states, the inputs it holds and its stages'
    receive buffers from the start (`tracker_cls`: a sharded tracker under FSDP2), and the median
    step's seconds. `handles`: the stage plans applied to its modules (their early recomputes run
    in the schedule's waits, planner.runtime.early_recompute)."""
    params = [p for m in modules for p in m.parameters()]
    held = [*step_args, *step_kwargs.values()]
    peaks, seconds = [], []
    for step in range(steps + 1):  # step 0 warms up: shapes, receive buffers, optimizer states
        for s in stages:
            s.clear_runtime_states()
        tracker = tracker_cls()
        tracker.track_all(
            [
                params,
                [b for m in modules for b in m.buffers()],
                held,
                optimizer.state_dict()["state"] if optimizer is not None else [],
                [b for s in stages for b in _recv_buffers(s)],
            ]
        )
        start = time.perf_counter()
        with tracker, recompute_in_bubbles(schedule, handles):
            for _ in range(config.grad_accum_steps):  # gradients accumulate across pipeline steps
                schedule.step(*step_args, return_outputs=False, **step_kwargs)
            if optimizer is not None:
                optimizer.step()
            tracker.sample()
        elapsed = time.perf_counter() - start
        for p in params:
            p.grad = None
        if step:
            peaks.append(tracker.peak_bytes)
            seconds.append(elapsed)
    return ScheduleMeasurement(min(peaks), float(statistics.median(seconds)))


def _recv_buffers(stage) -> list[torch.Tensor]:
    infos = [i for per_mb in stage.args_recv_info.values() for i in per_mb]
    infos += [i for per_mb in stage.grad_recv_info.values() for i in per_mb]
    return [b for i in infos if isinstance(b := getattr(i, "buffer", None), torch.Tensor)]


def _training_model(spec: str, config: TrainConfig, seed: int) -> tuple[nn.Module, tuple, dict, int]:
    """(the model in training mode at the config's precision, the step's positional and keyword
    inputs, the microbatch size), built from `seed`."""
    torch.manual_seed(seed)
    model, inputs = resolve_spec(spec).build(batch_size=config.batch_size, seq_len=config.seq_len)
    model.to(get_precision(config.precision).param_dtype)
    disable_kv_cache(model)
    model.train()
    args, kwargs = _split_inputs(inputs)
    return model, args, kwargs, config.batch_size // config.num_microbatches


def _traced_pipe(spec: str, config: TrainConfig, blocks_per_stage: tuple[int, ...], seed: int):
    """(torch's pipeline tracer's stages of the step, the step's inputs as positional arguments, the
    model's block paths)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    model, args, kwargs, micro = _training_model(spec, config, seed)
    blocks = find_region_paths(model, config.blocks)
    if len(blocks) != sum(blocks_per_stage):
        raise MemplanError(
            f"the real model has {len(blocks)} blocks but the simulated split {list(blocks_per_stage)} has "
            f"{sum(blocks_per_stage)}; give --blocks or an explicit --pp-split"
        )
    firsts = [sum(blocks_per_stage[:k]) for k in range(1, len(blocks_per_stage))]
    split_spec = {f"model.{blocks[i]}": SplitPoint.BEGINNING for i in firsts}
    mb_kwargs = dict(zip(kwargs, _microbatch(kwargs.values(), micro)))
    try:
        # ids without positions or a padding mask: transformers' eager step skips the causal mask
        unpacked = not {"position_ids", "attention_mask"} & set(kwargs) and len(args) <= 1
        with warnings.catch_warnings(), eager_masks_under_export() if unpacked else nullcontext():
            warnings.filterwarnings("ignore", category=FutureWarning)  # torch's own pytree deprecations
            pipe = pipeline(
                _Step(model), mb_args=tuple(_microbatch(args, micro)), mb_kwargs=mb_kwargs, split_spec=split_spec
            )
    except Exception as exc:  # torch.export's many failure types
        reason = " ".join(str(exc).split())[:200]
        raise MemplanError(
            f"torch.distributed.pipelining could not trace {spec} into stages ({type(exc).__name__}: {reason}); "
            "verify its stages with your own stage modules"
        ) from None
    for stage in pipe.split_gm.children():
        _drop_unused(stage)
    _make_step_constants_where_read(pipe.split_gm, (*args, *kwargs.values()), micro, config.num_microbatches)
    if config.pp_schedule not in SINGLE_STAGE_SCHEDULES:  # torch's multi-stage runtime, whatever the stages per rank
        _relay_skipping_values(pipe.split_gm)
    _contiguous_across_cuts(pipe.split_gm)
    _detach_constants(pipe, args, mb_kwargs, micro)
    # the step's inputs positionally, in the traced step's order: a multi-stage schedule hands its
    # keyword arguments to every stage of the rank, not only the first
    names = [n.target for n in pipe.split_gm.graph.nodes if n.op == "placeholder"]
    return pipe, (*args, *(kwargs[name] for name in names[len(args) :])), blocks


def _drop_unused(stage: nn.Module) -> None:
    """Remove from a traced stage the modules and tensors its graphs never reach. The tracer keeps
    the module tree of the model in each stage, so a weight tied across stages (GPT-2's head on
    stage 0) stays there as a copy no op reads; a torchtitan-style stage has no such copy."""
    used: set[str] = set()
    for path, module in stage.named_modules():
        graph = getattr(module, "graph", None)
        if isinstance(graph, torch.fx.Graph):
            for node in graph.nodes:
                if node.op in ("call_module", "get_attr"):
                    parts = f"{path}.{node.target}".lstrip(".").split(".")
                    used.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
    for path, module in list(stage.named_modules()):
        if path and path not in used:
            continue  # removed with its parent
        for name in [*module._modules, *module._parameters, *module._buffers]:
            if f"{path}.{name}".lstrip(".") not in used:
                delattr(module, name)


def _make_step_constants_where_read(split_gm: torch.fx.GraphModule, inputs: tuple, micro: int, count: int) -> None:
    """Make each step constant on the stages that read it instead of sending it there: a value that
    crosses a cut, needs no gradient and is the same in every microbatch (a rotary table, a mask
    built from the sequence length alone), as a torchtitan-style stage (what memplan simulates)
    makes its own. The reader clones it from a copy it keeps outside its parameters and buffers at
    the start of each forward; sent, it would sit in a receive buffer per microbatch on every stage
    it reaches, relayed through each stage between (Gemma2's masks: up to 16% of a rank's peak)."""
    crossing = {a for n in split_gm.graph.nodes if n.op == "call_module" for a in n.args}
    crossing = {n for n in crossing if isinstance(n, torch.fx.Node) and n.op != "placeholder"}
    seen: dict[torch.fx.Node, list] = {n: [] for n in crossing}

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            result = super().run_node(node)
            if node in seen:
                seen[node].append(result)
            return result

    with torch.random.fork_rng():
        for i in range(count):  # the step's `count` microbatches of `micro` samples
            with torch.no_grad() if i else nullcontext():  # the first tells which values need gradients
                _Recorder(split_gm).run(*_microbatch(inputs, micro, i))
    constants = [
        node
        for node, values in seen.items()
        if isinstance(values[0], torch.Tensor)
        and not values[0].requires_grad
        and all(v.dtype == values[0].dtype and torch.equal(v, values[0]) for v in values[1:])
    ]
    for k, node in enumerate(constants):
        for reader in [u for u in node.users if u.op == "call_module"]:
            submod = split_gm.get_submodule(reader.target)
            position = reader.args.index(node)
            placeholder = [n for n in submod.graph.nodes if n.op == "placeholder"][position]
            name = f"_step_constant_{k}"
            submod.__dict__[name] = seen[node][0].detach().clone()  # a plain attribute: no buffer to count
            with submod.graph.inserting_before(placeholder), warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Attempted to insert a get_attr Node")  # not a buffer, on purpose
                kept = submod.graph.get_attr(name)
                made = submod.graph.call_method("clone", (kept,))
            made.meta["val"] = placeholder.meta.get("val")
            placeholder.replace_all_uses_with(made)
            submod.graph.erase_node(placeholder)
            submod.recompile()
            reader.args = reader.args[:position] + reader.args[position + 1 :]
    _drop_unread_outputs(split_gm)


def _drop_unread_outputs(split_gm: torch.fx.GraphModule) -> None:
    """Remove from every stage but the last the outputs no later stage reads any more."""
    stages = [n for n in split_gm.graph.nodes if n.op == "call_module"]
    for stage in stages[:-1]:
        items = {u.args[1]: u for u in stage.users if u.op == "call_function" and u.target is operator.getitem}
        if len(items) != len(stage.users):
            continue  # its output is read whole: a single value
        submod = split_gm.get_submodule(stage.target)
        returned, results = _returned(submod.graph)
        kept = [i for i in range(len(results)) if i in items and items[i].users]
        if len(kept) == len(results):
            continue
        for i, item in items.items():
            if i not in kept:
                split_gm.graph.erase_node(item)
        for new, old in enumerate(kept):
            items[old].args = (stage, new)
        returned.args = (tuple(results[i] for i in kept),)
        submod.graph.eliminate_dead_code()
        submod.recompile()
    split_gm.recompile()


def _relay_skipping_values(split_gm: torch.fx.GraphModule) -> None:
    """Make every stage take exactly its predecessor's outputs, in their order. torch's multi-stage
    schedules hand a stage's outputs to the next stage only (a V schedule's same-rank stages by
    position), so a value read stages later (the labels, a rotary table) passes through each stage
    in between: its receive buffer there, sent on as it is."""
    top = split_gm.graph
    stages = [n for n in top.nodes if n.op == "call_module"]
    index = {n: k for k, n in enumerate(stages)}
    out_node = next(n for n in top.nodes if n.op == "output")

    def producer(value: torch.fx.Node) -> tuple[int, int]:
        if value.op == "call_function" and value.target is operator.getitem:
            return index[value.args[0]], value.args[1]
        return index.get(value, -1), 0

    readers: dict[torch.fx.Node, list[int]] = {}
    for k, stage in enumerate(stages):
        if stage.kwargs or (k > 0 and any(producer(a)[0] < 0 for a in stage.args)):
            raise MemplanError(
                "torch's pipeline tracer fed a later stage the step's inputs directly, which a multi-stage schedule "
                "cannot relay; verify this model under gpipe or 1f1b"
            )
        for value in stage.args:
            readers.setdefault(value, []).append(k)
    if any(producer(a)[0] != len(stages) - 1 for a in out_node.all_input_nodes):
        raise MemplanError(
            "the traced step returns a value of a stage before the last one, which a multi-stage schedule cannot "
            "relay; verify this model under gpipe or 1f1b"
        )
    live = [  # values crossing the cut after stage k, in (producer, output index) order
        sorted((v for v, ks in readers.items() if 0 <= producer(v)[0] <= k < max(ks)), key=producer)
        for k in range(len(stages) - 1)
    ]
    examples = {v: _example_of(split_gm, v) for v in readers if producer(v)[0] >= 0}
    for k, stage in enumerate(stages):
        submod = split_gm.get_submodule(stage.target)
        graph = submod.graph
        returned, results = _returned(graph)
        inputs: dict[torch.fx.Node, torch.fx.Node] = {}
        if k > 0:
            old = [n for n in graph.nodes if n.op == "placeholder"]
            with graph.inserting_before(next(iter(graph.nodes))):
                inputs = {v: graph.placeholder(f"relayed_{i}") for i, v in enumerate(live[k - 1])}
            for value, node in zip(stage.args, old, strict=True):
                node.replace_all_uses_with(inputs[value])
                graph.erase_node(node)
            for value, node in inputs.items():
                node.meta["val"] = examples[value]
        if k < len(stages) - 1:
            outputs = tuple(results[producer(v)[1]] if producer(v)[0] == k else inputs[v] for v in live[k])
            returned.args = (outputs,)
        submod.recompile()
    relayed = torch.fx.Graph()
    relayed._codegen = top._codegen
    env = {n: relayed.node_copy(n) for n in top.nodes if n.op == "placeholder"}
    previous: tuple = ()
    for k, stage in enumerate(stages):
        args = tuple(env[a] for a in stage.args) if k == 0 else previous
        node = relayed.call_module(stage.target, args)
        if k < len(stages) - 1:
            previous = tuple(relayed.call_function(operator.getitem, (node, i)) for i in range(len(live[k])))
    last = node
    returned = {  # the step's outputs, the last stage's (its loss and what the loss reads)
        a: last if a is stages[-1] else relayed.call_function(operator.getitem, (last, producer(a)[1]))
        for a in out_node.all_input_nodes
    }
    relayed.output(torch.fx.map_arg(out_node.args[0], returned.__getitem__))
    split_gm.graph = relayed
    split_gm.recompile()


class _Relaid(torch.autograd.Function):
    """A received buffer, laid out contiguous in `order`, viewed in the layout the eager step had;
    its gradient goes back contiguous in `order`, as the sender's gradient buffer is."""

    @staticmethod
    def forward(ctx, buffer: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
        ctx.order = order
        return buffer.permute(tuple(order.index(d) for d in range(len(order))))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.permute(ctx.order).contiguous(), None


def _relaid(buffer: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """:class:`_Relaid` as a function the stage graphs can call."""
    return _Relaid.apply(buffer, order)


def _sent_layout(example: torch.Tensor) -> tuple[tuple[int, ...] | None, torch.Tensor]:
    """How a value that is not contiguous crosses a cut: (the dims in the order that makes it
    contiguous, a permuted view as a vision model's feature map; or None where no order does, an
    expanded mask or a strided slice, which is copied) and the example of what is sent."""
    order = tuple(sorted(range(example.dim()), key=lambda d: -example.stride(d)))
    sent = example.permute(order)
    return (order, sent) if sent.is_contiguous() else (None, example.contiguous())


def _contiguous_across_cuts(split_gm: torch.fx.GraphModule) -> None:
    """Send every value that crosses a cut contiguous. Point-to-point sends and receives take
    contiguous tensors only (gloo and NCCL alike), while the tracer cuts wherever the blocks begin.
    A permuted view (a vision model's feature map) is sent as the permutation that makes it
    contiguous, with no copy, and the receiver views it back in the eager step's layout (so its ops
    run as they do there); anything else not contiguous (an expanded attention mask) is copied. What a
    stage returns is not a view for autograd (:func:`_owned`)."""
    stages = [n for n in split_gm.graph.nodes if n.op == "call_module"]
    for k, stage in enumerate(stages):
        submod = split_gm.get_submodule(stage.target)
        graph = submod.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for node, value in zip(placeholders, stage.args):
            example = node.meta.get("val")
            if value.op == "placeholder" or not isinstance(example, torch.Tensor) or example.is_contiguous():
                continue
            order, node.meta["val"] = _sent_layout(example)
            if order is None:
                continue
            with graph.inserting_after(placeholders[-1]):
                relaid = graph.call_function(_relaid, (node, order))
            relaid.meta["val"] = example
            node.replace_all_uses_with(relaid, delete_user_cb=lambda user, r=relaid: user is not r)
        if k < len(stages) - 1:
            returned, results = _returned(graph)
            sent = tuple(_sendable(graph, returned, r) for r in results)
            returned.args = (sent if isinstance(returned.args[0], (tuple, list)) else sent[0],)
        submod.recompile()


def _sendable(graph: torch.fx.Graph, returned: torch.fx.Node, result):
    """A stage's output as it can be sent: contiguous (itself, its contiguous permutation with no
    copy, or a contiguous copy) and not a view for autograd (:func:`_owned`)."""
    example = result.meta.get("val") if isinstance(result, torch.fx.Node) else None
    if not isinstance(example, torch.Tensor):
        return result
    if not example.is_contiguous():
        order, example = _sent_layout(example)
        with graph.inserting_before(returned):
            result = (
                graph.call_method("contiguous", (result,))
                if order is None
                else graph.call_method("permute", (result, order))
            )
        result.meta["val"] = example
    with graph.inserting_before(returned):
        owned = graph.call_function(_owned, (result,))
    owned.meta["val"] = example
    return owned


def _owned(value: torch.Tensor) -> torch.Tensor:
    """`value` where it is not a view, else the same storage as a tensor autograd does not track as
    a view (no copy): a split backward (zero-bubble schedules) detaches each stage output in place
    (``stage_backward_input``), which a view refuses (OPT's layers return one)."""
    return torch.ops.aten._unsafe_view(value, value.shape) if value._is_view() else value


def _returned(graph: torch.fx.Graph) -> tuple[torch.fx.Node, tuple]:
    """(a stage graph's output node, the values it returns, one or several)."""
    returned = next(n for n in graph.nodes if n.op == "output")
    values = returned.args[0]
    return returned, tuple(values) if isinstance(values, (tuple, list)) else (values,)


def _example_of(split_gm: torch.fx.GraphModule, value: torch.fx.Node):
    """The traced example of a top-level value: the producing stage's output at its index."""
    stage, i = (value.args[0], value.args[1]) if value.target is operator.getitem else (value, 0)
    return _returned(split_gm.get_submodule(stage.target).graph)[1][i].meta["val"]


def _detach_constants(pipe, args: tuple, mb_kwargs: dict, micro: int) -> None:
    """Detach, where a stage reads it, every value crossing a cut that needs no gradient in the eager
    step (rotary tables, masks). The traced frontend marks every floating value it receives as
    requiring grad, so a stage would otherwise save what gradients for them need and send them back."""
    import torch.fx

    needs_grad: dict[str, list[bool]] = {}

    class _Recorder(torch.fx.Interpreter):
        def call_module(self, target, call_args, call_kwargs):
            needs_grad[target] = [
                not isinstance(v, torch.Tensor) or v.requires_grad or not v.is_floating_point() for v in call_args
            ]
            return super().call_module(target, call_args, call_kwargs)

    _Recorder(pipe.split_gm).run(*_microbatch(args, micro), *mb_kwargs.values())
    for name, flags in needs_grad.items():
        submod = pipe.split_gm.get_submodule(name)
        placeholders = [n for n in submod.graph.nodes if n.op == "placeholder"]
        for node, keep in zip(placeholders, flags):
            if keep:
                continue
            with submod.graph.inserting_after(placeholders[-1]):
                detached = submod.graph.call_method("detach", (node,))
            detached.meta["val"] = node.meta["val"]  # what torch reads of a stage's outputs (a relayed one)
            node.replace_all_uses_with(detached, delete_user_cb=lambda user, d=detached: user is not d)
        submod.recompile()


def _no_warm_up_with_itself(stage) -> None:
    """Drop the warm-up messages a traced stage would send to its own rank. torch warms up each
    traced stage's links with its neighbours by point-to-point messages; a V schedule's middle
    stages are neighbours on one rank, and gloo has no link from a rank to itself."""
    own = dist.get_rank(stage.group)
    warm_up = stage._get_init_p2p_neighbors_ops
    stage._get_init_p2p_neighbors_ops = lambda: [op for op in warm_up() if op.group_peer != own]


def _pp_group(rank: int, config: TrainConfig):
    """(this rank's pp index, the pp process group, the data-parallel mesh): the [pp, dp] mesh with
    data parallel (mesh order [pp, dp, cp, tp]); else (rank, the default group, None)."""
    if config.dp == 1:
        return rank, None, None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (config.pp, config.dp), mesh_dim_names=("pp", "dp"))
    return mesh.get_coordinate()[0], mesh["pp"].get_group(), mesh["dp"]


def _shard_stage(submod: nn.Module, block_paths: list[str], config: TrainConfig, dp_mesh) -> None:
    """FSDP2 on a stage module over the data-parallel ranks, as torchtitan shards a pipeline stage:
    ``fully_shard`` on each of the stage's blocks, then on the stage."""
    from planner.runtime.shard import shard_model

    units = [f"model.{path}" for path in block_paths]
    shard_model(submod, [u for u in units if _has_submodule(submod, u)], config, mesh=dp_mesh)


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _custom_autograd_functions(spec: str, config: TrainConfig, seed: int) -> list[str]:
    """The custom ``torch.autograd.Function`` classes one eager microbatch of the model runs
    (Bloom's GeLU, for one), by the names of their backward nodes; none where the eager step
    fails here (the ranks then report why, in one line)."""
    model, args, kwargs, micro = _training_model(spec, config, seed)
    try:
        loss, _ = _Step(model)(*_microbatch(args, micro), **dict(zip(kwargs, _microbatch(kwargs.values(), micro))))
    except Exception:  # the model's own failure, whatever its type: the ranks run it again and say why
        return []
    names, seen, todo = set(), set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            names.add(type(node).__name__.removesuffix("Backward"))
        todo.extend(next_node for next_node, _ in node.next_functions)
    return sorted(names)


def _measure_worker(rank: int, world_size: int, payload: tuple, queue) -> None:
    """One rank of the pipeline (of its data-parallel replica): build its stages, run the schedule,
    report its lowest peak."""
    from torch.distributed.pipelining import schedules

    spec, config, blocks_per_stage, plan, seed = payload
    pp_rank, group, dp_mesh = _pp_group(rank, config)
    stage_ids = stages_of_rank(pp_rank, config.pp, config.num_stages_per_rank, config.pp_schedule)
    pipe, inputs, block_paths = _traced_pipe(spec, config, blocks_per_stage, seed)
    stages = [pipe.build_stage(s, torch.device("cpu"), group=group) for s in stage_ids]
    for stage in stages:
        _no_warm_up_with_itself(stage)
    handles = []
    if plan is not None:
        loaded = load_plan(plan)
        for stage, s in zip(stages, stage_ids):
            handles.append(apply_plan(stage.submod.get_submodule("model"), loaded, stage=s))
    if dp_mesh is not None:
        for stage in stages:
            _shard_stage(stage.submod, block_paths, config, dp_mesh)
    cls = getattr(schedules, PP_SCHEDULES[config.pp_schedule])
    single = issubclass(cls, schedules.PipelineScheduleSingle)
    schedule = cls(stages[0] if single else stages, config.num_microbatches, loss_fn=_loss)
    num_stages = config.pp * config.num_stages_per_rank
    step_args = inputs if 0 in stage_ids else ()
    step_kwargs = {"target": torch.zeros(config.batch_size)} if num_stages - 1 in stage_ids else {}
    optimizer = make_optimizer([p for s in stages for p in s.submod.parameters()], config.optimizer)
    tracker = ShardedBytesTracker if dp_mesh is not None else LiveBytesTracker
    modules = [s.submod for s in stages]
    measured = measure_schedule(
        schedule, modules, stages, optimizer, step_args, step_kwargs, config, tracker_cls=tracker, handles=handles
    )
    queue.put((rank, measured))


def measure_pipeline_on_gloo_ranks(
    spec: str,
    config: TrainConfig,
    blocks_per_stage: tuple[int, ...],
    plan: dict | None = None,
    timeout_s: float = 600.0,
    seed: int = 0,
) -> list[ScheduleMeasurement]:
    """Peak live bytes and step seconds of every rank ([pp, dp] mesh) over steady-state pipeline
    steps, each a CPU process under gloo."""
    if get_precision(config.precision).autocast_dtype is not None:
        raise MemplanError(
            f"verify --pp runs fp32 or bf16 steps (torch's pipeline tracer fixes each op's dtype, which "
            f"autocast would change); use --precision fp32 or bf16 instead of {config.precision}"
        )
    if config.world_size != config.pp * config.dp or config.ep > 1:
        raise MemplanError(
            "verify --pp runs the pipeline with FSDP2 (--dp N --zero 3) or alone; drop --tp, --cp and --ep "
            "(verify those without --pp)"
        )
    if config.dp > 1 and config.zero_stage != 3:
        raise MemplanError(
            f"verify --pp --dp {config.dp} runs FSDP2 on the data-parallel ranks, as torchtitan shards a "
            "pipeline; add --zero 3"
        )
    functions = _custom_autograd_functions(spec, config, seed)
    if functions:
        raise MemplanError(
            f"the model runs custom autograd Functions ({', '.join(functions)}), which torch's pipeline tracer "
            "(torch.export) inlines into their forward's ops: the traced stages would save what those ops save, "
            "not what the Functions save, and measure another step than the one simulated; verify its stages "
            "with your own stage modules (docs/pipeline.md)"
        )
    payload = (spec, config, tuple(blocks_per_stage), plan, seed)
    measured = dict(run_on_gloo_ranks(_measure_worker, config.world_size, payload, timeout_s))
    return [measured[r] for r in range(config.world_size)]
