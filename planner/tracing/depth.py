"""Trace a deep stack of identical blocks through a shallow copy of the model, exactly.

An 80-layer model runs the same ops 80 times. memplan traces the model with only the first few
blocks of its longest run of identical blocks kept (the container truncated in place, restored
after), and extends the graph to the full depth by inserting copies of one middle block: its
forward and backward ops, the storages it owns (with their allocation, free and save points moved
with it), its parameters, and the hand-over of the residual stream and its gradient to the blocks
on either side.

The extension is checked before it is trusted: the graph of ``BASE_BLOCKS`` blocks, extended by
one, must equal the traced graph of ``BASE_BLOCKS + 1`` blocks op for op and storage for storage
(:func:`same_graph`); otherwise (a model whose blocks behave differently by index, a forward that
does not iterate over its container) the full model is traced. The folded graph is the graph the
full trace records, so every simulation, plan and per-rank layout built on it is unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace

from torch import nn

from planner.tracing.blocks import module_signature
from planner.tracing.graph import OpGraph, OpNode, Region, TensorInfo

__all__ = [
    "BASE_BLOCKS",
    "FOLD_MIN_RUN",
    "BlockRun",
    "FoldError",
    "fold_trace",
    "graph_difference",
    "repeated_run",
    "same_graph",
    "traced_part",
]

REACH = 2  # how many blocks away a block's storages are used or freed (a residual held one block on)
_TEMPLATE = REACH + 1  # the template's position in the run: REACH matched blocks on each side, and one more
BASE_BLOCKS = 2 * REACH + 3  # run blocks kept in the shallow trace
FOLD_MIN_RUN = 12  # shorter runs are traced whole (folding them saves little)


class FoldError(ValueError):
    """The shallow graph does not extend by the block-copy rule (the caller traces the full model)."""


@dataclass(frozen=True)
class BlockRun:
    """The longest tail of identical blocks in one container: children start..start+length-1."""

    container: str  # module path of the nn.ModuleList / nn.Sequential ("" for the model itself)
    start: int
    length: int

    def path(self, index: int) -> str:
        return f"{self.container}.{index}" if self.container else str(index)


def repeated_run(model: nn.Module, region_paths: list[str], min_length: int = FOLD_MIN_RUN) -> BlockRun | None:
    """The longest run of identical blocks (same module signature) that ends its container and whose
    children are all blocks, or None when none has `min_length` blocks."""
    by_container: dict[str, set[int]] = {}
    for path in region_paths:
        parent, _, last = path.rpartition(".")
        if last.isdigit():
            by_container.setdefault(parent, set()).add(int(last))
    best: BlockRun | None = None
    for parent, indices in by_container.items():
        container = model.get_submodule(parent) if parent else model
        if not isinstance(container, nn.ModuleList | nn.Sequential):
            continue
        children = list(container)
        if [str(k) for k in range(len(children))] != list(container._modules):
            continue
        signature = module_signature(children[-1])
        start = len(children)
        while start > 0 and start - 1 in indices and module_signature(children[start - 1]) == signature:
            start -= 1
        length = len(children) - start
        if length >= min_length and (best is None or length > best.length):
            best = BlockRun(parent, start, length)
    return best


@contextmanager
def shallow(model: nn.Module, run: BlockRun, blocks: int) -> Iterator[None]:
    """The model with only the first `blocks` blocks of the run kept, restored on exit."""
    container = model.get_submodule(run.container) if run.container else model
    keep = run.start + blocks
    removed = list(container)[keep:]
    del container[keep:]
    try:
        yield
    finally:
        container.extend(removed)


def traced_part(model: nn.Module, run: BlockRun) -> AbstractContextManager[None]:
    """The model cut to the blocks :func:`fold_trace` runs (its deeper shallow trace's), restored on exit."""
    return shallow(model, run, BASE_BLOCKS + 1)


def _param_slice(model: nn.Module, block_path: str) -> tuple[int, int]:
    """Positions of a block's parameters in model.parameters() order (contiguous)."""
    prefix = block_path + "."
    positions = [i for i, (name, _) in enumerate(model.named_parameters()) if name.startswith(prefix)]
    if not positions or positions != list(range(positions[0], positions[-1] + 1)):
        raise FoldError(f"the parameters of {block_path} are not contiguous")
    return positions[0], positions[-1] + 1


def fold_trace(model: nn.Module, run: BlockRun, trace_once: Callable[[], OpGraph]) -> OpGraph:
    """The full-depth graph from two shallow traces (``trace_once`` traces the model as it is).

    Raises FoldError saying why when a shallow trace fails or one more block does not extend the
    shallow graph into the deeper one (the caller then traces every block)."""
    template = run.path(run.start + _TEMPLATE)
    try:
        with traced_part(model, run):
            deeper = trace_once()
        with shallow(model, run, BASE_BLOCKS):
            params = _param_slice(model, template)
            base = trace_once()
        difference = graph_difference(extend(base, run, 1, params), deeper)
        if difference is not None:
            raise FoldError(f"one more block does not extend the shallow trace: {difference}")
        return extend(base, run, run.length - BASE_BLOCKS, params)
    except FoldError:
        raise
    except (IndexError, KeyError, RuntimeError, ValueError, TypeError, AttributeError) as exc:
        raise FoldError(f"{type(exc).__name__}: {exc}") from exc


# --- the extension ------------------------------------------------------------------------------

FORWARD, BACKWARD = "F", "B"


class _Extension:
    """Copies of the run's template block t inserted between t and t + 1 (see the module docstring).

    The *matched* blocks t - REACH .. t + REACH have spans of one structure: the forward span of
    block b runs from the end of b - 1's forward to the end of its own, the backward span from the
    end of b + 1's backward to the end of its own. Every run block owns the storages allocated in
    its own ops (and the parameters only it reads). A reference from something of block n (new
    numbering) to an op of old block b lands on new block n + (b - its own old block): an old
    block (the same op when it is b itself), or copy j of the template.
    """

    def __init__(self, graph: OpGraph, run: BlockRun, copies: int) -> None:
        self.g, self.run, self.copies = graph, run, copies
        regions = {r.path: r for r in graph.regions}
        self.t = t = run.start + _TEMPLATE
        last = run.start + BASE_BLOCKS - 1
        try:
            reg = {b: regions[run.path(b)] for b in range(run.start, last + 1)}
        except KeyError as exc:
            raise FoldError(f"block {exc} has no region") from None
        self.matched = range(t - REACH, t + REACH + 1)
        self.spans: dict[tuple[int, str], range] = {}
        for b in range(run.start, last + 1):
            fwd_from = reg[b - 1].fwd_end if b > run.start else reg[b].fwd_start
            bwd_from = reg[b + 1].bwd_end if b < last else reg[b].bwd_start
            self.spans[(b, FORWARD)] = range(fwd_from, reg[b].fwd_end)
            self.spans[(b, BACKWARD)] = range(bwd_from, reg[b].bwd_end)
        self.where: dict[int, tuple[int, str, int]] = {}  # op -> (old block, kind, offset)
        for (b, kind), span in self.spans.items():
            for offset, i in enumerate(span):
                self.where[i] = (b, kind, offset)
            if b not in self.matched:
                continue
            model = self.spans[(t, kind)]
            if len(span) != len(model) or any(graph.ops[i].name != graph.ops[k].name for i, k in zip(span, model)):
                raise FoldError(f"the {kind} ops of {run.path(b)} differ from the template's")
        self._owners()
        self._layout()

    def _owners(self) -> None:
        """Which run block owns each storage; the matched blocks' storages matched by role."""
        g = self.g
        readers: dict[int, set[int]] = {}
        first_read: dict[int, tuple[int, int]] = {}
        for op in g.ops:
            for k, tid in enumerate((*op.inputs, *op.mutates)):
                readers.setdefault(tid, set()).add(op.index)
                first_read.setdefault(tid, (op.index, k))
        self.owner: dict[int, int] = {}
        keys: dict[int, list[tuple[tuple, int]]] = {b: [] for b in self.matched}
        for tid, info in g.tensors.items():
            if info.alloc_op >= 0:
                place = self.where.get(info.alloc_op)
                if place is None:
                    continue
                key = ("a", place[1], place[2], g.ops[info.alloc_op].allocs.index(tid))
            else:
                blocks = {self.where.get(i, (None,))[0] for i in readers.get(tid, ())}
                if len(blocks) != 1 or None in blocks:
                    continue
                place = self.where[first_read[tid][0]]
                key = ("p", place[1], place[2], first_read[tid][1])
            self.owner[tid] = place[0]
            if place[0] in keys:
                keys[place[0]].append((key, tid))
        self.roles: dict[int, list[int]] = {}
        self.role_of: dict[int, int] = {}
        template = sorted(keys[self.t])
        for b, entries in keys.items():
            entries.sort()
            if [k for k, _ in entries] != [k for k, _ in template]:
                raise FoldError(f"the storages of {self.run.path(b)} do not match the template's")
            for (_, tid), (_, ttid) in zip(entries, template):
                a, c = g.tensors[tid], g.tensors[ttid]
                if (a.nbytes, a.dtype, a.shape, a.category) != (c.nbytes, c.dtype, c.shape, c.category):
                    raise FoldError(f"storage {tid} of {self.run.path(b)} differs from the template's")
            self.roles[b] = [tid for _, tid in entries]
            for role, (_, tid) in enumerate(entries):
                self.role_of[tid] = role
        next_id = max(g.tensors, default=-1) + 1
        self.copy_ids: list[list[int]] = [self.roles[self.t]]  # copy 0: the template itself
        for _ in range(self.copies):
            self.copy_ids.append(list(range(next_id, next_id + len(template))))
            next_id += len(template)

    def _layout(self) -> None:
        """The new op order as (old op, copy) slots, copy 0 being the old op itself."""
        t, n = self.t, len(self.g.ops)
        fwd_end, bwd_split = self.spans[(t, FORWARD)].stop, self.spans[(t, BACKWARD)].start
        slots = [(i, 0) for i in range(fwd_end)]
        for j in range(1, self.copies + 1):
            slots += [(i, j) for i in self.spans[(t, FORWARD)]]
        slots += [(i, 0) for i in range(fwd_end, bwd_split)]
        for j in range(self.copies, 0, -1):
            slots += [(i, j) for i in self.spans[(t, BACKWARD)]]
        slots += [(i, 0) for i in range(bwd_split, n)]
        self.slots = slots
        self.index = {slot: k for k, slot in enumerate(slots)}
        self.index[(n, 0)] = len(slots)  # "after the last op"

    def _new_block(self, old: int, copy: int) -> int:
        """Old blocks up to t keep their number, copy j is t + j, old blocks after t move by copies."""
        return self.t + copy if copy else (old if old <= self.t else old + self.copies)

    def _resolve(self, new_block: int) -> tuple[int, int]:
        """(old block, copy) of a new block number."""
        t, c = self.t, self.copies
        if new_block <= t:
            return new_block, 0
        if new_block <= t + c:
            return t, new_block - t
        return new_block - c, 0

    def _target(self, b: int, owner: int, copy: int) -> tuple[int, int]:
        """Where a reference from (old block `owner`, copy) to old block b lands: (old block, copy)."""
        return self._resolve(self._new_block(owner, copy) + b - owner)

    def op_ref(self, i: int, owner: int | None, copy: int) -> int:
        """New index of old op i as referenced by something of (old block, copy)."""
        place = self.where.get(i)
        if place is None or owner is None:
            return self.index[(i, 0)]
        b, kind, offset = place
        old, j = self._target(b, owner, copy)
        if (old, j) == (b, 0):
            return self.index[(i, 0)]
        if old not in self.matched or b not in self.matched:
            raise FoldError(f"op {i} is referenced across more than {REACH} blocks")
        return self.index[(self.spans[(old, kind)][offset], j)]

    def tensor_ref(self, tid: int, reader: int | None, copy: int) -> int:
        """New id of old storage tid as read by an op of (old block, copy)."""
        b = self.owner.get(tid)
        if b is None:
            return tid
        if reader is None:
            if b == self.t:
                raise FoldError(f"storage {tid} of the template is read outside the run")
            return tid
        old, j = self._target(b, reader, copy)
        if (old, j) == (b, 0):
            return tid
        if tid not in self.role_of or old not in self.roles:
            raise FoldError(f"storage {tid} is read across more than {REACH} blocks")
        role = self.role_of[tid]
        return self.copy_ids[j][role] if j else self.roles[old][role]

    def rename(self, module: str, copy: int) -> str:
        """A module path in new block numbering."""
        prefix = self.run.container + "." if self.run.container else ""
        if not module.startswith(prefix):
            return module
        head, dot, rest = module[len(prefix) :].partition(".")
        if not head.isdigit() or int(head) < self.run.start:
            return module
        return prefix + str(self._new_block(int(head), copy)) + dot + rest

    def op_block(self, i: int) -> int | None:
        place = self.where.get(i)
        return None if place is None else place[0]

    def module_block(self, module: str) -> int | None:
        """The old run block a module path lies in."""
        prefix = self.run.container + "." if self.run.container else ""
        head = module[len(prefix) :].partition(".")[0] if module.startswith(prefix) else ""
        block = int(head) if head.isdigit() else None
        return block if block is not None and (block, FORWARD) in self.spans else None


def extend(graph: OpGraph, run: BlockRun, copies: int, template_params: tuple[int, int]) -> OpGraph:
    """`graph` (the run's first BASE_BLOCKS blocks traced) with `copies` more copies of its template."""
    if copies == 0:
        return graph
    x = _Extension(graph, run, copies)
    t = x.t
    ops: list[OpNode] = []
    for k, (i, j) in enumerate(x.slots):
        op = graph.ops[i]
        reader = x.op_block(i)

        def ids(tids: tuple[int, ...], reader=reader, j=j) -> tuple[int, ...]:
            return tuple(x.tensor_ref(tid, reader, j) for tid in tids)

        ops.append(
            replace(
                op,
                index=k,
                module=x.rename(op.module, j),
                inputs=ids(op.inputs),
                outputs=ids(op.outputs),
                allocs=ids(op.allocs),
                mutates=ids(op.mutates),
            )
        )

    def moved(info: TensorInfo, new_id: int, owner: int | None, j: int) -> TensorInfo:
        def ref(i: int | None) -> int | None:
            return None if i is None else (i if i < 0 else x.op_ref(i, owner, j))

        saved = [x.op_ref(i, owner, j) for i in info.saved_by]
        if owner is None:  # a storage of no block saved by template ops is saved by each copy too
            saved += [x.index[(i, c)] for i in info.saved_by if x.op_block(i) == t for c in range(1, copies + 1)]
        return replace(
            info,
            id=new_id,
            alloc_op=ref(info.alloc_op),
            free_op=ref(info.free_op),
            natural_free_op=ref(info.natural_free_op),
            saved_by=tuple(sorted(set(saved))),
        )

    tensors = {tid: moved(info, tid, x.owner.get(tid), 0) for tid, info in graph.tensors.items()}
    for j in range(1, copies + 1):
        for role, tid in enumerate(x.roles[t]):
            tensors[x.copy_ids[j][role]] = moved(graph.tensors[tid], x.copy_ids[j][role], t, j)

    regions: list[Region] = []
    for r in graph.regions:
        owner = x.module_block(r.path)
        for j in range(copies + 1) if owner == t else range(1):
            fs, fe = x.op_ref(r.fwd_start, owner, j), x.op_ref(r.fwd_end - 1, owner, j) + 1
            bs, be = x.op_ref(r.bwd_start, owner, j), x.op_ref(r.bwd_end - 1, owner, j) + 1
            regions.append(replace(r, path=x.rename(r.path, j), fwd_start=fs, fwd_end=fe, bwd_start=bs, bwd_end=be))
    regions.sort(key=lambda r: r.fwd_start)

    events: list[tuple[int, int, str]] = []
    for seq, (n, module) in enumerate(graph.pack_events):
        owner = x.module_block(module)
        for j in range(copies + 1) if owner == t else range(1):
            events.append((x.op_ref(n, owner, j), seq, x.rename(module, j)))
    events.sort()

    writes = []
    for i, tid, name in graph.meta.get("buffer_writes", ()):
        block = x.op_block(i)
        for j in range(copies + 1) if block == t else range(1):
            writes.append((x.index[(i, j)], x.tensor_ref(tid, block, j), x.rename(name, j)))
    writes.sort()

    lo, hi = template_params
    shapes = list(graph.param_shapes)
    shapes[hi:hi] = shapes[lo:hi] * copies
    trainable = list(graph.param_trainable)
    if trainable:
        trainable[hi:hi] = trainable[lo:hi] * copies
    return OpGraph(
        ops=ops,
        tensors=tensors,
        regions=regions,
        backward_start=x.index[(graph.backward_start, 0)],
        param_shapes=shapes,
        param_dtype=graph.param_dtype,
        param_trainable=tuple(trainable),
        meta={**graph.meta, "buffer_writes": writes},
        pack_events=tuple((n, module) for n, _, module in events),
    )


# --- equality -----------------------------------------------------------------------------------


def _canonical(graph: OpGraph) -> tuple:
    """The graph with storages numbered by first appearance (ops in order, then the rest by id)."""
    order: dict[int, int] = {}
    for op in graph.ops:
        for tid in (*op.inputs, *op.outputs, *op.allocs, *op.mutates):
            order.setdefault(tid, len(order))
    for tid in sorted(graph.tensors):
        order.setdefault(tid, len(order))

    def ids(tids: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(order[t] for t in tids)

    ops = tuple(
        (
            o.name,
            o.phase,
            o.module,
            o.flops,
            o.bytes_accessed,
            o.dtype,
            ids(o.inputs),
            ids(o.outputs),
            ids(o.allocs),
            ids(o.mutates),
            o.variant,
        )
        for o in graph.ops
    )
    tensors = tuple(
        sorted(
            (order[t.id], t.nbytes, t.category, t.dtype, t.shape, t.alloc_op, t.free_op, t.natural_free_op, t.saved_by)
            for t in graph.tensors.values()
        )
    )
    writes = tuple((i, order[tid], name) for i, tid, name in graph.meta.get("buffer_writes", ()))
    return (
        ops,
        tensors,
        tuple(graph.regions),
        graph.backward_start,
        graph.pack_events,
        tuple(graph.param_shapes),
        graph.param_trainable,
        writes,
    )


_CANONICAL_PARTS = (
    "ops",
    "storages",
    "regions",
    "backward start",
    "pack events",
    "parameter shapes",
    "trainable flags",
    "buffer writes",
)


def graph_difference(a: OpGraph, b: OpGraph) -> str | None:
    """The first part in which two graphs differ (and where), or None when they record the same step."""
    for part, x, y in zip(_CANONICAL_PARTS, _canonical(a), _canonical(b), strict=True):
        if x == y:
            continue
        if isinstance(x, tuple) and isinstance(y, tuple):
            at = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            return f"{part} differ at #{at} of {len(x)} vs {len(y)}"
        return f"{part} differ ({x!r} vs {y!r})"
    return None


def same_graph(a: OpGraph, b: OpGraph) -> bool:
    """Whether two graphs record the same step: ops, storages (up to numbering), regions, saves."""
    return graph_difference(a, b) is None
