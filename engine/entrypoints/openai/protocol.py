"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Mirrors vLLM's ``vllm/entrypoints/openai/protocol.py``: OpenAI's field names and shapes, so
the official ``openai`` client works unchanged, plus vLLM's sampling extras (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``, ...). Each request model turns
itself into ``SamplingParams`` with ``to_sampling_params``; a bad value then raises the
``ValueError`` of ``SamplingParams``, whose message starts with the field's name.

Sampling fields left unset (``None``) take the model's defaults from
``generation_config.json`` (``AsyncLLM.get_default_sampling_params``), then vLLM's — as
vLLM does. Unknown fields are ignored (vLLM logs them).

Structured outputs, as vLLM takes them: OpenAI's ``response_format`` (``json_object``,
``json_schema``) on chat and completions, vLLM's ``structured_outputs`` (``json``, ``regex``,
``choice``, ``grammar``, ``json_object``) on both, and on chat ``tools`` with ``tool_choice``
``"required"`` or a named function (``structured_outputs.py`` turns each into one
``StructuredOutputsParams``).

Left out: ``tool_choice: "auto"`` (it needs a tool parser), ``response_format`` of type
``structural_tag``, ``logit_bias``, ``suffix`` and ``best_of`` — these are declared only so
that using them is an error rather than silently ignored — beam search, LoRA, multimodal
content, embeddings and the other pooling APIs. The Responses API's bodies are in
``responses/protocol.py``.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

# A seed must fit a signed 64-bit integer (vLLM: ``_LONG_INFO``).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class OpenAIBaseModel(BaseModel):
    # Unknown fields are dropped, as OpenAI's API tolerates fields it does not know.
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------------- errors


class ErrorInfo(OpenAIBaseModel):
    """``{"message", "type", "param", "code"}``: ``param`` names the offending field."""

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    """The body of every error: ``{"error": ErrorInfo}`` (vLLM's ``ErrorResponse``)."""

    error: ErrorInfo


# ---------------------------------------------------------------------------- shared


