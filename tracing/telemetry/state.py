"""The live state of one instance, as engine-top shows it: what the collector builds.

``tracing.telemetry.collector`` subscribes to every process of a run directory (or reads a
recording) and folds each event into one ``LiveState`` (``LiveState.apply``); it also reads
the manifest (the planned tree) and psutil (who is alive, exit codes) and derives the alerts.
The views (``tui/``) only read a ``LiveState``; ``--json`` prints ``LiveState.to_json()``.
Times are Unix seconds unless a name says otherwise.

Imports no ``engine`` module and no torch.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from tracing.run_dir import CRASH_SUFFIX, Manifest
from tracing.telemetry.events import (
    GAUGE_MQ_READER_PREFIX,
    GAUGE_MQ_WRITTEN,
    Dropped,
    Event,
    ExporterStatus,
    Gauges,
    Heartbeat,
    OpenStageInfo,
    RequestEvent,
    RunInfo,
    Snapshot,
    StageEntered,
    StageLeft,
    StepRecord,
    StruckFaultInfo,
    WaitEnded,
    WaitStarted,
)

# How many step records are kept per engine, and samples per queue series (sparklines).
STEP_HISTORY = 200
QUEUE_HISTORY = 120
# A heartbeat older than this (s) makes a process "stale" (a frozen process, or a lost link).
HEARTBEAT_STALE_S = 3.0
# A bounded wait shorter than this (s) is an idle poll, repeated while idle (a worker waiting
# for the next step, 1 s at a time): never an alert, not shown as a wait.
IDLE_POLL_WAIT_S = 5.0
# A finished or aborted request stays in ``requests`` this long (s), then is pruned; at most
# MAX_REQUESTS are kept (the oldest finished go first).
FINISHED_KEEP_S = 5.0
MAX_REQUESTS = 2000
# Derived gauge (not on the wire): the shared-memory broadcast queue's lag, messages written
# minus those read by the slowest reader. Set in ``ProcessLive.gauges`` and as a queue series.
GAUGE_MQ_LAG = "mq.lag"
# psutil liveness words that mean the process is gone (``tracing.instances``).
DEAD_OS_STATES = ("exited", "zombie")
# psutil's words for a process that is stopped (SIGSTOP, a debugger): alive but frozen.
FROZEN_OS_STATES = ("stopped", "tracing-stop")
TERMINAL_REQUEST_STATES = ("finished", "aborted")
# How the collector's liveness note says a gone process wrote a crash report ("crashed in
# worker.load_model: OSError: ...", after "; " when psutil had a note of its own).
_CRASHED = re.compile(r"(^|; )crashed( in \S+)?: ")

ProcessState = Literal["planned", "starting", "running", "stale", "dead", "exited"]
# A process gone after a clean stop reads "exited", not "dead": it (its last heartbeat) or its
# parent reported exit status 0, or it stopped with its instance, which ended cleanly.
CLEAN_EXIT = "exited with code 0"
INSTANCE_GONE = "the instance is gone"  # a collector's note for the processes of a run directory removed
# A process of an instance that ended after a failure, stopped by the tree's teardown (not the
# root cause): gone, not cleanly, and not at fault (``LiveState.instance_ended``).
TORN_DOWN = "torn down with the instance"
# The root cause's own row once its instance is gone, when nothing else said how it ended (a
# SIGSTOPped worker that the teardown continued and stopped, exit status 0).
CULPRIT_TORN_DOWN = "the root cause; torn down with the instance"
LinkState = Literal["connecting", "live", "stale", "lost"]


@dataclass
class WaitInfo:
    """A bounded wait in progress (``tracing.waits``)."""

    what: str
    started_at: float
    timeout_s: float


@dataclass
class ProcessLive:
    """One process of the tree (planned in the manifest, or found running).

    ``state``: planned (no sign of it yet), starting (alive, in start-up stages), running,
    stale (alive but its heartbeat is older than ``HEARTBEAT_STALE_S``), dead (with
    ``exit_description``, e.g. "killed by SIGKILL (exit status -9)"), exited (gone after a
    clean stop: ``CLEAN_EXIT``, or the instance ended with no root cause). ``link``: the telemetry
    subscription's state. ``stage``/``stage_entered_at``: the innermost open stage.
    """

    role: str
    kind: str = "unknown"
    pid: int | None = None
    state: ProcessState = "planned"
    link: LinkState = "connecting"
    stages: list[OpenStageInfo] = field(default_factory=list)
    waits: list[WaitInfo] = field(default_factory=list)
    heartbeat_at: float | None = None
    last_step_at: float | None = None
    cpu_percent: float | None = None
    rss_bytes: int | None = None
    num_threads: int | None = None
    gauges: dict[str, float] = field(default_factory=dict)
    exit_description: str | None = None
    dropped_events: int = 0
    last_seq: int | None = None
    # --- added with the collector -------------------------------------------------------
    # rank: from the manifest. planned/counted: listed in the manifest / counts toward the
    # expected count. os_state: psutil's word (running, sleeping, stopped, exited, zombie,
    # "not started"), None when unknown (a replay without liveness). last_event_at: Unix
    # time of the last event received from it (any kind). heartbeat_interval_s: its
    # heartbeat period. dropped_by_kind: what its publisher reported dropping (``Dropped``),
    # by kind; refused_events: the part refused by a full socket. last_error: the last stage
    # it left with an error ("worker.load_model: OSError: ..."). stage_left_at /
    # last_stage_left: the last stage it left and when.
    rank: int | None = None
    planned: bool = False
    counted: bool = True
    os_state: str | None = None
    last_event_at: float | None = None
    heartbeat_interval_s: float = 1.0
    dropped_by_kind: dict[str, int] = field(default_factory=dict)
    refused_events: int = 0
    last_error: str | None = None
    last_stage_left: str | None = None
    stage_left_at: float | None = None
    # exporters: its span exporters' health, from its last heartbeat (``ExporterStatus``).
    exporters: list[ExporterStatus] = field(default_factory=list)
    # faults: injected faults that struck it (``StruckFaultInfo``), from its heartbeats.
    faults: list[StruckFaultInfo] = field(default_factory=list)
    # placement: where a Ray cluster put it (node_id, node_ip, actor_id), from its status file.
    placement: dict[str, str] = field(default_factory=dict)
    # sampled_events: what its publisher reported sampled or rate-limited away on purpose
    # (``Dropped.sampled``); lost_events: what it reported not sent for real (refused by a
    # full socket, or failed): ``Dropped.counts`` minus the sampled.
    sampled_events: int = 0
    lost_events: int = 0
    # clean_end: it stopped with its instance, which ended cleanly (``LiveState.instance_ended``).
    clean_end: bool = False
    # crash_file: its crash report's path (``<role>.crash.json``, in the run directory or its
    # post-mortem) when it wrote one; crash_caused_by: whom that report says it followed (an
    # echo: an engine core stopping because its worker died). None: it wrote none (killed from
    # outside), or nobody looked (a replay knows only what its recording's liveness said).
    crash_file: str | None = None
    crash_caused_by: str | None = None
    # torn_down: its instance ended after a failure and it went with it, not at fault (the
    # root cause is another's): ``TORN_DOWN``.
    torn_down: bool = False

    def copy(self) -> ProcessLive:
        return dataclasses.replace(
            self,
            stages=list(self.stages),
            faults=list(self.faults),
            placement=dict(self.placement),
            waits=list(self.waits),
            exporters=list(self.exporters),
            gauges=dict(self.gauges),
            dropped_by_kind=dict(self.dropped_by_kind),
        )

    @property
    def alive(self) -> bool:
        return self.state not in ("dead", "exited", "planned")

    @property
    def gone(self) -> bool:
        """Dead or exited: no longer running, whichever way it ended."""
        return self.state in ("dead", "exited")

    @property
    def stage(self) -> str | None:
        return self.stages[-1].name if self.stages else None

    @property
    def stage_entered_at(self) -> float | None:
        return self.stages[-1].entered_at if self.stages else None


@dataclass
class RequestLive:
    """A request seen in flight. ``state``: the latest ``RequestEvent.event``."""

    request_id: str
    state: str
    engine_index: int = -1
    num_prompt_tokens: int = -1
    num_computed_tokens: int = -1
    num_output_tokens: int = -1
    num_blocks: int = -1
    arrived_at: float | None = None
    updated_at: float | None = None
    reason: str | None = None
    # The KV blocks it holds, in block-table order, as of the engine's latest snapshot.
    block_ids: list[int] = field(default_factory=list)


@dataclass
class Alert:
    """Something a person should look at. ``severity``: warning or error. ``hint``: what this
    usually means (e.g. for a long ``worker.load_model``: reading weights from a slow disk)."""

    severity: Literal["warning", "error"]
    role: str | None
    message: str
    hint: str = ""


@dataclass
class LiveState:
    """Everything engine-top shows about one instance.

    From the manifest: ``run_dir``, ``mode``, ``model``, the parallel sizes, the planned
    count. From psutil: ``found_count`` and each process's ``pid``/``state``. From telemetry:
    everything else. ``queues``: name → recent samples, one per gauge update, e.g.
    ``"EngineCore_DP0 engine.input_queue"``. ``steps``: engine index → recent step records.
    ``source``: "live" (subscribed to a run directory) or "replay" (a recording).
    """

    run_dir: str | None = None
    source: Literal["live", "replay"] = "live"
    mode: str | None = None
    model: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    api_server_count: int = 0
    expected_count: int | None = None
    found_count: int = 0
    started_at: float | None = None
    now: float = 0.0
    processes: dict[str, ProcessLive] = field(default_factory=dict)
    queues: dict[str, deque[float]] = field(default_factory=dict)
    steps: dict[int, deque[StepRecord]] = field(default_factory=dict)
    requests: dict[str, RequestLive] = field(default_factory=dict)
    alerts: list[Alert] = field(default_factory=list)
    events_received: int = 0
    events_dropped: int = 0
    # --- added with the collector -------------------------------------------------------
    # status: where the collector is — "searching" (no instance found yet), "choose" (more
    # than one running: see ``candidates``), "waiting" (the run directory given does not
    # exist yet), "attached", "gone" (the instance's owner exited; still watching),
    # "replaying", "replay_done". message: one line saying the same for a person.
    # candidates: running instances' run directories (to offer a choice). events_refused:
    # events publishers reported refused by a full socket. stage_stats: span name → the
    # durations seen (``StageStat``), for "longer than usual".
    status: str = "searching"
    message: str = ""
    candidates: list[str] = field(default_factory=list)
    host: str | None = None
    port: int | None = None
    events_refused: int = 0
    stage_stats: dict[str, StageStat] = field(default_factory=dict)
    # events_dropped counts seq gaps: every event not received, whatever the cause. The
    # publishers' ``Dropped`` reports split it: events_sampled (sampled or rate-limited away
    # on purpose: steps above 50/s ...) and events_lost (real losses: refused by a full
    # socket, which events_refused also counts, or failed to encode).
    events_sampled: int = 0
    events_lost: int = 0
    # root_cause: the blame rule's culprit (``tracing.blame``, as the root-cause block and
    # glassbox doctor name it), as the first alert; None when the rule names no one.
    root_cause: Alert | None = None
    # A recording seen as of one step (``collector.replay_at``, ``engine-top --replay F --at
    # STEP``): the step reached, and every step id the recording has; None / empty otherwise.
    replay_step: int | None = None
    replay_steps: list[int] = field(default_factory=list)

    # ------------------------------------------------------------------ folding events

    def apply(self, event: Event) -> None:
        """Fold one event into the state (any order within a process is tolerated; a
        heartbeat or snapshot replaces what stage events said, so a lost event heals within
        one heartbeat). Also counts ``seq`` gaps as ``dropped_events``."""
        self.events_received += 1
        if event.t > self.now:
            self.now = event.t
        if type(event) is RunInfo:
            self._apply_run_info(event)
            return
        proc = self._process(event.role)
        if proc.pid != event.pid:
            if proc.pid is not None and proc.last_seq is not None:
                proc.last_seq = None  # a new process with this role: its seq restarts
            proc.pid = event.pid
        last = proc.last_seq
        if last is not None and event.seq > last + 1:
            gap = event.seq - last - 1
            proc.dropped_events += gap
            self.events_dropped += gap
        if last is None or event.seq > last:
            proc.last_seq = event.seq
        proc.last_event_at = event.t
        if proc.link == "connecting":
            proc.link = "live"
        handler = _HANDLERS.get(type(event))
        if handler is not None:
            handler(self, proc, event)

    def _process(self, role: str) -> ProcessLive:
        proc = self.processes.get(role)
        if proc is None:
            proc = self.processes[role] = ProcessLive(role=role)
        return proc

    def _on_stage_entered(self, proc: ProcessLive, ev: StageEntered) -> None:
        if not any(s.name == ev.name and s.thread == ev.thread for s in proc.stages):
            proc.stages.append(OpenStageInfo(name=ev.name, level=ev.level, thread=ev.thread, entered_at=ev.t))
        model = ev.attrs.get("glassbox.model.name") if ev.attrs else None
        if isinstance(model, str) and model:
            self.model = model

    def _on_stage_left(self, proc: ProcessLive, ev: StageLeft) -> None:
        for i in range(len(proc.stages) - 1, -1, -1):
            s = proc.stages[i]
            if s.name == ev.name and (not ev.thread or s.thread == ev.thread):
                del proc.stages[i]
                break
        proc.last_stage_left, proc.stage_left_at = ev.name, ev.t
        if ev.error:
            proc.last_error = f"{ev.name}: {ev.error}"
        stat = self.stage_stats.get(ev.name)
        if stat is None:
            stat = self.stage_stats[ev.name] = StageStat()
        stat.add(ev.duration_ms)

    def _on_wait_started(self, proc: ProcessLive, ev: WaitStarted) -> None:
        proc.waits.append(WaitInfo(what=ev.what, started_at=ev.t, timeout_s=ev.timeout_s))

    def _on_wait_ended(self, proc: ProcessLive, ev: WaitEnded) -> None:
        for i in range(len(proc.waits) - 1, -1, -1):
            if proc.waits[i].what == ev.what:
                del proc.waits[i]
                break

    def _on_heartbeat(self, proc: ProcessLive, ev: Heartbeat) -> None:
        proc.heartbeat_at = ev.t
        proc.heartbeat_interval_s = ev.interval_s
        proc.cpu_percent, proc.rss_bytes, proc.num_threads = ev.cpu_percent, ev.rss_bytes, ev.num_threads
        proc.stages = list(ev.stages)
        proc.exporters = list(ev.exporters)
        proc.faults = list(ev.faults)
        proc.waits = [WaitInfo(what=w.what, started_at=w.started_at, timeout_s=w.timeout_s) for w in ev.waits]
        if ev.last_step_at is not None:
            proc.last_step_at = ev.last_step_at
        for role, description in ev.exited.items():
            child = self._process(role)
            if child.torn_down or child.exit_description == CULPRIT_TORN_DOWN:
                continue  # its instance's end already said how it went
            child.exit_description = description
            child.state, child.link = self._end_state(child), "lost"

    def _on_gauges(self, proc: ProcessLive, ev: Gauges) -> None:
        self._set_gauges(proc, ev.values, sample=True)

    def _set_gauges(self, proc: ProcessLive, values: dict[str, float], *, sample: bool) -> None:
        proc.gauges.update(values)
        if any(k.startswith(GAUGE_MQ_READER_PREFIX) for k in values) or GAUGE_MQ_WRITTEN in values:
            reads = [v for k, v in proc.gauges.items() if k.startswith(GAUGE_MQ_READER_PREFIX)]
            written = proc.gauges.get(GAUGE_MQ_WRITTEN)
            if reads and written is not None:
                values = {**values, GAUGE_MQ_LAG: max(0.0, written - min(reads))}
                proc.gauges[GAUGE_MQ_LAG] = values[GAUGE_MQ_LAG]
        if not sample:
            return
        for name, value in values.items():
            key = f"{proc.role} {name}"
            series = self.queues.get(key)
            if series is None:
                series = self.queues[key] = deque(maxlen=QUEUE_HISTORY)
            series.append(float(value))

    def _on_step(self, proc: ProcessLive, ev: StepRecord) -> None:
        self._add_step(ev)
        end = ev.started_at + ev.duration_ms / 1e3
        if proc.last_step_at is None or end > proc.last_step_at:
            proc.last_step_at = end

    def _add_step(self, ev: StepRecord) -> None:
        history = self.steps.get(ev.engine_index)
        if history is None:
            history = self.steps[ev.engine_index] = deque(maxlen=STEP_HISTORY)
        if history and history[-1].step_id >= ev.step_id:
            return  # already seen (a snapshot's copy), or out of order
        history.append(ev)

    def _on_request(self, proc: ProcessLive, ev: RequestEvent) -> None:
        req = self.requests.get(ev.request_id)
        if req is None:
            req = self.requests[ev.request_id] = RequestLive(request_id=ev.request_id, state=ev.event)
            req.arrived_at = ev.t
        if ev.event == "arrived":
            req.arrived_at = ev.t if req.arrived_at is None else min(req.arrived_at, ev.t)
        # Events of one request come from two processes (the API server, its engine core),
        # so one can arrive after a later one: an event from before the request's end only
        # fills in what is unknown, and first_token's counts (the API server's: the prompt
        # computed, the outputs streamed) only ever raise what the engine already said.
        stale = req.state in TERMINAL_REQUEST_STATES and ev.event not in TERMINAL_REQUEST_STATES
        if not stale:
            req.state = ev.event
        for name in (
            "engine_index",
            "num_prompt_tokens",
            "num_computed_tokens",
            "num_output_tokens",
            "num_blocks",
        ):
            value = getattr(ev, name)
            if value == -1:
                continue
            old = getattr(req, name)
            if stale and old != -1:
                continue
            if ev.event == "first_token" and name != "engine_index":
                value = max(value, old)
            setattr(req, name, value)
        if ev.num_blocks == 0 and not stale:  # preempted or finished: it holds no block now
            req.block_ids = []
        if ev.reason is not None and not stale:
            req.reason = ev.reason
        if not stale:
            req.updated_at = ev.t

    def _on_dropped(self, proc: ProcessLive, ev: Dropped) -> None:
        for kind, n in ev.counts.items():
            proc.dropped_by_kind[kind] = proc.dropped_by_kind.get(kind, 0) + n
        refused = sum(ev.refused.values())
        proc.refused_events += refused
        self.events_refused += refused
        sampled = sum(ev.sampled.values())
        lost = max(0, sum(ev.counts.values()) - sampled)
        proc.sampled_events += sampled
        proc.lost_events += lost
        self.events_sampled += sampled
        self.events_lost += lost

    def _on_snapshot(self, proc: ProcessLive, ev: Snapshot) -> None:
        proc.stages = list(ev.stages)
        self._set_gauges(proc, ev.gauges, sample=False)
        if ev.last_step is not None:
            self._add_step(ev.last_step)
        for progress in ev.requests:
            req = self.requests.get(progress.request_id)
            if req is None:
                req = self.requests[progress.request_id] = RequestLive(
                    request_id=progress.request_id, state=progress.state, arrived_at=progress.arrived_at
                )
            if req.state in TERMINAL_REQUEST_STATES:
                continue  # a snapshot older than the request's end
            if req.state not in ("scheduled", "preempted") or progress.state != "waiting":
                req.state = progress.state
            req.engine_index = progress.engine_index
            req.num_prompt_tokens = progress.num_prompt_tokens
            req.num_computed_tokens = progress.num_computed_tokens
            req.num_output_tokens = progress.num_output_tokens
            req.num_blocks = progress.num_blocks
            req.block_ids = list(progress.block_ids)
            req.updated_at = ev.t

    def _apply_run_info(self, ev: RunInfo) -> None:
        try:
            manifest = msgspec.convert(ev.manifest, Manifest)
        except msgspec.ValidationError:
            manifest = None
        if manifest is not None:
            self.apply_manifest(manifest)
        self.apply_liveness(ev.liveness, ev.found_count)

    # ------------------------------------------------------------ manifest and psutil

    def apply_manifest(self, manifest: Manifest) -> None:
        """Take the planned tree and the shape from the run directory's manifest."""
        self.mode = manifest.mode
        self.run_dir = manifest.run_dir or self.run_dir
        self.tensor_parallel_size = manifest.tensor_parallel_size or 1
        self.pipeline_parallel_size = manifest.pipeline_parallel_size or 1
        self.data_parallel_size = manifest.data_parallel_size or 1
        self.api_server_count = manifest.api_server_count or 0
        self.expected_count = manifest.expected_process_count
        self.started_at = manifest.created_at
        self.host, self.port = manifest.host, manifest.port
        self.model = manifest.model or self.model
        for entry in manifest.roles:
            proc = self._process(entry.role)
            proc.planned = True
            proc.kind = entry.kind or proc.kind
            proc.rank = entry.rank if entry.rank is not None else proc.rank
            if entry.counted is not None:
                proc.counted = entry.counted
            if proc.pid is None and entry.pid is not None:
                proc.pid = entry.pid

    def apply_liveness(self, liveness: dict[str, str], found_count: int) -> None:
        """Take psutil's view: role → its state word (``running``, ``stopped``, ``not
        started``, ``exited: <note>``...). A process found gone gets ``exit_description``
        (the note) unless its parent already reported how it ended."""
        self.found_count = found_count
        for role, word in liveness.items():
            proc = self._process(role)
            os_state, _, note = word.partition(": ")
            proc.os_state = os_state
            if os_state in DEAD_OS_STATES and proc.exit_description is None:
                proc.exit_description = note or os_state
            if os_state in DEAD_OS_STATES and proc.crash_file is None and _CRASHED.search(note):
                # The collector's note names a crash report it read (a replay knows no more).
                proc.crash_file = f"{role}{CRASH_SUFFIX}"

    def apply_placement(self, role: str, status: Any) -> None:
        """Take where a cluster scheduler placed the process (``ProcessStatus.placement``)."""
        placement = getattr(status, "placement", None)
        if placement:
            self._process(role).placement = dict(placement)

    def apply_status(self, role: str, status: Any) -> None:
        """Take a process's status file (``tracing.run_dir.ProcessStatus``) as its open
        lifecycle stages and struck faults — for a process whose telemetry says nothing (frozen before anyone
        subscribed, or telemetry off); live stage events replace it once they come."""
        proc = self._process(role)
        if proc.pid is None and status.pid:
            proc.pid = status.pid
        self.apply_placement(role, status)
        if len(getattr(status, "faults", None) or []) > len(proc.faults):
            proc.faults = [
                StruckFaultInfo(
                    spec=f.spec, stage=f.stage, kind=f.kind, struck_at=f.struck_at, thread=f.thread
                )
                for f in status.faults
            ]
        stack = list(status.stage_stack or ([status.stage] if status.stage else []))
        if not stack:
            return
        entered = status.entered_at or status.updated_at or self.now
        known = {s.name: s for s in proc.stages}
        proc.stages = [
            known.get(name)
            or OpenStageInfo(name=name, level="lifecycle", thread="MainThread", entered_at=entered)
            for name in stack
        ]

    def derive(self, now: float, stale_after_s: float = HEARTBEAT_STALE_S) -> None:
        """Set ``now`` and every process's ``state`` and ``link`` from what is known by then;
        prune requests finished long ago."""
        self.now = now
        for proc in self.processes.values():
            stale_s = max(stale_after_s, 2.5 * proc.heartbeat_interval_s)
            if proc.exit_description is not None or proc.os_state in DEAD_OS_STATES:
                proc.state, proc.link = self._end_state(proc), "lost"
                continue
            if proc.last_event_at is None:
                proc.link = "connecting"
            elif now - proc.last_event_at <= stale_s:
                proc.link = "live"
            else:
                proc.link = "stale"
            if proc.os_state in FROZEN_OS_STATES:
                proc.state = "stale"  # stopped by a signal: alive, doing nothing
            elif proc.heartbeat_at is None:
                known_alive = proc.os_state not in (None, "not started") or proc.last_event_at is not None
                proc.state = "starting" if known_alive else "planned"
            elif now - proc.heartbeat_at > stale_s:
                proc.state = "stale"
            elif any(s.level == "lifecycle" and not s.name.endswith(".shutdown") for s in proc.stages):
                proc.state = "starting"
            else:
                proc.state = "running"
        self.prune(now)

    def _end_state(self, proc: ProcessLive) -> ProcessState:
        """How a process that is gone ended: ``exited`` after a clean stop (``CLEAN_EXIT``, as
        it or its parent reported it, or ``clean_end``), else ``dead``. The root cause's process
        never reads as a clean stop: a SIGSTOPped worker that the teardown continued and
        stopped exits with status 0, but it is the one at fault."""
        if self.root_cause is not None and self.root_cause.role == proc.role:
            return "dead"
        return "exited" if proc.exit_description == CLEAN_EXIT or proc.clean_end else "dead"

    def instance_ended(self, clean: bool) -> None:
        """The instance's run directory is gone. Every process not known gone is noted
        ``INSTANCE_GONE``; when the tree ended ``clean`` (no post-mortem kept, no root cause),
        those with no other account of their end (the owner, or a process whose last words
        were lost) stopped with it cleanly.

        When it ended after a failure and ``root_cause`` names the culprit (set it first: the
        instance's own root cause, from its post-mortem), the teardown's doing is told apart
        from the failure: the culprit's row is ``dead`` (``CULPRIT_TORN_DOWN`` when it had no
        other account, or only a clean exit status after the teardown stopped it), and every
        other process with no account of its own, or only a clean exit status, was
        ``TORN_DOWN``: not at fault, and not a clean stop either."""
        culprit = self.root_cause.role if self.root_cause is not None and not clean else None
        for proc in self.processes.values():
            if proc.exit_description is None and not proc.gone:
                proc.exit_description = INSTANCE_GONE
            if (
                clean
                and self.root_cause is None
                and proc.exit_description == INSTANCE_GONE
                and not proc.last_error
            ):
                proc.clean_end = True
            if culprit is None or proc.state == "planned" and proc.heartbeat_at is None:
                continue
            if proc.role == culprit:
                if proc.exit_description in (INSTANCE_GONE, CLEAN_EXIT):
                    proc.exit_description = CULPRIT_TORN_DOWN
            elif proc.exit_description in (INSTANCE_GONE, CLEAN_EXIT) or proc.crash_caused_by is not None:
                proc.torn_down = True
                if proc.exit_description in (INSTANCE_GONE, CLEAN_EXIT):
                    proc.exit_description = TORN_DOWN

    def prune(self, now: float) -> None:
        """Forget requests finished more than ``FINISHED_KEEP_S`` ago; keep at most ``MAX_REQUESTS``."""
        done = [
            r for r in self.requests.values()
            if r.state in TERMINAL_REQUEST_STATES and (r.updated_at or 0.0) < now - FINISHED_KEEP_S
        ]  # fmt: skip
        for r in done:
            del self.requests[r.request_id]
        if len(self.requests) > MAX_REQUESTS:
            order = sorted(
                self.requests.values(),
                key=lambda r: (r.state not in TERMINAL_REQUEST_STATES, r.updated_at or 0.0),
            )
            for r in order[: len(self.requests) - MAX_REQUESTS]:
                del self.requests[r.request_id]

    # ------------------------------------------------------------------ reading it

    def copy(self) -> LiveState:
        """A copy that shares nothing mutable with this state (step records are immutable
        in practice and shared)."""
        new = copy.copy(self)
        new.processes = {role: p.copy() for role, p in self.processes.items()}
        new.queues = {k: deque(v, maxlen=v.maxlen) for k, v in self.queues.items()}
        new.steps = {k: deque(v, maxlen=v.maxlen) for k, v in self.steps.items()}
        new.requests = {k: dataclasses.replace(v) for k, v in self.requests.items()}
        new.alerts = list(self.alerts)
        new.candidates = list(self.candidates)
        new.replay_steps = list(self.replay_steps)
        new.stage_stats = {k: dataclasses.replace(v) for k, v in self.stage_stats.items()}
        return new

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of the whole state (``engine-top --json``): every field, deques as
        lists, structs as dicts (field name → value), step keys as strings; each process also
        gets ``stage``, ``stage_entered_at``, ``time_in_stage_s`` and ``heartbeat_age_s``."""
        data = _jsonable(self)
        for role, proc in self.processes.items():
            entry = data["processes"][role]
            entry["stage"] = proc.stage
            entry["stage_entered_at"] = proc.stage_entered_at
            entered = proc.stage_entered_at
            entry["time_in_stage_s"] = round(max(0.0, self.now - entered), 3) if entered else None
            hb = proc.heartbeat_at
            entry["heartbeat_age_s"] = round(max(0.0, self.now - hb), 3) if hb else None
        return data


@dataclass
class StageStat:
    """Durations (ms) of one stage name seen leaving: count, mean, max, last."""

    count: int = 0
    mean_ms: float = 0.0
    max_ms: float = 0.0
    last_ms: float = 0.0

    def add(self, duration_ms: float) -> None:
        self.count += 1
        self.mean_ms += (duration_ms - self.mean_ms) / self.count
        self.max_ms = max(self.max_ms, duration_ms)
        self.last_ms = duration_ms


_HANDLERS: dict[type, Any] = {
    StageEntered: LiveState._on_stage_entered,
    StageLeft: LiveState._on_stage_left,
    WaitStarted: LiveState._on_wait_started,
    WaitEnded: LiveState._on_wait_ended,
    Heartbeat: LiveState._on_heartbeat,
    Gauges: LiveState._on_gauges,
    StepRecord: LiveState._on_step,
    RequestEvent: LiveState._on_request,
    Dropped: LiveState._on_dropped,
    Snapshot: LiveState._on_snapshot,
}


def _jsonable(obj: Any) -> Any:
    """Plain JSON data: structs and dataclasses → dicts by field name, deques/tuples → lists."""
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return obj
    if isinstance(obj, msgspec.Struct):
        return {name: _jsonable(getattr(obj, name)) for name in obj.__struct_fields__}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, deque, set, frozenset)):
        return [_jsonable(v) for v in obj]
    return msgspec.to_builtins(obj, str_keys=True)
