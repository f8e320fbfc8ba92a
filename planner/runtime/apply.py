"""Apply a memory plan to a real model: checkpoint, selectively checkpoint or offload modules.

`apply_plan` replaces the `forward` of every module a plan names with a wrapper (an instance
attribute) that runs the original forward under `torch.utils.checkpoint` (recompute) or under
saved-tensor hooks that move what autograd saves to host memory or disk (offload). The returned
:class:`PlanHandle` restores the model. A :class:`PlanLadder` installs wrappers for every module
any bucket names; a forward pre-hook on the root picks the bucket from the batch's sequence length
and each wrapper decides at call time, so a checkpoint's recompute reuses the forward's choice.
A recompute reads the buffers its forward read and leaves them as the forward left them
(:class:`ForwardBuffers`): BatchNorm's running statistics are updated once per step, as without a plan.
"""

from __future__ import annotations

import functools
import itertools
import shutil
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    SAC_IGNORED_OPS,
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from memplan_compat import is_fake, tree_leaves
from planner.errors import PlanFileError
from planner.plans.decisions import ModulePlan, OpKeys, module_plans
from planner.plans.format import CompiledPlan, Plan, PlanLadder, StagePlans, load_plan
from planner.plans.identity import check_plan_matches
from planner.runtime import cleanup
from planner.runtime.early_recompute import EarlyCheckpoint, EarlyQueue
from planner.runtime.offload import (
    SPILL_PREFIX,
    Spilled,
    pack_to_host,
    spillable,
    storage_ptrs,
    unpack_from_host,
)
from planner.tracing.blocks import parse_segment, runs_forward
from planner.tracing.hf import disable_kv_cache

if TYPE_CHECKING:
    from planner.runtime.compiled import CompiledBlocks

__all__ = ["ForwardBuffers", "ModulePlan", "PlanHandle", "apply_plan", "returns_tensor", "batch_seq_len"]


@functools.cache
def returns_tensor(func: Any) -> bool:
    """Whether an op overload's schema returns at least one Tensor (how memplan's trace names ops)."""
    return any("Tensor" in str(r.type) for r in func._schema.returns)


@functools.cache
def _op_name(func: Any) -> str:
    return str(func)


# ---------------------------------------------------------------- selective checkpointing


class _KeepPolicy:
    """SAC policy: MUST_SAVE for the kept `op#k` occurrences; counters start at 0 for each pass."""

    def __init__(self, keep_ops: frozenset[str]) -> None:
        self.keep_ops = keep_ops
        self.keys = {False: OpKeys(), True: OpKeys()}  # forward, recompute

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if not returns_tensor(func):
            return CheckpointPolicy.PREFER_RECOMPUTE
        key = self.keys[bool(ctx.is_recompute)].next_key(_op_name(func))
        return CheckpointPolicy.MUST_SAVE if key in self.keep_ops else CheckpointPolicy.PREFER_RECOMPUTE


def _skip_profiler_ranges() -> None:
    """FSDP2's hooks open profiler ranges (``record_function``) a different number of times in a
    checkpointed region's forward and in its recompute (a ``fully_shard`` unit nested in the region,
    e.g. the experts of an expert-parallel block under FSDP2), and torch 2.13's selective
    checkpointing counts every op of both and refuses a mismatch. Those ranges compute nothing:
    selective checkpointing skips them as it skips ``detach`` (torch's SAC_IGNORED_OPS)."""
    profiler = torch.ops.profiler
    SAC_IGNORED_OPS.update(
        {
            profiler._record_function_enter.default,
            profiler._record_function_enter_new.default,
            profiler._record_function_exit.default,
            profiler._record_function_exit._RecordFunction,
        }
    )


def selective_context_fn(keep_ops: frozenset[str]) -> Callable[[], tuple[Any, Any]]:
    """A checkpoint `context_fn` that builds a fresh policy (fresh counters) per checkpoint call."""
    _skip_profiler_ranges()

    def context_fn() -> tuple[Any, Any]:
        return create_selective_checkpoint_contexts(_KeepPolicy(keep_ops))

    return context_fn


# ---------------------------------------------------------------- offload


# ---------------------------------------------------------------- buffers written in forward

BufferSlot = tuple[nn.Module, str]  # (owner, name in owner._buffers)


def buffer_slots(modules: Iterable[nn.Module]) -> list[BufferSlot]:
    """Every buffer slot of `modules` and their submodules, each once."""
    owners = {id(sub): sub for m in modules for sub in m.modules()}
    return [(owner, name) for owner in owners.values() for name in owner._buffers]


