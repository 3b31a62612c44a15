"""The OpenAI-compatible API end to end: a real ``glassbox serve`` and the official client.

One server (``glassbox serve`` in its own process group: API server, engine core, worker)
is started for the whole module, with an API key, the bundled tiny model and
``max_model_len=512``; the tests talk to it with ``openai.OpenAI`` / ``openai.AsyncOpenAI``
and, for raw status codes and SSE bytes, with ``httpx``. The last test kills the engine
core, so it runs last (module order).

What a user would check: the greedy text over HTTP is the offline ``LLM``'s; streams add up
to the full text and never leak a stop string; usage counts are the tokenizer's; bad input
gets the right status and OpenAI's error shape naming the field; a client that goes away
frees its request's KV blocks; a dead engine gives 503.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine.config import DEFAULT_MODEL, ModelConfig
from engine.frontend.input_processor import InputProcessor
from engine.frontend.tokenizer import apply_chat_template, get_tokenizer
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(180)

MODEL = "glassbox-tiny"
API_KEY = "sk-test-key"
MAX_MODEL_LEN = 512
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["The quick brown fox", "import os", "Once upon a time there was"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a module?"}]
STARTUP_TIMEOUT_S = 150


# ---------------------------------------------------------------------------- the server


class Server:
    def __init__(self, proc: subprocess.Popen, run_dir: Path, port: int, log: Path) -> None:
        self.proc = proc
        self.run_dir = run_dir
        self.url = f"http://127.0.0.1:{port}"
        self.log = log

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=60, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def post(self, path: str, body: object, **kwargs) -> httpx.Response:
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        headers = {**AUTH, "Content-Type": "application/json", **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, content=content, headers=headers, timeout=60, **kwargs)

    def metrics(self) -> dict[str, float]:
        """The ``vllm:*`` samples of ``/metrics``, by name (labels dropped)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            if line.startswith("vllm:"):
                name_labels, value = line.rsplit(" ", 1)
                values[name_labels.split("{")[0]] = float(value)
        return values

    def wait_idle(self, timeout: float) -> tuple[float, dict[str, float]]:
        """Seconds until no request runs or waits and no KV block is used (or ``timeout``)."""
        start = time.monotonic()
        while True:
            m = self.metrics()
            idle = m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
            if (idle and m["vllm:kv_cache_usage_perc"] == 0) or time.monotonic() - start > timeout:
                return time.monotonic() - start, m
            time.sleep(0.05)

    def log_tail(self) -> str:
        try:
            return self.log.read_text()[-3000:]
        except OSError:
            return ""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("run")
    log = base / "server.log"
    env = {
        **os.environ,
        "GLASSBOX_RUN_DIR_BASE": str(base),
        # The last test kills the engine: the server must stay up to answer 503.
        "GLASSBOX_KEEP_ALIVE_ON_ENGINE_DEATH": "1",
    }
    cmd = [sys.executable, "-m", "engine.cli.main", "serve", "--port", "0", "--max-model-len", str(MAX_MODEL_LEN),
           "--served-model-name", MODEL, "--api-key", API_KEY, "--uvicorn-log-level", "warning",
           "--allowed-origins", '["http://example.com"]']  # fmt: skip
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    srv = None
    try:
        srv = _wait_until_serving(proc, base, log)
        yield srv
    finally:
        _stop_group(proc)


