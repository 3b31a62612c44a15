"""Fuzzing the API server's front door: no input gets a 5xx, and the server stays healthy.

One ``glassbox serve`` (bundled tiny model, ``max_model_len`` 64 so any generation is short,
no API key) is shared by the module, and a second one with ``--runner pooling`` for the
pooling routes (``/v1/embeddings``, ``/pooling``), which only a pooling model serves:

- schemathesis runs against each server's own ``/openapi.json`` with a fixed seed, a bounded
  number of cases per operation and a time budget, checking only ``not_a_server_error``;
- a hand-made, table-driven family (huge, nested, wrong types, ``NaN`` / ``Infinity``,
  out-of-vocabulary ids, nul bytes, invalid UTF-8, odd content types, HTTP/1.0, pipelining
  over a raw socket) where each case expects a 4xx or a 200 — and after every case
  ``/health`` answers 200 and a normal completion (an embedding) works.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from server_utils import Server, start_server

pytestmark = pytest.mark.timeout(300)

MAX_MODEL_LEN = 64
SEED = 20261130
# schemathesis: cases per operation and the run's time budget (it stops at whichever comes
# first; the fuzzing phase repeats until the budget is spent). 40 s keeps the whole suite
# inside its 15 minutes on 2 cores; every operation still gets its 25 examples first.
MAX_EXAMPLES = 25
MAX_TIME_S = 40
# The pooling server has the pooling routes and the shared ones (tokenize, models, health...).
POOLING_MAX_TIME_S = 20


@pytest.fixture(scope="module")
def server():
    base = Path(tempfile.mkdtemp(prefix="gbx", dir="/tmp"))  # short: ipc paths ≤ 107 chars
    srv = start_server(base, "--max-model-len", str(MAX_MODEL_LEN), "--uvicorn-log-level", "warning")
    try:
        yield srv
    finally:
        srv.kill_group()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def pooling_server():
    base = Path(tempfile.mkdtemp(prefix="gbx", dir="/tmp"))
    srv = start_server(base, "--runner", "pooling", "--max-model-len", str(MAX_MODEL_LEN),
                       "--uvicorn-log-level", "warning")  # fmt: skip
    try:
        yield srv
    finally:
        srv.kill_group()
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------- raw HTTP


def read_response(sock: socket.socket, buffered: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.x response (Content-Length or read-to-close bodies) from ``sock``;
    ``buffered`` holds bytes read past earlier responses and keeps what follows this one."""

    def fill() -> bool:
        chunk = sock.recv(65536)
        buffered.extend(chunk)
        return bool(chunk)

    while b"\r\n\r\n" not in buffered:
        if not fill():
            raise ConnectionError(f"connection closed before a full response head: {bytes(buffered)[:200]!r}")
    head, _, _ = bytes(buffered).partition(b"\r\n\r\n")
    del buffered[: len(head) + 4]
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        length = int(headers["content-length"])
        while len(buffered) < length:
            if not fill():
                raise ConnectionError("connection closed mid-body")
        body = bytes(buffered[:length])
        del buffered[:length]
    else:  # HTTP/1.0 style: the body runs to the close
        while fill():
            pass
        body = bytes(buffered)
        buffered.clear()
    return status, headers, body


def request_bytes(method: str, path: str, body: bytes = b"", *, version: str = "HTTP/1.1",
                  content_type: str | None = "application/json", extra: str = "") -> bytes:  # fmt: skip
    head = f"{method} {path} {version}\r\nHost: 127.0.0.1\r\n"
    if content_type is not None:
        head += f"Content-Type: {content_type}\r\n"
    if body or method == "POST":
        head += f"Content-Length: {len(body)}\r\n"
    return (head + extra + "\r\n").encode() + body


