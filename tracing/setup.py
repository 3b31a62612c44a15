"""The process's tracer provider: one per process, owned here, replaceable.

``setup_tracing(role, ...)`` builds an OpenTelemetry ``TracerProvider`` whose resource
names this process (``service.name=glassbox``, role, pid, rank), attaches the exporters
asked for, and keeps everything in one ``TracingHandle``. The stage helper
(``tracing.stage``) reads that handle; nothing else in Glassbox touches OpenTelemetry's
provider machinery.

Why not OpenTelemetry's global provider: it can be set only once per process ("Overriding
of current TracerProvider is not allowed"), while tests build many engines — with
different roles and exporters — in one process. So the provider lives here and a second
``setup_tracing`` call shuts the first one down (flushing it) and replaces it. Span
*context* (parent links, ``trace.get_current_span()``) is OpenTelemetry's ordinary
context, so propagation works as usual.

The handle also owns the process's **status file** (``tracing.run_dir.ProcessStatus``): a
small JSON file rewritten atomically by the run-directory contract's one writer whenever a
lifecycle stage is entered or left, so a deadline message, ``glassbox ps`` or a crash report
can name the stage of a process even when it is frozen and exports nothing.

Mirrors vLLM's ``init_tracer`` in ``vllm/tracing.py`` (OTLP only, global provider,
``BatchSpanProcessor``). Left out: sampling (every span is recorded), metrics providers.
A forked child inherits the parent's handle and must call ``setup_tracing`` again.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

from tracing import catalogue
from tracing import run_dir as run_dirs
from tracing.exporters import CountingExporter, ExporterHealth, InMemorySpanExporter, JsonLinesSpanExporter

logger = logging.getLogger(__name__)

SERVICE_NAME = "glassbox"
INSTRUMENTATION_NAME = "glassbox"


@dataclass
class TracingHandle:
    """Everything tracing holds for this process.

    Attributes:
        role: process role, e.g. ``EngineCore_DP0``.
        rank: worker rank or DP rank, or None.
        pid: the process id at setup.
        provider: this process's ``TracerProvider`` (not the OpenTelemetry global one).
        tracer: the tracer every stage span is started from.
        status_file: path of the status file, or None for no status file.
        in_memory: the in-memory exporter when ``in_memory=True`` was asked for.
        exporters: every exporter, each wrapped with its health counters.
        warnings: problems met at setup (e.g. an OTLP package missing); tracing went on.
        unavailable: health entries of exporters asked for but not built.
        recording: whether spans are made at all. With no exporter nothing could ever see
            them, so stages skip the span (about 20 µs each) and keep only the stack,
            status file and hooks.
    """

    role: str
    rank: int | None
    pid: int
    provider: TracerProvider
    tracer: trace.Tracer
    status_file: str | None = None
    in_memory: InMemorySpanExporter | None = None
    exporters: list[CountingExporter] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    unavailable: list[ExporterHealth] = field(default_factory=list)
    recording: bool = False
    _status_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def get_finished_spans(self) -> tuple[ReadableSpan, ...]:
        """Spans the in-memory exporter holds, oldest first (empty without ``in_memory``)."""
        return self.in_memory.get_finished_spans() if self.in_memory is not None else ()

    def clear_finished_spans(self) -> None:
        if self.in_memory is not None:
            self.in_memory.clear()

    def health(self) -> list[ExporterHealth]:
        """One ``ExporterHealth`` per exporter (spans exported, dropped, last error)."""
        return [e.health for e in self.exporters] + self.unavailable

    def health_summary(self) -> str:
        """One line for logs: ``jsonl: 12 exported, 0 dropped; otlp: 0 exported, ...``."""
        if not self.health():
            return "no exporters"
        parts = []
        for h in self.health():
            text = f"{h.name}: {h.exported} exported, {h.dropped} dropped"
            if h.last_error:
                text += f" (last error: {h.last_error})"
            parts.append(text)
        return "; ".join(parts)

    def write_status(self, fields: dict[str, Any]) -> None:
        """Atomically rewrite the status file with identity fields plus ``fields``.

        ``fields``: the other ``tracing.run_dir.ProcessStatus`` fields (``stage``,
        ``stage_stack``, ``entered_at``, ``last_finished`` as a dict); ``updated_at`` is now.
        Never raises: a status file that cannot be written (its run directory already
        removed, say) must not break the stage being recorded.
        """
        if self.status_file is None:
            return
        data = {"role": self.role, "rank": self.rank, "pid": self.pid, **fields, "updated_at": time.time()}
        try:
            status = msgspec.convert(data, run_dirs.ProcessStatus)
        except msgspec.ValidationError as e:  # a caller's bug; the stage itself goes on
            logger.warning("status file %s not written: %s", self.status_file, e)
            return
        try:
            with self._status_lock:  # writes land in the order the stages changed
                run_dirs.write_status(self.status_file, status)
        except OSError as e:
            logger.debug("could not write status file %s: %s", self.status_file, e)


_handle: TracingHandle | None = None
_setup_lock = threading.Lock()
_atexit_registered = False


def get_handle() -> TracingHandle | None:
    """The current handle, or None when ``setup_tracing`` was not called (or was shut down)."""
    return _handle


def _otlp_exporter(endpoint: str) -> SpanExporter:
    # The protocol variable is the one OpenTelemetry and vLLM read.
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: expected grpc or http/protobuf")
    return OTLPSpanExporter(endpoint=endpoint)


def setup_tracing(
    role: str,
    *,
    rank: int | None = None,
    trace_file: str | None = None,
    otlp_endpoint: str | None = None,
    in_memory: bool = False,
    status_file: str | None = None,
) -> TracingHandle:
    """Set up (or replace) this process's tracing and return the handle.

    Args:
        role: process role, put on every span's resource and in the status file.
        rank: worker rank or DP rank, when the role has one.
        trace_file: append every finished span to this file as one JSON line.
        otlp_endpoint: also send spans over OTLP (gRPC, or HTTP when
            ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``). When the exporter
            package is missing, one warning is logged and tracing goes on without it.
        in_memory: keep finished spans in memory (``get_finished_spans()``), for tests.
        status_file: rewrite this JSON file at each lifecycle stage; written once now.

    Calling it again shuts the previous provider down (flushing its exporters) and
    replaces it, so each call starts from a clean slate.

    Raises:
        OSError: ``trace_file`` cannot be opened.
    """
    global _handle, _atexit_registered
    with _setup_lock:
        if _handle is not None:
            _shutdown_locked()
        attributes: dict[str, Any] = {
            "service.name": SERVICE_NAME,
            catalogue.ATTR_ROLE: role,
            catalogue.ATTR_PID: os.getpid(),
        }
        if rank is not None:
            attributes[catalogue.ATTR_RANK] = rank
        # shutdown_on_exit=False: one atexit hook of ours, not one per replaced provider.
        provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=False)
        handle = TracingHandle(
            role=role,
            rank=rank,
            pid=os.getpid(),
            provider=provider,
            tracer=provider.get_tracer(INSTRUMENTATION_NAME),
            status_file=os.fspath(status_file) if status_file is not None else None,
        )
        if in_memory:
            handle.in_memory = InMemorySpanExporter()
            _add(handle, handle.in_memory, "in_memory", batch=False)
        if trace_file:
            # One write per span, no batching thread: a span is on disk when it ends.
            _add(handle, JsonLinesSpanExporter(trace_file), "jsonl", batch=False)
        if otlp_endpoint:
            try:
                exporter = _otlp_exporter(otlp_endpoint)
            except (ImportError, ValueError) as e:
                message = f"OTLP traces to {otlp_endpoint} disabled: {e}"
                logger.warning("%s (install opentelemetry-exporter-otlp to enable)", message)
                handle.warnings.append(message)
                # Listed in health() as never exporting, so the gap is visible, not silent.
                handle.unavailable.append(
                    ExporterHealth("otlp", last_error=message, last_error_at=time.time())
                )
            else:
                _add(handle, exporter, "otlp", batch=True)
        handle.recording = bool(handle.exporters)
        handle.write_status({"stage": None, "stage_stack": [], "entered_at": None, "last_finished": None})
        _handle = handle
        if not _atexit_registered:
            atexit.register(shutdown_tracing)
            _atexit_registered = True
        return handle


def _add(handle: TracingHandle, exporter: SpanExporter, name: str, *, batch: bool) -> None:
    counted = CountingExporter(exporter, name)
    # Network exports go through a background thread (a slow collector must not slow a
    # step); local ones are written as each span ends.
    processor = (
        BatchSpanProcessor(counted, schedule_delay_millis=500) if batch else SimpleSpanProcessor(counted)
    )
    handle.provider.add_span_processor(processor)
    handle.exporters.append(counted)


def _shutdown_locked() -> None:
    global _handle
    handle, _handle = _handle, None
    if handle is None:
        return
    try:
        handle.provider.shutdown()  # flushes batch processors, closes the JSON-lines file
    except Exception as e:  # noqa: BLE001 - shutting tracing down must never raise
        logger.warning("tracing shutdown failed: %s", e)
    if handle.health():
        logger.debug("tracing shut down: %s", handle.health_summary())


def shutdown_tracing() -> None:
    """Flush and close every exporter and forget the handle. Safe to call twice."""
    with _setup_lock:
        _shutdown_locked()


def get_finished_spans() -> tuple[ReadableSpan, ...]:
    """Spans held by the current in-memory exporter (empty without one)."""
    handle = _handle
    return handle.get_finished_spans() if handle is not None else ()


def clear_finished_spans() -> None:
    handle = _handle
    if handle is not None:
        handle.clear_finished_spans()


def read_status_file(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The status file at ``path`` as a dict, or None when it is missing or unreadable.

    The dict form of ``tracing.run_dir.read_status`` (which new code should call for the
    typed ``ProcessStatus``), kept for callers that index it. Fields: ``role``, ``rank``,
    ``pid``, ``stage`` (innermost open lifecycle stage or None), ``stage_stack`` (open
    lifecycle stages, outermost first), ``entered_at`` (Unix time the current stage was
    entered), ``updated_at``, ``last_finished`` (``name``, ``duration_ms``, ``error``,
    ``finished_at`` of the last lifecycle stage left, or None); a field missing from the
    file reads as None (``stage_stack``: ``[]``).
    """
    status = run_dirs.read_status(path)
    return None if status is None else msgspec.to_builtins(status)
