"""SIGTERM while streaming: ``--shutdown-timeout`` (vLLM's flag).

New connections are refused at once; requests in flight may finish within the grace period;
those still running then end with an SSE error event and ``data: [DONE]``; the server exits
0 and no process of its tree is left. Each test starts its own server (it stops it) and
kills its process group on teardown; the SIGTERM follows the first streamed chunk. A SIGTERM
to the whole process group takes the same path (the children leave it to the server).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from proc_utils import session_members, wait_gone
from server_utils import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture
def base():
    path = Path(tempfile.mkdtemp(prefix="gbx", dir="/tmp"))  # short: ipc paths <= 107 chars
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _open_stream(server, max_tokens: int, usage: bool = False):
    """A streamed completion read up to its first chunk: (client, response, line iterator).
    ``usage``: a last chunk carries the usage (``stream_options.include_usage``)."""
    client = httpx.Client(base_url=server.base_url, timeout=60)
    model = client.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "Return the", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": usage}}  # fmt: skip
    response = client.send(client.build_request("POST", "/v1/completions", json=body), stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data: "):
            break
    return client, response, lines


def _events(lines) -> list[str]:
    """The rest of the stream's ``data:`` payloads, in order."""
    return [line[len("data: ") :] for line in lines if line.startswith("data: ")]


def _wait_for_log(server, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in server.log():
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.02)


def test_streams_past_the_grace_period_end_with_an_error_event_and_done(base):
    grace = 1
    server = start_server(base, "--shutdown-timeout", str(grace))
    try:
        client, response, lines = _open_stream(server, max_tokens=1800)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        _wait_for_log(server, "Shutting down")
        with pytest.raises(httpx.ConnectError):  # new connections are refused at once
            httpx.get(server.base_url + "/health", timeout=5)
        events = []
        error_at = None
        for payload in _events(lines):
            events.append(payload)
            if error_at is None and '"error"' in payload:
                error_at = time.monotonic()
        response.close()
        client.close()
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"], error
        assert not any('"finish_reason":"length"' in e.replace(" ", "") for e in events), "it was cut short"
        assert error_at - signalled >= grace * 0.9, "requests in flight get the grace period"
        assert server.proc.wait(grace + 15) == 0, server.log()[-3000:]
        assert time.monotonic() - signalled < grace + 15
        assert wait_gone(session_members(server.proc.pid), timeout=10) == [], "no process is left"
        assert not server.run_dir.exists()
        assert "Traceback" not in server.log()
    finally:
        server.kill_group()


def test_a_short_stream_finishes_within_a_generous_grace_period(base):
    server = start_server(base, "--shutdown-timeout", "60")
    try:
        client, response, lines = _open_stream(server, max_tokens=48)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        events = _events(lines)
        response.close()
        client.close()
        assert events[-1] == "[DONE]", events[-3:]
        assert not any('"error"' in e for e in events), events[-3:]
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "length", last
        assert server.proc.wait(30) == 0, server.log()[-3000:]
        assert time.monotonic() - signalled < 30, "the server exits once its requests are done"
        assert wait_gone(session_members(server.proc.pid), timeout=10) == [], "no process is left"
        assert not server.run_dir.exists()
    finally:
        server.kill_group()


def test_default_shutdown_timeout_ends_streams_at_once(base):
    """vLLM's default, 0: SIGTERM ends the streams in flight right away, with the error event."""
    server = start_server(base)
    try:
        client, response, lines = _open_stream(server, max_tokens=1800)
        server.proc.send_signal(signal.SIGTERM)
        events = _events(lines)
        response.close()
        client.close()
        assert events[-1] == "[DONE]" and '"error"' in events[-2], events[-3:]
        assert server.proc.wait(20) == 0, server.log()[-3000:]
        assert wait_gone(session_members(server.proc.pid), timeout=10) == []
    finally:
        server.kill_group()


def test_a_second_ctrl_c_skips_the_drain_but_streams_still_end_with_an_error_and_done(base):
    """Found by a fresh user: the second Ctrl-C cut the stream off mid-chunk with a traceback
    and a log line blaming --shutdown-timeout. It ends the drain at once; the stream still
    gets the 503 event and [DONE]."""
    server = start_server(base, "--shutdown-timeout", "60")
    try:
        client, response, lines = _open_stream(server, max_tokens=1800)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        _wait_for_log(server, "waiting up to 60 s")
        server.proc.send_signal(signal.SIGINT)
        events = _events(lines)
        response.close()
        client.close()
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"], error
        assert server.proc.wait(30) == 0, server.log()[-3000:]
        assert time.monotonic() - signalled < 30, "the second Ctrl-C skips the 60 s drain"
        log = server.log()
        assert "a second interrupt" in log and "Traceback" not in log, log[-3000:]
        assert wait_gone(session_members(server.proc.pid), timeout=10) == [], "no process is left"
    finally:
        server.kill_group()


