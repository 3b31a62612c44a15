"""The collector: every process's live telemetry folded into one ``LiveState``.

``Collector(run_dir)`` (or ``Collector()``: the one running instance, found through
``tracing.run_dir.list_run_dirs``; ``list_instances()`` lists them so a view can offer a
choice) runs one background thread that

- subscribes (one ZMQ SUB socket) to every planned role's ``telemetry_address`` from the
  manifest, and to every ``*.tel`` socket in the run directory, re-reading both every
  second so processes that appear later (API servers after engines, a restarted worker)
  are picked up; ZMQ keeps retrying an address nobody has bound yet ("connecting");
- folds each event into a ``LiveState`` under a lock (``LiveState.apply``);
- once a second merges psutil's view (``tracing.instances.collect_instance``: who is alive,
  pids, exited, crash reports), derives each process's ``state``/``link`` and the
  ``alerts`` (``compute_alerts``): a stage running far longer than usual, with a hint of
  what that stage usually means (``tracing.hints``); a wait near its deadline; a stale
  heartbeat (a frozen process); a busy loop that stopped stepping; a dead process with
  its exit; expected ≠ found process count; events refused by a full socket.

``snapshot()`` returns a consistent deep copy; the caller never blocks on the thread. With
no server, a server still starting or one that is gone, the state says so (``status``,
``message``) and the thread keeps looking and reconnects — it never raises to the caller.

``Collector.from_recording(path, speed)`` replays a ``--telemetry-record`` file instead
(``source = "replay"``; ``speed=0``: as fast as possible). ``Recorder`` writes such a file:
it subscribes like the collector and appends every frame it receives (``encode_recorded``),
plus a ``RunInfo`` (manifest and liveness) at the start and whenever it changes.

Costs: the collector's thread decodes each frame (~1-2 µs) and applies it under the lock;
the once-a-second psutil pass is a few ms for a tree of ten. The recorder does not decode.

vLLM counterpart: none — vLLM's live view is Prometheus ``/metrics``, scraped from outside
(the vllm-top tools poll it once a second) and blind to a process stuck in start-up.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import msgspec
import zmq

from tracing import blame, hints
from tracing import hints as hints_mod
from tracing import instances as inst
from tracing import run_dir as run_dirs
from tracing.hints import StageHint
from tracing.slow_motion import PAUSE_PREFIX
from tracing.telemetry.events import (
    GAUGE_RUNNING,
    Event,
    RequestEvent,
    RunInfo,
    StepRecord,
    decode_event,
    encode_event,
    encode_recorded,
    read_recording,
    telemetry_address,
)
from tracing.telemetry.state import (
    CULPRIT_TORN_DOWN,
    DEAD_OS_STATES,
    FROZEN_OS_STATES,
    HEARTBEAT_STALE_S,
    IDLE_POLL_WAIT_S,
    TORN_DOWN,
    Alert,
    LiveState,
)

logger = logging.getLogger(__name__)

TEL_SUFFIX = ".tel"
REFRESH_S = 1.0  # manifest, sockets, psutil and alerts: at most once a second
REFUSED_ALERT_S = 10.0  # a refused-events alert stays this long after the last refusal
FAULT_ALERT_S = 30.0  # an injected fault whose stage was left stays a warning this long
NO_STEP_ALERT_S = 10.0  # requests running but no engine step for this long: the loop stopped


# ---------------------------------------------------------------------- stage hints


# One table for engine-top, glassbox doctor and the deadline messages: tracing/hints.py.
STAGE_HINTS: dict[str, StageHint] = hints.HINTS
DEFAULT_SLOW_AFTER_S = hints.DEFAULT_SLOW_AFTER_S


def stage_hint(name: str) -> StageHint:
    """The hint for stage ``name`` (``tracing.hints.stage_hint``: the hint catalogue, else
    its catalogue doc and a default by level)."""
    return hints.stage_hint(name)


# ---------------------------------------------------------------------- alerts


def _age(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def compute_alerts(
    state: LiveState,
    *,
    hints: Callable[[str], StageHint] = stage_hint,
    recent_refusals: dict[str, float] | None = None,
) -> list[Alert]:
    """Everything a person should look at in ``state`` (as of ``state.now``), errors first.

    ``recent_refusals``: role → when it last had events refused (kept by the caller across
    calls, so the alert fades ``REFUSED_ALERT_S`` after the last refusal).
    """
    now = state.now
    alerts: list[Alert] = [state.root_cause] if state.root_cause is not None else []
    starting = False
    torn_down: list[str] = []
    for role, proc in state.processes.items():
        if proc.state == "exited":
            continue  # a clean stop: nothing to look at
        if proc.state == "dead" and proc.torn_down:
            # Stopped by the teardown of an instance that failed: the root cause says why.
            how = proc.exit_description
            torn_down.append(role if how in (None, TORN_DOWN) else f"{role} ({how})")
            continue
        if proc.state == "dead" and proc.exit_description == CULPRIT_TORN_DOWN:
            continue  # the root cause above says what ended it; the teardown did the rest
        if proc.state == "dead":
            pid = f" (pid {proc.pid})" if proc.pid else ""
            # How it died decides where to read why: its crash report when it wrote one, else
            # doctor's words for a process killed from outside (it writes none).
            hint = hints_mod.dead_hint(proc.crash_file, proc.crash_caused_by)
            if proc.last_error and not proc.crash_file:
                hint = f"last error: {proc.last_error}; {hint}"
            alerts.append(
                Alert("error", role, f"{role}{pid} is dead: {proc.exit_description or 'exited'}", hint)
            )
            continue
        if proc.state in ("planned", "starting"):
            starting = True
        open_names = {st.name for st in proc.stages}
        for fault in proc.faults:
            # Said at once: the student asked for this fault, and the stage's hint is what the
            # same symptom would mean had it not been injected. An error while the process is
            # still in the struck stage (or dead, or frozen); a fading warning once it left.
            age = max(0.0, now - fault.struck_at)
            held = fault.stage in open_names or proc.state in ("dead", "stale")
            if not held and age > FAULT_ALERT_S:
                continue
            msg = f"injected {fault.kind} struck in {fault.stage} {_age(age)} ago ({fault.spec})"
            severity = "error" if held else "warning"
            alerts.append(Alert(severity, role, msg, f"{fault.stage}: {hints(fault.stage).hint}"))
        if proc.state == "stale" and proc.heartbeat_at is not None:
            age = now - proc.heartbeat_at
            if proc.os_state == "stopped":
                hint = "the process is stopped (SIGSTOP, Ctrl-Z or a debugger): SIGCONT resumes it"
            else:
                hint = (
                    "frozen: a native call holding the GIL, a deadlock, or the machine swapping; "
                    f"py-spy dump --pid {proc.pid} shows where"
                )
            alerts.append(Alert("error", role, f"no heartbeat from {role} for {_age(age)}", hint))
        # A deliberate pause (GLASSBOX_STARTUP_STAGE_DELAY_S) makes the stages it slows long on
        # purpose: its own wait row says so, and no stage is reported slow meanwhile.
        pausing = any(w.what.startswith(PAUSE_PREFIX) for w in proc.waits)
        for st in [] if pausing else proc.stages:
            elapsed = now - st.entered_at
            h = hints(st.name)
            slow_after = h.slow_after_s
            stat = state.stage_stats.get(st.name)
            if stat is not None and stat.count >= 3:
                slow_after = max(slow_after, 5 * stat.mean_ms / 1e3)
            if elapsed > slow_after:
                severity = "error" if elapsed > 3 * slow_after else "warning"
                msg = f"{role} in {st.name} for {_age(elapsed)} (usually under {_age(slow_after)})"
                alerts.append(Alert(severity, role, msg, h.hint))
        for w in proc.waits:
            elapsed = now - w.started_at
            # Short waits are idle polls, repeated by design (a worker waiting for the next
            # step, 1 s at a time); a wait on a real deadline that has lasted is news.
            if w.timeout_s >= IDLE_POLL_WAIT_S and elapsed > min(0.5 * w.timeout_s, 30.0):
                msg = f"{role} waiting for {w.what} for {_age(elapsed)} (deadline {_age(w.timeout_s)})"
                alerts.append(
                    Alert("warning", role, msg, "the awaited process or peer is stuck: see its stage")
                )
        running = proc.gauges.get(GAUGE_RUNNING, 0.0)
        if (
            proc.state == "running"
            and running > 0
            and proc.last_step_at is not None
            and now - proc.last_step_at > NO_STEP_ALERT_S
        ):
            msg = f"no engine step for {_age(now - proc.last_step_at)} with {running:.0f} requests running"
            hint = "the busy loop stopped while the heartbeat goes on: see the stage it is in"
            alerts.append(Alert("error", role, msg, hint))
        if proc.last_error and not proc.gone:
            alerts.append(Alert("warning", role, f"{proc.last_error}", "a stage failed (it raised)"))
        if recent_refusals is not None:
            prev = recent_refusals.get(f"{role}#n", 0.0)
            if proc.refused_events > prev:
                recent_refusals[f"{role}#n"] = proc.refused_events
                recent_refusals[role] = now
            last = recent_refusals.get(role)
            if last is not None and now - last <= REFUSED_ALERT_S:
                msg = f"{proc.refused_events} telemetry events refused by a full socket"
                hint = "a subscriber (engine-top, a recorder) reads too slowly; the engine did not wait"
                alerts.append(Alert("warning", role, msg, hint))
    if torn_down:
        cause = state.root_cause.role if state.root_cause is not None else "another process"
        msg = f"{TORN_DOWN} after {cause} failed: {', '.join(torn_down)}"
        alerts.append(Alert("warning", None, msg, "not at fault: the root cause above says why they stopped"))
    expected = state.expected_count
    if expected is not None and state.status in ("attached", "replaying", "replay_done"):
        found = state.found_count
        if found > expected:
            alerts.append(
                Alert("warning", None, f"{found} processes found, {expected} expected (extra processes)")
            )
        elif found < expected and not starting:
            alerts.append(
                Alert(
                    "error",
                    None,
                    f"{found} of {expected} processes found",
                    "a planned process is missing: see the dead ones",
                )
            )
    alerts.sort(key=lambda a: a.severity != "error")
    return alerts


_EXIT_STATUS = re.compile(r"\(exit status (-?\d+)\)$|^exited with code (-?\d+)$")


def exit_status(description: str | None) -> int | None:
    """The exit status in a parent's account of its child's end (``describe_exit``: "killed
    by SIGKILL (exit status -9)", "exited with code 1"), or None when it names none."""
    m = _EXIT_STATUS.search(description or "")
    if m is None:
        return None
    return int(m.group(1) if m.group(1) is not None else m.group(2))


def _known_troubles(state: LiveState) -> dict[str, blame.Seen]:
    """What live telemetry knows that the run directory does not: stopped and frozen
    processes, and the exit status a parent reported of a dead child (only a parent knows it;
    the blame rule ranks a known exit status before a process merely gone, as the root-cause
    block does)."""
    known = {}
    for role, proc in state.processes.items():
        if not proc.alive:
            code = exit_status(proc.exit_description) if proc.state in ("dead", "exited") else None
            if code is not None:
                known[role] = blame.Seen(role, returncode=code)
            continue
        if proc.os_state in FROZEN_OS_STATES:  # the OS says so at once, as doctor reads it
            known[role] = blame.Seen(role, stopped=f"stopped by a signal (os state {proc.os_state})")
        elif proc.state == "stale" and proc.heartbeat_at is not None:
            age = state.now - proc.heartbeat_at
            known[role] = blame.Seen(role, frozen=f"frozen: running but no heartbeat for {_age(age)}")
    return known


def _blame(run_dir: Path, known: dict[str, blame.Seen]) -> Alert | None:
    """The blame rule's culprit as an alert (``tracing.blame``), or None."""
    try:
        culprit = blame.blame_run_dir(run_dir, time.time(), known)
    except Exception:  # noqa: BLE001 - a half-written run directory must not stop the view
        logger.debug("telemetry: the blame rule failed", exc_info=True)
        return None
    if culprit is None:
        return None
    where = f" in {culprit.stage}" if culprit.stage else ""
    hint = f"{culprit.stage}: {hints.stage_hint(culprit.stage).hint}" if culprit.stage else ""
    return Alert("error", culprit.role, f"root cause: {culprit.role}{where}: {culprit.reason}", hint)


def _crash_files(run_dir: Path, roles: list[str]) -> dict[str, tuple[str, str | None]]:
    """role → (its crash report's path, whom the report says it followed) for each of
    ``roles`` that wrote one in ``run_dir`` (a run directory or a kept post-mortem)."""
    found = {}
    for role in roles:
        crash = run_dirs.read_crash_report(run_dir, role)
        if crash is not None:
            found[role] = (str(run_dirs.crash_path(run_dir, role)), crash.caused_by)
    return found


def post_mortem_root_cause(kept: Path) -> Alert | None:
    """The root cause an instance printed as it ended after a failure (``root_cause.txt`` in
    its post-mortem, written by the blame rule: ``engine/utils/processes.py``), as engine-top's
    root-cause alert; None when it kept none (or it names no process)."""
    path = kept / run_dirs.ROOT_CAUSE
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    fields = {key: values[0] for key, values in blame.root_cause_fields(text).items()}
    role = fields.get("process", "").split(" (rank ")[0].strip()
    if not role:
        return None
    stage = fields.get("stage", "")
    if stage.startswith(("none", "unknown")):
        stage = ""
    how = fields.get("exit", "")
    exception = fields.get("exception", "")
    # What to check, as doctor words it for a tree that is gone: what ended the culprit.
    if how.startswith("still running (stopped"):
        check = hints_mod.GONE_STOPPED
    elif how.startswith("still running (frozen"):
        check = hints_mod.GONE_FROZEN
    elif exception.startswith("none recorded"):
        check = hints_mod.NO_CRASH_REPORT
    elif exception and not exception.startswith("none"):
        crash = run_dirs.crash_path(kept, role)
        check = hints_mod.dead_hint(str(crash)) if crash.is_file() else ""
    else:
        check = ""
    if how.startswith("still running (") and how.endswith(")"):
        how = how[len("still running (") : -1]  # torn down since: what held it is the news
    if exception and not exception.startswith("none"):
        how = f"{how}; {exception}" if how else exception
    reason = fields.get("why") or how or "named by the instance's root cause"
    where = f" in {stage}" if stage else ""
    name = stage.split(" (")[0]
    hint = "; ".join(h for h in (check, f"{name}: {hints_mod.stage_hint(name).hint}" if name else "") if h)
    return Alert(
        "error", role, f"root cause: {role}{where}: {reason}", f"{hint} (the instance's root cause: {path})"
    )


# ---------------------------------------------------------------------- finding instances


def list_instances(base: str | os.PathLike[str] | None = None) -> list[Path]:
    """Run directories of running instances (their owner alive), oldest first: what a view
    offers to choose from. Stale directories are left out."""
    found = []
    for d in run_dirs.list_run_dirs(base):
        manifest = run_dirs.read_manifest(d)
        pid = (
            manifest.frontend_pid
            if manifest is not None and manifest.frontend_pid
            else run_dirs.creator_pid(d)
        )
        if run_dirs.pid_alive(pid):
            found.append((manifest.created_at if manifest is not None and manifest.created_at else 0.0, d))
    return [d for _, d in sorted(found)]


def _liveness(run_dir: Path) -> tuple[dict[str, str], int, bool]:
    """psutil's view of ``run_dir``: role → state word, the found count, whether the owner is gone."""
    info = inst.collect_instance(run_dir)
    liveness: dict[str, str] = {}
    for row in info.processes:
        if row.role is None:
            continue
        if row.alive:
            liveness[row.role] = row.state
            continue
        note = row.note or ""
        crash = run_dirs.read_crash_report(run_dir, row.role)
        if crash is not None and crash.exception:
            where = f" in {crash.stage}" if crash.stage else ""
            note = (
                f"{note}; crashed{where}: {crash.exception}" if note else f"crashed{where}: {crash.exception}"
            )
        liveness[row.role] = f"{row.state}: {note}" if note else row.state
    return liveness, info.found_process_count, info.stale


# ---------------------------------------------------------------------- the subscription


class _Subscription:
    """One SUB socket connected to every telemetry address of one run directory."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._ctx = zmq.Context(io_threads=1)
        self.sock = self._ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 10000)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self.addresses: set[str] = set()

    def update(self, manifest: run_dirs.Manifest | None) -> None:
        roles = {r.role for r in manifest.roles} if manifest is not None else set()
        try:
            roles |= {
                p.name[: -len(TEL_SUFFIX)] for p in self.run_dir.iterdir() if p.name.endswith(TEL_SUFFIX)
            }
        except OSError:
            pass
        for role in roles:
            address = telemetry_address(self.run_dir, role)
            if address not in self.addresses:
                try:
                    self.sock.connect(address)
                    self.addresses.add(address)
                except zmq.ZMQError as e:  # e.g. a path too long for ipc
                    logger.warning("telemetry: cannot connect to %s: %s", address, e)

    def recv_batch(self, timeout_ms: int, max_n: int = 2000) -> list[bytes]:
        frames: list[bytes] = []
        if not self.sock.poll(timeout_ms):
            return frames
        for _ in range(max_n):
            try:
                frames.append(self.sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        return frames

    def close(self) -> None:
        self.sock.close(0)
        self._ctx.term()


# ---------------------------------------------------------------------- the collector


class Collector:
    """Live state of one instance, kept up to date by a background thread (module docstring).

    Args:
        run_dir: the instance's run directory; None: the one running instance under ``base``
            (attaches when exactly one runs; re-searches when it goes away).
        base: where to look for run directories (default ``run_dir_base()``).
        stale_after_s: a heartbeat older than this (s) makes a process stale.
        refresh_s: how often the manifest, sockets, psutil and alerts are refreshed.
        hints: stage name → ``StageHint`` (default ``stage_hint``).

    Use ``start()`` (or ``with Collector(...) as c:``), ``snapshot()``, ``stop()``.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        base: str | os.PathLike[str] | None = None,
        stale_after_s: float = HEARTBEAT_STALE_S,
        refresh_s: float = REFRESH_S,
        hints: Callable[[str], StageHint] = stage_hint,
    ) -> None:
        self.fixed_run_dir = Path(run_dir) if run_dir is not None else None
        self.base = base
        self.stale_after_s = stale_after_s
        self.refresh_s = refresh_s
        self.hints = hints
        self._lock = threading.Lock()
        self._state = LiveState()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sub: _Subscription | None = None
        self._refusals: dict[str, float] = {}
        # (role, pid) of workers whose status file was read for a placement: once each.
        self._placement_read: set[tuple[str, int]] = set()
        self._attached: Path | None = None
        self.bad_frames = 0
        self.replay_path: Path | None = None
        self.speed = 1.0
        self.done = threading.Event()  # replay: every event applied
        self.refreshes = 0

    # -------------------------------------------------------------- public

    def start(self) -> Collector:
        """Start the background thread (returns at once)."""
        if self._thread is None:
            target = self._replay if self.replay_path is not None else self._run
            self._thread = threading.Thread(target=target, name="telemetry-collector", daemon=True)
            self._thread.start()
        return self

    def snapshot(self) -> LiveState:
        """A consistent copy of the live state (safe to read while the thread goes on)."""
        with self._lock:
            state = self._state.copy()
            refusals = dict(self._refusals)
        if state.source == "live" and state.status == "attached":
            # States and alerts as of now: a heartbeat that just said a fault struck (or a
            # process froze) is an alert in this snapshot, not a refresh later.
            state.derive(time.time(), self.stale_after_s)
            state.alerts = compute_alerts(state, hints=self.hints, recent_refusals=refusals)
        return state

    def stop(self) -> None:
        """Stop the thread and close the socket (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._thread = None

    def __enter__(self) -> Collector:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_until(self, predicate: Callable[[LiveState], bool], timeout_s: float) -> LiveState:
        """Poll ``snapshot()`` until ``predicate`` holds; the last snapshot either way."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.snapshot()
            if predicate(state) or time.monotonic() >= deadline:
                return state
            time.sleep(0.02)

    @staticmethod
    def list_instances(base: str | os.PathLike[str] | None = None) -> list[Path]:
        """Running instances' run directories (see ``list_instances``)."""
        return list_instances(base)

    @classmethod
    def from_recording(cls, path: str | os.PathLike[str], speed: float = 1.0, **kwargs: object) -> Collector:
        """A collector that replays recording ``path`` (``Recorder``, ``--telemetry-record``)
        with event times scaled by 1/``speed`` (``speed=0``: as fast as possible; ``done`` is
        set when the last event is applied). ``start()`` it like a live one."""
        c = cls(None, **kwargs)  # type: ignore[arg-type]
        c.replay_path = Path(path)
        c.speed = speed
        c._state.source = "replay"
        c._state.status = "replaying"
        c._state.message = f"replaying {path}"
        return c

    # -------------------------------------------------------------- live

    def _run(self) -> None:
        next_refresh = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_refresh:
                    try:
                        self._refresh()
                    except Exception:  # never let one bad pass end the thread
                        logger.exception("telemetry collector refresh failed")
                    next_refresh = time.monotonic() + self.refresh_s
                sub = self._sub
                if sub is None:
                    self._stop.wait(min(0.1, self.refresh_s))
                    continue
                timeout_ms = int(max(1.0, min(100.0, (next_refresh - time.monotonic()) * 1e3)))
                try:
                    frames = sub.recv_batch(timeout_ms)
                except zmq.ZMQError:
                    frames = []
                if frames:
                    self._apply_frames(frames)
        finally:
            if self._sub is not None:
                self._sub.close()
                self._sub = None

    def _apply_frames(self, frames: list[bytes]) -> None:
        events: list[Event] = []
        for frame in frames:
            try:
                events.append(decode_event(frame))
            except msgspec.DecodeError:
                self.bad_frames += 1
        with self._lock:
            for ev in events:
                self._state.apply(ev)

    def _choose_run_dir(self) -> tuple[Path | None, str, str, list[str]]:
        """(run dir to watch, status, message, candidates)."""
        if self.fixed_run_dir is not None:
            if self.fixed_run_dir.is_dir():
                return self.fixed_run_dir, "attached", f"watching {self.fixed_run_dir}", []
            return None, "waiting", f"waiting for {self.fixed_run_dir} to appear (no instance there yet)", []
        current = self._sub.run_dir if self._sub is not None else None
        running = list_instances(self.base)
        names = [str(d) for d in running]
        if current is not None and current in running:
            return current, "attached", f"watching {current}", names
        if len(running) == 1:
            return running[0], "attached", f"watching {running[0]}", names
        base = run_dirs.run_dir_base(self.base)
        if not running:
            return None, "searching", f"no running Glassbox instance under {base}; waiting for one", names
        return None, "choose", f"{len(running)} instances running under {base}: pick one (--run-dir)", names

    def _refresh(self) -> None:
        self.refreshes += 1
        run_dir, status, message, candidates = self._choose_run_dir()
        gone_dir = None
        if self._sub is not None and self._sub.run_dir != run_dir:
            gone_dir = self._sub.run_dir
            self._sub.close()
            self._sub = None
        if run_dir is not None and self._attached is not None and run_dir != self._attached:
            with self._lock:  # a different instance: start from a clean state
                self._state = LiveState()
        if run_dir is not None:
            self._attached = run_dir
        manifest = liveness = None
        found = 0
        if run_dir is None and self._attached is not None:
            # The instance we watched is gone (its run directory removed): keep what we saw.
            status = "gone"
            message = f"the instance in {self._attached} is gone; {message}"
            if gone_dir is not None:
                self._instance_ended(gone_dir)
        crashes: dict[str, tuple[str, str | None]] = {}
        if run_dir is not None:
            if self._sub is None:
                self._sub = _Subscription(run_dir)
            manifest = run_dirs.read_manifest(run_dir)
            self._sub.update(manifest)
            try:
                liveness, found, gone = _liveness(run_dir)
            except Exception:
                logger.exception("telemetry: reading process liveness failed")
                liveness, gone = None, False
            if liveness is not None:
                ended = [r for r, word in liveness.items() if word.partition(": ")[0] in DEAD_OS_STATES]
                crashes = _crash_files(run_dir, ended)
            if gone and manifest is not None:
                status, message = "gone", f"the instance in {run_dir} is gone (its owner exited)"
            elif manifest is None:
                status, message = "attached", f"{run_dir}: no manifest yet (the instance is starting)"
        with self._lock:
            state = self._state
            if run_dir is not None:
                state.run_dir = str(run_dir)
            state.status, state.message, state.candidates = status, message, candidates
            if manifest is not None:
                state.apply_manifest(manifest)
            if liveness is not None:
                state.apply_liveness(liveness, found)
            for role, (path, caused_by) in crashes.items():
                proc = state.processes.get(role)
                if proc is not None:
                    proc.crash_file, proc.crash_caused_by = path, caused_by
            if run_dir is not None:
                # A process that publishes nothing (frozen before anyone subscribed, or
                # telemetry off) still has its status file: its lifecycle stage.
                for role, proc in state.processes.items():
                    if proc.heartbeat_at is None or proc.os_state in FROZEN_OS_STATES:
                        status_record = run_dirs.read_status(run_dirs.status_path(run_dir, role))
                        if status_record is not None:
                            state.apply_status(role, status_record)
                    elif (
                        proc.kind == "worker"
                        and proc.pid is not None
                        and (role, proc.pid) not in self._placement_read
                    ):
                        # A Ray actor wrote where Ray put it before its first heartbeat: one
                        # read per worker process (an mp worker has none) is enough.
                        self._placement_read.add((role, proc.pid))
                        status_record = run_dirs.read_status(run_dirs.status_path(run_dir, role))
                        if status_record is not None:
                            state.apply_placement(role, status_record)
            state.derive(time.time(), self.stale_after_s)
            known = _known_troubles(state)
        # The blame rule reads the run directory (a few small files): outside the lock. Once the
        # run directory is removed, the root cause stays what the instance's end said.
        culprit = _blame(run_dir, known) if run_dir is not None else None
        with self._lock:
            state = self._state
            if run_dir is not None:
                state.root_cause = culprit
            state.alerts = compute_alerts(state, hints=self.hints, recent_refusals=self._refusals)

    def _instance_ended(self, gone_dir: Path) -> None:
        """The run directory we watched is gone. A tree that ended after a failure kept its
        post-mortem first (``tracing.run_dir.keep_post_mortem``); one that stopped cleanly kept
        none. The root cause becomes the instance's own (its ``root_cause.txt``; else the last
        one seen live; else the blame rule on what it kept, as ``glassbox doctor`` reads it) and
        stays the first alert; the crash reports are read where they were kept."""
        kept = run_dirs.find_post_mortem(gone_dir, run_dirs.post_mortem_root())
        cause = crashes = None
        if kept is not None:
            with self._lock:
                roles = list(self._state.processes)
                live = self._state.root_cause
            crashes = _crash_files(kept, roles)
            # The instance's own verdict, as it stood when it ended (what doctor reads back too),
            # not one judged now from files the teardown has since changed.
            cause = post_mortem_root_cause(kept) or live or _blame(kept, {})
        with self._lock:
            state = self._state
            state.found_count = 0
            state.root_cause = cause
            for role, (path, caused_by) in (crashes or {}).items():
                proc = state.processes.get(role)
                if proc is not None:
                    proc.crash_file, proc.crash_caused_by = path, caused_by
            state.instance_ended(clean=kept is None)

    # -------------------------------------------------------------- replay

    def _replay(self) -> None:
        assert self.replay_path is not None
        speed = self.speed
        last_derive = 0.0
        t0 = w0 = None
        last_t = None
        try:
            with open(self.replay_path, "rb") as f:
                for ev in read_recording(f):
                    if self._stop.is_set():
                        return
                    if speed > 0:
                        if t0 is None:
                            t0, w0 = ev.t, time.monotonic()
                        target = w0 + (ev.t - t0) / speed
                        while not self._stop.is_set():
                            remaining = target - time.monotonic()
                            if remaining <= 0:
                                break
                            self._stop.wait(min(remaining, 0.1))
                            if time.monotonic() - last_derive >= 0.25:
                                last_derive = time.monotonic()
                                self._derive_replay(t0 + (last_derive - w0) * speed)
                    with self._lock:
                        self._state.apply(ev)
                    last_t = ev.t if last_t is None else max(last_t, ev.t)
        except (OSError, msgspec.DecodeError) as e:
            with self._lock:
                self._state.message = f"replay of {self.replay_path} stopped: {e}"
        with self._lock:
            self._state.status = "replay_done"
            if not self._state.message.startswith("replay of"):
                self._state.message = f"replayed {self.replay_path} to the end"
        self._derive_replay(last_t if last_t is not None else 0.0)
        self.done.set()

    def _derive_replay(self, now: float) -> None:
        with self._lock:
            state = self._state
            state.derive(max(now, state.now), self.stale_after_s)
            state.alerts = compute_alerts(state, hints=self.hints, recent_refusals=self._refusals)


