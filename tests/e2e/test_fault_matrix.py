"""The fault matrix: faults injected into a real tree, seen the way a person sees them.

For each case a fault strikes one process of a ``glassbox serve`` (or an ``LLM``) tree on
purpose (``--inject-fault``, ``docs/faults.md``), and the test checks what a student would
check: ``engine-top --once --json`` and ``glassbox doctor --json`` name the struck process
and its stage within 10 s of the strike (doctor also the line its main thread waits at, and
the hint); a start-up that cannot finish ends in one root-cause block naming them; a signal
to the top process leaves nothing behind — no process, no run directory (the shared-memory
queues live in it).

The cases are chosen so each kind (hang, freeze, crash, exit) and each side (worker, engine
core; serve and offline; TP rank 1 of ``-tp 2``; engine 1 of ``-dp 2 --enable-expert-parallel``
in its MoE all-to-alls) is struck at least once; the in-process
tests of ``tests/e2e/test_faults.py`` cover every kind at any stage. All are slow (each starts a
tree) and bounded.
"""

from __future__ import annotations

import json
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
from typing import NamedTuple

import httpx
import psutil
import pytest
from proc_utils import session_members, wait_gone

from tracing import run_dir as contract

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "engine.cli.main"]
SEEN_WITHIN_S = 10.0  # engine-top and doctor name the struck process this soon after the strike

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


class Answer(NamedTuple):
    """What a person sees when a fault of one kind strikes a start-up stage of ``glassbox serve``."""

    state: str  # the struck process's state in glassbox doctor --json, while the tree stands
    verdict: str  # glassbox doctor's verdict (exit 1); once the tree is gone, doctor --last's
    ends: str  # how the server ends on its own
    exit_code: int  # ... and its exit status; Ctrl-C before that: 130
    root_cause: str  # words of its root-cause block


# One row per kind the course's lesson 10 (tutorials/10-diagnosing-a-hung-start-up.md) asks a
# student to predict; the tests below assert each row, and the lesson checks its answers here.
START_UP_ANSWERS = {
    "hang": Answer("starting", "stuck", "GLASSBOX_ENGINE_READY_TIMEOUT_S expires", 1,
                   "GLASSBOX_ENGINE_READY_TIMEOUT_S"),
    "freeze": Answer("stopped", "stopped", "GLASSBOX_STOPPED_TIMEOUT_S expires", 1, "stopped by a signal"),
    # held in a native call: the OS shows it sleeping in its stage, doctor sees the fault
    # holding it; its parent sees no heartbeat and names it frozen
    "gil": Answer("starting", "stuck", "GLASSBOX_HEARTBEAT_TIMEOUT_S expires", 1, "frozen: running but no heartbeat"),
    "crash": Answer("dead", "dead", "at once", 1, "InjectedFault"),
}  # fmt: skip
SIGNAL_EXIT = {signal.SIGTERM: 0, signal.SIGINT: 130, signal.SIGKILL: -9}


