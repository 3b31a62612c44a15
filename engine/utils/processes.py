"""Starting, naming, stopping and reporting on Glassbox's processes.

Every child (engine core, worker) is started the same way, by ``spawn_process``:

- **spawn, not fork**: the child is a fresh interpreter, ``python -m
  engine.utils.process_entry`` (the process harness's ``main``), so it never inherits a forked torch state, and a user script
  without an ``if __name__ == "__main__":`` guard still works — the child never re-imports
  the user's ``__main__`` (multiprocessing's spawn would).
- **the payload and the lifeline are one pipe**: the parent writes a ``SpawnEnvelope``
  (msgspec: role, target, run directory, and the target's own encoded payload) to the
  child's stdin and keeps the pipe open. A watcher thread in the child then blocks on
  that pipe; end-of-file means the parent is gone — however it died, SIGKILL included,
  because the kernel closes a dead process's file descriptors. The child then stops its own
  children (each has its own lifeline to it) and exits within a few seconds. This is the
  "no orphan ever keeps running" rule. The one thing the parent writes on it after the
  envelope is ``PARENT_STOPPING``: "I am stopping; leave a SIGTERM to me"
  (``announce_stopping``), passed on down the tree. A child stopped by a signal cannot read its lifeline,
  so each child also asks the kernel for a SIGCONT when its parent dies
  (``PR_SET_PDEATHSIG``; ``process_harness.continue_on_parent_death``): woken, it sees the
  end-of-file like any other.
- **a name**: the title ``glassbox::<role>`` (setproctitle) and the log prefix
  ``(<role> pid=N)``.
- **a crash report**: an exception that escapes the child's target is written to
  ``<role>.crash.json`` in the run directory (role, rank, pid, stage, exception) before the
  child exits, so whoever notices the death can print one root-cause block.

Watching them — a death, a stop, a frozen heartbeat — is ``engine/utils/supervisor.py``'s;
the root-cause block it raises is ``format_root_cause`` here, which applies the one blame rule
(``tracing/blame.py``).

vLLM: ``vllm/v1/utils.py`` (process spawning), ``vllm/utils/system_utils.py``
(``set_process_title``, ``decorate_logs``); the lifeline pipe is our own (vLLM leaves
orphans when the API server is SIGKILLed).
"""

from __future__ import annotations

import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from tracing.telemetry.state import CLEAN_EXIT

_LEN = struct.Struct("<Q")


