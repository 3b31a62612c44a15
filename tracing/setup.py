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

**OTLP** (``docs/otlp.md``): ``resolve_otlp`` picks the endpoint and protocol the way the
OpenTelemetry spec says — ``--otlp-traces-endpoint``, else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
else ``OTEL_EXPORTER_OTLP_ENDPOINT`` (+ ``/v1/traces`` for HTTP); the protocol from
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``, else ``OTEL_EXPORTER_OTLP_PROTOCOL``, else inferred
from the endpoint (a ``/v1/traces`` path or port 4318: ``http/protobuf``), else ``grpc``
(vLLM's default). Spans go through a ``BatchSpanProcessor`` whose drops (queue full, left at
shutdown) are counted; the SDK exporters' own log lines are taken in (one WARNING per outage,
from ``CountingExporter``, the rest at debug). ``TracingHandle.health()`` is the typed view.

Sampling: the provider is built without a sampler, so the SDK reads ``OTEL_TRACES_SAMPLER``
/ ``OTEL_TRACES_SAMPLER_ARG`` (default ``parentbased_always_on``); a span not sampled is
not exported (and not counted).

Mirrors vLLM's ``init_tracer`` in ``vllm/tracing.py`` (OTLP only, global provider,
``BatchSpanProcessor``). Left out: metrics providers. A forked child inherits the parent's
handle and must call ``setup_tracing`` again.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgspec
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

from tracing import catalogue
from tracing import run_dir as run_dirs
from tracing.exporters import (
    CountingExporter,
    ExporterHealth,
    InMemorySpanExporter,
    JsonLinesSpanExporter,
    capture_sdk_message,
)

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
        otlp: where and how spans go over OTLP (``resolve_otlp``), or None.
        runs_as: how this process's worker runs its model (``tracing.stage.set_runs_as``),
            kept with the handle so a new setup starts without an old engine's record.
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
    otlp: OtlpTarget | None = None
    runs_as: dict[str, str] = field(default_factory=dict)
    _status_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def get_finished_spans(self) -> tuple[ReadableSpan, ...]:
        """Spans the in-memory exporter holds, oldest first (empty without ``in_memory``)."""
        return self.in_memory.get_finished_spans() if self.in_memory is not None else ()

    def clear_finished_spans(self) -> None:
        if self.in_memory is not None:
            self.in_memory.clear()

    def health(self) -> list[ExporterHealth]:
        """One ``ExporterHealth`` per exporter, in setup order (``in_memory``, ``jsonl``,
        ``otlp``), then one per exporter asked for but not built (``exported`` 0,
        ``last_error`` why).

        Stable API (``/metrics``, the stats log line and live telemetry read it): each item is
        a *copy* taken now — ``exported``, ``dropped`` (all causes), ``queued`` (the batch
        queue now), ``failed_exports``, ``dropped_queue_full``, ``dropped_at_shutdown``,
        ``last_error`` / ``last_error_at``, ``last_export_at``, ``endpoint``, ``protocol``;
        see ``tracing.exporters.ExporterHealth``. Cheap (no I/O); any thread.
        """
        return [e.snapshot() for e in self.exporters] + [dataclasses.replace(h) for h in self.unavailable]

    def health_summary(self) -> str:
        """One line for logs: ``jsonl: 12 exported, 0 dropped; otlp: 0 exported, 3 dropped,
        5 queued (last error: Connection refused)``."""
        health = self.health()
        if not health:
            return "no exporters"
        parts = []
        for h in health:
            text = f"{h.name}: {h.exported} exported, {h.dropped} dropped"
            if h.queued:
                text += f", {h.queued} queued"
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


class _StartupIds(RandomIdGenerator):
    """Random ids, except the trace id of a root span started while an owner's start-up
    runs (``tracing.stage.startup_trace`` sets ``trace_id``): every root stage of the
    start-up (``cli.validate_config``, ``engine_core.handshake``, ...) is then a root of
    the one start-up trace, each with no parent."""

    trace_id: int | None = None

    def generate_trace_id(self) -> int:
        return self.trace_id if self.trace_id is not None else super().generate_trace_id()


