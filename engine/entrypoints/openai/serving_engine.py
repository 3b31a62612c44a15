"""What every OpenAI route shares: errors, the model check, prompts, limits, SSE.

Mirrors vLLM's ``vllm/entrypoints/openai/serving_engine.py`` (``OpenAIServing``) and the
helpers around it (``merge_async_iterators`` from ``vllm/utils``). Each route's class
(``OpenAIServingCompletion``, ``OpenAIServingChat``, ...) builds on ``OpenAIServing``.

Errors are raised, not returned: serving code raises ``OpenAIError`` (status, message, the
offending field) and ``app.py`` turns it into ``{"error": {...}}`` with that status — one
place that writes error responses. vLLM returns ``ErrorResponse`` objects instead.

Prompt-length and ``max_tokens`` rules (current vLLM): a prompt must leave room for at least
one output token (``validate_prompt``, the input processor's: ``LLM`` follows the same
rule); ``max_tokens`` unset means "all the room left"; ``max_tokens`` below 1 or above
``max_model_len`` is an error; a ``max_tokens`` that only overflows the room left after the
prompt is clamped to fit (by the input processor). Each route builds its engine requests
with ``InputProcessor.process_inputs`` before a stream answers 200, so every rule is
checked once, and a bad request is a plain 400.

Left out: LoRA, request logging, ``X-Request-Id`` handling, per-request priority from the
body.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncGenerator
from http import HTTPStatus
from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel

from engine.entrypoints.anthropic.protocol import anthropic_error_response
from engine.entrypoints.openai.protocol import (
    ChatMessageParam,
    ErrorInfo,
    ErrorResponse,
    PromptTokenUsageInfo,
    UsageInfo,
)
from engine.frontend.async_llm import AsyncLLM
from engine.frontend.tokenizer import apply_chat_template, encode
from engine.logger import init_logger
from engine.pooling_params import POOLING_FIELDS
from engine.sampling_params import SamplingParams
from engine.utils.processes import EngineDeadError

logger = init_logger(__name__)

T = TypeVar("T")

# A logprob of -inf cannot be written in JSON; vLLM writes this instead.
MIN_LOGPROB = -9999.0
# vLLM's default ``max_logprobs``; the limit applied is the server's --max-logprobs.
MAX_LOGPROBS = 20
# The ``type`` of an error body, by status (the names the ``openai`` client uses).
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# The fields a params error may name first (``SamplingParams``' and ``PoolingParams``' checks).
_PARAMS_FIELDS = frozenset(SamplingParams.__struct_fields__) | frozenset(POOLING_FIELDS)
# Fields declared (so that using them is not silently ignored) but not implemented: the 400
# each gets when given a value (``OpenAIServing.check_unsupported``).
UNSUPPORTED_FIELDS = {
    "logit_bias": "logit_bias is not supported.",
    "suffix": "suffix is not supported.",
    "prompt_logprobs": "prompt_logprobs is not supported by the server (left out); for completions, "
    "echo with logprobs returns the prompt's logprobs.",
    "chat_template": "A per-request chat_template is not supported; start the server with --chat-template.",
}
# Request fields accepted and ignored: not checked (``limits.decode_json``'s Unicode scan).
UNCHECKED_FIELDS = frozenset({"user"})
# Requests under this path get their errors in Anthropic's shape (``error_body``).
ANTHROPIC_PATH = "/v1/messages"
# What a client is told when the engine is dead, streaming or not (503); the root cause
# (pids, stages, exceptions) goes to the server's log only.
ENGINE_DEAD_MESSAGE = "The engine is dead; the server's log shows the root cause."


class OpenAIError(Exception):
    """A request that cannot be served; ``app.py`` answers it with ``error_response``.

    Args:
        message: what is wrong, for the client.
        status_code: 400 (bad request) unless given.
        param: the request field at fault (``"max_tokens"``, ``"messages"``, ...), or None.
    """

    def __init__(
        self, message: str, status_code: int = HTTPStatus.BAD_REQUEST, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = int(status_code)
        self.param = param

    def renamed(self, renames: dict[str, str]) -> OpenAIError:
        """This error with its field renamed through ``renames``: a route that runs through
        another route's flow (``/v1/responses`` and ``/v1/messages`` through chat's) names its
        own request's field (``max_output_tokens`` for chat's ``max_completion_tokens``).

        ``param`` is renamed, and so is the field where the message names it the two ways
        our messages do: first (``SamplingParams``: ``"stop must be ..."``) or quoted
        (``"'max_completion_tokens' is too large"``)."""
        message = self.message
        for old, new in renames.items():
            message = re.sub(rf"^{re.escape(old)}\b", new, message).replace(f"'{old}'", f"'{new}'")
        return OpenAIError(message, self.status_code, renames.get(self.param, self.param))


def error_response(status_code: int, message: str, param: str | None = None) -> ErrorResponse:
    """The OpenAI-shaped error body for ``status_code``.

    A message that quotes the request (an unknown model name, ...) may hold a lone
    surrogate, which JSON cannot be written with as UTF-8: it is escaped (``\\ud800``).
    """
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    err_type = ERROR_TYPES.get(status_code) or HTTPStatus(status_code).phrase.replace(" ", "")
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status_code))


def error_body(path: str, status_code: int, message: str, param: str | None = None) -> BaseModel:
    """The error body of a request to ``path``: Anthropic's shape
    (``{"type": "error", "error": {"type", "message"}}``) under ``/v1/messages``, where the
    ``anthropic`` client reads it; OpenAI's (``error_response``) everywhere else."""
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        return anthropic_error_response(status_code, message)
    return error_response(status_code, message, param)


