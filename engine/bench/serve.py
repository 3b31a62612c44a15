"""Load generator for any OpenAI-compatible server: random prompts, streamed requests, metrics.

Mirrors vLLM's ``vllm bench serve``: ``vllm/benchmarks/serve.py`` (arrivals, the run,
``calculate_metrics``), ``vllm/benchmarks/lib/endpoint_request_func.py`` (one streamed
request, timed chunk by chunk) and the random dataset of ``vllm/benchmarks/datasets.py``.
The class names are vLLM's (``SampleRequest``, ``RequestFuncInput``, ``RequestFuncOutput``,
``BenchmarkMetrics``).

The idea. A client cannot see tokens, only the chunks of a server-sent-event stream, so every
latency is measured at chunk arrival. For each request (all times ``time.perf_counter``):

- **TTFT** (time to first token): request sent → first chunk that carries a choice, *even
  one with empty text*, as in vLLM: a server sends a chunk per step that made tokens, and a
  token's text may be empty (a byte that completes no character yet, a skipped special
  token, text held back for a possible stop string) though the token is made. (Timing the
  first *non-empty* text instead once made a random-weight model's TTFT p99 look 2 s where
  its first tokens came after 0.8 s.) A chat stream's first chunk is the role chunk, which
  servers send with the first token.
- **ITL** (inter-token latency): the gap between consecutive choice chunks. A chunk may
  carry several tokens (the server coalesced them, or speculative decoding accepted a run);
  as in vLLM, each *chunk* gives one ITL sample — the gap is not divided among its tokens.
  So a chat stream, whose role chunk comes with the first token, has one near-zero ITL
  sample more than tokens − 1 (vLLM's client counts it the same way); TPOT does not.
- **E2EL** (end-to-end latency): request sent → last choice chunk (not ``[DONE]``, nor the
  usage chunk), so TPOT is the mean chunk gap when chunks are tokens.
- **TPOT** (time per output token, first token excluded): ``(E2EL - TTFT) / (tokens - 1)``,
  only for requests with more than one output token. It counts *tokens* (from the final
  ``usage`` chunk when the server sends one, else one per chunk), so it differs from the
  mean ITL exactly when chunks carry several tokens.

Over the run, only successful requests count: the throughputs divide their totals by the
benchmark duration (first request sent → last one finished, semaphore waits included);
TTFT/TPOT/ITL/E2EL are summarised by mean, median, standard deviation and p99 in ms.
Waiting for the ``--max-concurrency`` semaphore is *not* part of a request's TTFT (the clock
starts when the request is sent), as in vLLM.

Arrivals: ``request_rate=inf`` releases every request at once; a finite rate draws the gaps
between sends from a gamma distribution with mean ``1/rate`` (``burstiness=1``: exponential
gaps, a Poisson process), seeded, scheduled against absolute times so sleeps do not drift.

Bounds: every request is cut off after ``timeout`` seconds in total (not only per read), so
a run ends within (last arrival) + ceil(num_prompts / concurrency) × timeout.

Left out: datasets other than ``random`` (ShareGPT, sonnet, ...), prefix lengths, goodput
and SLOs, ramp-up, profiling hooks, multimodal inputs, the progress bar, and vLLM's initial
one-request test run (a ``GET /v1/models`` probe checks that the server is reachable).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

DEFAULT_VOCAB_RANGE = (100, 1000)  # token ids [low, high) that every real vocabulary has
_ERROR_TEXT_LIMIT = 300  # characters of an error body kept per failed request
T = TypeVar("T")


class BenchmarkError(Exception):
    """The benchmark cannot run at all (server unreachable, no model listed). One line."""


# --- the dataset -------------------------------------------------------------------------


@dataclass
class SampleRequest:
    """One prompt to send.

    Attributes:
        prompt: token ids (sent as a token-id prompt) or text.
        prompt_len: prompt length in tokens.
        expected_output_len: ``max_tokens`` for this request.
    """

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


def _length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] for a length drawn around ``length`` (at least 1)."""
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.floor(length * (1 + range_ratio)))
    return low, high


def load_tokenizer(path: str | Path) -> Any:
    """A ``tokenizers.Tokenizer`` from ``path/tokenizer.json`` (the fast tokenizer; no torch).

    Raises:
        ValueError: no readable ``tokenizer.json`` at ``path``.
    """
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"no tokenizer.json in {path}")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises its own Exception subclass
        raise ValueError(f"cannot load {file}: {e}") from e


