"""GLASSBOX_STARTUP_STAGE_DELAY_S: start-up in slow motion, shown as a deliberate pause."""

from __future__ import annotations

import threading
import time

import pytest

import tracing
from engine import envs
from tracing import catalogue
from tracing.run_dir import read_status
from tracing.slow_motion import ENV, install_stage_delay, pause_what, paused_stages, uninstall_stage_delay
from tracing.stage import add_stage_hook


@pytest.fixture(autouse=True)
def _clean():
    yield
    uninstall_stage_delay()
    tracing.shutdown_tracing()


def test_the_variable_is_checked_in_the_first_process(monkeypatch):
    for bad in ("-1", "soon", "nan", "inf"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=f"{ENV}=.*expected a number of seconds >= 0"):
            envs.validate_all()
    monkeypatch.setenv(ENV, "0.5")
    assert envs.GLASSBOX_STARTUP_STAGE_DELAY_S == 0.5
    monkeypatch.delenv(ENV)
    assert envs.GLASSBOX_STARTUP_STAGE_DELAY_S == 0.0


def test_start_up_stages_pause_and_shutdown_and_step_stages_do_not():
    stages = paused_stages()
    assert {
        catalogue.WORKER_LOAD_MODEL,
        catalogue.ENGINE_CORE_HANDSHAKE,
        catalogue.DP_COORDINATOR_INIT,
    } <= stages
    assert catalogue.ENGINE_CORE_SHUTDOWN not in stages and catalogue.ENGINE_CORE_STEP not in stages


def test_a_stage_pauses_first_and_the_status_file_and_wait_say_it_is_on_purpose(tmp_path, monkeypatch):
    status = tmp_path / "Worker_DP0_PP0_TP0.status.json"
    monkeypatch.setenv(ENV, "0.3")
    tracing.setup_tracing(
        "Worker_DP0_PP0_TP0", status_file=str(status)
    )  # arms the pause, as in every process
    events = []
    remove = add_stage_hook(lambda event, name, attrs: events.append((event, name)))
    seen = {}

    def look():  # what glassbox ps reads, while the pause lasts
        time.sleep(0.15)
        seen["status"] = read_status(status)

    watcher = threading.Thread(target=look)
    watcher.start()
    t0 = time.monotonic()
    with tracing.stage(catalogue.WORKER_LOAD_MODEL):
        entered_work = time.monotonic()
    watcher.join()
    remove()
    assert entered_work - t0 >= 0.3  # the stage's work came after its pause
    during = seen["status"]
    assert during.stage == catalogue.WORKER_LOAD_MODEL and during.pause is not None
    assert (during.pause.stage, during.pause.seconds, during.pause.env) == (
        catalogue.WORKER_LOAD_MODEL,
        0.3,
        ENV,
    )
    assert read_status(status).pause is None  # over once the stage's work began
    what = pause_what(catalogue.WORKER_LOAD_MODEL, 0.3)
    assert what == f"a deliberate pause before worker.load_model ({ENV}=0.3)"
    assert ("wait_start", what) in events and ("wait_end", what) in events
    assert not read_status(status).faults  # a pause, not a fault


def test_no_pause_unless_asked():
    assert install_stage_delay("LLM", "") == 0.0 and install_stage_delay("LLM", "0") == 0.0
    t0 = time.monotonic()
    with tracing.stage(catalogue.WORKER_LOAD_MODEL):
        pass
    assert time.monotonic() - t0 < 0.2


def test_ps_shows_the_pause_beside_the_stage(tmp_path):
    from rich.console import Console

    from engine.cli.ps import render_table
    from tracing.instances import InstanceInfo, ProcessInfo

    row = ProcessInfo(role="EngineCore_DP0", kind="engine_core", pid=1, state="sleeping", counted=True,
                      planned=True, stage=catalogue.EXECUTOR_INIT,
                      pause={"stage": catalogue.EXECUTOR_INIT, "seconds": 2.0, "env": ENV})  # fmt: skip
    console = Console(width=200, record=True)
    inst = InstanceInfo(run_dir=tmp_path, mode="serve", frontend_pid=1, stale=False, created_at=None,
                        expected_process_count=1, processes=[row])  # fmt: skip
    render_table([inst], console)
    assert f"executor.init (paused on purpose: {ENV}=2)" in console.export_text()


def test_engine_top_shows_a_wait_for_the_pause_and_no_slow_stage_alert():
    from tracing.telemetry.collector import compute_alerts
    from tracing.telemetry.state import LiveState, OpenStageInfo, ProcessLive, WaitInfo

    now = 1_800_000_000.0
    what = pause_what(catalogue.WORKER_WRAPPER_INIT, 8.0)
    stages = [OpenStageInfo(name=catalogue.WORKER_WRAPPER_INIT, level="lifecycle", thread="MainThread",
                            entered_at=now - 7.0)]  # fmt: skip
    worker = ProcessLive(role="Worker_DP0_PP0_TP0", kind="worker", pid=3, state="starting", stages=stages,
                         waits=[WaitInfo(what=what, started_at=now - 7.0, timeout_s=21.0)])  # fmt: skip
    state = LiveState(now=now, processes={worker.role: worker})
    assert compute_alerts(state) == []  # 7 s in a 5 s stage, on purpose: no alert
    worker.waits = []  # the same 7 s without the pause: slow
    assert [a.message for a in compute_alerts(state)] == [
        "Worker_DP0_PP0_TP0 in worker.wrapper_init for 7.0 s (usually under 5.0 s)"
    ]
