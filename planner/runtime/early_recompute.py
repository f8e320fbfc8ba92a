"""Recompute a checkpointed module before its backward: in a pipeline stage's wait for a gradient.

torch's checkpoint recomputes when the backward first reads a saved tensor, once per backward
call, so a recompute cannot be moved ahead of it. :class:`EarlyCheckpoint` saves what torch's
non-reentrant checkpoint saves (the inputs; every tensor autograd saves inside is dropped and made
again by running the forward once more, on the same random state and autocast settings) and
recomputes either when :meth:`EarlyCheckpoint.recompute` is called or, if it was not, when the
backward first needs a tensor. Each recomputed tensor is dropped once the backward has read it,
and the recompute stops at the last tensor autograd saves, as torch's does. Under a split backward
(zero-bubble schedules: I computes the input gradients, then W calls autograd once per weight
group) the same tensor is read in I and again in W, and torch's checkpoint would recompute in every
one of those calls; with ``read_once=False`` the recompute runs once, in I, and what it made is held
until autograd frees the stage's graph at the end of W.

:func:`recompute_in_bubbles` calls it where memplan's pipeline plans put it
(:mod:`planner.simulation.pipeline_early`): a stage that waits for a microbatch's gradient first
recomputes the modules its plan runs early (``StagePlan.early_recompute``) for that microbatch.
It follows torch's schedule loops, which post the gradient's receive and wait on it right before
the backward (``schedules._wait_batch_p2p``): the recompute runs just before that wait. GPipe
and 1F1B ask their stage for the receive there (``get_bwd_recv_ops``); the multi-stage runtime
(interleaved 1F1B, looped BFS, and before I or a whole B the zero-bubble schedules and DualPipeV)
takes the receive it posted earlier out of ``bwd_recv_ops``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states

from planner.errors import MemplanError

if TYPE_CHECKING:
    from planner.runtime.apply import PlanHandle

__all__ = ["EarlyCheckpoint", "EarlyQueue", "recompute_in_bubbles"]

_AUTOCAST_DEVICES = ("cpu", "cuda")


class _Stop(Exception):
    """Raised inside a recompute once it has made every tensor the backward reads."""


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        out = value.detach()
        out.requires_grad_(value.requires_grad)
        return out
    return value


class EarlyCheckpoint:
    """One checkpointed call of `fn(*args, **kwargs)` whose recompute may run before its backward."""

    def __init__(
        self, module: nn.Module, fn: Callable[..., Any], args: tuple, kwargs: dict, read_once: bool = True
    ) -> None:
        self.module = module
        self._read_once = read_once  # False: held until the graph is freed (a split backward reads twice)
        self._fn = fn
        self._args = tuple(_detached(a) for a in args)
        self._kwargs = {k: _detached(v) for k, v in kwargs.items()}
        self._cpu_rng = torch.get_rng_state()
        self._devices, self._device_rng = get_device_states(*args, *kwargs.values())
        self._autocast = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES}
        self._count = 0  # tensors autograd saved in the forward
        self._saved: list[torch.Tensor | None] | None = None

    def forward(self, args: tuple, kwargs: dict) -> Any:
        """Run the forward on `args` (the ones this checkpoint was made with), keeping none of the
        tensors autograd saves (they are recomputed)."""

        def pack(t: torch.Tensor) -> int:
            self._count += 1
            return self._count - 1

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            return self._fn(*args, **kwargs)

    @property
    def recomputed(self) -> bool:
        return self._saved is not None

    def recompute(self) -> None:
        """Make again every tensor the forward saved (no-op once done); FSDP2 units inside are
        unsharded first, as their pre-backward would."""
        if self._saved is not None:
            return
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.unshard()
        saved: list[torch.Tensor | None] = []

        def pack(t: torch.Tensor) -> None:
            # detached, as torch's checkpoint keeps them: the recompute's own graph (whose nodes hold
            # this hook, and through it `saved`) must not be reachable from what is kept
            saved.append(t.detach() if t.requires_grad else t)
            if len(saved) == self._count:
                raise _Stop

        def never(_: None) -> torch.Tensor:
            raise MemplanError("a recompute's own saved tensors are never read")

        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=self._devices))
            torch.set_rng_state(self._cpu_rng)
            if self._devices:
                set_device_states(self._devices, self._device_rng)
            for device, (enabled, dtype) in self._autocast.items():
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, never))
            try:
                if self._count:
                    self._fn(*self._args, **self._kwargs)
            except _Stop:
                pass
        if len(saved) != self._count:
            raise MemplanError(
                f"recomputing {type(self.module).__name__} saved {len(saved)} tensors where its forward saved "
                f"{self._count}: the module runs different ops the second time; keep it (do not recompute it)"
            )
        self._saved = saved

    def _unpack(self, index: int) -> torch.Tensor:
        self.recompute()
        assert self._saved is not None
        t = self._saved[index]
        if t is None:
            raise MemplanError("a recomputed tensor was read twice; run the backward once per forward")
        if self._read_once:
            self._saved[index] = None  # the backward holds it from here on
        return t


class EarlyQueue:
    """A stage module's early checkpoints, grouped by forward call (a module met again starts the
    next call's group), oldest first."""

    def __init__(self) -> None:
        self._groups: deque[dict[str, weakref.ref[EarlyCheckpoint]]] = deque()

    def add(self, path: str, call: EarlyCheckpoint) -> None:
        if not self._groups or path in self._groups[-1]:
            self._groups.append({})
        self._groups[-1][path] = weakref.ref(call)

    def recompute_oldest(self) -> int:
        """Recompute the oldest forward's checkpoints that are still to be recomputed (those whose
        backward ran, or whose graph is gone, are passed over); returns how many ran."""
        while self._groups:
            calls = [c for ref in self._groups.popleft().values() if (c := ref()) is not None and not c.recomputed]
            if calls:
                for c in calls:
                    c.recompute()
                return len(calls)
        return 0


