"""Time a step only while the machine is quiet.

A step counts as quiet when the CPU time other processes used during it (all CPU time the kernel
accounted in /proc/stat, minus this process's own from /proc/self/stat) stays below
`QUIET_FRACTION` of the step's wall time; otherwise it is run again, up to `max_attempts` times.
Every timed step records the other processes' CPU seconds it saw.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

__all__ = ["QUIET_FRACTION", "TimedStep", "cpu_jiffies", "timed_quiet"]

QUIET_FRACTION = 0.05  # other processes may use at most 5% of one core during a timed step
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class TimedStep:
    """One timed step: its wall seconds, other processes' CPU seconds, and how many tries it took."""

    wall_s: float
    other_cpu_s: float
    attempts: int
    quiet: bool

    def to_dict(self) -> dict:
        return asdict(self)


def cpu_jiffies() -> tuple[int, int]:
    """(busy jiffies of the whole machine, jiffies of this process) so far."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:9]]
    busy = sum(values) - values[3] - values[4]  # all but idle and iowait
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return busy, int(fields[11]) + int(fields[12])  # utime + stime


def timed_quiet(step: Callable[[], object], max_attempts: int) -> TimedStep:
    """Run `step` until one run is quiet (or `max_attempts` runs); the last run is the one recorded."""
    for attempt in range(1, max_attempts + 1):
        busy0, own0 = cpu_jiffies()
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0
        busy1, own1 = cpu_jiffies()
        other = max(0, (busy1 - busy0) - (own1 - own0)) * _TICK_S
        quiet = other <= max(QUIET_FRACTION * wall, _TICK_S)
        if quiet or attempt == max_attempts:
            return TimedStep(wall, other, attempt, quiet)
    raise AssertionError("unreachable")
