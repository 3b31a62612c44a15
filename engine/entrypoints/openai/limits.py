"""The API server's front door: a bounded request body, one JSON parser, memory given back.

vLLM has no counterpart: its routes let FastAPI read any body whole and parse it on the
event loop. Here every request passes ``RequestBodyLimit`` (an ASGI middleware) and every
route that takes a body parses it with ``parse_json_body``:

- **Size**: a body larger than ``--max-request-body-bytes`` is answered with a 413 (in
  OpenAI's error shape, Anthropic's under ``/v1/messages``) *before* it is read whole: at once when its ``Content-Length`` says
  so, or as soon as the bytes counted from a chunked body pass the limit. The connection is
  then closed (``Connection: close``), since the rest of the body is never read.
- **Parsing** (``parse_json_body``): the body must be JSON (``Content-Type`` absent,
  ``application/json`` or ``application/*+json``), valid UTF-8, RFC 8259 JSON (no ``NaN``,
  ``Infinity``, or a number that overflows to infinity), nested at most
  ``MAX_JSON_DEPTH`` deep, with no lone surrogate in its text (``check_unicode``). Anything
  else is a 400 naming what is wrong — never a 500, and the keep-alive connection stays
  usable. A large body is decoded in a worker thread, off the event loop.
- **Memory**: after a request whose body was large, ``malloc_trim`` hands the freed heap
  back to the system (glibc keeps it otherwise, in each thread's arena), so the server's
  resident memory returns near its baseline.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
import math
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.entrypoints.openai.serving_engine import UNCHECKED_FIELDS, OpenAIError, error_body
from engine.logger import init_logger

logger = init_logger(__name__)

T = TypeVar("T")

# 10 MiB: a full 128k-token context is about 0.5-1 MB as text or as JSON token ids (up to
# ~1.2 MB for CJK text escaped as \uXXXX), so this leaves room for several such prompts in one
# request, while bounding what one request can make the server hold (its body, the parsed
# JSON and the token ids: a few hundred MB at most for a body this size).
DEFAULT_MAX_REQUEST_BODY_BYTES = 10 * 1024 * 1024
# Deeper JSON than this is refused (OpenAI's request bodies are a few levels deep; a deep
# body would otherwise exhaust the recursion limit of the parser or of later checks).
MAX_JSON_DEPTH = 64
# Bodies at least this large are decoded in a worker thread (the hop costs ~0.1 ms; decoding
# 64 KiB costs about as much).
THREAD_DECODE_BYTES = 64 * 1024
# After a request whose body was at least this large, return freed memory to the system.
TRIM_AFTER_BYTES = 1024 * 1024
# Fields ``check_unicode`` leaves alone: ``user`` is accepted and ignored; a ``model`` that is
# not valid Unicode is no served name, which the route answers with its 404.
NOT_SCANNED = UNCHECKED_FIELDS | {"model"}


class BodyTooLarge(Exception):
    """The request body is larger than the limit (answered with 413)."""


async def send_error(send: Send, status: int, message: str, close: bool = False, path: str = "") -> None:
    """Send a whole error response (pure ASGI), in the shape of ``path``'s clients
    (``serving_engine.error_body``: OpenAI's, or Anthropic's under ``/v1/messages``)."""
    body = error_body(path, status, message).model_dump_json().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestBodyLimit:
    """Bounds each HTTP request's body to ``max_bytes`` before the app reads it.

    Args:
        app: the ASGI app inside.
        max_bytes: the largest body accepted (``--max-request-body-bytes``); 0 or less
            means no limit.

    A ``Content-Length`` above ``max_bytes`` (or not a number) is answered at once (413,
    400), nothing read; a chunked body is counted as it arrives and answered with 413 the
    moment it passes ``max_bytes``. An accepted body is read here whole (a client that
    leaves mid-body ends the request quietly) and handed to the app in one message, then
    ``receive`` is the server's again (disconnects still reach the app). After a large
    body's request ends, freed memory is returned to the system (``release_memory``).
    """

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        path = scope["path"]
        if length is not None and "transfer-encoding" not in headers:
            if not length.strip().isdigit():
                await send_error(
                    send, 400, f"Invalid Content-Length header: {length!r}.", close=True, path=path
                )
                return
            if 0 < self.max_bytes < int(length):
                await send_error(
                    send, 413, too_large_message(int(length), self.max_bytes), close=True, path=path
                )
                return
        # Read here, not by the app: a client that leaves mid-body (or is cut off by
        # --http-body-timeout's 408) ends the request quietly, with no traceback from the app.
        await self._read_counted(scope, receive, send)

    async def _read_counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the body whole, counting its bytes (413 as soon as a chunked one passes
        ``max_bytes``); then hand it to the app in one message."""
        chunks: list[bytes] = []
        size = 0
        more_body = True
        while more_body:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if 0 < self.max_bytes < size:
                await send_error(
                    send, 413, too_large_message(None, self.max_bytes), close=True, path=scope["path"]
                )
                return
            chunks.append(chunk)
            more_body = message.get("more_body", False)
        # The app's first receive() takes the body: from then on only the app holds it.
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        del chunks

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        try:
            await self.app(scope, replay, send)
        finally:
            if size >= TRIM_AFTER_BYTES:
                await release_memory()


