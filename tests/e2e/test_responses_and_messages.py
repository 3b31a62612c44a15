"""``/v1/responses`` and Anthropic's ``/v1/messages`` end to end, with the official clients.

One ``glassbox serve`` for the module: the bundled model on the default configuration, with an
API key, ``--trace-file`` (to read the requests' traces) and
``GLASSBOX_RESPONSES_API_STORE_SIZE=4`` (so that the store's bound is reached in five
requests). The tests talk to it with ``openai.OpenAI`` (``responses.create``, ``.stream``,
``.retrieve``, ``.cancel``), ``anthropic.Anthropic`` (``messages.create``, ``.stream``,
``.count_tokens``) and, for status codes and raw events, ``httpx``. Greedy sampling everywhere,
so texts can be compared.

What a user would check: both routes answer what ``/v1/chat/completions`` answers for the same
conversation, streamed or not; streams come in the order their clients expect; usage counts
are the tokenizer's (and the ``vllm:`` token counters move by them); ``previous_response_id``
continues a conversation; a stored response can be fetched until the bound pushes it out
(then a 404); a background response can be cancelled; errors have each API's shape and
status; each request is one trace with the same spans as a chat's.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from server_utils import Server, start_server

from engine.config import DEFAULT_MODEL
from engine.frontend.tokenizer import apply_chat_template, get_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MODEL = "glassbox-tiny"
API_KEY = "sk-routes-key"
STORE_SIZE = 4
SYSTEM = "Be brief."
QUESTION = "What is a module?"
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server():
    base = Path(tempfile.mkdtemp(prefix="gbm", dir="/tmp"))  # short: ipc paths ≤ 107 chars
    srv = start_server(base, "--max-model-len", "512", "--served-model-name", MODEL, "--api-key", API_KEY,
                       "--trace-file", str(base / "spans.jsonl"), "--uvicorn-log-level", "warning",
                       env={"GLASSBOX_RESPONSES_API_STORE_SIZE": str(STORE_SIZE)})  # fmt: skip
    try:
        yield srv
    finally:
        srv.kill_group()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer(DEFAULT_MODEL)


def openai_client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def anthropic_client(server: Server, api_key: str = API_KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=60)


def chat(server: Server, messages: list[dict], max_tokens: int):
    return openai_client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                         **GREEDY)  # fmt: skip


def prompt_tokens(tokenizer, messages: list[dict]) -> int:
    return len(tokenizer.encode(apply_chat_template(tokenizer, messages), add_special_tokens=False))


def post(server: Server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"} if headers is None else headers
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60)


def raw_events(server: Server, path: str, body: dict) -> list[tuple[str, dict]]:
    """A stream's ``(event name, data)`` pairs, as sent."""
    events, name = [], None
    with httpx.stream("POST", server.base_url + path, json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:  # fmt: skip
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: ") :])))
    return events


def metric(server: Server, name: str) -> float:
    for line in httpx.get(server.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


# ---------------------------------------------------------------------------- /v1/responses


def test_a_response_is_the_chat_completions_greedy_answer_with_its_token_counts(
    server: Server, tokenizer
) -> None:
    client = openai_client(server)
    response = client.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=12,
                                       **GREEDY)  # fmt: skip
    reference = chat(server, CHAT, 12)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == reference.choices[0].message.content
    assert (response.status == "incomplete") == (reference.choices[0].finish_reason == "length")
    assert response.usage.input_tokens == reference.usage.prompt_tokens == prompt_tokens(tokenizer, CHAT)
    assert response.usage.output_tokens == reference.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    # The same question as a message item with an input_text part.
    items = client.responses.create(
        model=MODEL, instructions=SYSTEM, max_output_tokens=12, **GREEDY,
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
    )  # fmt: skip
    assert items.output_text == response.output_text


def test_a_streamed_response_sends_its_events_in_order_and_the_same_text(server: Server) -> None:
    client = openai_client(server)
    kwargs = dict(model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=12, **GREEDY)
    full = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    head = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed"]  # fmt: skip
    assert types == head + ["response.output_text.delta"] * len(deltas) + tail and deltas
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in deltas) == full.output_text == final.output_text
    assert final.usage.input_tokens == full.usage.input_tokens
    assert final.usage.output_tokens == full.usage.output_tokens
    assert final.status == full.status and final.output[0].id == events[2].item.id
    # responses.create(stream=True) reads the same events.
    created = list(client.responses.create(stream=True, **kwargs))
    assert [e.type for e in created][:4] == head and [e.type for e in created][-4:] == tail
    assert created[-1].response.output_text == full.output_text


