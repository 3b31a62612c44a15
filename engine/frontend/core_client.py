"""Clients through which the frontend talks to the engine core.

Mirrors vLLM's ``vllm/v1/engine/core_client.py``. The frontend never touches the engine
core's internals: it adds requests, aborts them, asks for outputs and makes utility calls
through a client:

- ``InprocClient`` (``GLASSBOX_ENABLE_MULTIPROCESSING=0``): the ``EngineCore`` lives in the
  caller's process and ``get_output()`` runs one ``step()``.
- ``MPClient``: what the multiprocess clients share. The engine cores run in their own
  processes (``EngineCoreProc``); requests go out on a ROUTER socket, outputs come back on a
  PULL socket, both bound by this client (``ipc://`` paths in the run directory).
- ``AsyncMPClient`` (the API server's): the one implementation of the calls, on asyncio.
- ``SyncMPClient`` (the offline ``LLM``'s): a thin facade that runs ``AsyncMPClient``'s calls
  to completion on a private event loop in the calling thread.

Launching the engine cores and the start-up handshake are in ``engine_launcher.py``
(vLLM's ``vllm/v1/engine/utils.py``); the head's side of the multi-node join is
``engine/core/head_join.py``.

With ``--data-parallel-size N`` a multiprocess client holds N engine cores and client 0
starts the ``DPCoordinator``; new requests go to the engine with the lowest
``waiting * 4 + running`` (``DPLoadBalancer``, ``dp_load_balancer.py``). vLLM 0.32 does that
in its ``DPLBAsyncMPClient`` class (a subclass of its ``AsyncMPClient``); every Glassbox
multiprocess client holds a balancer, so the offline ``LLM`` balances too.

Each multiprocess client is one of the engine cores' clients (``client_index``: the offline
``LLM``, or one per API server with ``--api-server-count``): it binds its own input and
output sockets (``client_input_address``, ``client_output_address``), stamps its index on
every request and utility call, and so receives only its own outputs. Client 0 launches the
engine cores (and the coordinator); the others attach to them with the ``EnginesInfo`` that
client 0 hands on. The ``SchedulerStats`` that come with the outputs go into
``stats_table`` (``EngineStatsTable``: latest stats per engine), which ``/metrics`` reads.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import zmq
import zmq.asyncio

from engine import envs
from engine.config import ConfigError, EngineConfig
from engine.core.head_join import HeadJoin, bind_socket
from engine.core.messages import (
    ENGINE_CORE_DEAD,
    TAG_OUTPUTS,
    TAG_UTILITY,
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineDead,
    EngineHandshake,
    EnginesInfo,
    UtilityReply,
    UtilityRequest,
    decode_as,
)
from engine.core.messages import encode as encode_message
from engine.distributed import topology
from engine.frontend.dp_load_balancer import DPLoadBalancer
from engine.frontend.engine_launcher import (
    POLL_MS,
    CoreEngineProcManager,
    client_addresses,
    coordinator_payload,
    launch_core_engines,
    wait_for_engine_registration,
    wait_for_engine_startup,
)
from engine.frontend.engine_stats import EngineStatsTable
from engine.logger import init_logger
from engine.utils import processes
from engine.utils.processes import EngineDeadError
from engine.utils.supervisor import Supervisor, wait_for_exit
from engine.utils.wire import ErrorKind, ProtocolError
from tracing import WaitTimeout, catalogue, stage
from tracing.propagation import inject_trace_headers
from tracing.telemetry.publisher import telemetry
from tracing.waits import wait_for_async

logger = init_logger(__name__)

T = TypeVar("T")

# How long a dead engine core's ENGINE_CORE_DEAD may still take to arrive once its exit is seen.
DEAD_MESSAGE_GRACE_S = 0.5


class EngineCoreClient(ABC):
    """The offline ``LLM``'s handle on an engine core, synchronous: ``InprocClient`` or
    ``SyncMPClient`` (``make_client`` picks). The API server's is ``AsyncMPClient``."""

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
        # Imported here: the engine core brings torch, which the API server (this module's
        # other user) never imports (tests/e2e/test_import_rules.py).
        from engine.core.engine_core import EngineCore
        from engine.utils.processes import use_openmp_wait_here

        use_openmp_wait_here()  # the short OpenMP wait a child gets, where torch is not loaded yet
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