@pytest.mark.parametrize("shape", [(), ("-tp", "2")], ids=["default", "tp2"])
def test_sigterm_to_the_whole_process_group_drains_like_sigterm_to_the_server(base, tiny_dir, shape):
    """``kill -TERM -<pgid>`` (pkill, ``docker stop`` of a shell entrypoint, systemd's
    KillMode=control-group) reaches every process of the tree at once. The children leave it
    to the server's shutdown: the stream finishes whole, the server exits 0, nobody is blamed."""
    model = tiny_dir("llama", num_heads=4, num_kv_heads=2)  # splits over TP 2
    server = start_server(base, str(model), "--max-model-len", "256", "--shutdown-timeout", "60",
                          "--step-delay-ms", "20", *shape)  # fmt: skip
    try:
        pids = session_members(server.proc.pid)
        assert len(pids) >= (4 if shape else 2), pids  # API server + engine core (+ 2 workers)
        max_tokens = 100  # >= 2 s of steps after the SIGTERM (--step-delay-ms 20)
        client, response, lines = _open_stream(server, max_tokens=max_tokens, usage=True)
        os.killpg(server.proc.pid, signal.SIGTERM)  # it leads its session and process group
        events = _events(lines)
        response.close()
        client.close()
        assert events[-1] == "[DONE]", events[-3:]
        assert not any('"error"' in e for e in events), events[-3:]
        *chunks, usage = [json.loads(e) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
        assert usage["usage"]["completion_tokens"] == max_tokens, usage
        assert server.proc.wait(60) == 0, server.log()[-3000:]
        log = server.log()
        assert "Glassbox root cause" not in log and "Traceback" not in log, log[-3000:]
        assert wait_gone(session_members(server.proc.pid), timeout=10) == [], "no process is left"
        assert not server.run_dir.exists()
    finally:
        server.kill_group()


def _accepted(server) -> dict[str, int]:
    """Completions each API server has started answering (its access-log lines)."""
    lines = server.log().splitlines()
    return {s: sum(1 for line in lines if line.startswith(f"({s} pid=") and "POST /v1/completions" in line)
            for s in ("APIServer_0", "APIServer_1")}  # fmt: skip


def _stream_on(server, role: str, max_tokens: int):
    """A stream (``_open_stream``) that ``role`` serves: the kernel picks which API server
    accepts a connection, so streams another one took are closed (aborted) and retried."""
    for _ in range(40):
        before = _accepted(server)
        stream = _open_stream(server, max_tokens=max_tokens, usage=True)
        after = _accepted(server)
        if after[role] > before[role]:
            return stream
        stream[1].close()
        stream[0].close()
    raise AssertionError(f"{role} accepted none of 40 connections")


def test_sigterm_to_the_group_with_two_api_servers_drains_the_streams_of_both(base):
    """``-dp 2`` runs two API servers on one port: at APIServer_0's first signal each drains its
    own streams under the same --shutdown-timeout, and the engines stop after both have left —
    also when APIServer_1's stream runs longer than every one of APIServer_0's."""
    server = start_server(base, "-dp", "2", "--max-model-len", "256", "--shutdown-timeout", "60",
                          "--step-delay-ms", "20")  # fmt: skip
    try:
        streams = [(_stream_on(server, "APIServer_0", 20), 20), (_stream_on(server, "APIServer_1", 200), 200)]
        os.killpg(server.proc.pid, signal.SIGTERM)
        for (client, response, lines), max_tokens in streams:
            events = _events(lines)
            response.close()
            client.close()
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
            *chunks, usage = [json.loads(e) for e in events[:-1]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
            assert usage["usage"]["completion_tokens"] == max_tokens, usage
        assert server.proc.wait(90) == 0, server.log()[-3000:]
        log = server.log()
        assert "Glassbox root cause" not in log and "Traceback" not in log, log[-3000:]
        assert wait_gone(session_members(server.proc.pid), timeout=10) == [], "no process is left"
    finally:
        server.kill_group()
