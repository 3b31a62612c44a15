"""The API server under abuse: bounded bodies, work off the event loop, no 5xx
from undecodable input, every route in the OpenAPI document, no internals to clients, the
API key's scope and CORS.

Two real ``glassbox serve`` (bundled tiny model), each shared by the tests that need it:

- ``server``: ``--api-key`` with its default scope (``/v1`` only), default CORS (none) and
  the default body limit; ``GLASSBOX_KEEP_ALIVE_ON_ENGINE_DEATH=1`` because the last test
  kills its engine core;
- ``scoped``: ``--api-key-scope all``, one allowed CORS origin and a 4 KiB body limit.

Timings are compared as ratios of one another, never against a wall-clock bound: the
machine may be small and busy.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_utils import Server, start_server
from test_api_fuzz import raw_exchange, read_response, request_bytes

from engine.entrypoints.openai.limits import DEFAULT_MAX_REQUEST_BODY_BYTES, MAX_JSON_DEPTH
from engine.entrypoints.openai.serving_engine import ENGINE_DEAD_MESSAGE

pytestmark = pytest.mark.timeout(300)

API_KEY = "sk-abuse"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD_ORIGIN = "http://good.example"
SMALL_LIMIT = 4096
# Just under the default limit, as JSON: {"prompt": "..."}.
BIG_TEXT = "hello world, this is a test. " * ((DEFAULT_MAX_REQUEST_BODY_BYTES - 100) // 29)


def _start(*args: str, env: dict[str, str] | None = None):
    base = Path(tempfile.mkdtemp(prefix="gbx", dir="/tmp"))  # short: ipc paths ≤ 107 chars
    srv = start_server(base, "--uvicorn-log-level", "warning", *args, env=env)
    return base, srv


@pytest.fixture(scope="module")
def server():
    base, srv = _start("--api-key", API_KEY, env={"GLASSBOX_KEEP_ALIVE_ON_ENGINE_DEATH": "1"})
    try:
        yield srv
    finally:
        srv.kill_group()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def scoped():
    base, srv = _start("--api-key", API_KEY, "--api-key-scope", "all", "--allowed-origins",
                       json.dumps([GOOD_ORIGIN]), "--max-request-body-bytes", str(SMALL_LIMIT))  # fmt: skip
    try:
        yield srv
    finally:
        srv.kill_group()
        shutil.rmtree(base, ignore_errors=True)


def _post(srv: Server, path: str, body: bytes | str, timeout: float = 180) -> httpx.Response:
    headers = {**AUTH, "Content-Type": "application/json"}
    return httpx.post(srv.base_url + path, content=body, headers=headers, timeout=timeout)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _assert_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert error["code"] == status and error["message"], error
    return error


# ---------------------------------------------------------------------------- 1. off the loop


def test_a_large_tokenize_does_not_stall_other_streams(server: Server) -> None:
    """While a ~10 MB /tokenize runs (seconds of tokenizing), streams keep flowing: the
    largest gap between chunks stays small relative to the tokenize's duration and to the
    streams' typical gap (unfixed: one gap as long as the whole tokenize)."""
    arrivals: list[list[float]] = []
    stop = threading.Event()

    def stream_until_stopped() -> None:
        body = {"prompt": "Once", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        while not stop.is_set():
            times: list[float] = []
            arrivals.append(times)
            with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=AUTH,
                              timeout=120) as r:  # fmt: skip
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        times.append(time.monotonic())
                    if stop.is_set():
                        break

    streamer = threading.Thread(target=stream_until_stopped, daemon=True)
    streamer.start()
    while sum(len(t) for t in arrivals) < 100:  # the stream is flowing
        time.sleep(0.05)
    body = json.dumps({"prompt": BIG_TEXT})
    started = time.monotonic()
    r = _post(server, "/tokenize", body)
    ended = time.monotonic()
    time.sleep(0.5)
    stop.set()
    streamer.join(60)
    assert r.status_code == 200, r.text[:300]
    assert r.json()["count"] > 1_000_000
    tokenize_s = ended - started
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:])]
    during = [b - a for times in arrivals for a, b in zip(times, times[1:]) if b >= started and a <= ended]
    assert during, "no stream chunk arrived while /tokenize ran"
    typical = statistics.median(gaps)
    worst = max(during)
    report = (f"tokenize {tokenize_s:.2f} s; stream gaps: typical {typical * 1000:.1f} ms, worst while "
              f"tokenizing {worst * 1000:.0f} ms ({len(during)} gaps)")  # fmt: skip
    # The bug stalled every stream for the whole tokenize (worst gap ≈ tokenize_s). A second
    # bound of 200 × the median gap (~5 ms) flaked on a loaded 2-core machine (one 1.3 s gap
    # during a 9.4 s tokenize: a scheduling hiccup, not the stall), so the bound is the stall's.
    assert worst < tokenize_s / 4, report