class _ArmingRecvs(dict):
    """A multi-stage schedule's posted gradient receives: taking one out for (stage, microbatch)'s
    backward arms that stage's early queues for the wait that follows."""

    def __init__(self, posted: dict, queues: dict[int, list[EarlyQueue]], armed: list) -> None:
        super().__init__(posted)
        self._queues, self._armed = queues, armed

    def pop(self, key, *default):
        self._armed.extend(self._queues.get(key[0], ()))
        return super().pop(key, *default)


def _holds(stage_module: nn.Module, model: nn.Module) -> bool:
    return model is stage_module or any(m is model for m in stage_module.modules())


@contextlib.contextmanager
def recompute_in_bubbles(schedule: Any, handles: Sequence[PlanHandle]) -> Iterator[None]:
    """While `schedule` steps, each of this rank's stages recomputes its plan's early modules (the
    handles of :func:`planner.runtime.apply.apply_plan` on its stage modules) for each microbatch
    while it waits for that microbatch's gradient: torch's GPipe and 1F1B, and every schedule of
    its multi-stage runtime (before B, or before I where the backward is split)."""
    from torch.distributed.pipelining import schedules

    planned = [h for h in handles if h.early_queue is not None]
    multi = isinstance(schedule, schedules._PipelineScheduleRuntime)
    if not planned or not (multi or isinstance(schedule, schedules.PipelineScheduleSingle)):
        yield
        return
    if not callable(getattr(schedules, "_wait_batch_p2p", None)):
        raise MemplanError(
            "this torch's pipeline schedules have no _wait_batch_p2p to recompute in front of; apply the stage plans "
            "without recompute_in_bubbles (their modules recompute in backward)"
        )
    armed: list[EarlyQueue] = []
    wait = schedules._wait_batch_p2p

    def wait_batch_p2p(work: list) -> None:
        if armed:  # the gradient's receive is posted: recompute, then wait for it
            queues = list(armed)
            armed.clear()
            for q in queues:
                q.recompute_oldest()
        wait(work)

    if multi:
        queues = {
            stage.stage_index: [h.early_queue for h in planned if _holds(stage.submod, h.model)]
            for stage in schedule._stages
        }
        if not any(queues.values()):
            raise MemplanError(
                "none of these plan handles is on one of the schedule's stage modules; apply each stage's plan to its "
                "stage module (the submod given to PipelineStage)"
            )
        posted = schedule.bwd_recv_ops
        schedule.bwd_recv_ops = _ArmingRecvs(posted, queues, armed)
    else:
        stage = schedule._stage
        get_recv = stage.get_bwd_recv_ops

        def get_bwd_recv_ops(bwd_chunk_id: int) -> list:
            ops = get_recv(bwd_chunk_id)
            if ops:  # the last stage receives no gradient: it has no wait to fill
                armed.extend(h.early_queue for h in planned)
            return ops

        stage.get_bwd_recv_ops = get_bwd_recv_ops
    schedules._wait_batch_p2p = wait_batch_p2p
    try:
        yield
    finally:
        schedules._wait_batch_p2p = wait
        if multi:
            schedule.bwd_recv_ops = dict(schedule.bwd_recv_ops)
        else:
            del stage.get_bwd_recv_ops