def too_large_message(length: int | None, limit: int) -> str:
    got = f" ({length} bytes)" if length is not None else ""
    return (
        f"The request body{got} is larger than this server accepts: at most {limit} bytes "
        "(--max-request-body-bytes)."
    )


_libc: Any = None


async def release_memory() -> None:
    """Return the heap's free memory to the system (glibc ``malloc_trim``), off the event loop.

    Large requests leave megabytes free in glibc's arenas (one per thread that allocated);
    without this the process keeps them resident. A no-op where there is no glibc.
    """
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
            if _libc and not hasattr(_libc, "malloc_trim"):
                _libc = False
        except OSError:
            _libc = False
    if _libc:
        await asyncio.to_thread(_libc.malloc_trim, 0)


# ---------------------------------------------------------------------------- parsing


def _invalid_json(reason: str, position: int | None = None) -> RequestValidationError:
    loc = ("body",) if position is None else ("body", position)
    return RequestValidationError(
        [
            {
                "type": "json_invalid",
                "loc": loc,
                "msg": "JSON decode error",
                "ctx": {"error": reason},
            }
        ]
    )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


_decoder = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` (parsed JSON) nests lists and objects more than ``limit`` deep."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


def decode_json(raw: bytes) -> Any:
    """``raw`` → the JSON value it holds.

    Raises:
        RequestValidationError: (a 400) invalid UTF-8, invalid JSON (``NaN``, ``Infinity``
            and numbers that overflow included), a number with too many digits, or nesting
            deeper than ``MAX_JSON_DEPTH``.
        OpenAIError: (a 400) a field of an object body holds text that is not valid
            Unicode (``check_unicode``).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _invalid_json(f"the body is not valid UTF-8 (byte {raw[e.start]:#04x})", e.start) from None
    try:
        value = _decoder.decode(text)
    except json.JSONDecodeError as e:
        raise _invalid_json(e.msg, e.pos) from None
    except RecursionError:
        raise _invalid_json(f"nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except ValueError as e:  # NaN / Infinity, an overflowing number, an int of > 4300 digits
        raise _invalid_json(str(e)) from None
    # Nesting needs a bracket per level: a body with few brackets cannot be too deep.
    deep_enough = raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    if deep_enough and isinstance(value, (dict, list)) and too_deep(value):
        raise _invalid_json(f"nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    # A lone surrogate can only come from a \uXXXX escape: a body without one has none.
    if ("\\ud" in text or "\\uD" in text) and isinstance(value, dict):
        check_unicode(value)
    return value


def check_unicode(body: dict[str, Any]) -> None:
    """Refuse text that is not valid Unicode anywhere in a request's field (a lone surrogate
    such as ``"\\ud800"`` is valid JSON but cannot be UTF-8 encoded, so no later stage could
    take it), naming the top-level field; ``NOT_SCANNED`` fields are left to the route.

    Raises:
        OpenAIError: (400, ``param``: the field).
    """
    for name, value in body.items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            if name in NOT_SCANNED:
                continue
            raise OpenAIError(
                f"{name} is not valid Unicode text: {text[e.start]!r} (a lone surrogate) at position "
                f"{e.start} of {text[:40]!r}.",
                param=name,
            ) from None


def is_json_content_type(content_type: str | None) -> bool:
    """Absent, ``application/json`` or ``application/<x>+json`` (parameters allowed) — the
    types FastAPI reads as JSON."""
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    maintype, _, subtype = media.partition("/")
    return maintype == "application" and (subtype == "json" or subtype.endswith("+json"))


async def parse_json_body(raw_request: Request, then: Callable[[Any], T]) -> T:
    """The request's body as a JSON value: the one body parser of every route.

    ``then``: applied to the parsed value (the route's validation) in the same step. Both
    run in a worker thread for bodies of ``THREAD_DECODE_BYTES`` or more, so a large body
    never holds the event loop.

    Raises:
        OpenAIError: (400) the body is not labelled JSON.
        RequestValidationError: (400) the body is not valid JSON (see ``decode_json``), or
            what ``then`` raises.
    """
    content_type = raw_request.headers.get("content-type")
    if not is_json_content_type(content_type):
        raise OpenAIError(
            f"The body must be JSON sent as 'Content-Type: application/json' (got {content_type!r})."
        )
    raw = await raw_request.body()

    def work() -> T:
        return then(decode_json(raw))

    if len(raw) >= THREAD_DECODE_BYTES:
        return await asyncio.to_thread(work)
    return work()