def bad_request_from_value_error(
    e: ValueError, default_param: str | None, renames: dict[str, str] | None = None
) -> OpenAIError:
    """A ``ValueError`` from ``SamplingParams`` / ``PoolingParams`` or the input processor → a 400.

    Both params classes (``SamplingParams``, ``PoolingParams``) start their messages with the field's
    name; that name (renamed to the
    request's own field through ``renames``) becomes ``param``; so does a constraint's
    ``structured_outputs.<kind>:`` (the input processor's compile check). Other messages (a
    bad prompt) blame ``default_param``.
    """
    message = str(e)
    first_word = message.split(" ", 1)[0]
    if first_word.startswith("structured_outputs.") and first_word.endswith(":"):
        # A constraint that does not compile: "structured_outputs.json: <why>", named after the
        # request field it came from (response_format.json_schema.schema, tools[i]...).
        field = first_word[:-1]
        param = (renames or {}).get(field, field)
        message = f"{param}: {message.split(' ', 1)[1] if ' ' in message else ''}"
        return OpenAIError(message, param=param)
    if first_word in _PARAMS_FIELDS:
        param = (renames or {}).get(first_word, first_word)
    else:
        param = default_param
    return OpenAIError(message, param=param)


def check_finished_without_error(finish_reason: str | None, stop_reason: int | str | None) -> None:
    """A choice the engine ended with ``error`` (a structured-output grammar that failed in
    the engine, or that no token could follow; ``stop_reason`` says which) is a 400: the
    constraint is the request's.

    Raises:
        OpenAIError: (400) naming ``structured_outputs``.
    """
    if finish_reason == "error":
        raise OpenAIError(
            f"The engine could not follow the request's output constraint: {stop_reason}",
            param="structured_outputs",
        )


def random_uuid() -> str:
    return uuid.uuid4().hex


def sse_event(data: BaseModel) -> str:
    """One Server-Sent Event: ``data: <json>`` and a blank line."""
    return f"data: {data.model_dump_json()}\n\n"


def _pydantic_json(model: BaseModel) -> msgspec.Raw:
    """A pydantic model inside a wire struct (a chunk's logprobs), written by pydantic."""
    return msgspec.Raw(model.model_dump_json())


_wire_encoder = msgspec.json.Encoder(enc_hook=_pydantic_json)


class StreamChunks:
    """The SSE events of one stream's chunks, each the envelope with one choice in it.

    Every chunk of a stream carries the same ``id``, ``object``, ``created``, ``model`` and
    ``usage: null``: pydantic writes that envelope once, here, from a stream-response model
    with no choices; ``event`` splices one choice, written by msgspec from a wire struct
    (``protocol.CompletionStreamChoiceWire``, ``protocol.ChatStreamChoiceWire``), into its
    ``"choices":[]``. The event is ``sse_event`` of the full pydantic model, byte for byte,
    for about a tenth of the CPU time — it is paid once per token of every stream.

    Args:
        envelope: the stream's response model (``CompletionStreamResponse`` or
            ``ChatCompletionStreamResponse``) with ``choices=[]``.
    """

    def __init__(self, envelope: BaseModel) -> None:
        body = envelope.model_dump_json()
        # The last '"choices":[]' is the field itself: inside a JSON string a quote is escaped.
        cut = body.rindex('"choices":[]') + len('"choices":[')
        self._head = f"data: {body[:cut]}"
        self._tail = f"{body[cut:]}\n\n"

    def event(self, choice: msgspec.Struct) -> str:
        """``data: <the envelope with choices=[choice]>`` and a blank line."""
        return self._head + _wire_encoder.encode(choice).decode() + self._tail


