"""Request, response, stream-event and error bodies of Anthropic's Messages API (pydantic models).

Mirrors vLLM's ``vllm/entrypoints/anthropic/protocol.py`` (``AnthropicMessagesRequest``,
``AnthropicMessagesResponse``, ``AnthropicStreamEvent``, ``AnthropicErrorResponse``,
``AnthropicCountTokensRequest``): Anthropic's field names and shapes, so the official
``anthropic`` client's ``messages.create``, ``messages.stream`` and ``messages.count_tokens``
work unchanged.

Text only: ``system`` and each message's ``content`` are a string or text blocks. Declared only
so that using them is a 400 naming the field rather than silently ignored: ``tools``,
``tool_choice``, ``thinking`` (other than ``disabled``); blocks other than text (images,
documents, tool use and results, thinking) are refused likewise. Left out with them:
``output_config.effort``, vLLM's extras (``kv_transfer_params``, ``cache_salt``,
``chat_template_kwargs``, ``vllm_xargs``, multimodal payloads).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

# Anthropic's error ``type`` for each HTTP status (its API's error table); any other 4xx is
# ``invalid_request_error``, any other 5xx ``api_error``.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicBaseModel(BaseModel):
    # Unknown fields are dropped (``cache_control`` on a block, a ``citations`` list, ...).
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------------- errors


class AnthropicError(AnthropicBaseModel):
    """``{"type": "invalid_request_error" | ..., "message": ...}``."""

    type: str
    message: str


class AnthropicErrorResponse(AnthropicBaseModel):
    """The body of every error under ``/v1/messages``: ``{"type": "error", "error": {...}}``."""

    type: Literal["error"] = "error"
    error: AnthropicError


def anthropic_error_type(status_code: int) -> str:
    """Anthropic's error ``type`` for an HTTP status (``ANTHROPIC_ERROR_TYPES``)."""
    if status_code in ANTHROPIC_ERROR_TYPES:
        return ANTHROPIC_ERROR_TYPES[status_code]
    return "api_error" if status_code >= HTTPStatus.INTERNAL_SERVER_ERROR else "invalid_request_error"


def anthropic_error_response(status_code: int, message: str) -> AnthropicErrorResponse:
    """Anthropic's error body for ``status_code``. Deliberate deviation: vLLM puts the OpenAI
    error type (``BadRequestError``) in ``error.type``; this is Anthropic's own
    (``invalid_request_error``), which the ``anthropic`` client and Anthropic's docs use.

    A message that quotes the request may hold a lone surrogate, which JSON cannot be
    written with as UTF-8: it is escaped (``\\ud800``)."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return AnthropicErrorResponse(
        error=AnthropicError(type=anthropic_error_type(status_code), message=message)
    )


# ---------------------------------------------------------------------------- request


class AnthropicContentBlock(AnthropicBaseModel):
    """One content block. Only ``text`` blocks are served (``serving.py`` refuses the others
    by name); the type is an open string so that refusal names it."""

    type: str
    text: str | None = None


class AnthropicMessage(AnthropicBaseModel):
    """One turn: ``content`` a string or content blocks (vLLM also takes ``system`` turns)."""

    role: Literal["user", "assistant", "system"]
    content: str | list[AnthropicContentBlock]


class AnthropicJsonOutputFormat(AnthropicBaseModel):
    """``output_config.format``: ``{"type": "json_schema", "schema": {...}}``."""

    model_config = ConfigDict(extra="ignore", validate_by_name=True, validate_by_alias=True)

    type: Literal["json_schema"] = "json_schema"
    json_schema: dict[str, Any] = Field(alias="schema")


class AnthropicOutputConfig(AnthropicBaseModel):
    format: AnthropicJsonOutputFormat | None = None
    # Declared so that asking for it is a 400 (reasoning effort is left out).
    effort: str | None = None


class AnthropicThinkingConfig(AnthropicBaseModel):
    """``thinking``: only ``{"type": "disabled"}`` is served (there is no reasoning parser)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class AnthropicCountTokensRequest(AnthropicBaseModel):
    """``POST /v1/messages/count_tokens``: the conversation whose prompt tokens are counted."""

    # Fields no model declares are kept (not dropped unseen) so the server can log them.
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicContentBlock] | None = None
    # Declared only so that asking for them is a 400 rather than silently ignored.
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: AnthropicThinkingConfig | None = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    """``POST /v1/messages`` (vLLM's ``AnthropicMessagesRequest``).

    ``max_tokens`` is required and at least 1. ``stop_sequences``: strings that end the
    answer (``stop_reason: "stop_sequence"``, ``stop_sequence`` says which). ``metadata`` is
    accepted and ignored.
    """

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    output_config: AnthropicOutputConfig | None = None


