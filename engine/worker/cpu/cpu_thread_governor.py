"""``CpuThreadGovernor``: a CPU worker's torch thread count, following how much CPU is left to it.

The problem. A worker's step is a few dozen OpenMP parallel regions (the linears, the paged
attention kernel), each split over the worker's threads, each ending when the *slowest*
thread is done. On a quiet 2-core machine two threads that spin briefly between regions
(``GOMP_SPINCOUNT=10000``) are fastest: measured 610–630 tok/s against 470 for threads that
sleep at once (``OMP_WAIT_POLICY=PASSIVE``). But when another process takes one of the two
cores, every region waits for the thread that shares its core with that process, and the
spinning thread takes time from it: 265 tok/s, 0.43× of quiet. One thread alone, contended,
keeps 460 — it waits for nobody.

The idea. Count the CPUs the worker's share has, minus what other processes use of them,
and run with that many threads (at least one, at most the share's). Every ``window_s``
seconds of stepping the governor reads:

- ``own``: this process's CPU seconds per second (``time.process_time``), spinning included;
- ``idle``: the share's idle CPUs per second (``/proc/stat``, idle + iowait, per CPU);
- ``others = len(cpus) - idle - own``: what everything else took of the share;

and goes down to ``floor(len(cpus) - others + 0.8)`` threads when that is fewer than it runs
with, up to ``floor(len(cpus) - others + 0.6)`` when that is more (at least one, at most
``max_threads``): a thread is given up to more than 0.8 of a CPU taken, and taken back at
0.6 or less. Quiet, two spinning threads: own ≈ 1.7, idle ≈ 0.25, others ≈ 0.05 → 2. Serving, the
API server and the engine core (and a benchmark client) take 0.2–0.65 → stays 2. A busy loop on one core: the kernel
shares two cores among three runnable threads, own ≈ 0.9–1.3, others ≈ 0.9–1.3 → 1. With
one thread: own 1.0, others 1.0 → stays 1; when the loop ends, others ≈ 0.05–0.6 → 2.
A new count is taken only when two windows in a row agree (a burst of another process's work
does not flip it). Pauses between steps need no special care: while the worker waits, a
quiet share is idle (others ≈ 0) and a contended one is taken by the other process (others
≈ what it takes), so the estimate holds; after a long pause a new window starts, and a long
step (a big prefill on a big model) is judged like any other.

vLLM has no counterpart: its CPU worker binds one OpenMP thread per core and keeps them.
Changing the count may change the order of a matmul's sums, hence the last bits of a result
— as a different batch does.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from engine.logger import init_logger
from engine.utils.cpu_load import read_idle_seconds  # noqa: F401 - the governor's reader (tests import it here)

logger = init_logger(__name__)

# A pause between steps longer than this many windows (an idle engine) starts a new window:
# what the share did meanwhile is old news.
PAUSE_WINDOWS = 8
# Hysteresis, in CPUs: a thread is given up only to other processes taking more than 0.8 of
# a CPU, and taken back when they take 0.6 or less. Glassbox's own API server and engine
# core (and a benchmark client beside them) count as other processes — they do compete for
# the cores — and take 0.2-0.65 of a CPU while serving the tiny default model at 2,000
# tok/s; one threshold at 0.3 made the count flip several times a second. A busy loop
# measured 0.9-1.3 against two threads.
DOWN_SLACK_CPUS = 0.8
UP_SLACK_CPUS = 0.6


class CpuThreadGovernor:
    """Sets a CPU worker's torch threads from the CPU other processes leave it.

    Call ``step_started()`` before and ``step_finished()`` after each step; the count changes
    between steps only.

    Args:
        max_threads: the worker's share of threads (its plan); the governor never goes above.
        cpus: the CPU ids the worker runs on (its share).
        window_s: seconds of wall time per judgement.
        set_threads: sets the thread count (``engine.model.cpu.op_threads.set_op_threads``).
        read_idle: ``read_idle_seconds``, replaceable in tests.
        clock, cpu_clock: wall and process-CPU clocks in seconds.
        name: who this is, for the log line ("Worker rank 0 on CPUs 0-1").
    """

    def __init__(
        self,
        max_threads: int,
        cpus: tuple[int, ...],
        window_s: float = 0.25,
        set_threads: Callable[[int], None] | None = None,
        read_idle: Callable[[Iterable[int]], float | None] = read_idle_seconds,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] = time.process_time,
        name: str = "Worker",
    ) -> None:
        if set_threads is None:
            from engine.model.cpu.op_threads import set_op_threads

            set_threads = set_op_threads  # not torch's own count: a compiled graph guards on it
        self.max_threads = max_threads
        self.cpus = tuple(cpus)
        self.window_s = window_s
        self.num_threads = max_threads
        self._set_threads = set_threads
        self._read_idle = read_idle
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._name = name
        self._window: tuple[float, float, float] | None = None  # wall, cpu, idle at its start
        self._last_finish: float | None = None
        self._pending: int | None = None  # a count one window asked for
        self.changes = 0

    @property
    def enabled(self) -> bool:
        """Whether there is anything to govern: two or more threads, and /proc/stat readable."""
        return self.max_threads >= 2 and self._read_idle(self.cpus) is not None

    def step_started(self) -> None:
        now = self._clock()
        if self._last_finish is not None and now - self._last_finish > PAUSE_WINDOWS * self.window_s:
            self._window = None  # the engine idled: judge from here
        if self._window is None:
            idle = self._read_idle(self.cpus)
            if idle is not None:
                self._window = (now, self._cpu_clock(), idle)

    def step_finished(self) -> None:
        self._last_finish = now = self._clock()
        if self._window is None:
            return
        start, cpu0, idle0 = self._window
        wall = now - start
        if wall < self.window_s:
            return
        self._window = None
        idle1 = self._read_idle(self.cpus)
        if idle1 is None:
            return
        own = (self._cpu_clock() - cpu0) / wall
        idle = max(0.0, (idle1 - idle0) / wall)
        others = max(0.0, len(self.cpus) - idle - own)
        down = math.floor(len(self.cpus) - others + DOWN_SLACK_CPUS)
        up = math.floor(len(self.cpus) - others + UP_SLACK_CPUS)
        if down < self.num_threads:
            target = max(1, down)
        elif up > self.num_threads:
            target = min(self.max_threads, up)
        else:
            target = self.num_threads
        logger.debug("%s: %.2f s window: own %.2f, idle %.2f, others %.2f CPU(s) -> %d thread(s)",
                     self._name, wall, own, idle, others, target)  # fmt: skip
        if target == self.num_threads:
            self._pending = None
            return
        if self._pending != target:
            self._pending = target  # one more window must agree
            return
        self._pending = None
        logger.info(
            "%s: other processes take %.2f CPU(s) of its %d: %d torch thread(s) (was %d)",
            self._name, others, len(self.cpus), target, self.num_threads,
        )  # fmt: skip
        self._set_threads(target)
        self.num_threads = target
        self.changes += 1