SSE_DONE = "data: [DONE]\n\n"


def stream_error(error: BaseException, request_id: str, blamed: str | None) -> ErrorResponse:
    """The error body that ends a stream on ``error``, with the status a plain request would
    get: a ``ValueError`` (our convention for bad input) is a 400 blaming ``blamed`` unless it
    names a field, an ``OpenAIError`` its own status, anything else a 500, logged.

    A dead engine is a 503 with the short ``ENGINE_DEAD_MESSAGE``; its root cause (process,
    pid, stage, exception) goes to the log instead: one line, once per engine death however
    many streams it ends (the full block is printed once, last, by the server when it stops).
    """
    if isinstance(error, ValueError):
        error = bad_request_from_value_error(error, blamed)
    if isinstance(error, OpenAIError):
        return error_response(error.status_code, error.message, error.param)
    if isinstance(error, EngineDeadError):
        if not getattr(error, "_logged_for_streams", False):
            cause = getattr(error, "root_cause", None) or str(error)
            summary = "; ".join(
                " ".join(line.split()) for line in cause.splitlines() if line.strip() and line[0] != "="
            )
            logger.error("The engine died while streaming %s (and maybe others): %s", request_id, summary)
            try:
                error._logged_for_streams = True  # type: ignore[attr-defined]
            except AttributeError:
                pass
        return error_response(503, ENGINE_DEAD_MESSAGE)
    logger.error("stream %s failed", request_id, exc_info=error)
    return error_response(500, internal_error_message(error))


def stream_error_event(error: Exception, request_id: str, blamed: str) -> str:
    """The SSE error event (``data: {"error": ...}``) that ends a completions or chat stream on
    ``error`` (then comes ``data: [DONE]``); the body is ``stream_error``'s."""
    return sse_event(stream_error(error, request_id, blamed))


def internal_error_message(error: BaseException) -> str:
    """What a client is told of an unexpected error (500): its type, not its text (which may
    quote internals); the server logs the whole traceback."""
    return f"Internal server error ({type(error).__name__}); the server's log has the details."


def max_chars_per_token(tokenizer: Any) -> int | None:
    """An upper bound on the characters of text one token can stand for, or None when the
    tokenizer gives no such bound.

    With one, a text longer than ``max_model_len * bound`` characters cannot fit the context,
    whatever it says, and is refused before it is tokenized. Only byte-level BPE without a
    normalizer is trusted: every character becomes at least one byte token, and a vocabulary
    entry's length counts its bytes (≥ its characters). Tokenizers that may drop text (a
    whitespace pre-tokenizer, a normalizer that strips accents, unknown words fused into one
    ``<unk>``) give no bound.
    """
    try:
        backend = tokenizer.backend_tokenizer
        model = backend.model
    except AttributeError:
        return None
    if backend.normalizer is not None or type(model).__name__ != "BPE":
        return None
    if type(backend.pre_tokenizer).__name__ != "ByteLevel":
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    return max((len(token) for token in vocab), default=0) or None