class SpawnEnvelope(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """What ``spawn_process`` writes to a child's stdin (length-prefixed msgpack).

    ``payload`` is the target's own spawn message, already encoded by the boundary module
    that owns it (``EngineCoreSpawnPayload``, ``WorkerSpawnPayload``,
    ``CoordinatorSpawnPayload``, ``APIServerSpawnPayload``).
    """

    role: str
    target: str  # "package.module:function"
    payload: bytes
    run_dir: str


class EngineDeadError(RuntimeError):
    """The engine (or one of its processes) died; ``root_cause`` says which and why.

    vLLM: ``vllm/v1/engine/exceptions.py`` ``EngineDeadError``.
    """

    def __init__(self, root_cause: str) -> None:
        self.root_cause = root_cause
        super().__init__("The engine died; see the root cause below.\n" + root_cause)

    @property
    def culprit(self) -> str | None:
        """The role the root-cause block names (its ``process:`` line), or None."""
        for line in self.root_cause.splitlines():
            if line.startswith("process:"):
                return line.split()[1] if len(line.split()) > 1 else None
        return None


class EngineStartupTimeout(TimeoutError):
    """The engine did not become ready in time; ``root_cause`` is the block naming the process
    that held start-up back (its role, pid, stage and state), printed last like any other
    start-up failure. A ``TimeoutError``, so a caller waiting with a deadline can catch it."""

    def __init__(self, message: str, root_cause: str) -> None:
        super().__init__(message)
        self.root_cause = root_cause


def set_process_title(role: str) -> None:
    """``glassbox::<role>`` in ps/top (vLLM: ``set_process_title``).

    Raises:
        ValueError: ``role`` is not a role name (``engine/distributed/topology.py``).
    """
    from engine.distributed.topology import ProcessRole

    title = ProcessRole.parse(role).title
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # pragma: no cover - setproctitle is a dependency
        pass


@dataclass(eq=False)
class ChildProcess:
    """A child started by ``spawn_process``.

    ``lifeline`` is the parent's end of the child's stdin: closing it tells the child to
    exit (and happens by itself when the parent dies).
    """

    role: str
    popen: subprocess.Popen
    lifeline: Any
    run_dir: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        """The exit status (negative: killed by that signal), or None while running."""
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def announce_stopping(self) -> None:
        """Tell the child this process is stopping (``PARENT_STOPPING`` on its lifeline): a
        SIGTERM it gets from now on is left to this process's shutdown. Never raises, never
        blocks (a raw write of one byte; safe inside a signal handler)."""
        try:
            os.write(self.lifeline.fileno(), PARENT_STOPPING)
        except (OSError, ValueError):  # closed: it is being stopped already, or gone
            pass

    def request_stop(self) -> None:
        """Ask the child to exit (close the lifeline, SIGTERM) without waiting for it."""
        try:
            self.lifeline.close()
        except OSError:
            pass
        if self.popen.poll() is None:
            try:
                self.popen.send_signal(signal.SIGTERM)
                # A stopped (SIGSTOP) child acts on nothing until continued: wake it, so it
                # stops its own children in order instead of being SIGKILLed around them.
                self.popen.send_signal(signal.SIGCONT)
            except OSError:  # already gone
                pass

    def stop(self, timeout: float = 4.0) -> int | None:
        """Ask the child to exit (``request_stop``), SIGKILL it after ``timeout``."""
        self.request_stop()
        if self.popen.poll() is None:
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(2.0)
            except ProcessLookupError:
                pass
        return self.popen.poll()


# What every child gets for OpenMP's wait policy unless the user chose one (or set
# GLASSBOX_CPU_OMP_THREADS_BIND=nobind). With adaptive threads (GLASSBOX_CPU_ADAPTIVE_THREADS,
# the default) a thread that waits for its team spins briefly, then sleeps: fast between the
# back-to-back parallel regions of a step, and a worker whose CPUs another process takes runs
# with fewer threads instead of spinning against it (engine/worker/cpu/cpu_thread_governor.py).
# Without them, it sleeps at once (PASSIVE), so a taken core does not stall the whole team.
# docs/performance.md, "One core taken" and "Threads that follow the load". libgomp — torch's
# OpenMP on Linux — reads these when it is loaded, i.e. when the child imports torch: they
# can only be set at spawn.
OPENMP_WAIT_ADAPTIVE = {"GOMP_SPINCOUNT": "10000"}
OPENMP_WAIT_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
# Any of these set by the user means the user chose: Glassbox then adds none of the above.
OPENMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def openmp_wait_env(environ: dict[str, str]) -> dict[str, str]:
    """The OpenMP wait variables to add to a child's environment ``environ``:
    ``OPENMP_WAIT_ADAPTIVE`` under ``GLASSBOX_CPU_ADAPTIVE_THREADS`` (the default), else
    ``OPENMP_WAIT_DEFAULTS``; nothing when ``environ`` already sets one of
    ``OPENMP_WAIT_VARS`` or ``GLASSBOX_CPU_OMP_THREADS_BIND`` is ``nobind``. Glassbox's own
    defaults, chosen by measurement (``benchmarks/cpu_contention.py``); libgomp's own spins
    300,000 times before it sleeps."""
    from engine.envs import _bool

    if any(environ.get(name) for name in OPENMP_WAIT_VARS):
        return {}
    if environ.get("GLASSBOX_CPU_OMP_THREADS_BIND", "").strip().lower() == "nobind":
        return {}
    try:
        adaptive = _bool(environ.get("GLASSBOX_CPU_ADAPTIVE_THREADS", "1"))
    except ValueError:  # refused in the first process before any spawn; be safe anyway
        adaptive = False
    return dict(OPENMP_WAIT_ADAPTIVE if adaptive else OPENMP_WAIT_DEFAULTS)


def use_openmp_wait_here() -> dict[str, str]:
    """Give this process the OpenMP wait variables a child would get (``openmp_wait_env``) —
    for an engine in the caller's process (``InprocClient``) — if torch is not loaded yet
    (libgomp reads them once, when torch loads it). Returns what it set (empty: nothing, the
    user chose or torch was loaded). Measured in-process on a busy 2-core machine: libgomp's
    own spin (300,000 rounds) made every matmul wait on a starved thread."""
    import sys

    if "torch" in sys.modules:
        return {}
    wait = openmp_wait_env(dict(os.environ))
    os.environ.update(wait)
    return wait


def spawn_process(
    role: str,
    target: str,
    payload: bytes,
    run_dir: Path,
    env: dict[str, str] | None = None,
    pass_fds: tuple[int, ...] = (),
) -> ChildProcess:
    """Start ``target`` ("package.module:function") in a fresh interpreter titled ``glassbox::<role>``.

    ``target(payload, run_dir=..., role=...)`` runs in the child after its title, log prefix
    and lifeline watcher are in place. ``payload`` is the target's encoded spawn message.
    ``pass_fds``: file descriptors the child inherits under the same numbers (the API
    servers' shared listening socket).

    Raises:
        TypeError: ``payload`` is not bytes.
    """
    if not isinstance(payload, bytes):
        raise TypeError(f"spawn payload for {role} must be encoded bytes, not {type(payload).__name__}")
    child_env = dict(os.environ)
    # The child must import this same `engine`, wherever the parent found it.
    root = str(Path(__file__).resolve().parents[2])
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, child_env.get("PYTHONPATH", "")) if p)
    child_env.update(env or {})
    child_env.update(openmp_wait_env(child_env))
    from tracing import catalogue, stage
    from tracing.propagation import inject_trace_headers

    # The spawning span also in the environment (TRACEPARENT / TRACESTATE, as OpenTelemetry's
    # environment-variable carriers name them), for anything in the child that reads it; our
    # own code takes it from the spawn payload.
    for name, value in inject_trace_headers().items():
        child_env[name.upper()] = value

    with stage(catalogue.PROCESS_SPAWN, **{catalogue.ATTR_ROLE: role}) as st:
        popen = subprocess.Popen(
            [sys.executable, "-m", "engine.utils.process_entry", role],
            stdin=subprocess.PIPE,
            env=child_env,
            close_fds=True,
            pass_fds=pass_fds,
        )
        assert popen.stdin is not None
        st.set(catalogue.ATTR_PID, popen.pid)
        data = msgspec.msgpack.encode(SpawnEnvelope(role, target, payload, str(run_dir)))
        popen.stdin.write(_LEN.pack(len(data)) + data)
        popen.stdin.flush()
    child = ChildProcess(role=role, popen=popen, lifeline=popen.stdin, run_dir=run_dir)
    _children.add(child)
    if _stopping.is_set():  # spawned while this process stops: it knows from the start
        child.announce_stopping()
    return child


