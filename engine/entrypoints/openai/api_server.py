"""The API server process: ``glassbox serve``.

Mirrors vLLM's ``vllm/entrypoints/openai/api_server.py`` (``run_server``). Start-up, in
order, each step before the next:

1. validate the whole config (done by the CLI, before this module runs anything heavy);
2. **bind the listening socket** — before the engine starts, so a port that is taken fails in
   a second, with nothing spawned (and port 0 picks a free port, written to the manifest);
3. install the SIGTERM/SIGINT handler, so a signal during the long engine start-up still
   stops the whole tree;
4. build ``AsyncLLM``, which launches the engine core and its workers and waits for READY;
5. build the FastAPI app (routes, API key, CORS);
6. serve with uvicorn on uvloop, on the socket from step 2;
7. freeze the start-up objects out of the garbage collector's way (``gc.freeze``).

Shutdown: SIGINT/SIGTERM → uvicorn stops accepting and finishes → the engine tree is
stopped → the run directory is removed → exit 0. If the engine dies, requests in flight end
with an error, new ones get 503, the root cause is printed last, and the server exits 1 —
unless ``GLASSBOX_KEEP_ALIVE_ON_ENGINE_DEATH=1``.

This process never imports torch.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from engine import envs
from engine.config import EngineConfig
from engine.distributed import topology
from engine.logger import init_logger, set_process_role
from engine.utils import processes
from engine.utils import run_dir as run_dirs
from engine.utils.processes import EngineDeadError

logger = init_logger(__name__)

# Exit codes of ``glassbox serve`` (listed in its --help). A bad setting, found by any
# process, exits 2 through the CLI (ConfigError).
EXIT_OK = 0  # stopped by SIGTERM, or by Ctrl-C once serving
EXIT_ENGINE_DEAD = 1  # the engine died (the root cause is printed last)
EXIT_INTERRUPTED = 130  # Ctrl-C during start-up (128 + SIGINT)


@dataclass
class ServerArgs:
    """The server's own flags (the engine's are in ``EngineConfig``)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    allowed_origins: list[str] | None = None
    uvicorn_log_level: str = "info"


class PortInUseError(OSError):
    """The listening address cannot be bound; ``flag`` is the flag to change (``--port`` when
    the port is taken, ``--host`` when the address is not this machine's or not valid)."""

    flag = "--port"


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (and listen on) ``host:port`` before anything else starts.

    Raises:
        PortInUseError: the address is taken (or cannot be bound); the message says which.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as e:
        sock.close()
        err = PortInUseError(f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}")
        if getattr(e, "errno", None) != errno.EADDRINUSE:
            err.flag = "--host"
        raise err from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def run_server(config: EngineConfig, args: ServerArgs, sock: socket.socket | None = None) -> int:
    """Run the API server until it is told to stop; returns the process exit code.

    ``sock``: the listening socket when the caller bound it already (the CLI does, to fail
    fast on a taken port); else it is bound here.
    """
    # A signal during start-up (the engine can take minutes to load) stops everything:
    # installed first, so no signal can land between creating the run directory and
    # being ready to clean it up.
    startup_signal: list[int] = []

    def on_signal_during_startup(signum: int, frame: object) -> None:
        startup_signal.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal_during_startup)
    signal.signal(signal.SIGINT, on_signal_during_startup)
    # Every process of the tree, named once. This process is APIServer_0, the only API
    # server for now, also with --data-parallel-size > 1 (it then talks to every engine
    # core); vLLM's --api-server-count defaulting to the DP size is the next step (issue 8).
    # It owns the run directory.
    plan = topology.plan(config, frontend="serve", api_server_count=1)
    role = plan.api_servers[0]
    processes.set_process_title(role.name)
    set_process_role(role.name)
    engine = None
    run_dir: Path | None = None
    loop = _new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        if sock is None:
            sock = bind_socket(args.host, args.port)
        host, port = sock.getsockname()[:2]
        run_dir = run_dirs.create_run_dir()
        manifest = run_dirs.plan_tree(plan)
        run_dirs.write_manifest(run_dir, host=host, port=port, **manifest)
        logger.info("Bound http://%s:%d (run directory %s)", host, port, run_dir)

        from tracing import setup_tracing

        obs = config.observability_config
        setup_tracing(role.name, trace_file=obs.trace_file, otlp_endpoint=obs.otlp_traces_endpoint,
                      status_file=str(run_dirs.status_file(run_dir, role)))  # fmt: skip

        from engine.frontend.async_llm import AsyncLLM

        engine = AsyncLLM(config, run_dir)
        return loop.run_until_complete(_serve(engine, config, args, sock, port))
    except KeyboardInterrupt:
        # Ctrl-C exits 130 as a shell expects (128 + SIGINT); SIGTERM is a clean stop: 0.
        terminated = startup_signal[:1] == [signal.SIGTERM]
        logger.info("%s during start-up; stopping", "SIGTERM" if terminated else "Interrupted")
        return EXIT_OK if terminated else EXIT_INTERRUPTED
    except EngineDeadError as e:
        print(e.root_cause, file=sys.stderr, flush=True)
        return EXIT_ENGINE_DEAD
    finally:
        # Cleanup must finish even if a second signal arrives meanwhile.
        signal.signal(signal.SIGTERM, _ignore_signal)
        signal.signal(signal.SIGINT, _ignore_signal)
        if engine is not None:
            engine.shutdown()
        if sock is not None:
            sock.close()
        loop.close()
        if run_dir is not None:
            run_dirs.remove_run_dir(Path(run_dir))


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.new_event_loop()


