"""Which chunks a stream sends: one per engine output that brought tokens, as vLLM sends them.

The serving classes run against a scripted engine (its ``generate`` yields the outputs a real
engine would: the first token a byte that completes no character, so its text is empty).
vLLM sends that chunk with ``text: ""`` — a client, and ``vllm bench serve``'s TTFT, see the
token when it is made — and so must we; a chat stream's role chunk comes with the first
output, not before the prompt has run.
"""

from __future__ import annotations

import asyncio
import json
import types

import pytest

from engine.engine_args import EngineArgs
from engine.entrypoints.openai import protocol
from engine.entrypoints.openai.serving_chat import OpenAIServingChat
from engine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from engine.frontend.outputs import CompletionOutput, RequestOutput

# (text, token ids, finish reason) per engine output: "é" split over two byte tokens.
SCRIPT = [("", [200], None), ("é", [201], None), (" x", [202], "length")]


def _scripted_engine(events: list):
    from engine.frontend.async_llm import AsyncLLM
    from engine.frontend.input_processor import InputProcessor
    from engine.frontend.tokenizer import get_tokenizer

    model_config = EngineArgs().create_engine_config().model_config
    tokenizer = get_tokenizer(model_config.tokenizer)
    engine = types.SimpleNamespace(model_config=model_config, tokenizer=tokenizer, dead_error=None,
                                   input_processor=InputProcessor(model_config, tokenizer))  # fmt: skip
    engine.get_default_sampling_params = lambda: AsyncLLM.get_default_sampling_params(engine)

    async def generate(request, params, request_id, **kwargs):  # an EngineCoreRequest
        events.append("prefill")  # the engine ran the prompt: only now may a chunk go out
        for text, ids, finish in SCRIPT:
            out = CompletionOutput(0, text, ids, None, None, finish)
            yield RequestOutput(request_id, None, request.prompt_token_ids, None, [out], finish is not None)

    engine.generate = generate
    return engine


def _chunks(route: str) -> tuple[list[dict], list[str]]:
    events: list[str] = []
    engine = _scripted_engine(events)
    if route == "chat":
        serving, call = OpenAIServingChat(engine, "m"), "create_chat_completion"
        request = protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], stream=True)
    else:
        serving, call = OpenAIServingCompletion(engine, "m"), "create_completion"
        request = protocol.CompletionRequest(prompt="Once upon a time", stream=True)

    async def collect() -> list[dict]:
        chunks = []
        async for line in await getattr(serving, call)(request):
            data = line.removeprefix("data: ").strip()
            if data != "[DONE]":
                events.append("chunk")
                chunks.append(json.loads(data))
        return chunks

    return asyncio.run(collect()), events


def test_a_completion_stream_sends_the_token_whose_text_is_still_empty():
    chunks, _ = _chunks("completion")
    choices = [c["choices"][0] for c in chunks]
    assert [c["text"] for c in choices] == ["", "é", " x"]
    assert [c["finish_reason"] for c in choices] == [None, None, "length"]


def test_a_chat_stream_sends_its_role_with_the_first_token_then_every_token():
    chunks, events = _chunks("chat")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert [d.get("content") for d in deltas[1:]] == ["", "é", " x"]
    assert all("role" not in d for d in deltas[1:])  # only the first says it, as OpenAI does
    assert events[0] == "prefill"  # nothing was sent before the engine had an output


@pytest.mark.parametrize("route", ["chat", "completion"])
def test_the_streamed_text_is_the_whole_text(route):
    chunks, _ = _chunks(route)
    key = (lambda c: c["delta"].get("content") or "") if route == "chat" else (lambda c: c["text"])
    assert "".join(key(c["choices"][0]) for c in chunks) == "é x"


# Texts a token can decode to: JSON escapes, control characters, characters JSON leaves raw
# (U+0085, U+2028, U+2029, DEL), multi-byte characters, the replacement character.
TEXTS = ["", "x", ' "quoted" ', "back\\slash", "\n\r\t\b\f", "\x00\x01\x1f\x7f", "\x85\u2028\u2029",
         "é日本🙂", "\ufffd", "</script>"]  # fmt: skip
ENDINGS = [(None, None), ("length", None), ("stop", None), ("stop", 2), ("stop", "\n\n"), ("abort", None)]


@pytest.mark.parametrize("finish_reason, stop_reason", ENDINGS)
def test_a_completion_chunk_is_the_pydantic_models_json_byte_for_byte(finish_reason, stop_reason):
    # The stream writes its chunks with msgspec (a chunk per token); what a client reads must
    # stay what the pydantic models say — every field, in order, None written as null.
    from engine.entrypoints.openai.serving_engine import StreamChunks, sse_event

    envelope = dict(id="cmpl-1", created=1700000000, model='a "model" /x')
    chunks = StreamChunks(protocol.CompletionStreamResponse(**envelope, choices=[]))
    for index, text in enumerate(TEXTS):
        wire = protocol.CompletionStreamChoiceWire(index, text, None, finish_reason, stop_reason)
        choice = protocol.CompletionResponseStreamChoice(index=index, text=text, finish_reason=finish_reason,
                                                         stop_reason=stop_reason)  # fmt: skip
        expected = sse_event(protocol.CompletionStreamResponse(**envelope, choices=[choice]))
        assert chunks.event(wire) == expected


@pytest.mark.parametrize("finish_reason, stop_reason", ENDINGS)
def test_a_chat_chunk_is_the_pydantic_models_json_byte_for_byte(finish_reason, stop_reason):
    from engine.entrypoints.openai.serving_engine import StreamChunks, sse_event

    envelope = dict(id="chatcmpl-1", created=1700000000, model="m")
    chunks = StreamChunks(protocol.ChatCompletionStreamResponse(**envelope, choices=[]))
    # The role chunk, a delta with no content (written as null), then content deltas.
    deltas = [dict(role="assistant", content=""), dict(content=None)] + [dict(content=text) for text in TEXTS]
    for index, fields in enumerate(deltas):
        wire = protocol.ChatStreamChoiceWire(index, protocol.DeltaMessageWire(**fields), None, finish_reason,
                                             stop_reason)  # fmt: skip
        choice = protocol.ChatCompletionResponseStreamChoice(index=index, delta=protocol.DeltaMessage(**fields),
                                                             finish_reason=finish_reason, stop_reason=stop_reason)  # fmt: skip
        expected = sse_event(protocol.ChatCompletionStreamResponse(**envelope, choices=[choice]))
        assert chunks.event(wire) == expected