# --------------------------------------------------------------------- child side


def crash_file(run_dir: Path, role: str) -> Path:
    """Where process ``role`` writes its crash report (``tracing.run_dir.crash_path``)."""
    from tracing import run_dir as run_dirs

    return run_dirs.crash_path(run_dir, role)


def write_crash_report(
    run_dir: Path,
    role: str,
    exc: BaseException,
    stage: str | None,
    rank: int | None = None,
    caused_by: str | None = None,
) -> None:
    """Record why this process is about to die: a ``tracing.run_dir.CrashReport`` (best effort,
    never raises: the run dir may be gone).

    The stage recorded is the innermost one ``exc`` escaped (``tracing.stage.raised_in``),
    else ``stage`` (the caller's: the one still open, or the RPC it ran). ``caused_by``: the
    role whose failure this death follows (the report is then an echo, ``tracing.blame``).
    """
    from tracing import run_dir as run_dirs
    from tracing.stage import raised_in

    report = run_dirs.CrashReport(
        role=str(role),
        rank=rank,
        pid=os.getpid(),
        stage=raised_in(exc) or stage,
        caused_by=caused_by,
        exception=f"{type(exc).__name__}: {exc}",
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        time=time.time(),
    )
    try:
        run_dirs.write_crash_report(run_dir, report)
    except OSError:
        pass


