"""A memo of planner's traces shared by the test processes of one pytest session.

Most of the suite's time is tracing, and many tests trace the same small model with the same
arguments. :func:`install` wraps ``planner.tracing.recorder.trace`` and
``planner.tracing.parallel.rank_trace.trace_tp_rank``: a call whose arguments were traced before in
this session (by any xdist worker) gets a fresh unpickled copy of that trace, so no test sees
another's changes. Not memoised: specs given as objects, plans given as closures, tests that use
``monkeypatch`` or are marked ``fresh_trace`` (they trace to check tracing itself). The key holds
every argument, the model file's and plan files' modification times, and MEMPLAN_FULL_TRACE.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from planner.tracing.recorder import FULL_TRACE_ENV

MEMO_DIR_ENV = "MEMPLAN_TEST_TRACE_MEMO"  # the session's memo folder, made by the controlling process

enabled = True  # set per test by the conftest fixture


def open_session_memo() -> Path:
    """The memo folder of this session, made here and handed to the xdist workers by environment."""
    folder = Path(tempfile.mkdtemp(prefix="memplan-trace-memo-"))
    os.environ[MEMO_DIR_ENV] = str(folder)
    return folder


def close_session_memo(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _file_state(text: str) -> tuple | None:
    """(modification time, size) of the file a spec string names (``hf:PATH``, ``PATH.py:FUNC``)."""
    path = text.removeprefix("hf:").rpartition(":")[0] or text.removeprefix("hf:")
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_mtime_ns, st.st_size)


def _plan_identity(plan: object) -> tuple | None:
    """A plan function's name (and a partial's arguments); None for a closure, which has no stable key."""
    if plan is None:
        return ("default",)
    args: tuple = ()
    if isinstance(plan, functools.partial):
        args = (plan.args, sorted(plan.keywords.items()))
        plan = plan.func
    qualname = getattr(plan, "__qualname__", "<locals>")
    if "<locals>" in qualname or "<lambda>" in qualname:
        return None
    return (plan.__module__, qualname, repr(args))


def _memoised(original: Callable, key_of: Callable[..., tuple | None]) -> Callable:
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        folder = os.environ.get(MEMO_DIR_ENV)
        key = key_of(*args, **kwargs) if enabled and folder else None
        if key is None:
            return original(*args, **kwargs)
        full_key = repr((original.__qualname__, key, os.environ.get(FULL_TRACE_ENV)))
        path = Path(folder) / hashlib.sha256(full_key.encode()).hexdigest()
        if path.exists():
            return pickle.loads(path.read_bytes())
        result = original(*args, **kwargs)
        scratch = path.with_suffix(f".{os.getpid()}")
        scratch.write_bytes(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
        os.replace(scratch, path)
        return result

    return wrapper


def _trace_key(spec, **kwargs) -> tuple | None:
    if not isinstance(spec, str):
        return None
    return (spec, _file_state(spec), sorted((k, repr(v)) for k, v in kwargs.items()))


def _rank_key(spec, config, rank, lifetimes=True, plan=None, ep_plan=None) -> tuple | None:
    plans = (_plan_identity(plan), _plan_identity(ep_plan))
    if not isinstance(spec, str) or None in plans:
        return None
    files = [_file_state(s) for s in (spec, config.tp_plan, config.ep_plan)]
    return (spec, repr(config), rank, lifetimes, plans, files)


def install() -> None:
    """Route the planner's trace entry points through the memo (before the tests import them)."""
    from planner.tracing import recorder
    from planner.tracing.parallel import rank_trace

    if not hasattr(recorder.trace, "__wrapped__"):  # conftest may be imported twice (as tests.conftest)
        recorder.trace = _memoised(recorder.trace, _trace_key)
        rank_trace.trace_tp_rank = _memoised(rank_trace.trace_tp_rank, _rank_key)