def _wait_until_serving(proc: subprocess.Popen, base: Path, log: Path) -> Server:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    srv = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"glassbox serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if srv is None:
            for manifest in base.glob("glassbox-*/manifest.json"):
                try:
                    port = json.loads(manifest.read_text()).get("port")
                except (OSError, ValueError):
                    continue
                if port:
                    srv = Server(proc, manifest.parent, port, log)
        if srv is not None:
            try:
                if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                    return srv
            except httpx.HTTPError:
                pass  # bound, but the engine is still starting
        time.sleep(0.2)
    pytest.fail(f"glassbox serve was not ready within {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            # Children (engine core, worker) may outlive the leader by a moment.
            time.sleep(0.5)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(DEFAULT_MODEL)


def sse_events(response: httpx.Response) -> list[object]:
    """The data of each SSE event (JSON-decoded, ``[DONE]`` kept as the string)."""
    events: list[object] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(
    response: httpx.Response, status: int, param: str | None, err_type: str | None = None
) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert error["param"] == param, error
    assert error["message"]
    if err_type is not None:
        assert error["type"] == err_type
    return error


# ---------------------------------------------------------------------------- basics


def test_models_lists_the_served_name(server: Server) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_models_retrieve_and_head_health(server: Server) -> None:
    assert server.client().models.retrieve(MODEL).id == MODEL
    assert_error(
        httpx.get(f"{server.url}/v1/models/nope", headers=AUTH, timeout=10), 404, "model", "NotFoundError"
    )
    assert httpx.head(server.url + "/health", timeout=10).status_code == 200


def test_the_pooling_routes_name_the_runner_they_need(server: Server) -> None:
    for path in ("/v1/embeddings", "/pooling"):
        error = assert_error(server.post(path, {"model": MODEL, "input": "hi"}), 404, None, "NotFoundError")
        assert (
            "this server runs the model with --runner generate, and the route needs --runner pooling"
            in (error["message"])
        )


def test_health_ping_version_metrics_need_no_key(server: Server) -> None:
    from engine import __version__

    for path in ("/health", "/ping"):
        r = httpx.get(server.url + path, timeout=10)
        assert (r.status_code, r.content) == (200, b"")
    assert httpx.get(server.url + "/version", timeout=10).json() == {"version": __version__}
    assert "vllm:num_requests_running" in httpx.get(server.url + "/metrics", timeout=10).text


def test_api_key_is_required_on_v1_only(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.status_code == 401
    assert_error(httpx.get(server.url + "/v1/models", timeout=10), 401, None, "AuthenticationError")
    r = httpx.post(server.url + "/tokenize", json={"prompt": "hi"}, timeout=10)
    assert r.status_code == 200


# ---------------------------------------------------------------------------- generation


def test_completion_usage_counts_are_the_tokenizers(server: Server, tokenizer) -> None:
    out = server.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})  # fmt: skip
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer.encode(PROMPTS[0]))
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_chat_usage_counts_are_the_tokenizers(server: Server, tokenizer) -> None:
    out = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=6,
                                                  temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    prompt = apply_chat_template(tokenizer, CHAT)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    assert out.usage.completion_tokens == 6


@pytest.mark.slow
def test_greedy_text_over_http_equals_offline_llm(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    client = server.client()
    http = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    http_chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)

    from engine import LLM

    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(max_model_len=MAX_MODEL_LEN)
    try:
        params = SamplingParams(temperature=0, max_tokens=12)
        offline = llm.generate(PROMPTS, params, use_tqdm=False)
        offline_chat = llm.chat(CHAT, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [c.index for c in http.choices] == [0, 1, 2]
    assert [c.text for c in http.choices] == [o.outputs[0].text for o in offline]
    assert http.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in offline)
    assert http_chat.choices[0].message.content == offline_chat[0].outputs[0].text


def test_streamed_text_adds_up_to_the_full_text(server: Server) -> None:
    client = server.client()
    kwargs = dict(model=MODEL, max_tokens=10, temperature=0)
    full = client.completions.create(prompt=PROMPTS[1], **kwargs)
    chunks = list(client.completions.create(prompt=PROMPTS[1], stream=True,
                                            stream_options={"include_usage": True}, **kwargs))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])

    full_chat = client.chat.completions.create(messages=CHAT, **kwargs)
    chat_chunks = list(client.chat.completions.create(messages=CHAT, stream=True,
                                                      stream_options={"include_usage": True}, **kwargs))  # fmt: skip
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert chat_chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices)
    assert text == full_chat.choices[0].message.content
    assert chat_chunks[-1].usage == full_chat.usage


