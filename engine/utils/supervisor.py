"""The supervisor: who of a process's children died, is stopped or frozen, and whom to blame.

Every parent in the tree (the API server's client for its engine cores, coordinator and
other API servers; an engine core's executor for its workers) hands its children to one
``Supervisor``. Its thread **waits** on each child's pidfd (``os.pidfd_open``: readable the
moment the process exits — the pid-file-descriptor form of ``multiprocessing.Process.sentinel``,
which a ``subprocess.Popen`` lacks) with ``multiprocessing.connection.wait``, so a death is
seen at once, never by polling. The wait's timeout is there only for the deadlines a process
that is alive can miss: stopped by a signal (``GLASSBOX_STOPPED_TIMEOUT_S``) or frozen, its
heartbeat gone (``GLASSBOX_HEARTBEAT_TIMEOUT_S``), looked at every ``STATE_CHECK_S``.

One rule turns any of them — a death, a stop, a freeze, or a deadline its owner saw missed
(``Supervisor.fail``) — into one ``EngineDeadError`` whose root cause names the culprit:
``processes.format_root_cause``, i.e. the blame rule of ``tracing/blame.py`` (the one
``glassbox doctor`` and engine-top apply), told every exit status this parent read. The first
failure wins and is handed to the owner through its ``on_failure`` callback (from the
supervisor's thread); later ones return that same error.

Here too: the heartbeat every child beats (``start_liveness_beat``), the watch that reads it
(``StoppedWatch``), and the start-up laggard (``find_laggard``, ``describe_laggard``).

vLLM: ``MultiprocExecutor.start_worker_monitor`` (``vllm/v1/executor/multiproc_executor.py``:
a thread waiting with ``multiprocessing.connection.wait`` on the worker sentinels) and
``MPClient.start_engine_core_monitor`` / ``CoreEngineProcManager``
(``vllm/v1/engine/core_client.py``, ``vllm/v1/engine/utils.py``). vLLM's monitors know deaths
only; stopped and frozen processes, the blame rule and the laggard are ours.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_ready
from pathlib import Path

from engine.logger import init_logger
from engine.utils import processes
from engine.utils import run_dir as run_dirs
from engine.utils.processes import ChildProcess, EngineDeadError

logger = init_logger(__name__)

# How often the supervisor looks at its live children's state (stopped, frozen), in seconds.
# Deaths wake its wait at once; this is only the resolution of those two deadlines.
STATE_CHECK_S = 0.5
EXIT_REAP_S = 5.0  # s to reap a child whose pidfd said it exited (another thread may be reaping it)

FailureCallback = Callable[[EngineDeadError, "ChildProcess | None"], None]


def open_sentinel(pid: int) -> int | None:
    """A pidfd for ``pid`` (``os.pidfd_open``, Linux 5.3): readable once the process exits,
    child or not; None when it is gone already. The caller closes it."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie — dead, not yet reaped by its parent — does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def os_state(pid: int) -> str | None:
    """psutil's word for ``pid`` ("stopped" for SIGSTOP, "sleeping", ...), None when gone."""
    import psutil

    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return None


def _reap(child: ChildProcess) -> int | None:
    """The exit status of ``child``, whose pidfd said it exited (None: not reaped in time)."""
    try:
        return child.popen.wait(EXIT_REAP_S)
    except subprocess.TimeoutExpired:
        return child.poll()


