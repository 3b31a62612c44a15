"""``/v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API, run through the
chat flow.

Mirrors vLLM's ``vllm/entrypoints/anthropic/serving.py`` (``AnthropicServingMessages``, a
subclass of the chat route): the request becomes a ``ChatCompletionRequest``
(``to_chat_completion_request``: ``system`` a system message, text blocks chat text parts,
``max_tokens`` the output limit, ``stop_sequences`` the stop strings,
``output_config.format`` chat's ``response_format``), served by
``OpenAIServingChat.start_generation`` — the same checks, chat template, prompt-length rule,
sampling params, trace and engine request as a chat completion; errors name the Anthropic
field. What is this route's own is the answer's shape: one text block, ``stop_reason``
(``end_turn``, ``max_tokens``, ``stop_sequence`` with the string matched), Anthropic's usage,
and its stream of events (order in ``protocol.py``).

Where vLLM re-reads the chat route's own SSE chunks to write Anthropic's events, this reads
the engine's outputs directly (``ChatGeneration.outputs``). Deliberate deviations: the stream
sends a ``ping`` after ``content_block_start`` and always opens one text block, as Anthropic's
API does (vLLM sends no ``ping`` and opens a block at the first text); errors carry
Anthropic's error types (``invalid_request_error``, ...) where vLLM passes the OpenAI one.

Left out (a 400 naming the field): tools and tool use, extended thinking, blocks other than
text, ``output_config.effort``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from engine.entrypoints.anthropic.protocol import (
    AnthropicContentBlock,
    AnthropicContentBlockStartEvent,
    AnthropicContentBlockStopEvent,
    AnthropicCountTokensRequest,
    AnthropicCountTokensResponse,
    AnthropicMessageDelta,
    AnthropicMessageDeltaEvent,
    AnthropicMessagesRequest,
    AnthropicMessagesResponse,
    AnthropicMessageStartEvent,
    AnthropicMessageStopEvent,
    AnthropicPingEvent,
    AnthropicTextBlock,
    AnthropicTextDeltaEventWire,
    AnthropicTextDeltaWire,
    AnthropicUsage,
    StopReason,
    anthropic_error_response,
    anthropic_sse,
)
from engine.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessageParam
from engine.entrypoints.openai.serving_chat import ChatGeneration, OpenAIServingChat
from engine.entrypoints.openai.serving_engine import OpenAIError, random_uuid, stream_error
from engine.logger import init_logger

logger = init_logger(__name__)

# The chat fields an Anthropic request's errors are renamed from (``OpenAIError.renamed``).
RENAMES = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    # A schema that does not compile (structured_outputs.py's names), the specific name first.
    "response_format.json_schema.schema": "output_config.format.schema",
    "response_format": "output_config.format",
}
ROUTE = "/v1/messages"
_encoder = msgspec.json.Encoder()


def _text_of_blocks(blocks: list[AnthropicContentBlock], param: str) -> list[str]:
    """The texts of text blocks.

    Raises:
        OpenAIError: (400, ``param``) a block that is not text, or a text block without its
            ``text``.
    """
    texts = []
    for block in blocks:
        if block.type == "text" and block.text is None:
            raise OpenAIError("A text content block needs its 'text' field (a string).", param=param)
        if block.type != "text":
            raise OpenAIError(
                f"Only text content blocks are supported, got a {block.type!r} block "
                "(images, documents, tool use and thinking are left out).",
                param=param,
            )
        texts.append(block.text)
    return texts


def to_chat_messages(request: AnthropicCountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages (vLLM's ``_convert_system_message`` and
    ``_convert_messages``): ``system`` first — its blocks' texts joined with nothing between
    them, as vLLM joins them — then each message, a string as it is and text blocks as chat
    ``text`` parts (the chat path joins them with newlines).

    Raises:
        OpenAIError: (400) a block that is not text, naming ``system`` or ``messages``.
    """
    messages: list[dict[str, Any]] = []
    system = request.system
    if isinstance(system, list):
        system = "".join(_text_of_blocks(system, "system"))
    if system:
        messages.append({"role": "system", "content": system})
    for message in request.messages:
        content = message.content
        if not isinstance(content, str):
            content = [{"type": "text", "text": text} for text in _text_of_blocks(content, "messages")]
        messages.append({"role": message.role, "content": content})
    return messages


def check_supported(request: AnthropicCountTokensRequest) -> None:
    """Refuse what is left out, naming the field.

    Raises:
        OpenAIError: (400) ``tools``, ``tool_choice``, ``thinking`` other than disabled,
            ``output_config.effort``.
    """
    if request.tools:
        raise OpenAIError("tools are not supported (tool use is left out).", param="tools")
    if request.tool_choice is not None:
        raise OpenAIError("tool_choice is not supported (tool use is left out).", param="tool_choice")
    if request.thinking is not None and request.thinking.type != "disabled":
        raise OpenAIError("Extended thinking is not supported (left out).", param="thinking")
    config = getattr(request, "output_config", None)
    if config is not None and config.effort is not None:
        raise OpenAIError("output_config.effort is not supported (left out).", param="output_config.effort")


def to_chat_completion_request(request: AnthropicMessagesRequest) -> ChatCompletionRequest:
    """The chat request that serves ``request`` (vLLM's ``to_chat_completion_request``)."""
    output_format = request.output_config.format if request.output_config is not None else None
    response_format = None
    if output_format is not None:
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": "json_schema", "schema": output_format.json_schema},
        }
    return ChatCompletionRequest(
        model=request.model,
        messages=to_chat_messages(request),
        max_completion_tokens=request.max_tokens,
        stop=request.stop_sequences,
        stream=request.stream,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        response_format=response_format,
    )


