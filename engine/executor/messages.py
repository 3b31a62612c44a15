"""Messages between the engine core (``MultiprocExecutor``) and its worker processes.

Mirrors the traffic of vLLM's ``vllm/v1/executor/multiproc_executor.py``; the whole protocol
is in this one module::

    executor ──spawn (stdin pipe)──▶ worker      WorkerSpawnPayload
    executor ◀──response queue────── worker      WorkerReady (once), then WorkerReply per RPC
    executor ──rpc broadcast queue─▶ workers     WorkerRPC
    executor ◀──response queue────── worker      WorkerReply

Everything is msgspec (msgpack). Each ``WorkerRPC`` carries the W3C trace context of the
caller's current span (``trace_headers``), so a worker's span for that call is a child of
the engine core's span that made it. The response queue carries two kinds of message, so
``WorkerReady`` and ``WorkerReply`` are tagged and decoded as a union.

Where a value is an arbitrary Python object (``collective_rpc`` arguments such as the
``KVCacheConfig`` or ``init_worker``'s kwargs, and results such as the device dict or a KV
cache spec), it travels as pickled bytes in a field whose name says so (``*_pickle``):
``collective_rpc`` is a generic call and its arguments are whatever the worker method
takes. The per-step traffic is typed: ``execute_model``'s ``SchedulerOutput`` goes out in
``scheduler_output`` and its ``ModelRunnerOutput`` comes back in ``model_runner_output``.
"""

from __future__ import annotations

import pickle
import time
import traceback
from typing import Any

import msgspec

from engine.executor.shm_broadcast import MessageQueueHandle
from engine.outputs import ModelRunnerOutput
from engine.sched.output import SchedulerOutput
from engine.utils.wire import ErrorKind, ProtocolError, decode, error_kind

BOUNDARY = "engine core ↔ worker"


class WorkerSpawnPayload(msgspec.Struct, kw_only=True):
    """What a worker process needs to start (written to its stdin by ``spawn_process``).

    ``config_pickle`` is the pickled ``EngineConfig``: a tree of dataclasses the worker
    only reads, pickled rather than mapped field by field onto msgpack.
    ``trace_headers`` is the spawning span's context: the worker's start-up stages are its
    children.
    """

    config_pickle: bytes
    rank: int
    local_rank: int
    rpc_handle: MessageQueueHandle
    response_handle: MessageQueueHandle
    trace_headers: dict[str, str] | None = None

    @property
    def config(self) -> Any:
        return pickle.loads(self.config_pickle)


class WorkerRPC(msgspec.Struct, kw_only=True, array_like=True):
    """One ``collective_rpc``: run ``method`` on every worker.

    ``output_rank``: only that rank answers (None: every rank does).
    ``scheduler_output``: ``execute_model``'s argument, typed.
    ``args_pickle``: any other ``(args, kwargs)``, pickled (arbitrary Python objects).
    ``trace_headers``: the caller's span at the time of the call (W3C). ``sent_at``: when it
    was written to the broadcast queue (``time.time()``, s): the reader's wait is now − this.
    """

    method: str
    output_rank: int | None = None
    trace_headers: dict[str, str] | None = None
    scheduler_output: SchedulerOutput | None = None
    args_pickle: bytes = b""
    sent_at: float = 0.0

    @classmethod
    def make(
        cls,
        method: str,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        output_rank: int | None = None,
        trace_headers: dict[str, str] | None = None,
    ) -> WorkerRPC:
        """The RPC for ``method(*args, **kwargs)``: ``execute_model``'s one ``SchedulerOutput``
        travels typed (``scheduler_output``), any other call's arguments pickled."""
        typed = len(args) == 1 and not kwargs and isinstance(args[0], SchedulerOutput)  # execute_model's
        args_pickle = b"" if typed else pickle.dumps((tuple(args), dict(kwargs or {})), protocol=5)
        return cls(method=method, output_rank=output_rank, trace_headers=trace_headers,
                   scheduler_output=args[0] if typed else None, args_pickle=args_pickle, sent_at=time.time())  # fmt: skip

    def call_args(self) -> tuple[tuple, dict[str, Any]]:
        """The ``(args, kwargs)`` to call ``method`` with."""
        if self.scheduler_output is not None:
            return (self.scheduler_output,), {}
        return self._unpickled_args()

    def _unpickled_args(self) -> tuple[tuple, dict[str, Any]]:
        """``args_pickle`` as ``(args, kwargs)`` (every RPC but ``execute_model``).

        Raises:
            ProtocolError: it does not hold a ``(tuple, dict)``.
        """
        if not self.args_pickle:
            return (), {}
        call = pickle.loads(self.args_pickle)
        args, kwargs = call if isinstance(call, tuple) and len(call) == 2 else (None, None)
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise ProtocolError(f"malformed message on the {BOUNDARY} boundary: {self.method} arguments "
                                f"are not (tuple, dict)")  # fmt: skip
        return args, kwargs


