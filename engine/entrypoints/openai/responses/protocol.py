"""Request, response and stream-event bodies of ``/v1/responses`` (pydantic models).

Mirrors vLLM's ``vllm/entrypoints/openai/responses/protocol.py`` (``ResponsesRequest``,
``ResponsesResponse``) and the OpenAI types it builds on (``openai.types.responses``): OpenAI's
field names and shapes, so ``client.responses.create`` / ``.stream`` / ``.retrieve`` /
``.cancel`` of the official ``openai`` client work unchanged, plus vLLM's sampling extras
(``top_k``, ``min_p``, ``repetition_penalty``, ``seed``, ``stop``, ...).

Text only. ``input`` is a string or a list of message items (``role`` and ``content``: a
string, or ``input_text`` / ``output_text`` parts). Declared only so that using them is a 400
naming the field rather than silently ignored: ``tools`` and ``tool_choice`` other than
``auto``/``none``, ``reasoning``, ``include``, ``top_logprobs``, ``truncation: auto``;
items other than messages (function calls, reasoning items, ...) and parts other than text
(images, files) are refused likewise. Left out with them: ``prompt`` (stored prompts),
``conversation``, vLLM's harmony (gpt-oss) path, ``enable_response_messages``,
``previous_input_messages``, ``structured_outputs``, ``cache_salt``, LoRA.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.entrypoints.openai.protocol import SEED_MAX, SEED_MIN, OpenAIBaseModel

# A response's lifecycle (OpenAI's ``ResponseStatus``).
ResponseStatus = Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]


# ---------------------------------------------------------------------------- request


class ResponseInputTextPart(OpenAIBaseModel):
    """One text part of an input message: ``input_text`` (what the user said) or
    ``output_text`` (an earlier answer sent back as input)."""

    type: Literal["input_text", "output_text"]
    text: str


class ResponseInputMessage(OpenAIBaseModel):
    """One message item of ``input`` (OpenAI's ``EasyInputMessage`` and the ``message``
    items of ``ResponseInputItem``/``ResponseOutputMessage``; their ``id`` and ``status``
    are ignored)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponseInputTextPart]


class ResponseFormatText(OpenAIBaseModel):
    type: Literal["text"]


class ResponseFormatJSONObject(OpenAIBaseModel):
    type: Literal["json_object"]


class ResponseFormatJSONSchema(OpenAIBaseModel):
    """``{"type": "json_schema", "name", "schema", "description"?, "strict"?}``: the output
    must be JSON that the schema accepts (chat's ``response_format`` ``json_schema``)."""

    model_config = ConfigDict(extra="ignore", validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)  # fmt: skip

    type: Literal["json_schema"]
    name: str
    # ``schema`` would shadow BaseModel.schema: the field is ``schema_``, sent as "schema".
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema, Field(discriminator="type")
]


class ResponseTextConfig(OpenAIBaseModel):
    """``text``: the output's ``format`` (text, JSON object, JSON schema) and ``verbosity``
    (echoed; it changes nothing here)."""

    format: ResponseFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None

    def to_response_format(self) -> dict[str, Any] | None:
        """``format`` as chat's ``response_format`` (None for text): both go down the same path.

        ``json_object`` → ``{"type": "json_object"}``; ``json_schema`` →
        ``{"type": "json_schema", "json_schema": {"name", "schema", "description"?, "strict"?}}``.
        """
        fmt = self.format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        schema = {"name": fmt.name, "schema": fmt.schema_}
        if fmt.description is not None:
            schema["description"] = fmt.description
        if fmt.strict is not None:
            schema["strict"] = fmt.strict
        return {"type": "json_schema", "json_schema": schema}


class ResponsesRequest(OpenAIBaseModel):
    """``POST /v1/responses`` (vLLM's ``ResponsesRequest``).

    ``input``: a string (one user message) or message items. ``instructions``: a system
    message put first (not carried over to a response that names this one as
    ``previous_response_id``, as OpenAI says). ``max_output_tokens``: the output limit (unset:
    all the room the prompt leaves). ``store``: keep the response for ``GET
    /v1/responses/{id}`` and ``previous_response_id``. ``background``: answer at once with a
    ``queued`` response and run it; ``GET`` follows it, ``cancel`` stops it.
    """

    # Fields no model declares are kept (not dropped unseen) so the server can log them.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[ResponseInputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    metadata: dict[str, str] | None = None
    text: ResponseTextConfig | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    truncation: Literal["auto", "disabled"] = "disabled"
    # Declared only so that asking for them is a 400 rather than silently ignored.
    tools: list[dict[str, Any]] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @field_validator("input", mode="before")
    @classmethod
    def _only_message_items(cls, value: Any) -> Any:
        """Items other than messages (``function_call``, ``reasoning``, ...) get a 400 that
        says so, rather than a schema mismatch listing every variant."""
        if isinstance(value, list):
            for i, item in enumerate(value):
                kind = item.get("type", "message") if isinstance(item, dict) else None
                if kind != "message" and isinstance(kind, str):
                    raise ValueError(
                        f"item {i} is a {kind!r} item: only message items are supported "
                        "(tool calls and reasoning items are left out)"
                    )
        return value


