"""Clients through which the frontend talks to the engine core.

Mirrors vLLM's ``vllm/v1/engine/core_client.py``. The frontend never touches the engine
core's internals: it adds requests, aborts them, asks for outputs and makes utility calls
through an ``EngineCoreClient``:

- ``InprocClient`` (``GLASSBOX_ENABLE_MULTIPROCESSING=0``): the ``EngineCore`` lives in the
  caller's process and ``get_output()`` runs one ``step()``.
- ``SyncMPClient`` (the offline default): the engine core runs in its own process
  (``EngineCoreProc``); requests go out on a ROUTER socket, outputs come back on a PULL
  socket, both bound by this client on ``ipc://`` paths in the run directory.
- ``AsyncMPClient`` (the API server's): the same, driven from an asyncio loop.

Each multiprocess client is one of the engine core's clients (``client_index``; one today,
one per API server with several): it binds its own output socket
(``client_output_address``), stamps its index on every request and utility call, and so
receives only its own outputs. The ``SchedulerStats`` that come with the outputs go into
``stats_table`` (``EngineStatsTable``: latest stats per engine), which ``/metrics`` reads.
"""

from __future__ import annotations

import itertools
import pickle
import time
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgspec
import zmq

from engine import envs
from engine.config import ConfigError, EngineConfig
from engine.core.messages import (
    ENGINE_CORE_DEAD,
    TAG_HANDSHAKE,
    TAG_OUTPUTS,
    TAG_UTILITY,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineCoreSpawnPayload,
    EngineDead,
    EngineHandshake,
    UtilityReply,
    UtilityRequest,
    decode_as,
)
from engine.core.messages import encode as encode_message
from engine.distributed import topology
from engine.frontend.engine_stats import EngineStatsTable
from engine.logger import init_logger
from engine.utils import processes
from engine.utils import run_dir as run_dirs
from engine.utils.processes import EngineDeadError
from engine.utils.wire import ProtocolError

logger = init_logger(__name__)

# One bounded wait on the output socket; between waits the client checks the engine is alive.
POLL_MS = 100


