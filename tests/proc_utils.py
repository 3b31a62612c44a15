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