def wait_for_exit(
    children: Collection[ChildProcess], timeout: float | None, *, first: bool = False
) -> list[ChildProcess]:
    """Wait until every one of ``children`` exited (``first``: until one did), or ``timeout``
    seconds passed (None: no limit); returns those that exited, in ``children``' order.

    Blocks on the children's pidfds, so it returns the moment the last (or first) one exits.
    A signal handler that raises (SIGTERM, Ctrl-C) interrupts it.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    sentinels: dict[int, ChildProcess] = {}
    try:
        for child in children:
            if child.poll() is None and (fd := open_sentinel(child.pid)) is not None:
                sentinels[fd] = child
        while True:
            exited = [c for c in children if c.poll() is not None]
            if (first and exited) or len(exited) == len(children) or not sentinels:
                return exited
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return exited
            for fd in wait_ready(list(sentinels), left):
                _reap(sentinels.pop(fd))
                os.close(fd)
    finally:
        for fd in sentinels:
            os.close(fd)


def wait_for_pids_gone(pids: Collection[int], timeout: float) -> list[int]:
    """Wait until every process in ``pids`` exited (children or not: their pidfds), or
    ``timeout`` seconds passed; returns the pids still running then (empty: all gone)."""
    deadline = time.monotonic() + timeout
    sentinels: dict[int, int] = {}
    try:
        for pid in set(pids):
            if (fd := open_sentinel(pid)) is not None:
                sentinels[fd] = pid
        while sentinels and (left := deadline - time.monotonic()) > 0:
            for fd in wait_ready(list(sentinels), left):
                sentinels.pop(fd)
                os.close(fd)
        return sorted(sentinels.values())
    finally:
        for fd in sentinels:
            os.close(fd)


@dataclass(eq=False)
class Watched:
    """One process a ``Supervisor`` watches.

    ``child`` is None for a process this one did not start (another API server's engine
    cores): its exit status is not ours to read, and ``gone`` is the root cause to report
    when it ends. ``clean_exit(status)`` says whether an exit is no failure (an API server
    that drained and left while the tree stops)."""

    role: str
    pid: int
    child: ChildProcess | None = None
    rank: int | None = None
    clean_exit: Callable[[int | None], bool] | None = None
    gone: str | None = None
    sentinel: int | None = None
    exited: bool = False
    returncode: int | None = None


class Supervisor:
    """Watches a parent's children and turns the first death, stop, freeze or missed deadline
    into one ``EngineDeadError`` (see the module docstring).

    ``on_failure(error, child)`` is called once, with the error and the child it came from
    (None when the owner named a process that is not one: ``fail``), from the supervisor's
    thread or from the thread that called ``fail``. The owner calls ``close`` before it
    stops its children, so their exits are not reported.

    Args:
        run_dir: the run directory (status files, crash reports: what the blame rule reads).
        on_failure: the owner's callback, or None (the owner asks ``failure``).
        name: the thread's name (vLLM: ``MultiprocWorkerMonitor``, ``MPClientEngineMonitor``).
        stopped_timeout_s, heartbeat_timeout_s: ``StoppedWatch``'s deadlines (None: the
            ``GLASSBOX_STOPPED_TIMEOUT_S`` / ``GLASSBOX_HEARTBEAT_TIMEOUT_S`` settings).
        log_failures: log one line for the failure noticed (the executors); False when the
            owner tells the story itself (the client: the root-cause block, or one
            ``ConfigError`` line when a dying engine core says a setting was the cause).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        on_failure: FailureCallback | None = None,
        *,
        name: str = "Supervisor",
        stopped_timeout_s: float | None = None,
        heartbeat_timeout_s: float | None = None,
        log_failures: bool = True,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.on_failure = on_failure
        self.log_failures = log_failures
        self.name = name
        self.states = StoppedWatch(stopped_timeout_s, heartbeat_timeout_s)
        self._watched: list[Watched] = []
        self._failure: EngineDeadError | None = None
        # Set with the first failure: a bounded wait given it as ``cancel`` (vLLM: the
        # executor's ``shutdown_event``) stops at once instead of looking up every slice.
        self.failed = threading.Event()
        self._closed = False
        self._changed = threading.Condition(threading.RLock())  # guards all of the above
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the owner's side

    def watch(
        self,
        child: ChildProcess,
        *,
        rank: int | None = None,
        clean_exit: Callable[[int | None], bool] | None = None,
    ) -> None:
        """Watch ``child`` (``rank``: its worker rank, for the root cause) from now on."""
        self._add(Watched(child.role, child.pid, child, rank, clean_exit))

    def watch_pid(self, role: str, pid: int, gone: str) -> None:
        """Watch process ``pid`` that this one did not start; ``gone`` is the root cause when it
        ends (its own parent reports the real one)."""
        self._add(Watched(role, pid, gone=gone))

    @property
    def failure(self) -> EngineDeadError | None:
        """The first failure, or None while every watched process is well."""
        return self._failure

    def raise_if_failed(self) -> None:
        """Raises the first failure, if there was one.

        Raises:
            EngineDeadError: a watched process failed (or the owner reported one: ``fail``).
        """
        if self._failure is not None:
            raise self._failure

    def fail(
        self,
        role: str,
        pid: int | None,
        returncode: int | None = None,
        *,
        rank: int | None = None,
        state: str | None = None,
        note: str = "",
        exit_detail: str | None = None,
        child: ChildProcess | None = None,
    ) -> EngineDeadError:
        """The owner saw ``role`` fail (its exit status, or ``state``: "stopped …", "frozen …";
        ``note``/``exit_detail``: as ``processes.format_root_cause``): the first failure
        becomes the ``EngineDeadError`` of the blame rule and goes to ``on_failure``. Returns
        the first failure (this one, or an earlier one); the caller raises it."""
        with self._changed:
            if self._failure is not None:
                return self._failure
            root = processes.format_root_cause(
                self.run_dir, role, pid, returncode, rank=rank, note=note, state=state,
                exit_detail=exit_detail, exits=self._exits(),
            )  # fmt: skip
            self._failure = EngineDeadError(root)
            self.failed.set()
            self._changed.notify_all()
        self._told(role, pid, returncode, state, exit_detail, note)
        if self.on_failure is not None:
            self.on_failure(self._failure, child)
        return self._failure

    def exited_within(self, roles: Collection[str], timeout: float) -> str | None:
        """Wait up to ``timeout`` s for one of the watched ``roles`` to exit; the first that
        did, or None."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                gone = next((w.role for w in self._watched if w.role in roles and w.exited), None)
                left = deadline - time.monotonic()
                if gone is not None or left <= 0 or self._closed:
                    return gone
                self._changed.wait(left)

    def tree_problems(self) -> list[str]:
        """``StoppedWatch.tree_problems`` of this run directory (``/health``)."""
        return self.states.tree_problems(self.run_dir)

    def close(self) -> None:
        """Stop watching (the owner is about to stop its children); idempotent."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
            self._changed.notify_all()
        self._wake()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(STATE_CHECK_S * 4)
        if thread is None or not thread.is_alive():
            self._close_fds()

    # ------------------------------------------------------------------ the thread

    def _add(self, watched: Watched) -> None:
        if watched.child is None or watched.child.poll() is None:
            watched.sentinel = open_sentinel(watched.pid)
        with self._changed:
            if self._closed:
                if watched.sentinel is not None:
                    os.close(watched.sentinel)
                return
            self._watched.append(watched)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._wake()
        if watched.sentinel is None:  # gone already
            self._exited(watched)

    def _wake(self) -> None:
        """Wake the thread's wait (a child to add, or closing)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # closed: the thread is gone
            pass

    def _run(self) -> None:
        try:
            while not self._closed:
                with self._changed:
                    sentinels = {
                        w.sentinel: w for w in self._watched if w.sentinel is not None and not w.exited
                    }
                for fd in wait_ready([self._wake_r, *sentinels], STATE_CHECK_S):
                    if fd == self._wake_r:
                        os.read(self._wake_r, 4096)
                    elif not self._closed:
                        self._exited(sentinels[fd])
                if not self._closed and self._failure is None:
                    self._check_states()
        except Exception:  # a bug here must not pass silently: the tree would go unwatched
            logger.exception("%s stopped watching", self.name)
        finally:
            if self._closed:
                self._close_fds()

    def _exited(self, w: Watched) -> None:
        """``w``'s pidfd is readable (or it was gone when watched): record its exit and judge it."""
        code = _reap(w.child) if w.child is not None else None
        with self._changed:
            w.exited, w.returncode = True, code
            if w.sentinel is not None:
                os.close(w.sentinel)
                w.sentinel = None
            self._changed.notify_all()
            if self._closed or self._failure is not None:
                return
        if w.clean_exit is not None and w.clean_exit(code):
            return
        if w.gone is not None:
            with self._changed:
                if self._failure is None:
                    self._failure = EngineDeadError(w.gone)
                    self.failed.set()
            if self.on_failure is not None:
                self.on_failure(self._failure, None)
            return
        self.fail(w.role, w.pid, code, rank=w.rank, child=w.child)

    def _check_states(self) -> None:
        """A live child stopped by a signal, or frozen, past its deadline is a failure."""
        for w in [w for w in self._watched if w.child is not None and not w.exited]:
            seconds = self.states.stopped_for(w.pid)
            state = self.states.describe(seconds) if seconds is not None else None
            if state is None:
                seconds = self.states.frozen_for(w.pid, run_dirs.status_file(self.run_dir, w.role))
                state = self.states.describe_frozen(seconds) if seconds is not None else None
            if state is not None and not self._closed:
                self.fail(w.role, w.pid, None, rank=w.rank, state=state, child=w.child)
                return

    def _exits(self) -> dict[str, int]:
        """Role → exit status of each watched child known to have exited (reaped by the
        thread, or by its owner before the thread got to it)."""
        exits = {}
        for w in self._watched:
            code = w.returncode if w.exited else (w.child.poll() if w.child is not None else None)
            if code is not None:
                exits[w.role] = code
        return exits

    def _told(
        self, role: str, pid: int | None, code: int | None, state: str | None, detail: str | None, note: str
    ) -> None:
        """Log the failure noticed, and tell engine-top how the child ended (only a parent knows)."""
        from tracing import run_dir as contract
        from tracing.telemetry.publisher import telemetry

        who = f"{role} (pid {pid if pid is not None else '?'})"
        if code is not None or detail is not None:
            how = detail or processes.describe_exit(code)
            telemetry().note_child_exit(role, how)  # NULL_PUBLISHER when telemetry is off
            line = (
                f"{who} died: {how}" if code is not None else f"{who} {how}" + (f"; {note}" if note else "")
            )
        elif state is not None:
            line = f"{who} is {state}"
        else:
            crash = contract.read_crash_report(self.run_dir, role)
            line = f"{who} failed" + (f": {crash.exception}" if crash is not None and crash.exception else "")
        if self.log_failures:
            logger.error("%s", line)

    def _close_fds(self) -> None:
        with self._changed:
            for w in self._watched:
                if w.sentinel is not None:
                    os.close(w.sentinel)
                    w.sentinel = None
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._wake_r = self._wake_w = -1


