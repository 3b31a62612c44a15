"""Messages between the frontend (``LLM`` / ``AsyncLLM``) and the engine core.

Mirrors vLLM's ``vllm/v1/engine/__init__.py``. In-process (``InprocClient``) these are
passed as Python objects; the multiprocess clients encode them with msgspec (msgpack) as
positional arrays (``array_like``), as vLLM does: the **field order is the wire format**, so
new fields go at the end, with defaults.
Fields later work needs (``client_index``, ``data_parallel_rank``, ``current_wave``,
``priority``, ``trace_headers``) are already here.

This module is the whole client ↔ engine-core protocol::

    client 0 ──spawn (stdin pipe)─▶ engine core   EngineCoreSpawnPayload
    client 0 ◀──PUSH/PULL───────── engine core    TAG_HANDSHAKE EngineHandshake HELLO, then READY
    client i ◀──DEALER/ROUTER───── engine core    EngineHandshake CONNECTED (its input socket to i is up)
    client i ──ROUTER/DEALER──────▶ engine core   ADD EngineCoreRequest | ABORT AbortRequests | UTILITY UtilityRequest
    client i ◀──PUSH/PULL───────── engine core    TAG_OUTPUTS EngineCoreOutputs | TAG_UTILITY UtilityReply
    client i ◀──PUSH/PULL───────── engine core    ENGINE_CORE_DEAD EngineDead (last words)

Multi-node data parallelism (``docs/multi-node.md``) adds one socket, on the head's client 0
(``--data-parallel-rpc-port``, TCP), which headless engine cores join before anything else::

    client 0 ◀──DEALER/ROUTER───── headless engine core   EngineHandshake HELLO (its rank, DP size)
    client 0 ──ROUTER/DEALER──────▶ headless engine core  JoinAccepted (the head's engine sockets)
                                                          | JoinRefused | HeadStopping (the head stops)

The connection stays open for the engine core's life: both sides set ZMQ heartbeats on it;
the head learns of a lost rank from its socket monitor (the connection the HELLO came on), the
engine core of a lost head from its socket monitor. Every other socket is as below, on TCP
addresses (``head_engine_addresses``) instead of ``ipc://`` paths.

One socket pair per client: each client (an API server, or the offline ``LLM``) binds its
own ROUTER (input) and PULL (output) at ``input_addresses[i]`` / ``output_addresses[i]``
of the spawn payload, and every engine core connects one DEALER and one PUSH to each
(vLLM's layout with ``--api-server-count``). A request's ``client_index`` must be the index
of the socket it came in on; each step's ``EngineCoreOutputs`` are grouped by it and a
utility reply goes to the caller — so no client ever sees another's outputs. Client 0
launched the engines and alone gets the HELLO / READY handshake; ``ENGINE_CORE_DEAD`` goes
to every client, and so do the engine's ``SchedulerStats`` (``engine_index`` says which
engine), on a client's outputs or on their own.

The wire enums (``FinishReason``, ``EngineCoreRequestType``) live here too, so the frontend
needs nothing from the scheduler (``engine.sched``) to read a message.
"""

from __future__ import annotations

import enum
import functools
import pickle
import time
from typing import Any, Literal

import msgspec

from engine.outputs import Float32Tensor, LogprobsLists
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.utils.wire import ErrorKind, ProtocolError, decode, error_kind

BOUNDARY = "client ↔ engine core"


