"""A pickle reader that builds plain data only (no globals, no code), within a budget, for untrusted snapshot files.

Besides refusing every opcode that could run code, the reader meters what it builds:

- memory: every object it creates, every container slot, memo entry and mark is charged at its
  ``sys.getsizeof`` size against a budget proportional to the input size (plus a base, under a cap);
- elements: items put into containers, and the length of a container each time the memo hands
  it out again (``GET``), so shared references count as often as they are used;
- time: a wall-clock deadline proportional to the input size;
- hashing: set/frozenset elements and dict keys must be str or int, or tuples of them at most
  ``KEY_MAX_DEPTH`` deep and ``KEY_MAX_ELEMENTS`` items (counted with repeats), so a key built of
  memo-shared tuples cannot hash for ever;
- numbers: integers wider than ``INT_MAX_BITS`` and text numbers longer than ``TEXT_NUMBER_MAX_CHARS``
  are refused.
"""

from __future__ import annotations

import pickle
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["PickleBudget", "PickleBudgetExceeded", "PlainDataUnpickler", "RefusedPickle"]

MEMORY_BASE_BYTES = 64 * 2**20
MEMORY_PER_INPUT_BYTE = 16
MEMORY_CAP_BYTES = 8 * 2**30
ELEMENTS_BASE = 1_000_000
ELEMENTS_PER_INPUT_BYTE = 2
ELEMENTS_CAP = 500_000_000
TIME_BASE_S = 10.0
TIME_PER_MIB_S = 2.0
KEY_MAX_DEPTH = 4
KEY_MAX_ELEMENTS = 1024
INT_MAX_BITS = 128
TEXT_NUMBER_MAX_CHARS = 64

_SLOT = 8  # one reference in a list, tuple or the unpickler's stack
_MARK = 88  # a fresh stack list and its slot on the metastack
_MEMO_ENTRY = 100  # a memo dict entry with its int key
_CLOCK_EVERY = 1024  # charges between looks at the clock

# Opcodes that build plain data: scalars, str/bytes, list/tuple/dict/set, memo, framing.
_PLAIN_OPCODES = frozenset(
    """PROTO FRAME STOP MARK POP POP_MARK DUP NONE NEWTRUE NEWFALSE
    INT BININT BININT1 BININT2 LONG LONG1 LONG4 FLOAT BINFLOAT
    STRING BINSTRING SHORT_BINSTRING BINBYTES SHORT_BINBYTES BINBYTES8 BYTEARRAY8
    UNICODE SHORT_BINUNICODE BINUNICODE BINUNICODE8
    EMPTY_LIST APPEND APPENDS LIST EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3
    EMPTY_DICT DICT SETITEM SETITEMS EMPTY_SET ADDITEMS FROZENSET
    GET BINGET LONG_BINGET PUT BINPUT LONG_BINPUT MEMOIZE""".split()
)

# Opcodes whose loaders only look names up through find_class/persistent_load (refused there).
_LOOKUP_OPCODES = frozenset({"GLOBAL", "STACK_GLOBAL", "INST", "PERSID", "BINPERSID"})


class RefusedPickle(ValueError):
    """Raised for pickle content that could run code; passed through unchanged."""


class PickleBudgetExceeded(ValueError):
    """The pickle needs more memory, elements or time than its size justifies, or hashes unbounded keys."""


@dataclass(frozen=True)
class PickleBudget:
    """What one load may spend: estimated bytes of objects, container elements, wall-clock seconds."""

    memory_bytes: int
    elements: int
    time_s: float

    @classmethod
    def for_input(cls, input_bytes: int) -> PickleBudget:
        """The budget for a pickle of `input_bytes`: a base plus a share per input byte, capped."""
        return cls(
            memory_bytes=min(MEMORY_BASE_BYTES + MEMORY_PER_INPUT_BYTE * input_bytes, MEMORY_CAP_BYTES),
            elements=min(ELEMENTS_BASE + ELEMENTS_PER_INPUT_BYTE * input_bytes, ELEMENTS_CAP),
            time_s=TIME_BASE_S + TIME_PER_MIB_S * input_bytes / 2**20,
        )


def _refuse_opcode(name: str) -> Any:
    def refuse(self: PlainDataUnpickler) -> None:
        raise RefusedPickle(f"refusing to load pickle opcode {name} from snapshot: only plain data is allowed")

    return refuse


def _load_bytearray8(self: PlainDataUnpickler) -> None:
    # pickle._Unpickler pre-allocates (and zero-fills) the declared length; read first.
    (n,) = struct.unpack("<Q", self.read(8))
    data = self.read(n)
    if len(data) != n:
        raise pickle.UnpicklingError("pickle data was truncated")
    self.append(bytearray(data))