@pytest.fixture
def base():
    path = Path(tempfile.mkdtemp(prefix="gbm", dir="/tmp"))  # short: ipc paths ≤ 107 chars
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Tree:
    """A ``glassbox serve`` started in its own process group, read through its run directory."""

    def __init__(self, base: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        self.base = base
        self.log_path = base / "server.log"
        self.env = {**os.environ, "GLASSBOX_RUN_DIR_BASE": str(base), **(env or {})}
        self.env.pop("GLASSBOX_FAULT", None)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([*CLI, "serve", "--port", "0", *args], cwd=ROOT, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env, start_new_session=True)  # fmt: skip
        self.pids: set[int] = set()
        self.run_dir: Path | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def statuses(self) -> dict[str, contract.ProcessStatus]:
        found = {}
        for path in self.base.glob("glassbox-*/*.status.json"):
            self.run_dir = path.parent
            status = contract.read_status(path)
            if status is not None and status.role:
                found[status.role] = status
                if status.pid:
                    self.pids.add(status.pid)
        return found

    def wait_struck(self, role: str, timeout: float = 120.0) -> contract.StruckFault:
        """The fault once ``role``'s status file says it struck and, for a freeze, the OS shows
        the process stopped (polling at 20 Hz)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.statuses().get(role)
            if status is not None and status.faults:
                fault = status.faults[-1]
                if fault.kind != "freeze" or _os_stopped(status.pid):
                    return fault  # a freeze records first, then stops the process
            assert self.proc.poll() is None, (
                f"exited {self.proc.returncode} before the fault:\n{self.log()[-3000:]}"
            )
            time.sleep(0.05)
        raise AssertionError(f"{role}'s fault never struck:\n{self.log()[-3000:]}")

    def cli(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def stop(self, sig: int, within: float) -> int:
        self.statuses()  # every pid seen so far
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=within)

    def assert_nothing_left(self) -> None:
        """No process the tree's status files named, none of its process group, no run directory."""
        pids = sorted(self.pids - {self.proc.pid})
        assert wait_gone(pids, timeout=5.0) == [], self.log()[-3000:]
        assert session_members(self.proc.pid) == [], "a process of the tree's group outlived it"
        assert self.run_dir is not None and not self.run_dir.exists(), "run directory (and its queues) left"

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        for pid in self.pids:  # a process that left the group (it should not) goes too
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _engine_top(tree: Tree) -> dict:
    out = tree.cli(sys.executable, "-m", "tui.cli", "--once", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _doctor(tree: Tree, *args: str) -> tuple[int, dict]:
    out = tree.cli(*CLI, "doctor", "--json", *args)
    return out.returncode, json.loads(out.stdout)


def _os_stopped(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def _seen_by_both(tree: Tree, role: str, stage: str, kind: str, struck_at: float) -> dict:
    """engine-top's alert and doctor's diagnosis name ``role`` and ``stage``; returns doctor's report."""
    top = _engine_top(tree)
    alerts = [a for a in top["alerts"] if a["role"] == role and f"injected {kind}" in a["message"]]
    assert alerts, top["alerts"]
    assert stage in alerts[0]["message"] and alerts[0]["severity"] == "error"
    assert alerts[0]["hint"].startswith(f"{stage}: ")  # the stage's words from the hint catalogue
    code, doc = _doctor(tree)
    assert code == 1 and not doc["healthy"], doc["diagnosis"]
    assert doc["culprit"] == role, doc["diagnosis"]
    assert stage in doc["diagnosis"] and "injected fault struck" in doc["diagnosis"], doc["diagnosis"]
    assert doc["hint"].startswith(stage) or stage in doc["hint"], doc["hint"]
    assert time.time() - struck_at < SEEN_WITHIN_S + 15, "too slow to be useful"  # loose: a loaded machine
    return doc


def _main_waits_at(doc: dict, role: str) -> str:
    (proc,) = [p for p in doc["processes"] if p["role"] == role]
    (main,) = [t for t in proc["threads"] if t["main"]]
    return main["waits_at"]


# ------------------------------------------------------------------------ the student's case


def test_a_hung_start_up_is_named_by_engine_top_and_doctor_then_ctrl_c_leaves_nothing(base):
    """Serve the bundled model with a hang at worker.determine_available_memory: engine-top
    shows the alert with its hint, doctor the stuck process, its stage, the line it waits at,
    and what to do; Ctrl-C cleans up."""
    role, stage = "Worker_DP0_PP0_TP0", "worker.determine_available_memory"
    tree = Tree(base, ["--inject-fault", f"{stage}:hang@{role}"])
    try:
        fault = tree.wait_struck(role)
        assert (fault.stage, fault.kind) == (stage, "hang")
        doc = _seen_by_both(tree, role, stage, "hang", fault.struck_at)
        (proc,) = [p for p in doc["processes"] if p["role"] == role]
        assert (proc["state"], doc["verdict"]) == START_UP_ANSWERS["hang"][:2], doc["diagnosis"]
        waits_at = _main_waits_at(doc, role)
        # where it waits, in the project's own words: the injected hang inside the worker's stage
        assert waits_at.startswith("tracing/faults.py:") and "engine/worker/worker.py" in waits_at, waits_at
        assert "determine_available_memory" in waits_at, waits_at
        code = tree.stop(signal.SIGINT, within=20)
        assert code == SIGNAL_EXIT[signal.SIGINT], tree.log()[-3000:]
        tree.assert_nothing_left()
    finally:
        tree.kill()


@pytest.mark.parametrize(
    ("kind", "timeout"),
    [("hang", "GLASSBOX_ENGINE_READY_TIMEOUT_S"), ("freeze", "GLASSBOX_STOPPED_TIMEOUT_S"),
     ("gil", "GLASSBOX_HEARTBEAT_TIMEOUT_S")],
)  # fmt: skip
def test_a_start_up_held_by_a_fault_is_named_then_ends_on_its_own(base, kind, timeout):
    """The rows of START_UP_ANSWERS: doctor's state and verdict while the tree stands, then the
    server ends by itself when the kind's deadline expires, its exit status and root cause."""
    role, stage = "Worker_DP0_PP0_TP0", "worker.load_model"
    answer = START_UP_ANSWERS[kind]
    assert timeout in answer.ends
    tree = Tree(base, ["--inject-fault", f"{stage}:{kind}@{role}"], env={timeout: "12"})
    try:
        tree.wait_struck(role)
        code, doc = _doctor(tree, "--no-stacks")
        (proc,) = [p for p in doc["processes"] if p["role"] == role]
        assert (code, proc["state"], doc["verdict"], doc["culprit"]) == (
            1,
            answer.state,
            answer.verdict,
            role,
        ), doc
        assert tree.proc.wait(timeout=90) == answer.exit_code, tree.log()[-3000:]
        root = _root_cause(tree.log())
        assert f"process:   {role}" in root and answer.root_cause in root, root
        tree.assert_nothing_left()
    finally:
        tree.kill()


# ------------------------------------------------------------------------ serve, -tp 2, rank 1


@pytest.mark.parametrize(
    ("stage", "kind", "role", "stop"),
    [
        ("worker.load_model", "hang", "Worker_DP0_PP0_TP1", signal.SIGTERM),
        ("worker.init_device", "freeze", "Worker_DP0_PP0_TP1", signal.SIGINT),
        ("engine_core.initialize_kv_cache", "hang", "EngineCore_DP0", signal.SIGKILL),
    ],
)  # fmt: skip
def test_serve_tp2_fault_is_named_and_a_signal_to_the_top_leaves_nothing(base, stage, kind, role, stop):
    env = {"GLASSBOX_STOPPED_TIMEOUT_S": "60"}  # the frozen worker stays for doctor to see
    tree = Tree(base, ["-tp", "2", "--inject-fault", f"{stage}:{kind}@{role}"], env=env)
    try:
        fault = tree.wait_struck(role)
        doc = _seen_by_both(tree, role, stage, kind, fault.struck_at)
        (proc,) = [p for p in doc["processes"] if p["role"] == role]
        assert (proc["state"], doc["verdict"]) == START_UP_ANSWERS[kind][:2], doc["diagnosis"]
        if kind == "freeze":
            assert "kill -CONT" in proc["stack_error"]
        else:
            assert proc["stage"] == stage
            assert _main_waits_at(doc, role).startswith("tracing/faults.py:")
        code = tree.stop(stop, within=20)
        assert code == SIGNAL_EXIT[stop], tree.log()[-3000:]
        tree.assert_nothing_left()
    finally:
        tree.kill()


def _root_cause(log: str) -> str:
    log = log.rstrip()
    assert log.endswith("=" * 69) and log.count("Glassbox root cause") == 1, log[-3000:]
    return log[log.rindex("Glassbox root cause") :]


@pytest.mark.parametrize(
    ("stage", "kind", "role", "words"),
    [
        ("worker.compile_or_warm_up_model", "crash", "Worker_DP0_PP0_TP1", ["InjectedFault"]),
        ("worker.load_model", "crash", "Worker_DP0_PP0_TP1", ["InjectedFault"]),  # the docs' example
        ("engine_core.init", "exit:3", "EngineCore_DP0", ["exited with code 3"]),
    ],
)  # fmt: skip
def test_serve_tp2_start_up_fault_ends_in_one_root_cause_naming_process_and_stage(
    base, stage, kind, role, words
):
    # its own cache root: doctor --last reads this tree's post-mortem, no other test's
    tree = Tree(base, ["-tp", "2", "--inject-fault", f"{stage}:{kind}@{role}"],
                env={"GLASSBOX_CACHE_ROOT": str(base / "cache")})  # fmt: skip
    try:
        code = tree.proc.wait(timeout=120)
        assert code == START_UP_ANSWERS["crash"].exit_code, tree.log()[-3000:]  # exit:N too: the tree exits 1
        root = _root_cause(tree.log())
        assert f"process:   {role}" in root and f"stage:     {stage}" in root, root
        assert f"fault:     injected {stage}:{kind}@{role} struck in {stage}" in root, root
        for word in words:
            assert word in root, root
        assert not list(base.glob("glassbox-*")), "run directory left"
        code, doc = _doctor(tree, "--last")  # the tree is gone: its post-mortem
        assert (code, doc["verdict"], doc["culprit"]) == (1, START_UP_ANSWERS["crash"].verdict, role), doc
    finally:
        tree.kill()


# ------------------------------------------------------------------------ offline, -tp 2

OFFLINE = """
import sys
from engine import LLM
from engine.utils.processes import EngineDeadError
try:
    LLM(sys.argv[1], max_model_len=128, tensor_parallel_size=2, inject_fault=sys.argv[2])
except EngineDeadError as e:
    print("ROOT CAUSE:", e.root_cause, flush=True)
    sys.exit(1)
except TimeoutError as e:
    print("TIMEOUT:", e, flush=True)
    sys.exit(1)
print("started", flush=True)
"""


@pytest.mark.parametrize(
    ("spec", "env", "words"),
    [
        ("worker.load_model:crash@Worker_DP0_PP0_TP1", {},
         ["ROOT CAUSE", "Worker_DP0_PP0_TP1", "worker.load_model", "InjectedFault"]),
        ("worker.init_device:hang@Worker_DP0_PP0_TP1", {"GLASSBOX_ENGINE_READY_TIMEOUT_S": "6"},
         ["Worker_DP0_PP0_TP1", "worker.init_device", "GLASSBOX_ENGINE_READY_TIMEOUT_S"]),
    ],
)  # fmt: skip
def test_offline_tp2_start_up_fault_names_the_rank_and_leaves_nothing(
    base, default_model_dir, spec, env, words
):
    full_env = {
        **os.environ,
        "GLASSBOX_RUN_DIR_BASE": str(base),
        "GLASSBOX_ENABLE_MULTIPROCESSING": "1",
        **env,
    }
    full_env.pop("GLASSBOX_FAULT", None)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(OFFLINE), str(default_model_dir), spec],
                            cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=150)
        assert proc.returncode == 1 and "started" not in out, out[-3000:]
        for word in words:
            assert word in out, out[-3000:]
        assert not list(base.glob("glassbox-*")), "run directory left"
        assert [p for p in session_members(proc.pid)] == [], "a process of the tree outlived it"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


# ------------------------------------------------------------------------ a hang while serving


def test_a_worker_hung_in_a_step_errors_the_request_within_the_deadline_and_names_the_worker(base):
    """``worker.execute_model:hang`` after some steps: the in-flight stream gets an error
    within GLASSBOX_EXECUTE_MODEL_TIMEOUT_S, the root cause names the worker, nothing is left."""
    role = "Worker_DP0_PP0_TP0"
    env = {"GLASSBOX_EXECUTE_MODEL_TIMEOUT_S": "4"}
    tree = Tree(base, ["--inject-fault", f"worker.execute_model:hang@{role}#12"], env=env)
    try:
        manifest = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and manifest is None:
            for path in base.glob("glassbox-*/manifest.json"):
                data = json.loads(path.read_text() or "{}")
                manifest = data if "port" in data else None
            time.sleep(0.05)
        assert manifest is not None, tree.log()[-3000:]
        url = f"http://127.0.0.1:{manifest['port']}"
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        tree.statuses()
        body = {"model": manifest.get("served_model_name") or _model(url), "prompt": "Once upon a time",
                "max_tokens": 200, "stream": True, "ignore_eos": True}  # fmt: skip
        events: list[str] = []
        first_at = errored_at = None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line)
                first_at = first_at or time.monotonic()
                if '"error"' in line:
                    errored_at = time.monotonic()
        assert errored_at is not None, events[-5:]
        assert events[-1] == "data: [DONE]"
        assert 2 < len(events) < 40, "the hang struck after some tokens, not at once nor never"
        assert errored_at - first_at < 4 + 20, "the error came long after the deadline"
        code = tree.proc.wait(timeout=30)
        assert code == 1, tree.log()[-3000:]
        root = _root_cause(tree.log())
        assert role in root and "worker.execute_model" in root, root
        tree.assert_nothing_left()
    finally:
        tree.kill()