def test_a_multi_token_stop_string_never_reaches_the_stream(server: Server) -> None:
    client = server.client()
    base = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    text, lp = base.choices[0].text, base.choices[0].logprobs
    # A stop string made of two whole tokens (so it completes only on the second one),
    # whose first occurrence in the text is where those tokens are.
    stop = None
    for k in range(3, len(lp.tokens) - 2):
        candidate = lp.tokens[k] + lp.tokens[k + 1]
        if len(lp.tokens[k]) and len(lp.tokens[k + 1]) and text.find(candidate) == lp.text_offset[k]:
            stop, cut = candidate, lp.text_offset[k]
            break
    assert stop is not None, f"no usable stop string in {lp.tokens}"

    pieces, finish = [], []
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                           stop=[stop], stream=True, extra_body={"ignore_eos": True}):  # fmt: skip
        pieces.append(chunk.choices[0].text)
        finish.append(chunk.choices[0].finish_reason)
    streamed = "".join(pieces)
    assert streamed == text[:cut]
    assert stop not in streamed
    assert finish[-1] == "stop"


def test_n2_and_several_prompts_give_choices_at_i_times_n_plus_j(server: Server) -> None:
    client = server.client()
    out = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=5, temperature=0)
    singles = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0) for p in PROMPTS[:2]
    ]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    # Greedy: both samples of prompt i equal that prompt's single completion.
    assert [c.text for c in out.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    assert out.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert out.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)

    sampled = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=6, temperature=1.0,
                                             seed=7)  # fmt: skip
    assert sorted(c.index for c in sampled.choices) == [0, 1]
    again = client.chat.completions.create(
        model=MODEL, messages=CHAT, n=2, max_tokens=6, temperature=1.0, seed=7
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in sampled.choices]


def test_logprobs_shapes(server: Server) -> None:
    client = server.client()
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4  # the top 3, plus the sampled token when it is not among them
        assert top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely
        assert logprob <= 0

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True})  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for entry in content:
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())


def test_echo_prepends_the_prompt(server: Server) -> None:
    client = server.client()
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0)
    echo = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0, echo=True,
                                     logprobs=1)  # fmt: skip
    assert echo.choices[0].text == PROMPTS[1] + plain.choices[0].text
    lp = echo.choices[0].logprobs
    assert len(lp.tokens) == echo.usage.prompt_tokens + echo.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert all(v is not None for v in lp.token_logprobs[1:])


def collect_stream(server: Server, body: dict) -> dict[int, dict]:
    """A completions stream put back together: per choice, its text, tokens and offsets."""
    choices: dict[int, dict] = {}
    with httpx.Client(timeout=60) as client, client.stream("POST", server.url + "/v1/completions",
                                                           json={**body, "stream": True}, headers=AUTH) as r:  # fmt: skip
        assert r.status_code == 200
        for event in sse_events(r):
            if event == "[DONE]":
                break
            assert "error" not in event, event
            for c in event["choices"]:
                choice = choices.setdefault(c["index"], {"text": "", "tokens": [], "text_offset": []})
                choice["text"] += c["text"]
                choice["finish_reason"] = c["finish_reason"]
                if c["logprobs"] is not None:
                    choice["tokens"] += c["logprobs"]["tokens"]
                    choice["text_offset"] += c["logprobs"]["text_offset"]
    return choices