class MPClient:
    """What the multiprocess clients share: their sockets, the engines' processes, load
    balancing, the replies' matching and the liveness checks.

    With ``--data-parallel-size N`` client 0 starts N engine cores (``EngineCore_DP<k>``,
    each with its own workers) and, for N > 1, the ``DPCoordinator``; with several clients
    (API servers) the others attach to those engines (``engines``). Every engine connects to
    each client's ROUTER (input; an engine's DEALER identity is its DP rank) and pushes to
    each client's PULL (outputs), so one client's outputs of every engine arrive merged on
    its one socket, each stamped with its ``engine_index``. Each new request goes to the
    engine with the lowest score ``waiting * 4 + running``: the coordinator's latest
    published counts, plus the requests this client sent each engine since that publish; a
    request that pins ``data_parallel_rank`` goes to that engine. Aborts go to the engine
    that has the request; utility calls go to every engine.

    Multi-node DP (the head: ``--data-parallel-size-local`` K0 below the DP size D): client 0
    starts only engines 0..K0-1, every socket an engine uses is TCP on the head's address
    (``head_engine_addresses``), and client 0 holds the join socket (``HeadJoin``) where the
    headless nodes' engine cores join; a joined rank whose connection ends is reported lost,
    and the tree stops, as vLLM's DP engines are all or nothing.

    Start-up (``engine_launcher``) waits for every engine under one deadline. Every later
    wait is a bounded poll that raises, between polls, what the ``Supervisor``
    (``engine/utils/supervisor.py``) noticed: it waits on the pidfd of every engine process
    (and of the coordinator, and of processes handed to ``watch_child``); when one dies,
    client 0 stops the others, and one ``EngineDeadError`` names it. An attached client
    watches the engines by pid and leaves stopping (and the root cause) to client 0.

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
        # Multi-node DP (this is the head): TCP on --data-parallel-address, else ipc.
        self.head_layout, self.input_addresses, self.output_addresses = client_addresses(
            config, run_dir, num_clients
        )
        self.input_address = self.input_addresses[client_index]
        self.output_address = self.output_addresses[client_index]
        self.input_socket = self.ctx.socket(zmq.ROUTER)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        # The headless nodes' join socket and the ranks joined there (client 0 of a head only).
        self.head_join: HeadJoin | None = None
        try:
            bind_socket(self.input_socket, self.input_address)
            bind_socket(self.output_socket, self.output_address)
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
        # Which engine gets each new request, and which has each request (data parallelism).
        self.load_balancer = DPLoadBalancer(len(self.engine_roles))
        self.encoder = msgspec.msgpack.Encoder()
        self.pending: deque[EngineCoreOutputs] = deque()
        # Utility calls in flight: call id → (method, the future its UtilityReply resolves).
        self.utility_futures: dict[int, tuple[str, Future]] = {}
        self.call_ids = itertools.count()
        self.dead: EngineDeadError | None = None
        self.engine_manager: CoreEngineProcManager | None = None
        self.coordinator_proc: processes.ChildProcess | None = None
        # Other processes whose death takes the tree down (client 0: the other API servers).
        self.watched: list[processes.ChildProcess] = []
        # An attached client's engines, watched by pid: (role, pid).
        self.attached_engines: list[tuple[str, int]] = []
        # Waits on every child's pidfd; what it notices, the receive loop raises (_check_alive).
        self.supervisor = Supervisor(run_dir, self._on_child_failure, name="MPClientEngineMonitor",
                                     log_failures=False)  # fmt: skip
        self._noticed: tuple[EngineDeadError, processes.ChildProcess | None] | None = None
        self._closed = False
        try:
            if engines is None:
                self._launch_core_engines()
            else:
                self._attach(engines)
        except BaseException:
            self.shutdown()
            raise

    @property
    def engine_procs(self) -> list[processes.ChildProcess]:
        """The engine-core processes this client started (none for an attached client)."""
        return self.engine_manager.processes if self.engine_manager is not None else []

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
            coordinator_publish_address=self.load_balancer.publish_address,
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
        self._supervise_children()
        self.num_gpu_blocks = engines.num_gpu_blocks
        self.device_info = {"device": engines.device, "dtype": engines.dtype}
        if engines.coordinator_publish_address is not None:
            self.load_balancer.subscribe(self.ctx, engines.coordinator_publish_address)
        wait_for_engine_registration(self, time.monotonic() + envs.GLASSBOX_ENGINE_READY_TIMEOUT_S)

    # ------------------------------------------------------------------ start-up

    def _launch_core_engines(self) -> None:
        """Client 0: start the coordinator and this node's engine cores, bind the head's join
        socket (multi-node DP), and wait until every engine is ready (``engine_launcher``)."""
        with stage(catalogue.ENGINE_CORE_HANDSHAKE) as st:
            coordinator = None
            if self.coordinator_role is not None:
                coordinator = coordinator_payload(self.config, self.run_dir, self.head_layout)
                self.load_balancer.subscribe(self.ctx, coordinator.publish_address)
            if self.remote_roles:
                assert self.head_layout is not None
                self.head_layout.coordinator_address = coordinator.input_address if coordinator else None
                self.head_layout.coordinator_wave_address = coordinator.wave_address if coordinator else None
                self.head_join = HeadJoin(self.ctx, self.config, self.head_layout, self.remote_roles)
            self.engine_manager, self.coordinator_proc = launch_core_engines(
                self.config, self.run_dir, [r for r in self.engine_roles if r not in self.remote_roles],
                input_addresses=self.input_addresses, output_addresses=self.output_addresses,
                coordinator=(self.coordinator_role, coordinator) if coordinator else None,
            )  # fmt: skip
            self._supervise_children()
            ready = wait_for_engine_startup(self)
            # Every engine sizes its own KV cache; report the smallest.
            self.num_gpu_blocks = min(hs.num_gpu_blocks for hs in ready)
            self.device_info = {"device": ready[0].device, "dtype": ready[0].dtype}
            st.set(catalogue.ATTR_KV_NUM_BLOCKS, self.num_gpu_blocks)

    # ------------------------------------------------------------------ multi-node DP

    @property
    def joined(self) -> dict[int, EngineHandshake]:
        """The ranks joined from headless nodes: rank → its HELLO."""
        return self.head_join.joined if self.head_join is not None else {}

    def _serve_joins(self) -> None:
        """Answer the HELLOs waiting on the join socket (non-blocking). Raises ``EngineDeadError``
        when a joined rank's connection ended."""
        lost = self.head_join.serve() if self.head_join is not None else []
        if lost:
            self._mark_remote_lost(lost)

    def _mark_remote_lost(self, ranks: list[int]) -> None:
        """Joined rank(s) ``ranks`` lost their connection: the root cause names them, and the
        tree stops (vLLM's DP engines are all or nothing). Raises ``EngineDeadError``."""
        if self.dead is not None:
            raise self.dead
        self.dead = EngineDeadError(self.head_join.lost_root_cause(self.run_dir, ranks))
        self._fail_utility_calls()
        _stop_all(self._children())
        raise self.dead

    # ------------------------------------------------------------------ messages

    def _check_alive(self) -> None:
        """Raise the tree's death, if there was one: the supervisor (waiting on every child's
        pidfd, and on their stopped / heartbeat deadlines) noticed it (``_on_child_failure``),
        or an engine said ENGINE_CORE_DEAD. Cheap (a few attribute reads; a multi-node head
        also answers its join socket): the receive loops call it after every message and
        between polls.

        Raises:
            EngineDeadError: a child died, or was stopped or frozen too long (root cause: the
                blame rule, ``engine/utils/supervisor.py``).
        """
        if self.dead is not None:
            raise self.dead
        if self.head_join is not None:
            self._serve_joins()
        if self._noticed is not None:
            self._raise_noticed()

    def _raise_noticed(self) -> None:
        """The supervisor's failure, turned into this client's death (``_mark_dead``). Raises
        ``EngineDeadError``."""
        error, proc = self._noticed
        if proc is None:  # an attached client's engine is gone: client 0 reports the root cause
            self.dead = error
            self._fail_utility_calls()
            raise self.dead
        # Give a dying engine a moment to deliver its ENGINE_CORE_DEAD message (what it says
        # beats what its exit status says: a setting it refused is one ConfigError line).
        if proc.poll() is not None:
            deadline = time.monotonic() + DEAD_MESSAGE_GRACE_S
            while (left := deadline - time.monotonic()) > 0 and self.output_socket.poll(int(left * 1000) + 1):
                tag, *frames = self.output_socket.recv_multipart()
                if tag == ENGINE_CORE_DEAD:
                    self._mark_dead(_dead_message(frames))
        self._mark_dead(None, proc, root_cause=error.root_cause)

    def _supervise_children(self) -> None:
        """Hand the supervisor the engines and coordinator just started (or, attached, every
        engine by pid), once, at start-up: from then on a death reaches ``_on_child_failure``
        without any polling. (``watch_child`` hands over the later ones.)"""
        for proc in [*self.engine_procs, *([self.coordinator_proc] if self.coordinator_proc else [])]:
            self.supervisor.watch(proc)
        for role, pid in self.attached_engines:
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
            if proc is not None and proc.poll() is not None:
                # Only a parent knows how its child ended: tell engine-top.
                telemetry().note_child_exit(proc.role, processes.describe_exit(proc.poll()))
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

    def _unroutable(self, engine: int = 0) -> None:
        """The ROUTER cannot reach an engine core: it disconnected, so it is dying or dead."""
        role = self.engine_roles[engine].name
        proc = next((p for p in self.engine_procs if p.role == role), None)
        if proc is None and engine in self.joined:  # a headless node's: its join connection says more
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                self._serve_joins()
                self.head_join.monitor.poll(50)  # its connection's end wakes this at once
            self._mark_remote_lost([engine])
        if proc is not None:
            try:
                proc.popen.wait(1.0)
            except Exception:  # still alive but unreachable: report it as dead anyway
                pass
        self._check_alive()
        self._mark_dead(None, proc)

    def _dispatch(self, msg: tuple[bytes, list[bytes]]) -> None:
        tag, frames = msg
        if tag == TAG_OUTPUTS:
            outputs: EngineCoreOutputs = decode_as(EngineCoreOutputs, frames[0])
            self.stats_table.update_from_outputs(outputs)
            if self.load_balancer.request_engine:
                self.load_balancer.forget_finished(outputs)
            if outputs.outputs or outputs.finished_requests:
                self.pending.append(outputs)  # stats alone need nothing more
        elif tag == TAG_UTILITY:
            self._process_utility_output(decode_as(UtilityReply, frames[0]))
        else:
            raise ProtocolError(f"the engine core sent a message tagged {tag!r} after start-up; "
                                f"expected {TAG_OUTPUTS!r} or {TAG_UTILITY!r}")  # fmt: skip

    def _process_utility_output(self, reply: UtilityReply) -> None:
        """Resolve the future of the utility call ``reply`` answers (vLLM's
        ``_process_utility_output``). Raises ``ProtocolError`` for a call that is not pending."""
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

    def _utility_request(self, method: str, args: tuple) -> tuple[Future, bytes]:
        """A new call id, its pending future, and the encoded ``UtilityRequest``."""
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
        if self.head_join is not None:
            self.head_join.tell_stopping(
                "the head stopped" if self.dead is None else "the head's engine died"
            )
        self.supervisor.close()
        _stop_all(self._children())
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.load_balancer.close()
        if self.head_join is not None:
            self.head_join.close()  # HeadStopping on its way out
        self.ctx.term()