# ---------------------------------------------------------------------- seeking a recording


def recording_steps(path: str | os.PathLike[str]) -> list[int]:
    """The step ids of a recording's real steps (``StepRecord``, dummy batches left out), in
    order, each once (with several DP engines, a number any engine reached). Raises
    ``OSError`` / ``msgspec.DecodeError`` as ``read_recording`` does."""
    seen: set[int] = set()
    with open(path, "rb") as f:
        for ev in read_recording(f):
            if type(ev) is StepRecord and not ev.dummy:
                seen.add(ev.step_id)
    return sorted(seen)


def replay_at(
    path: str | os.PathLike[str], step: int, *, hints: Callable[[str], StageHint] = stage_hint
) -> LiveState:
    """The state of a recording as of engine step ``step``: every event up to the first
    (real) ``StepRecord`` numbered ``step`` or more, and the request events that step
    published right after it (its engine's next ``seq`` numbers: scheduled, preempted,
    finished). ``now`` is that last event's time; alerts are derived as of then;
    ``replay_step`` is the step reached (``replay_steps`` all of them).

    Raises:
        ValueError: the recording has no step numbered ``step`` or more (the message says
            which steps it has).
    """
    steps = recording_steps(path)
    if not steps or step > steps[-1]:
        have = f"steps {steps[0]} to {steps[-1]}" if steps else "no engine step"
        raise ValueError(f"{path} has {have}; no step {step}")
    state = LiveState(source="replay", status="replaying")
    reached: StepRecord | None = None
    last_seq, last_t = -1, 0.0  # the reached step's last event
    with open(path, "rb") as f:
        for ev in read_recording(f):
            if reached is not None:
                # the step's own request events follow its record, seq after seq
                if not (type(ev) is RequestEvent and ev.role == reached.role and ev.seq == last_seq + 1):
                    if ev.role == reached.role:
                        break
                    if ev.t > last_t:
                        break
                    state.apply(ev)
                    continue
                last_seq, last_t = ev.seq, ev.t
                state.apply(ev)
                continue
            state.apply(ev)
            if type(ev) is StepRecord and not ev.dummy and ev.step_id >= step:
                reached, last_seq, last_t = ev, ev.seq, ev.t
    assert reached is not None
    state.replay_step, state.replay_steps = reached.step_id, steps
    state.message = f"{path} at step {reached.step_id} (of {steps[0]}..{steps[-1]})"
    state.derive(last_t)
    state.alerts = compute_alerts(state, hints=hints)
    return state