def raw_exchange(port: int, *requests: bytes, timeout: float = 60) -> list[tuple[int, dict[str, str], bytes]]:
    """Send ``requests`` back to back on one connection (pipelined), read one response each."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(b"".join(requests))
        buffered = bytearray()
        return [read_response(sock, buffered) for _ in requests]


def _log_tail(server: Server) -> str:
    lines = [line for line in server.log().splitlines() if "are not known and were ignored" not in line]
    return "\n".join(lines[-60:])


def assert_healthy(server: Server, pooling: bool = False) -> None:
    """``/health`` is 200 and a normal completion (``pooling``: an embedding) works."""
    assert server.proc.poll() is None, f"the server exited:\n{_log_tail(server)}"
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
    if pooling:
        r = httpx.post(server.base_url + "/v1/embeddings", json={"input": "Hello"}, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["data"][0]["embedding"]) > 0
        return
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


# ---------------------------------------------------------------------------- schemathesis


def _schemathesis(server: Server, tmp_path: Path, max_time_s: int) -> str:
    """Run schemathesis against ``server``'s own OpenAPI document; returns its JUnit report
    (a test case per operation it ran)."""
    st = Path(sys.executable).with_name("st")
    command = [str(st) if st.exists() else "st", "run", server.base_url + "/openapi.json",
               "--checks", "not_a_server_error", "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED),
               "--max-time", str(max_time_s), "--workers", "1", "--request-timeout", "60",
               "--phases", "examples,coverage,fuzzing", "--suppress-health-check", "all",
               "--report", "junit", "--report-dir", str(tmp_path)]  # fmt: skip
    started = time.monotonic()
    run = subprocess.run(command, capture_output=True, text=True, timeout=max_time_s + 120, cwd=tmp_path)
    elapsed = time.monotonic() - started
    summary = run.stdout[-5000:] + run.stderr[-2000:]
    assert run.returncode == 0, (
        f"schemathesis found failures ({elapsed:.0f} s):\n{summary}\nserver log:\n{_log_tail(server)}"
    )
    assert "passed" in run.stdout and "generated" in run.stdout, summary
    assert "Exception in ASGI application" not in server.log()
    return "".join(path.read_text() for path in tmp_path.glob("junit-*.xml"))


def test_schemathesis_finds_no_server_error(server: Server, tmp_path: Path) -> None:
    _schemathesis(server, tmp_path, MAX_TIME_S)
    assert_healthy(server)


def test_schemathesis_finds_no_server_error_on_the_pooling_routes(
    pooling_server: Server, tmp_path: Path
) -> None:
    report = _schemathesis(pooling_server, tmp_path, POOLING_MAX_TIME_S)
    assert 'name="POST /v1/embeddings"' in report and 'name="POST /pooling"' in report, report[-3000:]
    assert_healthy(pooling_server, pooling=True)


# ---------------------------------------------------------------------------- hand-made family

NESTED = b"[" * 5000 + b"]" * 5000
DEEP_OBJECT = b'{"a":' * 3000 + b"1" + b"}" * 3000
BIG_TEXT = "word " * 400_000  # 2 MB: far more than 64 tokens

# (name, path, body bytes, content type, the statuses allowed)
# fmt: off
CASES = [
    ("nested list to tokenize", "/tokenize", NESTED, "application/json", {400}),
    ("nested list to completions", "/v1/completions", NESTED, "application/json", {400}),
    ("nested object to chat", "/v1/chat/completions", DEEP_OBJECT, "application/json", {400}),
    ("nested content parts", "/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "meta": [[[[[[[]]]]]]]}]}]}).encode(),
     "application/json", {200}),
    ("not nested too deep (60 levels)", "/detokenize", b'{"tokens": [1], "x": ' + b"[" * 60 + b"]" * 60 + b"}",
     "application/json", {200}),
    ("huge prompt", "/v1/completions", json.dumps({"prompt": BIG_TEXT}).encode(), "application/json", {400}),
    ("huge chat", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": BIG_TEXT}]}).encode(),
     "application/json", {400}),
    ("huge token list", "/v1/completions", json.dumps({"prompt": [1] * 300_000}).encode(), "application/json", {400}),
    ("huge tokenize", "/tokenize", json.dumps({"prompt": "ab " * 300_000}).encode(), "application/json", {200}),
    ("huge detokenize", "/detokenize", json.dumps({"tokens": [5, 6, 7] * 200_000}).encode(), "application/json",
     {200}),
    ("many prompts", "/v1/completions", json.dumps({"prompt": ["x"] * 300, "max_tokens": 1}).encode(),
     "application/json", {200, 400}),
    ("wrong type: prompt number", "/v1/completions", b'{"prompt": 5}', "application/json", {400}),
    ("wrong type: body is a list", "/v1/completions", b'[{"prompt": "x"}]', "application/json", {400}),
    ("wrong type: body is a string", "/tokenize", b'"prompt"', "application/json", {400}),
    ("wrong type: messages object", "/v1/chat/completions", b'{"messages": {"role": "user"}}', "application/json",
     {400}),
    ("wrong type: tokens strings", "/detokenize", b'{"tokens": ["a", "b"]}', "application/json", {400}),
    ("wrong type: max_tokens float", "/v1/completions", b'{"prompt": "x", "max_tokens": 2.5}', "application/json",
     {400}),
    ("wrong type: n huge", "/v1/completions", b'{"prompt": "x", "n": 100000000000000000000}', "application/json",
     {400}),
    ("wrong type: seed huge", "/v1/completions", b'{"prompt": "x", "seed": 1e300}', "application/json", {400}),
    ("a 5000-digit integer", "/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
     "application/json", {400}),
    ("NaN", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', "application/json", {400}),
    ("Infinity", "/v1/completions", b'{"prompt": "x", "top_p": Infinity}', "application/json", {400}),
    ("-Infinity", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": -Infinity}',
     "application/json", {400}),
    ("overflowing float", "/v1/completions", b'{"prompt": "x", "temperature": 1e999}', "application/json", {400}),
    ("out-of-vocabulary prompt id", "/v1/completions", b'{"prompt": [1, 99999999]}', "application/json", {400}),
    ("negative prompt id", "/v1/completions", b'{"prompt": [[1], [-1]]}', "application/json", {400}),
    ("out-of-vocabulary detokenize", "/detokenize", b'{"tokens": [4096]}', "application/json", {400}),
    ("out-of-vocabulary stop id", "/v1/completions", b'{"prompt": "x", "stop_token_ids": [1e10]}',
     "application/json", {400}),
    ("huge id", "/detokenize", b'{"tokens": [18446744073709551616]}', "application/json", {400}),
    ("nul bytes in prompt", "/v1/completions", b'{"prompt": "a\\u0000b", "max_tokens": 2}', "application/json",
     {200}),
    ("nul bytes in tokenize", "/tokenize", b'{"prompt": "\\u0000\\u0000"}', "application/json", {200}),
    ("raw nul byte in body", "/tokenize", b'{"prompt": "a\x00b"}', "application/json", {400}),
    ("lone surrogate", "/tokenize", b'{"prompt": "\\ud800"}', "application/json", {400}),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', "application/json", {400}),
    ("invalid UTF-8 in a key", "/v1/chat/completions", b'{"\xc3": 1, "messages": []}', "application/json", {400}),
    ("truncated JSON", "/v1/completions", b'{"prompt": "x"', "application/json", {400}),
    ("empty body", "/tokenize", b"", "application/json", {400}),
    ("trailing garbage", "/detokenize", b'{"tokens": [1]} xyz', "application/json", {400}),
    ("text/plain", "/v1/completions", b'{"prompt": "x"}', "text/plain", {400}),
    ("form", "/tokenize", b"prompt=x", "application/x-www-form-urlencoded", {400}),
    ("multipart", "/detokenize", b"--b\r\n\r\nx\r\n--b--", "multipart/form-data; boundary=b", {400}),
    ("no content type", "/tokenize", b'{"prompt": "x"}', None, {200}),
    ("json with charset", "/tokenize", b'{"prompt": "x"}', "application/json; charset=utf-8", {200}),
    ("vendor +json", "/tokenize", b'{"prompt": "x"}', "application/vnd.api+json", {200}),
    ("not quite json", "/tokenize", b'{"prompt": "x"}', "application/jsonx", {400}),
    ("nested object to responses", "/v1/responses", DEEP_OBJECT, "application/json", {400}),
    ("nested object to messages", "/v1/messages", DEEP_OBJECT, "application/json", {400}),
    ("huge input", "/v1/responses", json.dumps({"input": BIG_TEXT}).encode(), "application/json", {400}),
    ("huge message", "/v1/messages",
     json.dumps({"model": "x", "max_tokens": 1, "messages": [{"role": "user", "content": BIG_TEXT}]}).encode(),
     "application/json", {400, 404}),
    ("huge count_tokens", "/v1/messages/count_tokens",
     json.dumps({"model": "x", "messages": [{"role": "user", "content": "ab " * 300_000}]}).encode(),
     "application/json", {404}),
    ("wrong type: input number", "/v1/responses", b'{"input": 5}', "application/json", {400}),
    ("wrong type: max_tokens float", "/v1/messages",
     b'{"model": "x", "max_tokens": 2.5, "messages": [{"role": "user", "content": "x"}]}', "application/json", {400}),
    ("NaN temperature to messages", "/v1/messages",
     b'{"model": "x", "max_tokens": 1, "temperature": NaN, "messages": []}', "application/json", {400}),
    ("invalid UTF-8 to responses", "/v1/responses", b'{"input": "\xff"}', "application/json", {400}),
    ("lone surrogate to messages", "/v1/messages",
     b'{"model": "x", "max_tokens": 1, "messages": [{"role": "user", "content": "\\ud800"}]}', "application/json",
     {400}),
    ("text/plain to messages", "/v1/messages", b"{}", "text/plain", {400}),
    ("unknown route", "/v1/nope", b"{}", "application/json", {404}),
    ("wrong method", "/v1/models", b"{}", "application/json", {405}),
    ("a pooling route", "/v1/embeddings", b'{"input": "x"}', "application/json", {404}),
]
# The pooling server's routes (``pooling_server``).
POOLING_CASES = [
    ("nested list to embeddings", "/v1/embeddings", NESTED, "application/json", {400}),
    ("nested object to pooling", "/pooling", DEEP_OBJECT, "application/json", {400}),
    ("huge input", "/v1/embeddings", json.dumps({"input": BIG_TEXT}).encode(), "application/json", {400}),
    ("huge token list", "/pooling", json.dumps({"input": [1] * 300_000}).encode(), "application/json", {400}),
    ("many inputs", "/v1/embeddings", json.dumps({"input": ["x"] * 300}).encode(), "application/json", {200}),
    ("wrong type: input number", "/v1/embeddings", b'{"input": 5}', "application/json", {400}),
    ("wrong type: dimensions huge", "/v1/embeddings", b'{"input": "x", "dimensions": 1e300}', "application/json",
     {400}),
    ("NaN dimensions", "/pooling", b'{"input": "x", "dimensions": NaN}', "application/json", {400}),
    ("out-of-vocabulary id", "/v1/embeddings", b'{"input": [[1], [99999999]]}', "application/json", {400}),
    ("negative id", "/pooling", b'{"input": [-1]}', "application/json", {400}),
    ("invalid UTF-8", "/v1/embeddings", b'{"input": "\xff\xfe"}', "application/json", {400}),
    ("lone surrogate", "/pooling", b'{"input": "\\ud800"}', "application/json", {400}),
    ("text/plain", "/v1/embeddings", b'{"input": "x"}', "text/plain", {400}),
    ("a generation route", "/v1/completions", b'{"prompt": "x"}', "application/json", {404}),
]
# fmt: on


@pytest.mark.parametrize("name, path, body, content_type, allowed", CASES, ids=[c[0] for c in CASES])
def test_a_hostile_request_gets_a_4xx_or_200_and_the_server_stays_healthy(
    server: Server, name: str, path: str, body: bytes, content_type: str | None, allowed: set[int]
) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    with httpx.Client(timeout=120) as client:
        r = client.post(server.base_url + path, content=body, headers=headers)
        assert r.status_code in allowed, f"{name}: {r.status_code} {r.text[:300]}"
        if r.status_code >= 400 and path.startswith("/v1/messages"):  # Anthropic's shape
            body = r.json()
            assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"], r.text
        elif r.status_code >= 400:
            error = r.json()["error"]
            assert error["code"] == r.status_code and error["message"], r.text
        # The same keep-alive connection still serves.
        assert client.get(server.base_url + "/health").status_code == 200
    assert_healthy(server)


@pytest.mark.parametrize(
    "name, path, body, content_type, allowed", POOLING_CASES, ids=[c[0] for c in POOLING_CASES]
)
def test_a_hostile_pooling_request_gets_a_4xx_or_200_and_the_server_stays_healthy(
    pooling_server: Server, name: str, path: str, body: bytes, content_type: str | None, allowed: set[int]
) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    with httpx.Client(timeout=120) as client:
        r = client.post(pooling_server.base_url + path, content=body, headers=headers)
        assert r.status_code in allowed, f"{name}: {r.status_code} {r.text[:300]}"
        if r.status_code >= 400:
            error = r.json()["error"]
            assert error["code"] == r.status_code and error["message"], r.text
    assert_healthy(pooling_server, pooling=True)


def test_http_1_0_requests_are_served_and_the_connection_closes(server: Server) -> None:
    status, headers, body = raw_exchange(server.port, request_bytes("GET", "/health", version="HTTP/1.0"))[0]
    assert status == 200
    status, headers, body = raw_exchange(
        server.port, request_bytes("POST", "/tokenize", b'{"prompt": "hi"}', version="HTTP/1.0")
    )[0]
    assert status == 200 and json.loads(body)["count"] >= 1
    status, _, body = raw_exchange(
        server.port, request_bytes("POST", "/tokenize", NESTED, version="HTTP/1.0")
    )[0]
    assert status == 400 and json.loads(body)["error"]["code"] == 400
    assert_healthy(server)


def test_pipelined_requests_are_each_answered_in_order(server: Server) -> None:
    requests = [
        request_bytes("POST", "/tokenize", b'{"prompt": "one"}'),
        request_bytes("POST", "/tokenize", NESTED),
        request_bytes("POST", "/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
        request_bytes("POST", "/detokenize", b'{"tokens": [1, 2]}'),
        request_bytes("POST", "/tokenize", b'{"prompt": "\xff"}'),
        request_bytes("GET", "/health"),
    ]
    statuses = [status for status, _, _ in raw_exchange(server.port, *requests)]
    assert statuses == [200, 400, 400, 200, 400, 200]
    assert_healthy(server)


def test_a_malformed_request_line_or_header_is_a_4xx(server: Server) -> None:
    for raw in (
        b"GARBAGE\r\n\r\n",
        b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    ):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(raw)
            try:
                status = read_response(sock, bytearray())[0]
            except ConnectionError:
                status = None  # h11/httptools may just close the connection: also fine
        assert status is None or 400 <= status < 500, (raw, status)
    assert_healthy(server)
