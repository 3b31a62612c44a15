"""Several API servers (``--api-server-count A > 1``): APIServer_0 starts the others.

vLLM's counterparts are ``run_multi_api_server`` with its ``APIServerProcessManager`` (a
parent process that launches the engines, then A API server processes, and supervises
them) and ``run_api_server_worker_proc`` (each API server's process target). Here
APIServer_0 is that parent as well as the first server, so the tree is exactly A + DP + N
(+1) processes: ``start_api_servers`` runs inside its start-up, after the engine cores are
ready, and returns once every other server accepts connections on the listening socket
they all share; each other server runs ``run_api_server_worker``. The messages between
them are in ``api_server_messages.py``; serving itself is ``api_server.run_server_worker``,
the same in every server.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
from pathlib import Path

from engine import envs
from engine.config import EngineConfig
from engine.entrypoints.openai.api_server import new_event_loop, run_server_worker
from engine.entrypoints.openai.api_server_messages import (
    APIServerReady,
    APIServerSpawnPayload,
    ServerArgs,
    decode_as,
    encode,
    ready_address,
)
from engine.utils import processes

__all__ = ["start_api_servers", "run_api_server_worker"]


def start_api_servers(engine, plan, config: EngineConfig, args: ServerArgs, sock: socket.socket,
                      run_dir: Path) -> None:  # fmt: skip
    """APIServer_0: spawn APIServer_1..A-1 on the shared socket; return once each serves.

    Each is watched like an engine process: its death (also during start-up) stops the tree
    with its root cause.

    Raises:
        EngineDeadError: an API server (or an engine process) died meanwhile.
        TimeoutError: not every API server was serving within ``GLASSBOX_ENGINE_READY_TIMEOUT_S``.
    """
    import zmq

    from tracing import WaitTimeout, catalogue, stage, wait_for
    from tracing.propagation import inject_trace_headers

    others = plan.api_servers[1:]
    client = engine.engine_core
    ctx = zmq.Context.instance()
    ready_socket = ctx.socket(zmq.PULL)
    ready_socket.setsockopt(zmq.LINGER, 0)
    try:
        with stage(catalogue.API_SERVER_START_OTHERS):
            address = ready_address(run_dir)
            ready_socket.bind(address)
            engines = client.engines_info()
            config_pickle = pickle.dumps(config, protocol=5)
            trace_headers = inject_trace_headers() or None
            for role in others:
                payload = APIServerSpawnPayload(
                    config_pickle=config_pickle,
                    server_args=args,
                    client_index=role.api_index,
                    num_clients=len(plan.api_servers),
                    engines=engines,
                    listen_fd=sock.fileno(),
                    ready_address=address,
                    trace_headers=trace_headers,
                )
                proc = processes.spawn_process(
                    role.name,
                    "engine.entrypoints.openai.multi_api_server:run_api_server_worker",
                    encode(payload),
                    run_dir,
                    pass_fds=(sock.fileno(),),
                )
                client.watch_child(proc)
            waiting = {role.api_index: role.name for role in others}

            def all_serving() -> bool:
                if ready_socket.poll(100):
                    ready: APIServerReady = decode_as(APIServerReady, ready_socket.recv())
                    waiting.pop(ready.client_index, None)
                client._check_alive()  # a server that died during start-up: its root cause
                return not waiting

            timeout = envs.GLASSBOX_ENGINE_READY_TIMEOUT_S
            try:
                wait_for(f"ready from {', '.join(waiting.values())}", all_serving, timeout_s=timeout,
                         poll_interval_s=0)  # fmt: skip
            except WaitTimeout:
                raise TimeoutError(
                    f"API server(s) {', '.join(waiting.values())} not serving within "
                    f"GLASSBOX_ENGINE_READY_TIMEOUT_S={timeout:g} s"
                ) from None
    finally:
        ready_socket.close(linger=0)


def run_api_server_worker(payload_bytes: bytes, *, run_dir: Path, role: str) -> int:
    """Process target of APIServer_<i>, i > 0 (vLLM: ``run_api_server_worker_proc``).

    Attaches to the engine cores APIServer_0 launched, serves on the inherited listening
    socket, and tells APIServer_0 once it accepts connections. Exits 0 when stopped
    (SIGTERM, or its lifeline to APIServer_0 closing); returns the exit status
    (``engine.utils.process_harness.run_process``).
    """
    from engine.utils.process_harness import Observability, ProcessSpec, run_process

    payload: APIServerSpawnPayload = decode_as(APIServerSpawnPayload, payload_bytes)
    spec = ProcessSpec(role, run_dir, observability=Observability.of(payload.config.observability_config),
                       target=lambda ctx: _serve_api_server_worker(payload, run_dir, role, ctx))  # fmt: skip
    return run_process(spec)


def _serve_api_server_worker(payload: APIServerSpawnPayload, run_dir: Path, role: str, ctx) -> None:
    """APIServer_<i>'s life inside the harness (``run_api_server_worker``)."""
    from tracing import catalogue, stage
    from tracing.propagation import attached_trace_context

    config: EngineConfig = payload.config
    sock = socket.socket(fileno=payload.listen_fd)
    port = sock.getsockname()[1]
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    engine = None

    def close() -> None:
        if engine is not None:
            engine.shutdown()
        sock.close()
        loop.close()

    ctx.at_exit(close)

    def say_ready() -> None:
        import zmq

        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 2000)
        push.connect(payload.ready_address)
        push.send(encode(APIServerReady(client_index=payload.client_index, role=role, pid=os.getpid())))
        push.close()

    from engine.frontend.async_llm import AsyncLLM

    with attached_trace_context(payload.trace_headers), stage(catalogue.API_SERVER_ATTACH, role=role):
        engine = AsyncLLM(config, run_dir, client_index=payload.client_index,
                          num_clients=payload.num_clients, engines=payload.engines)  # fmt: skip
    code = loop.run_until_complete(
        run_server_worker(
            engine,
            config,
            payload.server_args,
            sock,
            port,
            launcher=False,
            on_serving=say_ready,
            several_servers=payload.num_clients > 1,
        )
    )
    if code:
        raise SystemExit(code)