async def _serve(engine, config: EngineConfig, args: ServerArgs, sock: socket.socket, port: int) -> int:
    import uvicorn

    from engine.entrypoints.openai.app import build_app

    served_name = args.served_model_name or config.model_config.served_model_name
    app = build_app(engine, served_model_name=served_name, api_key=args.api_key,
                    allowed_origins=args.allowed_origins)  # fmt: skip
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=2,
            timeout_keep_alive=5,
        )
    )
    exit_code = EXIT_OK
    dead: list[EngineDeadError] = []

    def on_engine_dead(error: EngineDeadError) -> None:
        nonlocal exit_code
        dead.append(error)
        if envs.GLASSBOX_KEEP_ALIVE_ON_ENGINE_DEATH:
            logger.error(
                "The engine died; staying up (GLASSBOX_KEEP_ALIVE_ON_ENGINE_DEATH=1), /health answers 503"
            )
            return
        exit_code = EXIT_ENGINE_DEAD
        server.should_exit = True

    engine.on_engine_dead.append(on_engine_dead)
    watchdog = asyncio.create_task(_watch_engine(engine))
    # While serving, uvicorn's own handlers turn SIGINT/SIGTERM into a graceful stop; when
    # it returns it re-raises the signal it caught into the handlers it found. Those are
    # no-ops, so the shutdown below (engine tree, run directory) runs and we exit 0.
    signal.signal(signal.SIGTERM, _ignore_signal)
    signal.signal(signal.SIGINT, _ignore_signal)
    gc.collect()
    gc.freeze()
    logger.info("Glassbox API server ready on http://%s:%d (model %s)", args.host, port, served_name)
    try:
        await server.serve(sockets=[sock])
    finally:
        watchdog.cancel()
    if dead:
        # The root cause comes last, after uvicorn's shutdown lines.
        print(dead[0].root_cause, file=sys.stderr, flush=True)
    return exit_code


def _ignore_signal(signum: int, frame: object) -> None:
    logger.debug("signal %d after serving stopped: already shutting down", signum)


async def _watch_engine(engine) -> None:
    """Notice a dead engine within a second even when no request is running."""
    while True:
        await asyncio.sleep(0.5)
        if engine.errored:
            return
        try:
            await engine.check_health()
        except EngineDeadError as e:
            engine._engine_died(e)
            return
