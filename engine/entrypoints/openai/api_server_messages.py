"""Messages between API server 0 and the other API servers (``--api-server-count A > 1``).

The whole protocol::

    APIServer_0 ──spawn (stdin pipe)─▶ APIServer_i   APIServerSpawnPayload (+ the listening socket's fd)
    APIServer_0 ◀──PUSH/PULL──────── APIServer_i   APIServerReady (attached, about to serve)

APIServer_0 binds the listening socket, launches the engine cores (and the coordinator),
and only then starts the other API servers: each inherits the same listening socket (the
kernel spreads ``accept()`` among them), attaches to the engines with the ``EnginesInfo``
in its payload, and says ready. vLLM: ``APIServerProcessManager`` and
``run_api_server_worker_proc`` (there a separate parent process launches everything and
supervises; here APIServer_0 does, so the tree is exactly A + DP + N (+1) processes).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from engine.core.messages import EnginesInfo
from engine.utils.wire import decode

BOUNDARY = "APIServer_0 ↔ APIServer_i"


@dataclass
class ServerArgs:
    """The server's own flags (the engine's are in ``EngineConfig``).

    ``api_server_count``: how many API server processes share the listening socket
    (``--api-server-count``); None means the data-parallel size, as in vLLM 0.32.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    allowed_origins: list[str] | None = None
    uvicorn_log_level: str = "info"
    api_server_count: int | None = None
    # The front door (app.build_app, docs/security.md): --api-key-scope, CORS beyond
    # --allowed-origins, --max-request-body-bytes (10 MiB: limits.DEFAULT_MAX_REQUEST_BODY_BYTES).
    api_key_scope: str = "v1"
    allowed_methods: list[str] | None = None
    allowed_headers: list[str] | None = None
    allow_credentials: bool = False
    max_request_body_bytes: int = 10 * 1024 * 1024
    # Slow clients and shutdown (docs/security.md): --http-header-timeout, --http-body-timeout
    # (seconds), --shutdown-timeout (seconds; vLLM's flag).
    http_header_timeout: float = 10.0
    http_body_timeout: float = 30.0
    shutdown_timeout: int = 0
    # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens (vLLM's flag).
    enable_prompt_tokens_details: bool = False


class APIServerSpawnPayload(msgspec.Struct, kw_only=True):
    """What APIServer_<i> needs to start (written to its stdin by ``spawn_process``).

    ``listen_fd``: the inherited listening socket's file descriptor (same number in the
    child). ``ready_address``: APIServer_0's PULL socket for ``APIServerReady``.
    ``trace_headers``: the spawning span (W3C), so the server's start-up joins the trace.
    """

    config_pickle: bytes
    server_args: ServerArgs
    client_index: int
    num_clients: int
    engines: EnginesInfo
    listen_fd: int
    ready_address: str
    trace_headers: dict[str, str] | None = None

    @property
    def config(self) -> Any:
        return pickle.loads(self.config_pickle)


class APIServerReady(msgspec.Struct, kw_only=True, array_like=True):
    """APIServer_<i> is attached to every engine core and about to accept connections."""

    client_index: int
    role: str
    pid: int


def ready_address(run_dir: Path) -> str:
    """Where APIServer_0 collects the other API servers' ``APIServerReady`` (it binds)."""
    return f"ipc://{run_dir}/api_ready.sock"


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_as(message_type: type, data: bytes) -> Any:
    """Decode ``data`` as ``message_type``; ``ProtocolError`` (naming this boundary) when it does not fit."""
    decoder = _decoders.get(message_type)
    if decoder is None:
        decoder = _decoders[message_type] = msgspec.msgpack.Decoder(message_type)
    return decode(decoder, data, BOUNDARY)