# ---------------------------------------------------------------------- the recorder


class Recorder:
    """Writes every telemetry frame of one run directory to a file (``--telemetry-record``).

    ``start(run_dir, path)`` opens ``path`` (truncating it) and starts a daemon thread that
    subscribes like the ``Collector`` and appends each frame as it arrives
    (``encode_recorded``: a 4-byte length, then the frame — no decoding), plus a ``RunInfo``
    (the manifest, each role's liveness, the found count) at the start and whenever it
    changes (checked every 2 s). ``stop()`` drains what is queued, flushes and closes; both
    are safe to call from the owner process (idempotent, bounded: stop waits at most ~2 s).
    ``frames_written`` counts the frames.
    """

    LIVENESS_S = 2.0
    REFRESH_S = 0.2

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._file: BinaryIO | None = None
        self.frames_written = 0
        self.path: Path | None = None
        self.run_dir: Path | None = None
        self._seq = 0

    def start(self, run_dir: str | os.PathLike[str], path: str | os.PathLike[str]) -> Recorder:
        """Start recording ``run_dir``'s telemetry into ``path``.

        Raises:
            OSError: ``path`` cannot be opened for writing.
            RuntimeError: already recording.
        """
        if self._thread is not None:
            raise RuntimeError(f"already recording {self.run_dir} into {self.path}")
        self.run_dir, self.path = Path(run_dir), Path(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by stop()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="telemetry-recorder", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop recording: drain, flush and close the file. Idempotent."""
        if self._thread is None:
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        self._thread = None

    def _write(self, frame: bytes) -> None:
        assert self._file is not None
        self._file.write(encode_recorded(frame))
        self.frames_written += 1

    def _run_info(self, manifest: run_dirs.Manifest | None) -> bytes | None:
        assert self.run_dir is not None
        try:
            liveness, found, _ = _liveness(self.run_dir)
        except Exception:
            logger.exception("telemetry recorder: reading process liveness failed")
            return None
        info = RunInfo(
            role="recorder",
            pid=os.getpid(),
            seq=self._seq,
            t=time.time(),
            manifest=msgspec.to_builtins(manifest) if manifest is not None else {},
            liveness=liveness,
            found_count=found,
        )
        self._seq += 1
        return encode_event(info)

    def _run(self) -> None:
        assert self.run_dir is not None and self._file is not None
        sub = _Subscription(self.run_dir)
        last_info: tuple[object, ...] | None = None
        next_refresh = next_liveness = 0.0
        last_flush = time.monotonic()
        stop_deadline = None
        try:
            while True:
                stopping = self._stop.is_set()
                now = time.monotonic()
                if stopping and stop_deadline is None:
                    stop_deadline = now + 1.0
                    frame = self._run_info(run_dirs.read_manifest(self.run_dir))
                    if frame is not None:
                        self._write(frame)
                if now >= next_refresh and not stopping:
                    manifest = run_dirs.read_manifest(self.run_dir)
                    sub.update(manifest)
                    next_refresh = now + self.REFRESH_S
                    if now >= next_liveness:
                        next_liveness = now + self.LIVENESS_S
                        frame = self._run_info(manifest)
                        if frame is not None:
                            info = decode_event(frame)
                            key = (msgspec.json.encode(info.manifest), tuple(sorted(info.liveness.items())))
                            if key != last_info:
                                last_info = key
                                self._write(frame)
                try:
                    frames = sub.recv_batch(0 if stopping else 100)
                except zmq.ZMQError:
                    frames = []
                for frame in frames:
                    self._write(frame)
                if time.monotonic() - last_flush >= 1.0:
                    self._file.flush()
                    last_flush = time.monotonic()
                if stopping and (not frames or stop_deadline is not None and now > stop_deadline):
                    break
        except Exception:
            logger.exception("telemetry recorder failed; the recording ends here")
        finally:
            sub.close()
            try:
                self._file.close()
            except OSError:
                pass


__all__ = [
    "STAGE_HINTS",
    "Collector",
    "Recorder",
    "StageHint",
    "compute_alerts",
    "list_instances",
    "recording_steps",
    "replay_at",
    "stage_hint",
]