def _text_number(self: PlainDataUnpickler) -> bytes:
    line = self.readline()
    if len(line) > TEXT_NUMBER_MAX_CHARS:
        raise PickleBudgetExceeded(f"pickle holds a {len(line)}-character number; snapshots hold 64-bit numbers")
    return line


# Text opcodes (protocol 0) parse a line; the line's length is checked before int()/float() see it.
def _load_int(self: PlainDataUnpickler) -> None:
    line = _text_number(self)
    self.append(line == b"01\n" if line in (b"00\n", b"01\n") else int(line, 0))


def _load_long(self: PlainDataUnpickler) -> None:
    self.append(int(_text_number(self)[:-1].rstrip(b"L"), 0))


def _load_float(self: PlainDataUnpickler) -> None:
    self.append(float(_text_number(self)[:-1]))


def _load_get(self: PlainDataUnpickler) -> None:
    i = int(_text_number(self)[:-1])
    if i not in self.memo:
        raise pickle.UnpicklingError(f"Memo value not found at index {i}")
    self.append(self.memo[i])


def _load_put(self: PlainDataUnpickler) -> None:
    i = int(_text_number(self)[:-1])
    if i < 0:
        raise pickle.UnpicklingError("negative PUT argument")
    self.memo[i] = self.stack[-1]


def _checked_long(base: Any) -> Any:
    def op(self: PlainDataUnpickler) -> None:
        base(self)
        if self.stack[-1].bit_length() > INT_MAX_BITS:
            raise PickleBudgetExceeded(f"pickle holds an integer wider than {INT_MAX_BITS} bits")
        self._pushed()

    return op


def _push(base: Any) -> Any:
    """An opcode that pushes one new object: charge its size and a stack slot."""
    getsizeof = sys.getsizeof

    def op(self: PlainDataUnpickler) -> None:  # the hot path: inlined _charge
        base(self)
        self.memory_bytes += getsizeof(self.stack[-1]) + _SLOT
        self._countdown -= 1
        if self.memory_bytes > self.budget.memory_bytes or not self._countdown:
            self._charge(0)

    return op