class AsyncMPClient(MPClient):
    """The multiprocess client's calls, driven from an asyncio loop: the API server's client,
    and the one implementation ``SyncMPClient`` runs for the offline ``LLM``.

    Start-up (the constructor) is synchronous, before any loop runs; afterwards the sockets
    are used through ``zmq.asyncio`` shadows, so waiting for outputs never blocks the loop
    (the liveness checks between polls use the plain sockets).

    One task reads the output socket: the API server's output handler calls
    ``get_output_async`` over and over, and the utility replies it receives resolve
    ``call_utility_async``'s futures. Where no such task runs (``caller_reads_outputs``:
    ``SyncMPClient``), a utility call reads itself until its answers come, and keeps the
    outputs it receives meanwhile for ``get_output_async``.
    """

    caller_reads_outputs = False

    def __init__(self, config: EngineConfig, run_dir: Path, **kwargs: Any) -> None:
        super().__init__(config, run_dir, **kwargs)
        self.async_input = zmq.asyncio.Socket.shadow(self.input_socket.underlying)
        self.async_output = zmq.asyncio.Socket.shadow(self.output_socket.underlying)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        """Send ``request`` to its engine (``DPLoadBalancer.get_core_engine_for_request``; a pinned
        ``data_parallel_rank`` was checked by ``InputProcessor.process_inputs``). Raises ``EngineDeadError``."""
        request.client_index = self.client_index
        engine = self.load_balancer.get_core_engine_for_request(request)
        await self._send(EngineCoreRequestType.ADD, self.encoder.encode(request), engine)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        """Abort ``request_ids`` in the engines that have them (nothing once the engine is dead)."""
        if request_ids and self.dead is None:
            for engine, ids in self.load_balancer.engines_for_abort(request_ids).items():
                await self._send(EngineCoreRequestType.ABORT, self.encoder.encode(_abort(ids)), engine)

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next outputs (of any engine); only one task may call this. Raises ``EngineDeadError``."""
        await self._recv_until(lambda: bool(self.pending))
        return self.pending.popleft()

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Run ``EngineCore.<method>(*args)`` on every engine; engine 0's answer is returned."""
        return (await self.call_utility_each_async(method, *args))[0]

    async def call_utility_each_async(self, method: str, *args: Any) -> list[Any]:
        """Run ``EngineCore.<method>(*args)`` on every engine; their answers, by DP rank.

        Raises:
            TimeoutError: no answer within ``GLASSBOX_EXECUTE_MODEL_TIMEOUT_S``.
            RuntimeError: the utility raised in an engine.
            EngineDeadError: an engine died meanwhile.
        """
        futures = []
        for engine in range(self.data_parallel_size):
            future, body = self._utility_request(method, args)
            futures.append(future)
            await self._send(EngineCoreRequestType.UTILITY, body, engine)
        if self.caller_reads_outputs:  # nobody else reads: receive until the replies resolve them
            awaited = [asyncio.ensure_future(self._recv_until(lambda: all(f.done() for f in futures)))]
        else:  # the output handler's receive loop resolves them
            awaited = [asyncio.wrap_future(f) for f in futures]
        timeout = envs.GLASSBOX_EXECUTE_MODEL_TIMEOUT_S
        try:
            # The wait checks between slices that the engines are alive.
            await wait_for_async(f"the answers to utility call {method!r}", awaited, timeout_s=timeout,
                                 check=self._check_alive, poll_interval_s=POLL_MS / 1000)  # fmt: skip
        except WaitTimeout:
            for future in futures:
                future.cancel()  # given up: a late answer is dropped
            raise TimeoutError(
                f"utility call {method!r} got no answer within GLASSBOX_EXECUTE_MODEL_TIMEOUT_S={timeout:g} s"
            ) from None
        return [f.result() for f in futures]

    async def _recv_until(self, done: Callable[[], bool]) -> None:
        """Receive and dispatch messages until ``done()`` (outputs go to ``pending``)."""
        while not done():
            self._dispatch(await self._recv())

    async def _recv(self) -> tuple[bytes, list[bytes]]:
        """One message from the engines: bounded polls (``POLL_MS``), every child checked alive
        between them and after each message (with several engines, one can die while another
        streams outputs). Raises ``EngineDeadError``."""
        while not await self.async_output.poll(POLL_MS):
            self._check_alive()
        tag, *frames = await self.async_output.recv_multipart()
        if tag == ENGINE_CORE_DEAD:
            self._mark_dead(_dead_message(frames))
        self._check_alive()
        return tag, frames

    async def _send(self, request_type: EngineCoreRequestType, body: bytes, engine: int = 0) -> None:
        """Send one message to engine ``engine`` (DP rank). Raises ``EngineDeadError`` when the
        tree is dead, or the engine is unreachable (it disconnected: dying or dead)."""
        self._check_alive()
        try:
            await self.async_input.send_multipart(
                [self.engine_identities[engine], request_type.value, body], copy=False
            )
        except zmq.ZMQError:
            self._unroutable(engine)