class ForwardBuffers:
    """The buffers one checkpointed call writes in its forward, in place or by rebinding (BatchNorm's
    running statistics and batch counter, step counters, caches), and their state before it.

    Made just before the forward, outside the checkpoint (no op lands in a selective policy's
    count), it copies the slots in `known` (those an earlier call of the module in the same
    train/eval modes wrote; None: all, and the forward's writes are then also found by value,
    since BatchNorm's kernel writes its running statistics without bumping their version). After
    the forward, the written slots are `known` and any whose version or tensor changed. :meth:`wrap`
    runs each recompute on their pre-forward state and rebinds the forward's results after, so a
    step leaves every buffer as it would without a plan. A slot first written on a later call (so
    not copied) replays on its post-forward state, exact for BatchNorm, whose training output uses
    the batch's statistics; a second recompute of one forward reads what the first left.
    """

    def __init__(self, slots: list[BufferSlot], known: frozenset[int] | None) -> None:
        self.slots = slots
        self._known = known
        self._before = [owner._buffers[name] for owner, name in slots]
        self._versions = [None if t is None else t._version for t in self._before]
        with torch.no_grad():
            self._copies = {
                i: t.detach().clone()
                for i, t in enumerate(self._before)
                if t is not None and (known is None or i in known)
            }
        self._replay_state: dict[int, torch.Tensor | None] = {}
        self._calls = 0

    def _written_in_place(self, i: int, before: torch.Tensor) -> bool:
        if before._version != self._versions[i]:
            return True
        if self._known is not None:
            return i in self._known
        copy = self._copies[i]
        return not is_fake(copy) and copy.device.type != "meta" and not torch.equal(copy, before)

    def written(self) -> frozenset[int]:
        """After the forward: the slots it wrote. Keeps their pre-forward state for the recompute
        and drops the other copies."""
        for i, ((owner, name), before) in enumerate(zip(self.slots, self._before)):
            if before is not None and self._written_in_place(i, before):
                copy = self._copies.get(i)
                with torch.no_grad():
                    self._replay_state[i] = before.detach().clone() if copy is None else copy
            elif owner._buffers.get(name) is not before:
                self._replay_state[i] = before  # rebound: the old tensor is the pre-forward state
        self._before, self._copies = [], {}
        return frozenset(self._replay_state)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` for torch.utils.checkpoint: its first call is the forward, later ones recompute."""

        def run(*args: Any, **kwargs: Any) -> Any:
            self._calls += 1
            if self._calls == 1 or not self._replay_state:
                return fn(*args, **kwargs)
            after = {i: self.slots[i][0]._buffers[self.slots[i][1]] for i in self._replay_state}
            for i, state in self._replay_state.items():
                owner, name = self.slots[i]
                owner._buffers[name] = state
            try:
                return fn(*args, **kwargs)
            finally:  # also when torch stops the recompute early
                for i, state in after.items():
                    owner, name = self.slots[i]
                    owner._buffers[name] = state

        return run


# ---------------------------------------------------------------- sequence length


def batch_seq_len(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """Size of dim 1 of the first tensor input (positional, then keyword) with at least 2 dims."""
    for t in tree_leaves((list(args), list(kwargs.values()))):
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[1])
    raise ValueError(
        "cannot read the batch's sequence length for the plan ladder: pass a tensor "
        "with at least 2 dims (batch, seq, ...) to the model"
    )


# ---------------------------------------------------------------- the handle


class PlanHandle:
    """The applied plan: restores the model on remove() (idempotent); a context manager."""

    def __init__(
        self,
        model: nn.Module,
        plans: Mapping[int, Plan],
        ladder: PlanLadder | None,
        spill_dir: str | Path | None,
        early: frozenset[str] = frozenset(),
        split_backward: bool = False,
    ) -> None:
        self.model = model
        self._early = early  # recomputed ahead of their backward (planner.runtime.early_recompute)
        # a pipeline stage whose backward runs as I then W: recompute once, in I, held until W
        self._split_backward = split_backward
        self.early_queue: EarlyQueue | None = EarlyQueue() if early else None
        self.ladder = ladder
        self._by_bucket = {s: module_plans(p.decisions) for s, p in plans.items()}
        first = next(iter(plans))
        # the identity the plans were checked against: fully_shard may wrap the model afterwards
        # (torchtitan's order), which changes its fingerprint, not the model a plan is for
        self._model_identity = plans[first].model
        self.active_bucket: int | None = first if ladder is None else None
        self.active_seq_len: int | None = None
        self._active: dict[str, ModulePlan] = self._by_bucket[first] if ladder is None else {}
        self._originals: dict[str, tuple[nn.Module, Any]] = {}  # path -> (module, own forward or None)
        self._hooks: list[Any] = []
        self._removed = False
        self._restore_use_cache: list[tuple[object, bool]] | None = None  # HF configs, use_cache before
        self._stream: Any = None
        self._spill_ids = itertools.count()
        self._segments: dict[str, list[tuple[int, int, str]]] = {}  # flat Sequential -> wrapped segments
        self._buffer_slots: dict[str, list[BufferSlot]] = {}  # wrapped path -> its buffers
        # (path, its buffer owners' training flags) -> buffer slots its forwards wrote so far
        self._written: dict[tuple[str, tuple[bool, ...]], frozenset[int]] = {}
        self._spill_parent = spill_dir
        self.spill_dir: Path | None = None
        if any(mp.target == "disk" for mps in self._by_bucket.values() for mp in mps.values()):
            self._make_spill_dir()

    def _make_spill_dir(self) -> None:
        parent = None if self._spill_parent is None else Path(self._spill_parent)
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
        self.spill_dir = Path(tempfile.mkdtemp(prefix=SPILL_PREFIX, dir=parent))
        cleanup.track(self.spill_dir)  # removed at exit or on SIGTERM if remove() never runs

    # -- installing -------------------------------------------------------------------
    def _install(self) -> None:
        self._wrap_paths(p for mps in self._by_bucket.values() for p in mps)
        self._disable_kv_cache()
        if self.ladder is not None:
            self._hooks.append(self.model.register_forward_pre_hook(self._select_bucket, with_kwargs=True))

    def _wrap_paths(self, paths: Iterable[str]) -> None:
        """Wrap each module or flat-Sequential segment in `paths` that is not wrapped yet; a
        Sequential that gains segments is re-wrapped with all of them."""
        segments: dict[str, list[tuple[int, int, str]]] = defaultdict(list)  # parent -> (i, j, path)
        for path in dict.fromkeys(paths):
            parsed = parse_segment(path)
            if parsed is None:
                if path not in self._originals:
                    self._wrap(path, self.model.get_submodule(path))
            else:
                parent, i, j = parsed
                segments[parent].append((i, j, path))
        for parent, spans in segments.items():
            known = self._segments.setdefault(parent, [])
            new = [s for s in spans if s not in known]
            if not new:
                continue
            if known:
                seq, own = self._originals.pop(parent or "<root>")
                if own is None:
                    del seq.forward
                else:
                    seq.forward = own
            known += new
            self._wrap_sequential(parent, self.model.get_submodule(parent), sorted(known))

    def use_plan(self, plan: Plan) -> None:
        """Follow `plan` from the next module call on (call it between steps, never inside one):
        the modules it names are wrapped if they are not yet. Not for a ladder's handle."""
        if self._removed:
            raise RuntimeError("this PlanHandle was removed; apply the plan again before training")
        if self.ladder is not None:
            raise ValueError("use_plan switches a single-plan handle; a ladder picks its plans itself")
        check_plan_matches(plan, self.model, self._model_identity)
        plans = module_plans(plan.decisions)
        if self.spill_dir is None and any(mp.target == "disk" for mp in plans.values()):
            self._make_spill_dir()
        self._wrap_paths(plans)
        if self._restore_use_cache is None:
            self._disable_kv_cache()
        self.active_bucket = int(plan.config["seq_len"])
        self._by_bucket[self.active_bucket] = plans
        self._active = plans

    def _wrap_sequential(self, path: str, seq: nn.Sequential, spans: list[tuple[int, int, str]]) -> None:
        """Run an nn.Sequential child by child, each planned segment of children as one unit."""
        if getattr(seq.forward, "_memplan_wrapper", False):
            raise ValueError(
                f"module '{path}' already has a memplan plan applied; call remove() on its PlanHandle first"
            )
        self._originals[path or "<root>"] = (seq, seq.__dict__.get("forward"))
        starts = {i: (j, seg) for i, j, seg in spans}
        children = list(seq)
        for i, j, seg in spans:
            self._buffer_slots[seg] = buffer_slots(children[i:j])

        def run(first: int, last: int) -> Callable[[Any], Any]:
            def body(x: Any) -> Any:
                for child in children[first:last]:
                    x = child(x)
                return x

            return body

        def forward(x: Any) -> Any:
            k = 0
            while k < len(children):
                if k in starts:
                    j, seg = starts[k]
                    x = self._run(seg, run(k, j), (x,), {})
                    k = j
                else:
                    x = children[k](x)
                    k += 1
            return x

        forward._memplan_wrapper = True  # type: ignore[attr-defined]
        seq.forward = forward

    def _disable_kv_cache(self) -> None:
        """Hugging Face models fill a key/value cache during forward when `config.use_cache` is
        set; a recompute would then see a changed cache and run different ops. Turn it off while
        a plan is applied (as transformers does for gradient checkpointing), on every config object
        of the model (an encoder-decoder's stacks have their own); remove() restores them."""
        if self._originals:
            self._restore_use_cache = disable_kv_cache(self.model)

    def _wrap(self, path: str, module: nn.Module) -> None:
        if not runs_forward(module):
            raise PlanFileError(
                f"module '{path}' is a {type(module).__name__} with no forward of its own (its parent calls its "
                "children), so it cannot be recomputed or offloaded as one; plan its children or its parent instead"
            )
        if getattr(module.forward, "_memplan_wrapper", False):
            raise ValueError(
                f"module '{path}' already has a memplan plan applied; call remove() on its PlanHandle first"
            )
        own = module.__dict__.get("forward")
        original = module.forward
        self._originals[path] = (module, own)
        self._buffer_slots[path] = buffer_slots([module])

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._run(path, original, args, kwargs)

        forward._memplan_wrapper = True  # type: ignore[attr-defined]
        module.forward = forward

    def _select_bucket(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        assert self.ladder is not None
        seq_len = batch_seq_len(args, kwargs)
        plan, beyond = self.ladder.plan_for(seq_len)
        if beyond:
            longest = self.ladder.buckets[-1][0]
            warnings.warn(
                f"batch sequence length {seq_len} is longer than the ladder's longest "
                f"bucket {longest}; using that bucket's plan",
                stacklevel=2,
            )
        bucket = int(plan.config["seq_len"])
        self.active_seq_len = seq_len
        self.active_bucket = bucket
        self._active = self._by_bucket[bucket]

    # -- running ----------------------------------------------------------------------
    def _run(self, path: str, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mp = self._active.get(path)  # decided now; a checkpoint's recompute reuses this choice
        if mp is None or mp.action == "keep":
            return original(*args, **kwargs)
        if mp.action == "recompute":
            return self._recompute(path, original, mp, args, kwargs)
        return self._offload(original, mp, args, kwargs)

    def _recompute(
        self, path: str, original: Callable[..., Any], mp: ModulePlan, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Whole-module, selective (keeping `mp.keep_ops`) or child recompute: one checkpoint, whose
        recompute leaves the module's buffers as its forward did (ForwardBuffers)."""
        if (path in self._early or self._split_backward) and not mp.keep_ops and torch.is_grad_enabled():
            return self._recompute_own(path, original, args, kwargs)
        fn = functools.partial(original, **kwargs) if kwargs else original
        options: dict[str, Any] = {"use_reentrant": False}
        if mp.keep_ops:
            options["context_fn"] = selective_context_fn(mp.keep_ops)
        slots = self._buffer_slots[path]
        if not slots or not torch.is_grad_enabled():  # nothing to restore, or no backward to recompute for
            return checkpoint(fn, *args, **options)
        key = (path, tuple(owner.training for owner, _ in slots))  # BatchNorm writes in training only
        buffers = ForwardBuffers(slots, self._written.get(key))
        out = checkpoint(buffers.wrap(fn), *args, **options)
        self._written[key] = self._written.get(key, frozenset()) | buffers.written()
        return out

    def _recompute_own(
        self, path: str, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """A whole-module recompute by memplan's checkpoint (:class:`EarlyCheckpoint`), buffers
        restored as in _recompute: one :func:`planner.runtime.early_recompute.recompute_in_bubbles`
        may run before the backward (else the backward runs it), or, on a stage whose backward is
        split, one that runs once in I and holds what it makes until W."""
        slots = self._buffer_slots[path]
        fn, buffers, key = original, None, None
        if slots:
            key = (path, tuple(owner.training for owner, _ in slots))
            buffers = ForwardBuffers(slots, self._written.get(key))
            fn = buffers.wrap(original)
        call = EarlyCheckpoint(self._originals[path][0], fn, args, kwargs, read_once=not self._split_backward)
        if path in self._early:
            assert self.early_queue is not None
            self.early_queue.add(path, call)
        out = call.forward(args, kwargs)
        if buffers is not None:
            self._written[key] = self._written.get(key, frozenset()) | buffers.written()
        return out

    def written_buffers(self, path: str) -> tuple[str, ...]:
        """Names (as the model's named_buffers() gives them) of the buffers that the recomputed
        forwards of `path` wrote so far; its recomputes left them as the forwards did."""
        names = {id(m): name for name, m in self.model.named_modules(remove_duplicate=False)}
        slots = self._buffer_slots.get(path, [])
        written = sorted(set().union(*(ids for (p, _), ids in self._written.items() if p == path)))
        return tuple(f"{names[id(slots[i][0])]}.{slots[i][1]}".lstrip(".") for i in written)

    def _offload(
        self, original: Callable[..., Any], mp: ModulePlan, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        stay = storage_ptrs(itertools.chain(self.model.parameters(), self.model.buffers()))
        stay |= storage_ptrs(tree_leaves((list(args), list(kwargs.values()))))

        def pack(t: torch.Tensor) -> Any:
            if not spillable(t) or t.untyped_storage().data_ptr() in stay:
                return t
            if mp.target == "disk":
                return Spilled(self._spill_path(), t)
            return pack_to_host(t, self._side_stream(t))

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, Spilled):
                return packed.load()
            if isinstance(packed, torch.Tensor):
                return packed
            return unpack_from_host(packed)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return original(*args, **kwargs)

    def _spill_path(self) -> Path:
        if self._removed or self.spill_dir is None:
            raise RuntimeError("this PlanHandle was removed; apply the plan again before training")
        return self.spill_dir / f"{next(self._spill_ids)}.bin"

    def _side_stream(self, t: torch.Tensor) -> Any:
        if t.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(t.device)
        return self._stream

    # -- removing ---------------------------------------------------------------------
    def remove(self) -> None:
        """Restore every module's forward, remove hooks and delete the spill directory."""
        if self._removed:
            return
        self._removed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for path, (module, own) in self._originals.items():
            if not getattr(module.__dict__.get("forward"), "_memplan_wrapper", False):
                warnings.warn(
                    f"module '{path}'.forward was replaced after the plan was applied; leaving it as it is",
                    stacklevel=2,
                )
                continue
            if own is None:
                del module.forward
            else:
                module.forward = own
        self._originals.clear()
        for config, use_cache in self._restore_use_cache or ():
            config.use_cache = use_cache
        self._restore_use_cache = None
        if self.spill_dir is not None:
            shutil.rmtree(self.spill_dir, ignore_errors=True)
            cleanup.untrack(self.spill_dir)

    @property
    def removed(self) -> bool:
        return self._removed

    def __enter__(self) -> PlanHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def apply_plan(
    model: nn.Module,
    plan_or_path: Plan | PlanLadder | CompiledPlan | StagePlans | str | Path,
    *,
    spill_dir: str | Path | None = None,
    compile_backend: str = "inductor",
    stage: int | None = None,
) -> PlanHandle | CompiledBlocks:
    """Make `model` follow a plan (or a ladder of plans); returns the handle that undoes it.

    A compiled plan runs each block under torch.compile (`compile_backend`) with its own
    activation_memory_budget.
    `spill_dir` is where disk offload writes (a fresh `memplan-spill-*` folder is made in it,
    default the system temp dir). Stage plans (``memplan plan --pp``) apply the plan of pipeline
    stage `stage` to `model`, the module that runs that stage (planner.runtime.stage_plans).
    Raises ValueError when the plan is for a different model.
    """
    plan = load_plan(plan_or_path) if isinstance(plan_or_path, (str, Path)) else plan_or_path
    if isinstance(plan, StagePlans):
        from planner.runtime.stage_plans import stage_plan_for_module

        plan, early, split_backward = stage_plan_for_module(model, plan, stage)
    else:
        early, split_backward = frozenset(), False
    if isinstance(plan, CompiledPlan):
        check_plan_matches(plan, model)
        from planner.runtime.compiled import compile_blocks  # torch.compile's stack, only when a compiled plan runs

        return compile_blocks(model, plan.budgets, compile_backend)
    if isinstance(plan, PlanLadder):
        plans = {s: p for s, p in plan.buckets}
        ladder: PlanLadder | None = plan
    elif isinstance(plan, Plan):
        plans = {int(plan.config["seq_len"]): plan}
        ladder = None
    else:
        raise ValueError(
            f"apply_plan takes a Plan, PlanLadder, CompiledPlan or plan file path, got {type(plan).__name__}; "
            "load it with load_plan"
        )
    for p in plans.values():
        check_plan_matches(p, model)
    handle = PlanHandle(model, plans, ladder, spill_dir, early, split_backward)
    try:
        handle._install()
    except BaseException:
        handle.remove()
        raise
    return handle