def _text_prompt(
    tokenizer: Any, rng: random.Random, length: int, vocab_range: tuple[int, int]
) -> tuple[str, int]:
    """Text that re-encodes to ``length`` tokens (or close): decode random ids, re-encode, fix up.

    Decoding then encoding does not round-trip (merges, byte fragments, dropped special ids),
    so the ids are trimmed or topped up a few times. Returns the text and its true length.
    """
    ids = [rng.randrange(*vocab_range) for _ in range(length)]
    for _ in range(10):
        text = tokenizer.decode(ids)
        encoded = tokenizer.encode(text, add_special_tokens=False).ids
        if len(encoded) == length:
            break
        if len(encoded) > length:
            ids = encoded[:length]
        else:
            ids = encoded + [rng.randrange(*vocab_range) for _ in range(length - len(encoded))]
    return text, len(encoded)


def sample_random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    vocab_range: tuple[int, int] | None = None,
    tokenizer: Any = None,
) -> list[SampleRequest]:
    """The random dataset (vLLM: ``RandomDataset``): random prompts of random lengths.

    Each prompt's length is drawn uniformly from
    ``[floor(input_len * (1 - range_ratio)), floor(input_len * (1 + range_ratio))]`` tokens,
    and its ``max_tokens`` likewise around ``output_len``; ``range_ratio=0`` gives exact
    lengths. Without a tokenizer a prompt is a list of token ids drawn from ``vocab_range``
    (default [100, 1000), present in any real vocabulary); with one it is text decoded from
    random ids of the tokenizer's base vocabulary. Same seed, same dataset.
    """
    rng = random.Random(seed)
    if vocab_range is None:
        vocab_range = (
            (0, tokenizer.get_vocab_size(with_added_tokens=False)) if tokenizer else DEFAULT_VOCAB_RANGE
        )
    in_low, in_high = _length_bounds(input_len, range_ratio)
    out_low, out_high = _length_bounds(output_len, range_ratio)
    requests = []
    for _ in range(num_prompts):
        length = rng.randint(in_low, in_high)
        max_tokens = rng.randint(out_low, out_high)
        if tokenizer is None:
            prompt: str | list[int] = [rng.randrange(*vocab_range) for _ in range(length)]
        else:
            prompt, length = _text_prompt(tokenizer, rng, length, vocab_range)
        requests.append(SampleRequest(prompt, length, max_tokens))
    return requests


