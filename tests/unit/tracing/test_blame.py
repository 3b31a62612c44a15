"""The blame rule (``tracing/blame.py``) on run directories written with the real records
(manifest, status files, crash reports, workers' ``<role>.comm``): who is at fault when
several processes failed, when one waits in a collective for another, and what the
root-cause block then says. The trees that produce these records are in
``tests/e2e/test_fault_matrix.py``; these cases pin the order of the rule, in milliseconds."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from engine.utils import processes
from tracing import blame
from tracing import run_dir as contract

WORKERS = ["Worker_DP0_PP0_TP0", "Worker_DP0_PP0_TP1"]


@pytest.fixture
def run_dir(tmp_path):
    roles = [contract.PlannedProcess("EngineCore_DP0", kind="engine_core", rank=0, dp_rank=0)]
    roles += [contract.PlannedProcess(r, kind="worker", rank=i, dp_rank=0, pp_rank=0, tp_rank=i)
              for i, r in enumerate(WORKERS)]  # fmt: skip
    contract.write_manifest(tmp_path, contract.Manifest(run_dir=str(tmp_path), mode="serve", roles=roles))
    return tmp_path


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _status(run_dir, role: str, pid: int, stage: str | None = None) -> None:
    contract.write_status(
        contract.status_path(run_dir, role), contract.ProcessStatus(role=role, pid=pid, stage=stage)
    )


def _crash(run_dir, role: str, pid: int, at: float, stage: str, caused_by: str | None = None) -> None:
    report = contract.CrashReport(role=role, pid=pid, stage=stage, exception="RuntimeError: boom", time=at,
                                  caused_by=caused_by)  # fmt: skip
    contract.write_crash_report(run_dir, report)


def test_an_echo_report_is_never_blamed_even_when_written_first(run_dir):
    """The engine core stopping because its worker failed writes an echo (caused_by): the
    worker is named, with its own stage and exception."""
    gone = _dead_pid()
    _crash(run_dir, "EngineCore_DP0", gone, 100.0, "engine_core.step", caused_by=WORKERS[1])
    _crash(run_dir, WORKERS[1], gone, 101.0, "worker.execute_dummy_batch")
    culprit = blame.blame_run_dir(run_dir, now=102.0)
    assert (culprit.role, culprit.verdict, culprit.stage) == (
        WORKERS[1],
        "failed",
        "worker.execute_dummy_batch",
    )
    assert culprit.exception == "RuntimeError: boom"


def test_a_process_merely_gone_ranks_after_a_crash_report(run_dir):
    """TP0's status file is older (it was stopped with the tree, exit status unknown here);
    TP1 wrote why it failed: TP1 is named."""
    gone = _dead_pid()
    _status(run_dir, WORKERS[0], gone)
    _crash(run_dir, WORKERS[1], gone, time.time() + 60, "worker.execute_model")
    assert blame.blame_run_dir(run_dir, now=time.time()).role == WORKERS[1]


def test_the_rank_a_collective_waits_for_is_named_not_the_one_waiting(run_dir, monkeypatch):
    """TP0 has been inside all_reduce #2 of step 3 for 5 s; TP1 is in step 3 but never reached
    a collective: TP1 is named, TP0 is its victim, and the root-cause block says so although
    the caller (the engine core's step deadline) noticed TP0."""
    for role in WORKERS:
        _status(run_dir, role, os.getpid())
    boards = [contract.CommBoard(run_dir, role) for role in WORKERS]
    for board in boards:
        for _ in range(3):
            board.rpc_enter("execute_model")
    boards[0].enter(0, contract.COMM_KINDS.index("all_reduce"))
    boards[0].leave(0)
    boards[0].enter(0, contract.COMM_KINDS.index("all_reduce"))
    culprit = blame.blame_run_dir(run_dir, now=time.time() + 5)
    assert (culprit.role, culprit.verdict, culprit.victims) == (WORKERS[1], "waited_on", [WORKERS[0]])
    assert culprit.reason.startswith(
        "TP0 waits in all_reduce #2 for TP1, which is still in worker.execute_model"
    )
    monkeypatch.setattr(blame, "WAITING_S", 0.0)  # the block reads the clock now: TP0 just entered
    root = processes.format_root_cause(run_dir, WORKERS[0], os.getpid(), None)
    assert f"process:   {WORKERS[1]}" in root and "stage:     worker.execute_model (step 3)" in root, root
    assert "why:       TP0 waits in all_reduce #2 for TP1" in root, root
    boards[1].enter(0, contract.COMM_KINDS.index("all_reduce"))
    boards[1].leave(0)
    boards[1].enter(0, contract.COMM_KINDS.index("all_reduce"))  # TP1 reached #2 too: nobody is late
    assert blame.blame_run_dir(run_dir, now=time.time() + 5) is None


@pytest.mark.parametrize(
    ("trouble", "words"),
    [
        ({"frozen": "frozen: no heartbeat"}, "; it is frozen: no heartbeat"),
        ({"stopped": "stopped by a signal (os state stopped)"}, "; it is stopped by a signal (os state stopped)"),
    ],
    ids=["frozen", "stopped"],
)  # fmt: skip
def test_a_waited_on_rank_with_trouble_of_its_own_reads_as_a_sentence(run_dir, trouble, words):
    """TP0 waits in all_reduce #1 for TP1, which is itself frozen or stopped: the verdict is
    TP1's own trouble and the reason says "it is …" (never "it frozen: …")."""
    for role in WORKERS:
        _status(run_dir, role, os.getpid())
    boards = [contract.CommBoard(run_dir, role) for role in WORKERS]
    for board in boards:
        board.rpc_enter("execute_model")
    boards[0].enter(0, contract.COMM_KINDS.index("all_reduce"))
    known = {WORKERS[1]: blame.Seen(WORKERS[1], **trouble)}
    culprit = blame.blame_run_dir(run_dir, now=time.time() + 5, known=known)
    assert (culprit.role, culprit.verdict) == (WORKERS[1], next(iter(trouble)))
    assert culprit.reason.startswith("TP0 waits in all_reduce #1 for TP1") and culprit.reason.endswith(words)


def test_a_peer_named_first_that_is_still_exiting_reads_as_failed_not_running(run_dir):
    """TP1 raised in a step and wrote its crash report; TP0's all_reduce then failed and TP0
    exited first. The root cause written on TP0's exit names TP1 with its exception, and its
    exit as failing (still exiting), never "still running" (a fresh-clone CI run found it)."""
    gone = _dead_pid()
    _status(run_dir, WORKERS[1], os.getpid())  # alive: still exiting
    _crash(run_dir, WORKERS[1], os.getpid(), 100.0, "worker.execute_model")
    _crash(run_dir, WORKERS[0], gone, 101.0, "worker.execute_model")
    root = processes.format_root_cause(run_dir, WORKERS[0], gone, 1, exits={WORKERS[0]: 1})
    assert f"process:   {WORKERS[1]}" in root and "exception: RuntimeError: boom" in root, root
    assert "exit:      failed (it wrote its crash report; it was still exiting)" in root, root


def test_every_stage_hint_is_a_clause_its_readers_end():
    """doctor and engine-top write "STAGE: HINT." — a hint that kept its catalogue doc's full
    stop read "..": found in lesson 11's engine_core.dummy_step diagnosis."""
    from tracing import catalogue, hints

    assert [name for name in catalogue.SPANS if hints.stage_hint(name).hint.endswith(".")] == []


# ---------------------------------------------------------------------------- expert parallelism

EP_WORKERS = ["Worker_DP0_PP0_TP0", "Worker_DP1_PP0_TP0"]
EP_A2A = contract.COMM_KINDS.index("all_to_all")
EP_GROUP = contract.COMM_GROUPS.index("ep")


@pytest.fixture
def ep_run_dir(tmp_path):
    """-dp 2 --enable-expert-parallel: two engine cores, one worker each, one EP group of both."""
    roles = [
        contract.PlannedProcess(f"EngineCore_DP{d}", kind="engine_core", rank=d, dp_rank=d) for d in (0, 1)
    ]
    roles += [contract.PlannedProcess(r, kind="worker", rank=0, dp_rank=d, pp_rank=0, tp_rank=0)
              for d, r in enumerate(EP_WORKERS)]  # fmt: skip
    contract.write_manifest(tmp_path, contract.Manifest(run_dir=str(tmp_path), mode="serve", roles=roles))
    for role in ["EngineCore_DP0", "EngineCore_DP1", *EP_WORKERS]:
        _status(tmp_path, role, os.getpid())
    return tmp_path


def test_a_rank_of_another_engine_that_never_reached_the_all_to_all_is_named(ep_run_dir):
    """DP0's worker waits in all_to_all #3 of step 5; DP1's is in step 5 but only reached #2
    (held inside its dispatch): DP1's worker is named, across engines."""
    boards = [contract.CommBoard(ep_run_dir, role) for role in EP_WORKERS]
    for board in boards:
        for _ in range(5):
            board.rpc_enter("execute_model")
        for _ in range(2):
            board.enter(EP_GROUP, EP_A2A)
            board.leave(EP_GROUP)
    boards[0].enter(EP_GROUP, EP_A2A)
    culprit = blame.blame_run_dir(ep_run_dir, now=time.time() + 5)
    assert (culprit.role, culprit.verdict, culprit.victims) == (EP_WORKERS[1], "waited_on", [EP_WORKERS[0]])
    assert culprit.reason.startswith(
        "DP0_TP0 waits in all_to_all #3 for DP1_TP0, which is still in worker.execute_model"
    )


def test_an_engine_whose_worker_was_never_sent_the_step_is_named_not_its_worker(ep_run_dir):
    """DP0's worker waits in all_to_all #1 of step 8 (a request's step); DP1's worker finished
    step 7 and sits between steps: its engine core never sent step 8 (its dummy batches stopped),
    so EngineCore_DP1 is named, both workers its victims."""
    boards = [contract.CommBoard(ep_run_dir, role) for role in EP_WORKERS]
    for board in boards:
        for _ in range(7):
            board.rpc_enter("execute_dummy_batch")
    boards[1].rpc_exit()
    boards[0].rpc_enter("execute_model")
    boards[0].enter(EP_GROUP, EP_A2A)
    culprit = blame.blame_run_dir(ep_run_dir, now=time.time() + 5)
    assert (culprit.role, culprit.verdict) == ("EngineCore_DP1", "waited_on")
    assert culprit.victims == EP_WORKERS
    assert culprit.reason == (
        "DP0_TP0 waits in all_to_all #1 for DP1_TP0, which is still at step 7 (5 s): "
        "EngineCore_DP1 never sent it step 8"
    )
