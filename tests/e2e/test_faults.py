"""Fault injection (``tracing.faults``, ``docs/faults.md``): the spec grammar, what each kind
does to a stage, the wiring (``GLASSBOX_FAULT``, ``--inject-fault``, ``LLM(inject_fault=...)``),
and — marked slow — faults struck in a real tree: a crashing worker, an engine core that
exits, a hung start-up under ``glassbox serve``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from proc_utils import wait_gone

from tracing import faults as fi
from tracing import stage
from tracing.stage import open_stages

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("worker.load_model:hang@Worker_DP0_PP0_TP1",
         fi.Fault("worker.load_model", "hang", role="Worker_DP0_PP0_TP1")),
        ("worker.determine_available_memory:freeze", fi.Fault("worker.determine_available_memory", "freeze")),
        ("engine_core.init:exit:3", fi.Fault("engine_core.init", "exit", 3)),
        ("worker.init_device:kill:SIGKILL", fi.Fault("worker.init_device", "kill", int(signal.SIGKILL))),
        ("worker.init_device:kill:term", fi.Fault("worker.init_device", "kill", int(signal.SIGTERM))),
        ("worker.init_device:kill:9", fi.Fault("worker.init_device", "kill", 9)),
        ("engine_core.step:slow:0.5@EngineCore_DP0#20",
         fi.Fault("engine_core.step", "slow", 0.5, role="EngineCore_DP0", occurrence=20)),
        ("worker.execute_model:crash#*", fi.Fault("worker.execute_model", "crash", occurrence=None)),
        (" scheduler.schedule : crash ", fi.Fault("scheduler.schedule", "crash")),
    ],
)  # fmt: skip
def test_good_specs_parse_and_print_back(spec, expected):
    (fault,) = fi.parse_faults(spec)
    assert fault == expected
    assert fi.parse_faults(str(fault)) == [fault]  # the canonical form parses to the same fault


def test_several_faults_and_empty_text():
    faults = fi.parse_faults("worker.load_model:crash@Worker_DP0_PP0_TP0, engine_core.init:slow:1,")
    assert [f.stage for f in faults] == ["worker.load_model", "engine_core.init"]
    assert fi.parse_faults("") == [] and fi.parse_faults(" , ") == []


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("worker.load_modle:hang", ["unknown stage 'worker.load_modle'", "did you mean worker.load_model"]),
        ("load_model:hang", ["unknown stage", "worker.load_model"]),
        ("worker.load_model:hung", ["unknown kind 'hung'", "did you mean hang"]),
        ("worker.load_model:kill:SIGFOO", ["unknown signal 'SIGFOO'"]),
        ("worker.load_model:kill:999", ["no signal number 999"]),
        ("worker.load_model:exit", ["exit needs a value", "exit:<code>"]),
        ("worker.load_model:exit:300", ["exit code", "0..255"]),
        ("worker.load_model:slow:-1", ["seconds > 0"]),
        ("worker.load_model:slow:nan", ["seconds > 0"]),
        ("worker.load_model:hang:3", ["hang takes no value"]),
        ("worker.load_model:crash#0", ["#N must be a whole number >= 1 or *"]),
        ("worker.load_model:crash@bad role", ["@ROLE must be a whole role name"]),
        ("llm_request:crash", ["request span"]),
        ("worker.load_model", ["expected STAGE:KIND"]),
        (":crash", ["no stage"]),
    ],
)  # fmt: skip
def test_bad_specs_are_one_line_naming_the_fault(spec, words):
    with pytest.raises(ValueError) as err:
        fi.parse_faults(f"engine_core.init:crash,{spec}")
    message = str(err.value)
    assert "\n" not in message and repr(spec.strip()) in message
    for word in words:
        assert word in message


def test_the_environment_variable_and_the_config_refuse_a_bad_spec(monkeypatch):
    from engine import envs
    from engine.config import ConfigError, ObservabilityConfig

    monkeypatch.setenv("GLASSBOX_FAULT", "worker.load_modle:hang")
    with pytest.raises(ValueError, match=r"GLASSBOX_FAULT=.*did you mean worker.load_model"):
        envs.validate_all()
    monkeypatch.setenv("GLASSBOX_FAULT", "worker.load_model:hang@Worker_DP0_PP0_TP1")
    parsed = envs.GLASSBOX_FAULT
    assert parsed == (fi.Fault("worker.load_model", "hang", role="Worker_DP0_PP0_TP1"),)
    with pytest.raises(ConfigError, match="--inject-fault.*unknown kind 'hung'"):
        ObservabilityConfig(inject_fault="worker.load_model:hung")
    assert (
        ObservabilityConfig(inject_fault=" engine_core.init:exit:3 ").inject_fault
        == "engine_core.init:exit:3"
    )


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (["serve", "--inject-fault", "worker.load_model:hung"], {}, "--inject-fault"),
        (["generate", "hi", "--inject-fault", "nope:crash"], {}, "--inject-fault"),
        (["serve"], {"GLASSBOX_FAULT": "engine_core.init:exit:x"}, "GLASSBOX_FAULT"),
        # a role this tree does not have would never strike: refused, with the closest name
        (["serve", "-tp", "2", "--inject-fault", "worker.load_model:hang@Worker_DP0_PP0_TP2"], {},
         "--inject-fault: fault worker.load_model:hang@Worker_DP0_PP0_TP2: this tree has no process "
         "Worker_DP0_PP0_TP2 (it has APIServer_0, EngineCore_DP0, Worker_DP0_PP0_TP0, Worker_DP0_PP0_TP1); "
         "did you mean Worker_DP0_PP0_TP1?"),
        (["generate", "hi"], {"GLASSBOX_FAULT": "engine_core.init:crash@EngineCore_DP1"},
         "this tree has no process EngineCore_DP1 (it has LLM, EngineCore_DP0, Worker_DP0_PP0_TP0)"),
        # a role the tree has, but which never enters the stage: it would never strike either
        (["serve", "-dp", "2", "--inject-fault", "engine_core.init:hang@DPCoordinator"], {},
         "--inject-fault: fault engine_core.init:hang@DPCoordinator: DPCoordinator never enters "
         "engine_core.init, so it would never strike; in this tree only EngineCore_DP0, EngineCore_DP1 enter it"),
    ],
)  # fmt: skip
def test_cli_refuses_a_bad_fault_in_one_line_with_exit_2(argv, env, names, tmp_path):
    env = {**os.environ, "GLASSBOX_RUN_DIR_BASE": str(tmp_path), **env}
    proc = subprocess.run([sys.executable, "-m", "engine.cli.main", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=env)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if "generation_config.json says" not in ln]
    assert len(lines) == 1 and names in lines[0], proc.stderr
    assert not list(tmp_path.iterdir()), "nothing was started"


# ------------------------------------------------------------------ in-process strikes


@pytest.fixture
def arm():
    """``arm(spec, role="Worker_DP0_PP0_TP0")``: install faults in this process; disarmed after."""
    yield lambda spec, role="Worker_DP0_PP0_TP0": fi.install_faults(role, spec)
    fi.uninstall_faults()
    fi.release_hangs()


@pytest.fixture
def fault_log():
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    log = logging.getLogger("tracing.faults")
    log.addHandler(handler)
    yield records
    log.removeHandler(handler)


def test_crash_raises_inside_the_stage_naming_the_fault(arm, fault_log):
    armed = arm("worker.load_model:crash@Worker_DP0_PP0_TP0")
    assert [str(f) for f in armed] == ["worker.load_model:crash@Worker_DP0_PP0_TP0"]
    assert len(fault_log) == 1 and fault_log[0].levelno == logging.WARNING
    assert "FAULT INJECTION ON" in fault_log[0].getMessage()
    with pytest.raises(fi.InjectedFault) as err, stage("worker.load_model"):
        pytest.fail("the body of a crashed stage must not run")
    assert "worker.load_model:crash@Worker_DP0_PP0_TP0" in str(err.value)
    assert "Worker_DP0_PP0_TP0" in str(err.value) and open_stages() == []
    with stage("worker.load_model"):  # #1 by default: the second entry goes through
        pass
    assert "strikes Worker_DP0_PP0_TP0" in fault_log[1].getMessage()


def test_a_fault_for_another_role_arms_nothing(arm, fault_log):
    stage_module = sys.modules["tracing.stage"]  # (``tracing.stage`` is the function)
    hooks = stage_module._hooks
    assert arm("worker.load_model:crash@Worker_DP0_PP0_TP1") == []
    assert stage_module._hooks == hooks  # no hook at all: untouched stages cost nothing
    with stage("worker.load_model"):
        pass
    assert "no fault targets Worker_DP0_PP0_TP0" in fault_log[0].getMessage()


def test_nth_entry_and_every_entry(arm):
    arm("engine_core.step:crash#3,scheduler.schedule:crash#*")
    for entry in (1, 2, 3, 4):
        if entry == 3:
            with pytest.raises(fi.InjectedFault), stage("engine_core.step"):
                pass
        else:
            with stage("engine_core.step"):
                pass
        with pytest.raises(fi.InjectedFault), stage("scheduler.schedule"):
            pass
    with stage("executor.execute_model"):  # not targeted
        pass


def test_slow_delays_then_goes_on(arm):
    arm("worker.init_device:slow:0.3")
    t0 = time.monotonic()
    with stage("worker.init_device"):
        ran = True
    assert ran and time.monotonic() - t0 >= 0.3


def test_hang_blocks_the_stage_thread_only(arm):
    arm("worker.determine_available_memory:hang")
    done = threading.Event()

    def run() -> None:
        with stage("worker.determine_available_memory"):
            done.set()

    thread = threading.Thread(target=run, name="hung", daemon=True)
    thread.start()
    time.sleep(0.8)
    assert thread.is_alive() and not done.is_set()
    assert [(s.name, s.thread) for s in open_stages()] == [("worker.determine_available_memory", "hung")]
    with stage("worker.load_model"):  # this thread goes on
        pass
    fi.release_hangs()
    thread.join(5)
    assert done.is_set() and not thread.is_alive()


def test_setup_tracing_arms_from_the_environment_and_disarms_when_unset(monkeypatch):
    from tracing import setup_tracing, shutdown_tracing

    monkeypatch.setenv("GLASSBOX_FAULT", "cli.validate_config:crash@APIServer_0")
    try:
        setup_tracing("APIServer_0")
        with pytest.raises(fi.InjectedFault), stage("cli.validate_config"):
            pass
        monkeypatch.delenv("GLASSBOX_FAULT")
        setup_tracing("APIServer_0")
        with stage("cli.validate_config"):
            pass
    finally:
        shutdown_tracing()
        fi.uninstall_faults()


STRUCK = """
import os, signal, sys, threading, time
from tracing import faults, stage
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
faults.install_faults("EngineCore_DP0", sys.argv[1])
lock = threading.Lock()
def say(word):
    with lock:  # whole lines: the two threads' words never share one
        print(word, flush=True)
