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

With ``--api-server-count A > 1`` (default: the data-parallel size, as vLLM 0.33) this
process is ``APIServer_0``: after step 4 it starts ``APIServer_1 .. A-1``, which inherit the
listening socket from step 2 (the kernel spreads ``accept()`` among them), attach to the
same engine cores with their own sockets (``run_api_server_worker``) and say ready; then it
serves as one of them. Any of them dying brings the tree down with one root cause, printed
by APIServer_0; the others stop when APIServer_0 stops them (or dies: their lifeline).

Metrics: with several API servers, APIServer_0 turns on prometheus_client's multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR`` = ``<run dir>/prometheus``, set in its own environment right after
the run directory exists and before anything imports prometheus_client; the servers it spawns
inherit it), so ``/metrics`` sums every server's request metrics whichever server answers
(``engine/metrics/prometheus.py``). Every server logs the periodic stats line every
``GLASSBOX_LOG_STATS_INTERVAL`` seconds.

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
import os
import pickle
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from engine import envs
from engine.config import EngineConfig
from engine.distributed import topology
from engine.entrypoints.openai.api_server_messages import (
    APIServerReady,
    APIServerSpawnPayload,
    ServerArgs,
    decode_as,
    encode,
    ready_address,
)
from engine.logger import adopt_logger, init_logger, set_process_role
from engine.utils import processes
from engine.utils import run_dir as run_dirs
from engine.utils.processes import EngineDeadError

logger = init_logger(__name__)

# Exit codes of ``glassbox serve`` (listed in its --help). A bad setting, found by any
# process, exits 2 through the CLI (ConfigError).
EXIT_OK = 0  # stopped by SIGTERM, or by Ctrl-C once serving
EXIT_ENGINE_DEAD = 1  # the engine died (the root cause is printed last)
EXIT_INTERRUPTED = 130  # Ctrl-C during start-up (128 + SIGINT)


__all__ = ["ServerArgs", "bind_socket", "run_server", "run_api_server_worker", "PortInUseError"]


class StartupInterrupted(BaseException):
    """SIGINT / SIGTERM arrived during start-up (a ``BaseException``, like
    ``KeyboardInterrupt``, so no ``except Exception`` on the way swallows it)."""


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
        # Not KeyboardInterrupt: one raised inside an exec() of generated code (a dataclass
        # being built while a module imports) makes CPython exit by SIGINT (-2) at the end,
        # whatever we return (it flags it as unhandled); our own exception does not.
        raise StartupInterrupted(signum)

    signal.signal(signal.SIGTERM, on_signal_during_startup)
    signal.signal(signal.SIGINT, on_signal_during_startup)
    # Every process of the tree, named once. This process is APIServer_0: it owns the run
    # directory, launches the engine cores, then the other API servers.
    plan = topology.plan(config, frontend="serve", api_server_count=args.api_server_count)
    role = plan.api_servers[0]
    processes.set_process_title(role.name)
    set_process_role(role.name)
    engine = None
    recorder = None
    run_dir: Path | None = None
    loop = _new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        if sock is None:
            sock = bind_socket(args.host, args.port)
        host, port = sock.getsockname()[:2]
        run_dir = run_dirs.create_run_dir()
        manifest = run_dirs.plan_tree(plan)
        served_name = args.served_model_name or config.model_config.served_model_name
        run_dirs.write_manifest(run_dir, host=host, port=port, model=served_name, **manifest)
        logger.info("Bound http://%s:%d (run directory %s)", host, port, run_dir)
        from tracing.stacks import enable_stack_dumps

        enable_stack_dumps(run_dir, role.name)  # SIGUSR1: every thread's stack (glassbox doctor)
        several_servers = len(plan.api_servers) > 1
        if several_servers:
            _setup_multiprocess_metrics(run_dir)

        from tracing import setup_tracing

        obs = config.observability_config
        setup_tracing(role.name, trace_file=obs.trace_file, otlp_endpoint=obs.otlp_traces_endpoint,
                      status_file=str(run_dirs.status_file(run_dir, role)))  # fmt: skip
        from tracing.telemetry.collector import Recorder
        from tracing.telemetry.publisher import start_telemetry

        start_telemetry(run_dir, role.name)
        if obs.telemetry_record:
            recorder = Recorder().start(run_dir, obs.telemetry_record)

        from engine.frontend.async_llm import AsyncLLM

        engine = AsyncLLM(config, run_dir, client_index=0, num_clients=len(plan.api_servers))
        if len(plan.api_servers) > 1:
            _start_api_servers(engine, plan, config, args, sock, run_dir)
        return loop.run_until_complete(
            _serve(engine, config, args, sock, port, several_servers=several_servers)
        )
    except (KeyboardInterrupt, StartupInterrupted):
        # Ctrl-C exits 130 as a shell expects (128 + SIGINT); SIGTERM is a clean stop: 0.
        terminated = startup_signal[:1] == [signal.SIGTERM]
        logger.info("%s during start-up; stopping", "SIGTERM" if terminated else "Interrupted")
        return EXIT_OK if terminated else EXIT_INTERRUPTED
    except (EngineDeadError, processes.EngineStartupTimeout) as e:
        if isinstance(e, processes.EngineStartupTimeout):
            logger.error("%s", e)
        print(e.root_cause, file=sys.stderr, flush=True)
        return EXIT_ENGINE_DEAD
    finally:
        # Cleanup must finish even if a second signal arrives meanwhile.
        signal.signal(signal.SIGTERM, _ignore_signal)
        signal.signal(signal.SIGINT, _ignore_signal)
        if engine is not None:
            engine.shutdown()
        if recorder is not None:
            recorder.stop()  # after the tree stopped: its last events are in the file
        if sock is not None:
            sock.close()
        loop.close()
        if run_dir is not None:
            run_dirs.remove_run_dir(Path(run_dir))