startup_ids = _StartupIds()
_setup_lock = threading.Lock()
_atexit_registered = False


def get_handle() -> TracingHandle | None:
    """The current handle, or None when ``setup_tracing`` was not called (or was shut down)."""
    return _handle


# ------------------------------------------------------------------------------ OTLP

OTLP_PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_OTLP_PROTOCOL = "grpc"  # vLLM's default (the spec's is http/protobuf)
OTLP_HTTP_PORT, OTLP_GRPC_PORT = 4318, 4317
TRACES_PATH = "/v1/traces"
FLAG_OTLP_ENDPOINT = "--otlp-traces-endpoint"
ENV_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
ENV_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
ENV_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
ENV_TRACES_SAMPLER = "OTEL_TRACES_SAMPLER"
TRACES_SAMPLERS = (
    "always_on", "always_off", "traceidratio",
    "parentbased_always_on", "parentbased_always_off", "parentbased_traceidratio",
)  # fmt: skip
SHUTDOWN_FLUSH_TIMEOUT_S = 5.0  # at shutdown, queued spans get this long to leave
BATCH_SCHEDULE_DELAY_MS = 500


class OtlpSettingError(ValueError):
    """An OTLP setting is not allowed: ``setting`` (flag or variable), ``value``, ``allowed``.

    ``engine.config.ObservabilityConfig`` turns it into a ``ConfigError`` (exit status 2).
    """

    def __init__(self, setting: str, value: Any, allowed: str) -> None:
        self.setting, self.value, self.allowed = setting, value, allowed
        super().__init__(f"{setting}: invalid value {value!r} ({allowed})")


@dataclass(frozen=True)
class OtlpTarget:
    """Where and how spans go over OTLP (``resolve_otlp``).

    ``endpoint``: the URL (or gRPC ``host:port``) given to the exporter as is.
    ``protocol``: ``grpc`` or ``http/protobuf``. ``endpoint_from`` / ``protocol_from``: the
    flag or variable each came from; ``protocol_from`` is ``"inferred: ..."`` or
    ``"default"`` when no protocol variable is set.
    """

    endpoint: str
    protocol: str
    endpoint_from: str
    protocol_from: str

    def describe(self) -> str:
        return f"OTLP traces to {self.endpoint} ({self.protocol})"

    def explain(self) -> str:
        """The one INFO line: where spans go, over what, and why that protocol."""
        if self.protocol_from == "default":
            why = f"not set, {DEFAULT_OTLP_PROTOCOL} is vLLM's default (set {ENV_TRACES_PROTOCOL} to choose)"
        elif self.protocol_from.startswith("inferred"):
            why = f"{self.protocol_from} (set {ENV_TRACES_PROTOCOL} to choose)"
        else:
            why = f"from {self.protocol_from}"
        return f"{self.describe()}: endpoint from {self.endpoint_from}; protocol {why}"