def beat():
    while True:
        say("beat")
        time.sleep(0.1)
threading.Thread(target=beat, daemon=True).start()
say("entering")
with stage("engine_core.init"):
    say("inside")
say("after")
"""


def _struck(spec: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(STRUCK), spec], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip


def _read_until(proc: subprocess.Popen, word: str, timeout: float = 30.0) -> list[str]:
    """The child's lines up to ``word``; never blocks past ``timeout`` (a reader thread reads
    the pipe, so a child stopped early cannot hang the test)."""
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == word:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(timeout):
        raise AssertionError(f"never printed {word!r}: {lines}")
    return list(lines)


@pytest.mark.parametrize(
    ("spec", "returncode"),
    [("engine_core.init:exit:3", 3), ("engine_core.init:kill:SIGKILL", -signal.SIGKILL),
     ("engine_core.init:kill:SIGTERM", 0)],
)  # fmt: skip
def test_exit_and_kill_end_the_process_in_the_stage(spec, returncode):
    proc = _struck(spec)
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == returncode, err
    assert "inside" not in out.split() and "after" not in out.split()
    assert f"FAULT INJECTED: {spec}" in err and err.count("FAULT INJECTION ON") == 1


def test_hang_keeps_other_threads_and_sigterm_still_stops_it():
    proc = _struck("engine_core.init:hang")
    try:
        _read_until(proc, "entering")
        beats = _read_until(proc, "beat") + _read_until(proc, "beat")  # the heartbeat goes on
        assert "inside" not in beats
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=5)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "inside" not in out.split(), err


def test_freeze_stops_the_whole_process_until_sigcont():
    proc = _struck("engine_core.init:freeze")
    try:
        _read_until(proc, "entering")
        ps = psutil.Process(proc.pid)
        deadline = time.monotonic() + 10
        while ps.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ps.status() == psutil.STATUS_STOPPED  # heartbeat thread included
        deadline = time.monotonic() + 10
        while True:  # continue it (again, should a loaded machine deliver the stop late)
            os.kill(proc.pid, signal.SIGCONT)
            try:
                out, err = proc.communicate(timeout=1)
                break
            except subprocess.TimeoutExpired:
                assert time.monotonic() < deadline, "never finished after SIGCONT"
    finally:
        proc.kill()
    words = [w for w in out.split() if w != "beat"]
    assert proc.returncode == 0 and words[-2:] == ["inside", "after"], err


# ------------------------------------------------------------- struck in a real tree


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return tiny_dir("llama", tie_word_embeddings=True)


def _children() -> set[psutil.Process]:
    return set(psutil.Process().children(recursive=True))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("worker.load_model:crash@Worker_DP0_PP0_TP0",
         ["Worker_DP0_PP0_TP0", "worker.load_model", "InjectedFault"]),
        ("engine_core.init:exit:3", ["EngineCore_DP0", "engine_core.init", "exited with code 3"]),
    ],
)  # fmt: skip
def test_llm_start_up_fault_ends_in_a_root_cause_naming_process_and_stage(tiny, monkeypatch, spec, words):
    from engine import LLM
    from engine.utils.processes import EngineDeadError

    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    monkeypatch.delenv("GLASSBOX_FAULT", raising=False)
    before = _children()
    with pytest.raises(EngineDeadError) as err:
        LLM(str(tiny), max_model_len=128, inject_fault=spec)
    root = err.value.root_cause
    for word in words:
        assert word in root, root
    assert "GLASSBOX_FAULT" not in os.environ  # set for the children only, then put back
    assert wait_gone([p.pid for p in _children() - before]) == []


@pytest.mark.slow
def test_a_warm_up_longer_than_the_step_deadline_is_not_cut_short(tiny, monkeypatch):
    """A cold torch.compile on a loaded machine outlasts a step's deadline: the warm-up RPC is
    start-up's, bounded by GLASSBOX_ENGINE_READY_TIMEOUT_S, so the engine starts and serves."""
    from engine import LLM, SamplingParams

    monkeypatch.setenv("GLASSBOX_EXECUTE_MODEL_TIMEOUT_S", "2")
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    monkeypatch.delenv("GLASSBOX_FAULT", raising=False)
    before = _children()
    with LLM(str(tiny), max_model_len=128, distributed_executor_backend="mp",
             inject_fault="worker.compile_or_warm_up_model:slow:5") as llm:  # fmt: skip
        out = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 3
    assert wait_gone([p.pid for p in _children() - before]) == []


