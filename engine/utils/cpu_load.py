"""How much of this process's CPUs other processes take: ``/proc/stat``'s idle time against
this process's own CPU time.

Used by the CPU worker's thread governor (``engine/worker/cpu/cpu_thread_governor.py``), which
follows the load step by step, and by the speed choices timed at start-up
(``engine/model/cpu/measured_choice.py``), which say how busy the machine was while they
measured. Over a window of ``wall`` seconds on ``cpus``:
``others = len(cpus) - idle / wall - own / wall``, in CPUs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable


def read_idle_seconds(cpus: Iterable[int]) -> float | None:
    """Idle + iowait seconds so far, summed over ``cpus``, from ``/proc/stat``; None where
    that cannot be read (not Linux)."""
    wanted = {f"cpu{c}" for c in cpus}
    try:
        with open("/proc/stat", encoding="ascii") as f:
            lines = f.readlines()
    except OSError:
        return None
    ticks = 0
    found = 0
    for line in lines:
        fields = line.split()
        if fields and fields[0] in wanted:
            ticks += int(fields[4]) + int(fields[5])  # idle, iowait
            found += 1
    if found != len(wanted):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


class OthersLoad:
    """CPUs that other processes took of this process's CPUs between ``__init__`` and
    ``others()`` (None where ``/proc/stat`` cannot be read or no time passed)."""

    def __init__(self, cpus: Iterable[int] | None = None) -> None:
        if cpus is None:
            cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
        self.cpus = tuple(sorted(cpus))
        self._start = (time.perf_counter(), time.process_time(), read_idle_seconds(self.cpus))

    def others(self) -> float | None:
        wall0, own0, idle0 = self._start
        idle1 = read_idle_seconds(self.cpus)
        wall = time.perf_counter() - wall0
        if idle0 is None or idle1 is None or wall <= 0:
            return None
        own = (time.process_time() - own0) / wall
        return max(0.0, len(self.cpus) - (idle1 - idle0) / wall - own)
