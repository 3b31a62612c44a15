"""``build_app``: the FastAPI application of the API server — routes, middleware, errors.

Mirrors the app half of vLLM's ``vllm/entrypoints/openai/api_server.py`` (``build_app``,
``init_app_state``, the route functions, ``with_cancellation`` from
``vllm/entrypoints/utils.py``, ``AuthenticationMiddleware``) and the Prometheus gauges of
``vllm/v1/metrics/loggers.py``. ``api_server.py`` builds the engine, then this app, then
serves it.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET|POST /ping``,
``GET /version``, ``GET /metrics``.

Errors: every error body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``.
Invalid requests — malformed JSON and schema violations included — are 400 (FastAPI's
default would be 422); an unknown model 404; a missing or wrong API key 401 (vLLM answers
``{"error": "Unauthorized"}`` there; we keep one shape); a dead engine 503; anything
unexpected 500, logged.

Middleware, outermost first (vLLM's order): the API-key check on ``/v1/*`` (only with an
``api_key``), then CORS. ``allowed_origins`` defaults to ``["*"]`` as vLLM's
``--allowed-origins`` does; pass ``[]`` for no CORS headers at all.

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

Left out: ``/load``, ``/v1/responses``, embeddings/pooling/score/rerank, audio, LoRA and dev
routes, ``X-Request-Id`` middleware.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
from collections.abc import AsyncIterator, Awaitable
from http import HTTPStatus
from typing import Any

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from engine import __version__
from engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from engine.entrypoints.openai.serving_chat import OpenAIServingChat
from engine.entrypoints.openai.serving_completion import OpenAIServingCompletion
from engine.entrypoints.openai.serving_engine import OpenAIError, bad_request_from_value_error, error_response
from engine.entrypoints.openai.serving_models import OpenAIServingModels
from engine.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from engine.frontend.async_llm import AsyncLLM
from engine.logger import get_process_role, init_logger
from engine.metrics.loggers import StatLoggerManager, attach
from engine.utils.processes import EngineDeadError

logger = init_logger(__name__)

# Only these paths need the API key (vLLM guards everything under /v1).
GUARDED_PREFIX = "/v1"
# Status for a request whose client left before the answer (nginx's "client closed request").
CLIENT_CLOSED_REQUEST = 499

router = APIRouter()


def build_app(
    engine: AsyncLLM,
    *,
    served_model_name: str,
    api_key: str | None = None,
    allowed_origins: list[str] | None = None,
    several_servers: bool = False,
    log_stats: bool = True,
) -> FastAPI:
    """The FastAPI app that serves ``engine`` under ``served_model_name``.

    Args:
        engine: a started ``AsyncLLM``; the app never shuts it down.
        served_model_name: the model id clients see in ``/v1/models`` and must send.
        api_key: when given, ``/v1/*`` requires ``Authorization: Bearer <api_key>``.
        allowed_origins: CORS origins; None means ``["*"]`` (vLLM's default).
        several_servers: one of several API servers (``--api-server-count`` > 1): the stats
            log line names this server and its share of the throughput.
        log_stats: keep the periodic stats log line (``app.state.stat_loggers.log()``).
    """
    app = FastAPI(title="Glassbox OpenAI-compatible API", version=__version__)
    app.include_router(router)
    state = app.state
    state.engine = engine
    state.serving_models = OpenAIServingModels(engine, served_model_name)
    state.serving_completion = OpenAIServingCompletion(engine, served_model_name)
    state.serving_chat = OpenAIServingChat(engine, served_model_name)
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
    # last, runs first (as in vLLM).
    app.add_middleware(
        CORSMiddleware,
        allow_origins=["*"] if allowed_origins is None else list(allowed_origins),
        allow_credentials=False,
        allow_methods=["*"],
        allow_headers=["*"],
    )
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    # Outermost: counts every HTTP request until its response is sent (live telemetry).
    state.http_in_flight = InFlightCounter.Count()
    app.add_middleware(InFlightCounter, count=state.http_in_flight)
    return app


# ---------------------------------------------------------------------------- routes


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(raw_request: Request) -> Response:
    """200 (empty) while the engine is alive, 503 once it is dead."""
    try:
        await raw_request.app.state.engine.check_health()
    except EngineDeadError:
        return Response(status_code=503)
    return Response(status_code=200)


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(raw_request: Request) -> Response:
    """Same as ``/health`` (SageMaker's name for it)."""
    return await health(raw_request)


@router.get("/version")
async def show_version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.get("/v1/models")
async def show_available_models(raw_request: Request) -> Response:
    return _json(raw_request.app.state.serving_models.show_available_models())


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, raw_request: Request) -> Response:
    """One model card (``client.models.retrieve``); 404 for any other name."""
    models = raw_request.app.state.serving_models.show_available_models()
    for card in models.data:
        if card.id == model_id:
            return _json(card)
    raise OpenAIError(f"The model `{model_id}` does not exist.", HTTPStatus.NOT_FOUND, param="model")


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    handler: OpenAIServingCompletion = raw_request.app.state.serving_completion
    return await _respond(raw_request, handler.create_completion(request, dict(raw_request.headers)))


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    handler: OpenAIServingChat = raw_request.app.state.serving_chat
    return await _respond(raw_request, handler.create_chat_completion(request, dict(raw_request.headers)))


@router.post("/tokenize")
async def tokenize(raw_request: Request) -> Response:
    """``{"prompt": str}`` or ``{"messages": [...]}`` → ``{"count", "max_model_len", "tokens"}``."""
    body = await _json_body(raw_request)
    chat = isinstance(body, dict) and "messages" in body
    request = _validate(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    return _json(raw_request.app.state.serving_tokenization.create_tokenize(request))


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    return _json(raw_request.app.state.serving_tokenization.create_detokenize(request))


@router.get("/metrics")
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


def _error(status_code: int, message: str, param: str | None = None) -> Response:
    return _json(error_response(status_code, message, param), status_code)


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
    if task.cancelled():
        logger.info("client disconnected from %s; request aborted", raw_request.url.path)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    try:
        result = task.result()
    except (OpenAIError, EngineDeadError):
        raise  # answered by their handlers below
    except ValueError as e:  # our convention for bad input (a prompt that cannot be encoded, ...)
        blamed = "messages" if raw_request.url.path.endswith("/chat/completions") else "prompt"
        raise bad_request_from_value_error(e, blamed) from None
    except Exception as e:
        return await _unexpected_error_handler(raw_request, e)
    if isinstance(result, BaseModel):
        return _json(result)
    return ClosingStreamingResponse(result, media_type="text/event-stream")


async def _wait_for_disconnect(raw_request: Request) -> None:
    """Return when the client disconnects (the body was already read by FastAPI)."""
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def _json_body(raw_request: Request) -> Any:
    """The request body parsed as JSON; malformed JSON is a validation error (400)."""
    raw = await raw_request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        position = getattr(e, "pos", 0)
        reason = getattr(e, "msg", str(e))
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", position),
                    "msg": "JSON decode error",
                    "ctx": {"error": reason},
                }
            ]
        ) from None


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
            messages.append(
                f"Invalid JSON in the request body at position {path[0] if path else 0}: {reason}"
            )
            continue
        if param is None and path and isinstance(path[0], str):
            param = path[0]
        where = ".".join(str(p) for p in path) or "body"
        messages.append(f"{where}: {err.get('msg', 'invalid value')}")
    content_type = request.headers.get("content-type", "")
    if content_type and "json" not in content_type:
        # FastAPI reads a body as JSON only when it is labelled so (vLLM refuses others).
        messages.insert(
            0, f"The body must be JSON sent as 'Content-Type: application/json' (got {content_type!r})"
        )
    return _error(400, "; ".join(messages) or "Invalid request", param)


async def _http_error_handler(request: Request, exc: StarletteHTTPException) -> Response:
    """Starlette's own errors (unknown route 404, wrong method 405) in the OpenAI shape."""
    response = _error(exc.status_code, str(exc.detail))
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


async def _openai_error_handler(request: Request, exc: OpenAIError) -> Response:
    return _error(exc.status_code, exc.message, exc.param)


async def _engine_dead_handler(request: Request, exc: EngineDeadError) -> Response:
    # The root-cause block (pids, stages, exceptions) goes to the server log, not to clients.
    return _error(503, "The engine is dead; the server's log shows the root cause.")


async def _value_error_handler(request: Request, exc: ValueError) -> Response:
    return await _openai_error_handler(request, bad_request_from_value_error(exc, None))


async def _unexpected_error_handler(request: Request, exc: Exception) -> Response:
    logger.error("unexpected error serving %s: %r", request.url.path, exc, exc_info=exc)
    return _error(500, f"Internal server error: {type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------- API key


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on ``/v1/*`` (vLLM's ``AuthenticationMiddleware``).

    Pure ASGI, so streamed responses pass through untouched. Only a SHA-256 digest of the
    key is kept, and digests are compared with ``secrets.compare_digest`` (constant time).
    Preflight ``OPTIONS`` requests and other paths (``/health``, ``/metrics``, ...) pass.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key_digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and scope.get("method") != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if path.startswith(GUARDED_PREFIX):
                header = Headers(scope=scope).get("authorization", "")
                token = header[len("Bearer ") :] if header.startswith("Bearer ") else ""
                digest = hashlib.sha256(token.encode()).digest()
                if not secrets.compare_digest(digest, self.key_digest):
                    response = _error(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.")
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------------- in flight


class InFlightCounter:
    """Counts HTTP requests from arrival until their response is sent (streams included):
    the API server's ``api.http_in_flight`` gauge. Pure ASGI."""

    class Count:
        value = 0

    def __init__(self, app: ASGIApp, count: Count) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.count.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.count.value -= 1
