"""The run directory: one per engine instance, where its processes leave their traces.

Holds the manifest (planned roles, pids, expected process count) and each process's status
file (its current lifecycle stage, written by ``tracing.stage``). Later it also holds the
ZMQ ipc sockets and the live-telemetry sockets, which is why paths are kept short (ipc
socket paths are limited to 107 characters). ``glassbox ps`` and ``engine-top`` find
running instances by listing these directories.

Created under ``GLASSBOX_RUN_DIR_BASE``, else ``$XDG_RUNTIME_DIR``, else ``/dev/shm``, else
the temp dir, with mode 0700, and removed when the instance shuts down. A memory-backed
filesystem matters: the workers' shared-memory queues are files in this directory, and on a
disk-backed one the kernel would write their pages back to disk.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from engine.distributed.topology import STATUS_SUFFIX, ProcessRole, TopologyPlan

RUN_DIR_PREFIX = "glassbox-"
MANIFEST = "manifest.json"
# create_run_dir names a directory glassbox-<creator pid>-<random>.
_RUN_DIR_NAME = re.compile(rf"^{re.escape(RUN_DIR_PREFIX)}(\d+)-")


def run_dir_base() -> Path:
    from engine import envs

    base = envs.GLASSBOX_RUN_DIR_BASE or os.environ.get("XDG_RUNTIME_DIR")
    if not base and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        base = "/dev/shm"
    return Path(base or tempfile.gettempdir())


def create_run_dir() -> Path:
    """Make a fresh run directory (mode 0700) and return its path.

    First sweeps away run directories that nothing owns any more (see
    ``sweep_stale_run_dirs``), so a tree that was killed all at once leaves no litter.
    """
    base = run_dir_base()
    base.mkdir(parents=True, exist_ok=True)
    sweep_stale_run_dirs(base)
    return Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-", dir=base))


def status_file(run_dir: Path, role: str | ProcessRole) -> Path:
    """Where process ``role`` (a ``ProcessRole`` or its name) records its current stage."""
    if isinstance(role, ProcessRole):
        return Path(run_dir) / role.status_file_name
    return Path(run_dir) / f"{role}{STATUS_SUFFIX}"


def status_files(run_dir: Path) -> dict[str, Path]:
    """Every status file in ``run_dir``, by role (empty when the directory is gone)."""
    try:
        names = sorted(p.name for p in run_dir.iterdir())
    except OSError:
        return {}
    return {n[: -len(STATUS_SUFFIX)]: run_dir / n for n in names if n.endswith(STATUS_SUFFIX)}


def list_run_dirs(base: Path | None = None) -> list[Path]:
    """Every run directory under ``base`` (default: ``run_dir_base()``), sorted by name.

    Only directories named like ``create_run_dir`` names them are listed; a stale one
    (its creator gone) is listed too — telling live from stale is the caller's job.
    """
    base = run_dir_base() if base is None else Path(base)
    try:
        entries = list(base.iterdir())
    except OSError:  # no base yet: nothing ever ran here
        return []
    return sorted(p for p in entries if _RUN_DIR_NAME.match(p.name) and p.is_dir())


def creator_pid(run_dir: Path) -> int | None:
    """The pid of the process that created ``run_dir`` (from its name), or None."""
    m = _RUN_DIR_NAME.match(Path(run_dir).name)
    return int(m.group(1)) if m else None


def write_manifest(run_dir: Path, **fields: object) -> None:
    """Atomically (re)write the manifest with ``fields`` plus creation time."""
    data = {"created_at": time.time(), "run_dir": str(run_dir), **fields}
    tmp = run_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, run_dir / MANIFEST)


def read_manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / MANIFEST).read_text())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def sweep_stale_run_dirs(base: Path) -> list[Path]:
    """Remove run directories whose creator and every process with a status file are dead.

    A tree normally cleans up after itself (the last survivor removes the directory); this
    catches the rest — e.g. a whole process group SIGKILLed at once. A directory with any
    live pid is left alone. Returns the removed paths.
    """
    removed = []
    for run_dir in list_run_dirs(base):
        pids = [creator_pid(run_dir)]
        for path in status_files(run_dir).values():
            try:
                pids.append(int(json.loads(path.read_text()).get("pid")))
            except (OSError, ValueError, TypeError):
                continue
        if any(pid is not None and _pid_alive(pid) for pid in pids):
            continue
        remove_run_dir(run_dir)
        removed.append(run_dir)
    return removed


def remove_run_dir(run_dir: Path) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)


def plan_tree(plan: TopologyPlan) -> dict:
    """The manifest fields of the planned process tree: roles, expected count, shape.

    Everything comes from ``plan`` (``engine/distributed/topology.py``): the roles in start-up
    order and the expected count, A + DP + N (+1 when DP > 1) — A API servers, DP engine
    cores, N workers (N = DP × PP × TP when the workers run in their own processes, else 0).
    An offline ``LLM`` is not an API server, so it is not counted (except in ``inproc`` mode,
    where it is the whole engine).
    """
    return {"mode": plan.mode, "frontend_pid": os.getpid(), "roles": plan.manifest_roles(),
            "expected_process_count": plan.expected_process_count, "api_server_count": plan.api_server_count,
            "data_parallel_size": plan.data_parallel_size, "world_size": plan.world_size}  # fmt: skip


def planned_roles(run_dir: Path) -> list[ProcessRole]:
    """The roles the manifest plans, in its order (empty when it is missing or unreadable;
    names that are not roles are skipped)."""
    try:
        entries = read_manifest(run_dir).get("roles", [])
    except (OSError, ValueError):
        return []
    roles = []
    for entry in entries:
        try:
            roles.append(ProcessRole.parse(entry.get("role")))
        except (ValueError, AttributeError):
            continue
    return roles