def _model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]


# ------------------------------------------------------------------------ SIGTERM at every start-up stage

# Every lifecycle stage a `glassbox serve` start-up passes through, with the process that is in
# it (1 x 1 x 1). A hang holds the stage, so the SIGTERM lands in it every time, not by luck.
START_UP_STAGES = [
    ("cli.validate_config", "APIServer_0"),
    ("process.spawn", "APIServer_0"),
    ("engine_core.handshake", "APIServer_0"),
    ("engine_core.init", "EngineCore_DP0"),
    ("executor.init", "EngineCore_DP0"),
    ("worker.wrapper_init", "Worker_DP0_PP0_TP0"),
    ("worker.init_worker", "Worker_DP0_PP0_TP0"),
    ("worker.init_device", "Worker_DP0_PP0_TP0"),
    ("worker.load_model", "Worker_DP0_PP0_TP0"),
    ("worker.determine_available_memory", "Worker_DP0_PP0_TP0"),
    ("engine_core.initialize_kv_cache", "EngineCore_DP0"),
    ("worker.initialize_kv_cache", "Worker_DP0_PP0_TP0"),
    ("worker.compile_or_warm_up_model", "Worker_DP0_PP0_TP0"),
]


def test_the_list_covers_every_start_up_stage():
    from tracing import catalogue

    start_up = {s.name for s in catalogue.SPANS.values() if s.level == catalogue.LIFECYCLE}
    # not on serve's path: the offline LLM's own stage, several API servers' stages, shutdown,
    # a headless node's join (test_multi_node_dp.py), the DP coordinator's (-dp only), the
    # engine cores' DP group (-dp with --enable-expert-parallel only)
    start_up -= {"llm.init", "api_server.start_api_servers", "api_server.attach", "engine_core.shutdown",
                 "engine_core.join_head", "dp_coordinator.init", "dp_coordinator.shutdown",
                 "engine_core.init_dp_group"}  # fmt: skip
    assert {stage for stage, _ in START_UP_STAGES} == start_up


