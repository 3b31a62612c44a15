"""engine-top after a process of the tree dies, read the way a person reads the screen.

Each test replays what a real failure of a default ``glassbox serve`` (APIServer_0,
EngineCore_DP0, Worker_DP0_PP0_TP0) leaves behind — the run directory's manifest, status
and crash files written with the engine's own writers, the telemetry the processes published
(heartbeats, the parent's word of how its child ended), and the post-mortem the tree keeps
before removing its run directory (``root_cause.txt`` as the server printed it, copied from
real runs) — through the collector's refresh, then renders the alerts and the process rows.

Found by a new user: with the worker SIGKILLed, the alert's hint sent them to a crash report
a SIGKILLed process never writes; once the tree was gone, the root cause vanished, the first
alert blamed APIServer_0 ("is dead: the instance is gone"), and after a SIGSTOP teardown the
culprit worker's row read "exited ✓ exited with code 0".
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from rich.console import Console

from tracing import hints
from tracing import run_dir as rd
from tracing.telemetry import collector as col
from tracing.telemetry.events import Heartbeat, OpenStageInfo, StageLeft
from tracing.telemetry.state import CLEAN_EXIT, TORN_DOWN, LiveState
from tui import views

API, ENGINE, WORKER = "APIServer_0", "EngineCore_DP0", "Worker_DP0_PP0_TP0"
KINDS = {API: "api_server", ENGINE: "engine_core", WORKER: "worker"}

# root_cause.txt of real runs (~/.cache/glassbox/post_mortem/*/root_cause.txt): a worker
# SIGSTOPped until GLASSBOX_STOPPED_TIMEOUT_S=5 tore the tree down, and one SIGKILLed.
STOPPED_ROOT_CAUSE = """\
======================== Glassbox root cause ========================
process:   Worker_DP0_PP0_TP0 (rank 0)
pid:       {pid}
stage:     none (serving or idle; last lifecycle stage finished: worker.compile_or_warm_up_model)
exit:      still running (stopped by a signal (SIGSTOP?) for 5 s, over GLASSBOX_STOPPED_TIMEOUT_S=5)
exception: none (it was still alive)
=====================================================================
"""
KILLED_ROOT_CAUSE = """\
======================== Glassbox root cause ========================
process:   Worker_DP0_PP0_TP0 (rank 0)
pid:       {pid}
stage:     worker.execute_model (step 336)
exit:      killed by SIGKILL (exit status -9)
exception: none recorded (killed from outside, or died before reporting)
=====================================================================
"""
ENGINE_DEAD = "EngineDeadError: The engine died; see the root cause below."


def _dead_pid() -> int:
    """The pid of a process that has ended (and was reaped)."""
    p = subprocess.Popen(["true"])
    p.wait(timeout=10)
    return p.pid


@pytest.fixture
def tree(monkeypatch):
    """A run directory under a short base (ipc paths), its post-mortems under a cache root of
    its own; the API server and engine core alive (this pid), the worker's pid gone."""
    base = Path(tempfile.mkdtemp(prefix="gbt-", dir="/tmp"))
    monkeypatch.setenv(rd.ENV_CACHE_ROOT, str(base / "cache"))
    run_dir = rd.make_run_dir(base)
    pids = {API: os.getpid(), ENGINE: os.getpid(), WORKER: _dead_pid()}
    rd.write_manifest(
        run_dir,
        rd.Manifest(
            created_at=time.time(),
            run_dir=str(run_dir),
            mode="serve",
            frontend_pid=os.getpid(),
            roles=[rd.PlannedProcess(role=r, kind=k, rank=0, pid=pids[r]) for r, k in KINDS.items()],
            expected_process_count=3,
            api_server_count=1,
            data_parallel_size=1,
        ),
    )
    for role, pid in pids.items():
        rd.write_status(rd.status_path(run_dir, role), rd.ProcessStatus(role=role, rank=0, pid=pid,
                                                                        updated_at=time.time()))  # fmt: skip
    c = col.Collector(run_dir, base=base)
    try:
        yield run_dir, pids, c
    finally:
        if c._sub is not None:
            c._sub.close()
        rd.remove_run_dir(base)


