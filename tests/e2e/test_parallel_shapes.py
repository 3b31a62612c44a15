"""Every parallel shape as users run it: ``glassbox serve`` on its defaults (the compiled step,
the default attention backend), one shape per test.

Shapes: ``1×1×1``, ``-tp 2``, ``-pp 2``, ``-dp 2``, ``-tp 2 -dp 2``, a head + ``--headless``
pair on loopback, and Ray ``-tp 2``. Each serves the same request pattern — a short prompt
(prefill, decode), a prompt longer than the step's token budget (chunked prefill), a few at
once (batched decodes), idle gaps (with DP an engine without requests runs dummy batches while
the other's wave runs), a stream its client closes after two chunks (an abort), and a request
after it — and checks what a user sees: every request succeeds; greedy text equals the eager
``1×1×1`` reference; no worker compiled a graph after warm-up (``graphs_after_warm_up`` in its
status file, what ``glassbox ps`` shows); and SIGTERM stops the tree cleanly (exit 0, no process
of its session left, the run directory removed).

The compile cache (``GLASSBOX_CACHE_ROOT``) is shared by every start, so only the first start
of each graph shape compiles.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from proc_utils import session_members, wait_gone
from server_utils import LoggedProcess, Node, Server, free_port_block, start_server

from tracing import run_dir as run_dirs

# A step's token budget below the long prompt's length, so it is prefilled in chunks.
COMMON = ["--max-model-len", "512", "--max-num-batched-tokens", "64", "--max-num-seqs", "8"]
SHORT = ["Return the", "Hello", "def f(x):", "The value of"]
LONG = " ".join(["Return the value for the given object, or None if the target is not found."] * 8)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def short_tmp():
    """A short directory: run-directory bases must leave room for ipc socket paths (107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="gbsh-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _complete(base_url: str, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def _abort_after_two_chunks(base_url: str, model: str) -> None:
    """A stream its client closes after two chunks: the server aborts the request."""
    body = {"model": model, "prompt": "Return the", "max_tokens": 200, "ignore_eos": True, "stream": True}
    chunks = 0
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if chunks == 2:
                    break
    assert chunks == 2


def _request_pattern(base_url: str) -> dict[str, str]:
    """The pattern every shape serves; returns ``{prompt: greedy text}``."""
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    texts: dict[str, str] = {SHORT[0]: _complete(base_url, model, SHORT[0])}
    time.sleep(1.0)  # an idle gap: with DP, engines run dummy batches until the wave ends
    texts[LONG] = _complete(base_url, model, LONG)  # chunked prefill (64-token budget)
    errors: list[BaseException] = []

    def one(prompt: str) -> None:
        try:
            texts[prompt] = _complete(base_url, model, prompt)
        except BaseException as e:  # noqa: BLE001 - reported below, with the prompt
            errors.append(e)

    threads = [threading.Thread(target=one, args=(p,)) for p in SHORT[1:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    time.sleep(1.0)
    _abort_after_two_chunks(base_url, model)
    time.sleep(0.5)
    texts["after abort: " + SHORT[0]] = _complete(base_url, model, SHORT[0])
    return texts


@pytest.fixture(scope="module")
def reference(short_tmp) -> dict[str, str]:
    """The eager ``1×1×1`` server's greedy texts for the pattern."""
    server = start_server(short_tmp / "ref", *COMMON, "--enforce-eager", timeout=180)
    try:
        return _request_pattern(server.base_url)
    finally:
        _stop(server)


def _workers_status(run_dir: Path) -> dict[str, run_dirs.ProcessStatus]:
    out = {}
    for role, path in run_dirs.status_paths(run_dir).items():
        status = run_dirs.read_status(path)
        if role.startswith("Worker_") and status is not None:
            out[role] = status
    return out


def _check_warm_workers(run_dir: Path, expected: int) -> None:
    """Each worker ran compiled and made no graph after warm-up."""
    workers = _workers_status(run_dir)
    assert len(workers) == expected, sorted(workers)
    for role, status in workers.items():
        assert status.runs_as.get("compile", "").startswith("compiled ("), (role, status.runs_as)
        assert "graphs_after_warm_up" not in status.runs_as, (role, status.runs_as)


def _stop(proc: LoggedProcess, timeout: float = 60) -> None:
    """SIGTERM the root; it must exit 0 and leave nothing of its session behind."""
    sid = proc.proc.pid
    try:
        proc.proc.send_signal(signal.SIGTERM)
        code = proc.proc.wait(timeout)
        assert code == 0, proc.log()[-4000:]
        left = wait_gone(session_members(sid), timeout=10)
        assert left == [], _describe(left) + proc.log()[-3000:]
    finally:
        proc.kill_group()


def _describe(pids: list[int]) -> str:
    import psutil

    out = []
    for pid in pids:
        try:
            out.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:120]}")
        except psutil.Error:
            out.append(f"{pid}: gone")
    return "left behind:\n" + "\n".join(out) + "\n"


def _serve_and_check(base: Path, reference: dict[str, str], args: list[str], workers: int,
                     env: dict[str, str] | None = None) -> None:  # fmt: skip
    server = start_server(base, *COMMON, *args, env=env, timeout=300)
    try:
        assert _request_pattern(server.base_url) == reference
        _check_warm_workers(server.run_dir, workers)
        assert "Glassbox root cause" not in server.log()
    finally:
        _stop(server)
    assert not server.run_dir.exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("args", "workers"),
    [([], 1), (["-tp", "2"], 2), (["-pp", "2"], 2), (["-dp", "2"], 2), (["-tp", "2", "-dp", "2"], 4)],
    ids=["1x1x1", "tp2", "pp2", "dp2", "tp2-dp2"],
)
def test_shape_on_defaults_serves_the_pattern_and_stops_cleanly(short_tmp, reference, args, workers):
    _serve_and_check(short_tmp / "-".join(args or ["one"]), reference, args, workers)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_tp2_on_defaults_serves_the_pattern_and_stops_cleanly(short_tmp, reference, monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    _serve_and_check(short_tmp / "ray", reference, ["-tp", "2", "--distributed-executor-backend", "ray"], 2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_head_and_headless_pair_on_defaults_serves_the_pattern_and_stops_cleanly(short_tmp, reference):
    port = free_port_block()
    node = Node(short_tmp / "node", port, *COMMON, "-dp", "2", "--data-parallel-start-rank", "1")
    head: Server | None = None
    try:
        head = start_server(short_tmp / "head", *COMMON, "-dp", "2", "--data-parallel-size-local", "1",
                            "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port),
                            timeout=300)  # fmt: skip
        node_run_dir = node.run_dir(timeout=120)
        assert _request_pattern(head.base_url) == reference
        _check_warm_workers(head.run_dir, 1)
        _check_warm_workers(node_run_dir, 1)
        # The head stops the pair: the headless node leaves with it.
        _stop(head)
        assert node.proc.wait(60) == 0, node.log()[-4000:]
        assert "Glassbox root cause" not in head.log() + node.log()
    finally:
        node.kill_group()
        if head is not None:
            head.kill_group()