def flight_file(run_dir: Path, role: str) -> Path:
    """Where an engine core's flight recorder lands when it dies: ``<role>.flight.json``."""
    return Path(run_dir) / f"{role}.flight.json"


def write_flight_record(run_dir: Path, role: str, steps: list[dict[str, Any]]) -> None:
    """The engine core's last step records (oldest first), written as it dies (best effort:
    the run directory may be gone). Each is a ``StepRecord``'s fields (tokens, budget, KV
    usage, phase times)."""
    import json

    try:
        flight_file(run_dir, role).write_text(json.dumps({"role": role, "pid": os.getpid(), "steps": steps}))
    except OSError:
        pass


def _last_flight_step(run_dir: Path, role: str) -> dict[str, Any] | None:
    import json

    try:
        steps = json.loads(flight_file(run_dir, role).read_text()).get("steps") or []
    except (OSError, ValueError, AttributeError):
        return None
    return steps[-1] if steps and isinstance(steps[-1], dict) else None


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name} (exit status {returncode})"
    if returncode == EXIT_TERMINATED_FROM_OUTSIDE:
        return f"terminated by SIGTERM from outside the tree (exit status {returncode})"
    if returncode == 0:
        return CLEAN_EXIT  # "exited with code 0": engine-top's word for a clean stop
    return f"exited with code {returncode}"


def _blamed(
    run_dir: Path,
    role: str,
    pid: int | None,
    returncode: int | None,
    state: str | None,
    exits: dict[str, int] | None = None,
) -> tuple | None:
    """The blame rule's culprit of ``run_dir``'s tree as (``tracing.blame.Blame``, its
    ``Seen``), told what the caller knows of ``role`` (its exit status, or ``state``:
    "stopped …" or "frozen …") and the exit statuses ``exits`` (role → status) it read of its
    other children; None when the rule names no one."""
    from tracing import blame

    known = {r: blame.Seen(r, returncode=code) for r, code in (exits or {}).items()}
    told = known[role] = blame.Seen(role, pid=pid, returncode=returncode)
    if state is not None:
        told.stopped, told.frozen = (state, None) if state.startswith("stopped") else (None, state)
    seen = blame.observe(run_dir, known)
    culprit = blame.find_culprit(seen, time.time())
    if culprit is None:
        return None
    return culprit, next(s for s in seen if s.role == culprit.role)


def _exit_of(other) -> tuple[int | None, str | None]:
    """(exit status, exit line's text) of ``other`` (a ``tracing.blame.Seen``), a culprit that
    is not the caller's process."""
    if other.returncode is not None:
        return other.returncode, None
    if not other.alive:
        return None, "gone (its exit status is its parent's to read)"
    trouble = other.stopped or other.frozen
    return None, "still running" + (f" ({trouble})" if trouble else "")


def _no_exception(returncode: int | None, exit_detail: str | None) -> str:
    """The exception line of a process that wrote no crash report."""
    if returncode is None and (not exit_detail or exit_detail.startswith("still")):
        return "none (it was still alive)"
    return "none recorded (killed from outside, or died before reporting)"