def test_previous_response_id_continues_the_conversation_without_its_instructions(server: Server) -> None:
    client = openai_client(server)
    first = client.responses.create(
        model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=8, **GREEDY
    )
    follow_up = "And a package?"
    second = client.responses.create(model=MODEL, input=follow_up, previous_response_id=first.id,
                                     max_output_tokens=8, **GREEDY)  # fmt: skip
    conversation = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": follow_up}]  # fmt: skip
    reference = chat(server, conversation, 8)
    assert second.previous_response_id == first.id
    assert second.output_text == reference.choices[0].message.content
    assert second.usage.input_tokens == reference.usage.prompt_tokens


def test_a_stored_response_is_retrieved_until_the_bound_pushes_it_out(server: Server) -> None:
    client = openai_client(server)
    kept = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, **GREEDY)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    unstored = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=4, store=False, **GREEDY
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    for _ in range(STORE_SIZE):
        client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=1, **GREEDY)
    gone = httpx.get(
        f"{server.base_url}/v1/responses/{kept.id}", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert gone.status_code == 404
    assert gone.json() == {"error": {"message": f"Response with id '{kept.id}' not found.", "type": "NotFoundError",
                                     "param": "response_id", "code": 404}}  # fmt: skip
    continued = post(server, "/v1/responses", {"model": MODEL, "input": "x", "previous_response_id": kept.id})
    assert continued.status_code == 404 and continued.json()["error"]["param"] == "previous_response_id"


def test_a_background_response_runs_to_its_end_or_is_cancelled(server: Server) -> None:
    client = openai_client(server)
    background = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=6, background=True,
                                         **GREEDY)  # fmt: skip
    assert background.status == "queued"
    deadline = time.monotonic() + 60
    while (current := client.responses.retrieve(background.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, current
        time.sleep(0.05)
    plain = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=6, **GREEDY)
    assert (current.status, current.output_text) == (plain.status, plain.output_text)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(plain.id)

    long = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=400, background=True,
                                   extra_body={"ignore_eos": True}, **GREEDY)  # fmt: skip
    assert client.responses.cancel(long.id).status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    # The engine request was aborted: nothing runs any more.
    deadline = time.monotonic() + 30
    while metric(server, "vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "the cancelled request still runs"
        time.sleep(0.05)


@pytest.mark.parametrize(
    "body, param",
    [
        (  # a schema that does not compile (a valid one is held to: tests/e2e/test_structured_outputs.py)
            {"text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "strin"}}}},
            "text.format.schema",
        ),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input"),
        ({"max_output_tokens": 100000}, "max_output_tokens"),
        ({"input": "word " * 5000}, "input"),
        ({"model": "nope"}, "model"),
    ],
)
def test_a_bad_or_left_out_responses_field_is_an_openai_error_naming_it(
    server: Server, body: dict, param: str
):
    r = post(server, "/v1/responses", {"model": MODEL, "input": QUESTION, **body})
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param


# ---------------------------------------------------------------------------- /v1/messages


def test_a_message_is_the_chat_completions_greedy_answer_with_its_token_counts(
    server: Server, tokenizer
) -> None:
    before = metric(server, "vllm:prompt_tokens_total"), metric(server, "vllm:generation_tokens_total")
    message = anthropic_client(server).messages.create(
        model=MODEL, max_tokens=12, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}],
        extra_body=GREEDY,
    )  # fmt: skip
    after = metric(server, "vllm:prompt_tokens_total"), metric(server, "vllm:generation_tokens_total")
    reference = chat(server, CHAT, 12)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == reference.choices[0].message.content
    expected = {"length": "max_tokens", "stop": "end_turn"}[reference.choices[0].finish_reason]
    assert (message.stop_reason, message.stop_sequence) == (expected, None)
    assert message.usage.input_tokens == reference.usage.prompt_tokens == prompt_tokens(tokenizer, CHAT)
    assert message.usage.output_tokens == reference.usage.completion_tokens
    # The request went through the engine like any other: vLLM's token counters moved by its usage.
    assert (after[0] - before[0], after[1] - before[1]) == (
        message.usage.input_tokens,
        message.usage.output_tokens,
    )
    counted = anthropic_client(server).messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}]
    )
    assert counted.input_tokens == message.usage.input_tokens


