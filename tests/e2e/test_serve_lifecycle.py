"""``glassbox serve`` as a process tree: three titled processes, and clean ends.

SIGTERM stops everything with exit 0; SIGKILL of the API server takes the engine core and
worker with it (the real vLLM leaves both orphaned); SIGKILL of the worker ends the open
request with an error, prints the root cause last and exits non-zero — or keeps serving
with /health at 503 under GLASSBOX_KEEP_ALIVE_ON_ENGINE_DEATH=1. Each test starts its own
server (they break it) and kills its process group on teardown; kills follow events (the
first streamed chunk), never sleeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from proc_utils import session_members, titled_processes, wait_gone
from server_utils import start_server

pytestmark = pytest.mark.slow

ARGS = ("--max-model-len", "256")


@pytest.fixture
def server(tmp_path):
    srv = start_server(tmp_path, *ARGS)
    yield srv
    srv.kill_group()


def test_three_titled_processes_and_sigterm_stops_everything(server):
    tree = titled_processes(server.proc.pid, include_self=True)
    assert sorted(tree) == [
        "glassbox::APIServer_0",
        "glassbox::EngineCore_DP0",
        "glassbox::Worker_DP0_PP0_TP0",
    ]
    assert tree["glassbox::APIServer_0"].pid == server.proc.pid
    ps = subprocess.run([sys.executable, "-m", "engine.cli.main", "ps", "--json", "--run-dir", str(server.run_dir)],
                        capture_output=True, text=True, timeout=60)  # fmt: skip
    info = json.loads(ps.stdout)["instances"][0]
    assert info["expected_process_count"] == 3 and info["found_process_count"] == 3
    pids = [p.pid for p in tree.values()]
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(10) == 0
    assert wait_gone(pids) == []
    assert not server.run_dir.exists()


def test_sigkill_of_api_server_takes_the_tree_with_it(server):
    tree = titled_processes(server.proc.pid, include_self=True)
    children = [p.pid for name, p in tree.items() if name != "glassbox::APIServer_0"]
    assert len(children) == 2
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(5)
    assert wait_gone(children) == []
    deadline = time.monotonic() + 5
    while server.run_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.run_dir.exists()


def _stream_until_first_chunk(server):
    """Open a long stream and read up to its first chunk; returns (client, response, line iterator)."""
    client = httpx.Client(base_url=server.base_url, timeout=30)
    body = {"model": json.loads(client.get("/v1/models").text)["data"][0]["id"], "prompt": "hello",
            "max_tokens": 200, "ignore_eos": True, "stream": True}  # fmt: skip
    response = client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data: "):
            break
    return client, response, lines


def test_sigkill_of_worker_errors_the_request_and_exits_nonzero_with_root_cause_last(server):
    tree = titled_processes(server.proc.pid, include_self=True)
    worker = tree["glassbox::Worker_DP0_PP0_TP0"]
    core = tree["glassbox::EngineCore_DP0"]
    client, response, lines = _stream_until_first_chunk(server)
    worker.send_signal(signal.SIGKILL)
    rest = "\n".join(lines)
    assert '"error"' in rest, rest[-500:]
    response.close()
    client.close()
    assert server.proc.wait(15) != 0
    assert wait_gone([core.pid, worker.pid]) == []
    log = server.log().rstrip().splitlines()
    block_start = max(i for i, line in enumerate(log) if "Glassbox root cause" in line)
    block = "\n".join(log[block_start:])
    assert "Worker_DP0_PP0_TP0" in block and "SIGKILL" in block
    assert log[-1].startswith("====="), "the root-cause block is the last thing printed"
    assert server.log().count("Glassbox root cause") == 1, "the root-cause block is printed once"
    assert not server.run_dir.exists()


def test_keep_alive_on_engine_death_answers_503(tmp_path):
    srv = start_server(tmp_path, *ARGS, env={"GLASSBOX_KEEP_ALIVE_ON_ENGINE_DEATH": "1"})
    try:
        worker = titled_processes(srv.proc.pid, include_self=True)["glassbox::Worker_DP0_PP0_TP0"]
        worker.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        status = 200
        while status != 503 and time.monotonic() < deadline:
            status = httpx.get(srv.base_url + "/health", timeout=2).status_code
            time.sleep(0.1)
        assert status == 503
        r = httpx.post(srv.base_url + "/v1/completions", json={"model": "x", "prompt": "hi"}, timeout=5)
        assert r.status_code in (503, 404)
        assert srv.proc.poll() is None, "the server stays up"
        # Staying up, it prints the root cause at once (there is no "last"), once.
        deadline = time.monotonic() + 10
        while "Glassbox root cause" not in srv.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = srv.log()
        assert log.count("Glassbox root cause") == 1 and "process:   Worker_DP0_PP0_TP0" in log, log[-3000:]
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(20)
        assert srv.log().count("Glassbox root cause") == 1, "printed again when it stopped"
    finally:
        srv.kill_group()


def test_port_in_use_is_one_line_and_nothing_starts(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        proc = subprocess.run([sys.executable, "-m", "engine.cli.main", "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=60,
                              env={**__import__("os").environ, "GLASSBOX_RUN_DIR_BASE": str(tmp_path)})  # fmt: skip
    finally:
        taken.close()
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "--port" in proc.stderr and "in use" in proc.stderr
    assert list(tmp_path.glob("glassbox-*")) == []


def _serve_to_exit(tmp_path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``glassbox serve --port 0 ARGS`` to its end in its own session; kill leftovers."""
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "GLASSBOX_RUN_DIR_BASE": str(tmp_path), **(env or {})})  # fmt: skip
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _assert_one_line_config_error(proc: subprocess.CompletedProcess, tmp_path, flag: str) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-2000:]
    assert proc.stderr.rstrip().splitlines()[-1].startswith(f"glassbox serve: error: {flag}:"), output[-2000:]
    assert "Traceback" not in output and "root cause" not in output and "ERROR" not in output
    assert list(tmp_path.glob("glassbox-*")) == [], "the run directory is removed"


