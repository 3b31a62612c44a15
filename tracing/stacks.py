"""Stacks on demand: every Glassbox process dumps the Python stack of each thread on SIGUSR1.

``enable_stack_dumps(run_dir, role)`` is called once at process start, by the process harness
(``engine.utils.process_harness``: every child, a Ray worker actor, the API server, a headless
node and the offline ``LLM``), right after the run directory exists. It opens ``<run_dir>/<role>.stacks``
(append mode, kept open) and registers ``faulthandler`` on SIGUSR1, so the dump is written by
C code inside the signal handler: it works even when the main thread is stuck in a native
call holding the GIL, which is exactly when a stack is wanted. The file starts with a header
line (role, pid, the main thread's id, time).

faulthandler writes raw tracebacks and names threads only by id (``Thread 0x00007f...``).
So, where the process can (the main thread registers), a Python handler is chained behind
it: as soon as the interpreter runs Python again it appends one ``# threads`` line, the JSON
map of thread id → thread name. A process that never gets there still has its dump.

``request_dump(run_dir, role, pid, timeout_s)`` is the reader's side (``glassbox doctor``):
it appends a request marker, sends SIGUSR1, waits (bounded) for the dump to appear after the
marker and returns it parsed (``parse_dump``: threads with names and frames, most recent call
first). A stopped process (SIGSTOP) cannot dump until continued: the caller says so.

vLLM has no counterpart (its users attach py-spy by hand). Imports no engine and no torch.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import signal
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

STACKS_SUFFIX = ".stacks"
DUMP_SIGNAL = signal.SIGUSR1
HEADER_PREFIX = "# glassbox stacks"
REQUEST_PREFIX = "# dump requested"
THREADS_PREFIX = "# threads "

_file: IO[str] | None = None  # the open stacks file of this process (kept for faulthandler)
_lock = threading.Lock()


def stacks_path(run_dir: str | os.PathLike[str], role: str) -> Path:
    """Where process ``role`` writes its stack dumps."""
    return Path(run_dir) / f"{role}{STACKS_SUFFIX}"


def enable_stack_dumps(run_dir: str | os.PathLike[str], role: str) -> Path | None:
    """Make this process dump every thread's stack into ``<run_dir>/<role>.stacks`` on SIGUSR1.

    Called again (a second ``LLM`` in one process), it moves the dumps to the new file.
    Never raises: without a writable run directory it does nothing and returns None.
    """
    global _file
    path = stacks_path(run_dir, role)
    try:
        f = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - kept open for faulthandler
    except OSError:
        return None
    with _lock:
        main = threading.main_thread().ident or 0
        f.write(
            f"{HEADER_PREFIX} role={role} pid={os.getpid()} main_thread=0x{main:016x} since={time.time():.3f}\n"
        )
        f.flush()
        chain = False
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, OSError):
                if signal.getsignal(DUMP_SIGNAL) is not _write_thread_names:
                    signal.signal(DUMP_SIGNAL, _write_thread_names)
                chain = True
        try:
            faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=chain)
        except (RuntimeError, ValueError, OSError):
            f.close()
            return None
        old, _file = _file, f
    if old is not None:
        with contextlib.suppress(OSError):
            old.close()
    return path


def _write_thread_names(signum: int, frame: object) -> None:
    """Runs (as Python) after faulthandler's dump: append the thread id → name map."""
    f = _file
    if f is None:
        return
    names = {f"0x{t.ident:016x}": t.name for t in threading.enumerate() if t.ident is not None}
    with contextlib.suppress(OSError, ValueError):
        f.write(THREADS_PREFIX + json.dumps(names) + "\n")
        f.flush()


# ---------------------------------------------------------------------- reading dumps


@dataclass
class ThreadStack:
    """One thread of a dump. ``frames``: ``(file, line, function)``, most recent call first."""

    ident: str
    name: str | None = None
    current: bool = False  # the thread that ran the signal handler
    main: bool = False
    frames: list[tuple[str, int, str]] = field(default_factory=list)

    @property
    def top(self) -> str | None:
        """The innermost frame as ``file:line in function``, or None."""
        if not self.frames:
            return None
        file, line, func = self.frames[0]
        return f"{file}:{line} in {func}"


_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_MAIN = re.compile(r"main_thread=(0x[0-9a-fA-F]+)")


def parse_dump(text: str, main_ident: str | None = None) -> list[ThreadStack]:
    """The threads of one faulthandler dump (``text``: the dump, optionally followed by a
    ``# threads`` line), main thread first."""
    threads: list[ThreadStack] = []
    names: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith(THREADS_PREFIX):
            with contextlib.suppress(ValueError):
                names.update(json.loads(line[len(THREADS_PREFIX) :]))
            continue
        m = _THREAD.match(line)
        if m:
            threads.append(ThreadStack(ident=m.group(2).lower(), current=m.group(1) == "Current thread"))
            continue
        m = _FRAME.match(line)
        if m and threads:
            threads[-1].frames.append((m.group(1), int(m.group(2)), m.group(3)))
    for t in threads:
        t.name = names.get(t.ident)
        t.main = t.ident == (main_ident or "").lower() or t.name == "MainThread"
    threads.sort(key=lambda t: not t.main)
    return threads


