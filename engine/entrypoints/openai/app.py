"""``build_app``: the FastAPI application of the API server — routes, middleware, errors.

Mirrors the app half of vLLM's ``vllm/entrypoints/openai/api_server.py`` (``build_app``,
``init_app_state``, the route functions, ``with_cancellation`` from
``vllm/entrypoints/utils.py``, ``AuthenticationMiddleware``) and the Prometheus gauges of
``vllm/v1/metrics/loggers.py``. ``api_server.py`` builds the engine, then this app, then
serves it.

Routes, on every server: ``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``,
``GET /health``, ``GET|POST /ping``, ``GET /version``, ``GET /metrics``. Then the routes of the
model's runner, as vLLM registers a router per supported task: with ``--runner generate``
``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses``,
``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` (``responses/``),
``POST /v1/messages``, ``POST /v1/messages/count_tokens`` (``engine/entrypoints/anthropic/``);
with ``--runner pooling`` ``POST /v1/embeddings`` and ``POST /pooling``
(``engine/entrypoints/pooling/``). A route of the other runner is a 404 that names the runner
serving it (vLLM's is a bare "Not Found"). The route table, with vLLM's counterparts and what
each leaves out, is in ``docs/architecture.md``.

Errors: every error body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``, but
under ``/v1/messages``, where it is Anthropic's ``{"type": "error", "error": {"type",
"message"}}`` (``serving_engine.error_body``: the API-key check and the body limit too).
Invalid requests — malformed JSON and schema violations included — are 400 (FastAPI's
default would be 422); an unknown model 404; a missing or wrong API key 401 (vLLM answers
``{"error": "Unauthorized"}`` there; we keep one shape); a body over
``--max-request-body-bytes`` 413; a dead engine 503; anything unexpected 500, logged.

Bodies: every route that takes one parses it with ``limits.parse_json_body`` (one parser:
JSON only, bounded depth, no ``NaN``; any body it cannot decode is a 400), large bodies in a
worker thread; the OpenAPI document still lists each body's schema (``_request_body``).
Tokenizing, the chat template, detokenizing and encoding full answers run in worker
threads too, so one large request never stalls the streams of others.

Middleware, outermost first: the in-flight counter (``http_telemetry``, glass), the API-key
check (only with an ``api_key``; ``/v1/*`` as vLLM, or every path but ``/health`` and
``/ping`` with ``api_key_scope="all"``), CORS (only when ``allowed_origins`` is not empty — unlike vLLM,
whose default ``["*"]`` lets a page from any origin use the server), then the body limit
(``limits.RequestBodyLimit``).

Client disconnects: a streamed response is an async generator; when the client goes away
Starlette cancels it and ``ClosingStreamingResponse`` closes it, so ``AsyncLLM.generate``'s
``finally`` aborts the request. A full response is computed in a task raced against the
client's disconnect, and cancelled when the client leaves first (vLLM's
``with_cancellation``).

Metrics (``engine/metrics/``, ``docs/metrics.md``): ``build_app`` makes a
``StatLoggerManager`` and hooks it to the engine's output processor, which hands it each batch's
``IterationStats`` (token counters, TTFT, inter-token latency, per-request latency histograms,
labelled with the engine that served the request). ``/metrics`` renders those (summed over
every API server in multiprocess mode), the scheduler gauges from the client's
``EngineStatsTable`` (one ``engine="<DP rank>"`` series per engine) and the span exporters'
health. A scrape asks the engine nothing.

Left out: ``/load``, score/rerank/classify, audio, LoRA and dev routes, ``X-Request-Id``
middleware.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from http import HTTPStatus
from typing import Any

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from engine import __version__
from engine.entrypoints.anthropic.protocol import (
    AnthropicCountTokensRequest,
    AnthropicCountTokensResponse,
    AnthropicErrorResponse,
    AnthropicMessagesRequest,
    AnthropicMessagesResponse,
)
from engine.entrypoints.anthropic.serving import AnthropicServingMessages
from engine.entrypoints.openai.http_telemetry import InFlightCounter
from engine.entrypoints.openai.limits import DEFAULT_MAX_REQUEST_BODY_BYTES, RequestBodyLimit, parse_json_body
from engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from engine.entrypoints.openai.responses.protocol import ResponsesRequest, ResponsesResponse
from engine.entrypoints.openai.responses.serving import OpenAIServingResponses
from engine.entrypoints.openai.serving_chat import OpenAIServingChat
from engine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from engine.entrypoints.openai.serving_engine import (
    ENGINE_DEAD_MESSAGE,
    OpenAIError,
    bad_request_from_value_error,
    error_body,
    internal_error_message,
)
from engine.entrypoints.openai.serving_models import OpenAIServingModels
from engine.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from engine.entrypoints.pooling.protocol import (
    EmbeddingCompletionRequest,
    EmbeddingResponse,
    PoolingCompletionRequest,
    PoolingResponse,
)
from engine.entrypoints.pooling.serving import ServingEmbedding, ServingPooling
from engine.frontend.async_llm import AsyncLLM
from engine.logger import get_process_role, init_logger
from engine.metrics.loggers import StatLoggerManager, attach
from engine.utils.processes import EngineDeadError

logger = init_logger(__name__)

# With --api-key-scope v1 (the default, vLLM's) only paths under this prefix need the key.
GUARDED_PREFIX = "/v1"
# With --api-key-scope all every path needs the key but these (liveness probes).
UNGUARDED_PATHS = frozenset({"/health", "/ping"})
API_KEY_SCOPES = ("v1", "all")
# Status for a request whose client left before the answer (nginx's "client closed request").
CLIENT_CLOSED_REQUEST = 499

# The routes every server has, and those of each runner (``--runner``).
router = APIRouter()
generate_router = APIRouter()
pooling_router = APIRouter()
RUNNER_ROUTERS = {"generate": generate_router, "pooling": pooling_router}


def build_app(
    engine: AsyncLLM,
    *,
    served_model_name: str,
    api_key: str | None = None,
    allowed_origins: list[str] | None = None,
    several_servers: bool = False,
    log_stats: bool = True,
    api_key_scope: str = "v1",
    allowed_methods: list[str] | None = None,
    allowed_headers: list[str] | None = None,
    allow_credentials: bool = False,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    enable_prompt_tokens_details: bool = False,
    responses_store_size: int = 0,
) -> FastAPI:
    """The FastAPI app that serves ``engine`` under ``served_model_name``.

    Args:
        engine: a started ``AsyncLLM``; the app never shuts it down.
        served_model_name: the model id clients see in ``/v1/models`` and must send.
        api_key: when given, the paths of ``api_key_scope`` require
            ``Authorization: Bearer <api_key>``.
        allowed_origins: CORS origins (``--allowed-origins``); None or ``[]``: none, so a
            page from another origin cannot read any answer (vLLM's default is ``["*"]``).
        several_servers: one of several API servers (``--api-server-count`` > 1): the stats
            log line names this server and its share of the throughput.
        log_stats: keep the periodic stats log line (``app.state.stat_loggers.log()``).
        api_key_scope: ``"v1"`` (vLLM's: only ``/v1/*``) or ``"all"`` (every path but
            ``/health`` and ``/ping``) (``--api-key-scope``).
        allowed_methods, allowed_headers, allow_credentials: the rest of the CORS policy
            (vLLM's ``--allowed-methods``, ``--allowed-headers``, ``--allow-credentials``);
            None means ``["*"]``; used only when some origin is allowed.
        max_request_body_bytes: bodies larger than this get a 413 before they are read
            whole (``--max-request-body-bytes``); 0 means no limit.
        enable_prompt_tokens_details: completions' and chats' usage carries
            ``prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``).
        responses_store_size: how many responses ``/v1/responses`` keeps for retrieval and
            ``previous_response_id`` (``GLASSBOX_RESPONSES_API_STORE_SIZE``); 0: none.

    Raises:
        ValueError: an ``api_key_scope`` that is not one of ``API_KEY_SCOPES``.
    """
    if api_key_scope not in API_KEY_SCOPES:
        raise ValueError(f"api_key_scope must be one of {API_KEY_SCOPES}, got {api_key_scope!r}")
    app = FastAPI(title="Glassbox OpenAI-compatible API", version=__version__)
    runner_type = engine.model_config.runner_type
    app.include_router(router)
    app.include_router(RUNNER_ROUTERS[runner_type])
    app.openapi = partial(_openapi, app, _BODY_MODELS[runner_type])
    state = app.state
    state.engine = engine
    state.runner_type = runner_type
    state.serving_models = OpenAIServingModels(engine, served_model_name)
    if runner_type == "generate":
        state.serving_completion = OpenAIServingCompletion(
            engine, served_model_name, enable_prompt_tokens_details
        )
        state.serving_chat = OpenAIServingChat(engine, served_model_name, enable_prompt_tokens_details)
        state.serving_responses = OpenAIServingResponses(
            engine, served_model_name, enable_prompt_tokens_details, responses_store_size
        )
        state.serving_messages = AnthropicServingMessages(
            engine, served_model_name, enable_prompt_tokens_details
        )
    else:
        state.serving_embedding = ServingEmbedding(engine, served_model_name, enable_prompt_tokens_details)
        state.serving_pooling = ServingPooling(engine, served_model_name, enable_prompt_tokens_details)
    state.serving_tokenization = OpenAIServingTokenization(engine, served_model_name)
    state.stat_loggers = StatLoggerManager(
        served_model_name,
        engine.stats_table,
        engine.model_config.max_model_len,
        role=get_process_role() or "APIServer_0",
        several_servers=several_servers,
        log_stats=log_stats,
    )
    attach(engine, state.stat_loggers, served_model_name)

    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(OpenAIError, _openai_error_handler)
    app.add_exception_handler(EngineDeadError, _engine_dead_handler)
    app.add_exception_handler(ValueError, _value_error_handler)
    app.add_exception_handler(Exception, _unexpected_error_handler)

    # Starlette wraps each middleware added around the ones before: the key check, added
    # last, runs first (as in vLLM), so no body is read for a client without the key; the
    # body limit runs inside CORS, so a page that may read answers can read its 413.
    app.add_middleware(RequestBodyLimit, max_bytes=max_request_body_bytes)
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_credentials=allow_credentials,
            allow_methods=["*"] if allowed_methods is None else list(allowed_methods),
            allow_headers=["*"] if allowed_headers is None else list(allowed_headers),
        )
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, scope=api_key_scope)
    # Outermost: counts every HTTP request until its response is sent (live telemetry).
    state.http_in_flight = InFlightCounter.Count()
    app.add_middleware(InFlightCounter, count=state.http_in_flight)
    return app


# ---------------------------------------------------------------------------- routes


def _openapi(app: FastAPI, body_models: tuple[type[BaseModel], ...]) -> dict[str, Any]:
    """FastAPI's OpenAPI document, plus the schemas of the request bodies the routes parse
    themselves (``_request_body``): ``body_models``, those of the routes this app serves."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)
        _, defs = models_json_schema(
            [(model, "validation") for model in body_models], ref_template=_SCHEMA_REFS + "{model}"
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, definition in defs.get("$defs", {}).items():
            components.setdefault(name, definition)
    return app.openapi_schema


_SCHEMA_REFS = "#/components/schemas/"
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 503)
}
_ANTHROPIC_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": AnthropicErrorResponse} for code in (400, 401, 404, 413, 503)
}
_SSE = {"text/event-stream": {"schema": {"type": "string"}}}


