"""Span exporters: in memory (tests), JSON lines (a file per run), and a health counter.

vLLM exports only over OTLP (``vllm/tracing.py``, a ``BatchSpanProcessor``). Glassbox adds
two exporters that need no collector: an in-memory one for tests, and a JSON-lines file
that a person can ``grep`` or ``glassbox trace`` can read after a crash. Every exporter is
wrapped in ``CountingExporter`` so a tracer that silently sends nothing shows up as
"0 exported, N dropped, last error ..." instead of going unnoticed.

Left out: console and Zipkin exporters (OTLP covers collectors).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter as _SdkInMemorySpanExporter,
)

from tracing import catalogue

logger = logging.getLogger("tracing.otlp")


class InMemorySpanExporter(_SdkInMemorySpanExporter):
    """Keeps finished spans in a list, for tests: ``get_finished_spans()``, ``clear()``.

    The SDK's exporter, under Glassbox's name so tests import it from one place.
    """


# The resource attributes a span line carries (every span's resource: ``tracing.setup``).
RESOURCE_KEYS = ("service.name", catalogue.ATTR_ROLE, catalogue.ATTR_PID, catalogue.ATTR_RANK)


def _hex_id(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """One finished span as a JSON-ready dict (the line format of ``JsonLinesSpanExporter``).

    Keys: ``name``, ``trace_id`` (32 hex), ``span_id`` / ``parent_span_id`` (16 hex or
    None), ``kind``, ``start_ns`` / ``end_ns`` (Unix epoch, ns), ``duration_ms``,
    ``attributes``, ``status`` ("UNSET" | "OK" | "ERROR"), ``status_description``,
    ``events`` (name, time_ns, attributes; an exception is one), ``links`` (trace_id, span_id
    of each related span), ``resource`` (the process's OpenTelemetry resource, the keys an
    OTLP backend shows: ``service.name``, ``glassbox.role``, ``glassbox.pid`` and, where set,
    ``glassbox.rank``).
    """
    ctx = span.context
    parent = span.parent
    start, end = span.start_time or 0, span.end_time or 0
    res = span.resource.attributes if span.resource is not None else {}
    return {
        "name": span.name,
        "trace_id": _hex_id(ctx.trace_id, 32),
        "span_id": _hex_id(ctx.span_id, 16),
        "parent_span_id": _hex_id(parent.span_id, 16) if parent is not None else None,
        "kind": span.kind.name,
        "start_ns": start,
        "end_ns": end,
        "duration_ms": round((end - start) / 1e6, 3),
        "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in (span.attributes or {}).items()},
        "status": span.status.status_code.name,
        "status_description": span.status.description,
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
            for e in span.events
        ],
        "links": [
            {"trace_id": _hex_id(link.context.trace_id, 32), "span_id": _hex_id(link.context.span_id, 16)}
            for link in span.links
        ],
        "resource": {key: res[key] for key in RESOURCE_KEYS if key in res},
    }


class JsonLinesSpanExporter(SpanExporter):
    """Appends each finished span to ``path`` as one JSON line (see ``span_to_dict``).

    Each ``export`` call is one unbuffered ``write`` in append mode, so the lines are on
    disk (in the page cache) as soon as the span ends — a process that hangs or is killed
    afterwards has still written them — and several processes may share one file without
    interleaving lines.

    Raises:
        OSError: the file cannot be opened (from the constructor).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_to_dict(s), default=str) + "\n" for s in spans).encode()
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            os.write(self._fd, data)
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export is already one write(2); nothing is buffered here

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


