"""``glassbox bench serve``: the metric math, and real runs against a peer server with known timing.

The peer is a small OpenAI-compatible server started here (FastAPI on uvicorn, in a thread,
on 127.0.0.1 port 0). It streams ``max_tokens`` one-character chunks: the first after
``TTFT_S``, the rest ``ITL_S`` apart, then a usage chunk — so the benchmark's figures can be
checked against delays we chose. Route prefixes change its behaviour:

- ``/flaky/v1/completions`` answers every second request with HTTP 500;
- ``/pairs/v1/completions`` puts two tokens in each chunk;
- ``/nousage/v1/completions`` sends no usage chunk;
- ``/blank/v1/completions`` sends its first ``BLANK_CHUNKS`` tokens with empty text (as a
  real server does for a byte that completes no character yet);
- ``/raw/v1/completions`` sends each token as ``"x\u2028\x85"`` written raw (JSON need not
  escape them, and a real server does not), its lines ended with CRLF;
- a chat stream opens with the role chunk, sent with the first token as vLLM does;
- without ``ignore_eos`` it "meets EOS" after ``EOS_AFTER`` tokens.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.bench.serve import (
    RequestFuncOutput,
    arrival_times,
    calculate_metrics,
    load_tokenizer,
    percentile,
    sample_random_requests,
    sse_data,
)
from engine.cli.main import main

TTFT_S = 0.2  # long enough that a loaded machine still gets every allowed request in flight at once
ITL_S = 0.01
EOS_AFTER = 3
BLANK_CHUNKS = 3
RAW_TOKEN = "x\u2028\x85"  # line separators to str.splitlines, not to the SSE format
MODEL = "peer-model"
ROOT = Path(__file__).resolve().parents[3]


class Peer:
    """The peer server's state: the bodies it received and the most requests in flight at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.peak = 0
        self.count = 0
        self.gate = 0  # hold first tokens until this many requests have arrived (10 s at most)

    def enter(self, body: dict) -> int:
        with self.lock:
            self.bodies.append(body)
            self.count += 1
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            return self.count

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1


