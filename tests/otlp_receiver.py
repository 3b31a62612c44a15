"""A real OTLP trace receiver inside the tests: HTTP/protobuf and gRPC, on 127.0.0.1.

Spans are decoded with ``opentelemetry-proto`` (``ExportTraceServiceRequest``) exactly as a
collector would get them, so a test sees what Jaeger would: ids, parents across processes,
attributes, resource attributes.

Use::

    from otlp_receiver import HttpOtlpReceiver, GrpcOtlpReceiver

    with HttpOtlpReceiver() as rx:             # or GrpcOtlpReceiver()
        llm = LLM(..., otlp_traces_endpoint=rx.endpoint)
        ...
        spans = rx.wait_for(lambda spans: any(s.name == "worker.load_model" for s in spans))
        startup = rx.trace_of("llm.init")      # every span of the trace that holds llm.init

API (both receivers):

- ``endpoint``: what to pass as ``otlp_traces_endpoint`` / ``--otlp-traces-endpoint``
  (HTTP: ``http://127.0.0.1:PORT/v1/traces``; gRPC: ``http://127.0.0.1:PORT``);
  ``protocol``: ``"http/protobuf"`` or ``"grpc"``; ``port``.
- ``spans``: a copy of every ``ReceivedSpan`` so far, in arrival order; ``requests``: how
  many export requests arrived; ``clear()`` forgets them.
- ``wait_for(predicate, timeout=20.0)``: polls ``predicate(spans)`` until it is true and
  returns the spans; on timeout raises ``AssertionError`` with a summary of what arrived.
- ``named(name)``, ``trace_of(name)``, ``roles()``: small lookups.
- ``stop()``: shuts the server down and waits for it (idempotent); also on ``with`` exit.
- HTTP only: ``fail_with = 503`` (or any status) answers every request with that status,
  to test an unhealthy collector; None (default) answers 200.

Thread-safe: the servers decode on their own threads under a lock.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

TRACES_PATH = "/v1/traces"


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the collector got it.

    ``trace_id`` (32 hex), ``span_id`` / ``parent_span_id`` (16 hex; parent None for a
    root), ``name``, ``kind`` (the proto enum's int: 1 internal, 2 server, 3 client ...),
    ``start_ns`` / ``end_ns``, ``attributes`` and ``resource`` (dicts of plain Python values;
    arrays as tuples), ``scope`` (instrumentation scope name), ``status_code`` (0 unset,
    1 ok, 2 error), ``links`` ((trace_id, span_id) pairs), ``events`` (names).
    """

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    resource: dict[str, Any] = field(default_factory=dict)
    scope: str = ""
    status_code: int = 0
    links: tuple[tuple[str, str], ...] = ()
    events: tuple[str, ...] = ()

    @property
    def role(self) -> str | None:
        """The Glassbox process role (``glassbox.role`` resource attribute)."""
        return self.resource.get("glassbox.role")

    @property
    def pid(self) -> int | None:
        return self.resource.get("glassbox.pid")


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    if which == "kvlist_value":
        return _attrs(v.kvlist_value.values)
    return getattr(v, which)


def _attrs(kvs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode_request(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """Every span of one ``ExportTraceServiceRequest``, with its resource's attributes."""
    out = []
    for rs in request.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex() if s.parent_span_id else None,
                        name=s.name,
                        kind=int(s.kind),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=_attrs(s.attributes),
                        resource=resource,
                        scope=ss.scope.name,
                        status_code=int(s.status.code),
                        links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links),
                        events=tuple(e.name for e in s.events),
                    )
                )
    return out


class OtlpReceiver:
    """What both receivers share: the collected spans and the waits on them."""

    protocol = ""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._requests = 0
        self._stopped = False
        self.port = 0

    @property
    def endpoint(self) -> str:
        raise NotImplementedError

    def _add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        spans = decode_request(request)
        with self._lock:
            self._requests += 1
            self._spans.extend(spans)

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    @property
    def requests(self) -> int:
        with self._lock:
            return self._requests

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self._requests = 0

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 20.0, interval: float = 0.05
    ) -> list[ReceivedSpan]:
        """Poll until ``predicate(spans)`` is true; return the spans then.

        Raises:
            AssertionError: not true after ``timeout`` s; the message lists what arrived.
        """
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans
            if predicate(spans):
                return spans
            if time.monotonic() >= deadline:
                names: dict[str, int] = {}
                for s in spans:
                    key = f"{s.role}:{s.name}"
                    names[key] = names.get(key, 0) + 1
                raise AssertionError(
                    f"{self.protocol} receiver: condition not met after {timeout:g}s; "
                    f"{len(spans)} spans in {self.requests} requests: {dict(sorted(names.items()))}"
                )
            time.sleep(interval)

    def named(self, name: str) -> list[ReceivedSpan]:
        """Every received span called ``name``."""
        return [s for s in self.spans if s.name == name]

    def trace_of(self, name: str) -> list[ReceivedSpan]:
        """Every span of the trace holding the first span called ``name`` (empty if none)."""
        spans = self.spans
        first = next((s for s in spans if s.name == name), None)
        return [] if first is None else [s for s in spans if s.trace_id == first.trace_id]

    def roles(self) -> set[str]:
        return {s.role for s in self.spans if s.role is not None}

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> OtlpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class HttpOtlpReceiver(OtlpReceiver):
    """OTLP/HTTP with protobuf bodies: ``POST /v1/traces`` (gzip / deflate accepted)."""

    protocol = "http/protobuf"

    def __init__(self, host: str = "127.0.0.1") -> None:
        super().__init__()
        self.fail_with: int | None = None
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                status = receiver.fail_with
                if self.path.split("?")[0] != TRACES_PATH:
                    status = 404
                if status is None:
                    request = trace_service_pb2.ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    receiver._add(request)
                    status = 200
                reply = (
                    trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                    if status == 200
                    else b""
                )
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                pass

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self.host, self.port = host, self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="otlp-http-receiver",
            daemon=True,
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}{TRACES_PATH}"

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class GrpcOtlpReceiver(OtlpReceiver):
    """OTLP/gRPC: a ``TraceServiceServicer`` on an insecure ``grpc.server``."""

    protocol = "grpc"

    def __init__(self, host: str = "127.0.0.1") -> None:
        import grpc

        super().__init__()
        receiver = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the proto's name
                receiver._add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="otlp-grpc"))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._server)
        self.host = host
        self.port = self._server.add_insecure_port(f"{host}:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._server.stop(grace=0.5).wait(5)


def closed_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on (bound, then closed): a collector that is down."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