def test_kv_cache_too_small_found_by_the_engine_core_is_one_line_exit_2(tmp_path):
    # --device auto: the budget is known only once the worker has picked its device.
    proc = _serve_to_exit(tmp_path, env={"GLASSBOX_CPU_KVCACHE_SPACE": "0.0001"})
    _assert_one_line_config_error(proc, tmp_path, "GLASSBOX_CPU_KVCACHE_SPACE")
    assert "needed" in proc.stderr and "GLASSBOX_CPU_KVCACHE_SPACE" in proc.stderr
    assert "Worker_DP0_PP0_TP0" in proc.stdout + proc.stderr, "the tree had started"


@pytest.mark.parametrize(
    "args",
    [("--kv-cache-memory-bytes", "1000"), ("--device", "cpu")],
    ids=["kv-cache-memory-bytes", "cpu-space"],
)
def test_fixed_kv_budget_too_small_is_refused_before_anything_starts(tmp_path, args):
    # A fixed budget (the flag, or GLASSBOX_CPU_KVCACHE_SPACE on --device cpu) is checked first,
    # and the error names the setting the user gave.
    proc = _serve_to_exit(tmp_path, *args, env={"GLASSBOX_CPU_KVCACHE_SPACE": "0.0001"})
    _assert_one_line_config_error(
        proc, tmp_path, args[0] if args[0] != "--device" else "GLASSBOX_CPU_KVCACHE_SPACE"
    )
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, "nothing started, nothing logged"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_bad_device_found_by_the_worker_is_one_line_exit_2(tmp_path):
    proc = _serve_to_exit(tmp_path, "--device", "cuda")
    _assert_one_line_config_error(proc, tmp_path, "--device")


