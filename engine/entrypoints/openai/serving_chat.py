"""``POST /v1/chat/completions``: a conversation in, the assistant's reply out.

Mirrors vLLM's ``vllm/entrypoints/openai/serving_chat.py`` (``OpenAIServingChat``). The
messages are rendered with the tokenizer's chat template (``apply_chat_template``), then the
request runs like one completion. A stream first sends, with the engine's first output, for
each choice a chunk whose delta is ``{"role": "assistant", "content": ""}``, then one content
delta per engine output that brought tokens (empty while a character is incomplete or text is
held back for a possible stop string, as vLLM sends it), the last one carrying the
``finish_reason``; with ``stream_options.include_usage`` a final chunk with no choices
carries the usage.

The flow up to the engine's outputs (checks, chat template, limits, sampling params, trace,
engine request) is ``start_generation``; ``/v1/responses`` and ``/v1/messages`` run it too,
with a ``ChatCompletionRequest`` made from their own request, and shape its outputs their way.

Structured outputs: ``response_format``, ``structured_outputs`` and ``tools`` with
``tool_choice`` ``"required"`` or a named function become the request's constraint
(``structured_outputs.py``); a reply to a tool choice comes back as ``message.tool_calls``
(streamed whole in the choice's last chunk).

Left out: ``tool_choice: "auto"`` and tool parsers, reasoning parsers,
``continue_final_message``, a chat template given in the request, ``echo``, multimodal
content parts, ``continuous_usage_stats``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatStreamChoiceWire,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaMessageWire,
    DeltaToolCall,
    UsageInfo,
)
from engine.entrypoints.openai.serving_engine import (
    MIN_LOGPROB,
    SSE_DONE,
    OpenAIError,
    OpenAIServing,
    StreamChunks,
    bad_request_from_value_error,
    check_finished_without_error,
    merge_async_iterators,
    random_uuid,
    sse_event,
    stream_error_event,
)
from engine.entrypoints.openai.structured_outputs import structured_outputs_of, tool_calls_of
from engine.frontend.outputs import LogprobsDict, RequestOutput
from engine.frontend.request_tracing import RequestTrace, start_request_trace
from engine.logger import init_logger
from engine.sampling_params import SamplingParams

logger = init_logger(__name__)


def reply_message(
    request: ChatCompletionRequest, text: str, finish_reason: str | None
) -> tuple[ChatMessage, str | None]:
    """The reply and its finish reason: the text as ``content``, or — when ``tool_choice``
    asked for tool calls — ``tool_calls`` with ``content: ""``; ``"required"`` then finishes
    ``tool_calls`` where the model finished ``stop``, a named tool ``stop`` (vLLM's)."""
    calls = tool_calls_of(request, text)
    if calls is None:
        return ChatMessage(role="assistant", content=text), finish_reason
    if request.tool_choice == "required" and finish_reason == "stop":
        finish_reason = "tool_calls"
    return ChatMessage(role="assistant", content="", tool_calls=calls), finish_reason


def wants_tool_calls(request: ChatCompletionRequest) -> bool:
    return bool(request.tools) and request.tool_choice not in (None, "none", "auto")


@dataclass
class ChatGeneration:
    """One chat request admitted into the engine (``OpenAIServingChat.start_generation``).

    The routes that run through the chat flow — chat completions, the Responses API and
    Anthropic's Messages — shape these outputs into their own answers.

    Attributes:
        request_id: the engine request's id (each route picks its prefix).
        prompt_token_ids: the rendered conversation's tokens (usage counts them).
        params: the request's ``SamplingParams`` before the input processor's fill-in.
        trace: the request's ``api_server.request`` span; ``final_output`` or the route's
            ``trace.wrap_stream`` ends it.
        outputs: the engine's ``RequestOutput``s, tagged with their generator's index (always
            0: one engine request); closing it aborts the request.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    trace: RequestTrace
    outputs: AsyncIterator[tuple[int, RequestOutput]]


class OpenAIServingChat(OpenAIServing):
    """The chat route (vLLM's ``OpenAIServingChat``), and the chat flow other routes reuse
    (``start_generation``, ``final_output``)."""

    async def create_chat_completion(
        self, request: ChatCompletionRequest, headers: dict[str, str] | None = None
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """Serve one chat request.

        Returns:
            The ``ChatCompletionResponse``, or (``stream``) an async iterator of SSE lines
            ending with ``data: [DONE]``. Closing that iterator aborts the engine request.

        Raises:
            OpenAIError: a bad request (400), an unknown model (404).
            EngineDeadError: the engine is dead (503).
        """
        generation = await self.start_generation(
            request, f"chatcmpl-{random_uuid()}", headers, "/v1/chat/completions"
        )
        if request.stream:
            stream = self._stream(request, generation.request_id, len(generation.prompt_token_ids),
                                  generation.outputs)  # fmt: skip
            return generation.trace.wrap_stream(stream)
        final = await self.final_output(generation, "messages")
        return self._full_response(request, generation.request_id, final)

    async def start_generation(
        self, request: ChatCompletionRequest, request_id: str, headers: dict[str, str] | None, route: str
    ) -> ChatGeneration:
        """Check a chat request, render and tokenize its conversation, and start it in the engine.

        Every rule a chat request meets is checked here, once, before anything answers 200: the
        model, the engine's health, the fields left out, the prompt's length
        (``check_text_fits``, then the input processor's ``validate_prompt``) and the sampling
        params. ``route`` names the HTTP route in the request's trace (``http.route``).

        Raises:
            OpenAIError: a bad request (400, naming the chat field at fault), an unknown
                model (404).
            EngineDeadError: the engine is dead (503).
        """
        arrived_ns = time.time_ns()
        self.check_model(request.model)
        self.check_engine_alive()
        self.check_unsupported(request)
        if request.top_logprobs and not request.logprobs:
            raise OpenAIError("top_logprobs needs logprobs to be true.", param="top_logprobs")
        structured_outputs, so_renames = structured_outputs_of(request)
        # Rendering and tokenizing off the event loop, so other requests stream on.
        tokenize_ns = time.time_ns()
        _, prompt_ids = await asyncio.to_thread(
            self.render_chat, request.messages, request.add_generation_prompt, True
        )
        tokenized_ns = time.time_ns()
        max_tokens_field = request.max_tokens_field
        max_tokens = self.resolve_max_tokens(request.requested_max_tokens, max_tokens_field)
        renames = {"max_tokens": max_tokens_field, "logprobs": "top_logprobs", **so_renames}
        try:
            params = request.to_sampling_params(max_tokens, self.default_sampling_params, structured_outputs)
            engine_request = self.engine.input_processor.process_inputs(
                request_id, {"prompt_token_ids": prompt_ids}, params
            )
        except ValueError as e:
            raise bad_request_from_value_error(e, "messages", renames) from None

        rtrace = start_request_trace(request_id, headers, arrived_ns, route)
        rtrace.record_inputs(tokenize_ns, tokenized_ns)
        engine_request.trace_headers = rtrace.engine_headers
        generator = self.engine.generate(engine_request, params, request_id)
        return ChatGeneration(request_id, prompt_ids, params, rtrace, merge_async_iterators(generator))

    async def final_output(self, generation: ChatGeneration, blamed: str) -> RequestOutput:
        """The last ``RequestOutput`` of a full (not streamed) request, its trace ended.

        Raises:
            OpenAIError: (400, ``blamed``) the engine refused the request's input.
            EngineDeadError: the engine died (503).
        """
        final: RequestOutput | None = None
        error: BaseException | None = None
        try:
            async with contextlib.aclosing(generation.outputs):
                async for _, output in generation.outputs:
                    final = output
        except ValueError as e:
            error = e
            raise bad_request_from_value_error(e, blamed) from None
        except BaseException as e:
            error = e
            raise
        finally:
            generation.trace.end(error)
        assert final is not None, "the engine ended a request without a final output"
        return final

    # ------------------------------------------------------------------ full response

    def _full_response(
        self, request: ChatCompletionRequest, request_id: str, final: RequestOutput
    ) -> ChatCompletionResponse:
        choices = []
        for out in final.outputs:
            logprobs = None
            if request.logprobs and out.logprobs is not None:
                logprobs = self.create_logprobs(out.token_ids, out.logprobs, request.top_logprobs or 0)
            check_finished_without_error(out.finish_reason, out.stop_reason)
            message, finish_reason = reply_message(request, out.text, out.finish_reason)
            choices.append(
                ChatCompletionResponseChoice(
                    index=out.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=out.stop_reason,
                )
            )
        completion_tokens = sum(len(out.token_ids) for out in final.outputs)
        usage = self.make_usage(len(final.prompt_token_ids), completion_tokens, final.num_cached_tokens)
        return ChatCompletionResponse(
            id=request_id, model=self.served_model_name, choices=choices, usage=usage
        )

    # ------------------------------------------------------------------ stream

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        prompt_tokens: int,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        chunks = StreamChunks(ChatCompletionStreamResponse(id=request_id, created=created,
                                                           model=self.served_model_name, choices=[]))  # fmt: skip

        def chunk(choices: list[ChatCompletionResponseStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse_event(ChatCompletionStreamResponse(id=request_id, created=created, model=self.served_model_name,
                                                          choices=choices, usage=usage))  # fmt: skip

        completion_tokens = num_cached_tokens = 0
        tool_calls = wants_tool_calls(request)
        texts: dict[int, str] = {}  # the text of each choice so far, when it becomes tool calls
        try:
            async with contextlib.aclosing(outputs):
                role_sent = False
                async for _, output in outputs:
                    num_cached_tokens = output.num_cached_tokens
                    if not role_sent:
                        # The role comes first, once per choice, before any content (as OpenAI
                        # does) — with the first engine output, as in vLLM, so a client's first
                        # chunk marks its first token (and an error before it comes alone).
                        role_sent = True
                        for index in range(request.n):
                            yield chunks.event(
                                ChatStreamChoiceWire(index, DeltaMessageWire(role="assistant", content=""))
                            )
                    for out in output.outputs:
                        completion_tokens += len(out.token_ids)
                        check_finished_without_error(out.finish_reason, out.stop_reason)
                        if tool_calls:
                            # Tool calls are sent whole, in the choice's last chunk.
                            texts[out.index] = texts.get(out.index, "") + out.text
                            if out.finish_reason is not None:
                                yield chunk([self._tool_call_choice(request, out.index, texts[out.index],
                                                                    out.finish_reason, out.stop_reason)])  # fmt: skip
                            continue
                        logprobs = None
                        if request.logprobs and out.logprobs:
                            logprobs = self.create_logprobs(
                                out.token_ids, out.logprobs, request.top_logprobs or 0
                            )
                        if not out.text and not out.token_ids and out.finish_reason is None:
                            continue  # nothing new for this choice (vLLM: "don't return empty chunks")
                        if logprobs is None:  # the common chunk: msgspec writes the same JSON
                            delta = DeltaMessageWire(content=out.text)
                            yield chunks.event(
                                ChatStreamChoiceWire(
                                    out.index, delta, None, out.finish_reason, out.stop_reason
                                )
                            )
                            continue
                        choice = ChatCompletionResponseStreamChoice(
                            index=out.index,
                            delta=DeltaMessage(content=out.text),
                            logprobs=logprobs,
                            finish_reason=out.finish_reason,
                            stop_reason=out.stop_reason,
                        )
                        yield chunk([choice])
            if request.stream_options is not None and request.stream_options.include_usage:
                yield chunk([], self.make_usage(prompt_tokens, completion_tokens, num_cached_tokens))
        except Exception as e:
            yield stream_error_event(e, request_id, "messages")
        yield SSE_DONE

    @staticmethod
    def _tool_call_choice(
        request: ChatCompletionRequest,
        index: int,
        text: str,
        finish_reason: str,
        stop_reason: int | str | None,
    ) -> ChatCompletionResponseStreamChoice:
        """A stream's last chunk of a choice that called tools: every call, whole."""
        message, finish_reason = reply_message(request, text, finish_reason)
        deltas = None
        if message.tool_calls is not None:
            deltas = [
                DeltaToolCall(id=call.id, type="function", index=i,
                              function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments))
                for i, call in enumerate(message.tool_calls)
            ]  # fmt: skip
        delta = DeltaMessage(content=message.content, tool_calls=deltas)
        return ChatCompletionResponseStreamChoice(
            index=index, delta=delta, finish_reason=finish_reason, stop_reason=stop_reason
        )

    # ------------------------------------------------------------------ logprobs

    def create_logprobs(
        self, token_ids: list[int], top_logprobs: list[LogprobsDict], num_top: int
    ) -> ChatCompletionLogProbs:
        """Chat logprobs: per sampled token, its text, logprob, bytes and the top-N alternatives.

        vLLM: ``OpenAIServingChat._create_chat_logprobs``.
        """
        content = []
        for token_id, step in zip(token_ids, top_logprobs):
            chosen = step.get(token_id)
            token = self.token_text(token_id, chosen.decoded_token if chosen is not None else None)
            alternatives = sorted(
                ((tid, lp) for tid, lp in step.items() if lp.rank is not None and lp.rank <= num_top),
                key=lambda item: item[1].rank,
            )
            top = []
            for tid, lp in alternatives:
                text = self.token_text(tid, lp.decoded_token)
                top.append(ChatCompletionLogProb(token=text, logprob=max(lp.logprob, MIN_LOGPROB),
                                                 bytes=list(text.encode("utf-8"))))  # fmt: skip
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=max(chosen.logprob, MIN_LOGPROB) if chosen is not None else MIN_LOGPROB,
                    bytes=list(token.encode("utf-8")),
                    top_logprobs=top,
                )
            )
        return ChatCompletionLogProbs(content=content)