@pytest.mark.parametrize(("stage", "role"), START_UP_STAGES, ids=[s for s, _ in START_UP_STAGES])
def test_sigterm_in_each_start_up_stage_is_a_clean_exit_within_5_s(base, stage, role):
    tree = Tree(base, ["--inject-fault", f"{stage}:hang@{role}"])
    try:
        if stage == "cli.validate_config":  # before the run directory exists: only the log says it
            deadline = time.monotonic() + 60
            while f"FAULT INJECTED: {stage}:hang@{role}" not in tree.log():
                assert time.monotonic() < deadline and tree.proc.poll() is None, tree.log()[-3000:]
                time.sleep(0.05)
        else:
            tree.wait_struck(role)
        t0 = time.monotonic()
        code = tree.stop(signal.SIGTERM, within=20)
        took = time.monotonic() - t0
        assert code == 0, tree.log()[-3000:]
        assert took < 5, f"SIGTERM in {stage} took {took:.1f} s to stop the tree"
        assert "Traceback" not in tree.log(), tree.log()[-3000:]
        if stage == "cli.validate_config":
            assert session_members(tree.proc.pid) == [] and not list(base.glob("glassbox-*"))
        else:
            tree.assert_nothing_left()
    finally:
        tree.kill()


# ------------------------------------------------------------------------ a stopped process, then the top is stopped