def arrival_times(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """When each request is sent, in seconds after the start; the first at 0.0.

    ``request_rate=inf``: all at 0.0. Otherwise the gaps are gamma-distributed with shape
    ``burstiness`` and mean ``1 / request_rate`` (``burstiness=1``: Poisson arrivals; below 1
    burstier, above 1 more regular). Seeded apart from the dataset, so changing the dataset
    does not move the arrivals.
    """
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(f"arrivals-{seed}")
    scale = 1.0 / (request_rate * burstiness)
    times, now = [], 0.0
    for i in range(num_requests):
        if i:
            now += rng.gammavariate(burstiness, scale)
        times.append(now)
    return times


# --- one request -------------------------------------------------------------------------


@dataclass
class RequestFuncInput:
    """What one streamed request sends (vLLM: ``RequestFuncInput``)."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int
    model: str
    api_url: str
    ignore_eos: bool = True
    chat: bool = False  # a chat endpoint: the prompt goes in a user message


@dataclass
class RequestFuncOutput:
    """What one request measured (vLLM: ``RequestFuncOutput``). Times in seconds.

    Attributes:
        success: the stream ended normally (HTTP 200, no error event).
        prompt_len: prompt tokens, as planned by the dataset.
        output_tokens: ``usage.completion_tokens`` of the final chunk, else the number of
            choice chunks (a chat stream's role chunk not counted).
        ttft: sent → first chunk with a choice, its text empty or not.
        itl: one gap per later choice chunk (len = chunks - 1).
        latency: sent → last choice chunk (E2EL).
        start_time: when it was sent, after the benchmark's start.
        error: why it failed (HTTP status and body, exception, timeout); "" on success.
    """

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""


def _payload(request: RequestFuncInput) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": request.model,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.chat:
        payload["messages"] = [{"role": "user", "content": request.prompt}]
        payload["max_completion_tokens"] = request.output_len
    else:
        payload["prompt"] = request.prompt
        payload["max_tokens"] = request.output_len
    if request.ignore_eos:  # a vLLM extension: sent only when wanted, for strict servers
        payload["ignore_eos"] = True
    return payload


def _chunk_text(chunk: dict[str, Any], chat: bool) -> str | None:
    """The text a chunk carries ("" for none), or None when it has no choices (the usage chunk)."""
    choices = chunk.get("choices")
    if not choices:
        return None
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def _is_role_chunk(chunk: dict[str, Any]) -> bool:
    """A chat stream's opening chunk: a role and no content (it times TTFT, but is no token)."""
    delta = chunk["choices"][0].get("delta") or {}
    return "role" in delta and not delta.get("content")


async def sse_data(response: Any) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of a server-sent-event stream (``httpx.Response``), as they come.

    Lines are cut from the raw bytes at ``\\n``, ``\\r\\n`` or ``\\r`` — the line ends of the
    SSE format, and nothing else. A text line splitter (httpx's ``aiter_lines``, which cuts
    where ``str.splitlines`` does) also cuts at U+0085, U+2028 and U+2029, which a chunk's
    JSON carries unescaped when a token's text holds one, so that chunk failed to parse;
    it also decoded every read to text first. Other lines (blank separators, comments,
    ``event:``) are skipped; each payload is stripped of surrounding whitespace.
    """
    pending = b""
    async for data in response.aiter_bytes():
        pending += data
        end = max(pending.rfind(b"\n"), pending.rfind(b"\r"))
        if end < 0:
            continue  # no whole line yet
        lines, pending = pending[: end + 1].splitlines(), pending[end + 1 :]
        for line in lines:  # a "\r\n" cut between two reads leaves an empty line: skipped
            if line.startswith(b"data:"):
                yield line[len(b"data:") :].strip()


async def async_request_openai_completions(
    client: Any, request: RequestFuncInput, headers: dict[str, str] | None = None
) -> RequestFuncOutput:
    """Send one streaming (chat) completion and time its chunks.

    ``client`` is an ``httpx.AsyncClient``. Never raises for a request that fails: the
    failure is the output (``success=False``, ``error`` set). Every chunk that carries a
    choice is timed, whatever its text (vLLM's ``async_request_openai_completions``).
    """
    output = RequestFuncOutput(prompt_len=request.prompt_len)
    usage_tokens: int | None = None
    chunks = token_chunks = 0  # every choice chunk; those not a chat stream's role chunk
    start = last = time.perf_counter()
    try:
        async with client.stream(
            "POST", request.api_url, json=_payload(request), headers=headers
        ) as response:
            if response.status_code != 200:
                body = " ".join((await response.aread()).decode(errors="replace").split())
                output.error = f"HTTP {response.status_code}: {body[:_ERROR_TEXT_LIMIT]}"
                return output
            async with contextlib.aclosing(sse_data(response)) as events:
                async for data in events:
                    if data == b"[DONE]":
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        output.error = f"error event: {json.dumps(chunk['error'])[:_ERROR_TEXT_LIMIT]}"
                        return output
                    text = _chunk_text(chunk, request.chat)
                    if text is not None:
                        if chunks == 0:
                            output.ttft = now - start
                        else:
                            output.itl.append(now - last)
                        last = now
                        chunks += 1
                        if not (request.chat and _is_role_chunk(chunk)):
                            token_chunks += 1
                        output.generated_text += text
                    if usage := chunk.get("usage"):
                        usage_tokens = usage.get("completion_tokens")
    except Exception as e:  # connection reset, bad JSON, ...: this request failed, the run goes on
        output.error = f"{type(e).__name__}: {' '.join(str(e).split())}"[:_ERROR_TEXT_LIMIT]
        return output
    if chunks == 0:
        output.error = "the stream carried no choices"
        return output
    output.latency = last - start
    output.output_tokens = usage_tokens if usage_tokens is not None else token_chunks
    output.success = True
    return output


# --- metrics -----------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), interpolating linearly between ranks (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class LatencyStats:
    """A latency's distribution in milliseconds; all None when there was no sample."""

    mean_ms: float | None = None
    median_ms: float | None = None
    std_ms: float | None = None
    p99_ms: float | None = None
    count: int = 0

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencyStats:
        if not seconds:
            return cls()
        ms = [s * 1000 for s in seconds]
        return cls(
            statistics.fmean(ms), statistics.median(ms), statistics.pstdev(ms), percentile(ms, 99), len(ms)
        )


@dataclass
class BenchmarkMetrics:
    """A run's results (vLLM: ``BenchmarkMetrics``). Only successful requests count.

    Attributes:
        completed, failed: request counts.
        total_input, total_output: tokens (prompt, generated) of the completed requests.
        duration_s: first send → last request finished.
        request_throughput: completed / duration (req/s).
        output_throughput: total_output / duration (tok/s).
        total_token_throughput: (total_input + total_output) / duration (tok/s).
        ttft, tpot, itl, e2el: see the module docstring.
    """

    completed: int
    failed: int
    total_input: int
    total_output: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats

    def to_json(self) -> dict[str, Any]:
        """Flat keys as in vLLM's result file (``mean_ttft_ms``, ``p99_itl_ms``, ...)."""
        out: dict[str, Any] = {
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input,
            "total_output_tokens": self.total_output,
            "duration": self.duration_s,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
        }
        for name in ("ttft", "tpot", "itl", "e2el"):
            stats: LatencyStats = getattr(self, name)
            for stat in ("mean", "median", "std", "p99"):
                out[f"{stat}_{name}_ms"] = getattr(stats, f"{stat}_ms")
        return out


def calculate_metrics(outputs: Sequence[RequestFuncOutput], duration_s: float) -> BenchmarkMetrics:
    """Aggregate per-request outputs over a run of ``duration_s`` seconds (vLLM: ``calculate_metrics``)."""
    done = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_tokens for o in done)
    rate = 1.0 / duration_s if duration_s > 0 else 0.0
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(outputs) - len(done),
        total_input=total_input,
        total_output=total_output,
        duration_s=duration_s,
        request_throughput=len(done) * rate,
        output_throughput=total_output * rate,
        total_token_throughput=(total_input + total_output) * rate,
        ttft=LatencyStats.of([o.ttft for o in done]),
        tpot=LatencyStats.of(
            [(o.latency - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
        ),
        itl=LatencyStats.of([gap for o in done for gap in o.itl]),
        e2el=LatencyStats.of([o.latency for o in done]),
    )


# --- the run -----------------------------------------------------------------------------


@dataclass
class BenchmarkConfig:
    """One ``bench serve`` run; the fields are the CLI flags (see ``engine/cli/bench.py``)."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first model of GET /v1/models
    num_prompts: int = 100
    random_input_len: int = 128
    random_output_len: int = 64
    random_range_ratio: float = 0.0
    request_rate: float = math.inf  # requests/s
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    tokenizer: str | None = None
    vocab_range: tuple[int, int] | None = None
    api_key: str | None = None
    timeout: float = 600.0  # seconds, per request, whole stream included

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


@dataclass
class BenchmarkResult:
    """A finished run: its settings, the metrics and every request's measurements."""

    config: BenchmarkConfig
    model: str
    metrics: BenchmarkMetrics
    outputs: list[RequestFuncOutput]
    max_concurrent_requests: int  # most requests in flight at once, seen by the client

    def to_json(self) -> dict[str, Any]:
        settings = asdict(self.config)
        settings.pop("api_key")
        settings["model"] = self.model
        settings["request_rate"] = str(self.config.request_rate)  # JSON has no inf
        requests = [
            {
                "success": o.success,
                "error": o.error,
                "prompt_len": o.prompt_len,
                "output_tokens": o.output_tokens,
                "start_s": o.start_time,
                "ttft_ms": o.ttft * 1000,
                "latency_ms": o.latency * 1000,
                "itl_ms": [gap * 1000 for gap in o.itl],
                "generated_text": o.generated_text,
            }
            for o in self.outputs
        ]
        return {
            **settings,
            **self.metrics.to_json(),
            "max_concurrent_requests": self.max_concurrent_requests,
            "requests": requests,
        }


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _first_model(client: Any, config: BenchmarkConfig) -> str:
    """Check the server answers, and pick the model: ``config.model`` or the first listed."""
    import httpx

    url = f"{config.base_url}/v1/models"
    try:
        response = await client.get(url, headers=_headers(config.api_key), timeout=min(config.timeout, 30.0))
    except httpx.HTTPError as e:
        reason = " ".join(str(e).split()) or "no answer"  # one line, whatever the library wrote
        raise BenchmarkError(f"cannot reach {url}: {type(e).__name__}: {reason}") from None
    if config.model is not None:
        return config.model  # some servers have no /v1/models; answering at all is enough
    if response.status_code != 200:
        if response.status_code == 401:
            raise BenchmarkError(
                f"GET {url} answered HTTP 401: the server wants an API key; pass --api-key "
                "(or set OPENAI_API_KEY)"
            )
        raise BenchmarkError(f"GET {url} answered HTTP {response.status_code}; pass --model")
    try:
        return response.json()["data"][0]["id"]
    except Exception as e:  # not JSON, no "data", an empty list
        raise BenchmarkError(f"GET {url} listed no model ({type(e).__name__}); pass --model") from None


async def benchmark(config: BenchmarkConfig, requests: Sequence[SampleRequest]) -> BenchmarkResult:
    """Send ``requests`` to the server as ``config`` says and measure them.

    Raises:
        BenchmarkError: the server cannot be reached, or no model to name.
    """
    import httpx

    pool = min(len(requests), config.max_concurrency or len(requests)) + 1  # +1: the probe
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(config.timeout)) as client:
        model = await _first_model(client, config)
        api_url = config.base_url + config.endpoint
        headers = _headers(config.api_key)
        semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        in_flight = peak = 0

        async def send(sample: SampleRequest, start: float) -> RequestFuncOutput:
            nonlocal in_flight, peak
            request = RequestFuncInput(
                sample.prompt,
                sample.prompt_len,
                sample.expected_output_len,
                model,
                api_url,
                config.ignore_eos,
                config.chat,
            )
            if semaphore is not None:
                await semaphore.acquire()
            in_flight += 1
            peak = max(peak, in_flight)
            sent = time.perf_counter() - start
            try:
                output = await asyncio.wait_for(
                    async_request_openai_completions(client, request, headers), config.timeout
                )
            except asyncio.TimeoutError:
                output = RequestFuncOutput(
                    prompt_len=sample.prompt_len, error=f"timed out after {config.timeout:g} s"
                )
            finally:
                in_flight -= 1
                if semaphore is not None:
                    semaphore.release()
            output.start_time = sent
            return output

        times = arrival_times(len(requests), config.request_rate, config.burstiness, config.seed)
        start = time.perf_counter()
        tasks = []
        for sample, at in zip(requests, times):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(sample, start)))
        outputs = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    return BenchmarkResult(config, model, calculate_metrics(outputs, duration), outputs, peak)


