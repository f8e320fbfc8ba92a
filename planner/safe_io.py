"""Careful file I/O for untrusted input and shared output paths.

- :func:`write_text` replaces a regular file atomically (a unique temporary file in the same
  directory, then a rename), writes through a symlink to the real file, writes in place to
  devices and pipes, and refuses directories.
- :func:`read_bounded` reads at most a limit (``/dev/zero`` and endless pipes end).
- :func:`load_json` parses JSON with bounds on size, nesting, container count and number
  magnitude, and refuses duplicate keys and NaN/Infinity.
- :func:`clean` strips control characters and caps the length of text that came from a file
  before it reaches a terminal.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any

__all__ = [
    "JSON_MAX_BYTES",
    "JSON_MAX_DEPTH",
    "JSON_MAX_ITEMS",
    "JSON_MAX_INT_DIGITS",
    "ECHO_MAX_CHARS",
    "clean",
    "load_json",
    "loads_json",
    "read_bounded",
    "write_text",
    "write_bytes",
]

JSON_MAX_BYTES = 16 * 2**20
"""Largest JSON file read (plans are kilobytes to a few megabytes)."""
JSON_MAX_DEPTH = 64
"""Deepest nesting of JSON arrays/objects accepted (plans nest 6 deep)."""
JSON_MAX_ITEMS = 2_000_000
"""Most JSON values (counted as separators and brackets) in one document."""
JSON_MAX_INT_DIGITS = 30
"""Most digits in one JSON number (2**64 has 20)."""
ECHO_MAX_CHARS = 200
"""Longest piece of file-derived text echoed back in a message."""

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def clean(value: object, max_chars: int = ECHO_MAX_CHARS) -> str:
    """`value` as printable one-line text: control characters (ESC, CR, newlines, bidi overrides)
    become '?', and text beyond `max_chars` is cut with a note of how much was left out."""
    text = value if isinstance(value, str) else str(value)
    cut = len(text) - max_chars
    if cut > 0:
        text = text[:max_chars]
    text = _CONTROL.sub("?", text)
    return f"{text}...(+{cut} chars)" if cut > 0 else text


# ---------------------------------------------------------------- reading


def read_bounded(path: str | Path, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of `path`, refusing (ValueError) a directory or anything longer than `max_bytes`.

    Reads at most ``max_bytes + 1`` bytes, so devices and endless pipes end too.
    """
    shown = clean(path)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise ValueError(f"{what} {shown} not found; check the path") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {shown} is a directory; pass a file") from None
    except PermissionError:
        raise ValueError(f"{what} {shown} cannot be read (permission denied); check the path") from None
    if len(data) > max_bytes:
        raise ValueError(f"{what} {shown} is larger than the {max_bytes}-byte limit; is it the right file?")
    return data


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"key '{clean(key, 60)}' appears twice in one object")
            seen.add(key)
    return out


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > JSON_MAX_INT_DIGITS:
        raise ValueError(f"a number has {len(text)} digits (at most {JSON_MAX_INT_DIGITS})")
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > 4 * JSON_MAX_INT_DIGITS:
        raise ValueError(f"a number is {len(text)} characters long (at most {4 * JSON_MAX_INT_DIGITS})")
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number '{clean(text, 40)}' is out of range")
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON; write a finite number")


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of parsed JSON (iterative; stops counting past `limit`)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


def loads_json(raw: bytes | str, what: str = "JSON") -> Any:
    """Parse JSON text under the module's bounds; one-line ValueError naming `what` otherwise."""
    if len(raw) > JSON_MAX_BYTES:
        raise ValueError(f"{what} is larger than the {JSON_MAX_BYTES}-byte limit")
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else bytes(raw)
    items = data.count(b",") + data.count(b"[") + data.count(b"{")
    if items > JSON_MAX_ITEMS:
        raise ValueError(f"{what} holds more than {JSON_MAX_ITEMS} values; is it the right file?")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not valid UTF-8 (byte {e.start})") from None
    try:
        value = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_refuse_constant,
        )
    except RecursionError:
        raise ValueError(f"{what} is nested more than {JSON_MAX_DEPTH} levels deep") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} is not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
    except ValueError as e:  # from the hooks above
        raise ValueError(f"{what} is refused: {e}") from None
    if _depth(value, JSON_MAX_DEPTH) > JSON_MAX_DEPTH:
        raise ValueError(f"{what} is nested more than {JSON_MAX_DEPTH} levels deep")
    return value


def load_json(path: str | Path, what: str = "JSON file") -> Any:
    """Read and parse a JSON file under the module's bounds (see :func:`loads_json`)."""
    return loads_json(read_bounded(path, JSON_MAX_BYTES, what), f"{what} {clean(path)}")


# ---------------------------------------------------------------- writing


def write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` safely; returns the path actually written (a symlink's target).

    A regular file (or a missing one) is replaced atomically: a unique temporary file in the same
    directory is written, flushed and renamed over it, so readers and concurrent writers never see
    a torn file. A symlink is resolved and its target replaced the same way (the link stays). A
    device, FIFO or socket is written in place. A directory is refused with a ValueError.
    """
    target = Path(os.path.realpath(path))
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except NotADirectoryError:
        raise ValueError(f"cannot write '{clean(path)}': a part of the path is not a directory") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise ValueError(f"cannot write '{clean(path)}': it is a directory; give a file name")
    if mode is not None and not stat.S_ISREG(mode):
        with open(target, "wb") as f:  # device, FIFO, socket: the reader is on the other side
            f.write(data)
        return target
    if not target.parent.is_dir():
        raise ValueError(f"cannot write '{clean(path)}': folder '{clean(target.parent)}' does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode & 0o7777 if mode is not None else 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def write_text(path: str | Path, text: str) -> Path:
    """:func:`write_bytes` of UTF-8 text."""
    return write_bytes(path, text.encode("utf-8"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