class OpenAIServing:
    """The base of the route handlers: the engine, the served name and shared checks.

    Args:
        engine: the engine client; its tokenizer and ``model_config`` are used directly.
        served_model_name: the only name ``model`` may carry in a request.
        enable_prompt_tokens_details: ``--enable-prompt-tokens-details``: a response's usage
            says how many prompt tokens came from the prefix cache (``make_usage``).
    """

    def __init__(
        self, engine: AsyncLLM, served_model_name: str, enable_prompt_tokens_details: bool = False
    ) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.model_config.max_model_len
        self.vocab_size: int = engine.model_config.vocab_size
        self.default_sampling_params: SamplingParams | None = None
        self.default_max_tokens: int | None = None
        if engine.model_config.runner_type == "generate":  # a pooling model samples nothing
            self.default_sampling_params = engine.get_default_sampling_params()
            # The model's max_new_tokens (--generation-config): it caps max_tokens as in vLLM's
            # get_max_tokens.
            self.default_max_tokens = engine.model_config.get_diff_sampling_param().get("max_tokens")
        self.max_chars_per_token = max_chars_per_token(self.tokenizer)

    def make_usage(self, prompt_tokens: int, completion_tokens: int, num_cached_tokens: int) -> UsageInfo:
        """A response's ``usage``; with ``--enable-prompt-tokens-details`` and a prefix-cache
        hit, ``prompt_tokens_details.cached_tokens`` (vLLM sets it only when non-zero)."""
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens)  # fmt: skip
        if self.enable_prompt_tokens_details and num_cached_tokens:
            usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=num_cached_tokens)
        return usage

    # ------------------------------------------------------------------ checks

    def check_model(self, model: str | None) -> None:
        """Raises ``OpenAIError`` (404) unless ``model`` is None or the served name."""
        if model is not None and model != self.served_model_name:
            raise OpenAIError(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, param="model")

    def check_engine_alive(self) -> None:
        """Raises ``EngineDeadError`` (503) before any work starts — also before a stream
        would answer 200 — when the engine is known to be dead."""
        if self.engine.dead_error is not None:
            raise self.engine.dead_error

    def check_text_fits(self, text: str, param: str) -> None:
        """Refuse, before tokenizing it, a text too long to fit ``max_model_len`` whatever it
        says (more than ``max_model_len * max_chars_per_token`` characters); a no-op when
        the tokenizer gives no bound (``max_chars_per_token``).

        Raises:
            OpenAIError: (400, ``param``) with vLLM's "maximum context length" wording.
        """
        bound = self.max_chars_per_token
        if bound is None or len(text) <= self.max_model_len * bound:
            return
        at_least = -(-len(text) // bound)
        pooling = self.engine.model_config.runner_type == "pooling"  # no output token follows
        raise OpenAIError(
            f"This model's maximum context length is {self.max_model_len} tokens. However, your "
            f"request has at least {at_least} input tokens ({len(text)} characters)"
            f"{'' if pooling else ', which leaves no room for output'}. Please reduce the length of "
            f"the input {param}.",
            param=param,
        )

    def resolve_max_tokens(self, requested: int | None, param: str = "max_tokens") -> int | None:
        """The request's output limit before its prompt is known: ``requested``, capped by
        the model's ``max_new_tokens`` (``--generation-config``) when it sets one; None when
        neither is set. The input processor then fills in all the room left after the
        prompt, or clamps the limit to it (vLLM's ``get_max_tokens``).

        A ``requested`` below 1 is left to ``SamplingParams`` to refuse (its ``max_tokens``
        rule, ``LLM``'s too).

        Raises:
            OpenAIError: ``requested`` > ``max_model_len``.
        """
        if requested is not None and requested > self.max_model_len:
            raise OpenAIError(
                f"'{param}' is too large: {requested}. This model's maximum context length is "
                f"{self.max_model_len} tokens.",
                param=param,
            )
        return min((v for v in (requested, self.default_max_tokens) if v is not None), default=None)

    @staticmethod
    def check_unsupported(request: Any) -> None:
        """Fields we accept in the schema but do not implement are errors when given a value
        (``UNSUPPORTED_FIELDS``; an empty ``logit_bias`` or ``suffix`` asks for nothing).
        Unknown fields are tolerated, as vLLM does (OpenAI's clients send new ones), and
        logged."""
        for field, message in UNSUPPORTED_FIELDS.items():
            if getattr(request, field, None) not in (None, {}, ""):
                raise OpenAIError(message, param=field)
        best_of = getattr(request, "best_of", None)
        if best_of is not None and best_of != request.n:
            raise OpenAIError(
                "best_of is not supported (beam search and best-of are left out).", param="best_of"
            )
        if request.stream_options is not None and not request.stream:
            raise OpenAIError("stream_options can only be given when stream is true.", param="stream_options")
        OpenAIServing.log_unknown_fields(request)

    @staticmethod
    def log_unknown_fields(request: BaseModel) -> None:
        """Log the fields of ``request`` that no model declares (they are ignored, as vLLM does)."""
        if request.model_extra:
            ignored = ", ".join(sorted(request.model_extra))
            logger.warning("The request's field(s) %s are not known and were ignored", ignored)

    # ------------------------------------------------------------------ prompts

    def render_prompts(
        self,
        prompt: str | list[str] | list[int] | list[list[int]],
        param: str,
        add_special_tokens: bool = True,
    ) -> list[tuple[str | None, list[int]]]:
        """A request's prompt field (completions' ``prompt``, embeddings' ``input``) → one
        (text or None, token ids) per prompt: a string, a list of strings, a list of token ids
        or a list of token-id lists. CPU-heavy: callers run it in a worker thread.

        Raises:
            OpenAIError: a text too long to fit the context whatever it says, refused before
                it is tokenized (``check_text_fits``, blaming ``param``).
        """
        if isinstance(prompt, str):
            prompt = [prompt]
        elif not prompt or isinstance(prompt[0], int):
            return [(None, list(prompt))]
        rendered: list[tuple[str | None, list[int]]] = []
        for p in prompt:
            if isinstance(p, str):
                self.check_text_fits(p, param)
                rendered.append((p, encode(self.tokenizer, p, add_special_tokens=add_special_tokens)))
            else:
                rendered.append((None, list(p)))
        return rendered

    def render_chat(
        self, messages: list[ChatMessageParam], add_generation_prompt: bool = True, check_length: bool = False
    ) -> tuple[str, list[int]]:
        """A conversation → (prompt text, prompt token ids), through the chat template.

        Content given as parts keeps the text parts, joined by newlines (vLLM's "string"
        content format). The rendered text already holds the template's special tokens, so
        it is tokenized without adding more. ``check_length``: refuse a rendered text too
        long to fit before tokenizing it (``check_text_fits``). CPU-heavy: callers run it in
        a worker thread.

        Raises:
            OpenAIError: a part that is not text, a template that refuses the messages,
                or (``check_length``) a conversation too long (``param`` is ``"messages"``).
                Text that is not valid Unicode never gets here: the body's parser
                (``limits.decode_json``) refuses it.
        """
        conversation: list[dict[str, Any]] = []
        for message in messages:
            content = message.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise OpenAIError(
                            'Only text content parts ({"type": "text", "text": ...}) are supported, '
                            f"got type {part.get('type')!r}.",
                            param="messages",
                        )
                    texts.append(part["text"])
                content = "\n".join(texts)
            entry: dict[str, Any] = {"role": message.role, "content": content}
            if message.name is not None:
                entry["name"] = message.name
            conversation.append(entry)
        try:
            text = apply_chat_template(
                self.tokenizer, conversation, add_generation_prompt=add_generation_prompt
            )
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from None
        if check_length:
            self.check_text_fits(text, "messages")
        try:
            return text, encode(self.tokenizer, text, add_special_tokens=False)
        except ValueError as e:  # only text from the messages can make the rendered text invalid
            raise OpenAIError(str(e), param="messages") from None

    # ------------------------------------------------------------------ helpers

    def token_text(self, token_id: int, decoded: str | None) -> str:
        """A token as text: the engine's decoding when it has one, else decoded here."""
        if decoded is not None:
            return decoded
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def merge_async_iterators(*iterators: AsyncGenerator[T, None]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several async generators as they come, each tagged with its generator's index.

    Closing (or cancelling) the merged iterator closes every generator — for
    ``AsyncLLM.generate`` that aborts the request in the engine. An exception from any
    generator ends the merge with that exception (the others are closed). One generator (the
    common case) is only tagged, without tasks: closing the merge closes it directly.
    """
    if len(iterators) == 1:
        return _tagged(iterators[0])
    return _merged_concurrently(iterators)


async def _tagged(iterator: AsyncGenerator[T, None]) -> AsyncGenerator[tuple[int, T], None]:
    async with contextlib.aclosing(iterator) as it:
        async for item in it:
            yield 0, item


async def _merged_concurrently(
    iterators: tuple[AsyncGenerator[T, None], ...],
) -> AsyncGenerator[tuple[int, T], None]:
    """``merge_async_iterators`` of several: one task drains each into a shared queue."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def drain(index: int, iterator: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(iterator) as it:
                async for item in it:
                    queue.put_nowait((index, item))
        except Exception as e:  # handed to the consumer, which re-raises it
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, done))

    tasks = [asyncio.create_task(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        # Let each generator's ``finally`` (the engine abort) run before we return.
        await asyncio.gather(*tasks, return_exceptions=True)