def _build_app(peer: Peer):
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": MODEL, "object": "model"}, {"id": "other", "object": "model"}],
        }

    async def complete(request: Request, mode: str):
        body = await request.json()
        body["authorization"] = request.headers.get("authorization")  # recorded with the body
        number = peer.enter(body)
        if mode == "flaky" and number % 2 == 0:
            peer.leave()
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        chat = "messages" in body
        tokens = body["max_completion_tokens"] if chat else body["max_tokens"]
        if not body.get("ignore_eos"):
            tokens = min(tokens, EOS_AFTER)
        per_chunk = 2 if mode == "pairs" else 1

        def event(piece: str, delta: dict | None = None) -> str:
            delta = delta or {"content": piece}
            choice = {"index": 0, "delta": delta} if chat else {"index": 0, "text": piece}
            if mode == "raw":
                return f"data: {json.dumps({'choices': [choice]}, ensure_ascii=False)}\r\n\r\n"
            return f"data: {json.dumps({'choices': [choice]})}\n\n"

        async def stream():
            try:
                deadline = time.monotonic() + 10
                while peer.count < peer.gate and time.monotonic() < deadline:
                    await asyncio.sleep(0.005)
                await asyncio.sleep(TTFT_S)
                if chat:
                    yield event("", {"role": "assistant", "content": ""})
                for sent in range(0, tokens, per_chunk):
                    if sent:
                        await asyncio.sleep(ITL_S)
                    blank = mode == "blank" and sent < BLANK_CHUNKS
                    yield event(
                        "" if blank else RAW_TOKEN if mode == "raw" else "x" * min(per_chunk, tokens - sent)
                    )
                if mode != "nousage":
                    usage = {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                peer.leave()

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def plain(request: Request):
        return await complete(request, "plain")

    @app.post("/{mode}/v1/completions")
    @app.post("/{mode}/v1/chat/completions")
    async def with_mode(request: Request, mode: str):
        return await complete(request, mode)

    return app


@pytest.fixture(scope="module")
def peer_server():
    peer = Peer()
    config = uvicorn.Config(_build_app(peer), host="127.0.0.1", port=0, log_level="warning", loop="asyncio")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "peer server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield peer, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture
def peer(peer_server):
    peer_server[0].reset()
    return peer_server


def _bench(base_url: str, tmp_path, *flags: str) -> dict:
    out = tmp_path / "result.json"
    rc = main(["bench", "serve", "--base-url", base_url, "--result-json", str(out), *flags])
    assert rc == 0
    return json.loads(out.read_text())


# --- metric math on hand-made records ----------------------------------------------------


def _out(success=True, prompt_len=0, output_tokens=0, ttft=0.0, itl=(), latency=0.0) -> RequestFuncOutput:
    return RequestFuncOutput(success, prompt_len, output_tokens, ttft, list(itl), latency)


def test_metrics_match_hand_computed_values():
    outputs = [
        _out(prompt_len=10, output_tokens=5, ttft=0.1, itl=[0.02] * 4, latency=0.18),
        _out(prompt_len=20, output_tokens=3, ttft=0.3, itl=[0.05, 0.05], latency=0.4),
        _out(prompt_len=5, output_tokens=1, ttft=0.2, latency=0.2),  # one token: no TPOT
        _out(success=False, prompt_len=7, output_tokens=9, ttft=9.0, itl=[9.0], latency=9.0),
    ]
    m = calculate_metrics(outputs, duration_s=2.0)
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 35, 9)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(22.0)
    # TTFT 100, 300, 200 ms: p99 interpolates between 200 and 300 at rank 1.98.
    assert (m.ttft.mean_ms, m.ttft.median_ms, m.ttft.p99_ms) == pytest.approx((200.0, 200.0, 298.0))
    # TPOT (180-100)/4 = 20 ms and (400-300)/2 = 50 ms.
    assert (m.tpot.count, m.tpot.mean_ms, m.tpot.median_ms) == (2, pytest.approx(35.0), pytest.approx(35.0))
    assert m.tpot.p99_ms == pytest.approx(49.7)
    # ITL pools every gap: four of 20 ms, two of 50 ms.
    assert (m.itl.count, m.itl.mean_ms, m.itl.median_ms, m.itl.p99_ms) == (
        6,
        pytest.approx(30.0),
        pytest.approx(20.0),
        pytest.approx(50.0),
    )
    assert m.e2el.mean_ms == pytest.approx(260.0)
    as_json = m.to_json()
    assert as_json["mean_ttft_ms"] == pytest.approx(200.0) and as_json["completed"] == 3


def test_metrics_with_no_success_have_no_latencies():
    m = calculate_metrics([_out(success=False, prompt_len=4)], duration_s=1.0)
    assert (m.completed, m.failed, m.total_input, m.request_throughput) == (0, 1, 0, 0.0)
    assert m.ttft.mean_ms is None and m.tpot.p99_ms is None and m.itl.count == 0


def test_percentile_interpolates_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([0, 10], 99) == pytest.approx(9.9)


# --- dataset and arrivals ----------------------------------------------------------------


def test_random_dataset_lengths_ids_and_seed():
    exact = sample_random_requests(20, input_len=16, output_len=8, seed=3)
    assert all(len(r.prompt) == r.prompt_len == 16 and r.expected_output_len == 8 for r in exact)
    assert all(100 <= t < 1000 for r in exact for t in r.prompt)
    assert exact == sample_random_requests(20, input_len=16, output_len=8, seed=3)
    assert exact != sample_random_requests(20, input_len=16, output_len=8, seed=4)

    ranged = sample_random_requests(200, input_len=100, output_len=10, range_ratio=0.5, vocab_range=(5, 7))
    lengths = {r.prompt_len for r in ranged}
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(lengths) > 20
    assert all(5 <= r.expected_output_len <= 15 for r in ranged)
    assert {t for r in ranged for t in r.prompt} == {5, 6}


