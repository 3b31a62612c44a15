"""Live telemetry: every event a Glassbox process publishes, typed, in one place.

Each process of the tree publishes on its own ZMQ PUB socket in the run directory
(``telemetry_address``: ``ipc://<run dir>/<role>.tel``); ``engine-top``, ``glassbox ps`` and
``--telemetry-record FILE`` subscribe. A span reaches a trace backend only when it ends; these
events say what is happening *now* — the stage a process is in, the wait it is blocked on,
its queue depths, each scheduler step — so a stuck stage is visible while it is stuck.

Wire format: one msgpack frame per event, a tagged union (``Event``; the tag is the event
kind), decoded with ``decode_event``. Every event carries ``role`` (an opaque role name, as
in the run-directory contract), ``pid``, ``seq`` (per publisher, from 0, +1 per event
*offered*: a gap is dropped events, also counted in ``Dropped``) and ``t`` (Unix time, s).
A recording (``--telemetry-record``) is the same frames, each prefixed by its length
(``encode_recorded``/``read_recording``).

Who emits what (gauge names are the ``GAUGE_*`` constants below):

============================  ===============================================================
event                         emitted by
============================  ===============================================================
``StageEntered/StageLeft``    every process, from the stage hook (``tracing.stage``)
``WaitStarted/WaitEnded``     every process, from the stage hook (``tracing.waits``)
``Heartbeat``                 every process, at least once a second, from its own thread
``Gauges``                    every process: its role's gauges, sampled by the heartbeat
                              thread (and pushed at once by ``publish_gauges``)
``StepRecord``                engine cores, one per scheduler step (sampled when too fast)
``RequestEvent``              engine cores (scheduled, preempted, finished ...) and API
                              servers (arrived, first token, aborted by the client)
``Dropped``                   any publisher that dropped events since its last ``Dropped``
``Snapshot``                  every process, once a second: its open stages and gauges, for
                              late subscribers
``RunInfo``                   the ``Recorder`` only, into a recording: manifest and liveness
============================  ===============================================================

This module imports no ``engine`` module and no torch: engine-top reads it without the engine.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Literal

import msgspec

# -------------------------------------------------------------------------- gauge names
# API server
GAUGE_API_IN_FLIGHT = "api.http_in_flight"  # HTTP requests being answered
GAUGE_API_WAITING_FOR_ENGINE = "api.waiting_for_engine"  # sent to the engine, no output yet
GAUGE_API_PENDING_OUTPUTS = "api.pending_output_chunks"  # outputs queued, not yet streamed
# Engine core
GAUGE_INPUT_QUEUE = "engine.input_queue"  # items in input_queue
GAUGE_OUTPUT_QUEUE = "engine.output_queue"  # items in output_queue
GAUGE_WAITING = "sched.waiting"
GAUGE_WAITING_FOR_FSM = "sched.waiting_for_fsm"  # of the waiting: grammars still compiling
GAUGE_RUNNING = "sched.running"
GAUGE_PREEMPTED = "sched.preempted_total"  # preemptions since start
GAUGE_KV_USED = "kv.blocks_used"
GAUGE_KV_FREE = "kv.blocks_free"
GAUGE_KV_CACHED = "kv.blocks_cached"  # free blocks that still hold a cached prefix
GAUGE_KV_TOTAL = "kv.blocks_total"
GAUGE_PREFIX_HIT_RATE = "kv.prefix_hit_rate"  # hits / queries since start, 0..1
GAUGE_DP_WAVE = "dp.wave"
GAUGE_DP_RUNNING = "dp.engines_running"  # 1 while this engine's DP wave runs
GAUGE_DUMMY_STEPS = "dp.dummy_steps_total"
# Executor (in the engine core): the shared-memory broadcast queue
GAUGE_MQ_WRITTEN = "mq.written"  # messages written since start
GAUGE_MQ_READER_PREFIX = "mq.read."  # + reader index: messages that reader has read
# Worker
GAUGE_WORKER_STEP = "worker.step_id"  # execute_model calls since start
GAUGE_WORKER_FORWARD_MS = "worker.forward_ms"  # time in the last execute_model
GAUGE_WORKER_THREADS = "worker.cpu_threads"  # threads of a CPU worker's step now (its governor's)
GAUGE_WORKER_THREADS_MAX = "worker.cpu_threads_max"  # its share: the most it runs with
# Worker of a mixture of experts (engine/worker/moe_telemetry.py): this rank's experts and their load
GAUGE_MOE_NUM_EXPERTS = "moe.num_experts"  # experts per MoE layer, all ranks together
GAUGE_MOE_FIRST_EXPERT = "moe.first_expert"  # the first of this rank's experts (a contiguous range)
GAUGE_MOE_LOCAL_EXPERTS = "moe.local_experts"  # how many this rank holds (all of them without EP)
GAUGE_MOE_EXPERT_PREFIX = "moe.expert."  # + expert id + ".tokens": rows it took since start, all layers
GAUGE_MOE_STEP_ROWS = "moe.step_rows"  # rows this rank's experts took in the last forward, all layers
GAUGE_MOE_A2A_MS = "moe.a2a_ms"  # the last forward's time inside expert-parallel all-to-alls
GAUGE_MOE_A2A_TOTAL_S = "moe.a2a_total_s"  # since start
GAUGE_MOE_FORWARD_TOTAL_S = "moe.forward_total_s"  # forwards (steps and dummy batches) since start


def moe_expert_gauge(expert: int) -> str:
    """The gauge of expert ``expert``'s rows since start: ``moe.expert.<id>.tokens``."""
    return f"{GAUGE_MOE_EXPERT_PREFIX}{expert}.tokens"