def _keyed_push(base: Any, stride: int) -> Any:
    """DICT (keys at every 2nd item) and FROZENSET (every item): check hashing before building."""

    def op(self: PlainDataUnpickler) -> None:
        self._check_keys(self.stack[::stride])
        self._elements(len(self.stack) // stride)
        base(self)
        self._pushed()

    return op


def _get(base: Any) -> Any:
    """GET/BINGET/LONG_BINGET/DUP: a shared reference costs the length of what it shares."""

    def op(self: PlainDataUnpickler) -> None:
        base(self)
        top = self.stack[-1]
        self._charge(_SLOT)
        if isinstance(top, (list, tuple, dict, set, frozenset)):
            self._elements(len(top))

    return op


def _memo(base: Any) -> Any:
    def op(self: PlainDataUnpickler) -> None:
        base(self)
        self._charge(_MEMO_ENTRY)

    return op


def _mark(base: Any) -> Any:
    def op(self: PlainDataUnpickler) -> None:
        base(self)
        self._charge(_MARK)

    return op


def _fill(base: Any, *, from_mark: bool, stride: int | None) -> Any:
    """APPEND(S), SETITEM(S), ADDITEMS: charge the container's growth; check keys (stride) first."""

    def op(self: PlainDataUnpickler) -> None:
        if from_mark:
            items = self.stack
            target = self.metastack[-1][-1]
        else:
            n = 1 if stride is None else 2
            items = self.stack[-n:]
            target = self.stack[-n - 1]
        if stride is not None:
            self._check_keys(items[::stride])
        added = len(items) if stride is None or stride == 1 else len(items) // 2
        before = sys.getsizeof(target)
        base(self)
        self._elements(added)
        self._charge(max(sys.getsizeof(target) - before, 0))

    return op


_WRAPPERS: dict[str, Any] = {
    "MARK": _mark,
    "DUP": _get,
    "GET": lambda b: _get(_load_get),
    "BINGET": _get,
    "LONG_BINGET": _get,
    "PUT": lambda b: _memo(_load_put),
    "BINPUT": _memo,
    "LONG_BINPUT": _memo,
    "MEMOIZE": _memo,
    "INT": lambda b: _push(_load_int),
    "LONG": lambda b: _checked_long(_load_long),
    "FLOAT": lambda b: _push(_load_float),
    "LONG1": _checked_long,
    "LONG4": _checked_long,
    "DICT": lambda b: _keyed_push(b, 2),
    "FROZENSET": lambda b: _keyed_push(b, 1),
    "APPEND": lambda b: _fill(b, from_mark=False, stride=None),
    "APPENDS": lambda b: _fill(b, from_mark=True, stride=None),
    "SETITEM": lambda b: _fill(b, from_mark=False, stride=2),
    "SETITEMS": lambda b: _fill(b, from_mark=True, stride=2),
    "ADDITEMS": lambda b: _fill(b, from_mark=True, stride=1),
}
_UNMETERED = frozenset({"PROTO", "FRAME", "STOP", "POP", "POP_MARK"})


class _OpcodeTable(dict):
    def __missing__(self, key: int) -> Any:
        raise pickle.UnpicklingError(f"invalid pickle opcode {key:#04x}")


def _build_dispatch() -> _OpcodeTable:
    table = _OpcodeTable()
    base = pickle._Unpickler.dispatch  # type: ignore[attr-defined]
    for name in dir(pickle):
        code = getattr(pickle, name)
        if not (name.isupper() and isinstance(code, bytes) and len(code) == 1):
            continue
        if code[0] not in base:
            continue
        fn = _load_bytearray8 if name == "BYTEARRAY8" else base[code[0]]
        if name in _LOOKUP_OPCODES or name in _UNMETERED:
            table[code[0]] = fn
        elif name in _PLAIN_OPCODES:
            table[code[0]] = _WRAPPERS.get(name, _push)(fn)
        else:  # REDUCE, BUILD, OBJ, NEWOBJ(_EX), EXT1/2/4, NEXT_BUFFER, READONLY_BUFFER, ...
            table[code[0]] = _refuse_opcode(name)
    return table


class PlainDataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Pure-Python unpickler that builds plain data only, within a :class:`PickleBudget`.

    The pure-Python implementation is used on purpose: its memo is a dict, so a
    hostile ``LONG_BINPUT 4000000000`` cannot make it allocate a huge memo array
    as the C unpickler does, and its opcode table can be whitelisted and metered.
    Globals, persistent ids, ``REDUCE``/``BUILD``/``NEWOBJ`` and extension codes
    (which can hit ``copyreg``'s process-wide cache without ``find_class``) are refused.
    """

    dispatch = _build_dispatch()

    def __init__(self, file: Any, budget: PickleBudget) -> None:
        super().__init__(file)
        self.budget = budget
        self.memory_bytes = 0
        self.element_count = 0
        self._deadline = time.monotonic() + budget.time_s
        self._countdown = _CLOCK_EVERY

    # -- metering ---------------------------------------------------------------------
    def _charge(self, n_bytes: int) -> None:
        self.memory_bytes += n_bytes
        if self.memory_bytes > self.budget.memory_bytes:
            raise PickleBudgetExceeded(
                f"loading would take more than {self.budget.memory_bytes // 2**20} MiB of memory, far more "
                "than a snapshot of this size needs"
            )
        self._countdown -= 1
        if self._countdown <= 0:  # look at the clock every _CLOCK_EVERY charges
            self._countdown = _CLOCK_EVERY
            if time.monotonic() > self._deadline:
                raise PickleBudgetExceeded(f"loading took longer than {self.budget.time_s:.0f} s")

    def _pushed(self) -> None:
        self._charge(sys.getsizeof(self.stack[-1]) + _SLOT)

    def _elements(self, n: int) -> None:
        self.element_count += n
        if self.element_count > self.budget.elements:
            raise PickleBudgetExceeded(
                f"the data holds more than {self.budget.elements} elements (shared references counted "
                "each time they are used), far more than a snapshot of this size holds"
            )

    def _check_keys(self, keys: list[Any]) -> None:
        for key in keys:
            _key_size(key, 0)

    def find_class(self, module: str, name: str) -> Any:
        raise RefusedPickle(f"refusing to load {module}.{name} from snapshot: only plain data is allowed")

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickle("refusing to load a persistent id from snapshot: only plain data is allowed")


def _key_size(key: Any, depth: int) -> int:
    """Items in a set element or dict key (repeats counted); refuse anything costly to hash."""
    kind = type(key)
    if kind is str or kind is int or kind is bool:
        return 1
    if kind is not tuple:
        raise PickleBudgetExceeded(
            f"a set element or dict key is a {kind.__name__}; snapshots only use str and int keys"
        )
    if depth >= KEY_MAX_DEPTH:
        raise PickleBudgetExceeded(f"a set element or dict key nests tuples more than {KEY_MAX_DEPTH} deep")
    size = 1
    for item in key:
        size += _key_size(item, depth + 1)
        if size > KEY_MAX_ELEMENTS:
            raise PickleBudgetExceeded(f"a set element or dict key holds more than {KEY_MAX_ELEMENTS} items")
    return size