class WorkerReady(msgspec.Struct, kw_only=True, tag="ready"):
    """A worker process is up and listening (its wrapper is built; nothing heavy yet).

    ``device`` and ``dtype`` are as configured (``auto`` until ``init_device`` resolves them).
    """

    role: str
    rank: int
    pid: int
    device: str = ""
    dtype: str = ""


class WorkerError(msgspec.Struct, kw_only=True):
    """An exception a worker raised in an RPC (the worker exits after reporting it).

    ``kind`` is what the engine core acts on; ``type`` (the class name) is for people.
    """

    type: str
    message: str
    traceback: str
    flag: str | None = None  # a ConfigError's flag: the caller reports it as one line
    kind: ErrorKind = ErrorKind.OTHER

    @classmethod
    def from_exception(cls, e: BaseException) -> WorkerError:
        flag = getattr(e, "flag", None)
        return cls(
            type=type(e).__name__,
            message=str(e),
            traceback="".join(traceback.format_exception(type(e), e, e.__traceback__)),
            flag=flag if isinstance(flag, str) else None,
            kind=error_kind(e),
        )


class WorkerReply(msgspec.Struct, kw_only=True, tag="reply"):
    """A worker's answer to one ``WorkerRPC``: a result, or the error it raised.

    ``model_runner_output``: ``execute_model``'s result, typed.
    ``result_pickle``: any other result, pickled (arbitrary Python objects).
    """

    rank: int
    method: str
    ok: bool = True
    model_runner_output: ModelRunnerOutput | None = None
    result_pickle: bytes = b""
    error: WorkerError | None = None

    @classmethod
    def success(cls, rank: int, method: str, value: Any) -> WorkerReply:
        if isinstance(value, ModelRunnerOutput):
            return cls(rank=rank, method=method, model_runner_output=value)
        return cls(rank=rank, method=method, result_pickle=pickle.dumps(value, protocol=5))

    @classmethod
    def failure(cls, rank: int, method: str, e: BaseException) -> WorkerReply:
        return cls(rank=rank, method=method, ok=False, error=WorkerError.from_exception(e))

    def result(self) -> Any:
        if self.model_runner_output is not None:
            return self.model_runner_output
        return pickle.loads(self.result_pickle) if self.result_pickle else None


_encoder = msgspec.msgpack.Encoder()
_rpc_decoder = msgspec.msgpack.Decoder(WorkerRPC)
_response_decoder = msgspec.msgpack.Decoder(WorkerReady | WorkerReply)
_spawn_decoder = msgspec.msgpack.Decoder(WorkerSpawnPayload)


def encode(message: WorkerSpawnPayload | WorkerRPC | WorkerReady | WorkerReply) -> bytes:
    return _encoder.encode(message)


def decode_rpc(data: bytes | memoryview) -> WorkerRPC:
    return decode(_rpc_decoder, data, BOUNDARY)


def decode_response(data: bytes | memoryview) -> WorkerReady | WorkerReply:
    return decode(_response_decoder, data, BOUNDARY)


def decode_spawn_payload(data: bytes) -> WorkerSpawnPayload:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(f"malformed message on the {BOUNDARY} boundary: the spawn payload is a "
                            f"{type(data).__name__}, not encoded WorkerSpawnPayload bytes")  # fmt: skip
    return decode(_spawn_decoder, data, BOUNDARY)