def _pid_of(tree: Tree, role: str) -> int:
    status = tree.statuses().get(role)
    assert status is not None and status.pid, tree.log()[-3000:]
    return status.pid


@pytest.mark.parametrize(
    ("role", "when", "sig"),
    [
        ("EngineCore_DP0", "serving", signal.SIGKILL),
        ("EngineCore_DP0", "serving", signal.SIGTERM),
        ("Worker_DP0_PP0_TP0", "serving", signal.SIGKILL),
        ("Worker_DP0_PP0_TP0", "serving", signal.SIGINT),
        ("EngineCore_DP0", "engine_core.initialize_kv_cache", signal.SIGKILL),
        ("Worker_DP0_PP0_TP0", "worker.load_model", signal.SIGKILL),
    ],
    ids=lambda v: v.name if isinstance(v, signal.Signals) else v,
)
def test_a_stopped_process_does_not_outlive_a_stopped_top(base, role, when, sig):
    """SIGSTOP one process (while serving, or a freeze fault during start-up), then Ctrl-C,
    SIGTERM or SIGKILL the top: within 5 s nothing is left — the stopped process included
    (each child gets SIGCONT from the kernel when its parent dies, then sees its lifeline)."""
    args = ["--inject-fault", f"{when}:freeze@{role}"] if when != "serving" else []
    tree = Tree(base, args, env={"GLASSBOX_STOPPED_TIMEOUT_S": "60"})
    try:
        if when == "serving":
            deadline = time.monotonic() + 120
            while "API server ready on" not in tree.log():
                assert time.monotonic() < deadline and tree.proc.poll() is None, tree.log()[-3000:]
                time.sleep(0.05)
            os.kill(_pid_of(tree, role), signal.SIGSTOP)
        else:
            tree.wait_struck(role)
        pid = _pid_of(tree, role)
        deadline = time.monotonic() + 10
        while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, "never stopped"
            time.sleep(0.02)
        tree.statuses()
        tree.proc.send_signal(sig)
        tree.proc.wait(timeout=20)
        tree.assert_nothing_left()
    finally:
        tree.kill()


