"""Helpers for tests that watch real process trees."""

from __future__ import annotations

import time

import psutil


def titled_processes(pid: int, include_self: bool = False) -> dict[str, psutil.Process]:
    """``{title: process}`` for the ``glassbox::`` processes under ``pid`` (full titles from
    the command line, padding stripped: ``comm`` is cut at 15 characters)."""
    root = psutil.Process(pid)
    procs = ([root] if include_self else []) + root.children(recursive=True)
    out = {}
    for proc in procs:
        try:
            title = " ".join(proc.cmdline()).strip()
        except psutil.Error:
            continue
        if title.startswith("glassbox::"):
            out[title] = proc
    return out


def wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    """The pids still alive after ``timeout`` seconds (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.05)
    return alive


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def session_members(sid: int) -> list[int]:
    """Pids of the live (not zombie) processes of session ``sid``: a server started with
    ``start_new_session=True`` leads its own session, and every process of its tree stays in it."""
    import os

    pids = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                pids.append(p.pid)
        except (psutil.Error, OSError):
            pass
    return pids


def generate_killing_on_first_finish(llm, pid: int):
    """Generate a 1-token and a 400-token request with ``llm``; when the short one finishes
    (an event, not a sleep), SIGKILL ``pid``. Returns the ``EngineDeadError`` the generate
    raised and the seconds it took. Fails the test if generate finishes instead."""
    import os
    import signal

    import pytest

    from engine import SamplingParams
    from engine.utils.processes import EngineDeadError

    params = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=400, ignore_eos=True)]

    def kill_on_first_finish(done: int, total: int) -> None:
        if done == 1:
            os.kill(pid, signal.SIGKILL)

    start = time.monotonic()
    with pytest.raises(EngineDeadError) as err:
        llm.generate(["a", "b"], params, use_tqdm=kill_on_first_finish)
    return err.value, time.monotonic() - start


def write_every_way(payload: bytes, *, run_dir, role: str) -> None:
    """A process-harness target (``spawn_process(role, "proc_utils:write_every_way", ...)``):
    writes to stdout and stderr the ways code in a worker does, each line tagged with ``payload``."""
    import logging
    import sys
    import warnings

    from engine.logger import init_logger

    tag = payload.decode()
    print(f"{tag} print")
    print(f"{tag} print two lines, first", f"{tag} print two lines, second", sep="\n")
    sys.stdout.write(f"{tag} written ")  # one line written in three pieces
    sys.stdout.write("in ")
    sys.stdout.write("pieces\n")
    sys.stdout.flush()
    warnings.warn(f"{tag} warnings.warn", UserWarning, stacklevel=1)
    logging.getLogger("thirdparty_bare").warning("%s third-party logger, no handler", tag)
    library = logging.getLogger("thirdparty_lib")  # a library that adds its own handler, as transformers does
    library.addHandler(logging.StreamHandler())
    library.propagate = False
    library.warning("%s third-party logger with its own handler", tag)
    init_logger("engine.test_child").warning("%s glassbox logger", tag)
    sys.stderr.flush()
