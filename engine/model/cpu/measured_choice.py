"""Speed choices made by timing the candidates on this machine, once, and remembering the verdict.

Where Glassbox can run the same math two ways and which is faster depends on the CPU (how
many bfloat16 dot products its cores start per cycle against float32 FMAs, whether it has
AMX tiles), a rule written from one CPU's flags is right on that CPU and backwards on the
next: on an Intel Xeon without AMX oneDNN's bfloat16 matmul runs at about half its float32
speed, on an AMD Zen 4 (AVX512-BF16) at about twice (``benchmarks/cpu_fma_peak.py``). So
the choice is measured instead: the candidates are timed at the model's own shapes, at the
worker's thread count, interleaved (one round of each, several rounds, medians), and the
verdict is cached in ``<GLASSBOX_CACHE_ROOT>/measured_choices/<name>-<hash>.json``, keyed by
everything that changes the answer (the CPU's name, vendor, family and model number and its
instruction sets, torch's version, the thread count, the shapes, this module's ``VERSION``). A
later start with the same key reads the file and measures nothing; a flag forces either side
without measuring.

Each ``Verdict`` says what was chosen, how (``measured``, ``cached``, ``forced by FLAG``) and
the figures behind it; the worker logs it and puts it in its status (``runs_as``), so
``glassbox ps`` and ``doctor`` show it.

vLLM counterpart: none as such — vLLM's CPU build picks its kernels by CPU flags
(``vllm/platforms/cpu.py``, ``cpu_attn``'s ISA dispatch); the closest in spirit is
Inductor's ``max-autotune``, which also times candidate kernels and caches the winner.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.logger import init_logger
from engine.utils.cpu_load import OthersLoad

logger = init_logger(__name__)

# Bump when a measurement's method changes: old verdicts are then ignored. 2: a busy
# measurement keeps the choice's default (``busy_default``); version 1's step_threads verdicts
# timed under load said "1 thread" for good on a 2-core machine that is faster with 2 when quiet.
VERSION = 2

# The instruction sets that decide which kernel is fastest (the rest of /proc/cpuinfo's flags
# change nothing a choice here depends on, and would make the key differ between VMs).
CPU_FLAGS_THAT_MATTER = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


def cpu_identity(cpuinfo: str | None = None) -> dict[str, Any]:
    """This CPU, as far as a speed choice cares: ``{"model": "AMD EPYC", "vendor":
    "AuthenticAMD", "family": 26, "model_number": 2, "flags": [...]}`` — the first processor
    of ``/proc/cpuinfo`` (or ``cpuinfo``, its text): model name, vendor, family and model
    number, and those of ``CPU_FLAGS_THAT_MATTER`` it has. Family and model number tell apart
    CPUs a VM names alike ("AMD EPYC" is a Zen 4, family 25, and a Zen 5, family 26, with the
    same flags here, and need not share a fastest kernel). Off Linux: the platform's processor
    name and no flags."""
    ident: dict[str, Any] = {"model": platform.processor() or platform.machine()}
    flags: set[str] = set()
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    fields = {"model name": "model", "vendor_id": "vendor", "cpu family": "family", "model": "model_number"}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if flags:
                break  # the end of the first processor's block
            continue
        name, sep, value = line.partition(":")
        name, value = name.strip(), value.strip()
        if not sep:
            continue
        if name == "flags":
            flags = set(value.split())
        elif name in fields:
            ident[fields[name]] = (
                int(value) if fields[name] in ("family", "model_number") and value.isdigit() else value
            )
    ident["flags"] = [f for f in CPU_FLAGS_THAT_MATTER if f in flags]
    return ident


@dataclass
class Verdict:
    """One speed choice: what was chosen, how, and the figures behind it.

    Attributes:
        name: the choice (``"bf16_linear"``).
        choice: the winner, as a user reads it (``"native"``, ``"upcast from 64 rows"``).
        source: ``"measured"``, ``"cached"`` (an earlier start's measurement) or
            ``"forced by --cpu-bf16-linear"``.
        detail: the measurement in words (each candidate's median time), "" when forced.
        data: what the code acts on (``{"min_rows": 64}``), JSON-serialisable.
        seconds: how long this start spent measuring (0 when cached or forced).
    """

    name: str
    choice: str
    source: str
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def short(self) -> str:
        """``native (measured)`` — for a status line."""
        return f"{self.choice} ({self.source})"

    def text(self) -> str:
        """The whole verdict in one sentence, for the log."""
        return f"{self.name}: {self.choice} ({self.source}{': ' + self.detail if self.detail else ''})"


def time_candidates(
    candidates: Mapping[str, Callable[[], None]],
    rounds: int = 5,
    timer: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median seconds of one call of each candidate: one warm-up call each, then ``rounds``
    rounds that call every candidate once in turn (interleaved, so a burst of load from
    another process falls on all of them alike).

    ``timer``: the clock (tests pass a fake one that the candidates themselves advance)."""
    for fn in candidates.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = timer()
            fn()
            times[name].append(timer() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def last_of_winning_run(
    order: Iterable[Any], times: Mapping[Any, Mapping[str, float]], faster: str, than: str, min_gain: float
) -> Any | None:
    """How far a candidate wins, as the measured choices put it: walking ``order`` (row counts,
    decodes per thread ...), the last key of the unbroken run from the first one where
    ``faster`` took at most ``1 / min_gain`` of ``than``'s time (``times[key][name]``:
    seconds); None when it does not win at the first key.

    >>> last_of_winning_run([1, 2, 4], {1: {"a": 1, "b": 2}, 2: {"a": 1, "b": 2}, 4: {"a": 2, "b": 1}}, "a", "b", 1.1)
    2
    """
    last = None
    for key in order:
        if times[key][than] >= min_gain * times[key][faster]:
            last = key
        else:
            break
    return last


def cache_dir() -> Path:
    from engine import envs

    return Path(envs.GLASSBOX_CACHE_ROOT).expanduser() / "measured_choices"


def cache_path(name: str, key: Mapping[str, Any]) -> Path:
    """``<cache>/measured_choices/<name>-<hash of key, CPU, torch, VERSION>.json``."""
    full = {"name": name, "version": VERSION, "torch": torch.__version__, "cpu": cpu_identity(), **key}
    digest = hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return cache_dir() / f"{name}-{digest}.json"


# Other processes taking this many CPUs or more while a choice was measured make its verdict
# provisional: a later start measures again (at most ``REMEASURE_BUSY`` times), so one busy
# moment does not decide for good; a choice that load itself tilts (how many threads, a
# one-thread compiled step against a multi-threaded eager one) keeps its default meanwhile.
BUSY_CPUS = 0.5
REMEASURE_BUSY = 2
# What measures the other processes' load during a measurement (tests put a fixed one).
load_meter: Callable[[], OthersLoad] = OthersLoad


def measured(
    name: str,
    key: Mapping[str, Any],
    measure: Callable[[], tuple[str, str, dict[str, Any]]],
    busy_default: tuple[str, dict[str, Any]] | None = None,
) -> Verdict:
    """The cached verdict for ``(name, key)`` on this machine, else ``measure()``'s —
    ``(choice, detail, data)`` — timed and written to the cache (atomically: two workers
    measuring at once each write a file of their own and rename it). An unreadable cache
    file is measured again; an unwritable cache directory only costs the next start a new
    measurement (logged). How busy the machine was meanwhile (other processes' CPUs,
    ``engine/utils/cpu_load.py``) is said in the detail; a verdict measured while they took
    ``BUSY_CPUS`` or more is measured again at the next start, up to ``REMEASURE_BUSY`` times.

    ``busy_default``: ``(choice, data)`` to use instead of a busy measurement's winner, for a
    choice the load itself tilts: timed while another process holds a core, fewer threads
    always win (the thread count is then the live governor's business, not a verdict's).
    Such a verdict says so in its detail and is what the cache keeps, so a machine busy at
    every try ends with the default, never with a choice made by someone else's load."""
    path = cache_path(name, key)
    remeasured = 0
    try:
        saved = json.loads(path.read_text())
        remeasured = int(saved.get("remeasured", 0))
        busy = (saved.get("others_cpus") or 0.0) >= BUSY_CPUS
        if not busy or remeasured >= REMEASURE_BUSY:
            return Verdict(name, saved["choice"], "cached", saved.get("detail", ""), saved["data"])
        remeasured += 1
    except (OSError, ValueError, KeyError, TypeError):
        pass
    start, load = time.perf_counter(), load_meter()
    choice, detail, data = measure()
    others = load.others()
    if others is not None and others >= 0.05:
        detail += f" (other processes took {others:.1f} CPU meanwhile)"
    if busy_default is not None and others is not None and others >= BUSY_CPUS and choice != busy_default[0]:
        detail = f"the default kept, the machine was busy while timed ({choice} measured faster: {detail})"
        choice, data = busy_default
    verdict = Verdict(name, choice, "measured", detail, data, seconds=time.perf_counter() - start)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        record = {"choice": choice, "detail": detail, "data": data, "key": dict(key), "cpu": cpu_identity(),
                  "others_cpus": others, "remeasured": remeasured}  # fmt: skip
        tmp.write_text(json.dumps(record, indent=1, default=str))
        os.replace(tmp, path)
    except OSError as e:
        logger.warning(
            "%s: could not cache the verdict in %s (%s); the next start measures again", name, path, e
        )
    return verdict