def test_block_override_too_small_is_refused_before_anything_starts(tmp_path):
    proc = _serve_to_exit(tmp_path, "--num-gpu-blocks-override", "40")
    _assert_one_line_config_error(proc, tmp_path, "--num-gpu-blocks-override")
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, "nothing started, nothing logged"
    assert "--max-model-len 2048 needs 129 blocks" in proc.stderr


@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)], ids=["ctrl-c", "sigterm"]
)
def test_signal_during_start_up_exit_code(tmp_path, sig, code):
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "serve", "--port", "0", *ARGS],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "GLASSBOX_RUN_DIR_BASE": str(tmp_path)})  # fmt: skip
    try:
        # The event: the API server has bound and written its manifest; the engine is starting.
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("glassbox-*/manifest.json")) and time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            time.sleep(0.02)
        proc.send_signal(sig)
        assert proc.wait(30) == code, log_path.read_text()[-2000:]
        assert "Traceback" not in log_path.read_text()
        assert wait_gone(session_members(proc.pid)) == [], "no process of the tree is left"
        assert list(tmp_path.glob("glassbox-*")) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_ctrl_c_during_start_up_with_a_stopped_worker_leaves_nothing(tmp_path):
    """A SIGSTOPped process acts on no signal and reads no lifeline until continued: stopping
    the tree must continue it, or it would stay behind, stopped, forever."""
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "serve", "--port", "0", *ARGS],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "GLASSBOX_RUN_DIR_BASE": str(tmp_path)})  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        worker = None
        while worker is None and time.monotonic() < deadline:  # the event: the worker exists
            assert proc.poll() is None, log_path.read_text()
            worker = titled_processes(proc.pid).get("glassbox::Worker_DP0_PP0_TP0")
            time.sleep(0.02)
        assert worker is not None, log_path.read_text()
        worker.send_signal(signal.SIGSTOP)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130, log_path.read_text()[-2000:]
        assert wait_gone(session_members(proc.pid), timeout=10) == [], "no process of the tree is left"
        assert list(tmp_path.glob("glassbox-*")) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_stopped_worker_makes_health_503_at_once_naming_it_and_sigcont_makes_it_200():
    """SIGSTOP of the worker while serving: /health answers 503 as soon as the worker is seen
    stopped — long before GLASSBOX_STOPPED_TIMEOUT_S (60 s here, so the tree stays up) tears
    the tree down — with an OpenAI-shaped error naming the worker's role and pid. SIGCONT:
    /health is 200 again and a request is served."""
    import shutil
    import tempfile
    from pathlib import Path

    from tracing import run_dir as run_dirs

    base = Path(tempfile.mkdtemp(prefix="gbh", dir="/tmp"))  # short: ipc paths ≤ 107 chars
    srv = start_server(base, *ARGS, env={"GLASSBOX_STOPPED_TIMEOUT_S": "60"})
    role = "Worker_DP0_PP0_TP0"
    pid = run_dirs.read_status(run_dirs.status_path(srv.run_dir, role)).pid
    try:
        assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 30  # well under the 60 s after which the tree goes down
        while (health := httpx.get(srv.base_url + "/health", timeout=10)).status_code != 503:
            assert time.monotonic() < deadline, "never 503"
            time.sleep(0.05)
        error = health.json()["error"]
        assert error["code"] == 503 and error["type"] == "ServiceUnavailableError", error
        assert f"{role} (pid {pid}) is stopped by a signal" in error["message"], error
        assert f"kill -CONT {pid}" in error["message"], error
        os.kill(pid, signal.SIGCONT)
        while (health := httpx.get(srv.base_url + "/health", timeout=10)).status_code != 200:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.05)
        done = httpx.post(srv.base_url + "/v1/completions", timeout=60,
                          json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})  # fmt: skip
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4, done.text
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        srv.kill_group()
        shutil.rmtree(base, ignore_errors=True)