# ------------------------------------------------------------------------ frozen: running, no heartbeat


def _serve_and_stream(tree: Tree, base: Path) -> tuple[list[str], float | None]:
    """Wait for /health, stream one long completion; its SSE data lines and when it errored."""
    deadline = time.monotonic() + 120
    url = None
    while url is None:
        assert time.monotonic() < deadline and tree.proc.poll() is None, tree.log()[-3000:]
        for path in base.glob("glassbox-*/manifest.json"):
            data = json.loads(path.read_text() or "{}")
            if "port" in data and "API server ready on" in tree.log():
                url = f"http://127.0.0.1:{data['port']}"
        time.sleep(0.05)
    tree.statuses()
    body = {
        "model": _model(url),
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    events, errored_at = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=90) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if '"error"' in line:
                    errored_at = time.monotonic()
    return events, errored_at


@pytest.mark.parametrize(
    ("stage", "role"),
    [("worker.execute_model", "Worker_DP0_PP0_TP0"), ("engine_core.step", "EngineCore_DP0")],
)
def test_a_process_holding_the_gil_is_named_frozen_and_the_request_errors(base, stage, role):
    """``gil``: the process runs (the OS says so) but no Python thread does, heartbeat
    included. Its parent notices the heartbeat stop within GLASSBOX_HEARTBEAT_TIMEOUT_S, the
    stream gets an error, the root cause names the process as frozen, nothing is left."""
    env = {"GLASSBOX_HEARTBEAT_TIMEOUT_S": "3", "GLASSBOX_EXECUTE_MODEL_TIMEOUT_S": "120"}
    tree = Tree(base, ["--inject-fault", f"{stage}:gil@{role}#8"], env=env)
    try:
        events, errored_at = _serve_and_stream(tree, base)
        assert errored_at is not None and events[-1] == "data: [DONE]", events[-3:]
        fault = tree.statuses()[role].faults[-1]
        assert (
            errored_at - time.monotonic() + time.time() - fault.struck_at < 3 + 20
        )  # noticed, not the 120 s deadline
        code = tree.proc.wait(timeout=30)
        assert code == 1, tree.log()[-3000:]
        root = _root_cause(tree.log())
        assert f"process:   {role}" in root and "frozen: running but no heartbeat" in root, root
        tree.assert_nothing_left()
    finally:
        tree.kill()


