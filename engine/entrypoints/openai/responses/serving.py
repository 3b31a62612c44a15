"""``/v1/responses``: the OpenAI Responses API for text, run through the chat flow.

Mirrors vLLM's ``vllm/entrypoints/openai/responses/serving.py`` (``OpenAIServingResponses``,
its simple — not harmony — path) and ``construct_input_messages`` of ``utils.py``. The
request becomes a conversation — ``instructions`` as a system message, then the stored
conversation and answer of ``previous_response_id``, then ``input`` — and that conversation a
``ChatCompletionRequest``, served by ``OpenAIServingChat.start_generation``: the same checks,
chat template, prompt-length rule, sampling params, trace and engine request as a chat
completion (errors name the Responses field: ``input``, ``max_output_tokens``,
``text.format``). What is this route's own is the shape of the answer: one assistant message
item, and a stream of typed events (``protocol.py``).

The store (``ResponsesStore``): an LRU of the last ``GLASSBOX_RESPONSES_API_STORE_SIZE``
responses (default 256) with ``store`` true, each with the conversation that produced it, in
this API server's memory. ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and
``previous_response_id`` read it; an id it no longer holds (or never held) is a 404,
``Response with id '...' not found.`` A retrieval counts as a use. 0 turns the store off:
``store`` is then ignored and ``background`` refused, vLLM's default. Deliberate deviation:
vLLM's store (``VLLM_ENABLE_RESPONSES_API_STORE=1``) keeps every response for the server's
life; a bound makes it safe to have on by default. With several API servers each has its own.

``background``: the answer is a ``queued`` response, stored; the run goes on in a task that
updates it (``in_progress``, then ``completed`` / ``incomplete`` / ``failed``) and ``cancel``
stops (``cancelled``; the engine request is aborted). A background response pushed out of
the store is cancelled too: nobody could fetch its answer.

``text.format`` (``json_object``, ``json_schema``) becomes chat's ``response_format``: the
output is held to it by the engine's structured outputs.

Left out (a 400 naming the field): tools and tool calls, reasoning, ``include``, logprobs
(``top_logprobs``), ``truncation: auto``, streamed background runs and ``GET ...?stream=true``
(vLLM's event store), the harmony path (gpt-oss), ``prompt`` (stored prompts).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import msgspec

from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.responses.protocol import (
    IncompleteDetails,
    InputTokensDetails,
    ResponseContentPartEvent,
    ResponseError,
    ResponseErrorEvent,
    ResponseInputMessage,
    ResponseLifecycleEvent,
    ResponseOutputItemEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseTextDeltaEventWire,
    ResponseTextDoneEvent,
    ResponseUsage,
    model_dump_event,
)
from engine.entrypoints.openai.serving_chat import ChatGeneration, OpenAIServingChat
from engine.entrypoints.openai.serving_engine import OpenAIError, random_uuid, stream_error
from engine.frontend.async_llm import AsyncLLM
from engine.frontend.outputs import RequestOutput
from engine.logger import init_logger

logger = init_logger(__name__)

# The chat fields a Responses request's errors are renamed from (``OpenAIError.renamed``).
RENAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    # A schema that does not compile names the field it is in (structured_outputs.py's names);
    # the specific names first, before "response_format" renames their start.
    "response_format.json_schema.schema": "text.format.schema",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
}
ROUTE = "/v1/responses"
_encoder = msgspec.json.Encoder()


def construct_input_messages(
    instructions: str | None,
    request_input: str | list[ResponseInputMessage],
    previous_messages: list[dict[str, Any]] | None = None,
    previous_output: list[ResponseOutputMessage] | None = None,
) -> list[dict[str, Any]]:
    """The conversation a Responses request stands for, as chat messages (vLLM's
    ``construct_input_messages``).

    ``instructions`` first (a system message), then the previous response's conversation
    without its system messages (instructions are not carried over), its answer as an
    assistant message, then ``request_input``: a string is one user message; a message item's
    text parts become chat ``text`` parts.
    """
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if previous_messages:
        messages.extend(m for m in previous_messages if m["role"] != "system")
    for item in previous_output or ():
        for part in item.content:
            messages.append({"role": "assistant", "content": part.text})
    if isinstance(request_input, str):
        messages.append({"role": "user", "content": request_input})
        return messages
    for item in request_input:
        content = item.content
        if not isinstance(content, str):
            content = [{"type": "text", "text": part.text} for part in content]
        messages.append({"role": item.role, "content": content})
    return messages


def to_chat_completion_request(
    request: ResponsesRequest, messages: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request that serves ``request`` over ``messages``: the same sampling fields,
    ``max_output_tokens`` as ``max_completion_tokens``, ``text.format`` as
    ``response_format`` (so structured outputs take one path for both routes)."""
    return ChatCompletionRequest(
        model=request.model,
        messages=messages,
        max_completion_tokens=request.max_output_tokens,
        stream=request.stream,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        seed=request.seed,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        response_format=request.text.to_response_format() if request.text is not None else None,
    )


