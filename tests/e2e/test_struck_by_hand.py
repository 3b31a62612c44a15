"""The faults found when the tree was struck by hand, each now a test.

- A start-up deadline ends like every other start-up failure: one root-cause block, last,
  naming the process that held it back, its stage and its state ("stopped"), exit 1 — and
  the stopped worker does not outlive the tree.
- A SIGTERM from outside the tree (not the parent's stop) is named as such in the root cause.
- A process stopped by a signal while the server is idle is noticed within
  ``GLASSBOX_STOPPED_TIMEOUT_S``: the server exits 1 naming it, and nothing is left.
- A ``GLASSBOX_RUN_DIR_BASE`` too long for the socket paths is one line naming it, exit 2;
  a run-directory base created under umask 000 is still 0700.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from proc_utils import wait_gone
from server_utils import start_server

from tracing import run_dir as contract

pytestmark = pytest.mark.slow


@pytest.fixture
def base():
    path = Path(tempfile.mkdtemp(prefix="gbh", dir="/tmp"))  # short: ipc paths ≤ 107 chars
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _planned_pids(run_dir: Path) -> list[int]:
    pids = []
    for path in contract.status_paths(run_dir).values():
        status = contract.read_status(path)
        if status is not None and status.pid:
            pids.append(status.pid)
    return pids


def _root_cause_last(log: str) -> str:
    log = log.rstrip()
    assert log.endswith("=" * 69), log[-2000:]
    assert log.count("Glassbox root cause") == 1, log[-3000:]
    return log[log.rindex("Glassbox root cause") :]


def test_a_start_up_deadline_names_the_frozen_worker_and_leaves_nothing(base, default_model_dir):
    # The ready deadline, not the stopped-process watch (GLASSBOX_STOPPED_TIMEOUT_S), ends it here.
    env = {**os.environ, "GLASSBOX_RUN_DIR_BASE": str(base), "GLASSBOX_ENGINE_READY_TIMEOUT_S": "6",
           "GLASSBOX_STOPPED_TIMEOUT_S": "600"}  # fmt: skip
    log = base / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "serve", "--port", "0", "--inject-fault",
                                 "worker.load_model:freeze@Worker_DP0_PP0_TP0"], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)  # fmt: skip
    try:
        pids: list[int] = []
        deadline = time.monotonic() + 60
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the start-up deadline never ended the server"
            for run_dir in base.glob("glassbox-*"):
                pids = sorted(set(pids) | set(_planned_pids(run_dir)))
            time.sleep(0.1)
        assert proc.returncode == 1
        block = _root_cause_last(log.read_text())
        assert "process:   Worker_DP0_PP0_TP0" in block and "stage:     worker.load_model" in block
        assert "stopped" in block and "GLASSBOX_ENGINE_READY_TIMEOUT_S=6" in block
        assert pids and wait_gone(pids) == [], "a frozen worker outlived the tree"
        assert not list(base.glob("glassbox-*"))
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None


@pytest.mark.parametrize(("role", "how"), [("EngineCore_DP0", "sigterm"), ("Worker_DP0_PP0_TP0", "sigstop")])
def test_a_child_terminated_or_stopped_from_outside_is_named(base, default_model_dir, role, how):
    server = start_server(base, "--max-model-len", "256", env={"GLASSBOX_STOPPED_TIMEOUT_S": "2"})
    try:
        status = contract.read_status(contract.status_path(server.run_dir, role))
        pids = _planned_pids(server.run_dir)
        os.kill(status.pid, signal.SIGTERM if how == "sigterm" else signal.SIGSTOP)
        assert server.proc.wait(20) == 1
        block = _root_cause_last(server.log())
        assert f"process:   {role}" in block
        if how == "sigterm":
            assert "terminated by SIGTERM from outside the tree" in block
        else:
            assert "stopped by a signal" in block and "GLASSBOX_STOPPED_TIMEOUT_S=2" in block
        assert wait_gone(pids) == [] and not server.run_dir.exists()
    finally:
        server.kill_group()


def test_a_run_dir_base_too_long_for_sockets_is_one_line(base):
    long_base = base / ("x" * 70)
    env = {**os.environ, "GLASSBOX_RUN_DIR_BASE": str(long_base)}
    done = subprocess.run([sys.executable, "-m", "engine.cli.main", "serve", "--port", "0"], capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()[-1:]
    assert "GLASSBOX_RUN_DIR_BASE" in line and "at most 64" in line


def test_a_base_made_under_umask_000_is_private(base):
    code = (
        f"import os; os.umask(0); from tracing.run_dir import make_run_dir; make_run_dir({str(base / 'b')!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert (base / "b").stat().st_mode & 0o777 == 0o700


def test_an_engine_core_that_dies_mid_serving_reports_its_last_step(tiny_dir):
    """The flight recorder: the engine core keeps its last step records and writes them as it
    dies; the root cause says what the last step did (here: a fault at the 5th step)."""
    from engine import LLM, SamplingParams
    from engine.utils.processes import EngineDeadError

    llm = LLM(
        str(tiny_dir("llama")), max_model_len=64, inject_fault="executor.execute_model:crash@EngineCore_DP0#5"
    )
    try:
        with pytest.raises(EngineDeadError) as err:
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=20, ignore_eos=True),
                         use_tqdm=False)  # fmt: skip
    finally:
        llm.shutdown()
    root = err.value.root_cause
    assert "process:   EngineCore_DP0" in root and "executor.execute_model" in root
    assert "last step: #4: 1 decode + 0 prefill tokens" in root, root


def test_ctrl_c_at_any_moment_of_start_up_exits_130(base):
    """A Ctrl-C that lands while a module imports (exec of generated dataclass code) used to
    end the server by SIGINT (-2) after a clean stop: CPython flags a KeyboardInterrupt that
    crosses exec() as unhandled. Struck at several moments after the port is bound."""
    for delay in (0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.12):
        env = {**os.environ, "GLASSBOX_RUN_DIR_BASE": str(base)}
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "serve", "--port", "0"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while not list(base.glob("glassbox-*/manifest.json")):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.002)
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) == 130, f"exit {proc.returncode} for a Ctrl-C {delay} s after the bind"
            assert not list(base.glob("glassbox-*"))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


_SIGINT_IN_A_FINALIZER = """
import gc, os, signal, sys
from engine.cli.main import main
from engine.utils import run_dir

write_manifest = run_dir.write_manifest


class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)  # the handler's exception is "ignored" here


def write_manifest_then_ctrl_c(*args, **kwargs):
    write_manifest(*args, **kwargs)
    Finalized()  # collected at once: Ctrl-C lands inside its __del__
    gc.collect()


run_dir.write_manifest = write_manifest_then_ctrl_c
sys.exit(main(["serve", "--port", "0"]))
"""


def test_ctrl_c_swallowed_by_a_finalizer_still_stops_the_server(base):
    """A Ctrl-C whose handler ran inside a ``__del__`` (CI caught one in regex's ``Group``
    finalizer): CPython prints "Exception ignored" and goes on, and the server used to start
    serving as if nothing had happened. The recorded signal now stops it before it serves."""
    env = {**os.environ, "GLASSBOX_RUN_DIR_BASE": str(base)}
    proc = subprocess.Popen([sys.executable, "-c", _SIGINT_IN_A_FINALIZER], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Exception ignored" in err  # the handler's exception was swallowed, as in CI
    assert proc.returncode == 130, err
    assert "server ready" not in err and "Interrupted during start-up" in err
    assert not list(base.glob("glassbox-*"))