# --------------------------------------------------------------------- heartbeats


# Seconds between two liveness beats (the status file's mtime, see ``start_liveness_beat``).
LIVENESS_INTERVAL_S = 1.0


def start_liveness_beat(
    status_file: Path, interval_s: float = LIVENESS_INTERVAL_S, stop: threading.Event | None = None
) -> threading.Thread:
    """Start a daemon thread that sets ``status_file``'s mtime to now every ``interval_s`` (s).

    This is the heartbeat a parent reads without subscribing to anything
    (``StoppedWatch.frozen_for``, ``GLASSBOX_HEARTBEAT_TIMEOUT_S``): every child started by
    ``spawn_process`` runs one from the process harness (``process_harness.main``), whatever ``GLASSBOX_TELEMETRY`` says.
    It is a Python thread on purpose: a native call holding the GIL, or a deadlock in the
    interpreter, stops it too, which is what "frozen" means. Before the child writes its
    status file (``tracing.setup_tracing``) and after the run directory is removed there is
    nothing to touch; the thread waits for the next beat. ``stop`` ends it (tests); a child
    never stops it (a daemon thread, it ends with the process).

    vLLM counterpart: none (vLLM has no frozen-process check).
    """
    stop = stop or threading.Event()

    def run() -> None:
        while not stop.is_set():
            try:
                os.utime(status_file)
            except OSError:  # no status file (yet), or the run directory is being removed
                pass
            stop.wait(interval_s)

    thread = threading.Thread(target=run, name="liveness_beat", daemon=True)
    thread.start()
    return thread