def assert_offsets_point_at_the_tokens(
    text: str, tokens: list[str], offsets: list[int], stopped: bool
) -> None:
    """``text_offset[i]`` is where token ``i``'s text starts in the returned ``text``.

    A token holding part of a UTF-8 character decodes alone to U+FFFD: what comes before
    that must be at the offset, followed by the (multi-byte, or never completed) character.
    Tokens cut off with a stop string or a stop token lie at or past the end of the text.
    """
    assert len(offsets) == len(tokens) and offsets == sorted(offsets)
    for token, offset in zip(tokens, offsets):
        head, partial, _ = token.partition("\ufffd")
        if offset + len(head) + len(partial) > len(text):
            assert stopped and offset >= len(text) - len(head), (token, offset, text)
            continue
        assert text[offset : offset + len(head)] == head, (token, offset, text)
        if partial:
            char = text[offset + len(head)]
            assert len(char.encode()) > 1 or char == "\ufffd", (token, offset, text)


def ids_ending_mid_character(tokenizer) -> list[int]:
    """A token-id prompt whose last token is the first byte(s) of a multi-byte character."""
    ids = tokenizer.encode("Once upon a time 日本語 🙂 ñ ü")
    cut = next((i for i in range(len(ids)) if tokenizer.decode(ids[: i + 1]).endswith("\ufffd")), None)
    assert cut is not None, "the tokenizer has a token for every character here: pick rarer ones"
    return ids[: cut + 1]


def two_token_stop_string(server: Server, prompt: str) -> str:
    """Two whole tokens of the greedy output, the first place their text occurs."""
    out = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                                          "logprobs": 0, "ignore_eos": True}).json()  # fmt: skip
    text, tokens = out["choices"][0]["text"], out["choices"][0]["logprobs"]["tokens"]
    for k in range(2, len(tokens) - 1):
        before = "".join(tokens[:k])
        candidate = tokens[k] + tokens[k + 1]
        if (
            "\ufffd" not in before + candidate
            and tokens[k]
            and tokens[k + 1]
            and text.find(candidate) == len(before)
        ):
            return candidate
    pytest.fail(f"no usable stop string in {tokens}")


@pytest.mark.parametrize(
    "case", ["plain", "stop", "echo", "echo_stop", "echo_split_characters", "ids_ending_mid_character", "n2"]
)
def test_logprob_text_offsets_are_positions_in_the_text_streamed_or_not(
    server: Server, tokenizer, case
) -> None:
    body: dict = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "logprobs": 0}
    if "stop" in case:
        body.update(stop=[two_token_stop_string(server, PROMPTS[2])], max_tokens=16, ignore_eos=True)
    if "echo" in case:
        body["echo"] = True
    if case == "echo_split_characters":
        body["prompt"] = "Once upon a time 日本語 🙂 ñ ü"
    if case == "ids_ending_mid_character":
        body.update(prompt=ids_ending_mid_character(tokenizer), echo=True, max_tokens=2)
    if case == "n2":
        body.update(n=2, temperature=1.0, seed=11, logprobs=2)

    full = server.post("/v1/completions", body)
    assert full.status_code == 200, full.text
    streamed = collect_stream(server, body)
    assert sorted(streamed) == [c["index"] for c in full.json()["choices"]]
    for choice in full.json()["choices"]:
        lp = choice["logprobs"]
        stopped = choice["finish_reason"] == "stop"
        if "stop" in case:
            assert choice["stop_reason"] == body["stop"][0]
        assert_offsets_point_at_the_tokens(choice["text"], lp["tokens"], lp["text_offset"], stopped)
        s = streamed[choice["index"]]
        assert (s["text"], s["tokens"], s["text_offset"]) == (choice["text"], lp["tokens"], lp["text_offset"])
    if case == "echo_split_characters":
        # The prompt's characters split over several byte tokens count once each.
        lp = full.json()["choices"][0]["logprobs"]
        assert sum(t == "\ufffd" for t in lp["tokens"]) >= 2, "the prompt must split a character"
        assert lp["text_offset"][len(tokenizer.encode(body["prompt"]))] == len(body["prompt"])