class EngineCoreClient(ABC):
    """The frontend's handle on an engine core."""

    # Resolved by the worker: {"device": "cpu", "dtype": "float32"}.
    device_info: dict[str, str]
    num_gpu_blocks: int
    # The latest SchedulerStats of each engine, as they arrive with the outputs.
    stats_table: EngineStatsTable

    @staticmethod
    def make_client(
        config: EngineConfig, run_dir: Path, multiprocess_mode: bool | None = None
    ) -> EngineCoreClient:
        if multiprocess_mode is None:
            multiprocess_mode = envs.GLASSBOX_ENABLE_MULTIPROCESSING
        return SyncMPClient(config, run_dir) if multiprocess_mode else InprocClient(config, run_dir)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (in-process: runs one engine step to make it)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any:
        """Run ``EngineCore.<method>(*args)`` where the engine lives; return its result."""

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """The engine core in the caller's process; ``get_output`` runs one ``step()``."""

    def __init__(self, config: EngineConfig, run_dir: Path | None = None) -> None:
        from engine.core.engine_core import EngineCore

        self.engine_core = EngineCore(config, run_dir=str(run_dir) if run_dir else None)
        self.device_info = self.engine_core.model_executor.device_info
        self.num_gpu_blocks = self.engine_core.kv_cache_config.num_blocks
        self.last_step_executed = False
        self.stats_table = EngineStatsTable([0])

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        outputs, self.last_step_executed = self.engine_core.step()
        for client_outputs in outputs.values():
            self.stats_table.update_from_outputs(client_outputs)
        return outputs.get(0) or EngineCoreOutputs()

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class MPClient(EngineCoreClient):
    """What both multiprocess clients share: launching the engine core and the handshake.

    Start-up waits for HELLO then READY under one deadline
    (``GLASSBOX_ENGINE_READY_TIMEOUT_S``); on expiry the error names the late process and
    the stage it is in (from the status files). Every later wait is a bounded poll that
    checks the engine process is alive between polls.

    Args:
        config: the engine config.
        run_dir: the instance's run directory (where the ``ipc://`` sockets live).
        client_index: which of the engine core's clients this is (its output socket, the
            ``client_index`` on its requests).
        num_clients: how many clients the engine core serves; the engine connects one output
            socket to each (``client_output_address``). This client launches the engine.

    Raises:
        EngineDeadError: the engine core (or a worker) died; ``root_cause`` says which.
        TimeoutError: start-up took longer than the deadline.
    """

    def __init__(
        self, config: EngineConfig, run_dir: Path, *, client_index: int = 0, num_clients: int = 1
    ) -> None:
        if not 0 <= client_index < num_clients:
            raise ValueError(f"client_index {client_index} is not one of the {num_clients} client(s)")
        self.config = config
        self.run_dir = run_dir
        self.client_index = client_index
        self.ctx = zmq.Context()
        self.input_address = f"ipc://{run_dir}/in.sock"
        self.output_addresses = [client_output_address(run_dir, i) for i in range(num_clients)]
        self.output_address = self.output_addresses[client_index]
        self.input_socket = self.ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.input_socket.bind(self.input_address)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        self.output_socket.bind(self.output_address)
        # The engine core this client talks to: DP rank 0, the only one until data
        # parallelism lands (issue 8); its DEALER identity is its DP rank.
        self.engine_role = topology.plan(config).engine_cores[0]
        self.engine_identity = self.engine_role.dp_rank.to_bytes(2, "little")
        self.stats_table = EngineStatsTable([self.engine_role.dp_rank])
        self.encoder = msgspec.msgpack.Encoder()
        self.pending: deque[EngineCoreOutputs] = deque()
        # Utility calls in flight: call id → (method, the future its UtilityReply resolves).
        self.utility_futures: dict[int, tuple[str, Future]] = {}
        self.call_ids = itertools.count()
        self.dead: EngineDeadError | None = None
        self.engine_proc: processes.ChildProcess | None = None
        self._closed = False
        try:
            self._launch_and_wait_ready()
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ start-up

    def _launch_and_wait_ready(self) -> None:
        from tracing import WaitTimeout, catalogue, stage, wait_for
        from tracing.propagation import inject_trace_headers

        with stage(catalogue.ENGINE_CORE_HANDSHAKE) as st:
            payload = encode_message(
                EngineCoreSpawnPayload(
                    config_pickle=pickle.dumps(self.config, protocol=5),
                    input_address=self.input_address,
                    output_addresses=self.output_addresses,
                    data_parallel_rank=self.engine_role.dp_rank,
                    trace_headers=inject_trace_headers(),
                )
            )
            self.engine_proc = processes.spawn_process(
                self.engine_role.name,
                "engine.core.engine_core_proc:EngineCoreProc.run_engine_core",
                payload,
                self.run_dir,
            )
            timeout = envs.GLASSBOX_ENGINE_READY_TIMEOUT_S
            deadline = time.monotonic() + timeout
            seen: dict[str, EngineHandshake] = {}

            def handshake_step() -> bool:
                """One short poll: record HELLO / READY; True once READY arrived."""
                msg = self._recv(deadline=time.monotonic())
                if msg is not None and msg[0] == TAG_HANDSHAKE:
                    hs = decode_as(EngineHandshake, msg[1][0])
                    if hs.kind not in ("HELLO", "READY"):
                        raise ProtocolError(
                            f"{hs.role} sent {hs.kind} on its output socket; HELLO or READY was due"
                        )
                    seen[hs.kind] = hs
                    logger.debug("engine core %s (pid %d) said %s", hs.role, hs.pid, hs.kind)
                return "READY" in seen

            try:
                # The bounded-wait helper: a deadline, a name, and wait events for telemetry.
                awaited = f"READY from {self.engine_role.name}"
                wait_for(awaited, handshake_step, timeout_s=timeout, poll_interval_s=0)
            except WaitTimeout:
                raise TimeoutError(self._startup_timeout_message(timeout, "HELLO" in seen)) from None
            ready = seen["READY"]
            self.num_gpu_blocks = ready.num_gpu_blocks
            self.device_info = {"device": ready.device, "dtype": ready.dtype}
            st.set(catalogue.ATTR_KV_NUM_BLOCKS, ready.num_gpu_blocks)
            # The engine's DEALER announces itself once connected; wait for it so the first
            # request cannot be dropped by the ROUTER.
            self._await_engine_registration(deadline)

    def _await_engine_registration(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.input_socket.poll(POLL_MS):
                frames = self.input_socket.recv_multipart()
                hs = decode_as(EngineHandshake, frames[-1])
                if hs.kind != "CONNECTED" or frames[0] != self.engine_identity:
                    raise ProtocolError(
                        f"{hs.role} sent {hs.kind} as {frames[0]!r} on its input socket; CONNECTED "
                        f"from {self.engine_identity!r} was due"
                    )
                return
            self._check_alive()
        raise TimeoutError("the engine core never connected its input socket")

    def _startup_timeout_message(self, timeout: float, seen_hello: bool) -> str:
        late = describe_laggard(self.run_dir)
        return (
            f"The engine did not become ready within GLASSBOX_ENGINE_READY_TIMEOUT_S={timeout:g} s "
            f"({'it said HELLO' if seen_hello else 'it never said HELLO'}). {late}"
        )

    # ------------------------------------------------------------------ messages

    def _recv(self, deadline: float | None) -> tuple[bytes, list[bytes]] | None:
        """One message from the engine, or None at the deadline. Raises EngineDeadError."""
        while True:
            if self.output_socket.poll(POLL_MS):
                tag, *frames = self.output_socket.recv_multipart()
                if tag == ENGINE_CORE_DEAD:
                    self._mark_dead(_dead_message(frames))
                return tag, frames
            self._check_alive()
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead
        proc = self.engine_proc
        if proc is not None and not proc.is_alive():
            # Give a dying engine a moment to deliver its ENGINE_CORE_DEAD message.
            if self.output_socket.poll(200):
                tag, *frames = self.output_socket.recv_multipart()
                if tag == ENGINE_CORE_DEAD:
                    self._mark_dead(_dead_message(frames))
            self._mark_dead(None)

    def _mark_dead(self, dead: EngineDead | None) -> None:
        if self.dead is None:
            proc = self.engine_proc
            root_cause = dead.root_cause if dead is not None else None
            if root_cause is None and proc is not None:
                root_cause = processes.format_root_cause(self.run_dir, proc.role, proc.pid, proc.poll())
            self.dead = EngineDeadError(root_cause or "the engine core died")
            # Utility calls still waiting get the same error.
            for _, future in self.utility_futures.values():
                if not future.done():
                    future.set_exception(self.dead)
            self.utility_futures.clear()
            if dead is not None and dead.during_startup and dead.error_type == "ConfigError":
                # A bad setting found by the engine (e.g. a KV budget too small for one
                # request) is the caller's error, raised as in-process: one ConfigError
                # naming the flag, no root-cause block.
                raise ConfigError.from_message(dead.message, flag=dead.flag or "") from None
        raise self.dead

    def _send(self, request_type: EngineCoreRequestType, body: bytes) -> None:
        if self.dead is not None:
            raise self.dead
        try:
            self.input_socket.send_multipart([self.engine_identity, request_type.value, body], copy=False)
        except zmq.ZMQError:
            self._unroutable()

    def _unroutable(self) -> None:
        """The ROUTER cannot reach the engine core: it disconnected, so it is dying or dead."""
        proc = self.engine_proc
        if proc is not None:
            try:
                proc.popen.wait(1.0)
            except Exception:  # still alive but unreachable: report it as dead anyway
                pass
        self._check_alive()
        self._mark_dead(None)

    def _dispatch(self, msg: tuple[bytes, list[bytes]] | None) -> None:
        if msg is None:
            return
        tag, frames = msg
        if tag == TAG_OUTPUTS:
            outputs: EngineCoreOutputs = decode_as(EngineCoreOutputs, frames[0])
            self.stats_table.update_from_outputs(outputs)
            if outputs.outputs or outputs.finished_requests:
                self.pending.append(outputs)  # stats alone need nothing more
        elif tag == TAG_UTILITY:
            reply: UtilityReply = decode_as(UtilityReply, frames[0])
            pending = self.utility_futures.pop(reply.call_id, None)
            if pending is None:
                raise ProtocolError(
                    f"the engine core answered utility call {reply.call_id}, which is not pending"
                )
            method, future = pending
            if future.done():  # the caller gave up (cancelled) before the answer came
                return
            if reply.ok:
                future.set_result(reply.result())
            else:
                future.set_exception(RuntimeError(f"engine utility {method!r} failed: {reply.error}"))
        else:
            raise ProtocolError(f"the engine core sent a message tagged {tag!r} after start-up; "
                                f"expected {TAG_OUTPUTS!r} or {TAG_UTILITY!r}")  # fmt: skip

    def _utility_request(self, method: str, args: tuple) -> tuple[Future, bytes]:
        """A new call id, its pending future, and the encoded ``UtilityRequest``."""
        from tracing.propagation import inject_trace_headers

        call_id = next(self.call_ids)
        future: Future = Future()
        self.utility_futures[call_id] = (method, future)
        return future, encode_message(
            UtilityRequest.make(call_id, method, args, inject_trace_headers() or None, self.client_index)
        )

    def shutdown(self) -> None:
        """Stop the engine core (and through it its workers) within a few seconds."""
        if self._closed:
            return
        self._closed = True
        if self.engine_proc is not None:
            self.engine_proc.stop(timeout=4.0)
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()


class SyncMPClient(MPClient):
    """The engine core in its own process, driven synchronously (the offline ``LLM``'s client)."""

    def add_request(self, request: EngineCoreRequest) -> None:
        request.client_index = self.client_index
        self._send(EngineCoreRequestType.ADD, self.encoder.encode(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None:
            self._send(EngineCoreRequestType.ABORT, self.encoder.encode(list(request_ids)))

    def get_output(self) -> EngineCoreOutputs:
        while not self.pending:
            self._dispatch(self._recv(deadline=None))
        return self.pending.popleft()

    def call_utility(self, method: str, *args: Any) -> Any:
        future, body = self._utility_request(method, args)
        self._send(EngineCoreRequestType.UTILITY, body)
        deadline = time.monotonic() + envs.GLASSBOX_EXECUTE_MODEL_TIMEOUT_S
        # This thread is the only reader: receive (keeping outputs for get_output) until
        # the reply resolves the future.
        while not future.done():
            msg = self._recv(deadline)
            if msg is None:
                raise TimeoutError(f"utility call {method!r} got no answer in time")
            self._dispatch(msg)
        return future.result()


class AsyncMPClient(MPClient):
    """The engine core in its own process, driven from an asyncio loop (the API server's client).

    The handshake runs synchronously before serving starts; afterwards the same sockets are
    used through asyncio shadows, so waiting for outputs never blocks the event loop.
    """

    def __init__(self, config: EngineConfig, run_dir: Path, **kwargs: Any) -> None:
        super().__init__(config, run_dir, **kwargs)
        import zmq.asyncio

        self.async_input = zmq.asyncio.Socket.shadow(self.input_socket.underlying)
        self.async_output = zmq.asyncio.Socket.shadow(self.output_socket.underlying)

    async def _recv_async(self, deadline: float | None) -> tuple[bytes, list[bytes]] | None:
        while True:
            if await self.async_output.poll(POLL_MS):
                tag, *frames = await self.async_output.recv_multipart()
                if tag == ENGINE_CORE_DEAD:
                    self._mark_dead(_dead_message(frames))
                return tag, frames
            self._check_alive()
            if deadline is not None and time.monotonic() >= deadline:
                return None

    async def _send_async(self, request_type: EngineCoreRequestType, body: bytes) -> None:
        if self.dead is not None:
            raise self.dead
        try:
            await self.async_input.send_multipart(
                [self.engine_identity, request_type.value, body], copy=False
            )
        except zmq.ZMQError:
            self._unroutable()

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        request.client_index = self.client_index
        await self._send_async(EngineCoreRequestType.ADD, self.encoder.encode(request))

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None:
            await self._send_async(EngineCoreRequestType.ABORT, self.encoder.encode(list(request_ids)))

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next outputs; only one task (the output handler) may call this."""
        while not self.pending:
            self._dispatch(await self._recv_async(deadline=None))
        return self.pending.popleft()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Utility call; its answer is picked up by the output handler's receive loop."""
        import asyncio

        future, body = self._utility_request(method, args)
        await self._send_async(EngineCoreRequestType.UTILITY, body)
        deadline = time.monotonic() + envs.GLASSBOX_EXECUTE_MODEL_TIMEOUT_S
        waiter = asyncio.wrap_future(future)
        # The output handler resolves the future; wait on it in bounded slices, checking
        # between them that the engine is alive.
        try:
            while not waiter.done():
                self._check_alive()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"utility call {method!r} got no answer in time")
                await asyncio.wait({waiter}, timeout=min(POLL_MS / 1000, left))
        finally:
            if not waiter.done():
                waiter.cancel()  # given up (timeout, dead engine, cancelled caller): a late answer is dropped
        return waiter.result()

    # The synchronous verbs are not used from the event loop.
    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError("use add_request_async")

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError("use abort_requests_async")

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError("use get_output_async")

    def call_utility(self, method: str, *args: Any) -> Any:
        raise NotImplementedError("use call_utility_async")


def client_output_address(run_dir: Path, client_index: int) -> str:
    """Where client ``client_index`` receives its engine outputs (it binds, engines connect)."""
    return f"ipc://{run_dir}/out{client_index}.sock"


def _dead_message(frames: list[bytes]) -> EngineDead | None:
    """The ``EngineDead`` after an ``ENGINE_CORE_DEAD`` tag (None when it did not come)."""
    return decode_as(EngineDead, frames[0]) if frames else None


def describe_laggard(run_dir: Path) -> str:
    """Name the process that holds start-up back, and the stage it is in (from status files).

    The engine core starts its workers, so the deepest process that is inside a stage is the
    one everybody waits for: a worker in a stage wins over the engine core. When no process
    reports a stage, the first planned one without a status file has not started.
    """
    from tracing import read_status_file

    engine_roles = [r.name for r in run_dirs.planned_roles(run_dir) if r.in_engine]
    now = time.time()
    statuses = {role: read_status_file(run_dirs.status_file(run_dir, role)) for role in engine_roles}
    in_stage = [role for role in engine_roles if (statuses[role] or {}).get("stage")]
    if in_stage:
        role = in_stage[-1]  # planned order is engine core, then its workers
        status = statuses[role]
        return (
            f"{role} (pid {status.get('pid')}) has been in stage {status['stage']} for "
            f"{now - status.get('entered_at', now):.1f} s."
        )
    for role in engine_roles:
        if statuses[role] is None:
            return f"{role} has not started yet (no status file in {run_dir})."
    return "No process reports a stage; see the log above."