class StoppedWatch:
    """Notices children stopped by a signal (SIGSTOP, Ctrl-Z, a debugger) for too long.

    A stopped process is alive but does nothing — not even its lifeline or heartbeat — so
    without this an idle tree would wait on it forever. ``stopped_for(pid)`` returns how long
    ``pid`` has been seen stopped once that is ``timeout_s`` or more
    (``GLASSBOX_STOPPED_TIMEOUT_S``), else None; a process that runs again is forgotten.
    ``frozen_for(pid, status_file)`` does the same for a process that runs but whose
    heartbeat stopped (``GLASSBOX_HEARTBEAT_TIMEOUT_S``): a native call holding the GIL.
    """

    def __init__(self, timeout_s: float | None = None, heartbeat_timeout_s: float | None = None) -> None:
        from engine import envs

        if timeout_s is None:
            timeout_s = envs.GLASSBOX_STOPPED_TIMEOUT_S
        if heartbeat_timeout_s is None:
            heartbeat_timeout_s = envs.GLASSBOX_HEARTBEAT_TIMEOUT_S
        self.timeout_s = timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._since: dict[int, float] = {}
        self._first_beat: dict[int, float] = {}  # pid → the first status-file mtime seen
        self._beating: set[int] = set()  # pids seen to beat (their mtime moved)

    def stopped_since(self, pid: int) -> float | None:
        """Seconds ``pid`` has been seen stopped (from the first call that saw it so: 0.0),
        at once, whatever the timeout; None while it runs (or is gone)."""
        import psutil

        from tracing.instances import STOPPED_STATES

        try:
            stopped = psutil.Process(pid).status() in STOPPED_STATES
        except psutil.Error:
            stopped = False
        if not stopped:
            self._since.pop(pid, None)
            return None
        since = self._since.setdefault(pid, time.monotonic())
        return time.monotonic() - since

    def stopped_for(self, pid: int) -> float | None:
        waited = self.stopped_since(pid)
        return waited if waited is not None and waited >= self.timeout_s else None

    def frozen_for(self, pid: int, status_file: Path) -> float | None:
        """Seconds since ``pid`` last beat, once over ``GLASSBOX_HEARTBEAT_TIMEOUT_S``, while
        the OS shows it running; else None.

        The heartbeat is ``status_file``'s mtime, touched each second by the child's liveness
        thread (``start_liveness_beat``, telemetry on or off). A child is only judged once it
        has been seen to beat (its mtime moved), so a child that has not written its status
        file yet, or one started some other way (no liveness thread), is never called frozen.
        """
        if self.heartbeat_timeout_s <= 0:
            return None
        try:
            mtime = os.stat(status_file).st_mtime
        except OSError:
            return None
        if pid not in self._beating:
            first = self._first_beat.setdefault(pid, mtime)
            if mtime == first:
                return None
            self._beating.add(pid)
        age = time.time() - mtime
        if age < self.heartbeat_timeout_s:
            return None
        import psutil

        try:
            if psutil.Process(pid).status() not in (
                psutil.STATUS_RUNNING,
                psutil.STATUS_SLEEPING,
                psutil.STATUS_DISK_SLEEP,
            ):
                return None  # stopped (stopped_for says so), or exiting
        except psutil.Error:
            return None
        return age

    def tree_problems(self, run_dir: Path) -> list[str]:
        """What stops the process tree of ``run_dir`` from serving, now: one line per process
        of its manifest (the source ``glassbox ps`` reads: ``tracing.instances``) that is
        stopped by a signal (at once, not after ``GLASSBOX_STOPPED_TIMEOUT_S``), frozen
        (``frozen_for``) or dead, naming its role, pid and why. Empty while every process runs.
        A process with no pid known here (not started, or on another node) is not judged.
        ``/health`` answers 503 with these."""
        from tracing import run_dir as run_dirs
        from tracing.instances import collect_instance

        problems = []
        for p in collect_instance(run_dir).processes:
            if not p.planned or not p.counted or p.pid is None or p.role is None:
                continue
            if not p.alive:
                problems.append(f"{p.role} (pid {p.pid}) is dead: {p.note or p.state}")
                continue
            stopped = self.stopped_since(p.pid)
            if stopped is not None:
                problems.append(
                    f"{p.role} (pid {p.pid}) is stopped by a signal (SIGSTOP, Ctrl-Z or a debugger) for "
                    f"{stopped:.0f} s; kill -CONT {p.pid} resumes it, else the server stops after "
                    f"GLASSBOX_STOPPED_TIMEOUT_S={self.timeout_s:g} s"
                )
                continue
            frozen = self.frozen_for(p.pid, run_dirs.status_path(run_dir, p.role))
            if frozen is not None:
                problems.append(f"{p.role} (pid {p.pid}) is {self.describe_frozen(frozen)}")
        return problems

    def describe(self, seconds: float) -> str:
        return f"stopped by a signal (SIGSTOP?) for {seconds:.0f} s, over GLASSBOX_STOPPED_TIMEOUT_S={self.timeout_s:g}"

    def describe_frozen(self, seconds: float) -> str:
        return (
            f"frozen: running but no heartbeat for {seconds:.0f} s, over GLASSBOX_HEARTBEAT_TIMEOUT_S="
            f"{self.heartbeat_timeout_s:g} (a native call holding the GIL, or a deadlock; py-spy dump shows where)"
        )