def format_root_cause(
    run_dir: Path,
    role: str,
    pid: int | None,
    returncode: int | None,
    rank: int | None = None,
    note: str = "",
    state: str | None = None,
    exit_detail: str | None = None,
    exits: dict[str, int] | None = None,
) -> str:
    """One block naming the process that died first: role, rank, pid, stage, exit, exception.

    The caller names the process it noticed (``role``: its exit status, or ``state``); the
    blame rule (``tracing.blame``) may name another, and ``exits`` (role → exit status: what
    the caller read of its other children, ``engine/utils/supervisor.py``) lets it tell a
    peer killed first from the survivors whose collectives then failed. Read from the run
    directory: the process's crash report and its status file (both ``tracing.run_dir``
    records), either of which may be missing. ``exit_detail`` replaces the exit line's text
    where the exit status is not ours to read (a Ray actor's process is the raylet's child:
    Ray reports its death, ``engine/executor/ray_executor.py``).
    """
    from tracing import blame
    from tracing import run_dir as run_dirs

    role, reason = str(role), ""
    if exit_detail is None:
        # The one blame rule (tracing/blame.py, as doctor and engine-top): the caller names the
        # process it noticed; the first failure, or the rank a collective waits for, wins.
        culprit = _blamed(run_dir, role, pid, returncode, state, exits)
        if culprit is not None:
            found, other = culprit
            if found.role != role:
                role, pid, rank, state = found.role, found.pid, None, None
                returncode, exit_detail = _exit_of(other)
            if found.victims:  # a peer waits for it: say who, in which collective
                reason = found.reason
    crash = run_dirs.read_crash_report(run_dir, role)
    if (
        crash is not None
        and crash.caused_by is None
        and crash.exception
        and returncode is None
        and exit_detail in (None, "still running")  # the caller's process, or a peer the rule named
    ):
        # It failed and wrote why, then was still exiting when this was written: not "running".
        gone = not run_dirs.pid_alive(pid if pid is not None else crash.pid)
        exit_detail = "failed (it wrote its crash report" + (
            " and is gone)" if gone else "; it was still exiting)"
        )
    status = run_dirs.read_status(run_dirs.status_path(run_dir, role)) or run_dirs.ProcessStatus()
    stage = (crash.stage if crash is not None else None) or status.stage
    comm = run_dirs.read_comm(run_dir, role)
    if not stage and comm is not None and comm.rpc in blame.STEP_RPCS:  # a worker inside a step RPC
        stage = f"worker.{comm.rpc} (step {comm.step})"
    if not stage:
        # Step stages are not written to the status file (too frequent), so a process
        # between lifecycle stages was serving, or idle.
        last = status.last_finished
        if last is not None and last.error:
            stage = f"{last.name} (failed: {last.error})"
        elif last is not None and last.name:
            stage = f"none (serving or idle; last lifecycle stage finished: {last.name})"
    if rank is None:
        rank = crash.rank if crash is not None and crash.rank is not None else status.rank
    if pid is None and crash is not None:
        pid = crash.pid
    exception = crash.exception if crash is not None else None
    exit_text = exit_detail or describe_exit(returncode) + (
        f" ({state})" if returncode is None and state else ""
    )
    lines = [
        "=" * 24 + " Glassbox root cause " + "=" * 24,
        f"process:   {role}" + (f" (rank {rank})" if rank is not None else ""),
        f"pid:       {pid if pid is not None else '?'}",
        f"stage:     {stage or 'unknown'}",
        f"exit:      {exit_text}",
        f"exception: {exception or _no_exception(returncode, exit_detail)}",
    ]
    for fault in status.faults:  # asked for, not found: say so (--inject-fault)
        lines.append(
            f"fault:     injected {fault.spec} struck in {fault.stage} (--inject-fault / GLASSBOX_FAULT)"
        )
    if reason:
        lines.append(f"why:       {reason}")
    if note:
        lines.append(f"note:      {note}")
    last = _last_flight_step(run_dir, role)
    if last is not None:
        lines.append(
            f"last step: #{last.get('step_id')}: {last.get('num_decode_tokens')} decode + "
            f"{last.get('num_prefill_tokens')} prefill tokens of {last.get('token_budget')}, "
            f"{last.get('num_running')} running, {last.get('num_waiting')} waiting, KV {last.get('kv_usage', 0):.0%} "
            f"({time.time() - last.get('started_at', time.time()):.1f} s before this report)"
        )
    lines.append("=" * 69)
    return "\n".join(lines)


class TerminatedFromOutside(Exception):
    """What a child's crash report says when a SIGTERM it got was not its parent's."""


# Exit status of a child stopped by a SIGTERM its parent did not send (128 + SIGTERM).
EXIT_TERMINATED_FROM_OUTSIDE = 128 + signal.SIGTERM
# The byte a parent writes on a child's lifeline when it starts stopping (``announce_stopping``).
PARENT_STOPPING = b"S"
# How long a child that got a SIGTERM with its lifeline open waits for its parent to say it is
# stopping (or to close the lifeline) before it takes the SIGTERM as one from outside the tree.
# A SIGTERM to the whole process group reaches parent and child at once; the parent's handler
# needs a moment (on a loaded machine, more) to announce.
STOP_ANNOUNCE_WAIT_S = 5.0
_lifeline_fd: int | None = None
_lifeline_eof = threading.Event()  # the watcher read end-of-file: the parent asked us to stop, or died
_parent_stopping = threading.Event()  # the parent said PARENT_STOPPING
_stopping = threading.Event()  # this process announced that it stops (to its children)
_from_outside = threading.Event()  # a SIGTERM was judged to come from outside the tree
_deciding = threading.Lock()
_children: weakref.WeakSet[ChildProcess] = weakref.WeakSet()


