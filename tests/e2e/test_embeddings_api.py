"""``/v1/embeddings`` and ``/pooling`` end to end: ``glassbox serve --runner pooling`` and the
official ``openai`` client.

One server for the module: the bundled model as an embedding model on the defaults (LAST
pooling, normalised, the compiled step), with an API key, ``--max-model-len 256``, a 32-token
step budget (so a long prompt is chunked over HTTP too) and ``--trace-file``. The reference
is transformers: the bundled checkpoint's final hidden states (``AutoModel``), pooled and
normalised the same way.

What a user would check: the client's default call (base64 under the hood), ``float``, a batch
of texts and of token-id lists all give transformers' vectors in order; usage counts the
prompt tokens; ``/pooling`` gives the raw pooled state with ``use_activation: false``; the
limits, the API-key scope, the other runner's routes, the metrics and the request's trace.
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from server_utils import start_server

from engine.config import DEFAULT_MODEL
from engine.frontend.tokenizer import get_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

API_KEY = "sk-pool"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 256
TEXTS = ["Return the value for the given object.", "import os", "Once upon a time " * 8]
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def server():
    base = Path(tempfile.mkdtemp(prefix="gbe", dir="/tmp"))  # short: ipc paths ≤ 107 chars
    trace_file = base / "spans.jsonl"
    srv = start_server(base, "--runner", "pooling", "--max-model-len", str(MAX_MODEL_LEN),
                       "--max-num-batched-tokens", "32", "--api-key", API_KEY, "--trace-file", str(trace_file))  # fmt: skip
    srv.trace_file = trace_file
    try:
        yield srv
    finally:
        srv.kill_group()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference():
    """``reference(token_ids, normalize=True)``: transformers' last-token hidden state."""
    import transformers

    model = transformers.AutoModel.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()

    def pooled(token_ids: list[int], normalize: bool = True) -> np.ndarray:
        with torch.no_grad():
            last = model(torch.tensor([token_ids])).last_hidden_state[0, -1]
        return (torch.nn.functional.normalize(last, dim=-1) if normalize else last).numpy()

    return pooled


def token_ids(text: str) -> list[int]:
    return get_tokenizer(DEFAULT_MODEL).encode(text)  # with the special tokens, as the server


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        server.base_url + path, json=body, headers=AUTH if headers is None else headers, timeout=60
    )