class SyncMPClient(AsyncMPClient, EngineCoreClient):
    """The offline ``LLM``'s client: ``AsyncMPClient``'s calls, each run to completion on a
    private event loop in the calling thread (``loop.run_until_complete``).

    The ``LLM`` is single-threaded, so this client has no thread of its own: signals (Ctrl-C,
    SIGTERM) reach the main thread while it waits, and raise there. No output handler task
    runs either, so a utility call reads outputs itself (``caller_reads_outputs``) and
    ``get_output`` returns the ones it kept. vLLM's ``SyncMPClient`` reads outputs on a
    background thread into a queue instead.
    """

    caller_reads_outputs = True

    def __init__(self, config: EngineConfig, run_dir: Path, **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        try:
            super().__init__(config, run_dir, **kwargs)
        except BaseException:
            self.loop.close()  # closed already when a failed start shut down; not when arguments were bad
            raise

    def _run(self, call: Coroutine[Any, Any, T]) -> T:
        task = self.loop.create_task(call)
        try:
            return self.loop.run_until_complete(task)
        finally:
            # Interrupted (Ctrl-C): a call left pending must not read outputs when the loop next runs.
            task.cancel()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._run(self.add_request_async(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._run(self.abort_requests_async(request_ids))

    def get_output(self) -> EngineCoreOutputs:
        return self._run(self.get_output_async())

    def call_utility(self, method: str, *args: Any) -> Any:
        """Run the utility on every engine; engine 0's answer is returned."""
        return self._run(self.call_utility_async(method, *args))

    def call_utility_each(self, method: str, *args: Any) -> list[Any]:
        """Run the utility on every engine; their answers, by DP rank."""
        return self._run(self.call_utility_each_async(method, *args))

    def shutdown(self) -> None:
        if not self.loop.is_running():
            cancelled = asyncio.all_tasks(self.loop)  # interrupted calls, cancelled: let them end
            if cancelled:
                self.loop.run_until_complete(asyncio.gather(*cancelled, return_exceptions=True))
        super().shutdown()
        if not self.loop.is_running():
            self.loop.close()


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
    return AbortRequests(request_ids=request_ids, trace_headers=inject_trace_headers() or None)


def _dead_message(frames: list[bytes]) -> EngineDead | None:
    """The ``EngineDead`` after an ``ENGINE_CORE_DEAD`` tag (None when it did not come)."""
    return decode_as(EngineDead, frames[0]) if frames else None
