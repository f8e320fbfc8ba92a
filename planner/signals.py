"""Ctrl-C during a CP-SAT solve: stop the search at once, then raise KeyboardInterrupt as usual.

CP-SAT by default installs its own SIGINT handler for the length of a solve, swallows the
interrupt (the search just ends early) and leaves the process's C-level handler at the default
action afterwards, so the next Ctrl-C kills the process without running ``finally`` blocks (spill
files stay behind). :func:`interruptible` turns that handler off, watches for SIGINT through
Python's wakeup fd on a helper thread and calls ``StopSearch()``; Python's own handler then raises
KeyboardInterrupt when the solve returns. The caller's SIGINT handler is put back afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["interruptible"]


@contextlib.contextmanager
def interruptible(solver: Any) -> Iterator[None]:
    """Around ``solver.Solve(model)`` of an OR-Tools ``CpSolver``: Ctrl-C stops it and is re-raised."""
    solver.parameters.catch_sigint_signal = False
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only; nothing to watch or restore here
        return
    previous = signal.getsignal(signal.SIGINT)
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

    def watch() -> None:
        while data := reader.recv(64):
            if signal.SIGINT in data:
                solver.StopSearch()
            if old_fd != -1:  # someone (asyncio) listened before us: pass the bytes on
                with contextlib.suppress(OSError):
                    os.write(old_fd, data)

    watcher = threading.Thread(target=watch, name="memplan-sigint-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old_fd)
        writer.close()  # ends the watcher's recv
        watcher.join()
        reader.close()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