def test_an_engine_core_hung_in_its_own_step_is_ended_and_named(base):
    """Found by a fresh user: ``engine_core.step:hang`` left /health 200 and the request
    waiting forever. The step watchdog ends it past the execute-model deadline + 5 s: the
    stream errors, the root cause names the engine core, the stage and where it waits."""
    env = {"GLASSBOX_EXECUTE_MODEL_TIMEOUT_S": "3"}
    tree = Tree(base, ["--inject-fault", "engine_core.step:hang@EngineCore_DP0#6"], env=env)
    try:
        events, errored_at = _serve_and_stream(tree, base)
        assert errored_at is not None and events[-1] == "data: [DONE]", events[-3:]
        code = tree.proc.wait(timeout=30)
        assert code == 1, tree.log()[-3000:]
        root = _root_cause(tree.log())
        assert (
            "process:   EngineCore_DP0" in root and "EngineStepHung: engine_core.step has run for" in root
        ), root
        assert "waits at tracing/faults.py" in root and "fault:     injected engine_core.step:hang" in root, (
            root
        )
        tree.assert_nothing_left()
    finally:
        tree.kill()


# ------------------------------------------------------------------------ one blame rule, three readers


def _stream_in_background(tree: Tree, base: Path) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["events"], out["errored_at"] = _serve_and_stream(tree, base)
        except Exception as e:  # noqa: BLE001 - reported by the test
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize(
    ("args", "kind", "role", "victim", "waits"),
    [
        (["-tp", "2"], "hang", "Worker_DP0_PP0_TP1", "Worker_DP0_PP0_TP0", "TP0 waits in all_reduce #"),
        (["-tp", "2"], "freeze", "Worker_DP0_PP0_TP1", "Worker_DP0_PP0_TP0", "TP0 waits in all_reduce #"),
        (["-pp", "2"], "hang", "Worker_DP0_PP0_TP0", "Worker_DP0_PP1_TP0", "PP1 waits in recv #"),
    ],
    ids=["tp1-hang", "tp1-freeze", "pp0-hang"],
)  # fmt: skip
def test_a_rank_hung_in_a_step_is_named_by_root_cause_doctor_and_engine_top_not_its_victim(
    base, args, kind, role, victim, waits
):
    """A rank blocks (hang) or is stopped (freeze) in its third execute_model: its peer waits
    for it in a collective (TP all_reduce, PP recv). The victim (then its engine core's
    deadline) is never blamed: doctor's diagnosis, engine-top's root-cause alert and the
    root-cause block all name the rank in worker.execute_model, and say its peer waits for it."""
    stage, short = "worker.execute_model", "TP1" if "-tp" in args else "PP0"
    # Then the engine core gives up on the step (or on its stopped worker): time for the readers.
    env = {"GLASSBOX_EXECUTE_MODEL_TIMEOUT_S": "20", "GLASSBOX_STOPPED_TIMEOUT_S": "20"}
    tree = Tree(base, [*args, "--inject-fault", f"{stage}:{kind}@{role}#3"], env=env)
    try:
        thread, out = _stream_in_background(tree, base)
        tree.wait_struck(role)
        deadline = time.monotonic() + 20
        while True:  # the peer counts as waiting once it has been inside its collective for a second
            code, doc = _doctor(tree, "--no-stacks")
            named = doc.get("culprit") == role and waits in doc.get("diagnosis", "")
            # A freeze announces itself 0.2 s before its SIGSTOP lands: wait for the OS to say so.
            named = named and (kind != "freeze" or "is stopped" in doc["diagnosis"])
            if named or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert doc["culprit"] == role and doc["culprit_stage"] == stage, doc["diagnosis"]
        assert waits in doc["diagnosis"] and f"for {short}" in doc["diagnosis"], doc["diagnosis"]
        if kind == "freeze":
            assert "is stopped" in doc["diagnosis"], doc["diagnosis"]
        (waiting,) = [p for p in doc["processes"] if p["role"] == victim]
        assert waiting["stage"] == stage, "a worker inside execute_model is busy, not idle"
        top = _engine_top(tree)
        assert top["alerts"][0]["role"] == role and stage in top["alerts"][0]["message"], top["alerts"]
        assert top["alerts"][0]["message"].startswith("root cause: "), top["alerts"]
        thread.join(timeout=150)
        assert out.get("errored_at") is not None, out
        assert tree.proc.wait(timeout=30) == 1, tree.log()[-3000:]
        root = _root_cause(tree.log())
        assert f"process:   {role}" in root and f"stage:     {stage}" in root, root
        assert f"why:       {waits}" in root or waits.replace("waits", "died waiting") in root, root
        tree.assert_nothing_left()
    finally:
        tree.kill()


