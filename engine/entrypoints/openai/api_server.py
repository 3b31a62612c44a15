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

With ``--api-server-count A > 1`` (default: the data-parallel size, as vLLM 0.32) this
process is ``APIServer_0``: after step 4 it starts ``APIServer_1 .. A-1``
(``multi_api_server.py``), which inherit the listening socket from step 2 (the kernel spreads
``accept()`` among them), attach to the same engine cores with their own sockets
(``run_api_server_worker``) and say ready; then it serves as one of them. Any of them dying brings the tree down with one root cause, printed
by APIServer_0; the others stop when APIServer_0 stops them (or dies: their lifeline).

Metrics: with several API servers, APIServer_0 turns on prometheus_client's multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR`` = ``<run dir>/prometheus``, set in its own environment right after
the run directory exists and before anything imports prometheus_client; the servers it spawns
inherit it), so ``/metrics`` sums every server's request metrics whichever server answers
(``engine/metrics/prometheus.py``). Every server logs the periodic stats line every
``GLASSBOX_LOG_STATS_INTERVAL`` seconds.

Shutdown (vLLM's ``--shutdown-timeout``): SIGINT/SIGTERM → every child is told this server is
stopping (``processes.announce_stopping``), so a SIGTERM sent to the whole process group
(``kill -TERM -<pgid>``, pkill, ``docker stop``, systemd) takes this same path → the listening socket is closed
(new connections are refused) and idle connections are closed → requests in flight may
finish for up to ``--shutdown-timeout`` seconds (default 0, as vLLM) → those still running are
ended through the engine client (``AsyncLLM.abort_all``): a stream gets an SSE error event
(503) and ``data: [DONE]``, a plain request a 503 → the engine tree is stopped → the run
directory is removed → exit 0. If the engine dies, requests in flight end with an error, new
ones get 503, the root cause is printed last, and the server exits 1 — unless
``GLASSBOX_KEEP_ALIVE_ON_ENGINE_DEATH=1``.

Slow clients (``docs/security.md``): a connection must deliver a request's headers within
``--http-header-timeout`` seconds (of connecting, or of the request's first byte on a
keep-alive connection) and its body within ``--http-body-timeout`` seconds of the headers, or
it gets 408 and is closed; an idle keep-alive connection is closed after
``GLASSBOX_HTTP_TIMEOUT_KEEP_ALIVE`` seconds. At start the soft ``RLIMIT_NOFILE`` is raised to
the hard limit (vLLM's ``set_ulimit``); connections beyond what it leaves room for are
answered 503 and closed, with one rate-limited log line.

This process never imports torch.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from engine import envs
from engine.config import EngineConfig
from engine.distributed import topology
from engine.entrypoints.openai.api_server_messages import ServerArgs
from engine.logger import adopt_logger, init_logger, set_process_role
from engine.utils import processes
from engine.utils import run_dir as run_dirs
from engine.utils.process_harness import Observability, ProcessSpec, install_stop_signals, start_observability
from engine.utils.processes import EngineDeadError
from tracing.stage import startup_trace

logger = init_logger(__name__)

# Exit codes of ``glassbox serve`` (listed in its --help). A bad setting, found by any
# process, exits 2 through the CLI (ConfigError).
EXIT_OK = 0  # stopped by SIGTERM, or by Ctrl-C once serving
EXIT_ENGINE_DEAD = 1  # the engine died (the root cause is printed last)
EXIT_INTERRUPTED = 130  # Ctrl-C during start-up (128 + SIGINT)


__all__ = ["ServerArgs", "bind_socket", "run_server", "PortInUseError", "set_ulimit"]

# After --shutdown-timeout, how long the requests that were ended get to write their last
# event before their tasks are cancelled, in seconds.
SHUTDOWN_FINISH_S = 5.0
# File descriptors kept free for the process itself (engine sockets, pipes, files) beyond
# those open when serving starts; connections past the rest are refused with 503.
FD_RESERVE = 64
# At most one log line per this many seconds for each kind of refused or dropped connection.
LOG_EVERY_S = 10.0


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


def set_ulimit() -> tuple[int, int]:
    """Raise this process's soft ``RLIMIT_NOFILE`` (open files) to its hard limit, so idle
    connections cannot use up the default 1,024 (vLLM: ``set_ulimit``, called at API server
    start; the engine processes started afterwards inherit it).

    Returns:
        ``(soft, hard)`` after the change (unchanged where it was refused, with a warning).
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:
        logger.warning("Could not raise the open-files limit (RLIMIT_NOFILE) from %d to %d: %s; "
                       "raise it with `ulimit -n`", soft, target, e)  # fmt: skip
        return soft, hard
    logger.debug("Raised the open-files limit (RLIMIT_NOFILE) from %d to %d", soft, target)
    return target, hard


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
        processes.announce_stopping()  # a SIGTERM to the whole group is left to this stop
        # Not KeyboardInterrupt: one raised inside an exec() of generated code (a dataclass
        # being built while a module imports) makes CPython exit by SIGINT (-2) at the end,
        # whatever we return (it flags it as unhandled); our own exception does not.
        raise StartupInterrupted(signum)

    install_stop_signals(on_signal_during_startup)
    # Every process of the tree, named once. This process is APIServer_0: it owns the run
    # directory, launches the engine cores, then the other API servers.
    plan = topology.plan(config, frontend="serve", api_server_count=args.api_server_count)
    role = plan.api_servers[0]
    processes.set_process_title(role.name)
    set_process_role(role.name)
    engine = None
    recorder = None
    run_dir: Path | None = None
    failure: str | None = None  # why the tree ended, when it ended after a failure
    root_cause: str | None = None
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        if sock is None:
            sock = bind_socket(args.host, args.port)
        set_ulimit()
        host, port = sock.getsockname()[:2]
        run_dir = run_dirs.create_run_dir()
        manifest = run_dirs.plan_tree(plan)
        served_name = args.served_model_name or config.model_config.served_model_name
        run_dirs.write_manifest(run_dir, host=host, port=port, model=served_name, **manifest)
        logger.info("Bound http://%s:%d (run directory %s)", host, port, run_dir)
        several_servers = len(plan.api_servers) > 1
        if several_servers:  # before anything imports prometheus_client
            _setup_multiprocess_metrics(run_dir)
        obs = config.observability_config
        # Tracing (and this server's status file), SIGUSR1 stack dumps (glassbox doctor), telemetry.
        start_observability(ProcessSpec(role.name, run_dir, observability=Observability.of(obs)))
        from tracing.telemetry.collector import Recorder

        if obs.telemetry_record:
            recorder = Recorder().start(run_dir, obs.telemetry_record)

        from engine.frontend.async_llm import AsyncLLM

        # One start-up trace: cli.validate_config (held from before tracing was up), the
        # engines' handshake, the other API servers' start (glassbox trace --startup).
        with startup_trace():
            engine = AsyncLLM(config, run_dir, client_index=0, num_clients=len(plan.api_servers))
            if len(plan.api_servers) > 1:
                from engine.entrypoints.openai.multi_api_server import start_api_servers

                start_api_servers(engine, plan, config, args, sock, run_dir)
        serving = run_server_worker(engine, config, args, sock, port, several_servers=several_servers,
                         startup_signal=startup_signal)  # fmt: skip
        return loop.run_until_complete(serving)
    except (KeyboardInterrupt, StartupInterrupted):
        # Ctrl-C exits 130 as a shell expects (128 + SIGINT); SIGTERM is a clean stop: 0.
        terminated = startup_signal[:1] == [signal.SIGTERM]
        logger.info("%s during start-up; stopping", "SIGTERM" if terminated else "Interrupted")
        return EXIT_OK if terminated else EXIT_INTERRUPTED
    except (EngineDeadError, processes.EngineStartupTimeout) as e:
        if isinstance(e, processes.EngineStartupTimeout):
            logger.error("%s", e)
        print(e.root_cause, file=sys.stderr, flush=True)
        timeout = isinstance(e, processes.EngineStartupTimeout)
        failure, root_cause = "start-up timed out" if timeout else "the engine died", e.root_cause
        return EXIT_ENGINE_DEAD
    except BaseException as e:
        from engine.config import ConfigError

        # A bad setting is one line naming the flag (exit 2): nothing to keep for it.
        if isinstance(e, Exception) and not isinstance(e, ConfigError):
            failure = f"{role.name} failed: {type(e).__name__}: {e}"
        raise
    finally:
        # Cleanup must finish even if a second signal arrives meanwhile.
        install_stop_signals(_ignore_signal)
        if engine is not None:
            engine.shutdown()
        if recorder is not None:
            recorder.stop()  # after the tree stopped: its last events are in the file
        if sock is not None:
            sock.close()
        loop.close()
        if engine is not None and engine.dead_error is not None and failure is None:
            # Died while serving (run_server_worker printed the root cause), or stayed up after it
            # (GLASSBOX_KEEP_ALIVE_ON_ENGINE_DEATH) until stopped.
            failure, root_cause = "the engine died", engine.dead_error.root_cause
        if run_dir is not None:
            # After a failure, what a post-mortem needs outlives the run directory.
            run_dirs.close_run_dir(Path(run_dir), failure=failure, root_cause=root_cause,
                                   telemetry_record=config.observability_config.telemetry_record)  # fmt: skip


def _setup_multiprocess_metrics(run_dir: Path) -> None:
    """Prometheus multiprocess mode for this server and the API servers it spawns (inherited)."""
    from engine.metrics.prometheus import setup_multiprocess_prometheus

    if "prometheus_client.values" in sys.modules:  # too late: values would stay per process
        logger.warning("prometheus_client was imported before multiprocess mode was set up; "
                       "/metrics will show only the answering API server's request metrics")  # fmt: skip
    path = setup_multiprocess_prometheus(run_dir)
    logger.debug("Prometheus multiprocess mode: %s", path)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop (asyncio's own where uvloop is missing), for every API server."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.new_event_loop()


async def run_server_worker(
    engine,
    config: EngineConfig,
    args: ServerArgs,
    sock: socket.socket,
    port: int,
    *,
    launcher: bool = True,
    on_serving: Callable[[], None] | None = None,
    several_servers: bool = False,
    startup_signal: list[int] | None = None,
) -> int:
    """Serve ``engine``'s app on ``sock`` until told to stop; returns the exit code.

    vLLM: ``run_server_worker``, which every API server runs, the first and the others alike.

    ``launcher``: this is APIServer_0, which owns the tree: an engine death ends it with
    ``EXIT_ENGINE_DEAD`` and the root cause printed last. Another API server reports the
    death to its clients (503) and keeps going until APIServer_0 stops it, so only one
    process prints the root cause; it stops on SIGTERM alone (a terminal's Ctrl-C reaches
    the whole process group, and APIServer_0 decides). ``on_serving``: called once uvicorn
    accepts connections. ``several_servers``: one of several API servers (metrics in
    multiprocess mode; the stats line names this server). ``startup_signal``: the signals
    APIServer_0's start-up handler saw; one there means stop (raises ``StartupInterrupted``).
    """
    import uvicorn

    from engine.entrypoints.openai.app import build_app

    served_name = args.served_model_name or config.model_config.served_model_name
    app = build_app(engine, served_model_name=served_name, api_key=args.api_key,
                    allowed_origins=args.allowed_origins, several_servers=several_servers,
                    api_key_scope=args.api_key_scope, allowed_methods=args.allowed_methods,
                    allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
                    max_request_body_bytes=args.max_request_body_bytes,
                    enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                    responses_store_size=envs.GLASSBOX_RESPONSES_API_STORE_SIZE)  # fmt: skip
    # uvicorn's own lines (start-up, access log) get the role prefix like ours: with
    # several API servers, each line says which one served.
    adopt_logger("uvicorn", args.uvicorn_log_level)
    server = _make_server(
        uvicorn.Config(
            app,
            log_config=None,
            log_level=args.uvicorn_log_level,
            http=_guarded_http_protocol(args.http_header_timeout, args.http_body_timeout),
            timeout_keep_alive=envs.GLASSBOX_HTTP_TIMEOUT_KEEP_ALIVE,
        ),
        engine,
        args.shutdown_timeout,
        signals=launcher,
    )
    exit_code = EXIT_OK
    dead: list[EngineDeadError] = []
    if launcher:
        # While serving, uvicorn's own handlers turn SIGINT/SIGTERM into a graceful stop;
        # when it returns it re-raises the signal it caught into the handlers it found.
        # Until uvicorn installs its handlers, a signal is only recorded (no exception can
        # land in the middle of setting up the app); one recorded by then stops the server
        # before it serves. After uvicorn, the recording is a no-op: the shutdown below
        # (engine tree, run directory) runs and we exit 0.
        if startup_signal is None:
            startup_signal = []
        seen = startup_signal

        def record_signal(signum: int, frame: object) -> None:
            seen.append(signum)
            processes.announce_stopping()

        install_stop_signals(record_signal)
    else:

        def on_sigterm() -> None:
            nonlocal exit_code
            origin = processes.sigterm_origin()
            if origin in ("parent stopping", "undecided"):
                # The whole group got it while APIServer_0 stops: it stops this server in turn.
                return
            if origin == "outside":
                # Not APIServer_0 stopping us (it closes the lifeline first): say so.
                exit_code = processes.EXIT_TERMINATED_FROM_OUTSIDE
            server.should_exit = True

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, on_sigterm)
        # APIServer_0 announces that it stops (a SIGTERM to it or to the whole group, Ctrl-C):
        # this server drains its own requests meanwhile, under the same --shutdown-timeout.
        loop = asyncio.get_running_loop()
        processes.on_parent_stopping(lambda: loop.call_soon_threadsafe(setattr, server, "should_exit", True))

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
            # Staying up, there is no "last" to wait for: the root cause now, once.
            print(error.root_cause, file=sys.stderr, flush=True)
            return
        exit_code = EXIT_ENGINE_DEAD
        server.should_exit = True

    engine.on_engine_dead.append(on_engine_dead)
    from tracing.telemetry import events
    from tracing.telemetry.publisher import telemetry

    in_flight = app.state.http_in_flight
    telemetry().add_gauge_provider(
        lambda: {events.GAUGE_API_IN_FLIGHT: in_flight.value, **engine.telemetry_gauges()}
    )
    watchdog = asyncio.create_task(_watch_engine(engine))
    from engine.metrics.loggers import run_log_loop
    from engine.metrics.prometheus import mark_process_dead

    stats_log = asyncio.create_task(run_log_loop(app.state.stat_loggers, envs.GLASSBOX_LOG_STATS_INTERVAL))
    announce = asyncio.create_task(_when_serving(server, on_serving)) if on_serving is not None else None
    gc.collect()
    gc.freeze()
    try:
        if launcher and startup_signal:
            # A start-up signal whose exception was swallowed (it landed in a finalizer,
            # ``__del__`` or a weakref callback, where CPython prints "Exception ignored" and
            # goes on), or one since the handlers above: stop before serving.
            raise StartupInterrupted(startup_signal[0])
        logger.info("Glassbox API server ready on http://%s:%d (model %s)", args.host, port, served_name)
        await server.serve(sockets=[sock])
        if launcher and not dead and getattr(engine.engine_core, "watched", None):
            # The other API servers drain their requests as this one did (they were told at
            # its first signal); the engines stop once they have left.
            wait = 0.0 if server.force_exit else float(args.shutdown_timeout) + SHUTDOWN_FINISH_S + 2.0
            left = await asyncio.to_thread(engine.engine_core.wait_watched_exit, wait)
            if left:
                logger.warning(
                    "Shutting down: %s still running after the drain; stopping it", ", ".join(left)
                )
    finally:
        watchdog.cancel()
        stats_log.cancel()
        mark_process_dead()
        if announce is not None:
            announce.cancel()
    if dead and launcher and not envs.GLASSBOX_KEEP_ALIVE_ON_ENGINE_DEATH:
        # The root cause comes last, after uvicorn's shutdown lines.
        print(dead[0].root_cause, file=sys.stderr, flush=True)
    return exit_code


def _make_server(config, engine, shutdown_timeout: float, *, signals: bool):
    """The uvicorn server, with Glassbox's shutdown (``--shutdown-timeout``).

    ``signals``: install uvicorn's SIGINT/SIGTERM handlers (APIServer_0). Without them
    (vLLM: ``NoSignalServer``) the caller installs its own SIGTERM handler, and SIGINT stays
    ignored.

    Shutdown, once ``should_exit`` is set: stop accepting (the listening socket is closed
    here; with several API servers the others still accept until they are stopped), close
    idle connections, let the requests in flight run for up to ``shutdown_timeout`` seconds
    (skipped when the engine is dead, or on a second Ctrl-C), then end those still running
    through ``engine.abort_all`` — streams write an error event and ``[DONE]`` — and give
    them ``SHUTDOWN_FINISH_S`` to write it before their tasks are cancelled.
    """
    import contextlib

    import uvicorn

    from engine.entrypoints.openai.serving_engine import OpenAIError

    class GlassboxServer(uvicorn.Server):
        def capture_signals(self):
            return super().capture_signals() if signals else contextlib.nullcontext()

        def handle_exit(self, sig, frame) -> None:
            # Before anything else: the children that got the same SIGTERM (sent to the whole
            # process group) leave it to this shutdown, which drains and then stops them.
            processes.announce_stopping()
            super().handle_exit(sig, frame)

        async def _wait_for_tasks(self, timeout: float, *, until_forced: bool = True) -> None:
            """Until the requests in flight are done, ``timeout`` s pass, or (``until_forced``)
            a second Ctrl-C asks to skip the wait."""
            deadline = time.monotonic() + timeout
            while self.server_state.tasks and time.monotonic() < deadline:
                if until_forced and self.force_exit:
                    return
                await asyncio.sleep(0.05)

        async def shutdown(self, sockets=None) -> None:
            uv_logger = uvicorn.server.logger
            uv_logger.info("Shutting down")
            for server in self.servers:
                server.close()  # new connections are refused from here on
            for listening in sockets or []:
                listening.close()
            for connection in list(self.server_state.connections):
                connection.shutdown()  # idle: closed now; busy: closed after its response
            state = self.server_state
            grace = 0.0 if engine.errored else float(shutdown_timeout)
            started = time.monotonic()
            if state.tasks and grace > 0:
                logger.info("Shutting down: waiting up to %g s (--shutdown-timeout) for %d request(s) in flight",
                            grace, len(state.tasks))  # fmt: skip
                await self._wait_for_tasks(grace)
            if state.tasks:
                message = "The server is shutting down; the request was stopped before it finished."
                ended = engine.abort_all(OpenAIError(message, 503))
                if engine.errored:
                    # The engine's death already ended them with its error; they are writing it.
                    logger.warning("Shutting down: the engine died; %d request(s) in flight end with its error",
                                   len(state.tasks))  # fmt: skip
                else:
                    if self.force_exit and grace > 0:
                        why = f"a second interrupt after {time.monotonic() - started:.1f} s of the drain"
                    else:
                        why = f"--shutdown-timeout {grace:g} s"
                    logger.warning("Shutting down: ended %d request(s) still running (%s)", ended, why)
                # Even after a second Ctrl-C: the ended requests write their error event and
                # [DONE] (it takes milliseconds) before anything is cancelled.
                await self._wait_for_tasks(SHUTDOWN_FINISH_S, until_forced=False)
            if state.tasks:
                logger.warning(
                    "Shutting down: cancelling %d request task(s) that did not finish", len(state.tasks)
                )
                for task in list(state.tasks):
                    task.cancel(msg="the server is shutting down")
                await asyncio.wait(list(state.tasks), timeout=1.0)
            for connection in list(state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None:
                    transport.close()
            if not self.force_exit:
                await self.lifespan.shutdown()

    return GlassboxServer(config)


def _guarded_http_protocol(header_timeout: float, body_timeout: float):
    """uvicorn's httptools protocol with deadlines for slow clients and a connection cap.

    Per connection: the request's headers must be complete within ``header_timeout``
    seconds (of the connection being made, or of the first byte of a later request on a
    keep-alive connection), and its body within ``body_timeout`` seconds of the headers;
    otherwise the client gets 408 (when it sent part of a request) and the connection is
    closed. Connections beyond what the soft ``RLIMIT_NOFILE`` leaves room for (minus the
    descriptors open now and ``FD_RESERVE``) get 503 and are closed. Each kind logs at most
    one line per ``LOG_EVERY_S`` seconds, with how many since the last line. (uvicorn has
    only a keep-alive timeout; vLLM adds none of these.)
    """
    import resource

    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc (macOS)
        open_now = 64
    max_connections = (1 << 30) if soft == resource.RLIM_INFINITY else max(soft - open_now - FD_RESERVE, 16)
    refused = _RateLimitedLog(
        "Refused %d connection(s): %d open, the open-files limit (RLIMIT_NOFILE %d) leaves room for %d; "
        "raise it with `ulimit -n`",
    )
    header_late = _RateLimitedLog(
        "Closed %d connection(s) that sent no complete request headers within --http-header-timeout %g s"
    )
    body_late = _RateLimitedLog(
        "Closed %d connection(s) whose request body took over --http-body-timeout %g s"
    )

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._deadline: asyncio.TimerHandle | None = None
            self._partial = False  # bytes of a request arrived, its headers are not complete

        def _arm(self, seconds: float, callback: Callable[[], None]) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, callback)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                refused.log(len(self.connections), soft, max_connections)
                self._reply_and_close(503, "Too many open connections; try again later.")
                return
            self._arm(header_timeout, self._on_header_timeout)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _responding(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._partial = True
            # A later request on a keep-alive connection; one pipelined behind a response
            # still being written gets its deadline once that response is complete.
            if self._deadline is None and not self._responding():
                self._arm(header_timeout, self._on_header_timeout)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._partial and self._deadline is None and not self.transport.is_closing():
                self._arm(header_timeout, self._on_header_timeout)

        def on_headers_complete(self) -> None:
            self._disarm()
            self._partial = False
            super().on_headers_complete()
            if not self.pipeline:  # a queued pipelined request is read after the one before
                self._arm(body_timeout, self._on_body_timeout)

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def _on_header_timeout(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            header_late.log(header_timeout)
            if self._partial:
                self._reply_and_close(408, "The request headers took too long to arrive.")
            else:
                self.transport.close()

        def _on_body_timeout(self) -> None:
            self._deadline = None
            cycle = self.cycle
            if self.transport.is_closing() or cycle is None or not cycle.more_body:
                return
            body_late.log(body_timeout)
            # The app waiting for the body sees the client gone; its response is dropped.
            started = cycle.response_started
            cycle.disconnected = True
            cycle.message_event.set()
            if started:
                self.transport.close()
            else:
                self._reply_and_close(408, "The request body took too long to arrive.")

        def _reply_and_close(self, status: int, message: str) -> None:
            reason = {408: "Request Timeout", 503: "Service Unavailable"}[status]
            body = json.dumps({"error": {"message": message, "type": reason.replace(" ", ""), "param": None,
                                         "code": status}}).encode()  # fmt: skip
            head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")  # fmt: skip
            self.transport.write(head.encode() + body)
            self.transport.close()

    return GuardedHttpToolsProtocol


class _RateLimitedLog:
    """One WARNING line per ``LOG_EVERY_S`` seconds at most: ``fmt % (count, *args)``, where
    count is how many events happened since the last line (the first one logs at once)."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.count = 0
        self.last = -float("inf")

    def log(self, *args: object) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= LOG_EVERY_S:
            logger.warning(self.fmt, self.count, *args)
            self.count = 0
            self.last = now


async def _when_serving(server, on_serving: Callable[[], None]) -> None:
    while not server.started:
        await asyncio.sleep(0.01)
    on_serving()


def _ignore_signal(signum: int, frame: object) -> None:
    logger.debug("signal %d after serving stopped: already shutting down", signum)


async def _watch_engine(engine) -> None:
    """Notice a dead engine within a second even when no request is running: its last words
    at once (the output handler reads them), a process gone within half a second."""
    engine.start_output_handler()
    while True:
        await asyncio.sleep(0.5)
        if engine.errored:
            return
        try:
            await engine.check_health()
        except EngineDeadError as e:
            engine._engine_died(e)
            return
