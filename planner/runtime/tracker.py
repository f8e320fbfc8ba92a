"""Live tensor bytes of a real run, counted per storage independently of the simulator."""

from __future__ import annotations

import threading
import weakref

import torch

from memplan_compat import TorchDispatchMode, tree_leaves

__all__ = ["LiveBytesTracker"]


class LiveBytesTracker(TorchDispatchMode):
    """Counts live storage bytes; `peak_bytes` is the maximum seen right after any op's outputs.

    A storage's last reference can drop on another thread (gloo's worker, done with a collective's
    buffer), which runs its release there: the count changes under a lock, so no update is lost."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: dict[int, int] = {}
        self._lock = threading.RLock()
        self.live_bytes = 0
        self.peak_bytes = 0

    def _release(self, key: int) -> None:
        with self._lock:
            self.live_bytes -= self._seen.pop(key, 0)

    def _resize(self, key: int, nbytes: int) -> bool:
        """A storage resized in place to `nbytes`; whether it is a tracked one."""
        with self._lock:
            if key not in self._seen:
                return False
            self.live_bytes += nbytes - self._seen[key]
            self._seen[key] = nbytes
            return True

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        with self._lock:
            if key in self._seen:
                return
            nbytes = st.nbytes()
            self._seen[key] = nbytes
            self.live_bytes += nbytes
        weakref.finalize(st, self._release, key)

    def track_all(self, objects) -> None:
        for t in tree_leaves(objects):
            if isinstance(t, torch.Tensor):
                self.track(t)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return out

    def sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
