"""Entry point of every Glassbox child process: ``python -m engine.utils.process_entry ROLE``.

Reads the payload from stdin (see ``engine.utils.processes``), names the process (its title,
and a ``(Role pid=N)`` prefix on every line it writes to stdout and stderr:
``engine.logger.decorate_logs``), starts the lifeline watcher and the liveness beat, and runs
the target. Kept tiny so a child starts fast: torch is imported by the target, not here.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
import threading
from pathlib import Path

# Seconds a child gives itself to stop cleanly after its parent died.
PARENT_DEATH_GRACE_S = 3.0


PR_SET_PDEATHSIG = 1  # linux/prctl.h


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


def main() -> None:
    continue_on_parent_death()
    from engine.logger import decorate_logs, init_logger, set_process_role
    from engine.utils import processes

    stdin_fd = sys.stdin.fileno()
    spec = processes.read_payload(stdin_fd)
    role, run_dir = spec.role, Path(spec.run_dir)
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

    processes.start_liveness_beat(run_dirs.status_path(run_dir, role))
    # From here a SIGTERM is judged by who sent it (the target installs the same again).
    processes.install_sigterm_exit(run_dir, role)
    # `glassbox doctor` asks for every thread's stack with SIGUSR1 (written to <role>.stacks).
    from tracing.stacks import enable_stack_dumps

    enable_stack_dumps(run_dir, role)
    try:
        module_name, qualname = spec.target.split(":")
        target = functools.reduce(getattr, qualname.split("."), importlib.import_module(module_name))
    except Exception as e:
        processes.write_crash_report(run_dir, role, e, stage=None)
        raise
    target(spec.payload, run_dir=run_dir, role=role)


if __name__ == "__main__":
    main()