# ---------------------------------------------------------------------------- response


class AnthropicTextBlock(AnthropicBaseModel):
    type: Literal["text"] = "text"
    text: str


class AnthropicUsage(AnthropicBaseModel):
    """``input_tokens``: the prompt's tokens (less those read from the prefix cache, which
    ``cache_read_input_tokens`` counts, only with ``--enable-prompt-tokens-details`` — vLLM's
    rule); ``output_tokens``: the tokens generated."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = Field(default=None, exclude_if=lambda v: v is None)


class AnthropicMessagesResponse(AnthropicBaseModel):
    """The assistant's message (vLLM's ``AnthropicMessagesResponse``), ``id`` ``msg_<hex>``.

    ``stop_reason``: ``end_turn`` (the model stopped), ``max_tokens``, ``stop_sequence`` (and
    ``stop_sequence`` names it); ``content`` is one text block (empty text when nothing was
    generated, as Anthropic sends it).
    """

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[AnthropicTextBlock]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class AnthropicCountTokensResponse(AnthropicBaseModel):
    """``{"input_tokens": N}``, and vLLM's ``context_management.original_input_tokens`` (the same N)."""

    input_tokens: int
    context_management: dict[str, int] | None = None


# ---------------------------------------------------------------------------- stream events
# Each SSE event is ``event: <type>`` then ``data: <the event's JSON>``. The order of a stream:
# message_start, content_block_start, ping, content_block_delta (one per engine output that
# brought text), content_block_stop, message_delta (stop_reason, usage), message_stop.


class AnthropicMessageStartEvent(AnthropicBaseModel):
    """``message_start``: the message with no content yet, and the prompt's usage."""

    type: Literal["message_start"] = "message_start"
    message: AnthropicMessagesResponse


class AnthropicContentBlockStartEvent(AnthropicBaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: AnthropicTextBlock


class AnthropicPingEvent(AnthropicBaseModel):
    type: Literal["ping"] = "ping"


class AnthropicContentBlockStopEvent(AnthropicBaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class AnthropicMessageDelta(AnthropicBaseModel):
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None


class AnthropicMessageDeltaEvent(AnthropicBaseModel):
    """``message_delta``: why the answer stopped, and the final usage."""

    type: Literal["message_delta"] = "message_delta"
    delta: AnthropicMessageDelta
    usage: AnthropicUsage


class AnthropicMessageStopEvent(AnthropicBaseModel):
    type: Literal["message_stop"] = "message_stop"


def anthropic_sse(event: BaseModel) -> str:
    """One SSE event: ``event: <type>``, ``data: <the event's JSON>``, a blank line (an
    ``AnthropicErrorResponse`` is the ``error`` event)."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"  # type: ignore[attr-defined]


class AnthropicTextDeltaWire(msgspec.Struct, tag="text_delta"):
    """``{"type": "text_delta", "text": ...}``."""

    text: str


class AnthropicTextDeltaEventWire(msgspec.Struct, tag="content_block_delta"):
    """``content_block_delta`` with a ``text_delta``: written by msgspec, as it is paid once per
    token of every stream."""

    index: int
    delta: AnthropicTextDeltaWire
