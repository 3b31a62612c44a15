"""``stage(...)``: the one way into a stage.

Every lifecycle stage, engine step phase and request span of Glassbox is entered here::

    with stage(catalogue.WORKER_LOAD_MODEL, rank=0) as st:
        load_weights()
        st.set(catalogue.ATTR_MODEL_NAME, name)

That one ``with`` does everything a watcher needs, so no caller can forget a part of it:

1. checks the name (and attribute keys) against the catalogue — a typo raises ``KeyError``;
2. opens an OpenTelemetry span, a child of the current span (nesting gives parent links);
3. records the stage as open in an in-process, per-thread stack (``current_stage()``,
   ``open_stages()``) — what a live view asks "where is this process now?";
4. for ``lifecycle`` stages, atomically rewrites the process's status file, so the stage
   can be named even if the process then freezes (``step`` stages skip this: no file I/O
   per step);
5. calls the stage hooks (``add_stage_hook``): the single place where live telemetry and
   fault injection (hang, crash, slow) plug in. An ``enter`` hook runs *inside* the stage,
   so a fault it raises looks exactly like the stage failing;
6. on the way out: records an exception and an ERROR status if the body raised (and
   re-raises), ends the span, logs ``left <stage> (<ms> ms)`` at DEBUG.

Without ``setup_tracing``, or with no exporter, there is no span (nothing could see it),
but the stack, hooks and log still work.

vLLM's counterpart is the 0.33 ``instrument(span_name=...)`` decorator in
``vllm/tracing/``; it only opens spans. The stack, status file and hooks are Glassbox's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from tracing import catalogue, setup

logger = logging.getLogger(__name__)

StageHook = Callable[[str, str, Mapping[str, Any]], None]
"""``hook(event, name, attrs)``. Events: ``enter`` and ``exit`` (stages), ``wait_start`` and
``wait_end`` (``tracing.waits``), ``fault`` (``record_fault``: an injected fault strikes).
For ``exit``, ``attrs`` also holds ``duration_ms`` and ``error`` (``"Type: message"`` or None); these two are hook fields, not span attributes."""

_hooks: tuple[StageHook, ...] = ()  # replaced, never mutated: emitters iterate a snapshot
_hooks_lock = threading.Lock()


def add_stage_hook(hook: StageHook) -> Callable[[], None]:
    """Call ``hook`` on every stage and wait event of this process; returns its remover.

    A hook that raises on ``enter`` fails the stage (the fault-injection path); keep hooks
    fast, as they run on every step stage too.
    """
    global _hooks
    with _hooks_lock:
        _hooks = (*_hooks, hook)
    return lambda: remove_stage_hook(hook)


def remove_stage_hook(hook: StageHook) -> None:
    """Stop calling ``hook``; a hook that is not registered is ignored."""
    global _hooks
    with _hooks_lock:
        _hooks = tuple(h for h in _hooks if h is not hook)


def emit(event: str, name: str, attrs: Mapping[str, Any]) -> None:
    """Send one event to every hook (used by ``stage`` and ``tracing.waits``)."""
    for hook in _hooks:
        hook(event, name, attrs)


@dataclass(slots=True)
class OpenStage:
    """A stage that has been entered and not left yet."""

    name: str
    level: str
    thread: str
    entered_at: float  # Unix time, s


# Each thread's stack is a plain list touched only by its own thread; _stacks maps thread
# id → that list so other threads can read every open stage (the status file, live views).
_local = threading.local()
_stacks: dict[int, list[OpenStage]] = {}
_stacks_lock = threading.Lock()
_last_finished: dict[str, Any] | None = None
_faults: list[dict[str, Any]] = []  # injected faults that struck here (record_fault)
_placement: dict[str, str] = {}  # where a cluster scheduler put this process (set_placement)
_pause: dict[str, Any] | None = None  # a deliberate pause now (set_pause; tracing.slow_motion)


def _thread_stack() -> list[OpenStage]:
    try:
        return _local.stack
    except AttributeError:
        stack: list[OpenStage] = []
        _local.stack = stack
        with _stacks_lock:
            # Forget finished threads' (empty) stacks so the map does not grow forever.
            alive = {t.ident for t in threading.enumerate()}
            for ident in [i for i, s in _stacks.items() if not s and i not in alive]:
                del _stacks[ident]
            _stacks[threading.get_ident()] = stack
        return stack


def current_stage() -> str | None:
    """The innermost open stage of the calling thread, or None."""
    stack = _thread_stack()
    return stack[-1].name if stack else None


def raised_in(exc: BaseException) -> str | None:
    """The innermost stage ``exc`` escaped (raised inside it), or None when it was raised
    outside every stage."""
    return getattr(exc, "__glassbox_stage__", None)


def open_stages() -> list[OpenStage]:
    """Every open stage of this process, all threads, oldest first."""
    with _stacks_lock:
        stacks = [list(s) for s in _stacks.values()]
    return sorted((st for s in stacks for st in s), key=lambda st: st.entered_at)


def _write_status(handle: setup.TracingHandle) -> None:
    lifecycle = [s for s in open_stages() if s.level == catalogue.LIFECYCLE]
    innermost = lifecycle[-1] if lifecycle else None
    handle.write_status(
        {
            "stage": innermost.name if innermost else None,
            "stage_stack": [s.name for s in lifecycle],
            "entered_at": innermost.entered_at if innermost else None,
            "last_finished": _last_finished,
            "faults": list(_faults),
            "placement": dict(_placement),
            "runs_as": dict(handle.runs_as),
            "pause": _pause,
        }
    )


def set_pause(pause: dict[str, Any] | None) -> None:
    """Say that this process pauses on purpose now (``stage``, ``seconds``, ``since``, ``env``)
    or no longer (None): kept in its status file, for ``glassbox ps`` (``tracing.slow_motion``).
    Never raises."""
    global _pause
    _pause = pause
    handle = setup._handle
    if handle is not None:
        _write_status(handle)


def set_placement(placement: dict[str, str]) -> None:
    """Record where a cluster scheduler placed this process (a Ray actor: ``node_id``,
    ``node_ip``, ``actor_id``) in its status file, for ``glassbox ps``, engine-top and
    ``glassbox doctor``. Never raises."""
    _placement.clear()
    _placement.update({k: str(v) for k, v in placement.items()})
    handle = setup._handle
    if handle is not None:
        _write_status(handle)


def set_runs_as(runs_as: dict[str, object]) -> None:
    """Record how this worker runs its model (device, dtype, compile mode, attention
    backend, CPU threads) in its status file, for ``glassbox ps`` and ``glassbox doctor``;
    later calls update the keys they name; kept with this process's tracing handle (none:
    nothing recorded). Never raises."""
    handle = setup._handle
    if handle is not None:
        handle.runs_as.update({k: str(v) for k, v in runs_as.items()})
        _write_status(handle)


def forget_faults() -> None:
    """Forget the faults ``record_fault`` recorded (``tracing.faults.uninstall_faults``)."""
    _faults.clear()


def record_fault(spec: str, name: str, kind: str) -> None:
    """Say that injected fault ``spec`` (of ``kind``) strikes now, in stage ``name``.

    Called by ``tracing.faults`` just before it acts, so the fault is visible before it
    hangs, freezes or ends the process: the status file gains it (``ProcessStatus.faults``,
    read by ``glassbox doctor`` and ``glassbox ps``) and the hooks get a ``fault`` event
    (live telemetry sends it with the next heartbeat, at once). Never raises.
    """
    entry = {
        "spec": spec,
        "stage": name,
        "kind": kind,
        "struck_at": time.time(),
        "thread": threading.current_thread().name,
    }
    _faults.append(entry)
    handle = setup._handle
    if handle is not None:
        _write_status(handle)
    try:
        emit("fault", name, entry)
    except Exception:  # noqa: BLE001 - a hook's failure must not change what the fault does
        logger.debug("a stage hook failed on a fault event", exc_info=True)


class Stage:
    """One entered stage; ``with stage(...) as st`` gives this object.

    Use ``st.set(key, value)`` to add an attribute learned inside the stage; ``st.span`` is
    the OpenTelemetry span (None when tracing is not set up).
    """

    __slots__ = ("name", "level", "attributes", "span", "_token", "_t0", "_t0_ns", "_record", "_stack")

    def __init__(self, name: str, attributes: Mapping[str, Any]) -> None:
        self.name = name
        self.level = catalogue.span_def(name).level
        self.attributes = {catalogue.attr_key(k): v for k, v in attributes.items() if v is not None}
        self.span: trace.Span | None = None
        self._token: object | None = None

    def set(self, key: str, value: Any) -> None:
        """Add one attribute (full key or keyword alias; None is ignored).

        Raises:
            KeyError: ``key`` is not in the catalogue.
        """
        key = catalogue.attr_key(key)
        if value is None:
            return
        self.attributes[key] = value
        if self.span is not None:
            self.span.set_attribute(key, value)

    def __enter__(self) -> Stage:
        handle = setup._handle
        if handle is not None and handle.recording:
            # The thread is on the span too (OpenTelemetry's thread.name): a trace shows one
            # lane per process and thread (``glassbox trace``).
            self.span = handle.tracer.start_span(
                self.name,
                attributes={**self.attributes, catalogue.ATTR_THREAD_NAME: threading.current_thread().name},
            )
            self._token = otel_context.attach(trace.set_span_in_context(self.span))
        self._record = OpenStage(self.name, self.level, threading.current_thread().name, time.time())
        self._stack = _thread_stack()
        self._stack.append(self._record)
        self._t0 = time.perf_counter()
        self._t0_ns = time.time_ns()
        if self.level == catalogue.LIFECYCLE and handle is not None:
            _write_status(handle)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("entered %s", self.name)
        if _hooks:
            try:
                emit("enter", self.name, self.attributes)
            except BaseException as e:
                self.__exit__(type(e), e, e.__traceback__)
                raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        global _last_finished
        duration_ms = (time.perf_counter() - self._t0) * 1e3
        stack = self._stack
        if stack and stack[-1] is self._record:
            stack.pop()
        elif self._record in stack:  # left out of order (generators): drop just this one
            stack.remove(self._record)
        error = f"{exc_type.__name__}: {exc}" if exc_type is not None else None
        if exc_type is SystemExit and getattr(exc, "code", None) in (0, None):
            # A clean stop (SIGTERM → SystemExit(0)) that arrived inside a stage: the stage was
            # cut short, not failed.
            error, exc = None, None
            if self.span is not None:
                self.span.add_event(catalogue.EVENT_STOPPED_BY_SHUTDOWN)
        if exc is not None and getattr(exc, "__glassbox_stage__", None) is None:
            # The innermost stage an exception escaped: what its crash report names, even
            # when it is written after every stage has unwound (``raised_in``).
            try:
                exc.__glassbox_stage__ = self.name  # type: ignore[union-attr]
            except AttributeError:  # an exception type with __slots__
                pass
        span = self.span
        if span is not None:
            if exc is not None:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, error))
            span.end()
            otel_context.detach(self._token)
        if span is None and setup._handle is None:
            _hold_early(self, error)
        if self.level == catalogue.LIFECYCLE:
            _last_finished = {
                "name": self.name,
                "duration_ms": round(duration_ms, 3),
                "error": error,
                "finished_at": time.time(),
            }
            handle = setup._handle
            if handle is not None:
                _write_status(handle)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("left %s (%.3f ms)%s", self.name, duration_ms, f" with {error}" if error else "")
        if _hooks:
            emit("exit", self.name, {**self.attributes, "duration_ms": duration_ms, "error": error})


# The stage that runs before this process can set up its tracing (``cli.validate_config``:
# tracing is set up from the config it builds): its last run is kept here and recorded by
# ``startup_trace`` once tracing is up.
_EARLY_STAGES = frozenset({catalogue.CLI_VALIDATE_CONFIG})
_early: list[tuple[str, dict[str, Any], int, int, str | None]] = []


def _hold_early(st: Stage, error: str | None) -> None:
    if st.name in _EARLY_STAGES:
        attributes = {**st.attributes, catalogue.ATTR_THREAD_NAME: threading.current_thread().name}
        _early[:] = [(st.name, attributes, st._t0_ns, time.time_ns(), error)]


def forget_early_stages() -> None:
    """Drop the stages held from before tracing was set up (tests)."""
    _early.clear()


class startup_trace:  # noqa: N801 - used as a context manager, like ``stage``
    """``with startup_trace():`` around an owner's start-up: its stages make one trace.

    An owner (``APIServer_0``, an offline ``LLM``) enters several top-level start-up stages
    one after the other: ``cli.validate_config`` (before tracing is set up: held until
    now), ``engine_core.handshake`` or ``llm.init``, ``api_server.start_api_servers``. Each
    is a root span; inside this block the roots share one trace id, the process's start-up
    trace (``glassbox trace --startup`` draws them all). The held stage is recorded first,
    with the times it ran. When a span is current already (an ``LLM`` built inside the
    caller's own span), the start-up's stages are its children as usual. On exit, root spans
    get trace ids of their own again: each request served afterwards is its own trace.
    """

    def __enter__(self) -> startup_trace:
        import random

        self._previous = setup.startup_ids.trace_id
        if not trace.get_current_span().get_span_context().is_valid:
            setup.startup_ids.trace_id = random.SystemRandom().getrandbits(128) or 1
        held, _early[:] = list(_early), []
        for name, attributes, start_ns, end_ns, error in held:
            handle, attrs = _recording_handle(name, attributes)
            if handle is None:
                continue
            span = handle.tracer.start_span(name, attributes=attrs, start_time=start_ns)
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, error))
            span.end(end_time=end_ns)
        return self

    def __exit__(self, *exc: object) -> None:
        setup.startup_ids.trace_id = self._previous


def stage(name: str, /, **attributes: Any) -> Stage:
    """Enter stage ``name`` (a ``catalogue`` span name) with ``attributes``.

    Attribute keys may be full keys (``**{catalogue.ATTR_RANK: 0}``) or keyword aliases
    (``rank=0``); None values are skipped.

    Raises:
        KeyError: ``name`` or an attribute key is not in the catalogue.
    """
    return Stage(name, attributes)


def is_recording() -> bool:
    """Whether this process's spans go anywhere (an exporter is set up): callers skip the
    work of building request-level spans when they would not be recorded."""
    handle = setup._handle
    return handle is not None and handle.recording


def start_span(
    name: str,
    *,
    attributes: Mapping[str, Any] | None = None,
    parent: otel_context.Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    start_ns: int | None = None,
) -> trace.Span:
    """Open a span that outlives any one ``with`` block (e.g. an HTTP request served across
    an async stream): not on the stage stack, not seen by stage hooks; end it with
    ``span.end()``. A non-recording span when tracing records nothing.

    Raises:
        KeyError: ``name`` or an attribute key is not in the catalogue.
    """
    handle, attrs = _recording_handle(name, attributes)
    if handle is None:
        return trace.INVALID_SPAN
    return handle.tracer.start_span(name, context=parent, kind=kind, attributes=attrs, start_time=start_ns)


def add_span_event(span: trace.Span, name: str, attributes: Mapping[str, Any] | None = None) -> None:
    """Add the catalogue event ``name`` to ``span`` (now), e.g. ``glassbox.client_disconnected``
    on ``api_server.request``.

    Raises:
        KeyError: ``name`` or an attribute key is not in the catalogue.
    """
    catalogue.event_def(name)
    attrs = {catalogue.attr_key(k): v for k, v in (attributes or {}).items() if v is not None}
    span.add_event(name, attributes=attrs)


def _recording_handle(
    name: str, attributes: Mapping[str, Any] | None
) -> tuple[setup.TracingHandle | None, dict[str, Any]]:
    """Check ``name`` and the attribute keys against the catalogue; the handle (None when
    nothing is recorded) and the attributes under their full keys, None values dropped."""
    catalogue.span_def(name)
    attrs = {catalogue.attr_key(k): v for k, v in (attributes or {}).items() if v is not None}
    handle = setup._handle
    return (handle if handle is not None and handle.recording else None), attrs


def record_span(
    name: str,
    *,
    start_ns: int,
    end_ns: int | None = None,
    attributes: Mapping[str, Any] | None = None,
    parent: otel_context.Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    links: Sequence[trace.SpanContext] = (),
) -> None:
    """Record a span whose timing is known after the fact (e.g. ``llm_request`` at finish).

    Args:
        name: a catalogue span name.
        start_ns: start, Unix epoch nanoseconds (e.g. the request's arrival time).
        end_ns: end, same clock; now when None.
        attributes: catalogue keys or aliases; None values are skipped.
        parent: context to parent the span under (e.g. one extracted from ``traceparent``);
            the current context when None.
        kind: span kind (vLLM records ``llm_request`` as SERVER).
        links: span contexts this span relates to without being their child (a request's
            prefill links the engine steps that computed it).

    Raises:
        KeyError: ``name`` or an attribute key is not in the catalogue.
    """
    handle, attrs = _recording_handle(name, attributes)
    if handle is None:
        return
    span_links = [trace.Link(c) for c in links if c is not None and c.is_valid]
    span = handle.tracer.start_span(
        name, context=parent, kind=kind, attributes=attrs, start_time=start_ns, links=span_links
    )
    span.end(end_time=end_ns)
