"""``DPCoordinator``: the data-parallel coordinator process (``glassbox::DPCoordinator``).

Mirrors the load-balancing half of vLLM's ``DPCoordinator`` (``vllm/v1/engine/coordinator.py``).
With ``--data-parallel-size N > 1`` the client starts one coordinator beside the N engine
cores. Each ``EngineCore_DP<k>`` pushes an ``EngineLoad`` (waiting, running) whenever its
counts change; the coordinator keeps the latest per engine and publishes the whole table
(``EngineLoads``) to every client at most every ``PUBLISH_INTERVAL_S`` (100 ms) while it
changes, and not at all while nothing changes. The clients pick the engine with the lowest
``waiting * 4 + running`` for each new request.

Not here yet (issue 8 item 7, next slices): request waves (``START_DP_WAVE``, engines that
step together and run dummy batches when idle) and several API servers subscribing.

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
    EngineLoad,
    EngineLoads,
    decode_as,
    encode,
)
from engine.logger import init_logger
from engine.utils import processes
from engine.utils import run_dir as run_dirs
from engine.utils.wire import ProtocolError

logger = init_logger(__name__)

# The longest single wait for engine messages when nothing is due (seconds).
IDLE_POLL_S = 1.0


class DPCoordinator:
    """The coordinator's state and loop (the process entry is ``run_coordinator``).

    Args:
        payload: the addresses to bind and the number of engines.
        clock: the time source (tests pass their own).
    """

    def __init__(self, payload: CoordinatorSpawnPayload, clock=time.monotonic) -> None:
        self.payload = payload
        self.clock = clock
        self.counts: list[tuple[int, int]] = [(0, 0)] * payload.data_parallel_size
        self.seq = 0
        self.dirty = False
        self.published_at = float("-inf")
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PULL)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.bind(payload.input_address)
        self.publish_socket = self.ctx.socket(zmq.PUB)
        self.publish_socket.setsockopt(zmq.LINGER, 0)
        self.publish_socket.bind(payload.publish_address)

    def record(self, load: EngineLoad) -> None:
        """Take one engine's new counts (a change marks the table for publishing)."""
        if not 0 <= load.engine_index < len(self.counts):
            raise ProtocolError(f"EngineLoad from engine {load.engine_index}, but there are "
                                f"{len(self.counts)} engines")  # fmt: skip
        counts = (load.num_waiting, load.num_running)
        if self.counts[load.engine_index] != counts:
            self.counts[load.engine_index] = counts
            self.dirty = True

    def maybe_publish(self) -> bool:
        """Publish the table if it changed and the last publish is ``publish_interval_s`` old."""
        now = self.clock()
        if not self.dirty or now - self.published_at < self.payload.publish_interval_s:
            return False
        self.seq += 1
        self.publish_socket.send(encode(EngineLoads(seq=self.seq, counts=list(self.counts))))
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
                    self.record(decode_as(EngineLoad, frame))
            self.maybe_publish()

    def close(self) -> None:
        self.input_socket.close(linger=0)
        self.publish_socket.close(linger=0)
        self.ctx.term()

    @staticmethod
    def run_coordinator(payload_bytes: bytes, *, run_dir: Path, role: str) -> None:
        """Process target: the payload is an encoded ``CoordinatorSpawnPayload``."""
        from tracing import setup_tracing

        payload = decode_as(CoordinatorSpawnPayload, payload_bytes)
        setup_tracing(role, status_file=str(run_dirs.status_file(run_dir, role)))
        processes.install_sigterm_exit()
        coordinator = None
        try:
            coordinator = DPCoordinator(payload)
            logger.debug("coordinating %d engines (pid %d)", payload.data_parallel_size, os.getpid())
            coordinator.run()
        except SystemExit:
            processes.ignore_sigterm()
        except BaseException as e:  # noqa: BLE001 - reported once, then exit non-zero
            processes.ignore_sigterm()
            processes.write_crash_report(run_dir, role, e, None)
            logger.error("coordinator failed: %s: %s", type(e).__name__, e)
            raise SystemExit(1) from None
        finally:
            if coordinator is not None:
                coordinator.close()
