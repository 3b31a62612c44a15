"""``engine.cli.doctor.diagnose`` on a hand-made report: the words doctor prints under
``diagnosis:`` and ``what to check:`` for a culprit the blame rule named."""

from __future__ import annotations

import pytest

from engine.cli import doctor
from tracing import blame, hints
from tracing.blame import Blame


def _report(verdict: str) -> doctor.Report:
    engine = doctor.ProcessReport(role="EngineCore_DP1", kind="engine_core", pid=1906, rank=1,
                                  os_state="exited", state="dead", stage="engine_core.dummy_step")  # fmt: skip
    report = doctor.Report(run_dir="/tmp/x", mode="serve", expected=1, found=0, live_telemetry=False,
                           processes=[engine], alerts=[], problems=[])  # fmt: skip
    report.blame = Blame(role="EngineCore_DP1", verdict=verdict, stage="engine_core.dummy_step",
                         reason="EngineStepHung: the step ran too long", pid=1906)  # fmt: skip
    return report


@pytest.mark.parametrize("verdict", ["failed", "dead"])
def test_a_dead_culprits_hint_and_its_stages_hint_are_two_sentences(verdict: str) -> None:
    report = _report(verdict)
    doctor.diagnose(report)
    stage_words = f"engine_core.dummy_step: {hints.stage_hint('engine_core.dummy_step').hint}."
    assert (report.culprit, report.hint) == ("EngineCore_DP1", f"{hints.DEAD}. {stage_words}")


# --------------------------------------------------------------------------- a tree that is gone
#
# `glassbox doctor --last` reads a kept post-mortem: the run directory's files as the teardown
# left them, and the root-cause block the instance printed when it noticed the failure. Built
# here as the engine builds them: the block by ``processes.format_root_cause`` (what the
# supervisor calls), the post-mortem by ``tracing.run_dir.keep_post_mortem`` (what
# ``close_run_dir`` calls), every pid dead (the teardown killed them).

WORKER = "Worker_DP0_PP0_TP0"
STOPPED = "stopped by a signal (SIGSTOP?) for 5 s, over GLASSBOX_STOPPED_TIMEOUT_S=5"
FROZEN = "frozen: running but no heartbeat for 31 s, over GLASSBOX_HEARTBEAT_TIMEOUT_S=30"


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=30)
    return p.pid


def _gone_tree(base, cache, *, root_cause, in_step: int | None = None, worker_stage: str | None = None):
    """A served tree whose worker failed, torn down: its post-mortem kept under ``cache``, its
    run directory removed. ``root_cause(run_dir, worker_pid)``: the block the instance printed.
    ``in_step``: the worker was inside that step's ``execute_model`` RPC (its ``.comm``)."""
    import os
    import shutil
    import time

    from tracing import run_dir as contract

    run_dir = base / f"glassbox-{_dead_pid()}-{os.urandom(3).hex()}"
    run_dir.mkdir(parents=True)
    now = time.time()
    roles = [("APIServer_0", "api_server"), ("EngineCore_DP0", "engine_core"), (WORKER, "worker")]
    planned = [contract.PlannedProcess(role=r, kind=k, rank=0 if k != "api_server" else None, counted=True,
                                       dp_rank=0 if k == "worker" else None, pp_rank=0 if k == "worker" else None,
                                       tp_rank=0 if k == "worker" else None) for r, k in roles]  # fmt: skip
    contract.write_manifest(run_dir, contract.Manifest(created_at=now - 60, run_dir=str(run_dir), mode="serve",
                                                       frontend_pid=_dead_pid(), roles=planned,
                                                       expected_process_count=3))  # fmt: skip
    pids = {}
    for role, _ in roles:
        pids[role] = _dead_pid()
        contract.write_status(contract.status_path(run_dir, role), contract.ProcessStatus(
            role=role, pid=pids[role], updated_at=now - 1, stage=worker_stage if role == WORKER else None,
            last_finished=contract.FinishedStage(name="worker.compile_or_warm_up_model", finished_at=now - 50),
        ))  # fmt: skip
    if in_step is not None:
        board = contract.CommBoard(run_dir, WORKER)
        for _ in range(in_step):
            board.rpc_enter("execute_model")
            board.rpc_exit()
        board.rpc_enter("execute_model")  # SIGKILLed in here
        board.close()
    # The engine core stopped because its worker did: an echo, never the culprit.
    contract.write_crash_report(run_dir, contract.CrashReport(
        role="EngineCore_DP0", rank=0, pid=pids["EngineCore_DP0"], caused_by=WORKER, time=now,
        exception="EngineDeadError: The engine died; see the root cause below.",
    ))  # fmt: skip
    contract.write_root_cause(run_dir, root_cause(run_dir, pids[WORKER]))
    kept = contract.keep_post_mortem(run_dir, cache / "post_mortem", reason="the engine died")
    shutil.rmtree(run_dir)
    assert kept is not None
    return kept, pids[WORKER]


