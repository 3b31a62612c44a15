"""Trace context across process boundaries (W3C ``traceparent`` / ``tracestate``).

One start-up is one trace across the whole process tree, and one request one trace from
the HTTP arrival to the last token: the parent injects its current span context into a
plain dict (carried in a spawn payload or a message), and the child attaches it before it
opens its own stages, so they become children of the parent's span.
vLLM: ``TRACE_HEADERS`` and ``extract_trace_context`` in ``vllm/tracing``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACE_HEADERS = ("traceparent", "tracestate")
_propagator = TraceContextTextMapPropagator()


def inject_trace_headers(context: otel_context.Context | None = None) -> dict[str, str]:
    """The current span context (or ``context``'s) as W3C headers ({} when no span is open)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=context)
    return carrier


def extract_trace_context(headers: Mapping[str, str] | None) -> otel_context.Context | None:
    """An OpenTelemetry context from W3C headers, or None when there are none."""
    if not headers or "traceparent" not in headers:
        return None
    return _propagator.extract(dict(headers))


@contextmanager
def attached_trace_context(headers: Mapping[str, str] | None) -> Iterator[None]:
    """Make spans opened inside the ``with`` children of the span in ``headers``."""
    ctx = extract_trace_context(headers)
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)
