"""Test-only builders of hostile inputs (pickles, JSON, OOM text) and a time/RSS meter."""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import struct
import threading
import time
from collections.abc import Iterator

PROTO4 = pickle.PROTO + b"\x04"


def memo_tuple_bomb(levels: int = 100) -> bytes:
    """Tuples nested through the memo: t[i+1] = (t[i], t[i]); hashing the top one takes 2**levels steps.

    Ends with the top tuple on the stack (memo index `levels`) and does not STOP.
    """
    out = [PROTO4, pickle.EMPTY_TUPLE, pickle.MEMOIZE]
    for i in range(levels):
        get = pickle.BINGET + bytes([i]) if i < 256 else pickle.LONG_BINGET + struct.pack("<I", i)
        out += [get, get, pickle.TUPLE2, pickle.MEMOIZE]
    return b"".join(out)


def hash_bombs(levels: int = 100) -> dict[str, bytes]:
    """The memo tuple bomb put in a set, a frozenset, a dict key via SETITEM and via DICT."""
    base = memo_tuple_bomb(levels)
    return {
        "set": base + pickle.EMPTY_SET + pickle.MARK + pickle.BINGET + bytes([levels]) + pickle.ADDITEMS + pickle.STOP,
        "frozenset": base + pickle.MARK + pickle.BINGET + bytes([levels]) + pickle.FROZENSET + pickle.STOP,
        "setitem": base
        + pickle.EMPTY_DICT
        + pickle.BINGET
        + bytes([levels])
        + pickle.NONE
        + pickle.SETITEM
        + pickle.STOP,
        "dict": base + pickle.MARK + pickle.BINGET + bytes([levels]) + pickle.NONE + pickle.DICT + pickle.STOP,
    }


def opcode_flood(opcode: bytes, n_bytes: int) -> bytes:
    """`n_bytes` of one opcode after a protocol header (MEMOIZE after one NONE to memoize)."""
    head = PROTO4 + (pickle.NONE if opcode == pickle.MEMOIZE else b"")
    return head + opcode * (n_bytes // len(opcode))


def shared_frames_snapshot(n_frames: int, n_blocks: int) -> bytes:
    """A snapshot whose blocks all share one frames list of `n_frames` (one frame dict, repeated)."""
    frame = {"filename": "x.py", "line": 1, "name": "f"}
    frames = [frame] * n_frames
    blocks = [{"size": 1 << 20, "state": "active_allocated", "frames": frames} for _ in range(n_blocks)]
    seg = {"total_size": n_blocks << 20, "blocks": blocks, "segment_type": "large"}
    return pickle.dumps({"segments": [seg]}, protocol=4)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def meter(sample_s: float = 0.002) -> Iterator[dict[str, float]]:
    """Measure wall time, this thread's CPU time (what a hang or a blow-up costs, whatever else the
    machine or the test process's other threads run: a fresh-clone run counted 5.3 s of process
    CPU time for what takes 0.4 s alone) and peak RSS above the starting RSS (sampled by a thread).
    The heap built before it is frozen out of garbage collection meanwhile, so that the objects a
    long test session holds are not scanned on the measured code's account."""
    out = {"wall_s": 0.0, "cpu_s": 0.0, "peak_rss_delta_bytes": 0.0}
    base = _rss_bytes()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(sample_s)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    gc.freeze()
    start = time.perf_counter()
    cpu_start = time.thread_time()
    try:
        yield out
    finally:
        out["wall_s"] = time.perf_counter() - start
        out["cpu_s"] = time.thread_time() - cpu_start
        gc.unfreeze()
        done.set()
        thread.join()
        peak[0] = max(peak[0], _rss_bytes())
        out["peak_rss_delta_bytes"] = peak[0] - base