def _request_body(*models: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` declaring a JSON request body of one of ``models`` (the routes
    parse bodies themselves, so FastAPI would not list them)."""
    refs = [{"$ref": f"{_SCHEMA_REFS}{m.__name__}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# The request models named by ``_request_body``, by runner: added to the OpenAPI document's components.
_COMMON_BODY_MODELS = (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest)
_BODY_MODELS = {
    "generate": (CompletionRequest, ChatCompletionRequest, *_COMMON_BODY_MODELS, ResponsesRequest,
                 AnthropicMessagesRequest, AnthropicCountTokensRequest),
    "pooling": (EmbeddingCompletionRequest, PoolingCompletionRequest, *_COMMON_BODY_MODELS),
}  # fmt: skip


@router.get("/health", operation_id="health")
@router.head("/health", operation_id="health_head")
async def health(raw_request: Request) -> Response:
    """200 (empty) while the engine is alive and every process of the tree runs; 503 with an
    OpenAI-shaped error (``ServiceUnavailableError``) once the engine is dead, or as soon as a
    process of the tree is stopped by a signal, frozen or dead — its message names the
    process (role, pid) and why. Every API server answers so (they read the same run
    directory). A stopped process continued in time (SIGCONT) makes it 200 again."""
    engine = raw_request.app.state.engine
    try:
        await engine.check_health()
    except EngineDeadError as e:
        return _error(503, f"the engine is dead: {e}")
    problems = engine.tree_problems()
    if problems:
        return _error(503, "; ".join(problems))
    return Response(status_code=200)


@router.get("/ping", operation_id="ping")
@router.post("/ping", operation_id="ping_post")
async def ping(raw_request: Request) -> Response:
    """Same as ``/health`` (SageMaker's name for it)."""
    return await health(raw_request)


@router.get("/version", operation_id="version")
async def show_version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.get("/v1/models", operation_id="list_models", response_model=ModelList, responses=_ERRORS)
async def show_available_models(raw_request: Request) -> Response:
    return _json(raw_request.app.state.serving_models.show_available_models())


@router.get("/v1/models/{model_id:path}", operation_id="retrieve_model", response_model=ModelCard,
            responses=_ERRORS)  # fmt: skip
async def retrieve_model(model_id: str, raw_request: Request) -> Response:
    """One model card (``client.models.retrieve``); 404 for any other name."""
    models = raw_request.app.state.serving_models.show_available_models()
    for card in models.data:
        if card.id == model_id:
            return _json(card)
    raise OpenAIError(f"The model `{model_id}` does not exist.", HTTPStatus.NOT_FOUND, param="model")


@generate_router.post("/v1/completions", operation_id="create_completion", openapi_extra=_request_body(CompletionRequest),
             responses={200: {"model": CompletionResponse, "content": _SSE}, **_ERRORS})  # fmt: skip
async def create_completion(raw_request: Request) -> Response:
    request = await parse_json_body(raw_request, partial(_validate, CompletionRequest))
    handler: OpenAIServingCompletion = raw_request.app.state.serving_completion
    return await _respond(raw_request, handler.create_completion(request, dict(raw_request.headers)))


@generate_router.post("/v1/chat/completions", operation_id="create_chat_completion",
             openapi_extra=_request_body(ChatCompletionRequest),
             responses={200: {"model": ChatCompletionResponse, "content": _SSE}, **_ERRORS})  # fmt: skip
async def create_chat_completion(raw_request: Request) -> Response:
    request = await parse_json_body(raw_request, partial(_validate, ChatCompletionRequest))
    handler: OpenAIServingChat = raw_request.app.state.serving_chat
    return await _respond(raw_request, handler.create_chat_completion(request, dict(raw_request.headers)))


@generate_router.post("/v1/responses", operation_id="create_response", openapi_extra=_request_body(ResponsesRequest),
             responses={200: {"model": ResponsesResponse, "content": _SSE}, **_ERRORS})  # fmt: skip
async def create_responses(raw_request: Request) -> Response:
    """OpenAI's Responses API, text only (``responses/serving.py``)."""
    request = await parse_json_body(raw_request, partial(_validate, ResponsesRequest))
    handler: OpenAIServingResponses = raw_request.app.state.serving_responses
    return await _respond(raw_request, handler.create_responses(request, dict(raw_request.headers)))


@generate_router.get("/v1/responses/{response_id}", operation_id="retrieve_response", response_model=ResponsesResponse,
            responses=_ERRORS)  # fmt: skip
async def retrieve_responses(response_id: str, raw_request: Request, stream: bool = False) -> Response:
    """A stored response as it stands; 404 once the store no longer holds it. ``stream=true``
    (vLLM replays a background run's events) is left out: a 400."""
    if stream:
        raise OpenAIError("Streaming a stored response is not supported (left out).", param="stream")
    return _json(raw_request.app.state.serving_responses.retrieve_responses(response_id))


@generate_router.post("/v1/responses/{response_id}/cancel", operation_id="cancel_response", response_model=ResponsesResponse,
             responses=_ERRORS)  # fmt: skip
async def cancel_responses(response_id: str, raw_request: Request) -> Response:
    """Stop a background response still queued or in progress (400 for any other)."""
    return _json(await raw_request.app.state.serving_responses.cancel_responses(response_id))


@generate_router.post("/v1/messages", operation_id="create_message", openapi_extra=_request_body(AnthropicMessagesRequest),
             responses={200: {"model": AnthropicMessagesResponse, "content": _SSE}, **_ANTHROPIC_ERRORS})  # fmt: skip
async def create_messages(raw_request: Request) -> Response:
    """Anthropic's Messages API, text only (``engine/entrypoints/anthropic/serving.py``)."""
    request = await parse_json_body(raw_request, partial(_validate, AnthropicMessagesRequest))
    handler: AnthropicServingMessages = raw_request.app.state.serving_messages
    return await _respond(raw_request, handler.create_messages(request, dict(raw_request.headers)))


@generate_router.post("/v1/messages/count_tokens", operation_id="count_message_tokens",
             openapi_extra=_request_body(AnthropicCountTokensRequest),
             responses={200: {"model": AnthropicCountTokensResponse}, **_ANTHROPIC_ERRORS})  # fmt: skip
async def count_message_tokens(raw_request: Request) -> Response:
    """The prompt tokens a ``/v1/messages`` request would have (the chat template rendered
    and tokenized in a worker thread)."""
    request = await parse_json_body(raw_request, partial(_validate, AnthropicCountTokensRequest))
    handler: AnthropicServingMessages = raw_request.app.state.serving_messages
    return await _respond(raw_request, handler.count_tokens(request))


@pooling_router.post("/v1/embeddings", operation_id="create_embedding",
                     openapi_extra=_request_body(EmbeddingCompletionRequest),
                     responses={200: {"model": EmbeddingResponse}, **_ERRORS})  # fmt: skip
async def create_embedding(raw_request: Request) -> Response:
    """OpenAI's embeddings API on a ``--runner pooling`` server (``engine/entrypoints/pooling/``)."""
    request = await parse_json_body(raw_request, partial(_validate_pooling, EmbeddingCompletionRequest))
    handler: ServingEmbedding = raw_request.app.state.serving_embedding
    return await _respond(raw_request, handler.create_embedding(request, dict(raw_request.headers)))


@pooling_router.post("/pooling", operation_id="create_pooling", openapi_extra=_request_body(PoolingCompletionRequest),
                     responses={200: {"model": PoolingResponse}, **_ERRORS})  # fmt: skip
async def create_pooling(raw_request: Request) -> Response:
    """vLLM's ``/pooling``: each prompt's pooled vector (the raw hidden state with
    ``use_activation: false``)."""
    request = await parse_json_body(raw_request, partial(_validate_pooling, PoolingCompletionRequest))
    handler: ServingPooling = raw_request.app.state.serving_pooling
    return await _respond(raw_request, handler.create_pooling(request, dict(raw_request.headers)))


def _validate_pooling(model: type[BaseModel], body: Any) -> Any:
    """A pooling route's body: chat-style ``messages`` are left out (a 400 naming them, before
    the schema would only say ``input`` is missing)."""
    if isinstance(body, dict) and "messages" in body and "input" not in body:
        raise OpenAIError("Chat-style pooling requests (messages) are not supported (left out): send input.",
                          param="messages")  # fmt: skip
    return _validate(model, body)


def _tokenize_request(body: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    chat = isinstance(body, dict) and "messages" in body
    return _validate(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)


@router.post("/tokenize", operation_id="tokenize",
             openapi_extra=_request_body(TokenizeCompletionRequest, TokenizeChatRequest),
             responses={200: {"model": TokenizeResponse}, **_ERRORS})  # fmt: skip
async def tokenize(raw_request: Request) -> Response:
    """``{"prompt": str}`` or ``{"messages": [...]}`` → ``{"count", "max_model_len", "tokens"}``.

    Parsing, the chat template, tokenizing and writing the answer run in a worker thread."""
    request = await parse_json_body(raw_request, _tokenize_request)
    return await _json_in_thread(raw_request.app.state.serving_tokenization.create_tokenize, request)


@router.post("/detokenize", operation_id="detokenize", openapi_extra=_request_body(DetokenizeRequest),
             responses={200: {"model": DetokenizeResponse}, **_ERRORS})  # fmt: skip
async def detokenize(raw_request: Request) -> Response:
    """``{"tokens": [...]}`` → ``{"prompt": str}``, in a worker thread."""
    request = await parse_json_body(raw_request, partial(_validate, DetokenizeRequest))
    return await _json_in_thread(raw_request.app.state.serving_tokenization.create_detokenize, request)


@router.get("/metrics", operation_id="metrics", response_class=PlainTextResponse)
async def metrics(raw_request: Request) -> Response:
    """Prometheus text: request metrics recorded as outputs arrived, and the latest stats each
    engine sent with its outputs (no call to the engine: a dead or busy engine shows its last
    figures)."""
    body, content_type = raw_request.app.state.stat_loggers.render()
    return Response(body, media_type=content_type)


# ---------------------------------------------------------------------------- responses


class ClosingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that always closes its body iterator, whatever ended it.

    Starlette stops iterating when the client disconnects but leaves the generator open
    (a plain ``async for`` does not close it); an open ``AsyncLLM.generate`` would keep the
    request running in the engine. Closing is shielded from the cancellation that ended the
    stream, so the generator's ``finally`` (the abort) can finish.
    """

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def _json(model: BaseModel, status_code: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")


async def _json_in_thread(work: Callable[[Any], BaseModel], request: Any) -> Response:
    """``work(request)`` and its JSON encoding, both in a worker thread (off the event loop)."""

    def run() -> str:
        return work(request).model_dump_json()

    return Response(await asyncio.to_thread(run), media_type="application/json")


def _error(status_code: int, message: str, param: str | None = None, path: str = "") -> Response:
    """An error response for a request to ``path``, in the shape its clients read
    (``serving_engine.error_body``)."""
    return _json(error_body(path, status_code, message, param), status_code)


async def _respond(raw_request: Request, work: Awaitable[BaseModel | AsyncIterator[str]]) -> Response:
    """Run a serving coroutine unless the client leaves first; shape what it returns.

    A model becomes a JSON response, an async iterator an SSE stream. A client that
    disconnects before a full response is ready cancels the work (and so aborts the
    engine requests).
    """
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
            # The cancellation runs the engine aborts; wait for them.
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled() or task.exception() is not None:
        return await _respond_failed(raw_request, task)
    result = task.result()
    if isinstance(result, BaseModel):
        # A large answer (echo, logprobs, many choices) takes a while to encode: off the loop.
        return Response(await asyncio.to_thread(result.model_dump_json), media_type="application/json")
    return ClosingStreamingResponse(result, media_type="text/event-stream")


async def _respond_failed(raw_request: Request, task: asyncio.Future) -> Response:
    """``_respond``'s work that did not return: the client left (499), or it raised."""
    if task.cancelled():
        logger.info("client disconnected from %s; request aborted", raw_request.url.path)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    try:
        task.result()  # raises the work's exception
    except (OpenAIError, EngineDeadError):
        raise  # answered by their handlers below
    except ValueError as e:  # our convention for bad input (a prompt that cannot be encoded, ...)
        blamed = _BLAMED_FIELD.get(raw_request.url.path, "prompt")
        raise bad_request_from_value_error(e, blamed) from None
    except Exception as e:
        return await _unexpected_error_handler(raw_request, e)


# The field a route's bad input (a ``ValueError``) is blamed on when it names none.
_BLAMED_FIELD = {"/v1/chat/completions": "messages", "/v1/messages": "messages", "/v1/responses": "input",
                 "/v1/embeddings": "input", "/pooling": "input"}  # fmt: skip


async def _wait_for_disconnect(raw_request: Request) -> None:
    """Return when the client disconnects (the body was already read by FastAPI)."""
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


def _validate(model: type[BaseModel], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        raise RequestValidationError(errors) from None


# ---------------------------------------------------------------------------- error handlers


async def _validation_error_handler(request: Request, exc: RequestValidationError) -> Response:
    """Schema violations and malformed JSON → 400 with ``param`` = the first bad field."""
    errors = list(exc.errors())
    param = None
    messages = []
    for err in errors:
        loc = list(err.get("loc", ()))
        path = loc[1:] if loc and loc[0] == "body" else loc
        if err.get("type") == "json_invalid":
            reason = (err.get("ctx") or {}).get("error", "")
            where = f" at position {path[0]}" if path else ""
            messages.append(f"Invalid JSON in the request body{where}: {reason}")
            continue
        if param is None and path and isinstance(path[0], str):
            param = path[0]
        where = ".".join(str(p) for p in path) or "body"
        messages.append(f"{where}: {err.get('msg', 'invalid value')}")
    return _error(400, "; ".join(messages) or "Invalid request", param, request.url.path)


async def _http_error_handler(request: Request, exc: StarletteHTTPException) -> Response:
    """Starlette's own errors (unknown route 404, wrong method 405) in the OpenAI shape; a
    route of the other runner is a 404 that names the runner serving it."""
    message = str(exc.detail)
    if exc.status_code == HTTPStatus.NOT_FOUND:
        message = _other_runners_route(request) or message
    response = _error(exc.status_code, message, path=request.url.path)
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


def _other_runners_route(request: Request) -> str | None:
    """What to say of a request for a route this server's runner does not serve, or None."""
    path, runner_type = request.url.path, getattr(request.app.state, "runner_type", None)
    for other, other_router in RUNNER_ROUTERS.items():
        if other != runner_type and any(route.path_regex.match(path) for route in other_router.routes):
            return (f"{request.method} {path} is not served here: this server runs the model with "
                    f"--runner {runner_type}, and the route needs --runner {other}.")  # fmt: skip
    return None


async def _openai_error_handler(request: Request, exc: OpenAIError) -> Response:
    return _error(exc.status_code, exc.message, exc.param, request.url.path)


async def _engine_dead_handler(request: Request, exc: EngineDeadError) -> Response:
    # The root-cause block (pids, stages, exceptions) goes to the server log, not to clients.
    return _error(503, ENGINE_DEAD_MESSAGE, path=request.url.path)


async def _value_error_handler(request: Request, exc: ValueError) -> Response:
    return await _openai_error_handler(request, bad_request_from_value_error(exc, None))


async def _unexpected_error_handler(request: Request, exc: Exception) -> Response:
    logger.error("unexpected error serving %s: %r", request.url.path, exc, exc_info=exc)
    return _error(500, internal_error_message(exc), path=request.url.path)


# ---------------------------------------------------------------------------- API key


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` (vLLM's ``AuthenticationMiddleware``).

    ``scope``: ``"v1"`` guards ``/v1/*`` only, as vLLM (``/tokenize``, ``/metrics``, ...
    stay open); ``"all"`` guards every path but ``/health`` and ``/ping``. Preflight
    ``OPTIONS`` requests always pass (browsers send them without credentials).

    ``/v1/messages`` too takes the key only as a bearer token, as vLLM 0.32's Anthropic route
    does: Anthropic's ``x-api-key`` header is not read (the ``anthropic`` client sends its
    ``api_key`` as ``Authorization: Bearer``; its ``auth_token`` always goes that way). Its 401
    is in Anthropic's error shape.

    Pure ASGI, so streamed responses pass through untouched. Only a SHA-256 digest of the
    key is kept, and digests are compared with ``secrets.compare_digest`` (constant time).
    """

    def __init__(self, app: ASGIApp, api_key: str, scope: str = "v1") -> None:
        self.app = app
        self.key_digest = hashlib.sha256(api_key.encode()).digest()
        self.scope = scope

    def guards(self, path: str) -> bool:
        if self.scope == "all":
            return path.rstrip("/") not in UNGUARDED_PATHS
        return path.startswith(GUARDED_PREFIX)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if self.guards(path):
                header = Headers(scope=scope).get("authorization", "")
                token = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
                digest = hashlib.sha256(token.encode()).digest()
                if not secrets.compare_digest(digest, self.key_digest):
                    response = _error(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                      path=path)  # fmt: skip
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)
