"""Slow clients cannot hold the API server's connections.

A client that sends part of its headers and waits, or trickles its body byte by byte, is
answered 408 and dropped within ``--http-header-timeout`` / ``--http-body-timeout``; a
connection that sends nothing at all is dropped too; the server keeps serving meanwhile.
At start the API server raises its soft open-files limit (RLIMIT_NOFILE) to the hard limit,
as vLLM's ``set_ulimit`` does. One server for the module (the tests only read from it);
its process group is killed on teardown.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from server_utils import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.5


@pytest.fixture(scope="module")
def server():
    base = Path(tempfile.mkdtemp(prefix="gbx", dir="/tmp"))  # short: ipc paths <= 107 chars
    # Start it under a soft open-files limit below the hard one (inherited), to see it raised.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > 1024:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))
    try:
        srv = start_server(base, "--max-model-len", "256", "--http-header-timeout", str(HEADER_TIMEOUT),
                           "--http-body-timeout", str(BODY_TIMEOUT))  # fmt: skip
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        yield srv
    finally:
        srv.kill_group()
        shutil.rmtree(base, ignore_errors=True)


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    return sock


def _read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took.

    Raises:
        AssertionError: still open after ``limit_s`` seconds.
    """
    start = time.monotonic()
    sock.settimeout(limit_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        raise AssertionError(f"still open after {limit_s} s; got {data!r}") from None
    except ConnectionResetError:
        pass
    return data, time.monotonic() - start


def test_partial_headers_are_answered_408_and_dropped(server):
    sock = _connect(server)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        data, elapsed = _read_until_closed(sock, HEADER_TIMEOUT + 10)
    finally:
        sock.close()
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert elapsed < HEADER_TIMEOUT + 5
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    assert "no complete request headers within --http-header-timeout" in server.log()


def test_a_silent_connection_is_dropped(server):
    sock = _connect(server)
    try:
        data, elapsed = _read_until_closed(sock, HEADER_TIMEOUT + 10)
    finally:
        sock.close()
    assert data == b""
    assert elapsed < HEADER_TIMEOUT + 5


def test_a_trickled_body_is_answered_408_and_dropped(server):
    body = b'{"model": "x", "prompt": "' + b"a" * 200 + b'", "max_tokens": 1}'
    sock = _connect(server)
    sent = 0
    start = time.monotonic()
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")  # fmt: skip
        # One byte every 50 ms: the whole body would take 10 s, far past the body timeout.
        try:
            for byte in body:
                sock.sendall(bytes([byte]))
                sent += 1
                sock.settimeout(0.05)
                try:
                    if sock.recv(65536, socket.MSG_PEEK):
                        break  # the server answered before the body was complete
                except TimeoutError:
                    pass
        except (BrokenPipeError, ConnectionResetError):
            pass
        data, _ = _read_until_closed(sock, BODY_TIMEOUT + 10)
    finally:
        sock.close()
    elapsed = time.monotonic() - start
    assert sent < len(body), "the body was read whole"
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert elapsed < BODY_TIMEOUT + 5
    assert "Traceback" not in server.log()
    assert "request body took over --http-body-timeout" in server.log()
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200


def test_keep_alive_then_partial_headers_are_dropped(server):
    """The header deadline starts again with the first byte of a later request."""
    sock = _connect(server)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(10)
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 "), first
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        data, elapsed = _read_until_closed(sock, HEADER_TIMEOUT + 10)
    finally:
        sock.close()
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert elapsed < HEADER_TIMEOUT + 5


def test_normal_requests_still_work(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        r = client.post("/v1/completions", json={"model": model, "prompt": "Return the", "max_tokens": 4})
        assert r.status_code == 200, r.text


def test_soft_open_files_limit_is_raised_to_the_hard_limit(server):
    limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
    line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    assert soft == hard, line
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] > 1024:
        assert int(soft) > 1024, "the fixture started it at 1024"


def _start_with_open_files_limit(base: Path, limit: int) -> tuple[subprocess.Popen, int]:
    """``glassbox serve --port 0`` with soft = hard RLIMIT_NOFILE ``limit``; (process, port)
    once /health answers 200. Output goes to ``base/server.log``."""

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    with open(base / "server.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "serve", "--port", "0",
                                 "--max-model-len", "256"], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=limit_files,
                                env={**os.environ, "GLASSBOX_RUN_DIR_BASE": str(base)})  # fmt: skip
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, (base / "server.log").read_text()[-3000:]
        manifests = [json.loads(p.read_text() or "{}") for p in base.glob("glassbox-*/manifest.json")]
        port = next((m["port"] for m in manifests if "port" in m), None)
        if port is not None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return proc, port
        time.sleep(0.1)


def test_connections_past_the_open_files_limit_get_503_and_one_log_line():
    base = Path(tempfile.mkdtemp(prefix="gbx", dir="/tmp"))
    proc = None
    conns: list[socket.socket] = []
    try:
        proc, port = _start_with_open_files_limit(base, 400)
        # More connections than the server has descriptors for, opened at once (silent ones
        # are dropped after --http-header-timeout, 10 s): the ones past its cap get 503.
        conns = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(400)]
        readable, _, _ = select.select(conns, [], [], 5.0)
        replies = [sock.recv(65536) for sock in readable]
        assert any(r.startswith(b"HTTP/1.1 503 ") for r in replies), replies[:3]
        for _ in range(5):  # more refusals: still one line
            extra = socket.create_connection(("127.0.0.1", port), timeout=10)
            extra.settimeout(10)
            assert extra.recv(65536).startswith(b"HTTP/1.1 503 ")
            extra.close()
        for sock in conns:
            sock.close()
        conns.clear()
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        log = (base / "server.log").read_text()
        assert log.count("RLIMIT_NOFILE 400") == 1, log[-3000:]
    finally:
        for sock in conns:
            sock.close()
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        shutil.rmtree(base, ignore_errors=True)
