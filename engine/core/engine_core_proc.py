"""``EngineCoreProc``: the engine core in its own process, with its three threads.

Mirrors vLLM's ``EngineCoreProc`` (``vllm/v1/engine/core.py``)::

    client i ──ROUTER ipc──▶ [input thread] ─▶ input_queue ─▶ [busy loop: step()] ─▶ output_queue ─▶ [output thread] ──PUSH ipc──▶ client i

- The **input thread** (``EngineCoreInputThread``) reads requests from one DEALER socket per
  client (each connected to that client's ROUTER; one client per API server), checks each
  request's ``client_index`` is the socket it came in on, and puts ``(type, payload)`` on
  ``input_queue``.
- The **busy loop** (the main thread) drains ``input_queue`` — adding and aborting requests,
  answering utility calls — then runs ``step()`` while there is work, and blocks (a bounded
  wait, repeated) on ``input_queue`` when there is none. With data parallelism it also
  follows the coordinator's request waves (vLLM's ``DPEngineCoreProc``): while a wave runs,
  an engine without requests runs a dummy batch (``engine_core.dummy_step``) instead of
  blocking, so every engine steps while any has work; an engine that gets a request while
  its wave is over starts the next one (``StartWave`` to the coordinator). With expert
  parallelism across engines this lockstep is what the model needs (every forward's MoE
  all-to-alls take every engine's workers): one forward per turn, no pause between dummy
  batches, and the engines end each wave together (``_lockstep_turn``: an all-reduce over
  their own DP group every ``DP_WAVE_SYNC_STEPS`` steps).
- The **output thread** (``EngineCoreOutputThread``) takes ``(client_index, message)`` pairs
  off ``output_queue``, encodes each and pushes it to that client's PULL socket: one PUSH
  socket per client output address (one per API server), so a client only ever receives
  the outputs of its own requests and the replies to its own utility calls.
  ``OutputRouter`` groups each step's outputs per client and adds the scheduler stats.

The frontend binds both sockets and the engine connects (vLLM's layout), so a frontend can
outlive a dead engine and report it. Start-up: connect → HELLO → build the ``EngineCore``
(executor, workers, KV cache) → READY (HELLO and READY go to client 0, which launched the
engines) → CONNECTED on every input socket. On a fatal error the engine core sends
``ENGINE_CORE_DEAD`` with a root-cause block and exits non-zero.

A headless node's engine core (multi-node DP, ``glassbox serve --headless``) first joins the
head over TCP (``engine/core/head_link.py``: HELLO → the head's socket addresses), then
starts as above on those TCP addresses; a fourth thread (``head_link_watcher``) watches the
join connection from then on: the loss of the head (or the head's ``HeadStopping``) ends the
busy loop, or, during start-up, the process.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from engine import envs
from engine.config import ConfigError, EngineConfig
from engine.core.coordinator_messages import DPWave, EngineLoad, StartWave, WaveComplete
from engine.core.coordinator_messages import decode_as as decode_coordinator
from engine.core.coordinator_messages import encode as encode_coordinator
from engine.core.engine_core import EngineCore
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
    UtilityReply,
    UtilityRequest,
    decode_as,
)
from engine.core.messages import encode as _encode
from engine.core.request_tracing import EngineCoreInputTracer
from engine.distributed.topology import ProcessRole
from engine.executor.abstract import Executor
from engine.logger import init_logger
from engine.utils import processes
from engine.utils import run_dir as run_dirs
from engine.utils.process_harness import Observability, ProcessContext, ProcessSpec, run_process
from engine.utils.wire import ProtocolError
from tracing import catalogue, stage
from tracing.propagation import attached_trace_context
from tracing.stage import open_stages
from tracing.telemetry import events

if TYPE_CHECKING:
    from engine.core.head_link import HeadLink

logger = init_logger(__name__)

# How long one idle wait on the input queue lasts before the loop looks around again.
IDLE_POLL_S = 1.0
# Expert parallelism across engines: every this many steps of a wave, the engines all-reduce
# whether any has work left, and all stop together when none has (vLLM's 32).
DP_WAVE_SYNC_STEPS = 32
# A client without outputs of its own still gets the engine's stats this often while the
# engine works (vLLM's coordinator publishes at this rate), and always after the last step.
STATS_INTERVAL_S = 0.1
# An input socket's frames → the ``(type, message)`` the input thread puts on the queue.
InputDecoder = Callable[[list[bytes]], tuple[EngineCoreRequestType, Any]]


class OutputRouter:
    """Groups one step's outputs per client and gives every client the scheduler stats.

    The scheduler returns ``{client_index: EngineCoreOutputs}`` with this step's
    ``SchedulerStats`` on one entry. ``route`` returns the ``(client_index, outputs)`` pairs
    to send: each client's own outputs, stamped with this engine's index and carrying the
    stats; a client with no outputs this step gets the stats on their own when its last
    ones are ``stats_interval_s`` old, or when the engine goes idle after this step (the
    final update, so every client sees 0 running once the requests are done).

    Every output's client index is one of this engine's clients: ``_decode_input`` refused
    any request stamped with another index than its socket's.
    """

    def __init__(
        self,
        num_clients: int,
        engine_index: int,
        stats_interval_s: float = STATS_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_clients = num_clients
        self.engine_index = engine_index
        self.stats_interval_s = stats_interval_s
        self.clock = clock
        self.stats_sent_at = [float("-inf")] * num_clients

    def route(
        self, outputs: dict[int, EngineCoreOutputs], going_idle: bool
    ) -> list[tuple[int, EngineCoreOutputs]]:
        stats = next((o.scheduler_stats for o in outputs.values() if o.scheduler_stats is not None), None)
        now = self.clock()
        routed = []
        for client_index in range(self.num_clients):
            eco = outputs.get(client_index)
            stats_stale = now - self.stats_sent_at[client_index] >= self.stats_interval_s
            if stats is not None and (eco is not None or going_idle or stats_stale):
                eco = eco if eco is not None else EngineCoreOutputs()
                eco.scheduler_stats = stats
                self.stats_sent_at[client_index] = now
            if eco is not None:
                eco.engine_index = self.engine_index
                routed.append((client_index, eco))
        return routed


class EngineCoreProc(EngineCore):
    """The engine core's process: sockets, threads, busy loop.

    Args:
        config: the engine config.
        input_addresses: one ``ipc://`` ROUTER endpoint per client, by client index.
        output_addresses: one ``ipc://`` PULL endpoint per client, by client index.
        data_parallel_rank: this engine's index (its DEALER identity).
        run_dir: the instance's run directory.
        coordinator_address: the ``DPCoordinator``'s input (data parallelism): the busy loop
            pushes an ``EngineLoad`` there whenever its (waiting, running) counts change, and
            a ``StartWave`` when it gets a request while its wave is over.
        coordinator_wave_address: where the coordinator publishes ``DPWave`` (wave started
            or complete); the input thread subscribes.
        head_link: a headless node's joined connection to the head (``HeadLink``, watched by its
            own thread from the join on), closed at shutdown; None on the head's own node.
        executor_class: as ``EngineCore``'s (``Executor.get_class(config)`` unless a test
            passes another).
    """

    # Expert parallelism across engines: the engine cores' DP group (set in __init__), else None.
    dp_group = None
    # ... and how many forwards of a wave pass between two "any work left?" all-reduces.
    wave_sync_steps = DP_WAVE_SYNC_STEPS

    def __init__(
        self,
        config: EngineConfig,
        input_addresses: list[str],
        output_addresses: list[str],
        data_parallel_rank: int,
        run_dir: Path,
        coordinator_address: str | None = None,
        coordinator_wave_address: str | None = None,
        head_link: HeadLink | None = None,
        executor_class: type[Executor] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.head_link = head_link
        self.data_parallel_rank = data_parallel_rank
        self.role = ProcessRole.engine_core(data_parallel_rank).name
        # (request_type, payload) or, for a traced ABORT, (request_type, payload, received_ns).
        self.input_queue: queue.Queue[tuple[Any, ...]] = queue.Queue()
        # The spans of a traced request's way in (input thread → input_queue → busy loop).
        self.input_tracer = EngineCoreInputTracer()
        if not output_addresses or len(input_addresses) != len(output_addresses):
            raise ProtocolError(f"the engine core's spawn payload names {len(input_addresses)} client input "
                                f"and {len(output_addresses)} output address(es); one of each per client "
                                "(at least one) is due")  # fmt: skip
        # (client_index, EngineCoreOutputs | UtilityReply, the step's span context or None,
        # when it was queued in ns); None stops the output thread.
        self.output_queue: queue.Queue[tuple[int, EngineCoreOutputs | UtilityReply, Any, int] | None] = (
            queue.Queue()
        )
        self.output_router = OutputRouter(len(output_addresses), data_parallel_rank)
        self.ctx = zmq.Context()
        self.output_sockets: list[zmq.Socket] = []
        for address in output_addresses:
            socket = self.ctx.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 2000)
            socket.connect(address)
            self.output_sockets.append(socket)
        self.input_addresses = input_addresses
        self._send_handshake(EngineHandshake(kind="HELLO", role=self.role, pid=os.getpid(),
                                             data_parallel_rank=data_parallel_rank))  # fmt: skip
        # This engine's own copy of the config says which DP rank it is, so its executor
        # starts its own workers (Worker_DP<k>_*) on its own queues.
        config.parallel_config.data_parallel_rank = data_parallel_rank
        self.coordinator_socket: zmq.Socket | None = None
        self.load_sent: tuple[int, int] | None = None
        # Request waves (data parallelism): the wave this engine is in, whether it runs (then
        # this engine steps even without requests), and how many dummy batches it ran.
        self.coordinator_wave_address = coordinator_wave_address
        self.current_wave = 0
        self.engines_running = False
        self.num_dummy_steps = 0
        self.dummy_step_interval_s = envs.GLASSBOX_DP_DUMMY_STEP_INTERVAL_S
        self._coordinator_backlog: list[bytes] = []
        if coordinator_address is not None:
            self.coordinator_socket = self.ctx.socket(zmq.PUSH)
            self.coordinator_socket.setsockopt(zmq.LINGER, 0)
            self.coordinator_socket.setsockopt(zmq.SNDHWM, 100)
            self.coordinator_socket.connect(coordinator_address)
        super().__init__(config, executor_class=executor_class, run_dir=str(run_dir))
        # Expert parallelism across engines: the engine cores' own DP group, where they decide
        # together when a wave ends (every engine must run the same steps: each step's forward
        # joins every other engine's in the MoE all-to-alls). None otherwise.
        self.dp_group = None
        self.wave_step = 0  # steps (real or dummy) in the running wave, on every engine alike
        if config.parallel_config.expert_parallel_across_dp:
            try:
                self.dp_group = self._init_dp_group()
            except BaseException:
                self.model_executor.shutdown()
                raise
        # A worker that dies while we are idle wakes the busy loop through the input queue.
        self.model_executor.register_failure_callback(
            lambda error: self.input_queue.put((EngineCoreRequestType.EXECUTOR_FAILED, error))
        )
        info = self.model_executor.device_info
        ready = EngineHandshake(
            kind="READY",
            role=self.role,
            pid=os.getpid(),
            data_parallel_rank=data_parallel_rank,
            num_gpu_blocks=self.kv_cache_config.num_blocks,
            device=info.get("device", ""),
            dtype=info.get("dtype", ""),
            max_model_len=config.model_config.max_model_len or 0,
        )
        self._send_handshake(ready)
        self._stop = threading.Event()
        self.input_thread = threading.Thread(
            target=self.process_input_sockets, name="EngineCoreInputThread", daemon=True
        )
        self.output_thread = threading.Thread(
            target=self.process_output_sockets, name="EngineCoreOutputThread", daemon=True
        )
        self.input_thread.start()
        self.output_thread.start()

    # ------------------------------------------------------------------ process entry

    @staticmethod
    def run_engine_core(payload_bytes: bytes, *, run_dir: Path, role: str) -> int:
        """Process target (vLLM: ``EngineCoreProc.run_engine_core``); the payload is an
        encoded ``EngineCoreSpawnPayload``. Returns the exit status
        (``engine.utils.process_harness.run_process``)."""
        if not isinstance(payload_bytes, bytes):
            raise ProtocolError(f"the engine core's spawn payload is a {type(payload_bytes).__name__}, "
                                "not encoded EngineCoreSpawnPayload bytes")  # fmt: skip
        payload: EngineCoreSpawnPayload = decode_as(EngineCoreSpawnPayload, payload_bytes)
        life = _EngineCoreLife(payload)
        return run_process(ProcessSpec(role, run_dir, rank=payload.data_parallel_rank,
                                       observability=Observability.of(payload.config.observability_config),
                                       target=life.run, last_words=life.last_words))  # fmt: skip

    # ------------------------------------------------------------------ busy loop

    def run_busy_loop(self) -> None:
        """Drain inputs, step while there is work (a dummy batch while a DP wave runs and this
        engine has none); block (bounded) when idle. With expert parallelism across engines,
        one step or dummy batch per turn while the wave runs, and the wave's end decided with
        the other engines (``_lockstep_turn``)."""
        while True:
            self._process_input_queue()
            # Once a turn, after the inputs and before a step that may run long: the coordinator
            # learns of arrivals before this engine prefills them (else a wave could end under
            # it), and of a step's changes at the next turn, which never waits for input after
            # a step that changed them (a DP engine with requests is in a running wave).
            if self.coordinator_socket is not None:  # data parallelism
                self._report_load()
            stepped = self.scheduler.has_requests()
            if stepped:
                if self.dp_group is not None:
                    self._maybe_start_wave()  # a step's forward needs every engine: a wave runs
                outputs, _ = self.step()
                going_idle = not self.scheduler.has_requests()
                for client_index, client_outputs in self.output_router.route(outputs, going_idle):
                    self.output_queue.put(
                        (client_index, client_outputs, self.step_tracer.last_step_context, time.time_ns())
                    )
            if self.dp_group is not None:
                self._lockstep_turn(stepped)
            elif not stepped and self.engines_running:
                self._dummy_step()

    def _lockstep_turn(self, stepped: bool) -> None:
        """Expert parallelism across engines (vLLM's ``DPEngineCoreProc`` busy loop): while the
        wave runs, every turn of every engine runs exactly one forward — this turn's step (the
        workers run a dummy forward when it schedules nothing), else a dummy batch — so the
        k-th forward of each engine meets the k-th of every other in the MoE all-to-alls.
        Every ``DP_WAVE_SYNC_STEPS`` forwards the engines all-reduce whether any has work left;
        when none has, all leave the wave after this same forward, and engine 0 tells the
        coordinator (``WaveComplete``)."""
        if not stepped:
            if not self.engines_running:
                return
            self._dummy_step()
        self.wave_step += 1
        if self.wave_step % self.wave_sync_steps:
            return
        from engine.distributed.parallel_state import has_unfinished_dp

        if has_unfinished_dp(self.dp_group, self.scheduler.has_requests()):
            return
        finished, self.wave_step = self.current_wave, 0
        self.current_wave += 1
        self.engines_running = False
        if self.data_parallel_rank == 0:
            message = WaveComplete(engine_index=0, wave=finished)
            self._coordinator_backlog.append(encode_coordinator(message))
            self._flush_coordinator_backlog()

    def _init_dp_group(self):
        """Join the engine cores' DP group at the port the first process picked (the
        ``engine_core.init_dp_group`` stage; the rendezvous names absent engines)."""
        from engine.distributed.parallel_state import stateless_init_dp_group

        pc = self.config.parallel_config
        with stage(catalogue.ENGINE_CORE_INIT_DP_GROUP, rank=self.data_parallel_rank):
            return stateless_init_dp_group(
                f"tcp://127.0.0.1:{pc.data_parallel_master_port}",
                self.data_parallel_rank,
                pc.data_parallel_size,
                rank_name=lambda r: ProcessRole.engine_core(r).name,
            )

    # ------------------------------------------------------------------ live telemetry

    def _telemetry_gauges(self) -> dict[str, float]:
        """The engine core's gauges: the scheduler's and KV cache's (``EngineCore``), its two
        queues and its DP wave (read from the heartbeat thread: lengths and counters only)."""
        return {
            **self.telemetry_gauges(),
            events.GAUGE_INPUT_QUEUE: self.input_queue.qsize(),
            events.GAUGE_OUTPUT_QUEUE: self.output_queue.qsize(),
            events.GAUGE_DP_WAVE: self.current_wave,
            events.GAUGE_DP_RUNNING: float(self.engines_running),
            events.GAUGE_DUMMY_STEPS: self.num_dummy_steps,
        }

    def _dummy_step(self) -> None:
        """One dummy batch (the wave runs, this engine has no request), then a short pause
        that any input ends (``GLASSBOX_DP_DUMMY_STEP_INTERVAL_S``)."""
        self.num_dummy_steps += 1
        started_at, t0 = time.time(), time.perf_counter()
        with stage(catalogue.ENGINE_CORE_DUMMY_STEP, **{catalogue.ATTR_DP_WAVE: self.current_wave}):
            self.execute_dummy_batch()
        record = self.dummy_step_record(started_at, (time.perf_counter() - t0) * 1e3)
        for observer in self.step_observers:
            observer.on_dummy_step(record)
        # No pause with expert parallelism across engines: the other engines' all-to-alls
        # would wait it out.
        if self.dummy_step_interval_s > 0 and self.dp_group is None:
            try:
                item = self.input_queue.get(timeout=self.dummy_step_interval_s)
            except queue.Empty:
                return
            self._handle_client_request(*item)

    def _report_load(self) -> None:
        """Push (waiting, running) to the DP coordinator when they changed (data parallelism:
        ``coordinator_socket`` is set)."""
        self._flush_coordinator_backlog()
        load = self._load()
        if load == self.load_sent:
            return
        message = EngineLoad(engine_index=self.data_parallel_rank, num_waiting=load[0], num_running=load[1])
        try:
            self.coordinator_socket.send(encode_coordinator(message), zmq.NOBLOCK)
            self.load_sent = load
        except zmq.Again:  # the coordinator is slow or gone; the next change tries again
            pass

    def _load(self) -> tuple[int, int]:
        """(waiting, running): what the coordinator's table holds for this engine."""
        return len(self.scheduler.waiting), len(self.scheduler.running)

    def _flush_coordinator_backlog(self) -> None:
        """Send wave starts that could not go out at once (they must not be lost)."""
        while self._coordinator_backlog:
            try:
                self.coordinator_socket.send(self._coordinator_backlog[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._coordinator_backlog.pop(0)

    def _maybe_start_wave(self, trace_headers: dict[str, str] | None = None) -> None:
        """A request arrived (or remains) while this engine's wave is over: start the next one
        (vLLM 0.32: an idle engine that gets a request starts the wave itself). ``trace_headers``:
        that request's span, so the wave shows in its trace. Data parallelism only
        (``coordinator_socket`` is set)."""
        if self.engines_running:
            return
        self.engines_running = True
        # The load goes with the start: sent apart, another engine's zero counts could reach
        # the coordinator between the two and end the wave at once (seen on a loaded machine).
        self.load_sent = self._load()
        start = StartWave(engine_index=self.data_parallel_rank, wave=self.current_wave, trace_headers=trace_headers,
                          num_waiting=self.load_sent[0], num_running=self.load_sent[1])  # fmt: skip
        self._coordinator_backlog.append(encode_coordinator(start))
        self._flush_coordinator_backlog()

    def _on_wave(self, wave: DPWave) -> None:
        """The coordinator's news: a wave runs (every engine steps) or the last one is complete."""
        if wave.running:
            if wave.exclude_engine != self.data_parallel_rank and wave.wave >= self.current_wave:
                self.current_wave = wave.wave
                self.engines_running = True
        elif wave.wave > self.current_wave and self.dp_group is None:  # with EP the engines end waves
            self.current_wave = wave.wave
            self.engines_running = False
            if self.scheduler.has_unfinished_requests():  # a request arrived as the wave ended
                self._maybe_start_wave()

    def get_dp_state(self) -> dict[str, int | bool]:
        """Utility: this engine's wave state and dummy-batch count (data parallelism)."""
        return {
            "current_wave": self.current_wave,
            "engines_running": self.engines_running,
            "num_dummy_steps": self.num_dummy_steps,
            "wave_step": self.wave_step,
        }

    def _process_input_queue(self) -> None:
        """Handle what is on ``input_queue``; when idle (no request, no running wave), first
        wait for work, a bounded wait repeated forever."""
        while not self.scheduler.has_requests() and not self.engines_running:
            try:
                item = self.input_queue.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                continue
            self._handle_client_request(*item)
        while not self.input_queue.empty():
            self._handle_client_request(*self.input_queue.get_nowait())

    def _handle_client_request(
        self, request_type: EngineCoreRequestType, payload: Any, received_ns: int | None = None
    ) -> None:
        """One item of ``input_queue``. ``received_ns``: when the input thread received it, for
        the messages whose span starts there (a traced ABORT)."""
        if request_type == EngineCoreRequestType.ADD:
            self.input_tracer.dequeued(payload, self.last_step_delay_ns)
            self.add_request(payload)
            if self.coordinator_socket is not None:  # data parallelism: a request starts a wave
                self._maybe_start_wave(payload.trace_headers)
        elif request_type == EngineCoreRequestType.ABORT:
            with self.input_tracer.aborting(payload, received_ns):
                self.abort_requests(payload.request_ids)
        elif request_type == EngineCoreRequestType.UTILITY:
            self._handle_utility(payload)
        elif request_type == EngineCoreRequestType.START_DP_WAVE:
            self._on_wave(payload)
        else:  # EXECUTOR_FAILED, PROTOCOL_ERROR, HEAD_LOST: the payload is the fatal error
            raise payload

    def _handle_utility(self, call: UtilityRequest) -> None:
        """Run a utility call; its reply (result or error) goes back to the calling client."""
        try:
            with attached_trace_context(call.trace_headers):
                reply = UtilityReply.success(call.call_id, getattr(self, call.method)(*call.call_args()))
        except Exception as e:  # a failed utility call is the caller's error, not ours
            reply = UtilityReply.failure(call.call_id, e)
        self.output_queue.put((call.client_index, reply, None, time.time_ns()))

    # ------------------------------------------------------------------ threads

    def process_input_sockets(self) -> None:
        """The input thread: each message from a client's socket, decoded (``_decode_input``),
        and each wave news from the coordinator go on ``input_queue``; a message that breaks
        the protocol goes there as PROTOCOL_ERROR and ends the thread."""
        poller, decoders = self._connect_input_sockets()
        try:
            while not self._stop.is_set():
                for socket, _ in poller.poll(timeout=int(IDLE_POLL_S * 1000)):
                    frames = socket.recv_multipart()
                    received_ns = time.time_ns()
                    try:
                        item = self.input_tracer.received(decoders[socket](frames), received_ns)
                    except ProtocolError as e:
                        # A frontend that breaks the protocol is a bug: stop with a clear error.
                        self.input_queue.put((EngineCoreRequestType.PROTOCOL_ERROR, e))
                        return
                    self.input_queue.put(item)
        except zmq.ZMQError:
            pass
        finally:
            for socket, _ in poller.sockets:
                socket.close()

    def _connect_input_sockets(self) -> tuple[zmq.Poller, dict[zmq.Socket, InputDecoder]]:
        """The input thread's sockets, at its start: one DEALER per client, connected to its
        ROUTER (our identity there is our DP rank) and told CONNECTED; with data parallelism,
        a SUB socket on the coordinator's wave address. Returns the poller over them all and
        each socket's decoder: ``_decode_input`` for its client's index, or ``_decode_wave``."""
        poller = zmq.Poller()
        decoders: dict[zmq.Socket, InputDecoder] = {}
        # Tell each client's ROUTER who we are, so it can route to us right away (a client
        # that binds later gets it when it does: ZMQ queues it meanwhile).
        connected = _encode(EngineHandshake(kind="CONNECTED", role=self.role, pid=os.getpid(),
                                            data_parallel_rank=self.data_parallel_rank))  # fmt: skip
        for index, address in enumerate(self.input_addresses):
            socket = self.ctx.socket(zmq.DEALER)
            socket.setsockopt(zmq.IDENTITY, self.data_parallel_rank.to_bytes(2, "little"))
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
            poller.register(socket, zmq.POLLIN)
            decoders[socket] = functools.partial(_decode_input, client_index=index)
            socket.send_multipart([connected])
        if self.coordinator_wave_address is not None:
            wave_socket = self.ctx.socket(zmq.SUB)
            wave_socket.setsockopt(zmq.LINGER, 0)
            wave_socket.setsockopt(zmq.SUBSCRIBE, b"")
            wave_socket.connect(self.coordinator_wave_address)
            poller.register(wave_socket, zmq.POLLIN)
            decoders[wave_socket] = _decode_wave
        return poller, decoders

    def process_output_sockets(self) -> None:
        for client_index, message, step_context, queued_ns in iter(self.output_queue.get, None):
            taken_ns = time.time_ns()
            tag = TAG_OUTPUTS if isinstance(message, EngineCoreOutputs) else TAG_UTILITY
            self.output_sockets[client_index].send_multipart([tag, _encode(message)], copy=False)
            if step_context is not None:  # part of the step's trace: waited, encoded, sent
                self.step_tracer.record_output_send(step_context, queued_ns, taken_ns)

    def _send_handshake(self, handshake: EngineHandshake) -> None:
        """HELLO / READY to client 0, the one that launched this engine and waits for them."""
        self.output_sockets[0].send_multipart([TAG_HANDSHAKE, _encode(handshake)], copy=False)

    def shutdown(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self.output_queue.put(None)
        super().shutdown()  # the workers stop while the output thread sends what is left
        if stop is not None:
            self.output_thread.join(timeout=2.0)
        for socket in self.output_sockets:
            socket.close(linger=1000)
        if getattr(self, "coordinator_socket", None) is not None:
            self.coordinator_socket.close(linger=0)
        self.ctx.term()
        if getattr(self, "head_link", None) is not None:
            self.head_link.close()


# A type frame → its request type and what the body decodes as (the internal types never
# arrive on the socket).
_INPUT_TYPES: dict[bytes, tuple[EngineCoreRequestType, Any]] = {
    request_type.value: (request_type, body_type)
    for request_type, body_type in (
        (EngineCoreRequestType.ADD, EngineCoreRequest),
        (EngineCoreRequestType.ABORT, AbortRequests),
        (EngineCoreRequestType.UTILITY, UtilityRequest),
    )
}


def _decode_input(frames: list[bytes], client_index: int = 0) -> tuple[EngineCoreRequestType, Any]:
    """``[type, body]`` from client ``client_index``'s socket → ``(type, message)``.

    Raises:
        ProtocolError: not two frames, an unknown type, a body that does not decode, or a
            request / utility call stamped with another client's index than its socket's.
    """
    if len(frames) != 2 or frames[0] not in _INPUT_TYPES:
        raise _malformed_input(frames)
    request_type, body_type = _INPUT_TYPES[frames[0]]
    message = decode_as(body_type, frames[1])
    if getattr(message, "client_index", client_index) != client_index:
        raise _misrouted_input(request_type, message.client_index, client_index)
    return request_type, message


def _decode_wave(frames: list[bytes]) -> tuple[EngineCoreRequestType, DPWave]:
    """The coordinator's wave news (data parallelism) → ``(START_DP_WAVE, wave)``.

    Raises:
        ProtocolError: the last frame does not decode as a ``DPWave``.
    """
    return EngineCoreRequestType.START_DP_WAVE, decode_coordinator(DPWave, frames[-1])


def _malformed_input(frames: list[bytes]) -> ProtocolError:
    """``_decode_input``'s error for frames that are not ``[a known request type, body]``."""
    if len(frames) != 2:
        return ProtocolError(f"malformed message on the client ↔ engine core boundary: {len(frames)} frames, "
                             "expected [request type, body]")  # fmt: skip
    return ProtocolError(f"malformed message on the client ↔ engine core boundary: request type "
                         f"{frames[0]!r} is not one of {[t.name for t, _ in _INPUT_TYPES.values()]}")  # fmt: skip


def _misrouted_input(request_type: EngineCoreRequestType, stamped: int, client_index: int) -> ProtocolError:
    """``_decode_input``'s error for a message stamped with another client's index than its socket's."""
    return ProtocolError(f"malformed message on the client ↔ engine core boundary: a {request_type.name} "
                         f"stamped client_index {stamped} came in on client {client_index}'s socket; its "
                         "outputs would go to the wrong API server")  # fmt: skip


class _EngineCoreLife:
    """The engine core process inside the harness (``run_engine_core``): join the head (a
    headless node), build the ``EngineCoreProc``, run its busy loop; on a fatal error, its
    last words to the frontend (``ENGINE_CORE_DEAD`` with the root cause); at exit, shut the
    engine down (and clean the run directory up when the frontend died first)."""

    def __init__(self, payload: EngineCoreSpawnPayload) -> None:
        self.payload = payload
        self.engine: EngineCoreProc | None = None
        self.head_link: HeadLink | None = None

    def run(self, ctx: ProcessContext) -> None:
        payload, config = self.payload, self.payload.config
        run_dir, role = ctx.spec.run_dir, ctx.spec.role
        parent_pid = os.getppid()

        def close() -> None:
            if self.engine is not None:
                self.engine.shutdown()
            elif self.head_link is not None:
                self.head_link.close()
            if os.getppid() != parent_pid:
                # Our parent (the frontend, which owns the run directory) is gone and our
                # workers are stopped: we are the last of the tree, so we clean up, keeping
                # the post-mortem (a frontend that leaves its tree behind did not end well).
                run_dirs.close_run_dir(run_dir, failure=f"the frontend died before {role}")

        ctx.at_exit(close)
        if payload.head_address is not None:  # a headless node: join the head first
            from engine.core.head_link import HeadLink

            self.head_link = head_link = HeadLink.join(payload.head_address, role, os.getpid(),
                                                       payload.data_parallel_rank,
                                                       config.parallel_config.data_parallel_size)  # fmt: skip
            accepted = head_link.accepted

            def on_head_news(error: BaseException) -> None:
                # The head stopped (SystemExit(0)) or is lost (HeadLost). Serving: the busy
                # loop ends through its input queue. Still starting (loading the model, say):
                # nothing reads that queue yet, so this process ends now (its workers follow
                # through their lifelines) rather than outlive its head.
                if self.engine is not None:
                    self.engine.input_queue.put((EngineCoreRequestType.HEAD_LOST, error))
                    return
                if not isinstance(error, SystemExit):
                    ctx.report_crash(error)
                os._exit(0 if isinstance(error, SystemExit) else 1)

            head_link.watch(on_head_news)
            payload = msgspec.structs.replace(
                payload, input_addresses=accepted.input_addresses, output_addresses=accepted.output_addresses,
                coordinator_address=accepted.coordinator_address,
                coordinator_wave_address=accepted.coordinator_wave_address,
            )  # fmt: skip
            self.payload = payload
        with attached_trace_context(payload.trace_headers):
            self.engine = engine = EngineCoreProc(config, payload.input_addresses, payload.output_addresses,
                                                  payload.data_parallel_rank, run_dir, payload.coordinator_address,
                                                  payload.coordinator_wave_address, self.head_link)  # fmt: skip
        publisher = ctx.telemetry
        if publisher is not None:
            publisher.add_gauge_provider(engine._telemetry_gauges)
            publisher.add_gauge_provider(engine.model_executor.telemetry_gauges)
            publisher.set_requests_provider(engine.telemetry_requests)
        StepWatchdog(engine, run_dir, role, payload.data_parallel_rank, payload.output_addresses).start()
        engine.run_busy_loop()

    def last_words(self, ctx: ProcessContext, e: BaseException) -> None:
        """Every death is reported, once: the crash report is written (an echo when a worker
        died first); the frontend gets ``ENGINE_CORE_DEAD`` with the root cause."""
        run_dir, role, engine = ctx.spec.run_dir, ctx.spec.role, self.engine
        if engine is not None and engine.flight_recorder:
            # The last steps before the end, beside the crash report (glassbox doctor reads it).
            processes.write_flight_record(run_dir, role, list(engine.flight_recorder))
        root = getattr(e, "root_cause", None)
        if root is None:
            root = processes.format_root_cause(run_dir, role, os.getpid(), 1)
            if isinstance(e, ConfigError) and engine is None:
                # A bad setting found during start-up: the frontend reports it as one
                # line naming the flag; nothing more to say here.
                logger.debug("engine core start-up refused: %s", e)
            else:
                logger.error("engine core failed: %s: %s", type(e).__name__, e)
        else:
            # A worker died: the frontend prints the root-cause block, once. This death is its
            # echo, and its crash report says so (the blame rule then never names this process).
            logger.error(
                "engine core stopping: a worker died, stopped or froze (the frontend prints the root cause)"
            )
        dead = EngineDead.from_exception(root, e, during_startup=engine is None)
        _send_dead(self.payload.output_addresses, dead)


class EngineStepHung(RuntimeError):
    """The engine core's own loop stopped inside a step (what ``StepWatchdog`` reports)."""


# Seconds past GLASSBOX_EXECUTE_MODEL_TIMEOUT_S a step may run: the workers' reply is bounded
# by that deadline, so a step that outlives it by this much is stuck in the engine core itself.
STEP_HUNG_GRACE_S = 5.0


class StepWatchdog(threading.Thread):
    """Ends an engine core whose step never finishes (vLLM has no counterpart).

    The workers' part of a step is bounded (``GLASSBOX_EXECUTE_MODEL_TIMEOUT_S``), but the
    engine core's own part (scheduling, updating, a deadlock, an injected ``hang``) is not:
    its heartbeat thread goes on, so ``/health`` stayed 200 and requests waited forever. This
    thread looks once a second at the open ``engine_core.step`` / ``engine_core.dummy_step``;
    one open longer than the execute-model deadline + ``STEP_HUNG_GRACE_S`` is reported like
    a crash — a crash report naming the stage and the line the main thread waits at, the
    flight recorder, ENGINE_CORE_DEAD to every client (requests in flight get an error, the
    frontend prints the root cause) — and the process exits 1 (its workers follow through
    their lifelines). A process holding the GIL is the heartbeat watch's case
    (``GLASSBOX_HEARTBEAT_TIMEOUT_S``): this thread cannot run then either.
    """

    STEPS = (catalogue.ENGINE_CORE_STEP, catalogue.ENGINE_CORE_DUMMY_STEP)

    def __init__(self, engine: EngineCore, run_dir: Path, role: str, rank: int, output_addresses: list[str]):
        super().__init__(name="step_watchdog", daemon=True)
        self.engine, self.run_dir, self.role, self.rank = engine, run_dir, role, rank
        self.output_addresses = output_addresses
        self.limit_s = envs.GLASSBOX_EXECUTE_MODEL_TIMEOUT_S + STEP_HUNG_GRACE_S
        self.main_ident = threading.main_thread().ident

    def run(self) -> None:
        while True:
            time.sleep(1.0)
            now = time.time()
            steps = [s for s in open_stages() if s.name in self.STEPS and s.thread == "MainThread"]
            if steps and now - steps[0].entered_at > self.limit_s:
                self._report(steps[0].name, now - steps[0].entered_at)
                os._exit(1)

    def _report(self, step: str, seconds: float) -> None:
        import sys
        import traceback

        from tracing.stacks import where_waits

        inner = [s.name for s in open_stages() if s.thread == "MainThread"]
        frame = sys._current_frames().get(self.main_ident)
        frames = (
            [(f.filename, f.lineno, f.name) for f in reversed(traceback.extract_stack(frame))]
            if frame
            else []
        )
        where = where_waits(frames)
        error = EngineStepHung(
            f"{step} has run for {seconds:.0f} s, over GLASSBOX_EXECUTE_MODEL_TIMEOUT_S + {STEP_HUNG_GRACE_S:g} s "
            f"= {self.limit_s:g} s: the engine core's own loop is stuck"
            + (f" in {inner[-1]}" if inner else "")
            + (f"; its main thread waits at {where}" if where else "")
        )
        logger.error("%s", error)
        if self.engine.flight_recorder:
            processes.write_flight_record(self.run_dir, self.role, list(self.engine.flight_recorder))
        processes.write_crash_report(self.run_dir, self.role, error, inner[-1] if inner else step, self.rank)
        root = processes.format_root_cause(self.run_dir, self.role, os.getpid(), 1)
        dead = EngineDead(
            root_cause=root, error_type=type(error).__name__, message=str(error), during_startup=False
        )
        try:
            _send_dead(self.output_addresses, dead)
        except zmq.ZMQError as e:
            logger.error("could not tell the clients: %s", e)


def _send_dead(output_addresses: list[str], dead: EngineDead) -> None:
    """Tell every client we are dying, on fresh sockets (the engine's may be mid-send)."""
    ctx = zmq.Context.instance()
    body = _encode(dead)
    for address in output_addresses:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        try:
            sock.connect(address)
            sock.send_multipart([ENGINE_CORE_DEAD, body])
        finally:
            sock.close()