def _beat(c: col.Collector, role: str, pid: int, seq: int, **kw) -> None:
    with c._lock:
        c._state.apply(Heartbeat(role=role, pid=pid, seq=seq, t=time.time(), cpu_percent=1.0,
                                 rss_bytes=1 << 20, num_threads=4, **kw))  # fmt: skip


def _serving(c: col.Collector, pids: dict[str, int]) -> None:
    for role, pid in pids.items():
        _beat(c, role, pid, 0)


def _tree_ends_after_failure(run_dir: Path, pids: dict[str, int], root_cause: str) -> Path:
    """What the tree does as it ends after a failure (``engine/utils/run_dir.close_run_dir``):
    the engine core's echo crash report, the root cause saved, the post-mortem kept, the run
    directory removed."""
    rd.write_crash_report(run_dir, rd.CrashReport(role=ENGINE, rank=0, pid=pids[ENGINE], exception=ENGINE_DEAD,
                                                  time=time.time(), caused_by=WORKER))  # fmt: skip
    rd.write_root_cause(run_dir, root_cause.format(pid=pids[WORKER]))
    kept = rd.keep_post_mortem(run_dir, rd.post_mortem_root(), reason="the engine died")
    assert kept is not None
    rd.remove_run_dir(run_dir)
    return kept


def _screen(state: LiveState) -> str:
    console = Console(record=True, width=160, color_system=None, force_terminal=False)
    console.print(views.render_processes(state))
    console.print(views.render_alerts(state))
    return console.export_text()


def _alert_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith(("✗", "⚠"))]


def _row(text: str, role: str) -> str:
    return next(line for line in text.splitlines() if role in line and "pid" not in line.split(role)[0])


def test_a_sigkilled_worker_is_the_root_cause_and_its_hint_says_it_wrote_no_crash_report(tree):
    run_dir, pids, c = tree
    c._refresh()
    _serving(c, pids)
    # kill -9 of the worker: its parent reaped it and says how it ended.
    _beat(c, ENGINE, pids[ENGINE], 1, exited={WORKER: "killed by SIGKILL (exit status -9)"})
    c._refresh()
    state = c.snapshot()
    assert state.status == "attached"
    first = state.alerts[0]
    assert first.message.startswith(f"root cause: {WORKER}"), state.alerts
    dead = next(a for a in state.alerts if a.message.startswith(f"{WORKER} (pid {pids[WORKER]}) is dead"))
    assert "killed by SIGKILL (exit status -9)" in dead.message
    assert dead.hint == hints.NO_CRASH_REPORT  # doctor's words: it wrote none
    assert not any("crash.json" in a.hint for a in state.alerts)

    # The tree goes down with it and is gone: the instance's root cause stays first.
    kept = _tree_ends_after_failure(run_dir, pids, KILLED_ROOT_CAUSE)
    c._refresh()
    c._refresh()  # and stays so on every later pass
    state = c.snapshot()
    assert state.status == "gone"
    text = _screen(state)
    lines = _alert_lines(text)
    assert lines[0].startswith(
        f"✗ ERROR {WORKER}: root cause: {WORKER} in worker.execute_model (step 336): killed by SIGKILL"
    ), lines
    assert state.alerts[0].hint.startswith(hints.NO_CRASH_REPORT)
    assert str(kept / rd.ROOT_CAUSE) in state.alerts[0].hint
    assert not any(a.role == API and a.severity == "error" for a in state.alerts)  # not blamed
    assert not any("<role>.crash.json" in a.hint for a in state.alerts)
    torn = next(a for a in state.alerts if a.message.startswith(TORN_DOWN))
    assert torn.severity == "warning" and API in torn.message and ENGINE in torn.message
    assert "killed by SIGKILL (exit status -9)" in _row(text, WORKER)
    assert "torn down with the instance" in _row(text, API)