class _Event(msgspec.Struct, kw_only=True, array_like=True, tag_field="kind"):
    role: str
    pid: int
    seq: int
    t: float  # Unix time, s


class StageEntered(_Event, tag="stage_enter"):
    """A stage (a catalogue span name) was entered; ``level`` is lifecycle, step or request."""

    name: str
    level: str
    thread: str
    attrs: dict[str, Any] = {}


class StageLeft(_Event, tag="stage_exit"):
    """A stage was left after ``duration_ms``; ``error`` is ``"Type: message"`` or None.
    ``thread``: the thread that left it ("" from an older publisher)."""

    name: str
    duration_ms: float
    error: str | None = None
    thread: str = ""


class WaitStarted(_Event, tag="wait_start"):
    """A bounded wait began (``tracing.waits``): ``what`` is waited for, at most ``timeout_s``."""

    what: str
    timeout_s: float


class WaitEnded(_Event, tag="wait_end"):
    """A bounded wait ended: ``outcome`` is ok, timeout, cancelled or error."""

    what: str
    outcome: str
    waited_ms: float


class OpenStageInfo(msgspec.Struct, kw_only=True, array_like=True):
    """One stage open right now (as ``tracing.stage.OpenStage``)."""

    name: str
    level: str
    thread: str
    entered_at: float  # Unix time, s


class OpenWaitInfo(msgspec.Struct, kw_only=True, array_like=True):
    """One bounded wait in progress (``tracing.waits``): ``what``, since ``started_at`` (Unix
    time, s), at most ``timeout_s``, in thread ``thread``."""

    what: str
    started_at: float
    timeout_s: float
    thread: str = ""


class StruckFaultInfo(msgspec.Struct, kw_only=True, array_like=True):
    """An injected fault (``tracing.faults``) that struck the process: ``spec`` as written,
    the ``stage`` it struck in, its ``kind`` (hang, freeze, ...), when (``struck_at``, Unix
    time, s) and in which ``thread``."""

    spec: str
    stage: str
    kind: str
    struck_at: float
    thread: str = ""


class ExporterStatus(msgspec.Struct, kw_only=True, array_like=True):
    """One span exporter's health, as ``tracing.setup.TracingHandle.health()`` gives it:
    ``name`` (otlp, jsonl, in_memory), spans ``exported`` / ``dropped`` (all causes) /
    ``queued`` (the batch queue now), ``failed_exports``, ``last_error`` and
    ``last_error_at`` (Unix time, s), ``endpoint`` (URL or file)."""

    name: str
    exported: int = 0
    dropped: int = 0
    queued: int = 0
    failed_exports: int = 0
    last_error: str | None = None
    last_error_at: float | None = None
    endpoint: str | None = None


class Heartbeat(_Event, tag="heartbeat"):
    """Sent at least once a second by a thread apart from the process's main loop.

    A busy loop that stopped shows as an old ``last_step_at`` while heartbeats go on; a
    frozen process (SIGSTOP, a GIL-holding hang) as heartbeats that stop.
    ``cpu_percent``: of one core, since the last heartbeat. ``rss_bytes``, ``num_threads``:
    now. ``stages``: every open stage, oldest first. ``last_step_at``: Unix time of the last
    engine step (engine cores) or execute_model (workers), else None. ``interval_s``: the
    period of these heartbeats. ``waits``: the bounded waits in progress, oldest first.
    ``exited``: children this process reaped, role → how it ended ("killed by SIGKILL (exit
    status -9)"), as its parent knows it (``TelemetryPublisher.note_child_exit``).
    ``exporters``: this process's span exporters' health (``ExporterStatus``), empty with
    tracing off. ``faults``: injected faults that struck it (``StruckFaultInfo``), oldest
    first; a heartbeat goes out the moment one strikes.
    """

    cpu_percent: float
    rss_bytes: int
    num_threads: int
    stages: list[OpenStageInfo] = []
    last_step_at: float | None = None
    interval_s: float = 1.0
    waits: list[OpenWaitInfo] = []
    exited: dict[str, str] = {}
    exporters: list[ExporterStatus] = []
    faults: list[StruckFaultInfo] = []


