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

import json
import os
import pickle
import queue
import threading
from pathlib import Path
from typing import Any

import msgspec
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
    EngineHandshake,
)
from engine.distributed.topology import ProcessRole
from engine.logger import init_logger
from engine.utils import processes
from engine.utils import run_dir as run_dirs
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
    def run_engine_core(payload: dict[str, Any], *, run_dir: Path, role: str) -> None:
        """Process target (vLLM: ``EngineCoreProc.run_engine_core``)."""
        config: EngineConfig = payload["config"]
        obs = config.observability_config
        setup_tracing(role, rank=payload["data_parallel_rank"], trace_file=obs.trace_file,
                      otlp_endpoint=obs.otlp_traces_endpoint,
                      status_file=str(run_dirs.status_file(run_dir, role)))  # fmt: skip
        processes.install_sigterm_exit()
        parent_pid = os.getppid()
        engine: EngineCoreProc | None = None
        try:
            with attached_trace_context(payload.get("trace_headers")):
                engine = EngineCoreProc(config, payload["input_address"], payload["output_address"],
                                        payload["data_parallel_rank"], run_dir)  # fmt: skip
            engine.run_busy_loop()
        except SystemExit:
            processes.ignore_sigterm()
            logger.debug("engine core stopping")
        except BaseException as e:  # noqa: BLE001 - every death is reported, once
            processes.ignore_sigterm()
            root = getattr(e, "root_cause", None)
            if root is None:
                processes.write_crash_report(run_dir, role, e, current_stage(), payload["data_parallel_rank"])
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
            error = {
                "type": type(e).__name__,
                "message": str(e),
                "flag": getattr(e, "flag", None),
                "during_startup": engine is None,
            }
            _send_dead(payload["output_address"], root, error)
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
        elif request_type == EngineCoreRequestType.EXECUTOR_FAILED:
            raise payload
        elif request_type == EngineCoreRequestType.UTILITY:
            call_id, method, args = payload
            try:
                result = (True, getattr(self, method)(*args))
            except Exception as e:  # a failed utility call is the caller's error, not ours
                result = (False, f"{type(e).__name__}: {e}")
            self.output_queue.put([TAG_UTILITY, pickle.dumps((call_id, *result))])
        else:
            logger.warning("ignoring request type %s", request_type)

    # ------------------------------------------------------------------ threads

    def _input_thread(self) -> None:
        socket = self.ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, self.data_parallel_rank.to_bytes(2, "little"))
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.input_address)
        decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        try:
            # Tell the frontend's ROUTER who we are, so it can route to us right away.
            socket.send_multipart([b"READY"])
            while not self._stop.is_set():
                if not poller.poll(timeout=int(IDLE_POLL_S * 1000)):
                    continue
                type_frame, *frames = socket.recv_multipart()
                request_type = EngineCoreRequestType(type_frame)
                if request_type == EngineCoreRequestType.ADD:
                    payload: Any = decoder.decode(frames[0])
                elif request_type == EngineCoreRequestType.ABORT:
                    payload = msgspec.msgpack.decode(frames[0])
                else:
                    payload = pickle.loads(frames[0])
                self.input_queue.put((request_type, payload))
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


def _encode(obj: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(obj)


def _send_dead(output_address: str, root_cause: str, error: dict[str, Any]) -> None:
    """Tell the frontend we are dying, on a fresh socket (the engine's may be mid-send)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    try:
        sock.connect(output_address)
        sock.send_multipart([ENGINE_CORE_DEAD, root_cause.encode(), json.dumps(error).encode()])
    finally:
        sock.close()
