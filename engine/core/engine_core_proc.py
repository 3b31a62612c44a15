"""``EngineCoreProc``: the engine core in its own process, with its three threads.

Mirrors vLLM's ``EngineCoreProc`` (``vllm/v1/engine/core.py``)::

    frontend ──ROUTER ipc──▶ [input thread] ─▶ input_queue ─▶ [busy loop: step()] ─▶ output_queue ─▶ [output thread] ──PUSH ipc──▶ frontend

- The **input thread** (``EngineCoreInputThread``) reads requests from a DEALER socket
  connected to the frontend's ROUTER and puts ``(type, payload)`` on ``input_queue``.
- The **busy loop** (the main thread) drains ``input_queue`` — adding and aborting requests,
  answering utility calls — then runs ``step()`` while there is work, and blocks (a bounded
  wait, repeated) on ``input_queue`` when there is none.
- The **output thread** (``EngineCoreOutputThread``) encodes what the busy loop put on
  ``output_queue`` and pushes it to the frontend's PULL socket.

The frontend binds both sockets and the engine connects (vLLM's layout), so a frontend can
outlive a dead engine and report it. Start-up: connect → HELLO → build the ``EngineCore``
(executor, workers, KV cache) → READY. On a fatal error the engine core sends
``ENGINE_CORE_DEAD`` with a root-cause block and exits non-zero.
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path
from typing import Any

import zmq

from engine.config import ConfigError, EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.messages import (
    ENGINE_CORE_DEAD,
    TAG_HANDSHAKE,
    TAG_OUTPUTS,
    TAG_UTILITY,
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
from engine.distributed.topology import ProcessRole
from engine.logger import init_logger
from engine.utils import processes
from engine.utils import run_dir as run_dirs
from engine.utils.wire import ProtocolError
from tracing import current_stage, setup_tracing
from tracing.propagation import attached_trace_context

logger = init_logger(__name__)

# How long one idle wait on the input queue lasts before the loop looks around again.
IDLE_POLL_S = 1.0


class EngineCoreProc(EngineCore):
    """The engine core's process: sockets, threads, busy loop.

    Args:
        config: the engine config.
        input_address / output_address: the frontend's ``ipc://`` endpoints.
        data_parallel_rank: this engine's index (its DEALER identity).
        run_dir: the instance's run directory.
    """

    def __init__(
        self,
        config: EngineConfig,
        input_address: str,
        output_address: str,
        data_parallel_rank: int,
        run_dir: Path,
    ) -> None:
        self.run_dir = run_dir
        self.data_parallel_rank = data_parallel_rank
        self.role = ProcessRole.engine_core(data_parallel_rank).name
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[list[bytes] | None] = queue.Queue()
        self.ctx = zmq.Context()
        self.output_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket.setsockopt(zmq.LINGER, 2000)
        self.output_socket.connect(output_address)
        self.input_address = input_address
        self._send([TAG_HANDSHAKE, _encode(EngineHandshake(kind="HELLO", role=self.role, pid=os.getpid(),
                                                           data_parallel_rank=data_parallel_rank))])  # fmt: skip
        super().__init__(config, run_dir=str(run_dir))
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
        self._send([TAG_HANDSHAKE, _encode(ready)])
        self._stop = threading.Event()
        self.input_thread = threading.Thread(
            target=self._input_thread, name="EngineCoreInputThread", daemon=True
        )
        self.output_thread = threading.Thread(
            target=self._output_thread, name="EngineCoreOutputThread", daemon=True
        )
        self.input_thread.start()
        self.output_thread.start()

    # ------------------------------------------------------------------ process entry

    @staticmethod
    def run_engine_core(payload_bytes: bytes, *, run_dir: Path, role: str) -> None:
        """Process target (vLLM: ``EngineCoreProc.run_engine_core``); the payload is an
        encoded ``EngineCoreSpawnPayload``."""
        if not isinstance(payload_bytes, bytes):
            raise ProtocolError(f"the engine core's spawn payload is a {type(payload_bytes).__name__}, "
                                "not encoded EngineCoreSpawnPayload bytes")  # fmt: skip
        payload: EngineCoreSpawnPayload = decode_as(EngineCoreSpawnPayload, payload_bytes)
        config: EngineConfig = payload.config
        obs = config.observability_config
        setup_tracing(role, rank=payload.data_parallel_rank, trace_file=obs.trace_file,
                      otlp_endpoint=obs.otlp_traces_endpoint,
                      status_file=str(run_dirs.status_file(run_dir, role)))  # fmt: skip
        processes.install_sigterm_exit()
        parent_pid = os.getppid()
        engine: EngineCoreProc | None = None
        try:
            with attached_trace_context(payload.trace_headers):
                engine = EngineCoreProc(config, payload.input_address, payload.output_address,
                                        payload.data_parallel_rank, run_dir)  # fmt: skip
            engine.run_busy_loop()
        except SystemExit:
            processes.ignore_sigterm()
            logger.debug("engine core stopping")
        except BaseException as e:  # noqa: BLE001 - every death is reported, once
            processes.ignore_sigterm()
            root = getattr(e, "root_cause", None)
            if root is None:
                processes.write_crash_report(run_dir, role, e, current_stage(), payload.data_parallel_rank)
                root = processes.format_root_cause(run_dir, role, os.getpid(), 1)
                if isinstance(e, ConfigError) and engine is None:
                    # A bad setting found during start-up: the frontend reports it as one
                    # line naming the flag; nothing more to say here.
                    logger.debug("engine core start-up refused: %s", e)
                else:
                    logger.error("engine core failed: %s: %s", type(e).__name__, e)
            else:
                # A worker died: the frontend prints the root-cause block, once.
                logger.error("engine core stopping: a worker died (the frontend prints the root cause)")
            flag = getattr(e, "flag", None)
            dead = EngineDead(
                root_cause=root,
                error_type=type(e).__name__,
                message=str(e),
                flag=flag if isinstance(flag, str) else None,
                during_startup=engine is None,
            )
            _send_dead(payload.output_address, dead)
            raise SystemExit(1) from None
        finally:
            processes.ignore_sigterm()
            if engine is not None:
                engine.shutdown()
            if os.getppid() != parent_pid:
                # Our parent (the frontend, which owns the run directory) is gone and our
                # workers are stopped: we are the last of the tree, so we clean up.
                run_dirs.remove_run_dir(run_dir)

    # ------------------------------------------------------------------ busy loop

    def run_busy_loop(self) -> None:
        """Drain inputs, step while there is work; block (bounded) when idle."""
        while True:
            self._process_input_queue()
            if self.scheduler.has_requests():
                outputs, _ = self.step()
                for client_outputs in outputs.values():
                    self.output_queue.put([TAG_OUTPUTS, _encode(client_outputs)])

    def _process_input_queue(self) -> None:
        if not self.scheduler.has_requests():
            # Idle: wait for the next request, a bounded wait repeated forever.
            while True:
                try:
                    item = self.input_queue.get(timeout=IDLE_POLL_S)
                    break
                except queue.Empty:
                    continue
            self._handle_input(*item)
        while True:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle_input(*item)

    def _handle_input(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        if request_type == EngineCoreRequestType.ADD:
            self.add_request(payload)
        elif request_type == EngineCoreRequestType.ABORT:
            self.abort_requests(payload)
        elif request_type in (EngineCoreRequestType.EXECUTOR_FAILED, EngineCoreRequestType.PROTOCOL_ERROR):
            raise payload
        elif request_type == EngineCoreRequestType.UTILITY:
            call: UtilityRequest = payload
            try:
                with attached_trace_context(call.trace_headers):
                    reply = UtilityReply.success(call.call_id, getattr(self, call.method)(*call.call_args()))
            except Exception as e:  # a failed utility call is the caller's error, not ours
                reply = UtilityReply.failure(call.call_id, e)
            self.output_queue.put([TAG_UTILITY, _encode(reply)])
        else:
            logger.warning("ignoring request type %s", request_type)

    # ------------------------------------------------------------------ threads

    def _input_thread(self) -> None:
        socket = self.ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, self.data_parallel_rank.to_bytes(2, "little"))
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.input_address)
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        try:
            # Tell the frontend's ROUTER who we are, so it can route to us right away.
            connected = EngineHandshake(kind="CONNECTED", role=self.role, pid=os.getpid(),
                                        data_parallel_rank=self.data_parallel_rank)  # fmt: skip
            socket.send_multipart([_encode(connected)])
            while not self._stop.is_set():
                if not poller.poll(timeout=int(IDLE_POLL_S * 1000)):
                    continue
                frames = socket.recv_multipart()
                try:
                    self.input_queue.put(_decode_input(frames))
                except ProtocolError as e:
                    # A frontend that breaks the protocol is a bug: stop with a clear error.
                    self.input_queue.put((EngineCoreRequestType.PROTOCOL_ERROR, e))
                    return
        except zmq.ZMQError:
            pass
        finally:
            socket.close()

    def _output_thread(self) -> None:
        while True:
            frames = self.output_queue.get()
            if frames is None:
                return
            self._send(frames)

    def _send(self, frames: list[bytes]) -> None:
        self.output_socket.send_multipart(frames, copy=False)

    def shutdown(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self.output_queue.put(None)
            self.output_thread.join(timeout=2.0)
        super().shutdown()
        self.output_socket.close(linger=1000)
        self.ctx.term()


# What each request type's body decodes as (the internal types never arrive on the socket).
_INPUT_TYPES: dict[EngineCoreRequestType, Any] = {
    EngineCoreRequestType.ADD: EngineCoreRequest,
    EngineCoreRequestType.ABORT: list[str],
    EngineCoreRequestType.UTILITY: UtilityRequest,
}


def _decode_input(frames: list[bytes]) -> tuple[EngineCoreRequestType, Any]:
    """``[type, body]`` from the frontend → ``(type, message)``; ``ProtocolError`` otherwise."""
    if len(frames) != 2:
        raise ProtocolError(f"malformed message on the client ↔ engine core boundary: {len(frames)} frames, "
                            "expected [request type, body]")  # fmt: skip
    try:
        request_type = EngineCoreRequestType(frames[0])
    except ValueError:
        request_type = None
    if request_type not in _INPUT_TYPES:
        raise ProtocolError(f"malformed message on the client ↔ engine core boundary: request type "
                            f"{frames[0]!r} is not one of {[t.name for t in _INPUT_TYPES]}")  # fmt: skip
    return request_type, decode_as(_INPUT_TYPES[request_type], frames[1])


def _send_dead(output_address: str, dead: EngineDead) -> None:
    """Tell the frontend we are dying, on a fresh socket (the engine's may be mid-send)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    try:
        sock.connect(output_address)
        sock.send_multipart([ENGINE_CORE_DEAD, _encode(dead)])
    finally:
        sock.close()