# ---------------------------------------------------------------------------- response


class ResponseOutputText(OpenAIBaseModel):
    """The text part of the answer (OpenAI's ``ResponseOutputText``; no annotations or
    logprobs here)."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


class ResponseOutputMessage(OpenAIBaseModel):
    """The answer as one assistant message item, ``id`` ``msg_<hex>``."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponseOutputText]


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    """Token counts: ``input_tokens`` is the rendered conversation's, ``cached_tokens`` those
    of them served from the prefix cache (vLLM: ``num_cached_tokens``)."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(OpenAIBaseModel):
    """Why a (background) response failed: ``code`` ``server_error``, and the message."""

    code: str
    message: str


class ResponsesResponse(OpenAIBaseModel):
    """The Response object (vLLM's ``ResponsesResponse``): what ``POST /v1/responses``
    returns, ``GET /v1/responses/{id}`` retrieves and the ``response.*`` events carry.

    ``status``: ``completed`` (the model stopped), ``incomplete`` (``max_output_tokens``
    reached; ``incomplete_details`` says so), ``queued`` / ``in_progress`` (a background
    response still running), ``cancelled``, ``failed`` (``error``). ``temperature`` and
    ``top_p`` are the values sampling used (the model's defaults when the request set none).
    """

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    model: str
    output: list[ResponseOutputMessage] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str = "auto"
    store: bool = True
    background: bool = False
    temperature: float
    text: ResponseTextConfig | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float
    truncation: Literal["auto", "disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None

    @property
    def output_text(self) -> str:
        """The answer's text (every ``output_text`` part), as the ``openai`` client's property."""
        return "".join(part.text for item in self.output for part in item.content)


# ---------------------------------------------------------------------------- stream events
# Each SSE event is ``event: <type>`` then ``data: <the event's JSON>``; ``sequence_number``
# counts the stream's events from 0. The order of a stream: response.created,
# response.in_progress, response.output_item.added, response.content_part.added,
# response.output_text.delta (one per engine output that brought text), response.output_text.done,
# response.content_part.done, response.output_item.done, response.completed.


class ResponseLifecycleEvent(OpenAIBaseModel):
    """``response.created``, ``response.in_progress``, ``response.completed``: the whole
    Response as it stands (``completed`` also ends an ``incomplete`` one, as vLLM sends it:
    the ``openai`` client's ``get_final_response`` waits for it)."""

    type: Literal["response.created", "response.in_progress", "response.completed"]
    sequence_number: int
    response: ResponsesResponse


class ResponseOutputItemEvent(OpenAIBaseModel):
    """``response.output_item.added`` (the message, ``in_progress``, no content yet) and
    ``response.output_item.done`` (the message as it ended)."""

    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: ResponseOutputMessage


class ResponseContentPartEvent(OpenAIBaseModel):
    """``response.content_part.added`` (an empty ``output_text``) and
    ``response.content_part.done`` (the part with its whole text)."""

    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: ResponseOutputText


class ResponseTextDoneEvent(OpenAIBaseModel):
    """``response.output_text.done``: the part's whole text."""

    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ResponseTextDeltaEventWire(msgspec.Struct, tag="response.output_text.delta"):
    """``response.output_text.delta``, one per engine output that brought text: written by
    msgspec (it is paid once per token of every stream), fields as OpenAI's
    ``ResponseTextDeltaEvent`` (``type``, the tag, first)."""

    sequence_number: int
    item_id: str
    delta: str
    output_index: int = 0
    content_index: int = 0
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ResponseErrorEvent(OpenAIBaseModel):
    """``error``: what ended a stream early (OpenAI's ``ResponseErrorEvent``; ``code`` is
    the HTTP status a plain request would have got)."""

    type: Literal["error"] = "error"
    sequence_number: int
    code: str | None = None
    message: str
    param: str | None = None


def model_dump_event(event: BaseModel) -> str:
    """One SSE event for a pydantic event model: ``event: <type>``, ``data: <json>``."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"  # type: ignore[attr-defined]