def check_supported(request: ResponsesRequest, store_enabled: bool) -> None:
    """Refuse what is left out, naming the field.

    Raises:
        OpenAIError: (400) tools, a tool choice other than auto/none, reasoning, ``include``,
            ``top_logprobs``, ``truncation: auto``, a streamed background run, a background
            run without the store.
    """
    if request.tools:
        raise OpenAIError("tools are not supported (tool calling is left out).", param="tools")
    if request.tool_choice not in ("auto", "none"):
        raise OpenAIError(
            "tool_choice must be 'auto' or 'none' (tool calling is left out).", param="tool_choice"
        )
    if request.reasoning is not None:
        raise OpenAIError("reasoning is not supported (reasoning models are left out).", param="reasoning")
    if request.include:
        raise OpenAIError(
            "include is not supported (logprobs and reasoning items are left out).", param="include"
        )
    if request.top_logprobs:
        raise OpenAIError("top_logprobs is not supported (logprobs are left out).", param="top_logprobs")
    if request.truncation == "auto":
        raise OpenAIError(
            "truncation 'auto' is not supported: a prompt too long is a 400.", param="truncation"
        )
    if request.background and request.stream:
        raise OpenAIError("A streamed background response is not supported (left out).", param="background")
    if request.background and not (request.store and store_enabled):
        raise OpenAIError(
            "background needs the response to be stored: store must be true, and the server's store "
            "on (GLASSBOX_RESPONSES_API_STORE_SIZE > 0).",
            param="background",
        )


@dataclass
class StoredResponse:
    """One entry of the store: the response, the conversation that produced it (chat messages,
    for ``previous_response_id``), and the task of a background run."""

    response: ResponsesResponse
    messages: list[dict[str, Any]]
    task: asyncio.Task | None = field(default=None, repr=False)


class ResponsesStore:
    """The stored responses: an LRU of at most ``capacity`` entries.

    ``get`` counts as a use; ``put`` of a new id beyond ``capacity`` forgets the least
    recently used entry, and cancels its background run if it still has one (its answer could
    never be fetched). ``capacity`` 0: nothing is ever stored. Pure bookkeeping on the event
    loop's thread: no lock (vLLM's ``response_store`` is a dict behind an ``asyncio.Lock``).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, entry: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.capacity:
            _, evicted = self._entries.popitem(last=False)
            if evicted.task is not None and not evicted.task.done():
                evicted.task.cancel()


def not_found(response_id: str, param: str) -> OpenAIError:
    """vLLM's 404 for an id the store does not hold."""
    return OpenAIError(f"Response with id '{response_id}' not found.", HTTPStatus.NOT_FOUND, param=param)