class Gauges(_Event, tag="gauges"):
    """Current values of this process's gauges (``GAUGE_*`` names; queue depths, counts)."""

    values: dict[str, float]


class ScheduledRequest(msgspec.Struct, kw_only=True, array_like=True):
    """One request of a step's ``SchedulerOutput`` (``engine/sched/output.py``): it computes
    ``num_scheduled_tokens`` tokens this step (vLLM's ``num_scheduled_tokens[req_id]``),
    after the ``num_computed_tokens`` already in the KV cache, and got ``num_new_blocks`` KV
    blocks for them (a new or resumed request: its whole block table, prefix-cache hits
    included). ``prefill``: prompt tokens (or a recomputation after preemption), not one
    decode token. ``resumed``: back after a preemption (one of ``scheduled_cached_reqs``
    whose block table is replaced). ``pooling``: a pooling model's request (``--runner
    pooling``): all prefill, pooled when its prompt is complete."""

    req_id: str
    num_scheduled_tokens: int
    num_computed_tokens: int
    num_new_blocks: int
    prefill: bool = False
    resumed: bool = False
    pooling: bool = False


# A step record lists at most this many requests of its SchedulerOutput (its counts are whole).
MAX_STEP_REQUESTS = 64


class StepRecord(_Event, tag="step", kw_only=True):
    """One scheduler step of engine ``engine_index``.

    Tokens: ``num_decode_tokens`` (one per decoding request) + ``num_prefill_tokens`` (prompt
    tokens, of ``num_prefill_reqs`` requests, ``num_chunked_prefills`` of them a chunk that
    leaves more for a later step) = ``tokens_scheduled`` ≤ ``token_budget``
    (``max_num_batched_tokens``). ``num_running``/``num_waiting``: requests after the step.
    ``kv_usage``: 0..1 after the step. Durations in ms: ``schedule_ms + execute_ms +
    update_ms`` ≈ ``duration_ms``. ``dummy``: a DP dummy batch (no request; every count 0,
    the defaults). ``step_delay_ms``: the pause ``--step-delay-ms`` makes after this step, not
    part of ``duration_ms`` (0 without the flag).

    Structured outputs: ``num_structured_reqs`` requests sampled under a grammar this step (the
    bitmask's rows), built in ``bitmask_ms`` (part of ``schedule_ms``); ``num_waiting_for_fsm``
    of the waiting requests still wait for their grammar to compile after the step.

    What was scheduled, request by request, in vLLM's ``SchedulerOutput`` terms:
    ``scheduled_new_reqs`` (first scheduled: the worker gets them whole) and
    ``scheduled_cached_reqs`` (known to the worker: running on, or resumed after a
    preemption), each a ``ScheduledRequest`` (at most ``MAX_STEP_REQUESTS`` in all), and
    ``finished_req_ids``: the requests finished since the previous step, which this step tells
    the workers to forget. A step that schedules nothing (``0+0``) runs only for those: right
    after requests finish, one more step hands their ids to the workers.

    The engine core builds one per step (``EngineCore.step``) and hands it to its step
    observers (``engine/core/step_observer.py``) before it is an event: its header is then
    unset (``role`` "", ``seq`` -1, as in a ``Snapshot``'s ``last_step``); ``publish_step``
    stamps it. ``figures()`` is the step without that header.
    """

    role: str = ""
    pid: int = 0
    seq: int = -1
    t: float = 0.0  # Unix time, s: when it was published
    engine_index: int
    step_id: int
    started_at: float  # Unix time, s
    duration_ms: float
    schedule_ms: float = 0.0
    execute_ms: float
    update_ms: float = 0.0
    num_decode_reqs: int = 0
    num_decode_tokens: int = 0
    num_prefill_reqs: int = 0
    num_prefill_tokens: int = 0
    num_chunked_prefills: int = 0
    tokens_scheduled: int = 0
    token_budget: int
    num_running: int = 0
    num_waiting: int = 0
    num_preempted: int = 0
    kv_usage: float
    dummy: bool = False
    step_delay_ms: float = 0.0
    scheduled_new_reqs: list[ScheduledRequest] = []
    scheduled_cached_reqs: list[ScheduledRequest] = []
    finished_req_ids: list[str] = []
    num_structured_reqs: int = 0
    num_waiting_for_fsm: int = 0
    bitmask_ms: float = 0.0

    def figures(self) -> dict[str, Any]:
        """The step's own fields (all but the event header), by name: what ``publish_step``
        takes (the scheduled requests as ``ScheduledRequest`` structs; ``msgspec.to_builtins``
        makes them JSON data, as the flight recorder keeps them)."""
        return {name: getattr(self, name) for name in _STEP_FIGURES}


