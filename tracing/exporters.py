"""Span exporters: in memory (tests), JSON lines (a file per run), and a health counter.

vLLM exports only over OTLP (``vllm/tracing.py``, a ``BatchSpanProcessor``). Glassbox adds
two exporters that need no collector: an in-memory one for tests, and a JSON-lines file
that a person can ``grep`` or ``glassbox trace`` can read after a crash. Every exporter is
wrapped in ``CountingExporter`` so a tracer that silently sends nothing shows up as
"0 exported, N dropped, last error ..." instead of going unnoticed.

Left out: console and Zipkin exporters (OTLP covers collectors).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter as _SdkInMemorySpanExporter,
)


class InMemorySpanExporter(_SdkInMemorySpanExporter):
    """Keeps finished spans in a list, for tests: ``get_finished_spans()``, ``clear()``.

    The SDK's exporter, under Glassbox's name so tests import it from one place.
    """


def _hex_id(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """One finished span as a JSON-ready dict (the line format of ``JsonLinesSpanExporter``).

    Keys: ``name``, ``trace_id`` (32 hex), ``span_id`` / ``parent_span_id`` (16 hex or
    None), ``kind``, ``start_ns`` / ``end_ns`` (Unix epoch, ns), ``duration_ms``,
    ``attributes``, ``status`` ("UNSET" | "OK" | "ERROR"), ``status_description``,
    ``events`` (name, time_ns, attributes; an exception is one), ``resource`` (role, pid, rank).
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
        "resource": {
            "role": res.get("glassbox.role"),
            "pid": res.get("glassbox.pid"),
            "rank": res.get("glassbox.rank"),
        },
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
    """What one exporter has done: spans exported, spans dropped, the last error.

    ``dropped`` counts spans whose export failed (an exception or a FAILURE result). Spans
    a batching processor discards because its queue was full are not seen here.
    """

    name: str
    exported: int = 0
    dropped: int = 0
    last_error: str | None = None
    last_error_at: float | None = None  # Unix time, s


class CountingExporter(SpanExporter):
    """Wraps an exporter, counts what it exported and dropped, and never raises.

    Tracing fails soft: an exporter error is counted and kept as ``health.last_error``
    rather than propagating into the engine.
    """

    def __init__(self, inner: SpanExporter, name: str) -> None:
        self.inner = inner
        self.health = ExporterHealth(name)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
            error = None if result is SpanExportResult.SUCCESS else "export returned FAILURE"
        except Exception as e:  # noqa: BLE001 - any exporter failure must stay inside tracing
            result, error = SpanExportResult.FAILURE, f"{type(e).__name__}: {e}"
        with self._lock:
            if error is None:
                self.health.exported += len(spans)
            else:
                self.health.dropped += len(spans)
                self.health.last_error = error
                self.health.last_error_at = time.time()
        return result

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return self.inner.force_flush(timeout_millis)
        except Exception:  # noqa: BLE001
            return False

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        except Exception as e:  # noqa: BLE001
            self.health.last_error = f"shutdown: {type(e).__name__}: {e}"
