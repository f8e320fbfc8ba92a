"""Each rank's ordered actions under a ``torch.distributed.pipelining`` schedule, built by torch.

No ranks and no process group: the schedule class is constructed with stand-in stages that
carry only the indices a schedule reads. Multi-stage schedules lower their order themselves
(``pipeline_order_with_comms``, what their runtime executes; it waits on every send at the
step's end). Single-stage schedules (GPipe, 1F1B) run their own loop, so their
``_step_microbatches`` runs once per stage with a stage that records each call instead of
computing, and with send requests that record when the loop lets go of them: a tensor sent
(a stage's output, an input's gradient) lives until then, which the loop decides, not the order.
A schedule torch adds later needs no code here, only its name in ``planner.config.PP_SCHEDULES``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import lru_cache
from unittest import mock

from planner.config import PP_SCHEDULES, V_SHAPED_SCHEDULES, TrainConfig
from planner.errors import MemplanError

__all__ = ["INPUT_GRADIENT_KINDS", "PipelineAction", "PipelineSchedule", "pipeline_schedule", "stages_of_rank"]

COMPUTE_KINDS = ("F", "B", "I", "W")
INPUT_GRADIENT_KINDS = ("B", "I")  # the backwards that make a stage's input gradient, from the next stage's


@dataclass(frozen=True)
class PipelineAction:
    """One step of a rank: ``kind`` is torch's computation type (F, B, I, W, SEND_F, RECV_F, SEND_B,
    RECV_B, UNSHARD, RESHARD, REDUCE_GRAD); ``microbatch`` is None for per-stage actions."""

    stage: int
    kind: str
    microbatch: int | None = None

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{'' if self.microbatch is None else self.microbatch}"


@dataclass(frozen=True)
class PipelineSchedule:
    """A schedule's actions per pipeline rank, in the order each rank runs them."""

    name: str
    pp: int
    num_stages: int
    microbatches: int
    actions: tuple[tuple[PipelineAction, ...], ...]
    # per rank: (stage, "F" output or "B" input gradient, microbatch) -> index in compute(rank) of
    # the action after which the schedule drops that send's request; absent: held to the step's end
    send_release: tuple[dict[tuple[int, str, int], int], ...] = field(default=(), compare=False)
    _compute: dict[int, tuple[PipelineAction, ...]] = field(default_factory=dict, compare=False, repr=False)

    def released_after(self, rank: int, stage: int, kind: str, microbatch: int) -> int:
        """Index in compute(rank) after which a send's request is dropped (the last: the step's end)."""
        default = len(self.compute(rank)) - 1
        return self.send_release[rank].get((stage, kind, microbatch), default) if self.send_release else default

    def output_released_after(self, rank: int, stage: int, microbatch: int) -> int | None:
        """Index in compute(rank) of the action after which a single-stage schedule's loop drops a
        forward's output (it keeps the last in a local until the next forward returns); None where
        the runtime drops it with the action (multi-stage schedules)."""
        return self.send_release[rank].get((stage, "O", microbatch)) if self.send_release else None

    def stages(self, rank: int) -> tuple[int, ...]:
        """The stage indices rank `rank` computes, ascending."""
        return tuple(sorted({a.stage for a in self.actions[rank] if a.kind in COMPUTE_KINDS}))

    @property
    def split_stages(self) -> frozenset[int]:
        """Stages past the first whose backward runs as I (input gradients) then W (weight
        gradients). torch's W calls backward once per weight group, and its checkpoint recomputes
        once per call (measured: W peaks 3.5x higher on a checkpointed Llama layer), so a stage plan
        recomputes there with memplan's checkpoint, once in I, holding what it made until W ends
        (StagePlan.split_backward); stage 0's backward is one call (its I does nothing, W is the
        whole backward)."""
        return frozenset(a.stage for r in range(self.pp) for a in self.compute(r) if a.kind == "I" and a.stage > 0)

    def recompute_runs(self, stage: int) -> int:
        """Times one step runs a recompute inside `stage`: once per backward, in B, or under a split
        backward in I (stage 0: in W, its whole backward)."""
        kinds = ("B", "W") if stage == 0 else INPUT_GRADIENT_KINDS
        return sum(a.kind in kinds for r in range(self.pp) for a in self.compute(r) if a.stage == stage)

    def compute(self, rank: int) -> tuple[PipelineAction, ...]:
        """Rank `rank`'s forward and backward actions only (computed once per rank)."""
        if rank not in self._compute:
            self._compute[rank] = tuple(a for a in self.actions[rank] if a.kind in COMPUTE_KINDS)
        return self._compute[rank]

    def to_dict(self) -> dict:
        return {
            "schedule": self.name,
            "pp": self.pp,
            "num_stages": self.num_stages,
            "microbatches": self.microbatches,
            "actions": [[str(a) for a in acts] for acts in self.actions],
        }


def stages_of_rank(rank: int, pp: int, stages_per_rank: int, schedule: str) -> tuple[int, ...]:
    """Stage indices of a rank: r, r+pp, ... (loop style) or r and 2·pp−1−r (V-shaped schedules)."""
    if schedule in V_SHAPED_SCHEDULES:
        return (rank, 2 * pp - 1 - rank)
    return tuple(rank + k * pp for k in range(stages_per_rank))