def _doctor_last(capsys, *flags: str):
    from engine.cli.main import main

    code = main(["doctor", "--last", *flags])
    return code, capsys.readouterr().out


@pytest.mark.timeout(60)
def test_doctor_last_says_a_stopped_worker_the_teardown_killed_was_stopped(run_and_cache_dirs, capsys):
    """``kill -STOP`` of the worker: its engine core names it stopped past
    GLASSBOX_STOPPED_TIMEOUT_S and the tree is torn down (the teardown kills it; it writes no
    crash report). ``doctor --last`` used to judge the files alone and say "is dead … died
    first, without a crash report … killed from outside (SIGKILL, the OOM killer)", against
    the root cause it printed below; it takes the verdict the block recorded."""
    import json

    from engine.utils import processes

    base, cache = run_and_cache_dirs
    _, pid = _gone_tree(base, cache, root_cause=lambda run_dir, pid: processes.format_root_cause(
        run_dir, WORKER, pid, None, rank=0, state=STOPPED))  # fmt: skip

    code, out = _doctor_last(capsys, "--json")
    report = json.loads(out)
    assert code == 1
    assert (report["culprit"], report["verdict"]) == (WORKER, "stopped"), report["diagnosis"]
    assert report["diagnosis"] == f"{WORKER} (pid {pid}) is stopped: {WORKER} is {STOPPED}."
    assert report["hint"] == hints.GONE_STOPPED + "."
    assert "without a crash report" not in report["diagnosis"] and "SIGKILL" not in report["hint"]

    code, out = _doctor_last(capsys)
    assert f"diagnosis: {WORKER} (pid {pid}) is stopped: {WORKER} is {STOPPED}.\n" in out, out
    assert f"what to check: {hints.GONE_STOPPED}.\n" in out, out
    assert f"the root cause saw it still running ({STOPPED})" in out, out  # its row: dead now, and why


@pytest.mark.timeout(60)
def test_doctor_last_names_the_step_rpc_a_sigkilled_worker_was_in(run_and_cache_dirs, capsys):
    """``kill -9`` of the worker in its 322nd step: the root cause says ``stage:
    worker.execute_model (step 322)`` (from the worker's ``.comm``). The post-mortem used to
    keep no ``.comm``: doctor showed the worker ``idle`` with ``culprit_stage: null``."""
    import json

    from engine.utils import processes
    from tracing import run_dir as contract

    base, cache = run_and_cache_dirs
    kept, pid = _gone_tree(base, cache, in_step=321, root_cause=lambda run_dir, pid: processes.format_root_cause(
        run_dir, WORKER, pid, -9, rank=0))  # fmt: skip
    assert "stage:     worker.execute_model (step 322)" in (kept / contract.ROOT_CAUSE).read_text()
    assert (kept / f"{WORKER}{contract.COMM_SUFFIX}").is_file()  # kept: what the blame rule reads

    code, out = _doctor_last(capsys, "--json")
    report = json.loads(out)
    assert code == 1
    assert (report["culprit"], report["verdict"]) == (WORKER, "dead"), report["diagnosis"]
    assert report["culprit_stage"] == "worker.execute_model"
    assert report["diagnosis"].startswith(f"{WORKER} (pid {pid}) is dead in stage worker.execute_model: ")
    worker = next(p for p in report["processes"] if p["role"] == WORKER)
    assert (worker["state"], worker["stage"]) == ("dead", "worker.execute_model")

    code, out = _doctor_last(capsys)
    row = next(line for line in out.splitlines() if line.strip().startswith(WORKER))
    assert "worker.execute_model" in row and " idle " not in row, row


@pytest.mark.parametrize(
    ("returncode", "state", "crash", "verdict", "stage"),
    [
        (None, STOPPED, None, "stopped", None),
        (None, FROZEN, None, "frozen", None),
        (-9, None, None, "dead", None),
        (1, None, "worker.load_model", "failed", "worker.load_model"),
    ],
)
def test_the_recorded_verdict_is_the_one_the_root_cause_block_was_written_with(
    tmp_path, returncode, state, crash, verdict, stage
):
    """``blame.recorded_blame`` reads back what ``processes.format_root_cause`` wrote: the
    same process, verdict and stage the blame rule gave when the block was written."""
    import time

    from engine.utils import processes
    from tracing import run_dir as contract

    pid = _dead_pid()
    status = contract.ProcessStatus(role=WORKER, pid=pid)
    contract.write_status(contract.status_path(tmp_path, WORKER), status)
    if crash:
        contract.write_crash_report(tmp_path, contract.CrashReport(
            role=WORKER, pid=pid, stage=crash, exception="OSError: [Errno 5] Input/output error", time=time.time(),
        ))  # fmt: skip
    block = processes.format_root_cause(tmp_path, WORKER, pid, returncode, rank=0, state=state)
    found = blame.recorded_blame(block, time.time())
    assert found is not None
    assert (found.role, found.pid, found.verdict, found.stage) == (WORKER, pid, verdict, stage), block
    if state is not None:  # a watcher's word, kept verbatim: as the live rule says it
        assert found.reason == f"{WORKER} is {state}"
    assert blame.recorded_blame("no block here", time.time()) is None
    assert isinstance(found, blame.Blame)


