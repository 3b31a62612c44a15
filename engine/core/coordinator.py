"""``DPCoordinator``: the data-parallel coordinator process (``glassbox::DPCoordinator``).

Mirrors vLLM's ``DPCoordinator`` (``vllm/v1/engine/coordinator.py``). With
``--data-parallel-size N > 1`` the client starts one coordinator beside the N engine cores.

- **Load balancing**: each ``EngineCore_DP<k>`` pushes an ``EngineLoad`` (waiting, running)
  whenever its counts change; the coordinator keeps the latest per engine and publishes the
  whole table (``EngineLoads``) to every client (every API server subscribes) at most every
  ``PUBLISH_INTERVAL_S`` (100 ms) while it changes, and not at all while nothing changes.
  The clients pick the engine with the lowest ``waiting * 4 + running`` for each new request.
- **Request waves**: an idle engine that gets a request sends ``StartWave``; the coordinator
  marks the wave running and tells every other engine (``DPWave``, vLLM's
  ``START_DP_WAVE``), which then steps — a dummy batch when it has nothing to do — until the
  coordinator sees every engine at zero waiting and zero running and ends the wave
  (``DPWave`` not running, next wave number) — or, with expert parallelism across engines,
  until the engines end it themselves (``WaveComplete``). See ``coordinator_messages.py``.

The coordinator owns no run directory and no engine: if its parent (the client) goes away
its lifeline closes and it exits; if it dies, the client notices and brings the tree down.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import zmq

from engine.core.coordinator_messages import (
    CoordinatorSpawnPayload,
    DPWave,
    EngineLoad,
    EngineLoads,
    EngineToCoordinator,
    StartWave,
    WaveComplete,
    decode_as,
    encode,
)
from engine.logger import init_logger
from engine.utils.wire import ProtocolError
from tracing import catalogue
from tracing.stage import stage

logger = init_logger(__name__)

# The longest single wait for engine messages when nothing is due (seconds).
IDLE_POLL_S = 1.0


class DPCoordinator:
    """The coordinator's state and loop (the process entry is ``run_coordinator``).

    Args:
        payload: the addresses to bind and the number of engines.
        clock: the time source (tests pass their own).
    """

    # Expert parallelism across engines: the engines end each wave (WaveComplete), not the counts.
    engines_end_waves = False

    def __init__(self, payload: CoordinatorSpawnPayload, clock=time.monotonic) -> None:
        self.payload = payload
        self.engines_end_waves = payload.engines_end_waves
        self.clock = clock
        self.counts: list[tuple[int, int]] = [(0, 0)] * payload.data_parallel_size
        # The wave state: the current wave's number, and whether it runs (every engine steps).
        self.current_wave = 0
        self.engines_running = False
        self.wave_started: tuple[int, dict[str, str] | None] = (0, None)
        self.seq = 0
        self.dirty = False
        self.published_at = float("-inf")
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PULL)
        self.publish_socket = self.ctx.socket(zmq.PUB)
        self.wave_socket: zmq.Socket | None = None
        for sock in (self.input_socket, self.publish_socket):
            sock.setsockopt(zmq.LINGER, 0)
        try:
            # The coordinator's start-up stage: what glassbox ps names while it binds, and
            # where a fault aimed at the DPCoordinator strikes.
            with stage(catalogue.DP_COORDINATOR_INIT):
                self.input_socket.bind(payload.input_address)
                self.publish_socket.bind(payload.publish_address)
                if payload.wave_address is not None:
                    self.wave_socket = self.ctx.socket(zmq.PUB)
                    self.wave_socket.setsockopt(zmq.LINGER, 0)
                    self.wave_socket.bind(payload.wave_address)
        except BaseException:
            self._close_sockets()
            raise

    def handle(self, message: EngineToCoordinator) -> None:
        """One message from an engine core."""
        if not 0 <= message.engine_index < len(self.counts):
            raise ProtocolError(f"{type(message).__name__} from engine {message.engine_index}, but there "
                                f"are {len(self.counts)} engines")  # fmt: skip
        if isinstance(message, StartWave):
            self.start_wave(message)
        elif isinstance(message, WaveComplete):
            self.wave_complete(message)
        else:
            self.record(message)

    def record(self, load: EngineLoad) -> None:
        """Take one engine's new counts (a change marks the table for publishing); when the
        wave runs and every engine is at zero, the wave is complete."""
        counts = (load.num_waiting, load.num_running)
        if self.counts[load.engine_index] != counts:
            self.counts[load.engine_index] = counts
            self.dirty = True
        if self.engines_running and not self.engines_end_waves and all(c == (0, 0) for c in self.counts):
            self.engines_running = False
            self.current_wave += 1
            self.dirty = True
            self._record_wave(self.current_wave - 1)
            logger.debug("wave %d complete", self.current_wave - 1)
            self._send_wave(DPWave(wave=self.current_wave, running=False))

    def wave_complete(self, message: WaveComplete) -> None:
        """Expert parallelism across engines: the engines ended wave ``message.wave`` together
        (vLLM: ``wave_complete`` from engine 0); a later wave already started stays running."""
        if message.wave >= self.current_wave:
            self.current_wave = message.wave + 1
            self.engines_running = False
            self.dirty = True
            self._record_wave(message.wave)
            logger.debug("wave %d complete (the engines' decision)", message.wave)

    def start_wave(self, message: StartWave) -> None:
        """An idle engine got a request: run wave ``message.wave`` unless it runs already (vLLM:
        ``start_wave`` handling and ``_send_start_wave``). The engine's load comes with it: until
        then its counts may read zero, and another engine's zero would end the wave at once."""
        counts = (message.num_waiting, message.num_running)
        if self.counts[message.engine_index] != counts:
            self.counts[message.engine_index] = counts
            self.dirty = True
        if message.wave > self.current_wave or (
            message.wave == self.current_wave and not self.engines_running
        ):
            self.current_wave = message.wave
            self.engines_running = True
            self.dirty = True
            self.wave_started = (time.time_ns(), message.trace_headers)
            logger.debug("wave %d started by engine %d", message.wave, message.engine_index)
            self._send_wave(DPWave(wave=message.wave, running=True, exclude_engine=message.engine_index))

    def _record_wave(self, wave: int) -> None:
        """``dp_coordinator.wave``: the wave that just completed, in the trace of the request
        that started it."""
        started_ns, headers = self.wave_started
        if headers:
            from tracing import catalogue, record_span
            from tracing.propagation import extract_trace_context

            record_span(catalogue.DP_COORDINATOR_WAVE, start_ns=started_ns, parent=extract_trace_context(headers),
                        attributes={catalogue.ATTR_DP_WAVE: wave})  # fmt: skip

    def telemetry_gauges(self) -> dict[str, float]:
        """Live telemetry: the wave state and each engine's latest counts."""
        from tracing.telemetry import events

        gauges = {
            events.GAUGE_DP_WAVE: self.current_wave,
            events.GAUGE_DP_RUNNING: float(self.engines_running),
        }
        for k, (waiting, running) in enumerate(self.counts):
            gauges[f"dp.engine{k}.waiting"], gauges[f"dp.engine{k}.running"] = waiting, running
        return gauges

    def _send_wave(self, wave: DPWave) -> None:
        if self.wave_socket is not None:
            self.wave_socket.send(encode(wave))

    def maybe_publish(self) -> bool:
        """Publish the table if it changed and the last publish is ``publish_interval_s`` old."""
        now = self.clock()
        if not self.dirty or now - self.published_at < self.payload.publish_interval_s:
            return False
        self.seq += 1
        self.publish_socket.send(encode(EngineLoads(seq=self.seq, counts=list(self.counts),
                                                    current_wave=self.current_wave,
                                                    engines_running=self.engines_running)))  # fmt: skip
        self.published_at = now
        self.dirty = False
        return True

    def run(self) -> None:
        """Receive counts, publish on time; a bounded wait when nothing is due."""
        while True:
            if self.dirty:
                wait_s = max(self.payload.publish_interval_s - (self.clock() - self.published_at), 0.0)
            else:
                wait_s = IDLE_POLL_S
            if self.input_socket.poll(int(wait_s * 1000) + 1):
                while True:
                    try:
                        frame = self.input_socket.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(decode_as(EngineToCoordinator, frame))
            self.maybe_publish()

    def _close_sockets(self) -> None:
        self.input_socket.close(linger=0)
        self.publish_socket.close(linger=0)
        if self.wave_socket is not None:
            self.wave_socket.close(linger=0)
        self.ctx.term()

    def close(self) -> None:
        """Close the sockets (the ``dp_coordinator.shutdown`` stage)."""
        with stage(catalogue.DP_COORDINATOR_SHUTDOWN):
            self._close_sockets()

    @staticmethod
    def run_coordinator(payload_bytes: bytes, *, run_dir: Path, role: str) -> int:
        """Process target: the payload is an encoded ``CoordinatorSpawnPayload``; returns the
        exit status (``engine.utils.process_harness.run_process``)."""
        from engine.utils.process_harness import Observability, ProcessSpec, run_process

        payload = decode_as(CoordinatorSpawnPayload, payload_bytes)

        def body(ctx) -> None:
            from tracing.propagation import attached_trace_context

            with attached_trace_context(payload.trace_headers):  # the spawner's start-up trace
                coordinator = DPCoordinator(payload)
            ctx.at_exit(coordinator.close)
            if ctx.telemetry is not None:
                ctx.telemetry.add_gauge_provider(coordinator.telemetry_gauges)
            logger.debug("coordinating %d engines (pid %d)", payload.data_parallel_size, os.getpid())
            coordinator.run()

        def last_words(ctx, e: BaseException) -> None:
            logger.error("coordinator failed: %s: %s", type(e).__name__, e)

        return run_process(ProcessSpec(role, run_dir, observability=Observability.of(payload),
                                       target=body, last_words=last_words))  # fmt: skip