def announce_stopping() -> None:
    """Tell every live child this process spawned that it is stopping (``PARENT_STOPPING`` on
    each lifeline, once); children spawned later are told at spawn. Called by the root (the
    API server) when a SIGTERM or Ctrl-C starts its shutdown, and by a child whose parent
    announced, so the whole tree leaves a SIGTERM to the root's drain: ``kill -TERM -<pgid>``
    (pkill, ``docker stop`` of a shell entrypoint, systemd's KillMode=control-group) stops the
    tree as a SIGTERM to the root alone does. Safe inside a signal handler; never raises.

    vLLM: the engine core and workers ignore SIGTERM/SIGINT while the frontend drives shutdown.
    """
    if _stopping.is_set():
        return
    _stopping.set()
    for child in list(_children):
        child.announce_stopping()


_on_parent_stopping: list[Callable[[], None]] = []


def on_parent_stopping(callback: Callable[[], None]) -> None:
    """Call ``callback`` (from the lifeline watcher's thread) once the parent announces that it
    is stopping; at once if it did already. Another API server uses it to start draining its
    own requests while APIServer_0 drains its own, so one ``--shutdown-timeout`` covers all."""
    _on_parent_stopping.append(callback)
    if _parent_stopping.is_set():
        callback()


def kill_children() -> None:
    """SIGKILL every live child this process spawned: the last thing a process does before it
    leaves abruptly (``os._exit``), so no child outlives it. Never raises."""
    for child in list(_children):
        try:
            if child.popen.poll() is None:
                child.popen.kill()
        except OSError:
            pass


def is_stopping() -> bool:
    """Whether this process announced that it stops (``announce_stopping``)."""
    return _stopping.is_set()


def parent_is_stopping() -> bool:
    """Whether this process's parent announced that it is stopping (``announce_stopping``)."""
    return _parent_stopping.is_set()


def sigterm_origin() -> str:
    """Who a SIGTERM this process just got is from, as far as it can tell now:

    - ``"parent"``: the parent asked this process to stop (it closes the lifeline first), or
      died, or there is no lifeline (not a spawned child): stop cleanly.
    - ``"parent stopping"``: the parent announced it is stopping; the SIGTERM came to the
      whole group. Leave it to the parent's shutdown, which stops this process in turn (and
      the lifeline still ends it if the parent dies).
    - ``"outside"``: a SIGTERM the parent did not send while it keeps running (``kill <pid>``):
      a death, with blame.
    - ``"undecided"``: the lifeline is open and the parent has not announced. A thread now
      waits up to ``STOP_ANNOUNCE_WAIT_S`` for the announcement; if none comes (and the
      lifeline stays open), it judges the SIGTERM from outside and sends SIGTERM to the main
      thread again, whose handler then sees ``"outside"``. Carry on meanwhile.
    """
    if _lifeline_fd is None or _lifeline_eof.is_set():
        return "parent"
    if _from_outside.is_set():
        return "outside"
    if _parent_stopping.is_set():
        return "parent stopping"
    pending = _lifeline_pending(_lifeline_fd)
    if pending is None:
        return "parent"  # end-of-file the watcher has not read yet
    if pending:
        return "parent stopping"  # the announcement, not read yet (nothing else comes after the envelope)
    if _deciding.acquire(blocking=False):
        threading.Thread(target=_decide_sigterm, name="sigterm_origin", daemon=True).start()
    return "undecided"


def _decide_sigterm() -> None:
    deadline = time.monotonic() + STOP_ANNOUNCE_WAIT_S
    try:
        while time.monotonic() < deadline:
            if _parent_stopping.wait(0.05) or _lifeline_eof.is_set():
                return  # left to the parent (announced), or the watcher stops us (EOF)
        _from_outside.set()
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    finally:
        _deciding.release()


