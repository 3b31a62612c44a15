"""``usage.prompt_tokens_details.cached_tokens``: the prompt tokens the prefix cache served.

As vLLM: only with ``--enable-prompt-tokens-details``, and only when the count is not 0;
in the whole response and in a stream's usage chunk alike, for completions and chats. The
serving classes run against a scripted engine whose outputs report ``num_cached_tokens``.
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


def _engine(num_cached_tokens: int):
    from engine.frontend.async_llm import AsyncLLM
    from engine.frontend.input_processor import InputProcessor
    from engine.frontend.tokenizer import get_tokenizer

    model_config = EngineArgs().create_engine_config().model_config
    tokenizer = get_tokenizer(model_config.tokenizer)
    engine = types.SimpleNamespace(model_config=model_config, tokenizer=tokenizer, dead_error=None,
                                   input_processor=InputProcessor(model_config, tokenizer))  # fmt: skip
    engine.get_default_sampling_params = lambda: AsyncLLM.get_default_sampling_params(engine)

    async def generate(request, params, request_id, **kwargs):
        for text, ids, finish in (("a", [200], None), ("b", [201], "length")):
            out = CompletionOutput(0, text, ids, None, None, finish)
            yield RequestOutput(request_id, None, request.prompt_token_ids, None, [out], finish is not None,
                                num_cached_tokens=num_cached_tokens)  # fmt: skip

    engine.generate = generate
    return engine


def _usage(route: str, stream: bool, enabled: bool, num_cached_tokens: int) -> dict:
    engine = _engine(num_cached_tokens)
    options = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    if route == "chat":
        serving, call = OpenAIServingChat(engine, "m", enabled), "create_chat_completion"
        request = protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], **options)
    else:
        serving, call = OpenAIServingCompletion(engine, "m", enabled), "create_completion"
        request = protocol.CompletionRequest(prompt="Once upon a time", **options)

    async def run() -> dict:
        result = await getattr(serving, call)(request)
        if not stream:
            return json.loads(result.model_dump_json())["usage"]
        chunks = [json.loads(line.removeprefix("data: ")) async for line in result if "[DONE]" not in line]
        return chunks[-1]["usage"]

    return asyncio.run(run())


@pytest.mark.parametrize("route", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_are_reported_with_the_flag(route, stream):
    usage = _usage(route, stream, enabled=True, num_cached_tokens=16)
    assert usage["prompt_tokens_details"] == {"cached_tokens": 16}
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize("route", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("enabled, num_cached_tokens", [(False, 16), (True, 0)])
def test_no_details_without_the_flag_or_without_a_hit(route, stream, enabled, num_cached_tokens):
    usage = _usage(route, stream, enabled, num_cached_tokens)
    assert "prompt_tokens_details" not in usage
    assert (
        usage["prompt_tokens"] > 0
        and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    )