# ---------------------------------------------------------------------------- 2. body limit


def test_a_body_over_the_limit_is_a_413_before_it_is_read(server: Server) -> None:
    # Only the headers are sent: the answer comes without the body.
    too_big = DEFAULT_MAX_REQUEST_BODY_BYTES + 1
    for path, extra in (("/tokenize", ""), ("/v1/completions", f"Authorization: Bearer {API_KEY}\r\n")):
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {too_big}\r\n"
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall((head + extra + "\r\n").encode())
            status, headers, body = read_response(sock, bytearray())
        assert status == 413 and headers.get("connection") == "close"
        error = json.loads(body)["error"]
        assert error["code"] == 413 and "--max-request-body-bytes" in error["message"], error
        assert str(DEFAULT_MAX_REQUEST_BODY_BYTES) in error["message"]
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit(scoped: Server) -> None:
    # The body is never finished (no last chunk): the 413 comes once the limit is passed.
    head = b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Authorization: Bearer {API_KEY}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    piece = b"x" * 1024
    with socket.create_connection(("127.0.0.1", scoped.port), timeout=30) as sock:
        sock.sendall(head)
        for _ in range(SMALL_LIMIT // len(piece) + 1):
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        status, headers, body = read_response(sock, bytearray())
    assert status == 413 and json.loads(body)["error"]["code"] == 413
    # Just under the limit is served.
    ok = _post(scoped, "/tokenize", json.dumps({"prompt": "y" * (SMALL_LIMIT - 20)}))
    assert ok.status_code == 200, ok.text


def test_memory_returns_near_its_baseline_after_large_requests(server: Server) -> None:
    """RSS after just-under-limit requests returns near the baseline (unfixed: a
    ~10 MB /tokenize left the server ~10x its baseline, for good). A prompt that cannot fit
    is refused before it is tokenized: far faster than tokenizing it."""
    pid = server.proc.pid  # `glassbox serve` is APIServer_0
    for _ in range(3):
        assert _post(server, "/tokenize", json.dumps({"prompt": "warm up " * 2000})).status_code == 200
        assert (
            _post(server, "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2})).status_code == 200
        )
    baseline = _rss_mb(pid)
    big_prompt = json.dumps({"prompt": BIG_TEXT})
    big_ids = json.dumps({"tokens": list(range(4000)) * 300})  # ~6 MB, 1.2 M ids
    # One round: the unfixed server kept ~10x its baseline after a single large /tokenize.
    started = time.monotonic()
    assert _post(server, "/tokenize", big_prompt).status_code == 200
    tokenize_s = time.monotonic() - started
    assert _post(server, "/detokenize", big_ids).status_code == 200
    started = time.monotonic()
    error = _assert_error(_post(server, "/v1/completions", big_prompt), 400)
    refuse_s = time.monotonic() - started
    assert "maximum context length" in error["message"] and error["param"] == "prompt"
    assert refuse_s < tokenize_s / 5, (refuse_s, tokenize_s)
    chat = json.dumps({"messages": [{"role": "user", "content": BIG_TEXT}]})
    assert (
        "maximum context length" in _assert_error(_post(server, "/v1/chat/completions", chat), 400)["message"]
    )
    deadline = time.monotonic() + 30
    while (rss := _rss_mb(pid)) > 2.5 * baseline and time.monotonic() < deadline:
        time.sleep(0.5)
    assert rss <= 2.5 * baseline, f"RSS {rss:.0f} MB after large requests, baseline {baseline:.0f} MB"


# ---------------------------------------------------------------------------- 3. one parser

BAD_BODIES = {
    "nested 5000 deep": b"[" * 5000 + b"]" * 5000,
    f"nested {MAX_JSON_DEPTH + 1} deep": b'{"prompt": "x", "a": '
    + b"[" * MAX_JSON_DEPTH
    + b"]" * MAX_JSON_DEPTH
    + b"}",
    "invalid UTF-8": b'{"prompt": "\xc3\x28"}',
    "NaN": b'{"prompt": "x", "temperature": NaN}',
    "Infinity": b'{"tokens": [1], "x": Infinity}',
    "1e999": b'{"prompt": "x", "top_p": 1e999}',
    "truncated": b'{"prompt": ',
    "empty": b"",
    "not JSON": b"hello",
}
POST_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
               "/tokenize", "/detokenize")  # fmt: skip


def test_any_undecodable_body_is_a_400_and_the_connection_stays_usable(server: Server) -> None:
    for path in POST_ROUTES:
        for name, body in BAD_BODIES.items():
            bad = request_bytes("POST", path, body, extra=f"Authorization: Bearer {API_KEY}\r\n")
            good = request_bytes("POST", "/tokenize", b'{"prompt": "still here"}')
            (status, _, answer), (after, _, _) = raw_exchange(server.port, bad, good)
            assert status == 400, (path, name, status, answer[:300])
            error = json.loads(answer)["error"]
            if path.startswith("/v1/messages"):  # Anthropic's error shape
                assert error["type"] == "invalid_request_error" and error["message"], (path, name, error)
            else:
                assert error["code"] == 400 and error["type"] == "BadRequestError", (path, name, error)
            assert after == 200, (path, name, "the keep-alive connection did not serve the next request")
    assert "Exception in ASGI application" not in server.log()
    assert "Traceback" not in server.log()


# ---------------------------------------------------------------------------- 4. OpenAPI


def test_every_route_is_in_the_openapi_document_with_its_body(server: Server) -> None:
    doc = httpx.get(server.base_url + "/openapi.json", timeout=30).json()
    paths = doc["paths"]
    expected = {
        "/health": {"get", "head"}, "/ping": {"get", "post"}, "/version": {"get"}, "/metrics": {"get"},
        "/v1/models": {"get"}, "/v1/models/{model_id}": {"get"}, "/v1/completions": {"post"},
        "/v1/chat/completions": {"post"}, "/tokenize": {"post"}, "/detokenize": {"post"},
        "/v1/responses": {"post"}, "/v1/responses/{response_id}": {"get"}, "/v1/responses/{response_id}/cancel": {"post"},
        "/v1/messages": {"post"}, "/v1/messages/count_tokens": {"post"},
    }  # fmt: skip
    assert {path: set(ops) for path, ops in paths.items()} == expected
    op_ids = [op["operationId"] for ops in paths.values() for op in ops.values()]
    assert len(op_ids) == len(set(op_ids)), op_ids
    schemas = doc["components"]["schemas"]
    for path in POST_ROUTES:
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        refs = [body["$ref"]] if "$ref" in body else [ref["$ref"] for ref in body["anyOf"]]
        for ref in refs:
            assert ref.removeprefix("#/components/schemas/") in schemas, ref
    assert {"TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest", "ResponsesRequest",
            "AnthropicMessagesRequest", "AnthropicCountTokensRequest"} <= set(schemas)  # fmt: skip
    assert "prompt" in schemas["TokenizeCompletionRequest"]["properties"]
    assert "Duplicate Operation ID" not in server.log()


# ---------------------------------------------------------------------------- 8. key scope, CORS


def test_the_api_key_guards_only_v1_by_default(server: Server) -> None:
    assert httpx.get(server.base_url + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(server.base_url + "/v1/models", headers=AUTH, timeout=30).status_code == 200
    assert httpx.post(server.base_url + "/tokenize", json={"prompt": "x"}, timeout=30).status_code == 200
    assert httpx.get(server.base_url + "/metrics", timeout=30).status_code == 200


def test_api_key_scope_all_guards_every_route_but_health_and_ping(scoped: Server) -> None:
    url = scoped.base_url
    for path in ("/health", "/ping"):
        assert httpx.get(url + path, timeout=30).status_code == 200
    guarded = [("GET", "/v1/models", None), ("GET", "/metrics", None), ("GET", "/version", None),
               ("GET", "/openapi.json", None), ("POST", "/tokenize", {"prompt": "x"}),
               ("POST", "/detokenize", {"tokens": [1]})]  # fmt: skip
    for method, path, body in guarded:
        r = httpx.request(method, url + path, json=body, timeout=30)
        assert _assert_error(r, 401)["type"] == "AuthenticationError", path
        r = httpx.request(method, url + path, json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200, (path, r.text[:200])
    # No body is read for a client without the key: a huge Content-Length is a 401, not a 413.
    head = f"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: {10 * SMALL_LIMIT}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", scoped.port), timeout=30) as sock:
        sock.sendall(head.encode())
        status = read_response(sock, bytearray())[0]
    assert status == 401


def test_cors_allows_only_the_origins_given(server: Server, scoped: Server) -> None:
    def preflight(srv: Server, origin: str) -> httpx.Response:
        headers = {"Origin": origin, "Access-Control-Request-Method": "POST",
                   "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
        return httpx.options(srv.base_url + "/v1/completions", headers=headers, timeout=30)

    # Default: no origin may use the server from a browser (vLLM's default would allow any).
    r = preflight(server, "http://evil.example")
    assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(
        server.base_url + "/v1/models", headers={**AUTH, "Origin": "http://evil.example"}, timeout=30
    )
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    # --allowed-origins: that origin only.
    r = preflight(scoped, GOOD_ORIGIN)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD_ORIGIN
    r = preflight(scoped, "http://evil.example")
    assert r.status_code >= 400 and r.headers.get("access-control-allow-origin") != "http://evil.example"
    r = httpx.get(scoped.base_url + "/v1/models", headers={**AUTH, "Origin": GOOD_ORIGIN}, timeout=30)
    assert r.headers["access-control-allow-origin"] == GOOD_ORIGIN


# ---------------------------------------------------------------------------- 5. (last) engine death


def test_engine_death_mid_stream_sends_the_short_message_only(server: Server) -> None:
    status = json.loads((server.run_dir / "EngineCore_DP0.status.json").read_text())
    events: list[list[str]] = []
    body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    chat = {
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as client:
        with (
            client.stream("POST", server.base_url + "/v1/completions", json=body, headers=AUTH) as r1,
            client.stream("POST", server.base_url + "/v1/chat/completions", json=chat, headers=AUTH) as r2,
        ):
            lines1, lines2 = r1.iter_lines(), r2.iter_lines()
            next(line for line in lines1 if line.startswith("data: "))
            next(line for line in lines2 if line.startswith("data: "))
            os.kill(status["pid"], signal.SIGKILL)
            for lines in (lines1, lines2):
                events.append([line[len("data: ") :] for line in lines if line.startswith("data: ")])
        plain = client.post(server.base_url + "/v1/completions", json={"prompt": "x"}, headers=AUTH)
    expected = _assert_error(plain, 503)["message"]
    assert expected == ENGINE_DEAD_MESSAGE
    for stream in events:
        assert stream[-1] == "[DONE]"
        error = json.loads(stream[-2])["error"]
        assert error == {"message": expected, "type": "ServiceUnavailableError", "param": None, "code": 503}
        assert not any("pid" in event or "EngineCore" in event for event in stream[:-1])
    # The root-cause block goes to the log instead.
    assert "The engine died while streaming" in server.log()


def test_the_default_body_limit_is_one_number_everywhere() -> None:
    from engine.cli import serve
    from engine.entrypoints.openai.api_server_messages import ServerArgs

    assert serve.DEFAULT_MAX_REQUEST_BODY_BYTES == DEFAULT_MAX_REQUEST_BODY_BYTES
    assert ServerArgs().max_request_body_bytes == DEFAULT_MAX_REQUEST_BODY_BYTES