def _env(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    value = value.strip() if value is not None else None
    return value or None  # the spec: an empty value is unset


def _check_endpoint(setting: str, endpoint: str, protocol: str) -> None:
    if any(c.isspace() for c in endpoint):
        raise OtlpSettingError(setting, endpoint, "a URL has no spaces")
    if "://" not in endpoint:
        if protocol == "grpc":
            host, sep, port = endpoint.rpartition(":")
            if sep and host and port.isdigit() and 0 < int(port) < 65536 and "/" not in endpoint:
                return  # host:port, as gRPC takes it
        raise OtlpSettingError(
            setting, endpoint,
            "an OTLP endpoint is a URL like http://127.0.0.1:4318/v1/traces (http/protobuf) or "
            "http://127.0.0.1:4317 (grpc)",
        )  # fmt: skip
    parts = urlsplit(endpoint)
    schemes = ("http", "https") if protocol == "http/protobuf" else ("http", "https", "grpc", "grpcs")
    if parts.scheme.lower() not in schemes:
        raise OtlpSettingError(
            setting, endpoint, f"the scheme must be one of {', '.join(schemes)} for {protocol}"
        )
    try:
        port = parts.port
    except ValueError:
        raise OtlpSettingError(setting, endpoint, "the port must be a number in 1..65535") from None
    if not parts.hostname:
        raise OtlpSettingError(setting, endpoint, "the URL names no host")
    if port == 0:
        raise OtlpSettingError(setting, endpoint, "the port must be a number in 1..65535")


def _infer_protocol(endpoint: str) -> tuple[str, str]:
    if "://" in endpoint:
        parts = urlsplit(endpoint)
        path, port = parts.path.rstrip("/"), None
        try:
            port = parts.port
        except ValueError:
            pass
    else:
        path, port = "", int(endpoint.rpartition(":")[2]) if endpoint.rpartition(":")[2].isdigit() else None
    if path.endswith(TRACES_PATH):
        return "http/protobuf", f"inferred from the {TRACES_PATH} path"
    if port == OTLP_HTTP_PORT:
        return "http/protobuf", f"inferred from port {OTLP_HTTP_PORT}"
    if port == OTLP_GRPC_PORT:
        return "grpc", f"inferred from port {OTLP_GRPC_PORT}"
    return DEFAULT_OTLP_PROTOCOL, "default"


def resolve_otlp(endpoint: str | None = None, environ: Mapping[str, str] | None = None) -> OtlpTarget | None:
    """Where OTLP spans go, or None when no endpoint is set anywhere.

    Endpoint: ``endpoint`` (the ``--otlp-traces-endpoint`` value; used as is, like the
    spec's signal-specific variable), else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (as is),
    else ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base URL: ``/v1/traces`` is appended for
    http/protobuf; gRPC takes it as is). Protocol: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``,
    else ``OTEL_EXPORTER_OTLP_PROTOCOL``, else inferred from the endpoint — a path ending in
    ``/v1/traces`` or port 4318 means ``http/protobuf``, port 4317 ``grpc`` — else ``grpc``
    (vLLM's default). Empty values count as unset.

    Raises:
        OtlpSettingError: a protocol other than grpc / http/protobuf, or a malformed
            endpoint; it names the flag or variable.
    """
    env = os.environ if environ is None else environ
    base = False
    value = endpoint.strip() if endpoint else None
    source = FLAG_OTLP_ENDPOINT
    if not value and (value := _env(env, ENV_TRACES_ENDPOINT)):
        source = ENV_TRACES_ENDPOINT
    if not value and (value := _env(env, ENV_ENDPOINT)):
        source, base = ENV_ENDPOINT, True
    if not value:
        return None
    protocol = protocol_from = None
    for name in (ENV_TRACES_PROTOCOL, ENV_PROTOCOL):
        if (protocol := _env(env, name)) is not None:
            protocol_from = name
            if protocol not in OTLP_PROTOCOLS:
                extra = (
                    " (http/json is not supported by the Python exporter)" if protocol == "http/json" else ""
                )
                raise OtlpSettingError(name, protocol, f"must be grpc or http/protobuf{extra}")
            break
    _check_endpoint(source, value, protocol or "grpc")
    if protocol is None:
        protocol, protocol_from = _infer_protocol(value)
        if protocol == "http/protobuf":
            _check_endpoint(source, value, protocol)
    if base and protocol == "http/protobuf" and not urlsplit(value).path.rstrip("/").endswith(TRACES_PATH):
        value = value.rstrip("/") + TRACES_PATH
    return OtlpTarget(endpoint=value, protocol=protocol, endpoint_from=source, protocol_from=protocol_from)


def check_traces_sampler(environ: Mapping[str, str] | None = None) -> None:
    """Raise ``OtlpSettingError`` for an ``OTEL_TRACES_SAMPLER`` the SDK does not know
    (the SDK itself would only log a warning and sample everything)."""
    env = os.environ if environ is None else environ
    sampler = _env(env, ENV_TRACES_SAMPLER)
    if sampler is not None and sampler.lower() not in TRACES_SAMPLERS:
        raise OtlpSettingError(ENV_TRACES_SAMPLER, sampler, f"must be one of {', '.join(TRACES_SAMPLERS)}")


def _otlp_exporter(target: OtlpTarget) -> SpanExporter:
    if target.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=target.endpoint)