@pytest.mark.slow
def test_serve_hung_start_up_names_the_worker_and_stage_and_leaves_nothing(tiny):
    base = Path(tempfile.mkdtemp(prefix="gbf", dir="/tmp"))  # ipc paths: at most 107 characters
    log_path = base / "server.log"
    env = {**os.environ, "GLASSBOX_RUN_DIR_BASE": str(base), "GLASSBOX_ENGINE_READY_TIMEOUT_S": "8"}
    env.pop("GLASSBOX_FAULT", None)
    stage_name, worker = "worker.determine_available_memory", "Worker_DP0_PP0_TP0"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.cli.main", "serve", "--port", "0", "--model", str(tiny),
             "--max-model-len", "128", "--inject-fault", f"{stage_name}:hang@{worker}"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    pids: set[int] = set()
    run_dir: Path | None = None
    try:
        deadline = time.monotonic() + 90
        seen_hung = False
        while proc.poll() is None and time.monotonic() < deadline:
            for path in base.glob("glassbox-*/*.status.json"):  # each process's status file
                run_dir = path.parent
                try:
                    data = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if isinstance(data.get("pid"), int):
                    pids.add(data["pid"])
                seen_hung |= data.get("role") == worker and data.get("stage") == stage_name
            time.sleep(0.1)
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        log = log_path.read_text(errors="replace")
        assert seen_hung, log[-3000:]
        assert proc.returncode not in (0, None), log[-3000:]
        assert (
            f"FAULT INJECTION ON in {worker}" in log and f"FAULT INJECTED: {stage_name}:hang@{worker}" in log
        )
        tail = log[log.index("GLASSBOX_ENGINE_READY_TIMEOUT_S=8") :]
        assert worker in tail and stage_name in tail, log[-3000:]
        pids.discard(proc.pid)
        assert pids and wait_gone(sorted(pids)) == []
        assert run_dir is not None and not run_dir.exists()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
        shutil.rmtree(base, ignore_errors=True)