def run_benchmark(config: BenchmarkConfig) -> BenchmarkResult:
    """Build the random dataset and run the benchmark to the end (blocking).

    Raises:
        BenchmarkError: the server cannot be reached, or no model to name.
        ValueError: the tokenizer cannot be loaded.
    """
    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
    requests = sample_random_requests(
        config.num_prompts,
        config.random_input_len,
        config.random_output_len,
        config.random_range_ratio,
        config.seed,
        config.vocab_range,
        tokenizer,
    )
    return _run(benchmark(config, requests))


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to the end on a uvloop event loop (asyncio's own where uvloop is missing).

    The client reads a chunk per token of every stream; on uvloop that reading costs about a
    third less CPU than on asyncio's selector loop, CPU that on a small machine the server
    under test would otherwise lose to its own benchmark.
    """
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(coro)
    return uvloop.run(coro)


# --- the report --------------------------------------------------------------------------

_WIDTH = 50


def _row(label: str, value: Any) -> str:
    if value is None:
        value = "n/a"
    elif isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40}{value:<10}"


def format_table(result: BenchmarkResult) -> str:
    """The result as a fixed-width table in the layout of ``vllm bench serve``."""
    m = result.metrics
    lines = [
        f"{' Serving Benchmark Result ':=^{_WIDTH}}",
        _row("Successful requests:", m.completed),
        _row("Failed requests:", m.failed),
        *(
            [_row("Maximum request concurrency:", result.config.max_concurrency)]
            if result.config.max_concurrency
            else []
        ),
        _row("Peak concurrent requests:", result.max_concurrent_requests),
        _row("Benchmark duration (s):", m.duration_s),
        _row("Total input tokens:", m.total_input),
        _row("Total generated tokens:", m.total_output),
        _row("Request throughput (req/s):", m.request_throughput),
        _row("Output token throughput (tok/s):", m.output_throughput),
        _row("Total token throughput (tok/s):", m.total_token_throughput),
    ]
    for name, title, stats in (
        ("TTFT", "Time to First Token", m.ttft),
        ("TPOT", "Time per Output Token (excl. 1st token)", m.tpot),
        ("ITL", "Inter-token Latency", m.itl),
    ):
        lines.append(f"{title:-^{_WIDTH}}")
        lines.append(_row(f"Mean {name} (ms):", stats.mean_ms))
        lines.append(_row(f"Median {name} (ms):", stats.median_ms))
        lines.append(_row(f"P99 {name} (ms):", stats.p99_ms))
    lines.append("=" * _WIDTH)
    errors = Counter(o.error for o in result.outputs if not o.success)  # first seen first
    lines += [
        f"error ({i + 1} of {len(errors)} distinct, {n} request{'s' if n != 1 else ''}): {e}"
        for i, (e, n) in enumerate(list(errors.items())[:3])
    ]
    return "\n".join(lines)