def _setup_multiprocess_metrics(run_dir: Path) -> None:
    """Prometheus multiprocess mode for this server and the API servers it spawns (inherited)."""
    from engine.metrics.prometheus import setup_multiprocess_prometheus

    if "prometheus_client.values" in sys.modules:  # too late: values would stay per process
        logger.warning("prometheus_client was imported before multiprocess mode was set up; "
                       "/metrics will show only the answering API server's request metrics")  # fmt: skip
    path = setup_multiprocess_prometheus(run_dir)
    logger.debug("Prometheus multiprocess mode: %s", path)


def _new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.new_event_loop()


async def _serve(
    engine,
    config: EngineConfig,
    args: ServerArgs,
    sock: socket.socket,
    port: int,
    *,
    launcher: bool = True,
    on_serving: Callable[[], None] | None = None,
    several_servers: bool = False,
) -> int:
    """Serve ``engine``'s app on ``sock`` until told to stop; returns the exit code.

    ``launcher``: this is APIServer_0, which owns the tree: an engine death ends it with
    ``EXIT_ENGINE_DEAD`` and the root cause printed last. Another API server reports the
    death to its clients (503) and keeps going until APIServer_0 stops it, so only one
    process prints the root cause; it stops on SIGTERM alone (a terminal's Ctrl-C reaches
    the whole process group, and APIServer_0 decides). ``on_serving``: called once uvicorn
    accepts connections. ``several_servers``: one of several API servers (metrics in
    multiprocess mode; the stats line names this server).
    """
    import uvicorn

    from engine.entrypoints.openai.app import build_app

    served_name = args.served_model_name or config.model_config.served_model_name
    app = build_app(engine, served_model_name=served_name, api_key=args.api_key,
                    allowed_origins=args.allowed_origins, several_servers=several_servers)  # fmt: skip
    # uvicorn's own lines (start-up, access log) get the role prefix like ours: with
    # several API servers, each line says which one served.
    adopt_logger("uvicorn", args.uvicorn_log_level)
    server = (uvicorn.Server if launcher else _no_signal_server)(
        uvicorn.Config(
            app,
            log_config=None,
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
        if not launcher:
            logger.error("The engine died; /health answers 503 until %s stops this server",
                         topology.ProcessRole.api_server(0).name)  # fmt: skip
            return
        if envs.GLASSBOX_KEEP_ALIVE_ON_ENGINE_DEATH:
            logger.error(
                "The engine died; staying up (GLASSBOX_KEEP_ALIVE_ON_ENGINE_DEATH=1), /health answers 503"
            )
            return
        exit_code = EXIT_ENGINE_DEAD
        server.should_exit = True

    engine.on_engine_dead.append(on_engine_dead)
    from tracing.telemetry import events
    from tracing.telemetry.publisher import get_publisher

    publisher = get_publisher()
    if publisher is not None:
        in_flight = app.state.http_in_flight
        publisher.add_gauge_provider(
            lambda: {events.GAUGE_API_IN_FLIGHT: in_flight.value, **engine.telemetry_gauges()}
        )
    watchdog = asyncio.create_task(_watch_engine(engine))
    from engine.metrics.loggers import run_log_loop
    from engine.metrics.prometheus import mark_process_dead

    stats_log = asyncio.create_task(run_log_loop(app.state.stat_loggers, envs.GLASSBOX_LOG_STATS_INTERVAL))
    if launcher:
        # While serving, uvicorn's own handlers turn SIGINT/SIGTERM into a graceful stop;
        # when it returns it re-raises the signal it caught into the handlers it found.
        # Those are no-ops, so the shutdown below (engine tree, run directory) runs and we
        # exit 0.
        signal.signal(signal.SIGTERM, _ignore_signal)
        signal.signal(signal.SIGINT, _ignore_signal)
    else:

        def on_sigterm() -> None:
            nonlocal exit_code
            if processes._lifeline_fd is not None and not processes._lifeline_closed(processes._lifeline_fd):
                # Not APIServer_0 stopping us (it closes the lifeline first): say so.
                exit_code = processes.EXIT_TERMINATED_FROM_OUTSIDE
            server.should_exit = True

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
    announce = asyncio.create_task(_when_serving(server, on_serving)) if on_serving is not None else None
    gc.collect()
    gc.freeze()
    logger.info("Glassbox API server ready on http://%s:%d (model %s)", args.host, port, served_name)
    try:
        await server.serve(sockets=[sock])
    finally:
        watchdog.cancel()
        stats_log.cancel()
        mark_process_dead()
        if announce is not None:
            announce.cancel()
    if dead and launcher:
        # The root cause comes last, after uvicorn's shutdown lines.
        print(dead[0].root_cause, file=sys.stderr, flush=True)
    return exit_code


def _no_signal_server(config):
    """A uvicorn server without its SIGINT/SIGTERM handlers (vLLM: ``NoSignalServer``): the
    caller installs its own SIGTERM handler, and SIGINT stays ignored."""
    import contextlib

    import uvicorn

    class NoSignalServer(uvicorn.Server):
        def capture_signals(self):
            return contextlib.nullcontext()

    return NoSignalServer(config)


async def _when_serving(server, on_serving: Callable[[], None]) -> None:
    while not server.started:
        await asyncio.sleep(0.01)
    on_serving()


# ------------------------------------------------------------------ several API servers


def _start_api_servers(engine, plan, config: EngineConfig, args: ServerArgs, sock: socket.socket,
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
                    "engine.entrypoints.openai.api_server:run_api_server_worker",
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


def run_api_server_worker(payload_bytes: bytes, *, run_dir: Path, role: str) -> None:
    """Process target of APIServer_<i>, i > 0 (vLLM: ``run_api_server_worker_proc``).

    Attaches to the engine cores APIServer_0 launched, serves on the inherited listening
    socket, and tells APIServer_0 once it accepts connections. Exits 0 when stopped
    (SIGTERM, or its lifeline to APIServer_0 closing).
    """
    from tracing import catalogue, setup_tracing, stage
    from tracing.propagation import attached_trace_context

    payload: APIServerSpawnPayload = decode_as(APIServerSpawnPayload, payload_bytes)
    config: EngineConfig = payload.config
    obs = config.observability_config
    setup_tracing(role, trace_file=obs.trace_file, otlp_endpoint=obs.otlp_traces_endpoint,
                  status_file=str(run_dirs.status_file(run_dir, role)))  # fmt: skip
    from tracing.telemetry.publisher import start_telemetry

    start_telemetry(run_dir, role)
    processes.install_sigterm_exit(run_dir, role)  # during start-up; serving installs its own handler
    sock = socket.socket(fileno=payload.listen_fd)
    port = sock.getsockname()[1]
    loop = _new_event_loop()
    asyncio.set_event_loop(loop)
    engine = None

    def say_ready() -> None:
        import zmq

        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 2000)
        push.connect(payload.ready_address)
        push.send(encode(APIServerReady(client_index=payload.client_index, role=role, pid=os.getpid())))
        push.close()

    try:
        from engine.frontend.async_llm import AsyncLLM

        with attached_trace_context(payload.trace_headers), stage(catalogue.API_SERVER_ATTACH, role=role):
            engine = AsyncLLM(config, run_dir, client_index=payload.client_index,
                              num_clients=payload.num_clients, engines=payload.engines)  # fmt: skip
        code = loop.run_until_complete(
            _serve(
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
    except SystemExit as e:
        logger.debug("stopped during start-up")
        if e.code:  # a SIGTERM from outside the tree: the exit status says so
            raise
    finally:
        processes.ignore_sigterm()
        if engine is not None:
            engine.shutdown()
        sock.close()
        loop.close()


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
