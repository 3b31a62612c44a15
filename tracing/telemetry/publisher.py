"""One process's live telemetry: a ZMQ publisher that never makes the engine wait.

Each process of the tree starts one ``TelemetryPublisher`` (``start_telemetry(run_dir,
role)``); engine code reaches it anywhere with ``telemetry()``, which is ``NULL_PUBLISHER``
(the same methods, doing nothing) when telemetry is off, so no caller needs a None guard
(``get_publisher()`` is the publisher or None, for code that asks whether one runs). It
binds an XPUB socket on ``telemetry_address(run_dir, role)`` (``ipc://<run dir>/<role>.tel``;
the run directory is 0700) and publishes the events of ``tracing.telemetry.events``:

- ``StageEntered``/``StageLeft``/``WaitStarted``/``WaitEnded`` from a stage hook
  (``tracing.stage.add_stage_hook``; no second instrumentation path). Lifecycle stages and
  waits are always published; ``step`` and ``request`` level stages at most
  ``stage_rate`` per second per name (an exit is published when its enter was, or when a
  heartbeat listed the stage as open); the rest are counted as dropped ``stage``.
- ``Heartbeat`` every ``interval_s`` (≤ 1 s) from a daemon thread of its own, so a busy
  loop that stopped shows as an old ``last_step_at`` while heartbeats go on, and a frozen
  process as heartbeats that stop; then ``Gauges`` from the gauge providers, ``Dropped``
  when anything was dropped, and a ``Snapshot`` every second for late subscribers.
- ``StepRecord`` (``publish_step``), sampled when steps come faster than
  ``max_steps_per_s``: every k-th is kept, the others counted as dropped ``step``.
- ``RequestEvent`` (``publish_request_event``; over 2000 a second sampled, except a
  request's ``finished``/``aborted``) and immediate gauge pushes (``publish_gauges``,
  coalesced to ≤ 10 per second, latest value wins).

Never blocking, never silent: every send is ``zmq.NOBLOCK`` on an XPUB socket with
``XPUB_NODROP`` (so a full subscriber pipe *refuses* the frame instead of ZMQ dropping it
unseen), ``SNDHWM`` bounded and ``LINGER`` 0. A refused, sampled-away or rate-limited event
still takes a ``seq`` number (so a subscriber sees the gap) and is counted; the counts go
out in the next ``Dropped`` (kept until one is delivered), the sampled-away (on purpose)
apart from the refused (a real loss). With ``XPUB_NODROP`` a
subscriber that stops reading makes the publisher refuse frames for every subscriber until
its pipe drains: a stuck engine-top costs events, never engine time.

Costs (measured on the development machine with ``python -m tracing.telemetry.publisher``;
see ``docs/telemetry.md``): a few µs per published event (encode + send under a lock),
well under 1 µs for a stage hook call that is rate-limited away; the heartbeat thread wakes
10 times a second and does its psutil reads once per ``interval_s``.

Switched off with ``GLASSBOX_TELEMETRY=0`` (read here, in ``telemetry_enabled``, the one
place; ``engine/envs.py`` declares it): ``start_telemetry`` then returns None,
``get_publisher()`` stays None and ``telemetry()`` is ``NULL_PUBLISHER``: an engine call such
as ``telemetry().mark_step()`` costs one global read and an empty method call.

vLLM counterpart: none. vLLM's live numbers are Prometheus metrics scraped from
``/metrics`` (and the vllm-top tools poll that once a second); nothing in vLLM says which
stage a process is in while it is in it.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil
import zmq

from tracing import catalogue
from tracing.stage import add_stage_hook, open_stages
from tracing.telemetry.events import (
    MAX_SNAPSHOT_REQUESTS,
    Dropped,
    Event,
    ExporterStatus,
    Gauges,
    Heartbeat,
    OpenStageInfo,
    OpenWaitInfo,
    RequestEvent,
    RequestProgress,
    Snapshot,
    StageEntered,
    StageLeft,
    StepRecord,
    StruckFaultInfo,
    WaitEnded,
    WaitStarted,
    encode_event,
    telemetry_address,
)

logger = logging.getLogger(__name__)

ENV_TELEMETRY = "GLASSBOX_TELEMETRY"
"""``GLASSBOX_TELEMETRY``: ``0`` / ``false`` / ``off`` / ``no`` switches live telemetry off
(no socket, no heartbeat thread, no stage hook); anything else, or unset, leaves it on."""

DEFAULT_SNDHWM = 1000  # frames queued per subscriber before sends are refused
DEFAULT_MAX_STEPS_PER_S = 50.0  # step records per second before sampling starts
DEFAULT_STAGE_RATE = 10  # step/request-level stage events published per second per name
DEFAULT_REQUEST_RATE = 2000  # request events per second before they are dropped
GAUGE_PUSH_INTERVAL_S = 0.1  # publish_gauges: at most 10 pushes a second
SNAPSHOT_INTERVAL_S = 1.0
CLOSE_LINGER_MS = 300  # at close, queued frames get this long to leave
_TICK_S = 0.1  # the heartbeat thread's wake-up period (flushes coalesced gauge pushes)

_ALWAYS_LEVELS = frozenset({catalogue.LIFECYCLE})
_TERMINAL_REQUEST_EVENTS = frozenset({"finished", "aborted"})  # never sampled away


def _exporter_statuses() -> list[ExporterStatus]:
    """This process's span exporters' health for the heartbeat (empty with tracing off)."""
    from tracing.setup import get_handle

    handle = get_handle()
    if handle is None:
        return []
    try:
        return [
            ExporterStatus(
                name=h.name,
                exported=h.exported,
                dropped=h.dropped,
                queued=h.queued,
                failed_exports=h.failed_exports,
                last_error=h.last_error,
                last_error_at=h.last_error_at,
                endpoint=h.endpoint,
            )
            for h in handle.health()
        ]
    except Exception:  # noqa: BLE001 - a heartbeat never fails for tracing's sake
        return []


def telemetry_enabled() -> bool:
    """Whether live telemetry is on: ``GLASSBOX_TELEMETRY`` is not 0/false/off/no."""
    return os.environ.get(ENV_TELEMETRY, "1").strip().lower() not in ("0", "false", "off", "no", "")


class _Window:
    """A per-second counter: ``allow()`` is True for the first ``limit`` calls of each second."""

    __slots__ = ("limit", "start", "count")

    def __init__(self, limit: float) -> None:
        self.limit, self.start, self.count = limit, 0.0, 0

    def allow(self, now: float) -> bool:
        if now - self.start >= 1.0:
            self.start, self.count = now, 0
        if self.count < self.limit:
            self.count += 1
            return True
        return False


class TelemetryPublisher:
    """Live telemetry of one process (see the module docstring). ``enabled`` is True (False
    on ``NullPublisher``): a caller that builds an event's fields first can skip that work.

    Args:
        run_dir: the instance's run directory (the socket goes there).
        role: this process's role name (``EngineCore_DP0``).
        interval_s: heartbeat period, s (clamped to 0.05..1.0).
        sndhwm: frames queued per subscriber before sends are refused (counted).
        max_steps_per_s: step records per second kept before sampling; None: no sampling.
        stage_rate: step/request-level stage events per second per stage name.
        hook: register the stage hook (one publisher per process should).
        heartbeat: start the heartbeat thread (tests may drive ``beat()`` by hand).

    Raises:
        zmq.ZMQError: the socket cannot be bound (``start_telemetry`` logs it and returns None).
    """

    enabled = True

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        role: str,
        *,
        interval_s: float = 1.0,
        sndhwm: int = DEFAULT_SNDHWM,
        max_steps_per_s: float | None = DEFAULT_MAX_STEPS_PER_S,
        stage_rate: int = DEFAULT_STAGE_RATE,
        hook: bool = True,
        heartbeat: bool = True,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.role = role
        self.pid = os.getpid()
        self.interval_s = min(max(float(interval_s), 0.05), 1.0)
        self.address = telemetry_address(self.run_dir, role)
        self._ctx = zmq.Context(io_threads=1)
        sock = self._ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.XPUB_NODROP, 1)
        try:
            sock.bind(self.address)
        except zmq.ZMQError:
            sock.close(0)
            self._ctx.term()
            raise
        self._sock = sock
        self._lock = threading.Lock()  # the socket, seq and the drop counts
        self._seq = 0
        self._dropped: dict[str, int] = {}
        self._refused: dict[str, int] = {}
        self._sampled: dict[str, int] = {}
        self._closed = False
        # steps
        self.max_steps_per_s = max_steps_per_s
        self._step_window_start = 0.0
        self._step_window_count = 0
        self._step_k = 1
        self._step_n = 0
        self._last_step: StepRecord | None = None
        self._last_step_fields: tuple[float, dict[str, Any]] | None = None
        self._last_step_at: float | None = None
        # stages and waits
        self._stage_rate = stage_rate
        self._levels: dict[str, str] = {}
        self._windows: dict[str, _Window] = {}
        self._local = threading.local()
        # Each thread's stack of "was this open stage's enter published?" flags, also
        # reachable from the heartbeat thread (see beat).
        self._flag_stacks: weakref.WeakKeyDictionary[threading.Thread, list[bool]] = (
            weakref.WeakKeyDictionary()
        )
        self._waits: dict[tuple[int, str], OpenWaitInfo] = {}
        self._waits_skipped: set[tuple[int, str]] = set()  # open waits whose start was not published
        self._request_window = _Window(DEFAULT_REQUEST_RATE)
        # gauges
        self._providers: list[Callable[[], Mapping[str, float]]] = []
        self._bad_providers: set[int] = set()
        self._gauges: dict[str, float] = {}
        self._pending_push: dict[str, float] = {}
        self._last_push = 0.0
        self._faults: list[StruckFaultInfo] = []  # injected faults that struck (record_fault)
        self._exited: dict[str, str] = {}
        # heartbeat
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # start the CPU measurement interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._remove_hook: Callable[[], None] | None = add_stage_hook(self._hook) if hook else None
        if heartbeat:
            self._thread = threading.Thread(target=self._run, name=f"telemetry-{role}", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ sending

    def _send_locked(self, cls: type[Event], kind: str, fields: dict[str, Any]) -> bool:
        """Build, number and send one event; caller holds ``_lock``. False: refused (counted)."""
        seq = self._seq
        self._seq = seq + 1
        try:
            frame = encode_event(cls(role=self.role, pid=self.pid, seq=seq, t=time.time(), **fields))
            self._sock.send(frame, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            self._refused[kind] = self._refused.get(kind, 0) + 1
        except Exception as e:  # an unencodable attribute, a closed socket: never the caller's problem
            self._count_error(kind, e)
        self._dropped[kind] = self._dropped.get(kind, 0) + 1
        return False

    def _count_error(self, kind: str, error: Exception) -> None:
        key = f"error:{kind}"
        if key not in self._dropped:
            logger.warning("telemetry: could not publish a %s event (%s); counting such drops", kind, error)

    def _skip(self, kind: str, n: int = 1) -> None:
        """Count ``n`` events sampled or rate-limited away (they still take seq numbers):
        in ``Dropped.counts`` and ``Dropped.sampled``, apart from real drops."""
        with self._lock:
            self._seq += n
            self._dropped[kind] = self._dropped.get(kind, 0) + n
            self._sampled[kind] = self._sampled.get(kind, 0) + n

    def publish(self, cls: type[Event], /, **fields: Any) -> bool:
        """Publish one event of type ``cls`` (e.g. ``RequestEvent``) from its own fields; the
        header (role, pid, seq, t) is filled in. Returns False when it was refused by a full
        socket (counted, published later in ``Dropped``). Never blocks, never raises."""
        if self._closed:
            return False
        kind = cls.__struct_config__.tag
        with self._lock:
            return self._send_locked(cls, kind, fields)

    # ------------------------------------------------------------------ the engine's API

    def publish_step(self, **fields: Any) -> bool:
        """One scheduler step: the fields of ``StepRecord`` (``engine_index``, ``step_id``,
        ``started_at`` (Unix s), ``duration_ms``, ``schedule_ms``, ``execute_ms``,
        ``update_ms``, the request/token counts, ``token_budget``, ``kv_usage`` 0..1,
        ``dummy``). Also marks the step (``mark_step``). When steps come faster than
        ``max_steps_per_s``, only every k-th is sent (k from the previous second's rate) and
        the rest counted as dropped ``step``; the latest one always goes into the next
        ``Snapshot``. Returns whether it was sent. Never blocks, never raises."""
        if self._closed:
            return False
        now = time.time()
        self._last_step_at = now
        cap = self.max_steps_per_s
        if cap is not None:
            if now - self._step_window_start >= 1.0:
                rate = self._step_window_count / max(now - self._step_window_start, 1.0)
                self._step_k = max(1, math.ceil(rate / cap)) if self._step_window_start else 1
                self._step_window_start, self._step_window_count = now, 0
            self._step_window_count += 1
            self._step_n += 1
            keep = self._step_n % self._step_k == 0 and self._step_window_count <= cap * self._step_k
            if not keep:
                self._last_step_fields = (now, fields)  # built only if a Snapshot needs it
                self._skip("step")
                return False
        with self._lock:
            seq = self._seq
            self._seq = seq + 1
            try:
                record = StepRecord(role=self.role, pid=self.pid, seq=seq, t=now, **fields)
                self._last_step, self._last_step_fields = record, None
                self._sock.send(encode_event(record), zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                self._refused["step"] = self._refused.get("step", 0) + 1
            except Exception as e:
                self._count_error("step", e)
            self._dropped["step"] = self._dropped.get("step", 0) + 1
            return False

    def mark_step(self, t: float | None = None) -> None:
        """Note that the busy loop made progress at Unix time ``t`` (now when None); goes out
        as the heartbeat's ``last_step_at``. Workers call it per ``execute_model``."""
        self._last_step_at = time.time() if t is None else t

    def publish_request_event(self, request_id: str, event: str, **fields: Any) -> bool:
        """A request changed state: ``event`` is arrived, scheduled, first_token, preempted,
        finished or aborted; ``fields``: ``RequestEvent``'s optional ones (``engine_index``,
        ``reason``, ``num_prompt_tokens``, ``num_computed_tokens``, ``num_output_tokens``,
        ``num_blocks``). Over 2000 a second the rest are sampled away (counted as dropped
        ``request``), except ``finished`` and ``aborted``: one per request, they carry its
        final counts and take it out of the in-flight list, so they are always sent."""
        if self._closed:
            return False
        if event not in _TERMINAL_REQUEST_EVENTS and not self._request_window.allow(time.monotonic()):
            self._skip("request")
            return False
        with self._lock:
            return self._send_locked(
                RequestEvent, "request", {"request_id": request_id, "event": event, **fields}
            )

    def publish_gauges(self, values: Mapping[str, float]) -> None:
        """Push gauge values now (``GAUGE_*`` names → numbers), e.g. a queue depth that just
        changed. At most 10 pushes a second go out; values pushed in between are merged
        (latest wins) and sent at the next allowed moment (≤ 0.1 s later). Also remembered for
        the heartbeat's ``Gauges`` and the ``Snapshot``."""
        if self._closed:
            return
        self._gauges.update(values)
        self._pending_push.update(values)
        now = time.monotonic()
        if now - self._last_push >= GAUGE_PUSH_INTERVAL_S:
            self._flush_push(now)

    def _flush_push(self, now: float) -> None:
        pending, self._pending_push = self._pending_push, {}
        if not pending:
            return
        self._last_push = now
        with self._lock:
            self._send_locked(Gauges, "gauges", {"values": pending})

    def add_gauge_provider(self, fn: Callable[[], Mapping[str, float]]) -> Callable[[], None]:
        """Call ``fn()`` from the heartbeat thread every ``interval_s``; it returns gauge
        values (``GAUGE_*`` names → numbers). It must be cheap and thread-safe (read a
        ``len()``, a counter). One that raises is logged once and skipped from then on.
        Returns a function that removes it."""
        self._providers.append(fn)
        return lambda: self._providers.remove(fn) if fn in self._providers else None

    def note_child_exit(self, role: str, description: str) -> None:
        """A child process this process reaped ended (``describe_exit(code)``: "killed by
        SIGKILL (exit status -9)") — or this process itself is about to exit (its own role:
        "exited with code 0"); every later heartbeat carries it in ``exited``, which is
        where a collector learns a dead process's exit status or signal. A heartbeat goes out
        at once: this process may itself be about to stop."""
        self._exited[role] = description
        self.beat(snapshot=False)

    # ------------------------------------------------------------------ the stage hook

    def _hook(self, event: str, name: str, attrs: Mapping[str, Any]) -> None:
        """``tracing.stage`` hook: must be cheap and must never raise."""
        try:
            if event == "enter" or event == "exit":
                level = self._levels.get(name)
                if level is None:
                    level = self._levels[name] = (
                        catalogue.SPANS[name].level if name in catalogue.SPANS else "step"
                    )
                if level in _ALWAYS_LEVELS:
                    publish = True
                else:
                    try:
                        flags = self._local.flags
                    except AttributeError:
                        flags = self._local.flags = []
                        self._flag_stacks[threading.current_thread()] = flags
                    if event == "enter":
                        window = self._windows.get(name)
                        if window is None:
                            window = self._windows[name] = _Window(self._stage_rate)
                        publish = window.allow(time.monotonic())
                        flags.append(publish)
                    else:
                        publish = flags.pop() if flags else False
                    if not publish:
                        self._skip("stage")
                        return
                thread = threading.current_thread().name
                with self._lock:
                    if event == "enter":
                        self._send_locked(
                            StageEntered,
                            "stage",
                            {"name": name, "level": level, "thread": thread, "attrs": attrs},
                        )
                    else:
                        fields = {
                            "name": name,
                            "duration_ms": attrs.get("duration_ms", 0.0),
                            "error": attrs.get("error"),
                            "thread": thread,
                        }
                        self._send_locked(StageLeft, "stage", fields)
            elif event == "wait_start":
                thread = threading.current_thread()
                timeout_s = float(attrs.get("timeout_s", 0.0))
                now = time.time()
                self._waits[(thread.ident or 0, name)] = OpenWaitInfo(
                    what=name, started_at=now, timeout_s=timeout_s, thread=thread.name
                )
                # Waits repeated many times a second (a step's reply from a worker) are rate
                # limited per name like step stages; the heartbeat lists every open one.
                window = self._windows.get(name)
                if window is None:
                    window = self._windows[name] = _Window(self._stage_rate)
                if not window.allow(time.monotonic()):
                    self._waits_skipped.add((thread.ident or 0, name))
                    self._skip("wait")
                    return
                with self._lock:
                    self._send_locked(WaitStarted, "wait", {"what": name, "timeout_s": timeout_s})
            elif event == "fault":
                self._faults.append(StruckFaultInfo(**attrs))
                self.beat(snapshot=False)  # the process may be about to hang, stop or end
            elif event == "wait_end":
                key = (threading.get_ident(), name)
                self._waits.pop(key, None)
                if key in self._waits_skipped:
                    self._waits_skipped.discard(key)
                    self._skip("wait")
                    return
                fields = {
                    "what": name,
                    "outcome": str(attrs.get("outcome", "")),
                    "waited_ms": attrs.get("waited_ms", 0.0),
                }
                with self._lock:
                    self._send_locked(WaitEnded, "wait", fields)
        except Exception as e:  # telemetry never fails a stage
            with self._lock:
                self._dropped["stage"] = self._dropped.get("stage", 0) + 1
                self._count_error("stage", e)

    # ------------------------------------------------------------------ the heartbeat thread

    def _run(self) -> None:
        next_beat = 0.0
        next_snapshot = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if self._pending_push and now - self._last_push >= GAUGE_PUSH_INTERVAL_S:
                    self._flush_push(now)
                if now >= next_beat:
                    next_beat = now + self.interval_s
                    self.beat(snapshot=now >= next_snapshot)
                    if now >= next_snapshot:
                        next_snapshot = now + SNAPSHOT_INTERVAL_S
            except Exception:  # the heartbeat must outlive any one bad tick
                logger.exception("telemetry heartbeat failed")
            self._stop.wait(min(_TICK_S, self.interval_s))

    def _collect_gauges(self) -> dict[str, float]:
        values: dict[str, float] = {}
        for fn in list(self._providers):
            if id(fn) in self._bad_providers:
                continue
            try:
                values.update(fn())
            except Exception:
                self._bad_providers.add(id(fn))
                logger.exception("telemetry: gauge provider %r failed; it is skipped from now on", fn)
        return values

    def beat(self, *, snapshot: bool = True) -> None:
        """One heartbeat: ``Heartbeat``, ``Gauges`` (providers), ``Dropped`` (when anything
        was dropped) and, with ``snapshot``, a ``Snapshot``. Called by the heartbeat thread;
        callable by hand when the thread is off."""
        if self._closed:
            return
        try:
            with self._proc.oneshot():
                cpu = self._proc.cpu_percent(None)
                rss = self._proc.memory_info().rss
                threads = self._proc.num_threads()
        except psutil.Error:
            cpu, rss, threads = 0.0, 0, threading.active_count()
        # Every open stage and wait goes into the heartbeat, also those whose start was
        # rate-limited away; so from now on their ends are published, or a subscriber would
        # show them open — and aging — until the next heartbeat (a fresh user read an
        # EngineCore "waiting for execute_model: 0.6s" under load as a stuck step).
        for flags in list(self._flag_stacks.values()):
            for i in range(len(flags)):
                try:
                    flags[i] = True
                except IndexError:  # the thread left a stage meanwhile
                    break
        self._waits_skipped.clear()
        stages = [
            OpenStageInfo(name=s.name, level=s.level, thread=s.thread, entered_at=s.entered_at)
            for s in open_stages()
        ]
        waits = sorted(self._waits.values(), key=lambda w: w.started_at)
        provided = self._collect_gauges()
        self._gauges.update(provided)
        with self._lock:
            self._drain_subscriptions()
            self._send_locked(
                Heartbeat,
                "heartbeat",
                {
                    "cpu_percent": cpu,
                    "rss_bytes": rss,
                    "num_threads": threads,
                    "stages": stages,
                    "last_step_at": self._last_step_at,
                    "interval_s": self.interval_s,
                    "waits": waits,
                    "exited": dict(self._exited),
                    "exporters": _exporter_statuses(),
                    "faults": list(self._faults),
                },
            )
            if provided:
                self._send_locked(Gauges, "gauges", {"values": provided})
            if snapshot:
                self._send_locked(
                    Snapshot,
                    "snapshot",
                    {
                        "stages": stages,
                        "gauges": dict(self._gauges),
                        "last_step": self._latest_step(),
                        "requests": self._requests_now(),
                    },  # fmt: skip
                )
            self._send_dropped_locked()

    def set_requests_provider(self, fn: Callable[[], list[RequestProgress]] | None) -> None:
        """``fn()`` lists the requests this process holds now (an engine core's waiting and
        running ones), for each ``Snapshot``; called from the heartbeat thread, so it must
        only read. At most ``MAX_SNAPSHOT_REQUESTS`` are sent."""
        self._requests_provider = fn

    def _requests_now(self) -> list[RequestProgress]:
        fn = getattr(self, "_requests_provider", None)
        if fn is None:
            return []
        try:
            return list(fn())[:MAX_SNAPSHOT_REQUESTS]
        except Exception:  # a list that changed under us: the next snapshot has it
            return []

    def _latest_step(self) -> StepRecord | None:
        pending = self._last_step_fields
        if pending is not None:
            self._last_step_fields = None
            t, fields = pending
            try:
                self._last_step = StepRecord(role=self.role, pid=self.pid, seq=-1, t=t, **fields)
            except TypeError:
                pass
        return self._last_step

    def _send_dropped_locked(self) -> None:
        if not self._dropped:
            return
        counts, refused, sampled = self._dropped, self._refused, self._sampled
        self._dropped, self._refused, self._sampled = {}, {}, {}
        fields = {"counts": counts, "refused": refused, "sampled": sampled}
        if not self._send_locked(Dropped, "dropped", fields):
            # Not delivered: keep the counts (the failed Dropped itself was counted) for next time.
            for kept, now in ((counts, self._dropped), (refused, self._refused), (sampled, self._sampled)):
                for kind, n in kept.items():
                    now[kind] = now.get(kind, 0) + n

    def _drain_subscriptions(self) -> None:
        """Read (and forget) the XPUB's subscription messages so they never pile up."""
        try:
            while self._sock.poll(0, zmq.POLLIN):
                self._sock.recv(zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def pending_dropped(self) -> dict[str, int]:
        """Counts of dropped events not yet delivered in a ``Dropped`` (by kind)."""
        with self._lock:
            return dict(self._dropped)

    @property
    def seq(self) -> int:
        """The next sequence number (= events offered so far)."""
        return self._seq

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Stop the heartbeat thread, remove the stage hook, try once to publish what was
        dropped, close the socket, giving frames already queued ``CLOSE_LINGER_MS`` to reach
        subscribers (a dying process's last words: which child died, how), then none.
        Idempotent."""
        if self._closed:
            return
        self._stop.set()
        if self._remove_hook is not None:
            self._remove_hook()
            self._remove_hook = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        with self._lock:
            self._send_dropped_locked()
            self._closed = True
            self._sock.close(CLOSE_LINGER_MS)
        self._ctx.term()

    def __enter__(self) -> TelemetryPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- the process's publisher


class NullPublisher:
    """The publisher of a process without telemetry (off, or not started): the methods
    engine code calls on ``TelemetryPublisher``, with its signatures, doing nothing and
    raising nothing; the ``publish*`` ones return False (not sent), as a refused send does."""

    enabled = False

    def publish(self, cls: type[Event], /, **fields: Any) -> bool:
        return False

    def publish_step(self, **fields: Any) -> bool:
        return False

    def mark_step(self, t: float | None = None) -> None:
        pass

    def publish_request_event(self, request_id: str, event: str, **fields: Any) -> bool:
        return False

    def publish_gauges(self, values: Mapping[str, float]) -> None:
        pass

    def add_gauge_provider(self, fn: Callable[[], Mapping[str, float]]) -> Callable[[], None]:
        return _nothing

    def note_child_exit(self, role: str, description: str) -> None:
        pass

    def set_requests_provider(self, fn: Callable[[], list[RequestProgress]] | None) -> None:
        pass


def _nothing() -> None:
    pass


NULL_PUBLISHER = NullPublisher()
_publisher: TelemetryPublisher | None = None
_start_lock = threading.Lock()


def telemetry() -> TelemetryPublisher | NullPublisher:
    """This process's publisher, or ``NULL_PUBLISHER`` when telemetry is off or not started:
    call its methods without a None guard. One global read."""
    publisher = _publisher
    return NULL_PUBLISHER if publisher is None else publisher


def get_publisher() -> TelemetryPublisher | None:
    """This process's publisher, or None (telemetry off, or not started). One global read."""
    return _publisher


def start_telemetry(
    run_dir: str | os.PathLike[str], role: str, *, interval_s: float = 1.0, **options: Any
) -> TelemetryPublisher | None:
    """Start this process's publisher (once; a second call returns the first one) and
    register it for ``get_publisher()``. ``options``: see ``TelemetryPublisher``.

    Returns None, logging why, when ``GLASSBOX_TELEMETRY=0`` or the socket cannot be bound
    (telemetry fails soft, like tracing). Closed at interpreter exit.
    """
    global _publisher
    if not telemetry_enabled():
        return None
    with _start_lock:
        if _publisher is not None:
            if _publisher.role != role:
                logger.warning(
                    "telemetry already started as %s; not starting it as %s", _publisher.role, role
                )
            return _publisher
        try:
            _publisher = TelemetryPublisher(run_dir, role, interval_s=interval_s, **options)
        except (zmq.ZMQError, OSError) as e:
            logger.warning(
                "live telemetry is off for %s: cannot bind %s (%s)", role, telemetry_address(run_dir, role), e
            )
            return None
        return _publisher


def stop_telemetry() -> None:
    """Close this process's publisher (if any); ``get_publisher()`` is None and
    ``telemetry()`` is ``NULL_PUBLISHER`` afterwards."""
    global _publisher
    with _start_lock:
        pub, _publisher = _publisher, None
    if pub is not None:
        pub.close()


def _forget_in_child() -> None:
    # A forked child must not touch its parent's socket or think its thread runs.
    global _publisher
    _publisher = None


os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(stop_telemetry)


# ---------------------------------------------------------------------- measuring the cost


def _bench(n: int = 20000) -> None:
    """Print what the hot paths cost: ``python -m tracing.telemetry.publisher``."""
    import tempfile

    from tracing.stage import stage

    with tempfile.TemporaryDirectory(prefix="gb-tel-") as d:
        sub_ctx = zmq.Context()
        pub = TelemetryPublisher(d, "Bench", max_steps_per_s=None, heartbeat=False, stage_rate=10**9)
        sub = sub_ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.address)
        time.sleep(0.3)

        def drain() -> None:
            while sub.poll(0):
                sub.recv()

        step = dict(
            engine_index=0, step_id=0, started_at=time.time(), duration_ms=5.0, schedule_ms=0.5, execute_ms=4.0,
            update_ms=0.5, num_decode_reqs=8, num_decode_tokens=8, num_prefill_reqs=1, num_prefill_tokens=120,
            num_chunked_prefills=0, tokens_scheduled=128, token_budget=2048, num_running=9, num_waiting=0,
            num_preempted=0, kv_usage=0.25,
        )  # fmt: skip

        def timed(label: str, fn: Callable[[], Any], count: int) -> None:
            t0 = time.perf_counter()
            for i in range(count):
                fn()
                if i % 500 == 499:
                    drain()
            dt = (time.perf_counter() - t0) / count * 1e6
            print(f"{label:<58} {dt:7.2f} µs")

        def bare_stage() -> None:
            with stage(catalogue.SCHEDULER_SCHEDULE):
                pass

        pub._remove_hook()  # type: ignore[misc]
        timed("stage enter+exit, no hook (baseline)", bare_stage, n)
        pub._remove_hook = add_stage_hook(pub._hook)
        timed("stage enter+exit, hook publishing both events", bare_stage, n)
        pub._stage_rate = 0
        pub._windows.clear()
        timed("stage enter+exit, hook rate-limited away", bare_stage, n)
        timed("publish_step (sent)", lambda: pub.publish_step(**step), n)
        pub.max_steps_per_s = 50.0
        timed("publish_step (sampled away, > 50/s)", lambda: pub.publish_step(**step), n)
        pub._request_window.limit = 10**9
        timed(
            "publish_request_event (sent)",
            lambda: pub.publish_request_event("req-1", "scheduled", engine_index=0),
            n,
        )
        timed("publish_gauges (coalesced)", lambda: pub.publish_gauges({"engine.input_queue": 3.0}), n)
        t0 = time.perf_counter()
        for _ in range(100):
            pub.beat()
        print(
            f"{'one heartbeat (psutil + open_stages + 4 frames)':<58} {(time.perf_counter() - t0) / 100 * 1e6:7.2f} µs"
        )
        pub.close()
        sub.close(0)
        sub_ctx.term()


if __name__ == "__main__":
    _bench()