class FinishReason(enum.IntEnum):
    """Why a request finished, as reported to the client (vLLM's ``FinishReason``).

    A wire enum: it travels in ``EngineCoreOutput``, so it lives with the messages
    (``engine.sched.request`` re-exports it).
    """

    STOP = 0
    LENGTH = 1
    ABORT = 2
    # vLLM 0.33's: the engine could not go on with the request (a structured-output grammar
    # that failed to compile in the engine, or that no token can follow).
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequestType(enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    # Internal: from the DP coordinator's wave socket (a client never sends it).
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"
    # Internal: put on the engine core's own input queue when a worker died.
    EXECUTOR_FAILED = b"\x04"
    # Internal: the input thread received a message that breaks the protocol.
    PROTOCOL_ERROR = b"\x05"
    # Internal: a headless engine core lost its head (or the head said it stops).
    HEAD_LOST = b"\x06"


class EngineCoreRequest(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True, gc=False):
    """A tokenized, validated request on its way to the scheduler.

    A generation request carries ``sampling_params``, a pooling one (``--runner pooling``)
    ``pooling_params`` and no sampling params (vLLM's rule: exactly one of the two).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    eos_token_id: int | None
    arrival_time: float
    data_parallel_rank: int | None = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: dict[str, str] | None = None
    pooling_params: PoolingParams | None = None


class EngineCoreEventType(enum.IntEnum):
    """What happened to a request inside the engine core (vLLM's ``EngineCoreEventType``)."""

    QUEUED = 1  # added to the scheduler's waiting queue
    SCHEDULED = 2  # scheduled for the first time, or again after a preemption
    PREEMPTED = 3  # its KV blocks freed; back to waiting


class EngineCoreEvent(msgspec.Struct, array_like=True, gc=False):
    """One ``EngineCoreEventType`` with its time (``time.time()``, s): the frontend turns
    these into time in queue, prefill and decode time (metrics and the request's trace)."""

    type: EngineCoreEventType
    timestamp: float


class EngineCoreOutput(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True, gc=False):
    """New tokens (and maybe a finish) for one request, from one engine step.

    ``events``: what happened to the request in the engine since its previous output
    (queued, scheduled, preempted, with times), or None. ``pooling_output``: a pooling
    request's vector (it comes once, with the finish: ``stop``), as float32 bytes.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    events: list[EngineCoreEvent] | None = None
    pooling_output: Float32Tensor | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# Upper bounds (s) of the grammar compile-time histogram (glassbox:structured_output_compile_seconds).
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class SchedulerStats(msgspec.Struct, kw_only=True, array_like=True, gc=False):
    """Scheduler state after a step (vLLM ``vllm/v1/metrics/stats.py``).

    ``kv_cache_usage`` is the fraction of usable blocks in use (0..1). Prefix-cache
    figures are cumulative token counts since start.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    step_counter: int = 0
    num_scheduled_tokens: int = 0
    # Structured outputs: waiting requests whose grammar still compiles, and every grammar
    # compile since start as a histogram (counts per bucket of GRAMMAR_COMPILE_BUCKETS, then
    # one for the rest; the sum of the seconds).
    num_waiting_for_fsm: int = 0
    grammar_compile_counts: list[int] = msgspec.field(default_factory=list)
    grammar_compile_seconds_sum: float = 0.0


class EngineCoreOutputs(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine step produced for one client.

    ``engine_index``: the DP rank of the engine that sent it. ``scheduler_stats``: that
    engine's state after the step (every client gets them, also with no outputs of its own,
    and once more when the engine goes idle); the client keeps the latest per engine
    (``EngineStatsTable``).
    """

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = msgspec.field(default_factory=time.monotonic)
    finished_requests: set[str] | None = None


class EngineHandshake(msgspec.Struct, kw_only=True, array_like=True):
    """Start-up messages from an engine core to its frontend.

    HELLO is sent as soon as the engine core's sockets are connected (nothing heavy has
    happened yet); READY once its workers are up and the KV cache is sized, carrying what
    only the worker could resolve (device, dtype) and the number of KV blocks.
    """

    kind: Literal["HELLO", "READY", "CONNECTED"]  # CONNECTED: sent on the input socket
    role: str
    pid: int
    data_parallel_rank: int = 0
    num_gpu_blocks: int = 0
    device: str = ""
    dtype: str = ""
    max_model_len: int = 0
    # A headless engine core's HELLO on the head's join socket: its DP size, checked there.
    data_parallel_size: int = 0


class AbortRequests(msgspec.Struct, kw_only=True, array_like=True):
    """ABORT: stop these requests and free their KV blocks. ``trace_headers``: the caller's
    span (W3C), e.g. the API server's for a client that went away."""

    request_ids: list[str]
    trace_headers: dict[str, str] | None = None


class UtilityRequest(msgspec.Struct, kw_only=True, array_like=True):
    """Run ``EngineCore.<method>(*args)`` in the engine core; the answer carries ``call_id``.

    ``args_pickle``: the pickled argument tuple (utility calls are generic; their arguments
    are whatever the method takes). ``trace_headers``: the caller's span (W3C).
    """

    call_id: int
    method: str
    args_pickle: bytes = b""
    trace_headers: dict[str, str] | None = None
    # The calling client: its output socket gets the reply.
    client_index: int = 0

    @classmethod
    def make(
        cls,
        call_id: int,
        method: str,
        args: tuple = (),
        trace_headers: dict[str, str] | None = None,
        client_index: int = 0,
    ):
        args_pickle = pickle.dumps(tuple(args), protocol=5) if args else b""
        return cls(call_id=call_id, method=method, args_pickle=args_pickle, trace_headers=trace_headers,
                   client_index=client_index)  # fmt: skip

    def call_args(self) -> tuple:
        args = pickle.loads(self.args_pickle) if self.args_pickle else ()
        if not isinstance(args, tuple):
            raise ProtocolError(f"malformed message on the {BOUNDARY} boundary: utility {self.method!r} "
                                f"arguments are a {type(args).__name__}, not a tuple")  # fmt: skip
        return args


class UtilityReply(msgspec.Struct, kw_only=True, array_like=True):
    """The answer to ``UtilityRequest`` ``call_id``: a result or an error.

    ``result_pickle``: the pickled return value (utility results are arbitrary objects,
    e.g. ``SchedulerStats`` or a dict). ``error``: ``"<type>: <message>"`` when it failed.
    """

    call_id: int
    ok: bool = True
    result_pickle: bytes = b""
    error: str = ""

    @classmethod
    def success(cls, call_id: int, value: Any) -> UtilityReply:
        return cls(call_id=call_id, result_pickle=pickle.dumps(value, protocol=5))

    @classmethod
    def failure(cls, call_id: int, e: BaseException) -> UtilityReply:
        return cls(call_id=call_id, ok=False, error=f"{type(e).__name__}: {e}")

    def result(self) -> Any:
        return pickle.loads(self.result_pickle) if self.result_pickle else None


class EngineDead(msgspec.Struct, kw_only=True, array_like=True):
    """The engine core's last words (vLLM: ``ENGINE_CORE_DEAD``).

    ``root_cause`` is the printed block (role, rank, pid, stage, exit); ``error_type`` (the
    class name, for people) / ``message`` / ``flag`` / ``kind`` describe the exception that
    ended it; ``during_startup`` is true when it died before READY (an ``ErrorKind.CONFIG``
    then is the caller's bad setting).
    """

    root_cause: str
    error_type: str = ""
    message: str = ""
    flag: str | None = None
    during_startup: bool = False
    kind: ErrorKind = ErrorKind.OTHER

    @classmethod
    def from_exception(cls, root_cause: str, e: BaseException, during_startup: bool) -> EngineDead:
        """The last words for a death by ``e`` (its kind decided here, by its type)."""
        flag = getattr(e, "flag", None)
        return cls(
            root_cause=root_cause,
            error_type=type(e).__name__,
            message=str(e),
            flag=flag if isinstance(flag, str) else None,
            during_startup=during_startup,
            kind=error_kind(e),
        )


class EngineCoreSpawnPayload(msgspec.Struct, kw_only=True):
    """What the engine core process needs to start (written to its stdin by ``spawn_process``).

    ``config_pickle`` is the pickled ``EngineConfig`` (a tree of dataclasses, pickled rather
    than mapped field by field onto msgpack). ``trace_headers``: the spawning span (W3C), so
    the engine core's start-up stages are its children. ``input_addresses`` and
    ``output_addresses``: one of each per client (API server), indexed by ``client_index``;
    the engine core connects a DEALER to each input and a PUSH to each output.
    ``coordinator_address``: where it pushes its request counts (``EngineLoad``) and wave
    starts when there is a ``DPCoordinator`` (data parallelism), else None;
    ``coordinator_wave_address``: where the coordinator publishes ``DPWave``.
    """

    config_pickle: bytes
    input_addresses: list[str]
    output_addresses: list[str]
    data_parallel_rank: int = 0
    trace_headers: dict[str, str] | None = None
    coordinator_address: str | None = None
    coordinator_wave_address: str | None = None
    # A headless node's engine core: the head's join socket (tcp://HOST:PORT). The engine
    # core joins there first; the head's JoinAccepted gives the four addresses above.
    head_address: str | None = None

    @property
    def config(self) -> Any:
        return pickle.loads(self.config_pickle)


class EnginesInfo(msgspec.Struct, kw_only=True):
    """What client 0 learned at start-up and hands to the other clients (API servers).

    Only client 0 launches the engine cores and gets their READY; an API server started
    after it attaches with this: the engines to expect a CONNECTED from (and watch, by
    pid), the resolved device and dtype, the smallest KV cache, and where the
    ``DPCoordinator`` publishes its counts (None without data parallelism).
    """

    engine_roles: list[str]
    engine_pids: list[int]
    num_gpu_blocks: int
    device: str
    dtype: str
    coordinator_publish_address: str | None = None


class JoinAccepted(msgspec.Struct, kw_only=True, array_like=True, tag="accepted"):
    """The head to a headless engine core that said HELLO: where the head's engine sockets are
    (its clients' inputs and outputs, the coordinator's input and wave publisher), and the
    head's DP size (the engine core refuses to run under another)."""

    input_addresses: list[str]
    output_addresses: list[str]
    coordinator_address: str | None
    coordinator_wave_address: str | None
    data_parallel_size: int


class JoinRefused(msgspec.Struct, kw_only=True, array_like=True, tag="refused"):
    """The head will not take this engine core (a rank it runs itself, one that joined
    already, another DP size); ``reason`` is one line for the headless node's log."""

    reason: str


class HeadStopping(msgspec.Struct, kw_only=True, array_like=True, tag="stopping"):
    """The head stops (SIGTERM, or the engine died): the headless engine core exits 0."""

    reason: str


# What the head sends a headless engine core on the join socket.
HeadToEngine = JoinAccepted | JoinRefused | HeadStopping


def tcp_address(host: str, port: int) -> str:
    """``tcp://host:port`` (an IPv6 host in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def head_engine_addresses(host: str, port: int, num_clients: int) -> JoinAccepted:
    """The head's TCP layout from ``--data-parallel-rpc-port`` P: P joins (the head's client 0
    binds it), P + 1 the coordinator's input, P + 2 its wave publisher, P + 3 + 2i and
    P + 4 + 2i client i's input and output (one pair per API server). Every one of
    P .. P + 2 + 2 × ``num_clients`` must be open to the headless nodes.

    Raises:
        ValueError: the last port is above 65535.
    """
    last = port + 2 + 2 * num_clients
    if last > 65535:
        raise ValueError(
            f"--data-parallel-rpc-port {port} with {num_clients} API server(s) needs ports up to {last}"
        )
    return JoinAccepted(
        input_addresses=[tcp_address(host, port + 3 + 2 * i) for i in range(num_clients)],
        output_addresses=[tcp_address(host, port + 4 + 2 * i) for i in range(num_clients)],
        coordinator_address=tcp_address(host, port + 1),
        coordinator_wave_address=tcp_address(host, port + 2),
        data_parallel_size=0,
    )


_encoder = msgspec.msgpack.Encoder()
# One decoder per message type, made on first use.
_decoder_for = functools.cache(msgspec.msgpack.Decoder)


def encode(message: Any) -> bytes:
    """msgpack bytes of any message of this boundary."""
    return _encoder.encode(message)


def decode_as(message_type: Any, data: bytes | memoryview) -> Any:
    """Decode ``data`` as ``message_type``; ``ProtocolError`` when it does not fit."""
    return decode(_decoder_for(message_type), data, BOUNDARY)


# Frame tags on the engine → frontend socket (the first frame of each multipart message).
TAG_HANDSHAKE = b"H"
TAG_OUTPUTS = b"O"
TAG_UTILITY = b"U"
# A lone frame the engine core sends when it dies (vLLM: ``EngineCoreProc.ENGINE_CORE_DEAD``),
# followed by a frame with an encoded ``EngineDead``.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