_STEP_FIGURES = StepRecord.__struct_fields__[len(_Event.__struct_fields__) :]


RequestEventKind = Literal["arrived", "scheduled", "first_token", "preempted", "finished", "aborted"]


class RequestEvent(_Event, tag="request"):
    """A request changed state. ``reason``: the finish reason (stop, length, abort) or why it
    was aborted / preempted, in plain words ("client disconnected", "engine died"). Token
    counts and ``num_blocks`` (KV blocks held) as of now; -1 when the emitter does not know
    (the API server knows no blocks). An engine core's ``finished`` carries the request's
    final prompt / computed / output counts, ``first_token`` (API server) its prompt as
    computed, ``preempted`` its computed count (0). ``finished``/``aborted`` are never
    sampled away."""

    request_id: str
    event: RequestEventKind
    engine_index: int = -1
    reason: str | None = None
    num_prompt_tokens: int = -1
    num_computed_tokens: int = -1
    num_output_tokens: int = -1
    num_blocks: int = -1


class Dropped(_Event, tag="dropped"):
    """Events this publisher did not send since its previous ``Dropped`` (never a silent
    drop), by event kind (``step``, ``request`` ...). ``counts``: all of them. ``sampled``:
    the part sampled or rate-limited away on purpose (steps above 50/s, step stages above
    10/s per name ...). ``refused``: the part refused by a full socket (a subscriber reading
    too slowly). ``counts - sampled`` are real losses: refused, or failed to encode."""

    counts: dict[str, int]
    refused: dict[str, int] = {}
    sampled: dict[str, int] = {}


class RequestProgress(msgspec.Struct, kw_only=True, array_like=True):
    """One request an engine holds right now (``state``: waiting or running), with its
    progress: computed tokens of ``num_prompt_tokens + num_output_tokens``, KV blocks held
    (``num_blocks``; ``block_ids``: which, in block-table order), ``arrived_at`` (Unix s)."""

    request_id: str
    state: str
    engine_index: int
    num_prompt_tokens: int
    num_computed_tokens: int
    num_output_tokens: int
    num_blocks: int
    arrived_at: float
    block_ids: list[int] = []


class Snapshot(_Event, tag="snapshot"):
    """Everything a late subscriber needs from this process, once a second. ``requests``:
    the requests an engine core holds now (at most ``MAX_SNAPSHOT_REQUESTS``), so the
    in-flight panel shows their progress between their state changes."""

    stages: list[OpenStageInfo]
    gauges: dict[str, float]
    last_step: StepRecord | None = None
    requests: list[RequestProgress] = []


MAX_SNAPSHOT_REQUESTS = 256


class RunInfo(_Event, tag="run_info"):
    """Written into recordings by the ``Recorder`` (never published by a process): the
    manifest (``tracing.run_dir.Manifest`` as JSON data) and each planned role's liveness as
    psutil saw it (role → ``running``/``exited: pid 12 exited``...), so a replay shows the
    planned tree, the expected count and the dead. Sent at the start and on each change."""

    manifest: dict[str, Any] = {}
    liveness: dict[str, str] = {}
    found_count: int = 0


Event = (
    StageEntered
    | StageLeft
    | WaitStarted
    | WaitEnded
    | Heartbeat
    | Gauges
    | StepRecord
    | RequestEvent
    | Dropped
    | Snapshot
    | RunInfo
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Event)
_LEN = struct.Struct("<I")


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


def decode_event(data: bytes | memoryview) -> Event:
    """One frame → its event. Raises ``msgspec.DecodeError`` / ``ValidationError`` when it is not one."""
    return _decoder.decode(data)


def telemetry_address(run_dir: Path | str, role: str) -> str:
    """The ``ipc://`` address process ``role`` publishes on (it binds; subscribers connect)."""
    return f"ipc://{run_dir}/{role}.tel"


def encode_recorded(frame: bytes) -> bytes:
    """One frame as it goes into a recording file: a 4-byte little-endian length, then the frame."""
    return _LEN.pack(len(frame)) + frame


def read_recording(file: BinaryIO) -> Iterator[Event]:
    """Every event of a recording, in order; a truncated last record (a recorder killed
    mid-write) ends the iteration quietly, a corrupt one raises ``msgspec.DecodeError``."""
    while True:
        head = file.read(_LEN.size)
        if len(head) < _LEN.size:
            return
        (n,) = _LEN.unpack(head)
        frame = file.read(n)
        if len(frame) < n:
            return
        yield decode_event(frame)