@pytest.mark.parametrize(
    ("args", "spec", "role", "stage"),
    [
        (["-tp", "2"], "worker.execute_model:crash@Worker_DP0_PP0_TP1#3", "Worker_DP0_PP0_TP1", "worker.execute_model"),
        (["-dp", "2"], "worker.execute_dummy_batch:crash@Worker_DP1_PP0_TP0", "Worker_DP1_PP0_TP0",
         "worker.execute_dummy_batch"),
    ],
    ids=["tp1-execute-model", "dp1-dummy-batch"],
)  # fmt: skip
def test_a_crash_while_serving_names_the_process_its_stage_and_exception(base, args, spec, role, stage):
    """A worker raising in a serving-time stage: the root cause names it (not a peer, not an
    engine core that relayed it), the stage the exception escaped and the exception; its exit
    is never "still running"."""
    tree = Tree(base, [*args, "--inject-fault", spec])
    try:
        thread, out = _stream_in_background(tree, base)
        assert tree.proc.wait(timeout=150) == 1, tree.log()[-3000:]
        thread.join(timeout=30)
        root = _root_cause(tree.log())
        assert f"process:   {role}" in root and f"stage:     {stage}" in root, root
        assert "exception: InjectedFault: injected fault" in root and "still running" not in root, root
    finally:
        tree.kill()


# ------------------------------------------------------------------------ expert parallelism


@pytest.mark.parametrize(
    ("spec", "role", "why"),
    [
        # DP1's worker blocks as it enters a MoE layer's dispatch: DP0's waits in the all-to-all
        ("moe.dispatch:hang@Worker_DP1_PP0_TP0#60", "Worker_DP1_PP0_TP0",
         "DP0_TP0 waits in all_to_all #"),
        # DP1's worker dies entering a combine: the all-to-all back loses a rank
        ("moe.combine:kill:SIGKILL@Worker_DP1_PP0_TP0#60", "Worker_DP1_PP0_TP0", "SIGKILL"),
        # DP1's engine core stops its dummy batches: its worker is never sent the step
        ("engine_core.dummy_step:hang@EngineCore_DP1#5", "EngineCore_DP1",
         "EngineCore_DP1 never sent it step"),
    ],
    ids=["dp1-dispatch-hang", "dp1-combine-kill", "dp1-dummy-steps-stop"],
)  # fmt: skip
def test_a_rank_that_stalls_or_dies_in_a_moe_collective_is_named_and_the_tree_stops(base, spec, role, why):
    """``-dp 2 --enable-expert-parallel`` on the bundled mixture of experts, one request
    streaming (engine 1 mostly runs dummy batches): a fault strikes engine 1 in its MoE
    collectives, or stops its dummy batches. Doctor names engine 1's process, not engine 0's
    worker waiting in the all-to-all; the stream errors within the step deadline; the tree exits
    1 with one root cause naming it, and leaves nothing."""
    from engine.config import MOE_MODEL

    env = {"GLASSBOX_EXECUTE_MODEL_TIMEOUT_S": "20"}
    args = ["--model", MOE_MODEL, "-dp", "2", "--enable-expert-parallel", "--api-server-count", "1",
            "--inject-fault", spec]  # fmt: skip
    tree = Tree(base, args, env=env)
    try:
        thread, out = _stream_in_background(tree, base)
        if "hang" in spec:  # while the tree stands: doctor names the rank, not its victim
            struck = tree.wait_struck(role, timeout=180)
            deadline = time.monotonic() + 15
            while True:
                code, doc = _doctor(tree, "--no-stacks")
                named = doc.get("culprit") == role and why in doc.get("diagnosis", "")
                if named or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert code == 1 and doc["culprit"] == role and why in doc["diagnosis"], doc["diagnosis"]
            thread.join(timeout=120)
            assert out.get("errored_at") is not None, out
            errored_at = time.time() - (time.monotonic() - out["errored_at"])
            assert errored_at - struck.struck_at < 20 + 15, "the stream errored long past the step deadline"
        thread.join(timeout=120)
        assert out.get("errored_at") is not None, out
        assert tree.proc.wait(timeout=60) == 1, tree.log()[-3000:]
        root = _root_cause(tree.log())
        assert f"process:   {role}" in root and why in root, root
        tree.assert_nothing_left()
    finally:
        tree.kill()