@dataclass
class ExporterHealth:
    """What one exporter has done — a snapshot (``TracingHandle.health()`` returns copies).

    Fields (counts are since the exporter was set up; times are Unix time, s):
        name: ``otlp``, ``jsonl`` or ``in_memory``.
        exported: spans the exporter accepted (for OTLP: the collector answered OK).
        dropped: spans that will never reach it, all causes together: an export that failed
            (``failed_exports`` calls), the batch queue full (``dropped_queue_full``), still
            queued at shutdown (``dropped_at_shutdown``), or the exporter unavailable.
        last_error: the last error, one line (``Connection refused``, ``UNAVAILABLE: ...``).
        last_error_at: when ``last_error`` happened.
        queued: spans waiting in the batch processor's queue now (OTLP; 0 for the
            exporters that write as each span ends).
        failed_exports: export calls that failed.
        dropped_queue_full: part of ``dropped``: the batch queue (``OTEL_BSP_MAX_QUEUE_SIZE``,
            2048) was full when the span ended.
        dropped_at_shutdown: part of ``dropped``: left in the queue when the process shut
            tracing down (the collector was failing, or the flush ran out of time).
        last_export_at: the last successful export.
        endpoint: where it sends: the OTLP URL, or the JSON-lines file path; None in memory.
        protocol: ``grpc`` or ``http/protobuf`` for OTLP, else None.
    """

    name: str
    exported: int = 0
    dropped: int = 0
    last_error: str | None = None
    last_error_at: float | None = None
    queued: int = 0
    failed_exports: int = 0
    dropped_queue_full: int = 0
    dropped_at_shutdown: int = 0
    last_export_at: float | None = None
    endpoint: str | None = None
    protocol: str | None = None

    @property
    def failing(self) -> bool:
        """The last export attempt met an error (no success since the last error)."""
        return self.last_error_at is not None and (
            self.last_export_at is None or self.last_error_at >= self.last_export_at
        )


# The SDK's exporter messages of the export in progress on this thread go to the exporter
# (see ``capture_sdk_message``): the thread's current CountingExporter.
_current = threading.local()


class CountingExporter(SpanExporter):
    """Wraps an exporter, counts what it exported and dropped, and never raises.

    Tracing fails soft: an exporter error is counted and kept as ``health.last_error``
    rather than propagating into the engine.

    ``describe`` (e.g. ``"OTLP traces to http://c:4318/v1/traces (http/protobuf)"``): when
    set, the first error logs exactly one WARNING naming it and the error; later failures
    are only counted (and logged at debug), until an export succeeds again (one INFO line
    "recovered"; a new outage warns once more). ``queue_size``: reads the batch queue's
    length for ``health.queued``.
    """

    def __init__(self, inner: SpanExporter, name: str, *, describe: str | None = None) -> None:
        self.inner = inner
        self.health = ExporterHealth(name)
        self.describe = describe
        self.queue_size: Callable[[], int] | None = None
        self._lock = threading.Lock()
        self._warned = False
        self._inner_shut_down = False
        self._export_error: str | None = None  # an SDK error message met during this export

    def snapshot(self) -> ExporterHealth:
        """A copy of ``health`` with ``queued`` read now."""
        with self._lock:
            snap = dataclasses.replace(self.health)
        if self.queue_size is not None:
            try:
                snap.queued = int(self.queue_size())
            except Exception:  # noqa: BLE001 - a health read never raises
                pass
        return snap

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._inner_shut_down:  # shut down early (a failing collector): counted, not sent
            self.count_dropped(len(spans), at_shutdown=True)
            return SpanExportResult.FAILURE
        previous, _current.exporter = getattr(_current, "exporter", None), self
        self._export_error = None
        try:
            result = self.inner.export(spans)
            error = (
                None
                if result is SpanExportResult.SUCCESS
                else (self._export_error or "export returned FAILURE")
            )
        except Exception as e:  # noqa: BLE001 - any exporter failure must stay inside tracing
            result, error = SpanExportResult.FAILURE, f"{type(e).__name__}: {e}"
        finally:
            _current.exporter = previous
        if error is None:
            recovered = False
            with self._lock:
                self.health.exported += len(spans)
                self.health.last_export_at = time.time()
                if self._warned:
                    self._warned, recovered = False, True
            if recovered and self.describe:
                logger.info("%s: exporting again (%s)", self.describe, self._counts_text())
        else:
            with self._lock:
                self.health.dropped += len(spans)
                self.health.failed_exports += 1
            self.note_error(error)
        return result

    def note_error(self, error: str) -> None:
        """Record ``error`` as the last error; the first of an outage logs the one WARNING."""
        with self._lock:
            self.health.last_error = error
            self.health.last_error_at = time.time()
            warn, self._warned = not self._warned, True
        if not self.describe:
            return
        if warn:
            logger.warning(
                "%s failed: %s; serving goes on, spans are counted as dropped (exporter health: "
                "engine-top header, /metrics); further failures are not logged",
                self.describe, error,
            )  # fmt: skip
        else:
            logger.debug("%s failed again: %s", self.describe, error)

    def note_sdk_message(self, message: str, level: int) -> None:
        """An SDK exporter log record met during this exporter's export (its own thread)."""
        error = summarize_sdk_error(message)
        if error is not None and level >= logging.WARNING:
            self._export_error = error
            if self._export_error is not None and not self.health.failing:
                self.note_error(error)  # the collector is failing now: say so at once

    def count_dropped(self, n: int, *, queue_full: bool = False, at_shutdown: bool = False) -> None:
        """Count ``n`` spans dropped before reaching the exporter (by the batch processor)."""
        if n <= 0:
            return
        with self._lock:
            self.health.dropped += n
            if queue_full:
                self.health.dropped_queue_full += n
            if at_shutdown:
                self.health.dropped_at_shutdown += n

    def _counts_text(self) -> str:
        h = self.health
        return f"{h.exported} exported, {h.dropped} dropped so far"

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return self.inner.force_flush(timeout_millis)
        except Exception:  # noqa: BLE001
            return False

    def shutdown(self) -> None:
        """Shut the inner exporter down once (a second call does nothing)."""
        with self._lock:
            if self._inner_shut_down:
                return
            self._inner_shut_down = True
        try:
            self.inner.shutdown()
        except Exception as e:  # noqa: BLE001
            with self._lock:
                self.health.last_error = f"shutdown: {type(e).__name__}: {e}"
                self.health.last_error_at = time.time()