def test_after_a_sigstop_teardown_the_stopped_worker_stays_the_root_cause_not_a_clean_exit(tree):
    run_dir, pids, c = tree
    c._refresh()
    _serving(c, pids)
    # GLASSBOX_STOPPED_TIMEOUT_S passed: the engine core fails (its last error names the
    # worker), the teardown continues and stops the worker, which exits with status 0.
    with c._lock:
        c._state.apply(StageLeft(role=ENGINE, pid=pids[ENGINE], seq=1, t=time.time(), name="engine_core.step",
                                 duration_ms=5000.0, error=f"{ENGINE_DEAD} process: {WORKER} (rank 0)"))  # fmt: skip
    _beat(c, WORKER, pids[WORKER], 1, exited={WORKER: CLEAN_EXIT})
    kept = _tree_ends_after_failure(run_dir, pids, STOPPED_ROOT_CAUSE)
    c._refresh()
    c._refresh()
    state = c.snapshot()
    assert state.status == "gone"
    text = _screen(state)
    lines = _alert_lines(text)
    assert lines[0] == (
        f"✗ ERROR {WORKER}: root cause: {WORKER}: stopped by a signal (SIGSTOP?) for 5 s, over "
        "GLASSBOX_STOPPED_TIMEOUT_S=5"
    ), lines
    assert state.alerts[0].hint.startswith(hints.GONE_STOPPED)
    assert not any(a.role == API and a.severity == "error" for a in state.alerts)
    assert not any("<role>.crash.json" in a.hint for a in state.alerts)
    # one alert for the worker: the root cause (its row says the teardown did the rest), then
    # one warning for those torn down with it
    assert [(a.severity, a.role) for a in state.alerts] == [("error", WORKER), ("warning", None)]
    assert state.alerts[1].message == f"{TORN_DOWN} after {WORKER} failed: {API}, {ENGINE}"
    worker = state.processes[WORKER]
    assert worker.state == "dead" and worker.exit_description != CLEAN_EXIT
    assert "✓" not in _row(text, WORKER) and "exited with code 0" not in _row(text, WORKER)
    assert "dead" in _row(text, WORKER) and "root cause" in _row(text, WORKER)
    for role in (API, ENGINE):  # torn down with it: not at fault, and not a clean stop either
        assert state.processes[role].torn_down and state.processes[role].state == "dead"
        assert "torn down with the instance" in _row(text, role) and "✓" not in _row(text, role)
    # The engine core's echo crash report is read where the post-mortem kept it.
    assert state.processes[ENGINE].crash_file == str(kept / f"{ENGINE}{rd.CRASH_SUFFIX}")


def test_a_dead_process_hint_names_its_crash_report_only_when_it_wrote_one():
    state = LiveState(now=100.0, status="attached")
    for role, how in ((WORKER, "killed by SIGKILL (exit status -9)"), (ENGINE, "exited with code 1"),
                      ("Worker_DP0_PP0_TP1", "exited with code 1")):  # fmt: skip
        p = state._process(role)
        p.pid, p.exit_description = 7, how
    state.processes[ENGINE].crash_file = "/run/x/EngineCore_DP0.crash.json"
    state.processes[ENGINE].crash_caused_by = WORKER
    state.processes["Worker_DP0_PP0_TP1"].crash_file = "/run/x/Worker_DP0_PP0_TP1.crash.json"
    state.derive(100.0)
    by_role = {a.role: a for a in col.compute_alerts(state)}
    assert by_role[WORKER].hint == hints.NO_CRASH_REPORT
    assert by_role["Worker_DP0_PP0_TP1"].hint == hints.DEAD.replace(
        "<role>.crash.json", "/run/x/Worker_DP0_PP0_TP1.crash.json"
    )
    assert by_role[ENGINE].hint.startswith(f"it stopped because {WORKER} failed")


def test_a_parents_word_of_how_its_child_ended_reaches_the_blame_rule():
    assert col.exit_status("killed by SIGKILL (exit status -9)") == -9
    assert col.exit_status("terminated by SIGTERM from outside the tree (exit status 143)") == 143
    assert col.exit_status("exited with code 1") == 1
    assert col.exit_status(CLEAN_EXIT) == 0
    assert col.exit_status("the instance is gone") is None
    state = LiveState(now=100.0)
    p = state._process(WORKER)
    p.exit_description = "killed by SIGKILL (exit status -9)"
    p.stages = [
        OpenStageInfo(name="worker.execute_model", level="step", thread="MainThread", entered_at=99.0)
    ]
    state.derive(100.0)
    assert col._known_troubles(state)[WORKER].returncode == -9
