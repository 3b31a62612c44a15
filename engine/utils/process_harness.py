"""The process harness: how every Glassbox process starts, runs and ends.

Every process of the tree starts here, whatever it does afterwards:

- a **spawned child** (engine core, worker, DP coordinator, ``APIServer_<i>``, i > 0) runs
  ``python -m engine.utils.process_entry ROLE`` (``spawn_process``), which calls ``main``: it reads the
  ``SpawnEnvelope`` from stdin, names the process (its title, and a ``(Role pid=N)`` prefix on
  every line it writes to stdout and stderr: ``engine.logger.decorate_logs``), ignores SIGINT
  (the parent decides when its children stop), starts the lifeline watcher and the liveness
  beat, judges a SIGTERM by who sent it, turns on stack dumps, and calls the target. The
  target decodes its own payload into a ``ProcessSpec`` and hands it to ``run_process``;
- a **Ray worker actor** (``RayWorkerWrapper``), whose process Ray starts and stops, calls
  ``start_observability`` from its constructor and ``report_crash`` when it fails;
- the tree's **owner** (``APIServer_0``, a headless node, an ``LLM`` in the user's process)
  creates the run directory itself, then calls ``start_observability``; its stop signals
  go through ``install_stop_signals``.

``start_observability`` is the one place that sets up a process's tracing (with its status
file) and starts its live telemetry (``tests/e2e/test_import_rules.py`` checks that no other module
calls them). ``run_process`` is the rest of a child's life::

    start_observability → SIGTERM judged by sender → target(ctx) ─┬─ returns        → exit 0
                                                                  ├─ SystemExit(n)  → exit n
                                                                  └─ exception      → crash report
                                                                     (once), last words, exit 1
    then the cleanups the target registered (ctx.at_exit), newest first, whatever happened

A SIGTERM sent to the whole process group while the parent stops (``PARENT_STOPPING`` on the
lifeline, ``engine/utils/processes.py``) raises nothing: the parent's shutdown stops this
process in turn.

vLLM: each process kind has its own entry (``EngineCoreProc.run_engine_core``,
``WorkerProc.worker_main``, ``run_api_server_worker_proc``), each with its own signal handler
and ``decorate_logs`` call; the harness is our own. It imports no torch: the target does.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tracing.setup import TracingHandle
    from tracing.telemetry.publisher import TelemetryPublisher

# Seconds a child gives itself to stop cleanly after its parent died.
PARENT_DEATH_GRACE_S = 3.0

PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class Observability:
    """What a process is watched with: ``ObservabilityConfig``'s per-process part.

    ``trace_file``: JSON-lines span file (``--trace-file``), or None. ``otlp_traces_endpoint``:
    ``--otlp-traces-endpoint`` (None: the OTEL_* variables decide). ``telemetry``: start live
    telemetry (``GLASSBOX_TELEMETRY=0`` still turns it off). ``in_memory``: keep finished
    spans in memory (tests).
    """

    trace_file: str | None = None
    otlp_traces_endpoint: str | None = None
    telemetry: bool = True
    in_memory: bool = False

    @classmethod
    def of(cls, config: Any, *, in_memory: bool = False) -> Observability:
        """From an ``ObservabilityConfig`` (or anything with ``trace_file`` and
        ``otlp_traces_endpoint``)."""
        return cls(config.trace_file, config.otlp_traces_endpoint, in_memory=in_memory)


@dataclass(frozen=True)
class ProcessSpec:
    """One process of the tree, as the harness runs it.

    Attributes:
        role: its role name from the topology plan (``ProcessRole.name``: ``EngineCore_DP0``).
        run_dir: the instance's run directory (status file, telemetry socket, crash report).
        rank: the worker rank or DP rank written into spans and the crash report, or None.
        observability: tracing and telemetry settings.
        target: the process body, ``target(ctx)`` (``run_process`` only).
        last_words: called with ``(ctx, exception)`` when an exception escapes ``target``,
            after its crash report is written and before the cleanups: what the process says
            as it dies (a log line, a message to its client). None: the traceback is printed
            (after the cleanups), as Python prints an uncaught exception's.
    """

    role: str
    run_dir: Path
    rank: int | None = None
    observability: Observability = Observability()
    target: Callable[[ProcessContext], None] | None = None
    last_words: Callable[[ProcessContext, BaseException], None] | None = None


@dataclass
class ProcessContext:
    """What ``run_process`` gives a target: its spec, its tracing handle and live telemetry
    publisher (None when telemetry is off), and the hooks of the process's end."""

    spec: ProcessSpec
    tracing: TracingHandle
    telemetry: TelemetryPublisher | None
    _cleanups: list[Callable[[], None]] = field(default_factory=list)
    _crash_reported: bool = False

    def at_exit(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` when the target is done, however it ended (newest first)."""
        self._cleanups.append(cleanup)

    def report_crash(self, exc: BaseException) -> None:
        """Write this process's crash report for ``exc`` (``report_crash``), once: later calls
        (the harness's own, when ``exc`` escapes the target) do nothing. Any thread."""
        if self._crash_reported:
            return
        self._crash_reported = True
        from tracing import current_stage

        report_crash(self.spec, exc, stage=current_stage())


_stack_dumps_for: tuple[str, str] | None = None


def _enable_stack_dumps(run_dir: Path, role: str) -> None:
    """SIGUSR1 → every thread's stack in ``<role>.stacks`` (``glassbox doctor``); once per
    (run directory, role): a child turns it on before its target runs."""
    global _stack_dumps_for
    key = (os.fspath(run_dir), role)
    if _stack_dumps_for == key:
        return
    from tracing.stacks import enable_stack_dumps

    if enable_stack_dumps(run_dir, role) is not None:
        _stack_dumps_for = key


def start_observability(spec: ProcessSpec) -> tuple[TracingHandle, TelemetryPublisher | None]:
    """Set up this process's tracing (its status file in the run directory, faults armed),
    its stack dumps and its live telemetry; returns ``(tracing handle, publisher or None)``.

    The one caller of ``tracing.setup_tracing`` and ``start_telemetry`` in ``engine/``. Called
    again (a second ``LLM`` in one process), it replaces the tracer provider; telemetry keeps
    its first publisher. Tracing and telemetry fail soft (a warning, no exception), except:

    Raises:
        OSError: the trace file cannot be opened.
    """
    from engine.utils import run_dir as run_dirs
    from tracing import setup_tracing
    from tracing.telemetry.publisher import start_telemetry

    obs = spec.observability
    handle = setup_tracing(
        spec.role,
        rank=spec.rank,
        trace_file=obs.trace_file,
        otlp_endpoint=obs.otlp_traces_endpoint,
        in_memory=obs.in_memory,
        status_file=str(run_dirs.status_file(spec.run_dir, spec.role)),
    )
    _enable_stack_dumps(spec.run_dir, spec.role)
    publisher = start_telemetry(spec.run_dir, spec.role) if obs.telemetry else None
    return handle, publisher


def report_crash(spec: ProcessSpec, exc: BaseException, *, stage: str | None = None) -> None:
    """Write ``<role>.crash.json`` for ``exc`` (``processes.write_crash_report``; never raises).

    An exception that carries a root-cause block (``EngineDeadError``) is an echo of the
    process the block names: the report says so (``caused_by``), so the blame rule never
    names this process; when the block names this process or no one, nothing is written.
    """
    from engine.utils import processes

    caused_by = None
    if getattr(exc, "root_cause", None) is not None:
        caused_by = getattr(exc, "culprit", None)
        if not caused_by or caused_by == spec.role:
            return
    processes.write_crash_report(spec.run_dir, spec.role, exc, stage, spec.rank, caused_by=caused_by)


def run_process(spec: ProcessSpec) -> int:
    """Run ``spec.target`` inside the harness (see the module docstring); returns the exit
    status: 0, the ``SystemExit`` code (``EXIT_TERMINATED_FROM_OUTSIDE`` for a SIGTERM from
    outside the tree), or 1 after an exception (its crash report written).

    Raises:
        SystemExit: one whose code is not a number (Python prints it and exits 1).
    """
    from engine.logger import init_logger
    from engine.utils import processes

    if spec.target is None:
        raise TypeError(f"run_process: the spec of {spec.role} has no target")
    logger = init_logger("engine.process")
    handle, publisher = start_observability(spec)
    processes.install_sigterm_exit(spec.run_dir, spec.role)
    ctx = ProcessContext(spec, handle, publisher)
    crashed: BaseException | None = None
    code = 0
    try:
        spec.target(ctx)
    except SystemExit as e:
        processes.ignore_sigterm()
        if e.code is not None and not isinstance(e.code, int):
            raise
        code = e.code or 0
        logger.debug("%s stopping (exit status %d)", spec.role, code)
    except BaseException as e:  # noqa: BLE001 - every death is reported, once
        processes.ignore_sigterm()
        code = 1
        ctx.report_crash(e)
        if spec.last_words is not None:
            spec.last_words(ctx, e)
        else:
            crashed = e
    finally:
        processes.ignore_sigterm()
        for cleanup in reversed(ctx._cleanups):
            cleanup()
    if crashed is not None:  # no last words: the traceback, as an uncaught exception's
        traceback.print_exception(type(crashed), crashed, crashed.__traceback__)
    if code == 0 and publisher is not None:
        # Its own last heartbeat says it stopped cleanly: engine-top shows it exited, not dead,
        # even when its parent's word of it is lost in the tree's stop.
        publisher.note_child_exit(spec.role, processes.describe_exit(0))
    return code


def install_stop_signals(handler: Callable[[int, Any], None] | signal.Handlers) -> None:
    """The tree owner's SIGTERM and SIGINT handler (both the same): ``handler(signum, frame)``,
    or ``signal.SIG_IGN`` once its shutdown runs. Main thread only."""
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


# --------------------------------------------------------------------- a spawned child


def continue_on_parent_death() -> None:
    """Ask the kernel to send this process SIGCONT when its parent dies (Linux ``prctl``).

    A process stopped by a signal (SIGSTOP, Ctrl-Z, a debugger) runs no thread, so its
    lifeline watcher cannot see the parent die and it would stay behind, stopped, with its
    own children alive under it. SIGCONT wakes it; the watcher then sees end-of-file and the
    process stops its children and exits. SIGCONT (not SIGKILL, the usual choice) because the
    kernel sends it when the parent *thread* that spawned this process ends, which is not
    always the parent's death: a SIGCONT to a running process does nothing. Elsewhere than
    Linux this does nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGCONT), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main() -> int | None:
    """A spawned child's life: read the envelope, name the process, watch the lifeline, beat,
    then run ``target(payload, run_dir=..., role=...)``; its return value is the exit status."""
    continue_on_parent_death()
    from engine.logger import decorate_logs, init_logger, set_process_role
    from engine.utils import processes, supervisor

    stdin_fd = sys.stdin.fileno()
    envelope = processes.read_payload(stdin_fd)
    role, run_dir = envelope.role, Path(envelope.run_dir)
    processes.set_process_title(role)
    set_process_role(role)
    # Every line this process writes, print() and warnings included, starts with its role.
    decorate_logs(role)
    logger = init_logger("engine.process")
    # The user's terminal Ctrl-C reaches the whole foreground group; the parent decides
    # when children stop (it closes their lifeline), so children ignore SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    parent_pid = os.getppid()

    def on_parent_death() -> None:
        if os.getppid() != parent_pid:
            logger.warning("parent process %d is gone; shutting down", parent_pid)
        else:
            logger.debug("the parent asked this process to stop")

        # Ask the main thread to stop (SIGTERM runs the target's shutdown path); if it
        # does not finish in time, leave anyway — taking this process's own children along,
        # so none outlives it (an engine core still waiting for a worker to stop).
        def leave() -> None:
            processes.kill_children()
            os._exit(1)

        threading.Timer(PARENT_DEATH_GRACE_S, leave).start()
        os.kill(os.getpid(), signal.SIGTERM)

    processes.watch_lifeline(stdin_fd, on_parent_death)
    # The status file's mtime, set each second: the parent's frozen check reads it
    # (GLASSBOX_HEARTBEAT_TIMEOUT_S). Its own thread, so telemetry being off changes nothing.
    from tracing import run_dir as run_dirs

    supervisor.start_liveness_beat(run_dirs.status_path(run_dir, role))
    # From here a SIGTERM is judged by who sent it (run_process installs the same again).
    processes.install_sigterm_exit(run_dir, role)
    # `glassbox doctor` asks for every thread's stack with SIGUSR1 (written to <role>.stacks).
    _enable_stack_dumps(run_dir, role)
    try:
        module_name, qualname = envelope.target.split(":")
        target = functools.reduce(getattr, qualname.split("."), importlib.import_module(module_name))
    except Exception as e:
        processes.write_crash_report(run_dir, role, e, stage=None)
        raise
    return target(envelope.payload, run_dir=run_dir, role=role)
