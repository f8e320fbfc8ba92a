"""A Ctrl-C while memplan imports (torch and OR-Tools take seconds) ends as one line and exit 130.

Building the parser imports nothing heavy (``memplan --help`` starts at once): main imports the
subcommand modules, and each command its machinery when it runs, inside ``with guarded_imports():``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["guarded_imports"]


@contextlib.contextmanager
def guarded_imports() -> Iterator[None]:
    """Raise KeyboardInterrupt on leaving if Ctrl-C came meanwhile (main then prints "memplan
    COMMAND: interrupted" and returns 130). The Ctrl-C is only noted while the imports run: raised
    inside an import, it can land in Python code that torch's C++ calls back into, which aborts the
    process (pybind11 terminates on the exception) instead of unwinding."""
    noted: list[int] = []

    def note(signum: int, frame: object) -> None:
        noted.append(signum)

    watch = threading.current_thread() is threading.main_thread()
    watch = watch and signal.getsignal(signal.SIGINT) is signal.default_int_handler  # else: ignored or handled
    previous = signal.signal(signal.SIGINT, note) if watch else None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if noted:
        raise KeyboardInterrupt