def test_text_prompts_reencode_to_their_length(default_model_dir):
    tokenizer = load_tokenizer(default_model_dir)
    requests = sample_random_requests(10, input_len=32, output_len=4, tokenizer=tokenizer)
    for r in requests:
        assert isinstance(r.prompt, str)
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False).ids)
        assert abs(r.prompt_len - 32) <= 2


def test_arrivals_poisson_mean_gap_and_inf():
    assert arrival_times(5, float("inf")) == [0.0] * 5
    times = arrival_times(4001, request_rate=50.0, seed=1)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    assert times[-1] / 4000 == pytest.approx(1 / 50.0, rel=0.06)
    assert times == arrival_times(4001, request_rate=50.0, seed=1)


# --- real runs against the peer server ---------------------------------------------------


def test_run_reports_the_peer_timing(peer, tmp_path, capsys):
    state, url = peer
    result = _bench(
        url, tmp_path, "--num-prompts", "6", "--random-input-len", "12", "--random-output-len", "5"
    )
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "Mean TTFT (ms):" in table and "P99 ITL (ms):" in table
    assert (result["completed"], result["failed"], result["total_input_tokens"]) == (6, 0, 72)
    assert result["total_output_tokens"] == 30 and result["model"] == MODEL
    for r in result["requests"]:
        assert r["success"] and r["output_tokens"] == 5 and r["generated_text"] == "xxxxx"
        assert TTFT_S * 1000 <= r["ttft_ms"] < TTFT_S * 1000 + 500
        # The last chunk cannot arrive before the server sent it; the ITLs span first to last.
        assert r["latency_ms"] >= (TTFT_S + 4 * ITL_S) * 1000
        assert len(r["itl_ms"]) == 4 and sum(r["itl_ms"]) == pytest.approx(r["latency_ms"] - r["ttft_ms"])
    # Single gaps jitter with the client's scheduling; their mean does not stray far.
    assert result["mean_itl_ms"] >= ITL_S * 1000 * 0.5 and result["p99_itl_ms"] >= result["median_itl_ms"]
    assert result["mean_tpot_ms"] == pytest.approx(result["mean_itl_ms"])  # one token per chunk
    assert result["request_throughput"] == pytest.approx(6 / result["duration"])
    # What the server was sent: streamed token-id prompts with the vLLM extras.
    body = state.bodies[0]
    assert body["model"] == MODEL and body["stream"] is True and body["ignore_eos"] is True
    assert body["max_tokens"] == 5 and body["temperature"] == 0.0
    assert body["stream_options"] == {"include_usage": True}
    assert len(body["prompt"]) == 12 and all(isinstance(t, int) for t in body["prompt"])