def _lifeline_pending(fd: int) -> int | None:
    """Bytes waiting on the lifeline (0: none), or None at end-of-file; consumes nothing."""
    import fcntl
    import select
    import termios

    try:
        if not select.select([fd], [], [], 0)[0]:
            return 0
        buf = bytearray(4)
        fcntl.ioctl(fd, termios.FIONREAD, buf)
        n = int.from_bytes(buf, sys.byteorder)
    except (OSError, ValueError):
        return None
    return n or None


def install_sigterm_exit(run_dir: Path | None = None, role: str | None = None) -> None:
    """Turn a SIGTERM into ``SystemExit`` in the main thread, by who sent it
    (``sigterm_origin``); once it raises, later SIGTERMs are ignored (the lifeline watcher
    and the parent may both send one), so shutdown runs once.

    A SIGTERM the parent asked for (it closes the lifeline first) is a clean stop:
    ``SystemExit(0)``. One that reached the whole process group while the parent stops
    (it announced) is left to the parent's shutdown: nothing is raised. One from outside the
    tree (``kill <pid>`` while the parent keeps running, judged within
    ``STOP_ANNOUNCE_WAIT_S``) is not a clean stop: a crash report says so, and the exit
    status is ``EXIT_TERMINATED_FROM_OUTSIDE`` (143), so the parent's root cause names the
    signal.
    """

    def handler(signum: int, frame: Any) -> None:
        origin = sigterm_origin()
        if origin in ("parent stopping", "undecided"):
            return
        ignore_sigterm()
        if origin == "parent":
            raise SystemExit(0)
        if run_dir is not None and role is not None:
            error = TerminatedFromOutside("SIGTERM from outside the tree (its parent did not ask it to stop)")
            write_crash_report(run_dir, role, error, None)
        raise SystemExit(EXIT_TERMINATED_FROM_OUTSIDE)

    signal.signal(signal.SIGTERM, handler)


def ignore_sigterm() -> None:
    """Call at the start of a shutdown path: a SIGTERM arriving now (the parent stopping us
    while we already exit) must not raise into cleanup code."""
    for _ in range(2):
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            return
        except OSError:
            # "Signal 15 ignored due to race condition": a second SIGTERM (the parent's, after
            # the lifeline watcher's own) was pending while SIGTERM was ignored already; it is
            # consumed now (the check runs before the change), so set it again.
            continue


def watch_lifeline(fd: int, on_parent_death: Callable[[], None]) -> threading.Thread:
    """Start a daemon thread that calls ``on_parent_death`` when pipe ``fd`` reaches EOF, and
    notes (and passes on to this process's children) the parent's ``PARENT_STOPPING``.

    Reads the raw fd (not ``sys.stdin``), so the blocked thread holds no interpreter lock
    that would stall this process's own exit.
    """

    global _lifeline_fd

    def run() -> None:
        try:
            while data := os.read(fd, 65536):
                if PARENT_STOPPING in data and not _parent_stopping.is_set():
                    _parent_stopping.set()
                    announce_stopping()  # down the tree: our children leave it to us, as we to ours
                    for callback in list(_on_parent_stopping):
                        try:
                            callback()
                        except Exception:  # one bad callback must not stop the watcher
                            logging.getLogger(__name__).exception("on_parent_stopping callback failed")
        except OSError:
            pass
        _lifeline_eof.set()
        on_parent_death()

    _lifeline_fd = fd
    thread = threading.Thread(target=run, name="lifeline_watcher", daemon=True)
    thread.start()
    return thread


def _read_exact(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            raise SystemExit(
                "glassbox: the payload pipe closed early (this module is started by spawn_process)"
            )
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_payload(fd: int) -> SpawnEnvelope:
    """The ``SpawnEnvelope``, read from the lifeline pipe ``fd`` (the child's stdin).

    Raises:
        SystemExit: the pipe closed before the whole envelope came, or it does not decode.
    """
    (n,) = _LEN.unpack(_read_exact(fd, _LEN.size))
    try:
        return msgspec.msgpack.decode(_read_exact(fd, n), type=SpawnEnvelope)
    except msgspec.DecodeError as e:
        raise SystemExit(f"glassbox: malformed spawn envelope on stdin: {e}") from None