def test_live_doctor_says_its_steps_are_the_ones_heard_while_it_watched(tmp_path):
    """A live engine core's step list is what doctor heard in its watch, not a flight
    recorder's record of the last steps (found by a fresh user: one step under that label)."""
    import io
    import time
    import types
    from collections import deque

    from tracing.telemetry.events import StepRecord

    core = doctor.ProcessReport(role="EngineCore_DP0", kind="engine_core", pid=1, rank=0, os_state="running",
                                state="running")  # fmt: skip
    step = StepRecord(engine_index=0, step_id=96, started_at=time.time(), duration_ms=12.5, execute_ms=11.0,
                      num_decode_tokens=3, num_prefill_reqs=0, num_prefill_tokens=0, num_chunked_prefills=0,
                      tokens_scheduled=3, token_budget=2048, num_running=3, num_waiting=0, num_preempted=0,
                      kv_usage=0.25)  # fmt: skip
    live = types.SimpleNamespace(steps={0: deque([step])})
    core.flight, core.flight_source = doctor._flight(tmp_path, core, live, 2.0)
    assert [s["step_id"] for s in core.flight] == [
        96
    ] and core.flight_source == "heard in 2 s of live telemetry"
    report = doctor.Report(run_dir=str(tmp_path), mode="mp", expected=1, found=1, live_telemetry=True,
                           processes=[core], alerts=[], problems=[])  # fmt: skip
    out = io.StringIO()
    doctor.render_text(report, out)
    assert "last steps of EngineCore_DP0 (heard in 2 s of live telemetry, oldest first):" in out.getvalue()
    # Without live telemetry, the file it wrote as it died: the flight recorder.
    (tmp_path / "EngineCore_DP0.flight.json").write_text('{"steps": [{"step_id": 7, "duration_ms": 3.0}]}')
    assert doctor._flight(tmp_path, core, None, 2.0) == (
        [{"step_id": 7, "duration_ms": 3.0}],
        "flight recorder",
    )


def test_doctors_process_rows_line_up_at_every_depth(tmp_path):
    """The pid, state and stage columns start at the same place for an API server, its engine
    core and that core's worker, however deep each is indented."""
    import io

    rows = [
        doctor.ProcessReport(role=role, kind=kind, pid=pid, rank=0, os_state="running", state="running", depth=depth)
        for role, kind, pid, depth in [("APIServer_0", "frontend", 101, 0), ("EngineCore_DP0", "engine_core", 102, 1),
                                       ("Worker_DP0_PP0_TP0", "worker", 103, 2)]
    ]  # fmt: skip
    report = doctor.Report(run_dir=str(tmp_path), mode="mp", expected=3, found=3, live_telemetry=False,
                           processes=rows, alerts=[], problems=[])  # fmt: skip
    out = io.StringIO()
    doctor.render_text(report, out)
    lines = [line for line in out.getvalue().splitlines() if " pid 10" in line]
    assert len(lines) == 3 and lines[2].startswith("  Worker_DP0_PP0_TP0"), lines
    assert len({line.index(" pid 10") for line in lines}) == 1, lines
    assert len({line.index("running") for line in lines}) == 1, lines


@pytest.mark.timeout(60)
def test_doctor_last_says_a_worker_late_for_the_start_up_deadline_was_still_at_work(
    run_and_cache_dirs, capsys
):
    """Start-up's deadline passed while the worker was still loading (alive, no trouble of its
    own); the tree was torn down. ``doctor --last`` used to judge the files alone and say it
    died without a crash report; the block says it was still at work, and why it ended."""
    import json

    from engine.utils import processes

    base, cache = run_and_cache_dirs
    note = "The engine did not become ready within GLASSBOX_ENGINE_READY_TIMEOUT_S=5 s (it said HELLO)."
    _, pid = _gone_tree(base, cache, worker_stage="worker.load_model", root_cause=lambda run_dir, pid: (
        processes.format_root_cause(run_dir, WORKER, pid, None, rank=0, note=note, state="sleeping")))  # fmt: skip
    code, out = _doctor_last(capsys, "--json")
    report = json.loads(out)
    assert code == 1
    assert (report["culprit"], report["verdict"], report["culprit_stage"]) == (
        WORKER,
        "stuck",
        "worker.load_model",
    )
    assert report["diagnosis"] == f"{WORKER} (pid {pid}) was still at work in stage worker.load_model: {note}"
    assert "without a crash report" not in report["diagnosis"] and "SIGKILL" not in report["hint"]