# --------------------------------------------------------------------- start-up laggard


def find_laggard(run_dir: Path) -> tuple[str, int | None] | None:
    """(role, pid) of the process that holds start-up back: the deepest planned engine
    process inside a stage, else the first without a status file (not started); None when
    every one reports no stage."""
    from tracing import run_dir as contract

    roles = [r.name for r in run_dirs.planned_roles(run_dir) if r.in_engine]
    statuses = {role: contract.read_status(run_dirs.status_file(run_dir, role)) for role in roles}
    in_stage = [role for role in roles if statuses[role] is not None and statuses[role].stage]
    if in_stage:
        return in_stage[-1], statuses[in_stage[-1]].pid  # planned order: engine core, then its workers
    for role in roles:
        if statuses[role] is None:
            return role, None
    return None


def describe_laggard(run_dir: Path, spawned: dict[str, int] | None = None) -> str:
    """Name the process that holds start-up back, and the stage it is in (from status files).

    The engine core starts its workers, so the deepest process that is inside a stage is the
    one everybody waits for: a worker in a stage wins over the engine core. When no process
    reports a stage, the first planned one without a status file has not started — or, when
    ``spawned`` (role name → pid of the caller's children) has it, has not set up yet.
    """
    from tracing.run_dir import read_status

    engine_roles = [r.name for r in run_dirs.planned_roles(run_dir) if r.in_engine]
    now = time.time()
    statuses = {role: read_status(run_dirs.status_file(run_dir, role)) for role in engine_roles}
    in_stage = [role for role in engine_roles if statuses[role] is not None and statuses[role].stage]
    if in_stage:
        role = in_stage[-1]  # planned order is engine core, then its workers
        status = statuses[role]
        from tracing.hints import stage_hint

        hint = stage_hint(status.stage).hint  # the words engine-top and glassbox doctor show
        return (
            f"{role} (pid {status.pid}) has been in stage {status.stage} for "
            f"{now - (status.entered_at or now):.1f} s." + (f" Usually: {hint}." if hint else "")
        )
    for role in engine_roles:
        if statuses[role] is None:
            if role in (spawned or {}):
                return (
                    f"{role} (pid {spawned[role]}) was started but has not set up yet (no status file in "
                    f"{run_dir}: its interpreter is still starting or importing)."
                )
            return f"{role} has not started yet (no status file in {run_dir})."
    return "No process reports a stage; see the log above."
