"""A CPU worker's torch threads: how many, and on which CPUs (``GLASSBOX_CPU_OMP_THREADS_BIND``).

vLLM counterpart: ``VLLM_CPU_OMP_THREADS_BIND`` and ``CPUWorker.init_device``
(``vllm/v1/worker/cpu_worker.py``). ``plan_cpu_threads`` decides, ``apply_cpu_threads`` does
it; ``CPUWorker`` (``cpu_worker.py``) calls both before its first torch op. vLLM pins each
OpenMP thread to one CPU with its own C++ helper and, under ``auto``, picks the CPUs NUMA node
by NUMA node and keeps one back for the engine core; Glassbox pins the whole worker process to
its share (each thread then placed by the OS inside it), has no NUMA logic, and keeps no core
back (its engine core sleeps while the worker computes: about 2 % of a core, measured in
``benchmarks/cpu_contention.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from engine.config import ConfigError

BIND_ENV = "GLASSBOX_CPU_OMP_THREADS_BIND"


@dataclass(frozen=True)
class CpuThreadPlan:
    """What one CPU worker does with its torch threads (``plan_cpu_threads``).

    ``num_threads``: torch's intra-op thread count to set (``torch.set_num_threads``), None to
    leave it. ``cpus``: the CPU ids to pin the worker's process to (``os.sched_setaffinity``),
    None to leave its affinity. ``why``: one phrase for the log line.
    """

    num_threads: int | None
    cpus: tuple[int, ...] | None
    why: str

    @property
    def placement(self) -> tuple[int | None, tuple[int, ...] | None]:
        """``(num_threads, cpus)``."""
        return self.num_threads, self.cpus


def _cpu_ranges(cpus: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` → ``"0-2,5"``."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def _usable_cpus() -> set[int]:
    """The CPUs this (thread of the) process may run on; every CPU where affinity is not known."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))


def _omp_count(value: str | None) -> int | None:
    """``OMP_NUM_THREADS``'s (first) count, or None when unset or not a whole number >= 1
    (OpenMP ignores such a value too)."""
    first = (value or "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) >= 1 else None


def plan_cpu_threads(
    bind: str | tuple[tuple[int, ...], ...],
    worker_index: int,
    num_workers: int,
    usable_cpus: set[int] | frozenset[int],
    omp_num_threads: str | None,
    own_process: bool,
) -> CpuThreadPlan:
    """Decide one CPU worker's torch thread count and CPU affinity.

    Args:
        bind: ``GLASSBOX_CPU_OMP_THREADS_BIND`` as parsed by ``engine.envs``: ``"auto"``,
            ``"nobind"``, or one tuple of CPU ids per worker.
        worker_index: this worker's index among all the engine's local workers (DP rank ×
            world size + rank).
        num_workers: how many workers the engine runs on this machine (DP × PP × TP).
        usable_cpus: the CPUs this process may run on (``os.sched_getaffinity(0)``).
        omp_num_threads: the user's ``OMP_NUM_THREADS`` (None when unset): under ``auto`` it
            gives the count; with explicit lists the list decides.
        own_process: the worker runs in a Glassbox process of its own (or the engine core's
            with ``--distributed-executor-backend uni``), not in the caller's: ``auto``
            changes nothing in the caller's process.

    Returns:
        The plan (``CpuThreadPlan``); ``nobind`` → change nothing.

    Raises:
        ConfigError: an explicit list has no entry for this worker, or names a CPU this
            process may not use; the message names ``GLASSBOX_CPU_OMP_THREADS_BIND``.
    """
    if bind == "nobind":
        return CpuThreadPlan(None, None, f"{BIND_ENV}=nobind")
    if bind == "auto":
        if not own_process:
            return CpuThreadPlan(None, None, "auto, in the caller's process: left as they are")
        cpus = sorted(usable_cpus)
        if num_workers >= len(cpus):
            # No more than one CPU each: one thread per worker, and the OS places them.
            share: tuple[int, ...] | None = None
            threads = 1
        else:
            # Contiguous shares, sizes differing by at most one (the first get the extra CPUs).
            base, extra = divmod(len(cpus), num_workers)
            start = worker_index * base + min(worker_index, extra)
            share = tuple(cpus[start : start + base + (worker_index < extra)])
            threads = len(share)
            if num_workers == 1:
                share = None  # all of them: nothing to pin
        why = f"auto: {len(cpus)} usable CPUs, {num_workers} worker(s)"
        if _omp_count(omp_num_threads) is not None:
            threads = _omp_count(omp_num_threads)
            why += f", OMP_NUM_THREADS={omp_num_threads}"
        return CpuThreadPlan(threads, share, why)
    if worker_index >= len(bind):
        raise ConfigError(
            BIND_ENV,
            "|".join(_cpu_ranges(cpus) for cpus in bind),
            f"one CPU list per worker, separated by '|': {num_workers} workers but {len(bind)} list(s)",
        )
    cpus_of_worker = bind[worker_index]
    unusable = sorted(set(cpus_of_worker) - set(usable_cpus))
    if unusable:
        raise ConfigError(
            BIND_ENV,
            "|".join(_cpu_ranges(cpus) for cpus in bind),
            f"CPU {_cpu_ranges(tuple(unusable))} is not one this process may use "
            f"({_cpu_ranges(tuple(sorted(usable_cpus)))})",
        )
    return CpuThreadPlan(
        len(cpus_of_worker), cpus_of_worker, f"{BIND_ENV}={_cpu_ranges(cpus_of_worker)} for this worker"
    )


def apply_cpu_threads(plan: CpuThreadPlan) -> None:
    """Carry out ``plan`` in this process: ``torch.set_num_threads`` (OpenMP's and MKL's
    counts), and ``os.sched_setaffinity`` for every thread the process has (new threads,
    OpenMP's pool among them, inherit it from the thread that starts them)."""
    if plan.num_threads is not None and torch.get_num_threads() != plan.num_threads:
        torch.set_num_threads(plan.num_threads)
    if plan.cpus is not None and hasattr(os, "sched_setaffinity"):
        try:
            tids = [int(t) for t in os.listdir("/proc/self/task")]
        except OSError:
            tids = [0]
        for tid in tids:
            try:
                os.sched_setaffinity(tid, plan.cpus)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