_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\")\]]+)")
_MAX_ERROR_LEN = 200


def summarize_sdk_error(message: str) -> str | None:
    """The error in one of the OTLP exporters' log messages, short, or None for no error.

    ``Transient error <E> encountered while exporting ...`` → E; ``Failed to export ...,
    error code: StatusCode.UNAVAILABLE, error details: D`` → ``UNAVAILABLE: D``; an errno
    text inside (``[Errno 111] Connection refused``) → ``Connection refused``.
    """
    text = message.strip()
    if text.startswith("Transient error "):
        details = text.split("Error details: ", 1)[1] if "Error details: " in text else ""
        text = text[len("Transient error ") :].split(" encountered while exporting", 1)[0]
        text = text.removeprefix("StatusCode.")
        if details:
            text = f"{text}: {details}"
    elif "error code: StatusCode." in text:
        code = text.split("error code: StatusCode.", 1)[1].split(",", 1)[0]
        details = text.split("error details: ", 1)[1] if "error details: " in text else ""
        text = f"{code}: {details}" if details else code
    elif text.startswith("Failed to export") and "due to timeout" in text:
        return None  # the HTTP client's closing line; the transient error said why
    elif text.startswith("Failed to export"):
        text = text.replace("Failed to export spans batch ", "")
    elif text.startswith(("Shutdown in progress", "Exporter already shutdown", "OTLP client already")):
        return None
    if (m := _ERRNO.search(text)) is not None:
        text = m.group(1).strip()
    text = " ".join(text.split())
    return text if len(text) <= _MAX_ERROR_LEN else text[: _MAX_ERROR_LEN - 1] + "…"


def capture_sdk_message(record: logging.LogRecord) -> bool:
    """Hand an SDK exporter log record to the exporter exporting on this thread, if any."""
    exporter = getattr(_current, "exporter", None)
    if exporter is None:
        return False
    try:
        exporter.note_sdk_message(record.getMessage(), record.levelno)
    except Exception:  # noqa: BLE001 - logging must never raise into the exporter
        return False
    return True
