"""A pickle reader that builds plain data only (no globals, no code), for untrusted snapshot files."""

from __future__ import annotations

import pickle
import struct
from typing import Any

__all__ = ["PlainDataUnpickler", "RefusedPickle"]

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


def _refuse_opcode(name: str) -> Any:
    def refuse(self: pickle._Unpickler) -> None:
        raise RefusedPickle(
            f"refusing to load pickle opcode {name} from snapshot: only plain data is allowed"
        )

    return refuse


def _load_bytearray8(self: pickle._Unpickler) -> None:
    # pickle._Unpickler pre-allocates (and zero-fills) the declared length; read first.
    (n,) = struct.unpack("<Q", self.read(8))
    data = self.read(n)
    if len(data) != n:
        raise pickle.UnpicklingError("pickle data was truncated")
    self.append(bytearray(data))


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
        if name in _PLAIN_OPCODES or name in _LOOKUP_OPCODES:
            table[code[0]] = base[code[0]]
        else:  # REDUCE, BUILD, OBJ, NEWOBJ(_EX), EXT1/2/4, NEXT_BUFFER, READONLY_BUFFER, ...
            table[code[0]] = _refuse_opcode(name)
    table[pickle.BYTEARRAY8[0]] = _load_bytearray8
    return table


class PlainDataUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """Pure-Python unpickler that builds plain data only.

    The pure-Python implementation is used on purpose: its memo is a dict, so a
    hostile ``LONG_BINPUT 4000000000`` cannot make it allocate a huge memo array
    as the C unpickler does, and its opcode table can be whitelisted. Globals,
    persistent ids, ``REDUCE``/``BUILD``/``NEWOBJ`` and extension codes (which can
    hit ``copyreg``'s process-wide cache without ``find_class``) are all refused.
    """

    dispatch = _build_dispatch()

    def find_class(self, module: str, name: str) -> Any:
        raise RefusedPickle(
            f"refusing to load {module}.{name} from snapshot: only plain data is allowed"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickle(
            "refusing to load a persistent id from snapshot: only plain data is allowed"
        )
