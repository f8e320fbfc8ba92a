"""Spill directories go when the process goes.

An exception or KeyboardInterrupt unwinds through ``PlanHandle.remove()`` (a context manager or a
``finally``); what is still tracked when the interpreter exits is removed by an ``atexit`` hook; and
SIGTERM, which would end the process without either, gets a handler that removes the tracked
directories and then hands the signal on: to the previous Python handler, or (when that was the
default action) back to the default action, re-raised so the exit status still says SIGTERM. A forked child (a DataLoader
worker) starts with nothing tracked, so its exit or SIGTERM leaves the parent's directories alone.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

__all__ = ["track", "untrack", "remove_tracked", "tracked"]

_lock = threading.Lock()
_dirs: set[Path] = set()
_installed = False
_previous_sigterm: Any = None


def track(path: Path) -> None:
    """Remove `path` (a directory) at exit or on SIGTERM unless :func:`untrack` is called first."""
    with _lock:
        _dirs.add(Path(path))
    _install()


def untrack(path: Path) -> None:
    with _lock:
        _dirs.discard(Path(path))


def tracked() -> frozenset[Path]:
    with _lock:
        return frozenset(_dirs)


def remove_tracked() -> None:
    """Delete every tracked directory now (what the exit hook and the SIGTERM handler do)."""
    with _lock:
        dirs = list(_dirs)
        _dirs.clear()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) must never remove its parent's spill directories."""
    _dirs.clear()


def _on_sigterm(signum: int, frame: Any) -> None:
    remove_tracked()
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)  # the default action: end the process as SIGTERM would
    os.kill(os.getpid(), signum)


def _install() -> None:
    global _installed, _previous_sigterm
    with _lock:
        if _installed:
            return
        _installed = True
    atexit.register(remove_tracked)
    os.register_at_fork(after_in_child=_forget_in_child)
    if threading.current_thread() is not threading.main_thread():
        return  # handlers can only be set from the main thread; the exit hook still runs
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        return  # the process chose to ignore SIGTERM; keep it that way
    _previous_sigterm = previous
    signal.signal(signal.SIGTERM, _on_sigterm)