def test_a_streamed_message_sends_anthropics_events_in_order_and_the_same_text(server: Server) -> None:
    kwargs = dict(model=MODEL, max_tokens=12, system=[{"type": "text", "text": SYSTEM}],
                  messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}])  # fmt: skip
    full = anthropic_client(server).messages.create(**kwargs, extra_body=GREEDY)
    with anthropic_client(server).messages.stream(**kwargs, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == full.content[0].text
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == (
        full.stop_reason, full.usage.input_tokens, full.usage.output_tokens)  # fmt: skip

    events = raw_events(server, "/v1/messages", {**kwargs, "stream": True, **GREEDY})
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "content_block_start", "ping"] + ["content_block_delta"] * deltas + [
        "content_block_stop", "message_delta", "message_stop"] and deltas  # fmt: skip
    assert all(name == data["type"] for name, data in events)
    assert events[0][1]["message"]["usage"] == {"input_tokens": full.usage.input_tokens, "output_tokens": 0}
    assert (
        "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == full.content[0].text
    )
    assert events[-2][1]["delta"] == {"stop_reason": full.stop_reason, "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == full.usage.output_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(server: Server) -> None:
    client = anthropic_client(server)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY)
    text = client.messages.create(max_tokens=24, **kwargs).content[0].text
    # A word in the middle of the greedy answer: the answer stops just before it.
    stop = next(" " + w for w in text.split(" ")[2:] if w and text.index(" " + w) > 0)
    cut = client.messages.create(max_tokens=24, stop_sequences=[stop], **kwargs)
    assert (cut.stop_reason, cut.stop_sequence, cut.content[0].text) == (
        "stop_sequence",
        stop,
        text[: text.index(stop)],
    )
    with client.messages.stream(max_tokens=24, stop_sequences=[stop], **kwargs) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == (
        "stop_sequence", stop, cut.content[0].text)  # fmt: skip


def test_anthropic_errors_have_anthropics_shape_and_status(server: Server) -> None:
    message = [{"role": "user", "content": QUESTION}]
    missing = post(server, "/v1/messages", {"model": MODEL, "messages": message})
    assert missing.status_code == 400
    body = missing.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and "max_tokens" in body["error"]["message"]

    with pytest.raises(anthropic.AuthenticationError) as denied:
        anthropic_client(server, api_key="wrong").messages.create(model=MODEL, max_tokens=2, messages=message)
    assert denied.value.status_code == 401 and denied.value.body["error"]["type"] == "authentication_error"
    # As vLLM 0.32: the key is read from Authorization: Bearer only, never from x-api-key.
    x_api_key = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": message},
                     headers={"x-api-key": API_KEY})  # fmt: skip
    assert x_api_key.status_code == 401 and x_api_key.json()["error"]["type"] == "authentication_error"

    with pytest.raises(anthropic.NotFoundError) as unknown:
        anthropic_client(server).messages.create(model="nope", max_tokens=2, messages=message)
    assert unknown.value.body["error"]["type"] == "not_found_error"
    for body, word in [({"max_tokens": 100000}, "max_tokens"), ({"tools": [{"name": "f", "input_schema": {}}]}, "tools"),
                       ({"messages": [{"role": "user", "content": "word " * 5000}]}, "context length")]:  # fmt: skip
        r = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": message, **body})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert word in r.json()["error"]["message"]


# ---------------------------------------------------------------------------- traces


def test_each_route_makes_the_request_trace_a_chat_makes(server: Server) -> None:
    post(server, "/v1/responses", {"model": MODEL, "input": QUESTION, "max_output_tokens": 2})
    post(
        server,
        "/v1/messages",
        {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
    )
    routes = {"/v1/responses", "/v1/messages"}
    deadline = time.monotonic() + 20
    while True:
        spans = []
        for line in (server.run_dir.parent / "spans.jsonl").read_text().splitlines():
            try:
                spans.append(json.loads(line))
            except ValueError:
                continue  # a line being written right now
        roots = {s["attributes"].get("http.route"): s for s in spans if s["name"] == "api_server.request"}
        children = {(s["trace_id"], s["parent_span_id"], s["name"]) for s in spans}
        done = routes <= set(roots) and all(
            (roots[r]["trace_id"], roots[r]["span_id"], "llm_request") in children for r in routes
        )
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert routes <= set(roots), sorted(r for r in roots if r)
    for route in routes:
        root = roots[route]
        for name in ("api_server.process_inputs", "llm_request"):
            assert (root["trace_id"], root["span_id"], name) in children, (route, name)
