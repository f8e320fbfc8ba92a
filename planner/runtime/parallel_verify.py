"""Shard a real model as memplan's tensor- and expert-parallel simulation does, and measure one rank's step.

Run inside a process group of ``dp · cp · tp`` ranks (gloo on CPU). Order, as torchtitan composes
them: the TP plan and the EP plan (the same callables the fake-tensor trace applied), then a
memplan plan (checkpointing), then ``fully_shard`` per block and root on the ``dp`` (× ``cp``)
submesh with ``--zero 3`` (under expert parallel each experts module first, on the ``dp / ep``
ranks that hold the same experts). Under expert parallel the step routes tokens as the trace
assumed (planner/runtime/routing.py), so each rank receives the rows its prediction is for. With
``--cp`` every measured step runs inside torch's ``context_parallel`` with memplan's CPU route
into torch's ring attention (planner/tracing/parallel/context_parallel.py), as the trace does.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import queue as queue_module
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from costmodels.memory import get_precision
from memplan_compat import is_traceable_wrapper_subclass
from planner.config import TrainConfig
from planner.errors import MemplanError
from planner.plans.format import load_plan
from planner.runtime.apply import apply_plan
from planner.runtime.routing import assumed_routing
from planner.runtime.shard import ShardedBytesTracker, fsdp_kwargs, measure_sharded_step, shard_model
from planner.runtime.verify import Measurement
from planner.tracing.blocks import find_region_paths
from planner.tracing.hf import disable_kv_cache
from planner.tracing.parallel.context_parallel import context_parallel_step
from planner.tracing.parallel.ep_plans import expert_paths, expert_tp_replicas, resolve_ep_plan
from planner.tracing.parallel.rank_trace import ep_mesh
from planner.tracing.parallel.tp_plans import step_context, tp_plan_for
from planner.tracing.recorder import loss_of, run_step_inputs
from planner.tracing.specs import resolve_spec

__all__ = [
    "LocalBytesTracker",
    "build_parallel_model",
    "diverged_tp_replicas",
    "measure_on_gloo_ranks",
    "measure_parallel_step",
    "run_on_gloo_ranks",
]


class LocalBytesTracker(ShardedBytesTracker):
    """Live bytes of one rank, seen through DTensor: a DTensor op desugars into the local ops (and
    collectives) the rank runs before this tracker counts their outputs. A wrapper subclass
    (DTensor, the AsyncCollectiveTensor of a functional collective) owns no memory: its inner
    tensors are counted instead."""

    def track(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self.track(inner)
            return
        super().track(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented
        return super().__torch_dispatch__(func, types, args, kwargs)


def _mesh(config: TrainConfig) -> DeviceMesh:
    return init_device_mesh("cpu", (config.dp, config.cp, config.tp), mesh_dim_names=("dp", "cp", "tp"))


def build_parallel_model(
    spec: str, config: TrainConfig, plan=None, seed: int = 0, checkpoint: Callable | None = None
) -> tuple[nn.Module, object]:
    """(model, inputs) of this rank: built from `seed`, in the config's dtype, TP-sharded, with the
    plan applied (or ``checkpoint(model, inputs)`` called at that step: a live planner such as
    auto_checkpoint) and, with ``--zero 3``, fully sharded over the dp (× cp) submesh."""
    torch.manual_seed(seed)
    model, inputs = resolve_spec(spec).build(batch_size=config.batch_size, seq_len=config.seq_len)
    model.to(get_precision(config.precision).param_dtype)
    disable_kv_cache(model)
    units = find_region_paths(model, config.blocks)
    mesh = _mesh(config)
    if config.tp > 1:
        tp_plan_for(config)(model, mesh["tp"])
    experts = []
    if config.ep > 1:
        sparse = ep_mesh(config)
        resolve_ep_plan(config.ep_plan)(model, sparse)
        experts = expert_paths(model)
    if plan is not None:
        apply_plan(model, plan)
    if checkpoint is not None:
        checkpoint(model, inputs)
    if config.shard_ranks > 1 and config.zero_stage == 3:
        tp_replicas = expert_tp_replicas(model, config.tp)
        for path in experts:  # torchtitan: the experts over the dp / ep ranks holding the same ones, first
            shard_experts(model.get_submodule(path), sparse, tp_replicas, config)
        shard_model(model, units, config, mesh=_shard_mesh(mesh, config))
    return model, inputs


def shard_experts(experts: nn.Module, mesh: DeviceMesh, tp_replicas: int, config: TrainConfig) -> None:
    """``fully_shard`` an experts module over the ranks of the ``[edp, ep, tp]`` mesh holding the same
    experts: ``edp``, and ``tp`` too where each TP rank keeps them whole (`tp_replicas` > 1). Those TP
    ranks ran disjoint slices of one batch, so their gradients are summed, not averaged: the divide
    factor stays the data-parallel one (edp), applied after a summing reduce-scatter (gloo has no
    pre-multiplied sum)."""
    if tp_replicas == 1:
        fully_shard(experts, mesh=mesh["edp"], **fsdp_kwargs(config))
        return
    fully_shard(experts, mesh=mesh["edp", "tp"]._flatten("edp_tp"), **fsdp_kwargs(config))
    experts.set_gradient_divide_factor(float(mesh["edp"].size()))
    experts.set_force_sum_reduction_for_comms(True)


def _shard_mesh(mesh: DeviceMesh, config: TrainConfig) -> DeviceMesh:
    """FSDP2's mesh: dp, or dp × cp flattened under context parallel (torchtitan's ``dp_shard_cp``)."""
    return mesh["dp"] if config.cp == 1 else mesh["dp", "cp"]._flatten("dp_shard_cp")


def measure_parallel_step(model: nn.Module, inputs, config: TrainConfig) -> Measurement:
    """This rank's peak live bytes over a steady-state step (after a warm-up; the lowest of a few),
    routed as the trace assumes under expert parallel."""
    with assumed_routing(config.moe_imbalance) if config.ep > 1 else nullcontext():
        return measure_sharded_step(model, inputs, config, tracker=LocalBytesTracker)


def _context_parallel(config: TrainConfig, inputs):
    """The steps inside torch's context_parallel over the cp submesh (nothing when cp is 1)."""
    if config.cp == 1:
        return nullcontext()
    return context_parallel_step(_mesh(config)["cp"], inputs, config.seq_len, config.cp_rotate)