class PromptTokenUsageInfo(OpenAIBaseModel):
    """``usage.prompt_tokens_details``: ``cached_tokens``, the prompt tokens served from the
    prefix cache (vLLM: ``PromptTokenUsageInfo``)."""

    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    """Token counts of a request: prompt tokens once per prompt, all choices' output tokens.

    ``prompt_tokens_details`` is set only with ``--enable-prompt-tokens-details`` and a
    non-zero count of cached prompt tokens, as in vLLM. Deliberate deviation: where it is
    not set, vLLM's non-streamed body writes ``"prompt_tokens_details": null``; ours leaves
    the key out (as vLLM's streamed usage chunk does).
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = Field(default=None, exclude_if=lambda v: v is None)


class JsonSchemaResponseFormat(OpenAIBaseModel):
    """``response_format.json_schema``: the schema the reply must validate against
    (``schema``; vLLM's ``JsonSchemaResponseFormat``). ``strict`` is accepted: the output is
    always held to the schema."""

    name: str
    description: str | None = None
    # "schema" shadows a BaseModel attribute: the field is json_schema, spelled "schema" in JSON.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ResponseFormat(OpenAIBaseModel):
    """``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "json_schema": {...}}`` (vLLM's ``ResponseFormat``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's ``structured_outputs`` request field: exactly one of ``json`` (a JSON schema),
    ``regex``, ``choice``, ``grammar`` (Lark or GBNF) or ``json_object``, and the JSON
    grammar's options (``engine.sampling_params.StructuredOutputsParams``)."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    # vLLM's, left out: declared so that asking for them is a 400, not silently ignored.
    structural_tag: str | None = None
    disable_fallback: bool | None = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class FunctionDefinition(OpenAIBaseModel):
    """A tool's function: its ``name`` and the JSON schema of its arguments (``parameters``)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    """One entry of ``tools`` (vLLM's ``ChatCompletionToolsParam``)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIBaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIBaseModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call this tool."""

    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


class FunctionCall(OpenAIBaseModel):
    """The call the model made: the tool's name and its arguments, a JSON text."""

    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    """One ``message.tool_calls`` entry (vLLM's ``ToolCall``; ids ``chatcmpl-tool-...``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """A streamed piece of a tool call (its ``index``; the first piece carries id and name)."""

    id: str | None = None
    type: Literal["function"] | None = None
    index: int
    function: DeltaFunctionCall | None = None


class StreamOptions(OpenAIBaseModel):
    """``include_usage``: send a last chunk, with no choices, that carries ``usage``."""

    include_usage: bool | None = False


# The request's sampling fields that ``SamplingParams`` takes as they are, and those that take
# the model's defaults when unset (``None``).
COPIED_FIELDS = (
    "n",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)
DEFAULTED_FIELDS = ("repetition_penalty", "temperature", "top_p", "top_k", "min_p")


class SamplingFields(OpenAIBaseModel):
    """The sampling and stopping fields that completions and chat share."""

    model: str | None = None
    n: int = 1
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Structured outputs (both routes): OpenAI's response_format and vLLM's structured_outputs.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM extras left out: declared so that asking for them is a 400, not silently ignored.
    prompt_logprobs: int | None = None
    chat_template: str | None = None

    # Fields no model declares are kept (not dropped unseen) so the server can log them.
    model_config = ConfigDict(extra="allow")

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        default: SamplingParams,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """``SamplingParams`` for one prompt; unset fields take ``default``'s values.

        Raises:
            ValueError: a value out of range; the message starts with the field name.
        """

        fields = {name: getattr(self, name) for name in COPIED_FIELDS}
        for name in DEFAULTED_FIELDS:
            value = getattr(self, name)
            fields[name] = getattr(default, name) if value is None else value
        # Streams need only what is new (and the output processor holds back text that could
        # still become a stop string); a full response needs only the end.
        output_kind = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        fields.update(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        return SamplingParams(**fields, output_kind=output_kind, structured_outputs=structured_outputs)


# ---------------------------------------------------------------------------- completions


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``.

    ``prompt``: a string, a list of strings, a list of token ids, or a list of token-id
    lists; several prompts give ``len(prompts) * n`` choices, prompt ``i``'s sample ``j``
    at index ``i * n + j``. ``logprobs``: how many top alternatives per token (the sampled
    token's own logprob always comes too). ``echo``: the prompt is prepended to the text
    (and, with ``logprobs``, its tokens' logprobs to the logprobs).
    """

    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_sampling_params(
        self,
        max_tokens: int | None,
        default: SamplingParams,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        prompt_logprobs = self.logprobs if self.echo else None
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, default, structured_outputs)


class CompletionLogProbs(OpenAIBaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token.

    ``top_logprobs[i]`` maps token text → logprob for the top-N alternatives and the
    sampled token; ``text_offset[i]`` is the character offset of token ``i``'s text in the
    choice's whole text (the echoed prompt included) — the same in a stream, where a chunk's
    offsets may run ahead of the text sent so far while a possible stop string is held back.
    A prompt's first token (``echo``) has no logprob: ``None`` in both lists.
    """

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    # vLLM's extra: the stop string or stop token id that ended the choice.
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------- chat


class ChatMessageParam(OpenAIBaseModel):
    """One message of the conversation sent in; ``content`` is a string or a list of
    ``{"type": "text", "text": ...}`` parts (checked by the chat serving code)."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``.

    ``max_completion_tokens`` (OpenAI's current name) wins over ``max_tokens``.
    ``logprobs``: return the sampled tokens' logprobs; ``top_logprobs``: how many
    alternatives with each (needs ``logprobs``).
    """

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    # vLLM's extra: end with the header that opens the assistant's turn.
    add_generation_prompt: bool = True
    # Tool calling: "required" or a named function constrain the reply to the tools' argument
    # schemas; "none" ignores the tools; "auto" (the default with tools) is refused.
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = None

    @property
    def max_tokens_field(self) -> str:
        """The name of the field that set the output limit (for error messages)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def to_sampling_params(
        self,
        max_tokens: int | None,
        default: SamplingParams,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, None, default, structured_outputs)


class ChatMessage(OpenAIBaseModel):
    """The reply. ``tool_calls`` only when the model called tools (then ``content`` is None
    for ``tool_choice: "required"``, the empty string for a named tool, as vLLM sends them)."""

    role: str
    content: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)


class DeltaMessage(OpenAIBaseModel):
    """A chat stream's delta. ``role`` is sent only where it is set (the first chunk of a
    choice), as OpenAI and vLLM (``exclude_unset``) send it, not as ``"role": null``."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_missing_role(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if self.role is None:
            data.pop("role", None)
        if self.tool_calls is None:
            data.pop("tool_calls", None)
        return data


class ChatCompletionLogProb(OpenAIBaseModel):
    """One alternative: its text, logprob and UTF-8 bytes."""

    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    """The sampled token, with its ``top_logprobs`` alternatives (best first)."""

    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------- stream chunks on the wire


class CompletionStreamChoiceWire(msgspec.Struct):
    """One ``CompletionResponseStreamChoice``, as msgspec writes it.

    A stream writes one choice per request per step; msgspec writes it in well under a
    microsecond where building and dumping the pydantic models takes several. The JSON is
    the pydantic model's, byte for byte — same fields, same order, ``logprobs: null`` —
    which ``tests/unit/entrypoints/test_stream_chunks.py`` checks. The envelope around it (id, created,
    model, ``usage: null``) is written once per stream (``serving_engine.StreamChunks``).
    ``logprobs``, when asked for, is the pydantic model, written by pydantic
    (``StreamChunks``' encoder hands pydantic models back to pydantic).
    """

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class DeltaMessageWire(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``DeltaMessage`` as msgspec writes it: ``role`` left out when None (as the pydantic
    model's serializer does), ``content`` always written (``null`` when None)."""

    role: str | None = None
    content: str | None


class ChatStreamChoiceWire(msgspec.Struct):
    """One ``ChatCompletionResponseStreamChoice`` with no logprobs, as msgspec writes it
    (the pydantic model's JSON, byte for byte; see ``CompletionStreamChoiceWire``)."""

    index: int
    delta: DeltaMessageWire
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


# ---------------------------------------------------------------------------- models


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "glassbox"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------------- tokenization


class TokenizeCompletionRequest(OpenAIBaseModel):
    """``POST /tokenize`` with a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIBaseModel):
    """``POST /tokenize`` with a conversation, rendered by the chat template first."""

    model: str | None = None
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    # The template already holds the special tokens it wants.
    add_special_tokens: bool = False
    return_token_strs: bool = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