class OpenAIServingResponses(OpenAIServingChat):
    """The Responses routes (vLLM's ``OpenAIServingResponses``, which builds on
    ``OpenAIServing``; this one builds on the chat route, whose flow it runs).

    Args:
        store_size: how many responses the store keeps (``GLASSBOX_RESPONSES_API_STORE_SIZE``).
    """

    def __init__(
        self,
        engine: AsyncLLM,
        served_model_name: str,
        enable_prompt_tokens_details: bool = False,
        store_size: int = 0,
    ) -> None:
        super().__init__(engine, served_model_name, enable_prompt_tokens_details)
        self.store = ResponsesStore(store_size)
        # The background runs still going: held here so that none is garbage-collected while
        # it runs (an entry pushed out of the store lets go of its task).
        self.background_tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ routes

    async def create_responses(
        self, request: ResponsesRequest, headers: dict[str, str] | None = None
    ) -> ResponsesResponse | AsyncIterator[str]:
        """Serve ``POST /v1/responses``.

        Returns:
            The response (``completed`` / ``incomplete``, or ``queued`` for a background run),
            or (``stream``) an async iterator of SSE events ending with ``response.completed``.
            Closing it aborts the engine request.

        Raises:
            OpenAIError: a bad request (400 naming the field), an unknown model or
                ``previous_response_id`` (404).
            EngineDeadError: the engine is dead (503).
        """
        created_at = int(time.time())
        check_supported(request, self.store.capacity > 0)
        self.log_unknown_fields(request)
        previous = None
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:
                raise not_found(request.previous_response_id, "previous_response_id")
        messages = construct_input_messages(
            request.instructions,
            request.input,
            previous.messages if previous is not None else None,
            previous.response.output if previous is not None else None,
        )
        if not messages:
            raise OpenAIError("input has no message (and there are no instructions).", param="input")
        response_id = f"resp_{random_uuid()}"
        try:
            generation = await self.start_generation(
                to_chat_completion_request(request, messages), response_id, headers, ROUTE
            )
        except OpenAIError as e:
            raise e.renamed(RENAMES) from None
        store = request.store and self.store.capacity > 0
        skeleton = self._response(request, generation, created_at, "in_progress", store)
        if request.background:
            return self._start_background(skeleton, messages, generation)
        if request.stream:
            return generation.trace.wrap_stream(self._stream(skeleton, messages, generation))
        try:
            final = await self.final_output(generation, "input")
        except OpenAIError as e:
            raise e.renamed(RENAMES) from None
        response = self._finish_full(skeleton, generation, final)
        if store:
            self.store.put(StoredResponse(response, messages))
        return response

    def retrieve_responses(self, response_id: str) -> ResponsesResponse:
        """``GET /v1/responses/{id}``: the stored response as it stands.

        Raises:
            OpenAIError: (404) not stored, or no longer (``ResponsesStore``).
        """
        entry = self.store.get(response_id)
        if entry is None:
            raise not_found(response_id, "response_id")
        return entry.response

    async def cancel_responses(self, response_id: str) -> ResponsesResponse:
        """``POST /v1/responses/{id}/cancel``: stop a background run (its engine request is
        aborted) and return the response, ``cancelled``.

        Raises:
            OpenAIError: (404) not stored; (400) the response is not a background run still
                queued or in progress (vLLM's "Cannot cancel a synchronous response.").
        """
        entry = self.store.get(response_id)
        if entry is None:
            raise not_found(response_id, "response_id")
        if entry.response.status not in ("queued", "in_progress"):
            raise OpenAIError("Cannot cancel a synchronous response.", param="response_id")
        entry.response = entry.response.model_copy(update={"status": "cancelled"})
        if entry.task is not None:
            entry.task.cancel()
            # The cancellation closes the engine stream (its abort); wait for it.
            await asyncio.gather(entry.task, return_exceptions=True)
        return entry.response

    # ------------------------------------------------------------------ answers

    def _response(
        self, request: ResponsesRequest, generation: ChatGeneration, created_at: int, status: str, store: bool
    ) -> ResponsesResponse:
        """The response before any output: the request's settings, echoed as OpenAI does."""
        return ResponsesResponse(
            id=generation.request_id,
            created_at=created_at,
            status=status,
            instructions=request.instructions,
            max_output_tokens=request.max_output_tokens,
            metadata=request.metadata,
            model=self.served_model_name,
            parallel_tool_calls=request.parallel_tool_calls,
            previous_response_id=request.previous_response_id,
            service_tier=request.service_tier,
            store=store,
            background=request.background,
            temperature=generation.params.temperature,
            text=request.text,
            tool_choice=request.tool_choice,
            top_p=generation.params.top_p,
            truncation=request.truncation,
            user=request.user,
        )

    def _finish(
        self,
        skeleton: ResponsesResponse,
        generation: ChatGeneration,
        item_id: str,
        text: str,
        num_output_tokens: int,
        finish_reason: str | None,
        num_cached_tokens: int,
    ) -> ResponsesResponse:
        """The response once the engine is done: ``completed``, or ``incomplete`` when the
        output limit ended it (vLLM's rule), with the answer (one message item, ``item_id``)
        and the usage."""
        incomplete = finish_reason == "length"
        message = ResponseOutputMessage(
            id=item_id,
            status="incomplete" if incomplete else "completed",
            content=[ResponseOutputText(text=text)],
        )
        usage = self._usage(len(generation.prompt_token_ids), num_output_tokens, num_cached_tokens)
        return skeleton.model_copy(
            update={
                "status": "incomplete" if incomplete else "completed",
                "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete else None,
                "output": [message],
                "usage": usage,
            }
        )

    def _finish_full(
        self, skeleton: ResponsesResponse, generation: ChatGeneration, final: RequestOutput
    ) -> ResponsesResponse:
        """``_finish`` from the final output of a full (not streamed) request."""
        out = final.outputs[0]
        return self._finish(skeleton, generation, f"msg_{random_uuid()}", out.text, len(out.token_ids),
                            out.finish_reason, final.num_cached_tokens)  # fmt: skip

    def _usage(self, input_tokens: int, output_tokens: int, cached_tokens: int) -> ResponseUsage:
        return ResponseUsage(
            input_tokens=input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
            output_tokens=output_tokens,
            total_tokens=input_tokens + output_tokens,
        )

    # ------------------------------------------------------------------ background

    def _start_background(
        self, skeleton: ResponsesResponse, messages: list[dict[str, Any]], generation: ChatGeneration
    ) -> ResponsesResponse:
        queued = skeleton.model_copy(update={"status": "queued"})
        entry = StoredResponse(queued, messages)
        entry.task = asyncio.create_task(
            self._run_background(entry, generation), name=f"background {skeleton.id}"
        )
        self.store.put(entry)
        return queued

    async def _run_background(self, entry: StoredResponse, generation: ChatGeneration) -> None:
        """Run a background response to its end, updating its stored entry: ``in_progress``
        from the first output, then the finished response, or ``failed`` with the error. A
        cancellation (``cancel_responses``, or the entry pushed out of the store) closes the
        engine stream, which aborts the request."""
        skeleton = entry.response
        generation.outputs = self._mark_in_progress(entry, generation.outputs)
        try:
            final = await self.final_output(generation, "input")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = stream_error(e, generation.request_id, "input")
            entry.response = skeleton.model_copy(
                update={
                    "status": "failed",
                    "error": ResponseError(code="server_error", message=error.error.message),
                }
            )
            return
        entry.response = self._finish_full(skeleton, generation, final)

    @staticmethod
    async def _mark_in_progress(
        entry: StoredResponse, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        async with contextlib.aclosing(outputs):
            async for item in outputs:
                if entry.response.status == "queued":
                    entry.response = entry.response.model_copy(update={"status": "in_progress"})
                yield item

    # ------------------------------------------------------------------ stream

    async def _stream(
        self, skeleton: ResponsesResponse, messages: list[dict[str, Any]], generation: ChatGeneration
    ) -> AsyncIterator[str]:
        """The typed events of one response (the order in ``protocol.py``), each with the next
        ``sequence_number``. The message item is opened with the engine's first output (so a
        client's first delta marks the first token, and an error before it comes alone); an
        error ends the stream with an ``error`` event. The final response is stored (when
        ``store``) before ``response.completed`` is sent."""
        sequence = 0

        def event(model_type: type, **fields: Any) -> str:
            nonlocal sequence
            sequence += 1
            return model_dump_event(model_type(sequence_number=sequence - 1, **fields))

        item_id = f"msg_{random_uuid()}"
        yield event(ResponseLifecycleEvent, type="response.created", response=skeleton)
        yield event(ResponseLifecycleEvent, type="response.in_progress", response=skeleton)
        empty_item = ResponseOutputMessage(id=item_id, status="in_progress", content=[])
        text_parts: list[str] = []
        last: RequestOutput | None = None
        num_output_tokens = 0
        try:
            async with contextlib.aclosing(generation.outputs):
                async for _, output in generation.outputs:
                    if last is None:
                        yield event(ResponseOutputItemEvent, type="response.output_item.added", output_index=0,
                                    item=empty_item)  # fmt: skip
                        yield event(ResponseContentPartEvent, type="response.content_part.added", item_id=item_id,
                                    output_index=0, content_index=0, part=ResponseOutputText(text=""))  # fmt: skip
                    last = output
                    num_output_tokens += len(output.outputs[0].token_ids)
                    delta = output.outputs[0].text
                    if delta:
                        text_parts.append(delta)
                        yield self._delta_event(sequence, item_id, delta)
                        sequence += 1
        except Exception as e:
            error = stream_error(e, generation.request_id, "input")
            yield event(ResponseErrorEvent, code=str(error.error.code), message=error.error.message,
                        param=RENAMES.get(error.error.param, error.error.param))  # fmt: skip
            return
        assert last is not None, "the engine ended a request without a final output"
        text = "".join(text_parts)
        response = self._finish(skeleton, generation, item_id, text, num_output_tokens,
                                last.outputs[0].finish_reason, last.num_cached_tokens)  # fmt: skip
        part = response.output[0].content[0]
        yield event(ResponseTextDoneEvent, item_id=item_id, output_index=0, content_index=0, text=text)
        yield event(ResponseContentPartEvent, type="response.content_part.done", item_id=item_id, output_index=0,
                    content_index=0, part=part)  # fmt: skip
        yield event(ResponseOutputItemEvent, type="response.output_item.done", output_index=0,
                    item=response.output[0])  # fmt: skip
        if response.store:
            self.store.put(StoredResponse(response, messages))
        yield event(ResponseLifecycleEvent, type="response.completed", response=response)

    @staticmethod
    def _delta_event(sequence_number: int, item_id: str, delta: str) -> str:
        """``response.output_text.delta``, written by msgspec (once per engine output)."""
        body = _encoder.encode(ResponseTextDeltaEventWire(sequence_number, item_id, delta)).decode()
        return f"event: response.output_text.delta\ndata: {body}\n\n"