def _measure_worker(rank: int, world_size: int, payload: tuple, queue) -> None:
    """One gloo rank of :func:`measure_on_gloo_ranks`: build, shard, measure, check the replicas, report."""
    spec, config, plan = payload
    plan = load_plan(plan) if plan is not None else None
    model, inputs = build_parallel_model(spec, config, plan)
    with _context_parallel(config, inputs):
        peak = measure_parallel_step(model, inputs, config).peak_bytes
        diverged = diverged_tp_replicas(model, inputs, config) if config.tp > 1 and config.ep == 1 else []
    queue.put((rank, peak, diverged))


def _replicated_over_tp(param: torch.Tensor) -> bool:
    """Whether every tensor-parallel rank holds the same values of `param` (a plain tensor, or a
    DTensor replicated over the "tp" mesh dimension or without one)."""
    if not isinstance(param, DTensor):
        return True
    names = param.device_mesh.mesh_dim_names or ()
    return "tp" not in names or param.placements[names.index("tp")].is_replicate()


def diverged_tp_replicas(model: nn.Module, inputs, config: TrainConfig) -> list[str]:
    """The parameters every tensor-parallel rank holds alike whose gradients differ across the ranks
    after one more forward and backward: the plan does not sum them over the ranks (it leaves a
    parameter inside a sharded region replicated: a learnable activation, a norm over the rank's
    heads), so training would drift the replicas apart. The gradients are cleared again."""
    group = _mesh(config)["tp"].get_group()
    with step_context(config):
        loss_of(run_step_inputs(model, inputs)).backward()
    diverged = []
    for name, param in model.named_parameters():
        if param.grad is None or not _replicated_over_tp(param):
            continue
        grad = param.grad
        if isinstance(grad, DTensor):  # a partial sum, where DTensor defers the reduction, reduced
            grad = grad.redistribute(placements=param.placements).to_local()
        highest, lowest = grad.detach().float().clone(), grad.detach().float().clone()
        dist.all_reduce(highest, dist.ReduceOp.MAX, group=group)
        dist.all_reduce(lowest, dist.ReduceOp.MIN, group=group)
        if not torch.equal(highest, lowest):
            diverged.append(name)
    model.zero_grad(set_to_none=True)
    return diverged


