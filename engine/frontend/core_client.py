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

With ``--data-parallel-size N`` a multiprocess client holds N engine cores and starts the
``DPCoordinator``; it load-balances new requests over the engines (vLLM's
``DPLBAsyncMPClient``: lowest ``waiting * 4 + running``), see ``MPClient``.

Each multiprocess client is one of the engine cores' clients (``client_index``: the offline
``LLM``, or one per API server with ``--api-server-count``): it binds its own input and
output sockets (``client_input_address``, ``client_output_address``), stamps its index on
every request and utility call, and so receives only its own outputs. Client 0 launches the
engine cores (and the coordinator); the others attach to them with the ``EnginesInfo`` that
client 0 hands on. The ``SchedulerStats`` that come with the outputs go into
``stats_table`` (``EngineStatsTable``: latest stats per engine), which ``/metrics`` reads.
"""

from __future__ import annotations

import errno
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
from engine.core.coordinator_messages import (
    CoordinatorSpawnPayload,
    EngineLoads,
    coordinator_addresses,
    score,
    wave_address,
)
from engine.core.coordinator_messages import decode_as as decode_coordinator
from engine.core.coordinator_messages import encode as encode_coordinator
from engine.core.messages import (
    ENGINE_CORE_DEAD,
    TAG_HANDSHAKE,
    TAG_OUTPUTS,
    TAG_UTILITY,
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineCoreSpawnPayload,
    EngineDead,
    EngineHandshake,
    EnginesInfo,
    HeadStopping,
    JoinAccepted,
    JoinRefused,
    UtilityReply,
    UtilityRequest,
    decode_as,
    head_engine_addresses,
    tcp_address,
)
from engine.core.messages import encode as encode_message
from engine.distributed import topology
from engine.frontend.engine_stats import EngineStatsTable
from engine.logger import init_logger
from engine.utils import processes
from engine.utils.processes import EngineDeadError
from engine.utils.supervisor import Supervisor, describe_laggard, find_laggard, os_state, wait_for_exit
from engine.utils.wire import ErrorKind, ProtocolError
from tracing.telemetry.publisher import get_publisher

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
    """What both multiprocess clients share: launching the engine cores and the handshake.

    With ``--data-parallel-size N`` client 0 starts N engine cores (``EngineCore_DP<k>``,
    each with its own workers) and, for N > 1, the ``DPCoordinator``; with several clients
    (API servers) the others attach to those engines (``engines``). Every engine connects to
    each client's ROUTER (input; an engine's DEALER identity is its DP rank) and pushes to
    each client's PULL (outputs), so one client's outputs of every engine arrive merged on
    its one socket, each stamped with its ``engine_index``. Each new request goes to the engine with the lowest
    score ``waiting * 4 + running`` (vLLM's ``DPLBAsyncMPClient``): the coordinator's latest
    published counts, plus the requests this client sent each engine since that publish; a
    request that pins ``data_parallel_rank`` goes to that engine. Aborts go to the engine
    that has the request; utility calls go to every engine (engine 0's answer is returned).

    Multi-node DP (the head: ``--data-parallel-size-local`` K0 below the DP size D, with
    ``--data-parallel-address``): client 0 starts only engines 0..K0-1; every socket an engine
    uses is TCP on the head's address (``head_engine_addresses``), and client 0 binds a join
    socket at ``--data-parallel-rpc-port`` where the headless nodes' engine cores say HELLO
    and get those addresses (vLLM's handshake socket). A rank that has not joined within
    ``GLASSBOX_DP_JOIN_TIMEOUT_S`` fails start-up with the ranks that never joined named; a
    joined rank whose connection ends (its node died, SIGKILL included: the join
    socket's monitor; or a silent network: ZMQ heartbeats) is reported lost — a log line and
    the root cause naming it — and the tree stops, as vLLM's DP engines are all or nothing.
    Stopping, client 0 tells each joined rank ``HeadStopping`` (they exit 0).

    Start-up (client 0) waits for HELLO then READY from every engine under one deadline
    (``GLASSBOX_ENGINE_READY_TIMEOUT_S``); on expiry the error names the engines not ready
    and the late process and its stage (from the status files). Every client then waits
    for each engine's CONNECTED on its own input socket. Every later wait is a bounded poll
    that raises, between polls, what the ``Supervisor`` (``engine/utils/supervisor.py``)
    noticed: it waits on the pidfd of every engine process (and of the coordinator, and of
    processes handed to ``watch_child``); when one dies, client 0 stops the others, and one
    ``EngineDeadError`` names it. An attached client watches the engines by pid and leaves
    stopping (and the root cause) to client 0.

    Args:
        config: the engine config.
        run_dir: the instance's run directory (where the ``ipc://`` sockets live).
        client_index: which of the engine cores' clients this is (its output socket, the
            ``client_index`` on its requests).
        num_clients: how many clients the engine cores serve; each engine connects one
            input and one output socket to each (``client_input_address``,
            ``client_output_address``).
        engines: None for client 0, which launches the engines; for any other client, what
            client 0 learned (``MPClient.engines_info()``), to attach to the same engines.

    Raises:
        EngineDeadError: an engine core, a worker or the coordinator died; ``root_cause`` says which.
        TimeoutError: start-up took longer than the deadline.
    """

    def __init__(
        self,
        config: EngineConfig,
        run_dir: Path,
        *,
        client_index: int = 0,
        num_clients: int = 1,
        engines: EnginesInfo | None = None,
    ) -> None:
        if not 0 <= client_index < num_clients:
            raise ValueError(f"client_index {client_index} is not one of the {num_clients} client(s)")
        if (engines is None) != (client_index == 0):
            raise ValueError("client 0 launches the engine cores; every other client attaches (engines=...)")
        self.config = config
        self.run_dir = run_dir
        self.client_index = client_index
        self.ctx = zmq.Context()
        pc = config.parallel_config
        # Multi-node DP (this is the head): TCP on --data-parallel-address, else ipc.
        self.head_layout: JoinAccepted | None = None
        if pc.multi_node:
            try:
                self.head_layout = head_engine_addresses(pc.data_parallel_address, pc.data_parallel_rpc_port,
                                                         num_clients)  # fmt: skip
            except ValueError as e:
                raise ConfigError.from_message(str(e), flag="--data-parallel-rpc-port") from None
            self.input_addresses = list(self.head_layout.input_addresses)
            self.output_addresses = list(self.head_layout.output_addresses)
        else:
            self.input_addresses = [client_input_address(run_dir, i) for i in range(num_clients)]
            self.output_addresses = [client_output_address(run_dir, i) for i in range(num_clients)]
        self.input_address = self.input_addresses[client_index]
        self.output_address = self.output_addresses[client_index]
        self.input_socket = self.ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        # The headless nodes' join socket (client 0 of a head only), and the ranks joined there:
        # rank → its HELLO.
        self.join_socket: zmq.Socket | None = None
        self.joined: dict[int, EngineHandshake] = {}
        self.joined_identities: dict[int, bytes] = {}  # rank → its join connection's ZMQ identity
        self.joined_at: dict[int, float] = {}  # rank → when it joined (time.monotonic)
        self.coordinator_sub: zmq.Socket | None = None
        try:
            _bind(self.input_socket, self.input_address)
            _bind(self.output_socket, self.output_address)
        except BaseException:
            self.input_socket.close(linger=0)
            self.output_socket.close(linger=0)
            self.ctx.term()
            raise
        # The engine cores this client talks to, one per DP rank; an engine's DEALER
        # identity is its DP rank. With multi-node DP some run on headless nodes (remote).
        plan = topology.plan(config)
        self.remote_roles = list(plan.remote_engine_cores)
        self.engine_roles = list(plan.engine_cores)
        self.engine_role = self.engine_roles[0]
        self.engine_identities = [r.dp_rank.to_bytes(2, "little") for r in self.engine_roles]
        self.engine_identity = self.engine_identities[0]
        self.coordinator_role = plan.coordinator
        self.stats_table = EngineStatsTable(r.dp_rank for r in self.engine_roles)
        # Load balancing: the coordinator's latest (waiting, running) per engine, what this
        # client sent each engine since then, and which engine has each request.
        dp = len(self.engine_roles)
        self.engine_loads: list[tuple[int, int]] = [(0, 0)] * dp
        self.sent_since_loads = [0] * dp
        self.requests_sent = [0] * dp  # per engine, since start (tests, introspection)
        self.loads_seq = 0
        # The coordinator's wave state, as last published (data parallelism).
        self.current_wave, self.engines_running = 0, False
        self.request_engine: dict[str, int] = {}
        self.encoder = msgspec.msgpack.Encoder()
        self.pending: deque[EngineCoreOutputs] = deque()
        # Utility calls in flight: call id → (method, the future its UtilityReply resolves).
        self.utility_futures: dict[int, tuple[str, Future]] = {}
        self.call_ids = itertools.count()
        self.dead: EngineDeadError | None = None
        self.engine_procs: list[processes.ChildProcess] = []
        self.coordinator_proc: processes.ChildProcess | None = None
        # Other processes whose death takes the tree down (client 0: the other API servers).
        self.watched: list[processes.ChildProcess] = []
        # An attached client's engines, watched by pid: (role, pid).
        self.attached_engines: list[tuple[str, int]] = []
        self.coordinator_publish_address: str | None = None
        self._alive_checked_at = 0.0
        # Waits on every child's pidfd; what it notices, the receive loop raises (_check_alive).
        self.supervisor = Supervisor(run_dir, self._on_child_failure, name="MPClientEngineMonitor")
        self._noticed: tuple[EngineDeadError, processes.ChildProcess | None] | None = None
        self._supervised: set[processes.ChildProcess] = set()  # handed to it already
        self._supervised_pids: set[str] = set()  # the attached engines handed to it, by role
        self._closed = False
        try:
            if engines is None:
                self._launch_and_wait_ready()
            else:
                self._attach(engines)
        except BaseException:
            self.shutdown()
            raise

    @property
    def engine_proc(self) -> processes.ChildProcess | None:
        """Engine DP0's process (the only one without data parallelism)."""
        return self.engine_procs[0] if self.engine_procs else None

    @property
    def data_parallel_size(self) -> int:
        return len(self.engine_roles)

    def _children(self) -> list[processes.ChildProcess]:
        coordinator = [self.coordinator_proc] if self.coordinator_proc else []
        return [*self.engine_procs, *coordinator, *self.watched]

    def watch_child(self, proc: processes.ChildProcess) -> None:
        """Treat ``proc``'s death as the tree's (client 0 watches the other API servers); one
        that exits 0 while this process stops drained and left: no death."""
        self.watched.append(proc)
        self._supervised.add(proc)
        self.supervisor.watch(proc, clean_exit=lambda code: processes.is_stopping() and code == 0)

    def wait_watched_exit(self, timeout: float) -> list[str]:
        """Client 0, stopping: wait up to ``timeout`` s for the other API servers to finish
        their own drain and exit (on their pidfds); returns the roles still running then (they
        are stopped with the engines)."""
        exited = wait_for_exit(self.watched, timeout)
        return [p.role for p in self.watched if p not in exited]

    def engines_info(self) -> EnginesInfo:
        """What another client needs to attach to this client's engines (client 0 only)."""
        if not self.engine_procs:
            raise RuntimeError("only the client that launched the engine cores can describe them")
        pids = {p.role: p.pid for p in self.engine_procs}
        return EnginesInfo(
            engine_roles=[r.name for r in self.engine_roles],
            # 0: an engine core on a headless node (client 0 watches its connection).
            engine_pids=[pids.get(r.name, 0) for r in self.engine_roles],
            num_gpu_blocks=self.num_gpu_blocks,
            device=self.device_info["device"],
            dtype=self.device_info["dtype"],
            coordinator_publish_address=self.coordinator_publish_address,
        )

    def _attach(self, engines: EnginesInfo) -> None:
        """Another client's engines: subscribe to the coordinator and wait for every engine's
        CONNECTED on this client's input socket."""
        if engines.engine_roles != [r.name for r in self.engine_roles]:
            raise ProtocolError(f"attached to engines {engines.engine_roles}, but the plan has "
                                f"{[r.name for r in self.engine_roles]}")  # fmt: skip
        self.attached_engines = [
            (role, pid) for role, pid in zip(engines.engine_roles, engines.engine_pids) if pid
        ]
        self.num_gpu_blocks = engines.num_gpu_blocks
        self.device_info = {"device": engines.device, "dtype": engines.dtype}
        if engines.coordinator_publish_address is not None:
            self._subscribe_coordinator(engines.coordinator_publish_address)
        self._await_engine_registration(time.monotonic() + envs.GLASSBOX_ENGINE_READY_TIMEOUT_S)

    def _subscribe_coordinator(self, publish_address: str) -> None:
        self.coordinator_publish_address = publish_address
        self.coordinator_sub = self.ctx.socket(zmq.SUB)
        self.coordinator_sub.setsockopt(zmq.LINGER, 0)
        self.coordinator_sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.coordinator_sub.connect(publish_address)

    # ------------------------------------------------------------------ start-up

    def _launch_and_wait_ready(self) -> None:
        from tracing import WaitTimeout, catalogue, stage, wait_for
        from tracing.propagation import inject_trace_headers

        with stage(catalogue.ENGINE_CORE_HANDSHAKE) as st:
            coordinator_input = coordinator_waves = None
            if self.coordinator_role is not None:
                coordinator_waves = wave_address(self.run_dir)
                coordinator_input, publish = coordinator_addresses(self.run_dir)
                if self.head_layout is not None:  # engines on other nodes reach it over TCP
                    coordinator_input = self.head_layout.coordinator_address
                    coordinator_waves = self.head_layout.coordinator_wave_address
                self._subscribe_coordinator(publish)
                coordinator_payload = CoordinatorSpawnPayload(
                    input_address=coordinator_input,
                    publish_address=publish,
                    data_parallel_size=self.data_parallel_size,
                    wave_address=coordinator_waves,
                    trace_file=self.config.observability_config.trace_file,
                    otlp_traces_endpoint=self.config.observability_config.otlp_traces_endpoint,
                )
                self.coordinator_proc = processes.spawn_process(
                    self.coordinator_role.name,
                    "engine.core.coordinator:DPCoordinator.run_coordinator",
                    encode_coordinator(coordinator_payload),
                    self.run_dir,
                )
            config_pickle = pickle.dumps(self.config, protocol=5)
            trace_headers = inject_trace_headers()
            if self.remote_roles:
                self._bind_join_socket(coordinator_input, coordinator_waves)
            for role in self.engine_roles:
                if role in self.remote_roles:  # a headless node starts it; it joins below
                    continue
                payload = encode_message(
                    EngineCoreSpawnPayload(
                        config_pickle=config_pickle,
                        input_addresses=self.input_addresses,
                        output_addresses=self.output_addresses,
                        data_parallel_rank=role.dp_rank,
                        trace_headers=trace_headers,
                        coordinator_address=coordinator_input,
                        coordinator_wave_address=coordinator_waves,
                    )
                )
                self.engine_procs.append(
                    processes.spawn_process(
                        role.name,
                        "engine.core.engine_core_proc:EngineCoreProc.run_engine_core",
                        payload,
                        self.run_dir,
                    )
                )
            ready_timeout = envs.GLASSBOX_ENGINE_READY_TIMEOUT_S
            join_timeout = envs.GLASSBOX_DP_JOIN_TIMEOUT_S
            started = time.monotonic()
            # Each engine has GLASSBOX_ENGINE_READY_TIMEOUT_S from its start: a local one from
            # now, a headless node's from its join (itself bounded by GLASSBOX_DP_JOIN_TIMEOUT_S).
            timeout = ready_timeout + (join_timeout if self.remote_roles else 0.0)
            deadline = started + timeout
            # Per engine: the handshakes seen so far (HELLO, READY).
            seen: dict[int, dict[str, EngineHandshake]] = {r.dp_rank: {} for r in self.engine_roles}

            def handshake_step() -> bool:
                """One short poll: record HELLO / READY; True once every engine is READY."""
                if self.remote_roles:
                    self._serve_joins()
                    missing = [r for r in self.remote_roles if r.dp_rank not in self.joined]
                    if missing and time.monotonic() - started > join_timeout:
                        message = self._join_timeout_message(join_timeout, missing)
                        root = processes.format_root_cause(
                            self.run_dir, missing[0].name, None, None, rank=missing[0].dp_rank, note=message,
                            exit_detail="never joined (no HELLO on the head's join socket)",
                        )  # fmt: skip
                        raise processes.EngineStartupTimeout(message, root)
                    now = time.monotonic()
                    if any(
                        "READY" not in seen[r.dp_rank]
                        and now - self.joined_at.get(r.dp_rank, started) > ready_timeout
                        for r in self.engine_roles
                        if r.dp_rank in self.joined_at or r not in self.remote_roles
                    ):
                        raise _ReadyLate
                msg = self._recv(deadline=time.monotonic())
                if msg is not None and msg[0] == TAG_HANDSHAKE:
                    hs = decode_as(EngineHandshake, msg[1][0])
                    if hs.kind not in ("HELLO", "READY") or hs.data_parallel_rank not in seen:
                        raise ProtocolError(
                            f"{hs.role} sent {hs.kind} (DP rank {hs.data_parallel_rank}) on its output "
                            "socket; HELLO or READY from a planned engine was due"
                        )
                    seen[hs.data_parallel_rank][hs.kind] = hs
                    logger.debug("engine core %s (pid %d) said %s", hs.role, hs.pid, hs.kind)
                return all("READY" in kinds for kinds in seen.values())

            try:
                # The bounded-wait helper: a deadline, a name, and wait events for telemetry.
                awaited = f"READY from {', '.join(r.name for r in self.engine_roles)}"
                wait_for(awaited, handshake_step, timeout_s=timeout, poll_interval_s=0)
            except (WaitTimeout, _ReadyLate):
                late = [r for r in self.engine_roles if "READY" not in seen[r.dp_rank]]
                if late and all(r in self.remote_roles for r in late):  # their status files are on their node
                    message = (
                        f"Not every engine became ready within GLASSBOX_ENGINE_READY_TIMEOUT_S={ready_timeout:g} s "
                        f"of joining; not ready: {', '.join(r.name for r in late)}, on headless node(s): `glassbox ps` "
                        "or engine-top there shows the stage."
                    )
                    hello = self.joined.get(late[0].dp_rank)
                    root = processes.format_root_cause(
                        self.run_dir, late[0].name, hello.pid if hello else None, None, rank=late[0].dp_rank,
                        note=message, exit_detail="not READY in time (it runs on a headless node)",
                    )  # fmt: skip
                    raise processes.EngineStartupTimeout(message, root) from None
                message = self._startup_timeout_message(ready_timeout, seen)
                raise processes.EngineStartupTimeout(message, self._startup_root_cause(message)) from None
            ready = [seen[r.dp_rank]["READY"] for r in self.engine_roles]
            # Every engine sizes its own KV cache; report the smallest.
            self.num_gpu_blocks = min(hs.num_gpu_blocks for hs in ready)
            self.device_info = {"device": ready[0].device, "dtype": ready[0].dtype}
            st.set(catalogue.ATTR_KV_NUM_BLOCKS, self.num_gpu_blocks)
            # Each engine's DEALER announces itself once connected; wait for all so the
            # first request cannot be dropped by the ROUTER.
            self._await_engine_registration(deadline)

    # ------------------------------------------------------------------ multi-node DP

    def _bind_join_socket(self, coordinator_input: str | None, coordinator_waves: str | None) -> None:
        """Client 0 of a head: bind the join ROUTER at ``--data-parallel-rpc-port`` (heartbeats
        on, and a socket monitor for connections that end), and fix what a joining rank is told.

        A ROUTER cannot say which peer left (``ROUTER_NOTIFY`` is a draft API of libzmq), so the
        head remembers the connection (file descriptor, ``zmq.SRCFD``) each HELLO came on, and
        the monitor's ``EVENT_DISCONNECTED`` names that descriptor."""
        from engine.core.head_link import set_heartbeats

        pc = self.config.parallel_config
        assert self.head_layout is not None
        self.head_layout.coordinator_address = coordinator_input
        self.head_layout.coordinator_wave_address = coordinator_waves
        self.head_layout.data_parallel_size = pc.data_parallel_size
        self.join_address = tcp_address(pc.data_parallel_address, pc.data_parallel_rpc_port)
        self.join_socket = self.ctx.socket(zmq.ROUTER)
        self.join_socket.setsockopt(zmq.LINGER, 1000)
        set_heartbeats(self.join_socket)
        self.join_monitor = self.join_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.joined_fds: dict[int, int] = {}  # connection fd → the rank that joined on it
        _bind(self.join_socket, self.join_address)
        logger.info("Waiting for data-parallel rank(s) %s to join at %s (headless nodes: glassbox serve "
                    "--headless -dp %d --data-parallel-start-rank ... --data-parallel-address %s "
                    "--data-parallel-rpc-port %d)", ", ".join(str(r.dp_rank) for r in self.remote_roles),
                    self.join_address, pc.data_parallel_size, pc.data_parallel_address,
                    pc.data_parallel_rpc_port)  # fmt: skip

    def _serve_joins(self) -> None:
        """Answer every HELLO waiting on the join socket, and notice a joined rank's connection
        ending (non-blocking). Raises ``EngineDeadError`` when a joined rank is lost."""
        if self.join_socket is None:
            return
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                frames = self.join_socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(frames) != 2:
                raise ProtocolError(f"{len(frames)} frames on the join socket; [identity, HELLO] was due")
            identity, body = frames[0].bytes, frames[1].bytes
            hello: EngineHandshake = decode_as(EngineHandshake, body)
            refusal = self._refuse_join(hello)
            if refusal is not None:
                logger.error("refused %s (pid %d) from a headless node: %s", hello.role, hello.pid, refusal)
                self.join_socket.send_multipart([identity, encode_message(JoinRefused(reason=refusal))])
                continue
            self.joined[hello.data_parallel_rank] = hello
            self.joined_identities[hello.data_parallel_rank] = identity
            self.joined_at[hello.data_parallel_rank] = time.monotonic()
            self.joined_fds[frames[1].get(zmq.SRCFD)] = hello.data_parallel_rank
            self.join_socket.send_multipart([identity, encode_message(self.head_layout)])
            logger.info("Data-parallel rank %d joined: %s (pid %d on its node)", hello.data_parallel_rank,
                        hello.role, hello.pid)  # fmt: skip
        lost: list[int] = []
        while self.join_monitor.poll(0):
            event = recv_monitor_message(self.join_monitor)
            rank = self.joined_fds.pop(int(event["value"]), None)
            if event["event"] == zmq.EVENT_DISCONNECTED and rank is not None:
                lost.append(rank)
        if lost:
            self._mark_remote_lost(lost)

    def _refuse_join(self, hello: EngineHandshake) -> str | None:
        """Why ``hello`` cannot join (one line naming the flag to fix), or None."""
        pc = self.config.parallel_config
        rank = hello.data_parallel_rank
        remote = [r.dp_rank for r in self.remote_roles]
        if hello.kind != "HELLO":
            return f"{hello.kind} on the join socket; HELLO with its DP rank was due"
        if hello.data_parallel_size != pc.data_parallel_size:
            return (f"--data-parallel-size {hello.data_parallel_size} there, {pc.data_parallel_size} on the "
                    "head")  # fmt: skip
        if rank not in remote:
            return (f"--data-parallel-start-rank: rank {rank} is not one the head waits for (it waits for "
                    f"{', '.join(map(str, remote))}; it runs 0..{remote[0] - 1} itself)")  # fmt: skip
        if rank in self.joined:
            return f"--data-parallel-start-rank: rank {rank} joined already (pid {self.joined[rank].pid})"
        return None

    def _join_timeout_message(self, timeout: float, missing: list[topology.ProcessRole]) -> str:
        ranks = ", ".join(str(r.dp_rank) for r in missing)
        return (
            f"Data-parallel rank(s) {ranks} ({', '.join(r.name for r in missing)}) never joined the head at "
            f"{self.join_address} within GLASSBOX_DP_JOIN_TIMEOUT_S={timeout:g} s: start them with `glassbox "
            f"serve --headless -dp {self.data_parallel_size} --data-parallel-start-rank {missing[0].dp_rank} "
            f"--data-parallel-address ... --data-parallel-rpc-port ...` on their node, and open the ports "
            "(docs/multi-node.md)"
        )

    def _mark_remote_lost(self, ranks: list[int]) -> None:
        """Joined rank(s) ``ranks`` lost their connection: log it, the root cause names them, and
        the tree stops (vLLM's DP engines are all or nothing). Raises ``EngineDeadError``."""
        if self.dead is not None:
            raise self.dead
        names = [topology.ProcessRole.engine_core(k).name for k in ranks]
        first = self.joined[ranks[0]]
        logger.error("Lost data-parallel rank(s) %s (%s): the connection from the headless node closed "
                     "(the node or its engine core died, or the network is down); requests they held fail "
                     "and the head stops: vLLM's data-parallel engines are all or nothing",
                     ", ".join(map(str, ranks)), ", ".join(names))  # fmt: skip
        root = processes.format_root_cause(
            self.run_dir, names[0], first.pid, None, rank=ranks[0],
            note=f"lost data-parallel rank(s) {', '.join(map(str, ranks))} ({', '.join(names)}); pid "
                 f"{first.pid} is on the headless node, which joined at {self.join_address}",
            exit_detail="lost: its connection to the head closed (its node died, it was killed, or the network is down)",
        )  # fmt: skip
        self.dead = EngineDeadError(root)
        self._fail_utility_calls()
        _stop_all(self._children())
        raise self.dead

    def _tell_joined_stopping(self, reason: str) -> None:
        """Client 0 of a head is stopping: each joined rank gets ``HeadStopping`` (it exits 0)."""
        if self.join_socket is None:
            return
        body = encode_message(HeadStopping(reason=reason))
        for identity in self.joined_identities.values():
            try:
                self.join_socket.send_multipart([identity, body], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _await_engine_registration(self, deadline: float) -> None:
        """Every engine's CONNECTED on this client's input socket (``tracing.wait_for``).

        Raises:
            TimeoutError: an engine core never connected by ``deadline`` (named).
            EngineDeadError: an engine process died meanwhile.
        """
        from tracing import WaitTimeout, wait_for

        waiting = set(self.engine_identities)

        def all_connected() -> bool:
            if self.input_socket.poll(POLL_MS):
                frames = self.input_socket.recv_multipart()
                hs = decode_as(EngineHandshake, frames[-1])
                if hs.kind != "CONNECTED" or frames[0] not in waiting:
                    raise ProtocolError(
                        f"{hs.role} sent {hs.kind} as {frames[0]!r} on its input socket; CONNECTED "
                        f"from one of {sorted(waiting)!r} was due"
                    )
                waiting.discard(frames[0])
            else:
                self._check_alive()
            return not waiting

        try:
            wait_for("CONNECTED from every engine core", all_connected,
                     timeout_s=max(deadline - time.monotonic(), 0.0), poll_interval_s=0)  # fmt: skip
            return
        except WaitTimeout:
            pass
        names = [r.name for r, i in zip(self.engine_roles, self.engine_identities) if i in waiting]
        raise TimeoutError(f"the engine core(s) {', '.join(names)} never connected their input socket")

    def _startup_root_cause(self, message: str) -> str:
        """The root-cause block of a start-up deadline: the process holding start-up back (the
        deepest one in a stage, else the first that never started), with its state."""
        laggard = find_laggard(self.run_dir)
        role, pid = laggard if laggard is not None else (self.engine_role.name, None)
        if pid is None:  # no status file yet (still importing, say): this client spawned it
            pid = self._spawned_pids().get(role)
        state = os_state(pid) if pid else None
        if state == "stopped":
            state = "stopped by a signal (SIGSTOP?)"
        return processes.format_root_cause(self.run_dir, role, pid, None, note=message, state=state)

    def _spawned_pids(self) -> dict[str, int]:
        """Role name → pid of each child this client spawned (engine cores, coordinator)."""
        return {p.role: p.pid for p in self._children()}

    def _startup_timeout_message(self, timeout: float, seen: dict[int, dict[str, EngineHandshake]]) -> str:
        late = describe_laggard(self.run_dir, spawned=self._spawned_pids())
        if len(seen) == 1:
            said = "it said HELLO" if "HELLO" in seen[self.engine_role.dp_rank] else "it never said HELLO"
            return f"The engine did not become ready within GLASSBOX_ENGINE_READY_TIMEOUT_S={timeout:g} s ({said}). {late}"
        laggards = [
            f"{r.name} ({'said HELLO' if 'HELLO' in seen[r.dp_rank] else 'never said HELLO'})"
            for r in self.engine_roles
            if "READY" not in seen[r.dp_rank]
        ]
        return (
            f"Not every engine became ready within GLASSBOX_ENGINE_READY_TIMEOUT_S={timeout:g} s; "
            f"not ready: {', '.join(laggards)}. {late}"
        )

    # ------------------------------------------------------------------ load balancing

    def _drain_coordinator(self) -> None:
        """Take the coordinator's newest published counts, if any arrived (non-blocking)."""
        if self.coordinator_sub is None:
            return
        while True:
            try:
                frame = self.coordinator_sub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            loads: EngineLoads = decode_coordinator(EngineLoads, frame)
            if loads.seq > self.loads_seq and len(loads.counts) == self.data_parallel_size:
                self.loads_seq = loads.seq
                self.engine_loads = [tuple(c) for c in loads.counts]
                self.sent_since_loads = [0] * self.data_parallel_size
                self.current_wave, self.engines_running = loads.current_wave, loads.engines_running

    def engine_scores(self) -> list[int]:
        """Each engine's score ``waiting * 4 + running``: the coordinator's latest counts, with
        the requests sent since counted as waiting."""
        self._drain_coordinator()
        return [
            score(waiting + sent, running)
            for (waiting, running), sent in zip(self.engine_loads, self.sent_since_loads)
        ]

    def _choose_engine(self, request: EngineCoreRequest) -> int:
        """The engine for a new request: its pinned ``data_parallel_rank``, else the lowest score."""
        dp = self.data_parallel_size
        if request.data_parallel_rank is not None:
            if not 0 <= request.data_parallel_rank < dp:
                raise ValueError(
                    f"request {request.request_id!r} asks for data_parallel_rank "
                    f"{request.data_parallel_rank}, but there are {dp} engine(s) (0..{dp - 1})"
                )
            engine = request.data_parallel_rank
        elif dp == 1:
            engine = 0
        else:
            scores = self.engine_scores()
            engine = min(range(dp), key=lambda k: (scores[k], k))
        self.sent_since_loads[engine] += 1
        self.requests_sent[engine] += 1
        self.request_engine[request.request_id] = engine
        return engine

    def _engines_for_abort(self, request_ids: list[str]) -> dict[int, list[str]]:
        """Engine → the ids it has (an id this client does not know goes to every engine)."""
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self.request_engine.pop(request_id, None)
            for k in [engine] if engine is not None else range(self.data_parallel_size):
                by_engine.setdefault(k, []).append(request_id)
        return by_engine

    # ------------------------------------------------------------------ messages

    def _recv(self, deadline: float | None) -> tuple[bytes, list[bytes]] | None:
        """One message from the engines, or None at the deadline. Raises EngineDeadError."""
        while True:
            if self.output_socket.poll(POLL_MS):
                tag, *frames = self.output_socket.recv_multipart()
                if tag == ENGINE_CORE_DEAD:
                    self._mark_dead(_dead_message(frames))
                self._check_alive_now_and_then()
                return tag, frames
            self._check_alive()
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _check_alive_now_and_then(self) -> None:
        """While messages keep coming (no poll times out), still look at every child each
        ``POLL_MS``: with several engines, one can die while another streams outputs."""
        now = time.monotonic()
        if now - self._alive_checked_at >= POLL_MS / 1000:
            self._alive_checked_at = now
            self._check_alive()

    def _check_alive(self) -> None:
        """Raise the tree's death, if there was one: the supervisor (waiting on every child's
        pidfd, and on their stopped / heartbeat deadlines) noticed it, or an engine said
        ENGINE_CORE_DEAD. Cheap: the receive loops call it between polls.

        Raises:
            EngineDeadError: a child died, or was stopped or frozen too long (root cause: the
                blame rule, ``engine/utils/supervisor.py``).
        """
        if self.dead is not None:
            raise self.dead
        if self.join_socket is not None:
            self._serve_joins()
        self._supervise_children()
        noticed = self._noticed
        if noticed is None:
            return
        error, proc = noticed
        if proc is None:  # an attached client's engine is gone: client 0 reports the root cause
            self.dead = error
            self._fail_utility_calls()
            raise self.dead
        # Give a dying engine a moment to deliver its ENGINE_CORE_DEAD message.
        if proc.poll() is not None and self.output_socket.poll(200):
            tag, *frames = self.output_socket.recv_multipart()
            if tag == ENGINE_CORE_DEAD:
                self._mark_dead(_dead_message(frames))
        self._mark_dead(None, proc, root_cause=error.root_cause)

    def _supervise_children(self) -> None:
        """Hand the supervisor every child (and, attached, every engine by pid) not yet handed."""
        for proc in self._children():
            if proc not in self._supervised:
                self._supervised.add(proc)
                self.supervisor.watch(proc)
        for role, pid in self.attached_engines:
            if role not in self._supervised_pids:
                self._supervised_pids.add(role)
                gone = (f"{role} (pid {pid}) is gone; the API server that launched it "
                        f"({topology.ProcessRole.api_server(0).name}) reports the root cause")  # fmt: skip
                self.supervisor.watch_pid(role, pid, gone)

    def _on_child_failure(self, error: EngineDeadError, proc: processes.ChildProcess | None) -> None:
        """The supervisor's callback (its thread): note it; the receive loop raises it
        (``_check_alive``), as the sockets are this client's thread's."""
        if self._noticed is None:
            self._noticed = (error, proc)

    def tree_problems(self) -> list[str]:
        """Each process of this server's tree (the run directory's manifest) that is stopped,
        frozen or dead right now, by role, pid and why (``StoppedWatch.tree_problems``: the
        rule that tears the tree down after ``GLASSBOX_STOPPED_TIMEOUT_S``, applied at once)."""
        return self.supervisor.tree_problems()

    def _mark_dead(
        self,
        dead: EngineDead | None,
        proc: processes.ChildProcess | None = None,
        root_cause: str | None = None,
    ) -> None:
        """The tree is dead: ``dead`` (an engine's ENGINE_CORE_DEAD), else ``root_cause`` (the
        supervisor's), else the blame rule's for ``proc``. Stops the rest; raises."""
        if self.dead is None:
            proc = proc or self.engine_proc
            if dead is not None:
                root_cause = dead.root_cause
            publisher = get_publisher()
            if publisher is not None and proc is not None and proc.poll() is not None:
                # Only a parent knows how its child ended: tell engine-top.
                publisher.note_child_exit(proc.role, processes.describe_exit(proc.poll()))
            if root_cause is None and proc is not None:
                root_cause = self.supervisor.fail(proc.role, proc.pid, proc.poll(), child=proc).root_cause
            self.dead = EngineDeadError(root_cause or "the engine core died")
            self._fail_utility_calls()
            self.supervisor.close()  # what follows is this client stopping the rest
            if len(self._children()) > 1:
                # One process of the tree died: the rest (other engines, the coordinator)
                # go down with it, so the root cause is the only story.
                _stop_all(self._children())
            if dead is not None and dead.during_startup and dead.kind is ErrorKind.CONFIG:
                # A bad setting found by the engine (e.g. a KV budget too small for one
                # request) is the caller's error, raised as in-process: one ConfigError
                # naming the flag, no root-cause block.
                raise ConfigError.from_message(dead.message, flag=dead.flag or "") from None
        raise self.dead

    def _fail_utility_calls(self) -> None:
        """Utility calls still waiting get the engine's death as their error."""
        for _, future in self.utility_futures.values():
            if not future.done():
                future.set_exception(self.dead)
        self.utility_futures.clear()

    def _send(self, request_type: EngineCoreRequestType, body: bytes, engine: int = 0) -> None:
        if self.dead is not None:
            raise self.dead
        try:
            self.input_socket.send_multipart(
                [self.engine_identities[engine], request_type.value, body], copy=False
            )
        except zmq.ZMQError:
            self._unroutable(engine)

    def _unroutable(self, engine: int = 0) -> None:
        """The ROUTER cannot reach an engine core: it disconnected, so it is dying or dead."""
        role = self.engine_roles[engine].name
        proc = next((p for p in self.engine_procs if p.role == role), None)
        if proc is None and engine in self.joined:  # a headless node's: its join connection says more
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                self._serve_joins()
                self.join_monitor.poll(50)  # its connection's end wakes this at once
            self._mark_remote_lost([engine])
        if proc is not None:
            try:
                proc.popen.wait(1.0)
            except Exception:  # still alive but unreachable: report it as dead anyway
                pass
        self._check_alive()
        self._mark_dead(None, proc)

    def _dispatch(self, msg: tuple[bytes, list[bytes]] | None) -> None:
        if msg is None:
            return
        tag, frames = msg
        if tag == TAG_OUTPUTS:
            outputs: EngineCoreOutputs = decode_as(EngineCoreOutputs, frames[0])
            self.stats_table.update_from_outputs(outputs)
            if self.request_engine:  # finished requests are no engine's any more
                for output in outputs.outputs:
                    if output.finished:
                        self.request_engine.pop(output.request_id, None)
                for request_id in outputs.finished_requests or ():
                    self.request_engine.pop(request_id, None)
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
        """Stop the engine cores (and through them their workers) and the coordinator within a
        few seconds."""
        if self._closed:
            return
        self._closed = True
        self._tell_joined_stopping("the head stopped" if self.dead is None else "the head's engine died")
        self.supervisor.close()
        _stop_all(self._children())
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        if self.coordinator_sub is not None:
            self.coordinator_sub.close(linger=0)
        if self.join_socket is not None:
            self.join_socket.disable_monitor()
            self.join_monitor.close(linger=0)
            self.join_socket.close(linger=1000)  # HeadStopping on its way out
        self.ctx.term()


class SyncMPClient(MPClient):
    """The engine cores in their own processes, driven synchronously (the offline ``LLM``'s client)."""

    def add_request(self, request: EngineCoreRequest) -> None:
        request.client_index = self.client_index
        engine = self._choose_engine(request)
        self._send(EngineCoreRequestType.ADD, self.encoder.encode(request), engine)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None:
            for engine, ids in self._engines_for_abort(request_ids).items():
                self._send(EngineCoreRequestType.ABORT, self.encoder.encode(_abort(ids)), engine)

    def get_output(self) -> EngineCoreOutputs:
        while not self.pending:
            self._dispatch(self._recv(deadline=None))
        return self.pending.popleft()

    def call_utility(self, method: str, *args: Any) -> Any:
        """Run the utility on every engine; engine 0's answer is returned."""
        return self.call_utility_each(method, *args)[0]

    def call_utility_each(self, method: str, *args: Any) -> list[Any]:
        """Run the utility on every engine; their answers, by DP rank."""
        futures = []
        for engine in range(self.data_parallel_size):
            future, body = self._utility_request(method, args)
            futures.append(future)
            self._send(EngineCoreRequestType.UTILITY, body, engine)
        from tracing import WaitTimeout, wait_for

        timeout = envs.GLASSBOX_EXECUTE_MODEL_TIMEOUT_S

        def answered() -> bool:
            # This thread is the only reader: receive (keeping outputs for get_output) until
            # the replies resolve the futures; each receive is one bounded slice.
            if not all(f.done() for f in futures):
                self._dispatch(self._recv(time.monotonic()))
            return all(f.done() for f in futures)

        try:
            wait_for(
                f"the answers to utility call {method!r}", answered, timeout_s=timeout, poll_interval_s=0
            )
        except WaitTimeout:
            raise TimeoutError(
                f"utility call {method!r} got no answer within GLASSBOX_EXECUTE_MODEL_TIMEOUT_S={timeout:g} s"
            ) from None
        return [f.result() for f in futures]


class AsyncMPClient(MPClient):
    """The engine cores in their own processes, driven from an asyncio loop (the API server's client).

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
                self._check_alive_now_and_then()
                return tag, frames
            self._check_alive()
            if deadline is not None and time.monotonic() >= deadline:
                return None

    async def _send_async(self, request_type: EngineCoreRequestType, body: bytes, engine: int = 0) -> None:
        if self.dead is not None:
            raise self.dead
        try:
            await self.async_input.send_multipart(
                [self.engine_identities[engine], request_type.value, body], copy=False
            )
        except zmq.ZMQError:
            self._unroutable(engine)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        request.client_index = self.client_index
        engine = self._choose_engine(request)
        await self._send_async(EngineCoreRequestType.ADD, self.encoder.encode(request), engine)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None:
            for engine, ids in self._engines_for_abort(request_ids).items():
                await self._send_async(EngineCoreRequestType.ABORT, self.encoder.encode(_abort(ids)), engine)

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next outputs; only one task (the output handler) may call this."""
        while not self.pending:
            self._dispatch(await self._recv_async(deadline=None))
        return self.pending.popleft()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Utility call on every engine (engine 0's answer is returned); the answers are picked
        up by the output handler's receive loop."""
        import asyncio

        futures = []
        for engine in range(self.data_parallel_size):
            future, body = self._utility_request(method, args)
            futures.append(future)
            await self._send_async(EngineCoreRequestType.UTILITY, body, engine)
        from tracing import WaitTimeout
        from tracing.waits import wait_for_async

        timeout = envs.GLASSBOX_EXECUTE_MODEL_TIMEOUT_S
        # The output handler resolves the futures; the wait checks between slices that the
        # engines are alive.
        try:
            answers = await wait_for_async(
                f"the answers to utility call {method!r}",
                [asyncio.wrap_future(f) for f in futures],
                timeout_s=timeout,
                check=self._check_alive,
                poll_interval_s=POLL_MS / 1000,
            )
        except WaitTimeout:
            raise TimeoutError(
                f"utility call {method!r} got no answer within GLASSBOX_EXECUTE_MODEL_TIMEOUT_S={timeout:g} s"
            ) from None
        return answers[0]

    # The synchronous verbs are not used from the event loop.
    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError("use add_request_async")

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError("use abort_requests_async")

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError("use get_output_async")

    def call_utility(self, method: str, *args: Any) -> Any:
        raise NotImplementedError("use call_utility_async")


def _stop_all(children: list[processes.ChildProcess], timeout: float = 4.0) -> None:
    """Stop every child at once: lifelines closed and SIGTERM to all, then wait (SIGKILL after
    ``timeout``), so N engines take as long to stop as one."""
    for child in children:
        child.request_stop()
    deadline = time.monotonic() + timeout
    for child in children:
        child.stop(timeout=max(deadline - time.monotonic(), 0.1))


def _abort(request_ids: list[str]) -> AbortRequests:
    """An ABORT message carrying the caller's span (W3C)."""
    from tracing.propagation import inject_trace_headers

    return AbortRequests(request_ids=request_ids, trace_headers=inject_trace_headers() or None)


class _ReadyLate(Exception):
    """An engine (multi-node DP) is past its own READY deadline (``GLASSBOX_ENGINE_READY_TIMEOUT_S``
    from its start or join) while the overall wait still runs."""


def _bind(socket: zmq.Socket, address: str) -> None:
    """Bind ``address``; a TCP one that is taken or not this machine's is the flag's error.

    Raises:
        ConfigError: a ``tcp://`` address that cannot be bound (names ``--data-parallel-rpc-port``
            or ``--data-parallel-address``).
    """
    try:
        socket.bind(address)
    except zmq.ZMQError as e:
        if not address.startswith("tcp://"):
            raise
        flag = "--data-parallel-rpc-port" if e.errno == errno.EADDRINUSE else "--data-parallel-address"
        raise ConfigError.from_message(
            f"{flag}: the head cannot bind {address}: {e.strerror} (multi-node DP uses "
            "--data-parallel-rpc-port and the next 2 + 2 × API servers ports; docs/multi-node.md)",
            flag=flag,
        ) from None


def client_input_address(run_dir: Path, client_index: int) -> str:
    """Where client ``client_index`` sends requests from (its ROUTER: it binds, engines connect)."""
    return f"ipc://{run_dir}/in{client_index}.sock"


def client_output_address(run_dir: Path, client_index: int) -> str:
    """Where client ``client_index`` receives its engine outputs (it binds, engines connect)."""
    return f"ipc://{run_dir}/out{client_index}.sock"


def _dead_message(frames: list[bytes]) -> EngineDead | None:
    """The ``EngineDead`` after an ``ENGINE_CORE_DEAD`` tag (None when it did not come)."""
    return decode_as(EngineDead, frames[0]) if frames else None