class _StandInStage:
    """What a schedule reads of a stage; records the calls a single-stage schedule's loop makes."""

    def __init__(self, stage_index: int, num_stages: int, pp: int, rank: int) -> None:
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group_size = pp
        self.group_rank = rank
        self.submod = None
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.has_backward = True
        self.output_chunks: list = []
        self.stage_index_to_group_rank: dict[int, int] = {}
        self.calls: list[PipelineAction] = []
        self.released: dict[tuple[int, str, int], int] = {}

    def _record(self, kind: str, mb: int | None = None) -> None:
        self.calls.append(PipelineAction(self.stage_index, kind, mb))

    def _send(self, kind: str, mb: int) -> list[_Held]:
        """A send request; when the schedule drops it, the compute actions run so far say where."""
        self._record(f"SEND_{kind}", mb)
        send = _Held()
        weakref.finalize(send, self._release, kind, mb)
        return [send]

    def _release(self, kind: str, mb: int) -> None:
        computed = sum(1 for a in self.calls if a.kind in COMPUTE_KINDS)
        self.released[(self.stage_index, kind, mb)] = computed - 1

    def clear_runtime_states(self) -> None:
        pass

    def get_fwd_recv_ops(self, mb: int) -> list:
        if not self.is_first:
            self._record("RECV_F", mb)
        return []

    def get_fwd_send_ops(self, mb: int) -> list:
        return [] if self.is_last else self._send("F", mb)

    def get_bwd_recv_ops(self, mb: int) -> list:
        if not self.is_last:
            self._record("RECV_B", mb)
        return []

    def get_bwd_send_ops(self, mb: int) -> list:
        return [] if self.is_first else self._send("B", mb)

    def forward_one_chunk(self, mb: int, *args, **kwargs) -> _Held:
        """Records the forward; its output, when the loop drops it, says where (kind "O")."""
        self._record("F", mb)
        output = _Held()
        weakref.finalize(output, self._release, "O", mb)
        return output

    def backward_one_chunk(self, mb: int, loss=None, full_backward: bool = True, last_backward: bool = False) -> None:
        self._record("B" if full_backward else "I", mb)

    def backward_weight_one_chunk(self, mb: int, last_backward: bool = False) -> None:
        self._record("W", mb)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        self._record("REDUCE_GRAD")

    def scale_grads(self, grad_scale_factor: int) -> None:
        pass


class _Held:
    """What a schedule's loop holds, then drops: a stand-in send request (what ``P2POp`` is to a
    schedule) or a forward's output."""

    peer = 0


class _Work:
    def __init__(self, ops: list) -> None:
        self.ops = ops

    def wait(self) -> None:
        pass


def _fake_batch_p2p(ops: list, desc: str | None = None) -> list[_Work]:
    return [_Work(list(ops))] if ops else []


def _fake_sorted_batch_p2p(ops: list, desc: str | None = None) -> dict[int, list[_Work]]:
    return {0: _fake_batch_p2p(ops)} if ops else {}


def _flatten(action) -> list[PipelineAction]:
    """torch's _Action as ours; an overlapped forward-backward (DualPipeV) runs its parts in order."""
    if action.sub_actions:
        return [p for sub in action.sub_actions for p in _flatten(sub)]
    return [PipelineAction(action.stage_index, action.computation_type.value, action.microbatch_index)]


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


@lru_cache(maxsize=64)
def _build(name: str, pp: int, stages_per_rank: int, microbatches: int) -> PipelineSchedule:
    from torch.distributed.pipelining import schedules  # noqa: PLC0415 (heavy, and only for pipelines)

    cls = getattr(schedules, PP_SCHEDULES[name])
    num_stages = pp * stages_per_rank
    prefix = f"--pp-schedule {name} with --pp {pp}, --stages-per-rank {stages_per_rank}, --microbatches {microbatches}"
    try:
        if issubclass(cls, schedules.PipelineScheduleSingle):
            if stages_per_rank != 1:
                raise MemplanError(f"{prefix}: this schedule runs one stage per rank; use --stages-per-rank 1")
            per_rank, releases = [], []
            for rank in range(pp):
                stage = _StandInStage(rank, num_stages, pp, rank)
                sched = cls(stage, microbatches)
                # stages count as initialized (no metadata exchange); without a loss_fn torch
                # skips the loss, not the order
                sched._stage_forward_initialized = True
                sched._stage_backward_initialized = sched._has_backward
                with (
                    mock.patch.object(schedules, "_batch_p2p", _fake_batch_p2p),
                    mock.patch.object(schedules, "_sorted_batch_p2p", _fake_sorted_batch_p2p),
                ):
                    sched._step_microbatches()
                del sched
                per_rank.append(tuple(stage.calls))
                releases.append(dict(stage.released))
        else:
            stages = [_StandInStage(i, num_stages, pp, 0) for i in stages_of_rank(0, pp, stages_per_rank, name)]
            sched = cls(stages, microbatches)
            order = sched.pipeline_order_with_comms
            per_rank = [tuple(p for a in order[r] if a is not None for p in _flatten(a)) for r in range(pp)]
            releases = []  # the runtime waits on every send at the step's end
    except MemplanError:
        raise
    except (ValueError, RuntimeError, AssertionError, KeyError, IndexError) as exc:
        raise MemplanError(f"{prefix}: torch refuses it: {_one_line(exc)}") from exc
    schedule = PipelineSchedule(name, pp, num_stages, microbatches, tuple(per_rank), tuple(releases))
    for rank in range(pp):
        want = stages_of_rank(rank, pp, stages_per_rank, name)
        if schedule.stages(rank) != tuple(sorted(want)):
            raise MemplanError(f"{prefix}: torch places stages {schedule.stages(rank)} on rank {rank}, not {want}")
    return schedule


def pipeline_schedule(config: TrainConfig) -> PipelineSchedule:
    """The config's schedule, as torch orders it (a one-line error where torch refuses the shape)."""
    if config.pp < 2:
        raise MemplanError("a pipeline schedule needs --pp N with N > 1")
    return _build(config.pp_schedule, config.pp, config.num_stages_per_rank, config.num_microbatches)