def test_tokenize_detokenize_round_trip(server: Server, tokenizer) -> None:
    text = "Return the number of items in a container."
    r = server.post("/tokenize", {"prompt": text})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert server.post("/detokenize", {"tokens": body["tokens"]}).json() == {"prompt": text}

    chat_tokens = server.post("/tokenize", {"messages": CHAT}).json()
    usage = server.client().chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).usage
    assert chat_tokens["count"] == usage.prompt_tokens
    assert_error(server.post("/detokenize", {"tokens": [10**7]}), 400, "tokens")
    assert_error(server.post("/tokenize", {"prompt": 5}), 400, "prompt")


@pytest.mark.slow
def test_32_concurrent_requests_all_complete(server: Server) -> None:
    prompts = [f"{PROMPTS[i % 3]} {i % 4}" for i in range(32)]

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        kwargs = dict(
            model=MODEL, prompt=prompts[i], max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
        )
        if i % 2:
            text, tokens = "", 0
            stream = await client.completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs
            )
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                else:
                    tokens = chunk.usage.completion_tokens
            return text, tokens
        out = await client.completions.create(**kwargs)
        return out.choices[0].text, out.usage.completion_tokens

    async def run_all() -> list[tuple[str, int]]:
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run_all())
    assert all(tokens == 4 for _, tokens in results)
    # The same prompt gives the same greedy text, streamed or not, whatever ran beside it.
    by_prompt: dict[str, set[str]] = {}
    for prompt, (text, _) in zip(prompts, results):
        by_prompt.setdefault(prompt, set()).add(text)
    assert all(len(texts) == 1 for texts in by_prompt.values())
    assert server.wait_idle(5)[1]["vllm:num_requests_running"] == 0


# ---------------------------------------------------------------------------- limits


