"""The supervisor (``engine/utils/supervisor.py``): it waits on its children's pidfds, so a
death reaches the owner's callback at once, by the one blame rule; a stopped child is a
failure only past its deadline; a clean exit or a closed supervisor reports nothing.

The children are plain interpreters (no harness): each waits on its stdin, the lifeline a
``ChildProcess`` holds, so closing it ends them. No test sleeps: each waits on an event.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from engine.utils import supervisor as sup
from engine.utils.processes import ChildProcess, EngineDeadError

DEADLINE_S = 30.0  # generous: a loaded machine; a prompt callback takes milliseconds


def _child(run_dir, role: str = "Worker_DP0_PP0_TP0") -> ChildProcess:
    popen = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    return ChildProcess(role=role, popen=popen, lifeline=popen.stdin, run_dir=run_dir)


class Reported:
    """The owner's side: what the callback got, and an event to wait on."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.calls: list[tuple[EngineDeadError, ChildProcess | None]] = []

    def __call__(self, error: EngineDeadError, child: ChildProcess | None) -> None:
        self.calls.append((error, child))
        self.event.set()


@pytest.fixture
def children(tmp_path):
    made: list[ChildProcess] = []
    yield lambda role="Worker_DP0_PP0_TP0": made.append(_child(tmp_path, role)) or made[-1]
    for child in made:
        child.stop(timeout=5)


def test_a_killed_child_reaches_the_callback_promptly_with_its_root_cause(tmp_path, children):
    reported = Reported()
    supervisor = sup.Supervisor(tmp_path, reported, heartbeat_timeout_s=0)
    victim, bystander = children("Worker_DP0_PP0_TP0"), children("Worker_DP0_PP0_TP1")
    supervisor.watch(victim, rank=0)
    supervisor.watch(bystander, rank=1)
    try:
        victim.popen.send_signal(signal.SIGKILL)
        assert reported.event.wait(DEADLINE_S), "the death never reached the callback"
        [(error, child)] = reported.calls
        assert child is victim and supervisor.failure is error
        assert "process:   Worker_DP0_PP0_TP0" in error.root_cause, error.root_cause
        assert "killed by SIGKILL" in error.root_cause, error.root_cause
        with pytest.raises(EngineDeadError):
            supervisor.raise_if_failed()
        # Once: a later death, or the owner's own report, returns the first failure.
        assert supervisor.fail(bystander.role, bystander.pid, 1) is error
        assert len(reported.calls) == 1
    finally:
        supervisor.close()


def test_a_clean_exit_and_a_closed_supervisor_report_nothing(tmp_path, children):
    reported = Reported()
    supervisor = sup.Supervisor(tmp_path, reported, heartbeat_timeout_s=0)
    leaver, stopped_later = children("APIServer_1"), children("EngineCore_DP0")
    supervisor.watch(leaver, clean_exit=lambda code: code == 0)
    supervisor.watch(stopped_later)
    leaver.lifeline.close()  # it reads end-of-file and exits 0
    assert supervisor.exited_within({"APIServer_1"}, DEADLINE_S) == "APIServer_1"
    supervisor.close()
    stopped_later.stop(timeout=5)
    assert sup.wait_for_exit([leaver, stopped_later], DEADLINE_S) == [leaver, stopped_later]
    assert reported.calls == [] and supervisor.failure is None


def test_a_child_stopped_past_its_deadline_is_a_failure_naming_it(tmp_path, children):
    reported = Reported()
    supervisor = sup.Supervisor(tmp_path, reported, stopped_timeout_s=0.5, heartbeat_timeout_s=0)
    child = children("EngineCore_DP0")
    supervisor.watch(child)
    try:
        os.kill(child.pid, signal.SIGSTOP)
        assert reported.event.wait(DEADLINE_S), "the stopped child was never reported"
        [(error, who)] = reported.calls
        assert who is child and child.poll() is None  # alive, but stopped: still a failure
        assert "stopped by a signal" in error.root_cause and "EngineCore_DP0" in error.root_cause
    finally:
        supervisor.close()
        os.kill(child.pid, signal.SIGCONT)


def test_wait_for_exit_returns_the_first_to_exit_without_polling(tmp_path, children):
    first, other = children("EngineCore_DP0"), children("EngineCore_DP1")
    assert sup.wait_for_exit([first, other], 0.01, first=True) == []  # the deadline, nobody out
    first.lifeline.close()
    assert sup.wait_for_exit([first, other], DEADLINE_S, first=True) == [first]
    assert first.poll() == 0 and other.poll() is None


def test_close_run_dir_waits_for_a_member_that_still_writes_then_removes_the_directory(tmp_path):
    # A worker whose engine core exited at once still writes into the run directory for a
    # moment: the closer waits for it (its pid from its status file), so nothing is left.
    from engine.utils import run_dir as run_dirs
    from tracing import run_dir as contract

    run_dir = tmp_path / "glassbox-1-abcd"
    run_dir.mkdir()
    script = (
        "import sys, pathlib; sys.stdin.read(); "
        f"pathlib.Path({str(run_dir / 'Worker_DP0_PP0_TP0.crash.json')!r}).write_text('{{}}')"
    )
    popen = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE)
    contract.write_status(
        contract.status_path(run_dir, "Worker_DP0_PP0_TP0"),
        contract.ProcessStatus(role="Worker_DP0_PP0_TP0", pid=popen.pid),
    )
    closer = threading.Thread(target=run_dirs.close_run_dir, args=(run_dir,))
    closer.start()
    popen.stdin.close()  # the member writes its last file and exits while the closer waits
    closer.join(DEADLINE_S)
    assert popen.wait(DEADLINE_S) == 0
    assert not run_dir.exists()


def test_wait_for_pids_gone_returns_those_still_running_at_the_deadline():
    popen = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert sup.wait_for_pids_gone([popen.pid], 0.2) == [popen.pid]
        popen.stdin.close()
        assert sup.wait_for_pids_gone([popen.pid], DEADLINE_S) == []
    finally:
        popen.kill()
        popen.wait()