def assert_error(response: httpx.Response, status: int, param: str | None, says: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def prompt_tokens_and_successes(server) -> tuple[float, float, float]:
    """``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total`` and
    ``vllm:request_success_total{finished_reason="stop"}`` now."""
    values = {}
    for line in httpx.get(server.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(("vllm:prompt_tokens_total", "vllm:generation_tokens_total")):
            values[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:request_success_total") and 'finished_reason="stop"' in line:
            values["success"] = float(line.rsplit(" ", 1)[1])
    return values["vllm:prompt_tokens_total"], values["vllm:generation_tokens_total"], values["success"]


# ---------------------------------------------------------------------------- the official client


def test_the_clients_default_call_and_float_give_transformers_vectors(server, client, model_name, reference):
    before = prompt_tokens_and_successes(server)
    # The client's default asks for base64 and decodes the float32 bytes itself.
    default = client.embeddings.create(model=model_name, input=TEXTS)
    floats = client.embeddings.create(model=model_name, input=TEXTS, encoding_format="float")
    ids = [token_ids(t) for t in TEXTS]
    assert len(ids[2]) > 32, "the long text is chunked (32-token steps)"
    for response in (default, floats):
        assert [d.index for d in response.data] == [0, 1, 2]
        for d, prompt in zip(response.data, ids):
            assert len(d.embedding) == 256 and abs(np.linalg.norm(d.embedding) - 1) < 1e-5
            assert cosine(d.embedding, reference(prompt)) >= MIN_COSINE
        assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
    assert np.allclose(default.data[2].embedding, floats.data[2].embedding, atol=1e-6)
    # Six requests, their prompt tokens counted, none generated, each a success with "stop".
    after = prompt_tokens_and_successes(server)
    assert after[0] - before[0] == 2 * sum(map(len, ids))
    assert after[1] == before[1] and after[2] - before[2] == 6


def test_token_id_inputs(client, model_name, reference):
    batch = [[5, 6, 7, 8], list(range(20, 60))]
    response = client.embeddings.create(model=model_name, input=batch, encoding_format="float")
    assert [cosine(d.embedding, reference(p)) >= MIN_COSINE for d, p in zip(response.data, batch)] == [
        True,
        True,
    ]
    single = client.embeddings.create(model=model_name, input=batch[0], encoding_format="float")
    assert len(single.data) == 1 and np.allclose(
        single.data[0].embedding, response.data[0].embedding, atol=1e-6
    )
    assert single.usage.prompt_tokens == 4


def test_explicit_base64_is_the_float32_bytes(server, model_name, reference):
    body = {"model": model_name, "input": "import os", "encoding_format": "base64"}
    data = post(server, "/v1/embeddings", body).json()["data"][0]["embedding"]
    vector = np.frombuffer(base64.b64decode(data), dtype=np.float32)
    assert cosine(vector, reference(token_ids("import os"))) >= MIN_COSINE


# ---------------------------------------------------------------------------- /pooling


def test_pooling_gives_the_raw_pooled_state_without_activation(server, model_name, reference):
    prompt = token_ids(TEXTS[0])
    raw = post(server, "/pooling", {"model": model_name, "input": TEXTS[0], "use_activation": False})
    assert raw.status_code == 200, raw.text
    body = raw.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "pooling"
    vector, expected = np.array(body["data"][0]["data"]), reference(prompt, normalize=False)
    assert cosine(vector, expected) >= MIN_COSINE
    assert np.linalg.norm(vector) == pytest.approx(np.linalg.norm(expected), rel=1e-3)
    normalised = post(server, "/pooling", {"model": model_name, "input": TEXTS[0]}).json()["data"][0]["data"]
    assert np.linalg.norm(normalised) == pytest.approx(1, abs=1e-5)


# ---------------------------------------------------------------------------- limits and errors


def test_an_embedding_prompt_may_fill_the_context_and_no_more(server):
    full = post(server, "/v1/embeddings", {"input": list(range(5, 5 + MAX_MODEL_LEN))})
    assert full.status_code == 200, full.text
    assert_error(post(server, "/v1/embeddings", {"input": list(range(5, 6 + MAX_MODEL_LEN))}), 400, "input",
                 f"maximum context length is {MAX_MODEL_LEN} tokens")  # fmt: skip
    too_long = "word " * (MAX_MODEL_LEN * 40)  # refused before it is tokenized
    assert_error(post(server, "/v1/embeddings", {"input": too_long}), 400, "input", "maximum context length")


@pytest.mark.parametrize(
    "path, body, status, param, says",
    [
        ("/v1/embeddings", {"input": "x", "dimensions": 8}, 400, "dimensions", "does not support Matryoshka"),
        ("/v1/embeddings", {"input": "x", "normalize": False}, 400, "normalize", "use `use_activation` instead"),
        ("/v1/embeddings", {"input": "x", "encoding_format": "bytes"}, 400, "encoding_format", "'base64'"),
        ("/v1/embeddings", {"input": "x", "model": "other"}, 404, "model", "does not exist"),
        ("/v1/embeddings", {"input": []}, 400, "input", "cannot be empty"),
        ("/v1/embeddings", {"input": [999999]}, 400, "input", "out of vocabulary"),
        ("/v1/embeddings", {"messages": [{"role": "user", "content": "hi"}]}, 400, "messages", "left out"),
        ("/v1/embeddings", {"input": "x", "truncate_prompt_tokens": 4}, 400, "truncate_prompt_tokens", "left out"),
        ("/pooling", {"input": "x", "task": "classify"}, 400, "task", "Unsupported task: 'classify'"),
        ("/pooling", {"input": "x", "task": "encode"}, 400, "task", "`encode` task was removed"),
        ("/pooling", {"input": "x", "dimensions": 8}, 400, "dimensions", "not supported"),
        ("/v1/completions", {"prompt": "x"}, 404, None, "runs the model with --runner pooling"),
        ("/v1/chat/completions", {"messages": []}, 404, None, "the route needs --runner generate"),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_errors_naming_the_field(server, path, body, status, param, says):
    assert_error(post(server, path, body), status, param, says)


def test_the_api_key_guards_v1_embeddings_not_pooling(server):
    # vLLM's scope: only /v1/* needs the key.
    assert_error(post(server, "/v1/embeddings", {"input": "x"}, headers={}), 401, None, "API key")
    assert post(server, "/pooling", {"input": "x"}, headers={}).status_code == 200


def test_an_embeddings_request_is_one_trace_through_the_engine(server, model_name):
    caller_trace, caller_span = "5c0ffee0" * 4, "0123456789abcdef"
    headers = {**AUTH, "traceparent": f"00-{caller_trace}-{caller_span}-01"}
    text = "A text no other test sends, " * 6  # no prefix-cache hit: every chunk computed
    assert post(server, "/v1/embeddings", {"model": model_name, "input": text}, headers).status_code == 200
    wanted = {"api_server.request", "api_server.process_inputs", "llm_request", "engine_core.input",
              "engine_core.input_queue", "scheduler.waiting", "request.prefill"}  # fmt: skip
    deadline = time.monotonic() + 20
    while True:
        spans = [
            json.loads(line) for line in server.trace_file.read_text().splitlines() if line.endswith("}")
        ]
        mine = {s["name"]: s for s in spans if s["trace_id"] == caller_trace}
        if wanted <= set(mine) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert wanted <= set(mine), sorted(mine)
    root = mine["api_server.request"]
    assert root["attributes"]["http.route"] == "/v1/embeddings" and root["parent_span_id"] == caller_span
    assert all(mine[name]["parent_span_id"] == root["span_id"] for name in wanted - {"api_server.request"})
    assert mine["request.prefill"]["resource"]["glassbox.role"] == "EngineCore_DP0"
    assert mine["request.prefill"]["attributes"]["glassbox.request.num_chunks"] >= 2, (
        "chunked over 32-token steps"
    )
    assert "request.decode" not in mine, "a pooling request has no decode"
    assert mine["llm_request"]["attributes"]["gen_ai.response.finish_reasons"] == ["stop"]