_FAILED = "rank failed"  # the first item of what a rank puts on the queue when it raised


def _guarded(worker, rank: int, world_size: int, init_file: str, payload, queue) -> None:
    """Run one rank: join the gloo group, run ``worker(rank, world_size, payload, queue)`` on one
    thread, wait for every rank to finish (no rank leaves while a peer still talks to it). An
    exception goes to the parent as one line (the first rank's is reported); a native crash (a
    signal) prints every thread's Python stack to the rank's stderr; the process ends before the
    interpreter tears down (:func:`_exit_before_teardown`)."""
    faulthandler.enable(all_threads=True)
    atexit.register(_exit_before_teardown)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        worker(rank, world_size, payload, queue)
        dist.barrier()
    except Exception as exc:
        while exc.__cause__ is not None:  # torch's wrappers ("[Stage 1] failed to run forward") chain the cause
            exc = exc.__cause__
        queue.put((_FAILED, rank, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"))


def _exit_before_teardown() -> None:
    """The rank process's last exit handler (registered first), after multiprocessing has sent the
    queue's items: end the process without tearing down its process groups or the interpreter. A
    device mesh keeps its groups alive past ``destroy_process_group``, and the interpreter's
    teardown destroys them while gloo's threads still hold tensors, which now and then aborts the
    process ("terminate called without an active exception", heap corruption;
    pytorch/pytorch#179291). The operating system closes its sockets."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_reason(proc) -> str:
    """'died of SIGABRT' or 'exited with code 3' for a finished process."""
    code = proc.exitcode
    return f"died of {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def _killed_peers(procs, wait_s: float = 5.0) -> str:
    """'; first gloo rank 0 died of SIGABRT ...' when a rank process was killed by a signal (a native
    crash, which its peers see only as a lost connection), waiting up to `wait_s` for it; else ''."""
    deadline = time.monotonic() + wait_s
    while True:
        killed = [r for r, p in enumerate(procs) if p.exitcode is not None and p.exitcode < 0]
        if killed:
            return f"; first gloo rank {killed[0]} {_exit_reason(procs[killed[0]])} (its stderr has the stack)"
        if all(p.exitcode is not None for p in procs) or time.monotonic() > deadline:
            return ""
        time.sleep(0.1)


def run_on_gloo_ranks(worker, world_size: int, payload, timeout_s: float = 600.0) -> list:
    """Start `world_size` CPU processes (spawn), each running ``worker(rank, world_size, payload,
    queue)`` in a gloo group of them all; every item they put on the queue, in arrival order.
    A rank that raises is a MemplanError with its message; one that dies, or no item within
    `timeout_s`, is a RuntimeError; no process is left running."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as workdir:
        init_file = os.path.join(workdir, "gloo-init")
        procs = [
            ctx.Process(target=_guarded, args=(worker, r, world_size, init_file, payload, queue))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        items, waited_s = [], 0.0
        try:
            while any(p.is_alive() for p in procs) or not queue.empty():
                try:
                    item = queue.get(timeout=1)
                    waited_s = 0.0
                    if item[0] == _FAILED:
                        raise MemplanError(f"gloo rank {item[1]} failed: {item[2]}{_killed_peers(procs)}")
                    items.append(item)
                except queue_module.Empty:
                    waited_s += 1
                    failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if failed:
                        raise RuntimeError(f"gloo rank {failed[0]} {_exit_reason(procs[failed[0]])}") from None
                    if waited_s >= timeout_s:
                        raise RuntimeError(f"gloo rank processes gave no result within {timeout_s:.0f} s") from None
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return items


def measure_on_gloo_ranks(
    spec: str, config: TrainConfig, plan: dict | None = None, timeout_s: float = 600.0
) -> tuple[list[int], list[str]]:
    """(peak live bytes of every global rank over a steady-state step, the parameters that diverged
    over the tensor-parallel ranks: :func:`diverged_tp_replicas`), each rank a CPU process under gloo."""
    items = run_on_gloo_ranks(_measure_worker, config.world_size, (spec, config, plan), timeout_s)
    peaks = {rank: peak for rank, peak, _ in items}
    diverged = sorted({name for _, _, names in items for name in names})
    return [peaks[r] for r in range(config.world_size)], diverged