class _SdkExporterLog(logging.Handler):
    """Takes the OTLP exporters' own log records: the export in progress on the thread gets
    the error (its exporter logs the one WARNING), and each record goes on at debug level on
    ``tracing.otlp`` — no retry or traceback storm in the process's log."""

    def emit(self, record: logging.LogRecord) -> None:
        capture_sdk_message(record)
        if _sdk_debug.isEnabledFor(logging.DEBUG):
            _sdk_debug.debug("%s: %s", record.name, record.getMessage())


class _QueueFullFilter(logging.Filter):
    """The batch processor's "Queue full, dropping Span." — counted in health instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Queue full", "Shutdown called, ignoring"))


_sdk_debug = logging.getLogger("tracing.otlp.sdk")
_sdk_logs_tamed = False


def _tame_sdk_logging() -> None:
    global _sdk_logs_tamed
    if _sdk_logs_tamed:
        return
    _sdk_logs_tamed = True
    sdk_exporters = logging.getLogger("opentelemetry.exporter")  # otlp.proto.grpc / .http, http transport
    sdk_exporters.addHandler(_SdkExporterLog())
    sdk_exporters.propagate = False
    if sdk_exporters.level == logging.NOTSET or sdk_exporters.level > logging.DEBUG:
        sdk_exporters.setLevel(logging.DEBUG)
    logging.getLogger("opentelemetry.sdk._shared_internal").addFilter(_QueueFullFilter())


class _CountingBatchSpanProcessor(BatchSpanProcessor):
    """A ``BatchSpanProcessor`` that never drops silently: a span that finds the queue full
    (its oldest span is discarded) and spans still queued at shutdown are counted in the
    exporter's health; the queue length is ``health.queued``. Shutdown is bounded: queued
    spans get ``SHUTDOWN_FLUSH_TIMEOUT_S``; a failing collector gets no flush at all."""

    def __init__(self, counted: CountingExporter) -> None:
        super().__init__(counted, schedule_delay_millis=BATCH_SCHEDULE_DELAY_MS)
        self._counted = counted
        bp = getattr(self, "_batch_processor", None)
        queue = getattr(bp, "_queue", None)
        self._queue = queue
        self._max_queue = getattr(bp, "_max_queue_size", None)
        if queue is not None:
            counted.queue_size = queue.__len__

    def on_end(self, span: ReadableSpan) -> None:
        if not (span.context and span.context.trace_flags.sampled):
            return
        bp = getattr(self, "_batch_processor", None)
        if bp is not None and getattr(bp, "_shutdown", False):
            self._counted.count_dropped(1, at_shutdown=True)
            return
        if self._queue is not None and self._max_queue is not None and len(self._queue) >= self._max_queue:
            self._counted.count_dropped(1, queue_full=True)
        super().on_end(span)

    def shutdown(self) -> None:
        bp = getattr(self, "_batch_processor", None)
        if self._counted.health.failing:
            # The collector is failing: abort the export in progress (its retries) at once.
            self._counted.shutdown()
        if bp is not None and hasattr(bp, "shutdown"):
            # While the last spans are flushed, a collector that starts failing aborts the
            # flush at once (instead of retrying for the whole timeout).
            done = threading.Event()

            def watch() -> None:
                while not done.wait(0.05):
                    if self._counted.health.failing:
                        self._counted.shutdown()
                        return

            watcher = threading.Thread(target=watch, name="otlp-shutdown-watch", daemon=True)
            watcher.start()
            try:
                bp.shutdown(timeout_millis=int(SHUTDOWN_FLUSH_TIMEOUT_S * 1000))
            finally:
                done.set()
                watcher.join(1)
        else:  # pragma: no cover - another SDK layout
            super().shutdown()
        self._counted.shutdown()
        left = len(self._queue) if self._queue is not None else 0
        if left:
            self._queue.clear()
            self._counted.count_dropped(left, at_shutdown=True)


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
        otlp_endpoint: also send spans over OTLP (``--otlp-traces-endpoint``). When None,
            the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``
            are read; the protocol as ``resolve_otlp`` says. A bad setting, or an exporter
            package missing, logs one warning and tracing goes on without OTLP (the config
            check in the first process has already refused bad settings with exit 2).
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
        provider = TracerProvider(
            resource=Resource.create(attributes), shutdown_on_exit=False, id_generator=startup_ids
        )
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
            jsonl = _add(handle, JsonLinesSpanExporter(trace_file), "jsonl", batch=False)
            jsonl.health.endpoint = os.fspath(trace_file)
        _add_otlp(handle, otlp_endpoint)
        handle.recording = bool(handle.exporters)
        handle.write_status({"stage": None, "stage_stack": [], "entered_at": None, "last_finished": None})
        _handle = handle
        if not _atexit_registered:
            atexit.register(shutdown_tracing)
            _atexit_registered = True
        # GLASSBOX_FAULT (--inject-fault): arm this process's faults, or disarm earlier ones
        # when it is unset (imported here: tracing.faults imports tracing.stage, which imports us).
        from tracing.faults import install_faults

        install_faults(role)
        from tracing.slow_motion import install_stage_delay

        install_stage_delay(role)  # GLASSBOX_STARTUP_STAGE_DELAY_S: start-up in slow motion
        return handle


def _add(
    handle: TracingHandle, exporter: SpanExporter, name: str, *, batch: bool, describe: str | None = None
) -> CountingExporter:
    counted = CountingExporter(exporter, name, describe=describe)
    # Network exports go through a background thread (a slow collector must not slow a
    # step); local ones are written as each span ends.
    processor = _CountingBatchSpanProcessor(counted) if batch else SimpleSpanProcessor(counted)
    handle.provider.add_span_processor(processor)
    handle.exporters.append(counted)
    return counted


def _add_otlp(handle: TracingHandle, endpoint: str | None) -> None:
    try:
        target = resolve_otlp(endpoint)
    except OtlpSettingError as e:
        message = f"OTLP traces disabled: {e}"
        logger.warning("%s", message)
        handle.warnings.append(message)
        # Listed in health() as never exporting, so the gap is visible, not silent.
        handle.unavailable.append(ExporterHealth("otlp", last_error=message, last_error_at=time.time()))
        return
    if target is None:
        return
    try:
        exporter = _otlp_exporter(target)
    except ImportError as e:
        message = f"{target.describe()} disabled: {e}"
        logger.warning("%s (pip install opentelemetry-exporter-otlp-proto-%s)", message,
                       "grpc" if target.protocol == "grpc" else "http")  # fmt: skip
        handle.warnings.append(message)
        handle.unavailable.append(
            ExporterHealth("otlp", last_error=message, last_error_at=time.time(),
                           endpoint=target.endpoint, protocol=target.protocol)
        )  # fmt: skip
        return
    _tame_sdk_logging()
    counted = _add(handle, exporter, "otlp", batch=True, describe=target.describe())
    counted.health.endpoint, counted.health.protocol = target.endpoint, target.protocol
    handle.otlp = target
    # One INFO line in the first process of the tree; its children say it at debug level.
    top = multiprocessing.parent_process() is None
    logger.log(logging.INFO if top else logging.DEBUG, "%s", target.explain())


def _shutdown_locked() -> None:
    global _handle
    handle, _handle = _handle, None
    if handle is None:
        return
    try:
        handle.provider.shutdown()  # flushes batch processors, closes the JSON-lines file
    except Exception as e:  # noqa: BLE001 - shutting tracing down must never raise
        logger.warning("tracing shutdown failed: %s", e)
    health = handle.health()
    if any(h.dropped for h in health):
        # Not silent: what never reached its exporter, counted (the WARNING came earlier).
        logger.info("tracing shut down: %s", handle.health_summary())
    elif health:
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