def test_max_tokens_is_clamped_to_the_room_left(server: Server) -> None:
    prompt = [5] * 500
    r = server.post(
        "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 100, "ignore_eos": True}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 500
    # Unset (null) means all the room left.
    r = server.post(
        "/v1/completions", {"model": MODEL, "prompt": [5] * 505, "max_tokens": None, "ignore_eos": True}
    )
    assert r.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 505
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_llm_and_http_answer_a_prompt_length_the_same_way(server: Server, tokenizer) -> None:
    """``LLM`` validates with its ``InputProcessor``: it accepts and refuses the lengths the
    server does, with the server's words (a prompt of ``max_model_len`` leaves no room)."""
    processor = InputProcessor(ModelConfig(model=DEFAULT_MODEL, max_model_len=MAX_MODEL_LEN), tokenizer)
    params = SamplingParams(max_tokens=None)
    for n in (MAX_MODEL_LEN - 1, MAX_MODEL_LEN, MAX_MODEL_LEN + 1):
        ids = [5] * n
        r = server.post("/v1/completions", {"model": MODEL, "prompt": ids, "ignore_eos": True})
        if n < MAX_MODEL_LEN:
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
            request = processor.process_inputs("r", {"prompt_token_ids": ids}, params)
            assert request.sampling_params.max_tokens == 1
        else:
            message = assert_error(r, 400, "prompt", "BadRequestError")["message"]
            with pytest.raises(ValueError) as offline:
                processor.process_inputs("r", {"prompt_token_ids": ids}, params)
            assert str(offline.value) == message


BAD_COMPLETIONS = [
    ('{"model": "glassbox-tiny", "prompt": "x",', 400, None),  # malformed JSON
    ({"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN + 1}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, 10**6]}, 400, "prompt"),
    ({"model": MODEL}, 400, "prompt"),
    # Values that once crashed or hung the server (found by a break-it pass):
    ({"model": MODEL, "prompt": "x", "temperature": 1, "top_k": 2**63}, 400, "top_k"),
    ({"model": MODEL, "prompt": "x", "n": 10**20}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": [10**23]}, 400, "stop_token_ids"),
    ({"model": MODEL, "prompt": "\ud800 x"}, 400, "prompt"),
    ({"model": "no-such-model", "prompt": "x"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", BAD_COMPLETIONS)
def test_bad_completion_requests_get_openai_errors(
    server: Server, body: object, status: int, param: str
) -> None:
    error = assert_error(server.post("/v1/completions", body), status, param)
    if status == 404:
        assert error["type"] == "NotFoundError"
        assert error["message"] == "The model `no-such-model` does not exist."
    else:
        assert error["type"] == "BadRequestError"


BAD_CHATS = [
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": "hello"}, "messages"),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages",
    ),  # fmt: skip
    ({"model": MODEL, "messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"model": MODEL, "messages": CHAT, "max_tokens": 10**6}, "max_tokens"),
    ({"model": MODEL, "messages": CHAT, "temperature": -1}, "temperature"),
    ({"model": MODEL, "messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({"model": MODEL, "messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    (
        {"model": MODEL, "messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tool_choice",
    ),
]


@pytest.mark.parametrize("body,param", BAD_CHATS)
def test_bad_chat_requests_get_openai_errors(server: Server, body: dict, param: str) -> None:
    assert_error(server.post("/v1/chat/completions", body), 400, param, "BadRequestError")


def model_vocab_size() -> int:
    return json.loads((Path(DEFAULT_MODEL) / "config.json").read_text())["vocab_size"]


CHAT_FIELD_ERRORS = [
    ({"stop": ["\ud800"]}, "stop"),
    ({"stop": "ok\udfff"}, "stop"),
    ({"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages"),
    ({"messages": [{"role": "us\ud800er", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}, "messages"),
    ({"stop_token_ids": ["VOCAB"]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
]
COMPLETION_FIELD_ERRORS = [
    ({"stop": ["\ud800"]}, "stop"),
    ({"stop": "ok\udfff"}, "stop"),
    ({"prompt": "hi \ud800"}, "prompt"),
    ({"prompt": ["fine", "\ud800"]}, "prompt"),
    ({"prompt": [1, "VOCAB"]}, "prompt"),
    ({"stop_token_ids": ["VOCAB"]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "path,fields,param",
    [("/v1/completions", *case) for case in COMPLETION_FIELD_ERRORS]
    + [("/v1/chat/completions", *case) for case in CHAT_FIELD_ERRORS],
)
def test_a_bad_field_is_a_400_naming_it_before_any_stream_starts(
    server: Server, path: str, fields: dict, param: str, stream: bool
) -> None:
    """Text that is not valid Unicode (a lone surrogate: valid JSON, but no UTF-8 for it) in
    any field, and token ids outside the vocabulary: a plain 400 naming the field — never a
    200 stream (or a chat role chunk) that then carries the error."""
    vocab = model_vocab_size()
    fields = json.loads(json.dumps(fields).replace('"VOCAB"', str(vocab)))
    body = {"model": MODEL, "max_tokens": 4, "stream": stream, **fields}
    if path == "/v1/completions":
        body.setdefault("prompt", PROMPTS[0])
    else:
        body.setdefault("messages", CHAT)
    r = server.post(path, body)
    assert r.headers["content-type"].startswith("application/json"), r.text
    error = assert_error(r, 400, param, "BadRequestError")
    assert "not valid Unicode" in error["message"] or "out of vocabulary" in error["message"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "hi \ud800"}, "prompt"),
        ({"messages": [{"role": "user", "content": "\udfff"}]}, "messages"),
    ],
)
def test_tokenize_names_the_field_that_is_not_valid_text(server: Server, body: dict, param: str) -> None:
    error = assert_error(server.post("/tokenize", {"model": MODEL, **body}), 400, param, "BadRequestError")
    assert "not valid Unicode" in error["message"]


def test_an_error_quoting_a_lone_surrogate_is_still_json(server: Server) -> None:
    error = assert_error(server.post("/v1/completions", {"model": "\ud800", "prompt": "x"}), 404, "model")
    assert error["message"] == "The model `\\ud800` does not exist."


def test_an_unused_field_is_not_checked(server: Server) -> None:
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1, "user": "\ud800"})
    assert r.status_code == 200, r.text


def test_a_body_that_is_not_labelled_json_is_a_400(server: Server) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x"})
    r = server.post("/v1/completions", body, headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert "application/json" in assert_error(r, 400, None)["message"]


def test_cors_preflight_passes_without_a_key(server: Server) -> None:
    """An allowed origin's preflight needs no key (browsers send none); another origin gets
    no CORS header (the default allows none: tests/e2e/test_api_abuse.py)."""
    headers = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
    r = httpx.options(server.url + "/v1/completions", headers=headers, timeout=10)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://example.com"
    other = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(server.url + "/v1/completions", headers=other, timeout=10)
    assert "access-control-allow-origin" not in r.headers


def test_a_prompt_too_long_is_a_400_with_vllms_wording(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL, prompt=[5] * (MAX_MODEL_LEN + 10), max_tokens=4)
    assert e.value.status_code == 400 and e.value.param == "prompt"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in e.value.message
    long_chat = [{"role": "user", "content": "word " * 2000}]
    error = assert_error(
        server.post("/v1/chat/completions", {"model": MODEL, "messages": long_chat}), 400, "messages"
    )
    assert "maximum context length" in error["message"]


def test_a_prompt_too_long_leaves_no_misleading_warning_in_the_log(server: Server) -> None:
    """We check lengths ourselves (a clean 400): transformers must not also log that the
    prompt is longer than the tokenizer's ``model_max_length`` and "will result in indexing
    errors" — nor anything else about how we call it."""
    config = json.loads((Path(DEFAULT_MODEL) / "tokenizer_config.json").read_text())
    words = max(MAX_MODEL_LEN, config.get("model_max_length") or 0, 1000) + 100
    text = "word " * words
    for stream in (False, True):
        body = {"model": MODEL, "prompt": text, "max_tokens": 4, "stream": stream}
        assert_error(server.post("/v1/completions", body), 400, "prompt")
        chat = {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": stream}
        assert_error(server.post("/v1/chat/completions", chat), 400, "messages")
    assert server.post("/tokenize", {"prompt": text}).json()["count"] > words
    log = server.log.read_text(errors="replace")
    assert "indexing errors" not in log and "Token indices sequence length" not in log
    assert "[transformers]" not in log, log[-3000:]


@pytest.mark.parametrize(
    "path,field,value",
    [
        ("/v1/completions", "prompt_logprobs", 1),
        ("/v1/chat/completions", "prompt_logprobs", 1),
        ("/v1/chat/completions", "chat_template", "{{ messages }}"),
    ],
)
def test_a_vllm_extra_that_is_left_out_is_a_400_not_silently_ignored(
    server: Server, path: str, field: str, value: object
) -> None:
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT})
    assert_error(server.post(path, body), 400, field, "BadRequestError")


def test_an_unknown_field_is_ignored_and_logged(server: Server) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "frobnicate_level": 3}
    assert server.post("/v1/completions", body).status_code == 200
    assert "field(s) frobnicate_level are not known and were ignored" in server.log.read_text(
        errors="replace"
    )


def test_a_stream_error_before_start_is_a_plain_error(server: Server) -> None:
    body = {"model": MODEL, "prompt": "x", "stream": True, "temperature": -1}
    assert_error(server.post("/v1/completions", body), 400, "temperature")


# ---------------------------------------------------------------------------- disconnects


def seconds_per_token(server: Server) -> float:
    """How long one token takes now, end to end: a 24-token stream's time from the request to
    its last chunk, over its tokens. (Timing only the gaps between chunks measured nothing when
    a busy machine delivered the chunks in one burst.)"""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 24, "ignore_eos": True, "stream": True}
    chunks = 0
    sent = time.monotonic()
    with httpx.Client(timeout=30) as client, client.stream("POST", server.url + "/v1/completions", json=body,
                                                           headers=AUTH) as response:  # fmt: skip
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
                last = time.monotonic()
    assert chunks > 0, "the stream carried no token"
    return (last - sent) / 24  # ignore_eos: all 24 tokens


LONG = 500  # tokens: many seconds of decoding on these CPUs


def test_a_stream_whose_client_leaves_is_aborted(server: Server) -> None:
    natural = seconds_per_token(server) * LONG  # how long the request would run if not aborted
    body = {"model": MODEL, "prompt": "x", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()  # kept alive: dropping it would close the connection early
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[len("data: ") :])["choices"][0]["text"] is not None
        running = server.metrics()
        assert running["vllm:num_requests_running"] == 1 and running["vllm:kv_cache_usage_perc"] > 0
    elapsed, metrics = server.wait_idle(5)
    assert metrics["vllm:num_requests_running"] == 0, f"still running after {elapsed:.1f} s"
    assert metrics["vllm:kv_cache_usage_perc"] == 0
    assert elapsed < natural / 2, f"idle after {elapsed:.2f} s: no faster than finishing ({natural:.2f} s)"


def test_a_full_response_whose_client_leaves_is_aborted(server: Server) -> None:
    natural = seconds_per_token(server) * LONG
    body = {"model": MODEL, "prompt": "x", "max_tokens": LONG, "ignore_eos": True}
    with httpx.Client(timeout=httpx.Timeout(30, read=0.5)) as client, pytest.raises(httpx.ReadTimeout):
        client.post(server.url + "/v1/completions", json=body, headers=AUTH)
    left_at = time.monotonic()
    elapsed, metrics = server.wait_idle(5)
    assert metrics["vllm:num_requests_running"] == 0, f"still running after {elapsed:.1f} s"
    assert metrics["vllm:kv_cache_usage_perc"] == 0
    assert time.monotonic() - left_at < natural / 2


def _engine_sample(text: str, name: str, engine_index: int = 0) -> float:
    """The value of ``name``'s series for DP rank ``engine_index`` in ``/metrics`` text."""
    (line,) = [
        ln for ln in text.splitlines() if ln.startswith(name + "{") and f'engine="{engine_index}"' in ln
    ]
    assert f'model_name="{MODEL}"' in line
    return float(line.rsplit(" ", 1)[1])


def test_metrics_follow_the_stats_that_come_with_the_outputs(server: Server) -> None:
    """``/metrics`` shows engine 0 idle as soon as a request's answer is back (the stats of
    the step that finished it came with its last output), and busy from a stream's first
    chunk on (the stats came with that chunk) — no utility call, no waiting."""
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200, r.text
    text = httpx.get(server.url + "/metrics", timeout=10).text
    assert _engine_sample(text, "vllm:num_requests_running") == 0
    assert _engine_sample(text, "vllm:num_requests_waiting") == 0
    assert _engine_sample(text, "vllm:kv_cache_usage_perc") == 0
    body = {"model": MODEL, "prompt": "x", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as response,
    ):
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        text = httpx.get(server.url + "/metrics", timeout=10).text
        assert _engine_sample(text, "vllm:num_requests_running") == 1
        assert _engine_sample(text, "vllm:kv_cache_usage_perc") > 0
    # The client left: the abort's step and the final update on going idle bring it to 0.
    elapsed, metrics = server.wait_idle(5)
    assert metrics["vllm:num_requests_running"] == 0, f"still running after {elapsed:.1f} s"


# ---------------------------------------------------------------------------- engine death (last)


def test_engine_death_ends_streams_with_an_error_and_gives_503(server: Server) -> None:
    status = json.loads((server.run_dir / "EngineCore_DP0.status.json").read_text())
    body = {"model": MODEL, "prompt": "x", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as response,
    ):
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        os.kill(status["pid"], signal.SIGKILL)
        rest = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"

    assert httpx.get(server.url + "/health", timeout=10).status_code == 503
    assert_error(server.post("/v1/completions", {"model": MODEL, "prompt": "x"}), 503, None)
