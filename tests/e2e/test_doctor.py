"""``glassbox doctor`` and what it stands on: the hint catalogue and stacks on demand.

Fast tests read hand-made run directories (no processes); the slow one runs doctor against a
real ``glassbox serve``: healthy (exit 0, every process's stack shows its main loop), then with
its worker SIGSTOPped (exit 1, the stopped worker named, and why it cannot dump).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from engine.cli.main import main
from tracing import catalogue, hints
from tracing import run_dir as contract

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "engine.cli.main"]

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------------ the hint catalogue


def test_every_lifecycle_stage_of_the_catalogue_has_a_hint():
    lifecycle = [s.name for s in catalogue.SPANS.values() if s.level == catalogue.LIFECYCLE]
    missing = [name for name in lifecycle if name not in hints.HINTS]
    assert not missing, f"add these to tracing/hints.py: {missing}"
    assert all(name in catalogue.SPANS for name in hints.HINTS), "a hint for a span the catalogue lacks"
    for name in lifecycle:
        h = hints.HINTS[name]
        assert h.hint and h.typical and h.slow_after_s > 0, name


def test_each_start_up_stage_hint_says_what_the_stage_usually_waits_on():
    assert "import" in hints.HINTS[catalogue.WORKER_WRAPPER_INIT].hint
    assert "rendezvous" in hints.HINTS[catalogue.WORKER_INIT_DEVICE].hint
    assert "disk" in hints.HINTS[catalogue.WORKER_LOAD_MODEL].hint
    assert "profile" in hints.HINTS[catalogue.WORKER_DETERMINE_AVAILABLE_MEMORY].hint
    assert "compile" in hints.HINTS[catalogue.WORKER_COMPILE_OR_WARM_UP_MODEL].hint
    assert "READY" in hints.HINTS[catalogue.ENGINE_CORE_HANDSHAKE].hint


def test_engine_top_alerts_use_the_same_table():
    from tracing.telemetry.collector import STAGE_HINTS, stage_hint

    assert STAGE_HINTS is hints.HINTS
    for name in catalogue.SPANS:
        assert stage_hint(name) == hints.stage_hint(name)


def test_the_deadline_message_carries_the_hint(tmp_path):
    from engine.utils.supervisor import describe_laggard

    manifest = {"roles": [{"role": "EngineCore_DP0", "kind": "engine_core"},
                          {"role": "Worker_DP0_PP0_TP0", "kind": "worker"}]}  # fmt: skip
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    now = time.time()
    for role, stage in (("EngineCore_DP0", "engine_core.init"), ("Worker_DP0_PP0_TP0", "worker.load_model")):
        status = {"role": role, "pid": 7, "stage": stage, "stage_stack": [stage], "entered_at": now - 3}
        (tmp_path / f"{role}.status.json").write_text(json.dumps(status))
    message = describe_laggard(tmp_path)
    assert message.startswith("Worker_DP0_PP0_TP0 (pid 7) has been in stage worker.load_model"), message
    assert hints.HINTS[catalogue.WORKER_LOAD_MODEL].hint in message


def test_the_troubleshooting_doc_carries_the_hint_table_as_generated():
    doc = (ROOT / "docs" / "troubleshooting-hangs.md").read_text()
    m = re.search(r"<!-- hints:begin.*?-->\n(.*?)<!-- hints:end -->", doc, flags=re.S)
    assert m, "docs/troubleshooting-hangs.md lost its hint-table markers"
    assert m.group(1) == hints.render_markdown(), "regenerate: python -m tracing.hints"


# ------------------------------------------------------------------------ stacks on demand


def test_a_process_dumps_every_thread_with_names_on_sigusr1(tmp_path):
    from tracing.stacks import request_dump

    script = tmp_path / "sleeper.py"
    script.write_text(
        "import sys, threading, time\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from tracing.stacks import enable_stack_dumps\n"
        f"enable_stack_dumps({str(tmp_path)!r}, 'Sleeper')\n"
        "threading.Thread(target=time.sleep, args=(60,), name='EngineCoreOutputThread', daemon=True).start()\n"
        "def wait_here():\n"
        "    print('ready', flush=True)  # from inside: the dump cannot come before\n"
        "    time.sleep(60)\n"
        "wait_here()\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        result = request_dump(tmp_path, "Sleeper", proc.pid, timeout_s=2.0)
        assert result.error is None, result.raw
        main_thread = result.threads[0]
        assert main_thread.main and main_thread.name == "MainThread"
        assert main_thread.frames[0][2] == "wait_here"
        assert "EngineCoreOutputThread" in {t.name for t in result.threads}
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = request_dump(tmp_path, "Sleeper", proc.pid, timeout_s=0.3)
        assert stopped.error is not None and not stopped.threads
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(10)


# ------------------------------------------------------------------------ doctor, no processes


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _hand_made_run_dir(base: Path) -> Path:
    run_dir = base / f"glassbox-{_dead_pid()}-abc"
    run_dir.mkdir(parents=True)
    now = time.time()
    roles = [
        contract.PlannedProcess(role="APIServer_0", kind="api_server", counted=True),
        contract.PlannedProcess(role="EngineCore_DP0", kind="engine_core", rank=0),
        contract.PlannedProcess(role="Worker_DP0_PP0_TP0", kind="worker", rank=0),
    ]
    contract.write_manifest(run_dir, contract.Manifest(
        created_at=now - 30, run_dir=str(run_dir), mode="serve", frontend_pid=_dead_pid(), roles=roles,
        expected_process_count=3,
    ))  # fmt: skip
    for role, stage in (("APIServer_0", "engine_core.handshake"), ("EngineCore_DP0", "executor.init"),
                        ("Worker_DP0_PP0_TP0", "worker.load_model")):  # fmt: skip
        contract.write_status(contract.status_path(run_dir, role), contract.ProcessStatus(
            role=role, pid=_dead_pid(), stage=stage, stage_stack=[stage], entered_at=now - 20, updated_at=now - 20,
        ))  # fmt: skip
    contract.write_crash_report(run_dir, contract.CrashReport(
        role="Worker_DP0_PP0_TP0", rank=0, pid=1234, stage="worker.load_model",
        exception="OSError: [Errno 5] Input/output error", traceback="Traceback...\nOSError: [Errno 5]", time=now,
    ))  # fmt: skip
    return run_dir


def test_doctor_on_a_dead_instance_names_the_crashed_worker_and_exits_1(tmp_path, capsys):
    run_dir = _hand_made_run_dir(tmp_path)
    assert main(["doctor", "--run-dir", str(run_dir), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "dead" and report["culprit"] == "Worker_DP0_PP0_TP0"
    assert "OSError" in report["diagnosis"] and "worker.load_model" in report["diagnosis"]
    assert report["expected"] == 3 and report["found"] == 0
    assert main(["doctor", "--run-dir", str(run_dir)]) == 1
    text = capsys.readouterr().out
    assert "diagnosis: Worker_DP0_PP0_TP0" in text and "crash report: OSError" in text


def test_doctor_names_an_injected_fault_and_shows_the_flight_recorder(tmp_path, capsys):
    """A fault that struck is in the status file (``faults``); the dead engine core's last
    steps in ``<role>.flight.json``: doctor says both, in its row, its diagnosis and a table."""
    run_dir = _hand_made_run_dir(tmp_path)
    now = time.time()
    status_path = contract.status_path(run_dir, "Worker_DP0_PP0_TP0")
    status = contract.read_status(status_path)
    status.faults = [contract.StruckFault(spec="worker.load_model:crash@Worker_DP0_PP0_TP0",
                                          stage="worker.load_model", kind="crash", struck_at=now - 19)]  # fmt: skip
    status.runs_as = {"device": "cpu", "dtype": "float32", "compile": "eager", "attention": "TORCH_SDPA"}
    contract.write_status(status_path, status)
    steps = [{"step_id": i, "started_at": now - 25 + i, "duration_ms": 12.5, "num_decode_tokens": 3,
              "num_prefill_tokens": 61, "token_budget": 64, "num_running": 3, "num_waiting": 1, "kv_usage": 0.25}
             for i in range(1, 12)]  # fmt: skip
    (run_dir / "EngineCore_DP0.flight.json").write_text(
        json.dumps({"role": "EngineCore_DP0", "steps": steps})
    )
    assert main(["doctor", "--run-dir", str(run_dir), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (
        "An injected fault struck: worker.load_model:crash@Worker_DP0_PP0_TP0 in worker.load_model"
        in (report["diagnosis"])
    )
    (core,) = [p for p in report["processes"] if p["role"] == "EngineCore_DP0"]
    assert [s["step_id"] for s in core["flight"]] == list(range(4, 12))  # the last 8, oldest first
    (worker,) = [p for p in report["processes"] if p["role"] == "Worker_DP0_PP0_TP0"]
    assert worker["runs_as"] == "cpu float32, eager, attention TORCH_SDPA"  # how it ran its model
    assert main(["doctor", "--run-dir", str(run_dir)]) == 1
    text = capsys.readouterr().out
    assert "injected fault struck: worker.load_model:crash@Worker_DP0_PP0_TP0 in worker.load_model" in text
    assert "last steps of EngineCore_DP0 (flight recorder, oldest first):" in text
    assert "#11: 3 decode + 61 prefill tokens of 64, 3 running, 1 waiting, KV 25%, 12.5 ms" in text


def test_where_a_thread_waits_is_said_in_the_projects_own_code():
    import sysconfig

    from tracing.stacks import where_waits

    lib = sysconfig.get_paths()["stdlib"]
    root = ROOT
    frames = [(f"{lib}/threading.py", 331, "wait"), (str(root / "tracing/faults.py"), 265, "_hang"),
              (str(root / "tracing/stage.py"), 80, "emit"), (str(root / "engine/worker/worker.py"), 170,
              "determine_available_memory"), (str(root / "engine/worker/worker.py"), 90, "run")]  # fmt: skip
    assert where_waits(frames) == (
        "tracing/faults.py:265 in _hang, inside engine/worker/worker.py:170 in determine_available_memory"
    )
    assert where_waits(frames[3:]) == "engine/worker/worker.py:170 in determine_available_memory"
    assert where_waits(frames[:1]) is None  # only a library's frames
    # A step RPC's hang passes through the worker's RPC observer: named with its caller.
    rpc = [*frames[:3], (str(root / "engine/worker/step_telemetry.py"), 101, "observed_rpc"),
           (f"{lib}/contextlib.py", 137, "__enter__"),
           (str(root / "engine/executor/multiproc_executor.py"), 358, "worker_busy_loop")]  # fmt: skip
    assert where_waits(rpc) == (
        "tracing/faults.py:265 in _hang, inside engine/executor/multiproc_executor.py:358 in worker_busy_loop"
    )


def test_doctor_reads_a_half_written_run_dir_without_crashing(tmp_path, capsys):
    run_dir = tmp_path / "glassbox-1-x"
    run_dir.mkdir()
    (run_dir / "manifest.json").write_text('{"roles": [{"role": "EngineCore_DP0"')  # cut off
    (run_dir / "EngineCore_DP0.status.json").write_text("{not json")
    assert main(["doctor", "--run-dir", str(run_dir), "--json"]) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    assert any("manifest.json" in p for p in report["problems"])


def test_doctor_with_nothing_running_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GLASSBOX_RUN_DIR_BASE", str(tmp_path))
    _hand_made_run_dir(tmp_path)
    assert main(["doctor"]) == 1  # nothing serving is not healthy (an ops probe must see it)
    out = capsys.readouterr().out
    assert "no running Glassbox instance" in out and "--run-dir" in out


def test_doctor_bad_run_dir_is_one_line_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--run-dir", str(tmp_path / "nope")])
    assert e.value.code == 2
    assert "--run-dir" in capsys.readouterr().err


# ------------------------------------------------------------------------ doctor, a real server


def _doctor(base: Path) -> tuple[int, dict]:
    env = {**os.environ, "GLASSBOX_RUN_DIR_BASE": str(base)}
    proc = subprocess.run([*CLI, "doctor", "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.slow
def test_doctor_against_a_real_server_healthy_then_with_its_worker_stopped():
    import psutil
    from server_utils import start_server

    base = Path(tempfile.mkdtemp(prefix="gbd", dir="/tmp"))  # short: ipc paths ≤ 107 chars
    server = start_server(base, env={"GLASSBOX_STOPPED_TIMEOUT_S": "600"})  # doctor, not the watch, names it
    worker = None
    try:
        start = time.monotonic()
        code, report = _doctor(base)
        assert time.monotonic() - start < 30
        assert code == 0, report["diagnosis"]
        assert report["healthy"] and report["expected"] == report["found"] == 3
        by_role = {p["role"]: p for p in report["processes"]}
        assert set(by_role) == {"APIServer_0", "EngineCore_DP0", "Worker_DP0_PP0_TP0"}
        main_loops = {"APIServer_0": "run_server", "EngineCore_DP0": "run_busy_loop",
                      "Worker_DP0_PP0_TP0": "worker_main"}  # fmt: skip
        for role, loop in main_loops.items():
            p = by_role[role]
            assert p["state"] == "running" and p["heartbeat_age_s"] is not None, p
            # An idle process polls (the worker for its next RPC, a second at a time): no wait shown.
            assert p["waits"] == [], (role, p["waits"])
            main_thread = next(t for t in p["threads"] if t["main"])
            assert any(f" in {loop}" in f for f in main_thread["frames"]), (role, main_thread["frames"])
        engine_threads = {t["name"] for t in by_role["EngineCore_DP0"]["threads"]}
        assert {"EngineCoreInputThread", "EngineCoreOutputThread"} <= engine_threads

        worker = psutil.Process(by_role["Worker_DP0_PP0_TP0"]["pid"])
        os.kill(worker.pid, signal.SIGSTOP)
        code, report = _doctor(base)
        assert code == 1
        assert report["verdict"] == "stopped" and report["culprit"] == "Worker_DP0_PP0_TP0"
        assert f"pid {worker.pid}" in report["diagnosis"] and "stopped" in report["diagnosis"]
        stopped = next(p for p in report["processes"] if p["role"] == "Worker_DP0_PP0_TP0")
        assert "cannot dump" in stopped["stack_error"] and "kill -CONT" in stopped["stack_error"]
        assert "kill -CONT" in report["hint"]
    finally:
        if worker is not None:
            try:
                os.kill(worker.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        server.kill_group()
        shutil.rmtree(base, ignore_errors=True)


def test_diagnosis_is_never_healthy_while_a_fault_holds_a_stage_or_the_tree_stops():
    """Found by a fresh user: doctor said "healthy" (exit 0) 7 s into a worker hung in a step,
    while the engine core was shutting down, and with engine-top alerting a death."""
    from engine.cli.doctor import ProcessReport, Report, diagnose

    def report(*procs, alerts=()):
        return Report(run_dir="/x", mode="serve", expected=len(procs), found=len(procs), live_telemetry=True,
                      processes=list(procs), alerts=list(alerts), problems=[])  # fmt: skip

    def proc(role, kind, depth, stage=None, faults=()):
        return ProcessReport(role=role, kind=kind, pid=7, rank=0, os_state="running", state="running",
                             stage=stage, time_in_stage_s=3.0 if stage else None, depth=depth,
                             faults=list(faults))  # fmt: skip

    api, core = proc("APIServer_0", "api_server", 1), proc("EngineCore_DP0", "engine_core", 2)
    spec = "worker.execute_model:hang@Worker_DP0_PP0_TP0#20 in worker.execute_model"
    held = report(api, core, proc("Worker_DP0_PP0_TP0", "worker", 3, "worker.execute_model", [spec]))
    diagnose(held)
    assert (held.healthy, held.verdict, held.culprit) == (False, "stuck", "Worker_DP0_PP0_TP0")
    assert (
        "is held in stage worker.execute_model" in held.diagnosis
        and "An injected fault struck" in held.diagnosis
    )
    stopping = report(api, proc("EngineCore_DP0", "engine_core", 2, "engine_core.shutdown"))
    diagnose(stopping)
    assert (stopping.healthy, stopping.verdict) == (False, "stopping")
    dying = report(api, core, alerts=[{"severity": "error", "role": "Worker_DP0_PP0_TP0",
                                       "message": "Worker_DP0_PP0_TP0 (pid 9) is dead: exited with code 1",
                                       "hint": "its crash report says why"}])  # fmt: skip
    diagnose(dying)
    assert (dying.healthy, dying.verdict) == (False, "unhealthy") and "is dead" in dying.diagnosis
    fine = report(api, core)
    diagnose(fine)
    assert fine.healthy and fine.verdict == "healthy"