def main_thread_ident(path: str | os.PathLike[str]) -> str | None:
    """The main thread's id from the stacks file's last header line."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    found = None
    for line in text.splitlines():
        if line.startswith(HEADER_PREFIX):
            m = _MAIN.search(line)
            if m:
                found = m.group(1)
    return found


@dataclass
class DumpResult:
    """What ``request_dump`` got: ``threads`` (parsed), ``raw`` text, or ``error`` (why none)."""

    threads: list[ThreadStack] = field(default_factory=list)
    raw: str = ""
    error: str | None = None


_PROJECT = Path(__file__).resolve().parents[1]  # the checkout: engine/, tracing/, tui/
_LIBRARY = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
# Glassbox's own plumbing a stack passes through (a fault, a bounded wait, a stage, the
# worker's RPC observer): a frame there is named with the first caller outside them.
_HELPERS = ("tracing/faults.py", "tracing/waits.py", "tracing/stage.py", "engine/worker/step_telemetry.py")


_PACKAGES = tuple(str(_PROJECT / name) + os.sep for name in ("engine", "tracing", "tui"))


def _is_own(file: str) -> bool:
    """Glassbox's code (also when installed into site-packages), or a script: not a library's."""
    return file.startswith(_PACKAGES) or not (file.startswith(_LIBRARY) or file.startswith("<"))


def short_path(file: str) -> str:
    """A file of this checkout relative to it (``engine/worker/worker.py``); others as given."""
    try:
        return str(Path(file).resolve().relative_to(_PROJECT))
    except (ValueError, OSError):
        return file


def where_waits(frames: list[tuple[str, int, str]]) -> str | None:
    """Where a thread waits, in Glassbox's own code: the innermost frame outside the standard
    library and installed packages (``engine/frontend/core_client.py:765 in _run``); when
    that is a helper (an injected fault, a bounded wait, the stage hook), also the engine
    frame it serves (``..., inside engine/worker/worker.py:170 in determine_available_memory``).
    ``frames``: ``ThreadStack.frames``, most recent call first. None when every frame is a
    library's."""
    own = [(short_path(f), n, fn) for f, n, fn in frames if _is_own(f)]
    if not own:
        return None
    file, line, func = own[0]
    text = f"{file}:{line} in {func}"
    if file in _HELPERS:
        caller = next(((f, n, fn) for f, n, fn in own if f not in _HELPERS), None)
        if caller is not None:
            text += f", inside {caller[0]}:{caller[1]} in {caller[2]}"
    return text


def request_dump(run_dir: str | os.PathLike[str], role: str, pid: int, timeout_s: float = 1.0) -> DumpResult:
    """Ask process ``pid`` (role ``role``) for its stacks and read them back (bounded wait).

    Appends a ``# dump requested`` marker to its stacks file, sends SIGUSR1 and waits up to
    ``timeout_s`` for a dump after the marker (and a little longer for the thread-name line).
    Never raises.
    """
    path = stacks_path(run_dir, role)
    if not path.exists():
        return DumpResult(error=f"no {path.name}: stack dumps were not enabled in this process")
    try:
        with open(path, "a", encoding="utf-8") as f:
            offset = f.tell()
            f.write(f"{REQUEST_PREFIX} by pid {os.getpid()} at {time.time():.3f}\n")
    except OSError as e:
        return DumpResult(error=f"cannot write {path}: {e}")
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return DumpResult(error=f"pid {pid} is gone")
    except PermissionError as e:
        return DumpResult(error=f"cannot signal pid {pid}: {e}")
    deadline = time.monotonic() + timeout_s
    names_deadline = None
    text = ""
    while True:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                f.seek(offset)
                text = f.read()
        except OSError:
            text = ""
        has_dump = "(most recent call first)" in text
        if has_dump and THREADS_PREFIX in text:
            break
        now = time.monotonic()
        if has_dump and names_deadline is None:
            names_deadline = min(deadline + 0.5, now + 0.3)  # the name map follows, if Python runs
        if (names_deadline is not None and now >= names_deadline) or (not has_dump and now >= deadline):
            break
        time.sleep(0.02)
    # Only the first dump after our marker (another reader may have asked meanwhile).
    body = text.split("\n", 1)[1] if "\n" in text else ""
    nxt = body.find(REQUEST_PREFIX)
    if nxt >= 0:
        body = body[:nxt]
    if "(most recent call first)" not in body:
        return DumpResult(raw=body, error=f"no dump within {timeout_s:g} s")
    return DumpResult(threads=parse_dump(body, main_thread_ident(path)), raw=body)


__all__ = [
    "DUMP_SIGNAL",
    "STACKS_SUFFIX",
    "DumpResult",
    "ThreadStack",
    "enable_stack_dumps",
    "main_thread_ident",
    "parse_dump",
    "request_dump",
    "stacks_path",
]