def to_anthropic_stop_reason(
    finish_reason: str | None, stop_reason: int | str | None
) -> tuple[StopReason | None, str | None]:
    """The engine's finish → Anthropic's ``(stop_reason, stop_sequence)`` (vLLM's
    ``_to_anthropic_stop_reason``): ``length`` → ``max_tokens``; a stop string matched →
    ``stop_sequence`` and the string; any other stop (EOS, a stop token) → ``end_turn``; an
    abort → no reason."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason != "stop":
        return None, None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


class AnthropicServingMessages(OpenAIServingChat):
    """The Messages routes (vLLM's ``AnthropicServingMessages``)."""

    async def create_messages(
        self, request: AnthropicMessagesRequest, headers: dict[str, str] | None = None
    ) -> AnthropicMessagesResponse | AsyncIterator[str]:
        """Serve ``POST /v1/messages``.

        Returns:
            The message, or (``stream``) an async iterator of SSE events ending with
            ``message_stop``. Closing it aborts the engine request.

        Raises:
            OpenAIError: a bad request (400 naming the field), an unknown model (404);
                ``app.py`` answers it in Anthropic's shape.
            EngineDeadError: the engine is dead (503).
        """
        check_supported(request)
        self.log_unknown_fields(request)
        try:
            generation = await self.start_generation(
                to_chat_completion_request(request), f"msg_{random_uuid()}", headers, ROUTE
            )
            if request.stream:
                return generation.trace.wrap_stream(self._stream(generation))
            final = await self.final_output(generation, "messages")
        except OpenAIError as e:
            raise e.renamed(RENAMES) from None
        out = final.outputs[0]
        stop_reason, stop_sequence = to_anthropic_stop_reason(out.finish_reason, out.stop_reason)
        return AnthropicMessagesResponse(
            id=generation.request_id,
            content=[AnthropicTextBlock(text=out.text)],
            model=self.served_model_name,
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=self._usage(len(generation.prompt_token_ids), len(out.token_ids), final.num_cached_tokens),
        )

    async def count_tokens(self, request: AnthropicCountTokensRequest) -> AnthropicCountTokensResponse:
        """Serve ``POST /v1/messages/count_tokens``: the tokens of the conversation rendered by
        the chat template, as a ``/v1/messages`` request would have them (no length limit:
        like ``/tokenize``, it says what the text is).

        Raises:
            OpenAIError: a bad request (400), an unknown model (404).
        """
        self.check_model(request.model)
        check_supported(request)
        self.log_unknown_fields(request)
        messages = [ChatMessageParam.model_validate(m) for m in to_chat_messages(request)]
        _, prompt_ids = await asyncio.to_thread(self.render_chat, messages, True, False)
        return AnthropicCountTokensResponse(
            input_tokens=len(prompt_ids), context_management={"original_input_tokens": len(prompt_ids)}
        )

    def _usage(self, prompt_tokens: int, output_tokens: int, num_cached_tokens: int) -> AnthropicUsage:
        """Anthropic's usage from chat's (``make_usage``): with ``--enable-prompt-tokens-details``
        and a prefix-cache hit, the cached tokens move from ``input_tokens`` to
        ``cache_read_input_tokens`` (vLLM's ``_build_anthropic_usage``)."""
        usage = self.make_usage(prompt_tokens, output_tokens, num_cached_tokens)
        cached = (
            usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details is not None else None
        )
        return AnthropicUsage(
            input_tokens=prompt_tokens - (cached or 0),
            output_tokens=output_tokens,
            cache_read_input_tokens=cached,
        )

    async def _stream(self, generation: ChatGeneration) -> AsyncIterator[str]:
        """Anthropic's events for one message. ``message_start`` (and the text block's start and
        a ``ping``) come with the engine's first output, so a client's first delta marks the
        first token and an error before it comes alone; an error ends the stream with an
        ``error`` event in Anthropic's shape."""
        prompt_tokens = len(generation.prompt_token_ids)
        output_tokens = 0
        last = None
        try:
            async with contextlib.aclosing(generation.outputs):
                async for _, output in generation.outputs:
                    if last is None:
                        start = AnthropicMessagesResponse(
                            id=generation.request_id, content=[], model=self.served_model_name,
                            usage=self._usage(prompt_tokens, 0, output.num_cached_tokens),
                        )  # fmt: skip
                        yield anthropic_sse(AnthropicMessageStartEvent(message=start))
                        yield anthropic_sse(
                            AnthropicContentBlockStartEvent(
                                index=0, content_block=AnthropicTextBlock(text="")
                            )
                        )
                        yield anthropic_sse(AnthropicPingEvent())
                    last = output
                    out = output.outputs[0]
                    output_tokens += len(out.token_ids)
                    if out.text:
                        body = _encoder.encode(
                            AnthropicTextDeltaEventWire(0, AnthropicTextDeltaWire(out.text))
                        )
                        yield f"event: content_block_delta\ndata: {body.decode()}\n\n"
        except Exception as e:
            error = stream_error(e, generation.request_id, "messages")
            yield anthropic_sse(anthropic_error_response(error.error.code, error.error.message))
            return
        assert last is not None, "the engine ended a request without a final output"
        out = last.outputs[0]
        stop_reason, stop_sequence = to_anthropic_stop_reason(out.finish_reason, out.stop_reason)
        yield anthropic_sse(AnthropicContentBlockStopEvent(index=0))
        delta = AnthropicMessageDelta(stop_reason=stop_reason, stop_sequence=stop_sequence)
        usage = self._usage(prompt_tokens, output_tokens, last.num_cached_tokens)
        yield anthropic_sse(AnthropicMessageDeltaEvent(delta=delta, usage=usage))
        yield anthropic_sse(AnthropicMessageStopEvent())