def test_host_and_port_name_the_server_as_in_vllm(peer, tmp_path):
    state, url = peer
    port = url.rsplit(":", 1)[1]
    out = tmp_path / "result.json"
    rc = main(["bench", "serve", "--host", "127.0.0.1", "--port", port, "--num-prompts", "2",
               "--random-output-len", "3", "--result-json", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert rc == 0 and (result["completed"], result["failed"]) == (2, 0)
    assert len(state.bodies) == 2


def test_no_ignore_eos_lets_the_server_stop_early(peer, tmp_path):
    state, url = peer
    flags = [
        "--num-prompts",
        "3",
        "--random-output-len",
        "8",
        "--no-ignore-eos",
        "--model",
        "named",
        "--api-key",
        "k1",
    ]
    result = _bench(url, tmp_path, *flags)
    assert result["total_output_tokens"] == 3 * EOS_AFTER
    assert all("ignore_eos" not in body and body["model"] == "named" for body in state.bodies)
    assert all(body["authorization"] == "Bearer k1" for body in state.bodies)


def test_failed_requests_are_counted_with_their_error(peer, tmp_path, capsys):
    _, url = peer
    result = _bench(
        url,
        tmp_path,
        "--endpoint",
        "/flaky/v1/completions",
        "--random-output-len",
        "4",
        "--num-prompts",
        "6",
        "--max-concurrency",
        "1",
    )
    assert (result["completed"], result["failed"]) == (3, 3)
    failed = [r for r in result["requests"] if not r["success"]]
    assert all(r["error"].startswith("HTTP 500") and "injected failure" in r["error"] for r in failed)
    assert result["total_output_tokens"] == 3 * 4
    out = capsys.readouterr().out
    assert "error (1 of 1 distinct, 3 requests): HTTP 500" in out, out


def test_all_failed_exits_nonzero(peer, tmp_path, capsys):
    _, url = peer
    rc = main(["bench", "serve", "--base-url", url, "--endpoint", "/missing", "--num-prompts", "2"])
    err = capsys.readouterr().err
    assert rc == 1 and "no request succeeded" in err


def test_multi_token_chunks_give_one_itl_per_chunk(peer, tmp_path):
    _, url = peer
    result = _bench(
        url, tmp_path, "--endpoint", "/pairs/v1/completions", "--num-prompts", "2", "--random-output-len", "8"
    )
    for r in result["requests"]:
        assert r["output_tokens"] == 8  # from usage: tokens, not chunks
        assert len(r["itl_ms"]) == 3  # four chunks of two tokens
    # TPOT spreads three chunk gaps over seven tokens: well under one gap.
    assert result["mean_tpot_ms"] < result["mean_itl_ms"] * 0.6


def test_without_usage_tokens_are_counted_by_chunks(peer, tmp_path):
    _, url = peer
    result = _bench(
        url,
        tmp_path,
        "--endpoint",
        "/nousage/v1/completions",
        "--num-prompts",
        "2",
        "--random-output-len",
        "4",
    )
    assert result["total_output_tokens"] == 8


def test_ttft_is_the_first_chunk_even_with_empty_text(peer, tmp_path):
    # As vLLM's client: a token whose text is still empty is a token made. Timing the first
    # non-empty text instead put TTFT BLANK_CHUNKS steps late (and, on a random model whose
    # bytes rarely form characters, at the end of the stream).
    _, url = peer
    flags = ["--endpoint", "/blank/v1/completions", "--num-prompts", "2", "--random-output-len", "6"]
    result = _bench(url, tmp_path, *flags)
    for r in result["requests"]:
        assert r["generated_text"] == "xxx" and r["output_tokens"] == 6
        assert TTFT_S * 1000 <= r["ttft_ms"] < TTFT_S * 1000 + 500
        assert len(r["itl_ms"]) == 5 and sum(r["itl_ms"]) == pytest.approx(r["latency_ms"] - r["ttft_ms"])


def test_line_separators_inside_a_chunk_do_not_cut_it(peer, tmp_path):
    # U+2028 and U+0085 end a line for str.splitlines (and so for httpx's aiter_lines), not
    # for SSE; a server writes them raw in a chunk's JSON when a token's text holds one.
    _, url = peer
    flags = ["--endpoint", "/raw/v1/completions", "--num-prompts", "2", "--random-output-len", "3"]
    result = _bench(url, tmp_path, *flags)
    assert result["completed"] == 2
    for r in result["requests"]:
        assert r["generated_text"] == RAW_TOKEN * 3 and r["output_tokens"] == 3 and len(r["itl_ms"]) == 2


@pytest.mark.parametrize("cut", [1, 2, 3, 7, 1000])
def test_sse_payloads_are_whole_however_the_reads_cut_the_stream(cut):
    body = 'data: {"a": 1}\r\n\r\n: a comment\nevent: x\ndata:{"b":"\u2028"}\n\rdata: [DONE]\r\n'.encode()

    class Response:
        async def aiter_bytes(self):
            for i in range(0, len(body), cut):
                yield body[i : i + cut]

    async def payloads() -> list[bytes]:
        return [data async for data in sse_data(Response())]

    assert asyncio.run(payloads()) == [b'{"a": 1}', '{"b":"\u2028"}'.encode(), b"[DONE]"]


def test_chat_role_chunk_times_ttft_but_is_not_a_token(peer, tmp_path, default_model_dir):
    _, url = peer
    flags = ["--endpoint", "/nousage/v1/chat/completions", "--tokenizer", str(default_model_dir)]
    result = _bench(url, tmp_path, *flags, "--num-prompts", "2", "--random-output-len", "4")
    assert result["total_output_tokens"] == 2 * 4  # counted by chunks: the role chunk is none
    for r in result["requests"]:
        assert TTFT_S * 1000 <= r["ttft_ms"] < TTFT_S * 1000 + 500 and len(r["itl_ms"]) == 4


@pytest.mark.parametrize("limit, expected_peak", [("1", 1), ("3", 3), (None, 8)])
def test_max_concurrency_bounds_requests_in_flight(peer, tmp_path, limit, expected_peak):
    state, url = peer
    state.gate = expected_peak  # none finishes before the allowed ones are all in, however slow the machine
    flags = ["--num-prompts", "8", "--random-output-len", "4"]
    if limit:
        flags += ["--max-concurrency", limit]
    result = _bench(url, tmp_path, *flags)
    assert result["completed"] == 8
    assert state.peak == expected_peak  # no limit and rate inf: all eight sent at once
    assert result["max_concurrent_requests"] == expected_peak


def test_finite_request_rate_spreads_the_arrivals(peer, tmp_path):
    _, url = peer
    rate, n = 20.0, 8
    span = arrival_times(n, rate, seed=0)[-1]  # the run's seeded Poisson schedule
    result = _bench(
        url, tmp_path, "--num-prompts", str(n), "--random-output-len", "2", "--request-rate", str(rate)
    )
    starts = [r["start_s"] for r in result["requests"]]
    assert starts == sorted(starts) and starts[-1] >= span * 0.99
    assert span <= result["duration"] < span + 1.5
    assert result["request_rate"] == "20.0"


def test_chat_endpoint_with_tokenizer_sends_text(peer, tmp_path, default_model_dir):
    state, url = peer
    result = _bench(
        url,
        tmp_path,
        "--endpoint",
        "/v1/chat/completions",
        "--tokenizer",
        str(default_model_dir),
        "--num-prompts",
        "2",
        "--random-output-len",
        "4",
    )
    assert result["completed"] == 2 and result["total_output_tokens"] == 2 * 4
    message = state.bodies[0]["messages"][0]
    assert message["role"] == "user" and isinstance(message["content"], str) and message["content"]


# --- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--num-prompts", "0"], "--num-prompts"),
        (["--num-prompts", "x"], "--num-prompts"),
        (["--request-rate", "0"], "--request-rate"),
        (["--random-range-ratio", "1.0"], "--random-range-ratio"),
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--random-output-len", "-1"], "--random-output-len"),
        (["--timeout", "0"], "--timeout"),
        (["--base-url", "localhost:8000"], "--base-url"),
        (["--port", "0"], "--port"),
        (["--port", "x"], "--port"),
        (["--vocab-range", "9", "9"], "--vocab-range"),
        (["--tokenizer", "/nonexistent"], "--tokenizer"),
        (["--endpoint", "/v1/chat/completions"], "--endpoint"),
        (["--result-json", "/nonexistent/dir/out.json"], "--result-json"),
    ],
)
def test_bad_flag_is_one_line_naming_it(flags, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.count("\n") == 1 and flag in err and err.startswith("glassbox bench serve: error:")


def test_unreachable_server_is_one_clear_line():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli.main", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and f"cannot reach http://127.0.0.1:{port}/v1/models" in proc.stderr
