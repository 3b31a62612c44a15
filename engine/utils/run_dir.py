"""The engine's side of the run directory: the topology plan written as the manifest.

The run-directory contract — the file formats (``Manifest``, ``ProcessStatus``,
``CrashReport``), the one atomic writer, the readers, the base directory, listing and the
stale sweep — lives in ``tracing/run_dir.py``, below the engine, so that ``glassbox ps``
and engine-top read run directories without importing the engine. This module adapts it to
the engine:

- ``plan_tree(plan)`` / ``write_manifest(run_dir, **fields)``: the topology plan
  (``engine/distributed/topology.py``) as the manifest, each planned process with its kind,
  ranks, title, status file name and whether it is counted. Role names are built and
  parsed here (through the topology), never in the contract.
- ``create_run_dir()``: a fresh run directory under the base that ``engine/envs.py``
  declares (``GLASSBOX_RUN_DIR_BASE``, else ``$XDG_RUNTIME_DIR``, else ``/dev/shm``, else
  the temp dir), mode 0700. A memory-backed filesystem matters: the workers'
  shared-memory queues are files in this directory.
- ``status_file(run_dir, role)``: where a process (a ``ProcessRole`` or its name) writes its
  status file.

The other names (``list_run_dirs``, ``creator_pid``, ``sweep_stale_run_dirs``,
``remove_run_dir``, ``status_files``) are the contract's, kept here for the engine's
callers. The records are read typed, with the contract's readers
(``tracing.run_dir.read_manifest``, ``read_status``, ``read_crash_report``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import msgspec

from engine.distributed.topology import ProcessRole, RoleKind, TopologyPlan
from engine.logger import init_logger
from tracing import run_dir as contract
from tracing.run_dir import (  # noqa: F401 - re-exported for the engine's callers
    MANIFEST,
    RUN_DIR_PREFIX,
    creator_pid,
    is_stale,
    list_run_dirs,
    remove_run_dir,
    stale_run_dirs,
    sweep_stale_run_dirs,
)

logger = init_logger(__name__)

MEMBERS_EXIT_S = 5.0  # s close_run_dir waits for the tree's other members to exit before removing


def run_dir_base() -> Path:
    """Where this engine creates run directories (``GLASSBOX_RUN_DIR_BASE`` from
    ``engine/envs.py``, else ``$XDG_RUNTIME_DIR``, else ``/dev/shm``, else the temp dir)."""
    from engine import envs

    return contract.run_dir_base(envs.GLASSBOX_RUN_DIR_BASE)


def create_run_dir() -> Path:
    """Make a fresh run directory (mode 0700) under ``run_dir_base()`` and return its path.

    First sweeps away run directories that nothing owns any more (see
    ``sweep_stale_run_dirs``), so a tree that was killed all at once leaves no litter.

    Raises:
        ConfigError: ``GLASSBOX_RUN_DIR_BASE`` is too long for the ipc socket paths inside it.
        OSError: the base directory cannot be created or written.
    """
    base = run_dir_base()
    if len(str(base)) > contract.MAX_BASE_LEN:
        from engine.config import ConfigError

        raise ConfigError.from_message(
            f"GLASSBOX_RUN_DIR_BASE={base} is {len(str(base))} characters; at most {contract.MAX_BASE_LEN} "
            "fit (Unix socket paths inside it are limited to 107 bytes): choose a shorter directory",
            flag="GLASSBOX_RUN_DIR_BASE",
        )
    return contract.make_run_dir(base, post_mortem_root())


def post_mortem_root() -> Path:
    """Where this engine keeps post-mortems: ``<GLASSBOX_CACHE_ROOT>/post_mortem``
    (``tracing.run_dir.post_mortem_root``)."""
    from engine import envs

    return contract.post_mortem_root(envs.GLASSBOX_CACHE_ROOT)


def close_run_dir(
    run_dir: Path,
    *,
    failure: str | None = None,
    root_cause: str | None = None,
    telemetry_record: str | None = None,
) -> Path | None:
    """Remove ``run_dir`` at the end of its tree, first keeping its post-mortem when the tree
    ended after a failure.

    ``failure``: why it ended (``the engine died``, ``start-up timed out``), None for a clean
    end (nothing is kept). ``root_cause``: the root-cause text the frontend printed, saved
    as ``root_cause.txt`` beside the crash reports. ``telemetry_record``: the telemetry
    recording (``--telemetry-record``), kept too when small. Call it after the tree stopped
    (its crash reports and flight recorders are written). Returns the kept post-mortem's
    directory (``tracing.run_dir.keep_post_mortem``), or None. Never raises for the keeping:
    a tree always ends.
    """
    from engine.utils.supervisor import wait_for_pids_gone

    # The tree's other members first: a grandchild (a worker whose engine core exited at once,
    # say) still writes its status or crash report here for a moment after its parent's exit,
    # and a file written while the directory is removed leaves the directory behind.
    members = [s.pid for p in status_files(run_dir).values() if (s := contract.read_status(p)) is not None]
    left = wait_for_pids_gone([pid for pid in members if pid != os.getpid()], MEMBERS_EXIT_S)
    if left:
        logger.debug("removing %s while pid(s) %s still run", run_dir, left)
    kept = None
    if failure is not None:
        if root_cause:
            contract.write_root_cause(run_dir, root_cause)
        try:
            kept = contract.keep_post_mortem(run_dir, post_mortem_root(), reason=failure,
                                             telemetry_record=telemetry_record)  # fmt: skip
        except Exception:  # noqa: BLE001 - a post-mortem is a bonus, never a second failure
            logger.debug("keeping the post-mortem of %s failed", run_dir, exc_info=True)
        if kept is not None:
            # Debug: the root-cause block stays the last thing a failed tree prints (`glassbox
            # doctor`, run with nothing live, points at --last).
            logger.debug("Post-mortem kept in %s (glassbox doctor --last reads it)", kept)
    contract.remove_run_dir(run_dir)
    return kept


def status_file(run_dir: Path, role: str | ProcessRole) -> Path:
    """Where process ``role`` (a ``ProcessRole`` or its name) records its current stage."""
    if isinstance(role, ProcessRole):
        return Path(run_dir) / role.status_file_name
    return contract.status_path(run_dir, role)


def status_files(run_dir: Path) -> dict[str, Path]:
    """Every status file in ``run_dir``, by role name (empty when the directory is gone)."""
    return contract.status_paths(run_dir)


# ------------------------------------------------------------------------ the manifest


def plan_tree(plan: TopologyPlan) -> dict:
    """The manifest fields of the planned process tree: roles, expected count, shape.

    Everything comes from ``plan`` (``engine/distributed/topology.py``): the roles in start-up
    order and the expected count, A + DP + N (+1 when DP > 1) — A API servers, DP engine
    cores, N workers (N = DP × PP × TP when the workers run in their own processes, else 0).
    An offline ``LLM`` is not an API server, so it is not counted (except in ``inproc`` mode,
    where it is the whole engine). Each ``roles`` entry holds ``role``, ``kind`` and ``rank``;
    ``write_manifest`` completes it (``planned_process``).
    """
    return {"mode": plan.mode, "frontend_pid": os.getpid(), "roles": plan.manifest_roles(),
            "expected_process_count": plan.expected_process_count, "api_server_count": plan.api_server_count,
            "data_parallel_size": plan.data_parallel_size, "world_size": plan.world_size}  # fmt: skip


def planned_process(
    role: ProcessRole, *, mode: str | None, rank: int | None = None, pid: int | None = None
) -> contract.PlannedProcess:
    """The manifest entry of ``role``: its name, kind, ranks, title and status file name.

    ``rank``: the plan's rank (an engine core's DP rank, a worker's rank in its engine).
    ``counted`` follows ``TopologyPlan.is_counted``: everything but the owner ``LLM``, which
    counts only in ``inproc`` mode (where it is the whole engine), and a headless node's
    ``HeadlessNode`` launcher.
    """
    return contract.PlannedProcess(
        role=role.name, kind=role.kind.value, rank=rank, dp_rank=role.dp_rank, pp_rank=role.pp_rank,
        tp_rank=role.tp_rank, api_index=role.api_index, pid=pid, title=role.title,
        status_file=role.status_file_name, counted=role.kind is not RoleKind.HEADLESS and (role.kind is not RoleKind.FRONTEND or mode == "inproc"),
    )  # fmt: skip


def build_manifest(run_dir: Path, **fields: Any) -> contract.Manifest:
    """The ``Manifest`` of ``fields`` (``plan_tree``'s, plus e.g. ``host``/``port``) and the
    creation time, each ``roles`` entry completed by ``planned_process``.

    Raises:
        TypeError: a field the manifest does not have.
        ValueError: a ``roles`` entry whose ``role`` is not a role name.
    """
    mode = fields.get("mode")
    roles = []
    for entry in fields.pop("roles", []):
        entry = dict(entry) if isinstance(entry, dict) else msgspec.structs.asdict(entry)
        role = ProcessRole.parse(entry.get("role"))
        owner = role.kind in (RoleKind.FRONTEND, RoleKind.HEADLESS)
        pid = entry.get("pid") or (fields.get("frontend_pid") if owner else None)
        roles.append(planned_process(role, mode=mode, rank=entry.get("rank"), pid=pid))
    manifest = contract.Manifest(created_at=time.time(), run_dir=str(run_dir), roles=roles, **fields)
    if manifest.tensor_parallel_size is None and manifest.pipeline_parallel_size is None:
        workers = [r for r in roles if r.kind == RoleKind.WORKER.value]
        if workers:
            manifest.tensor_parallel_size = 1 + max(r.tp_rank for r in workers)
            manifest.pipeline_parallel_size = 1 + max(r.pp_rank for r in workers)
        elif manifest.world_size == 1:  # no worker processes (the uni executor): one worker
            manifest.tensor_parallel_size = manifest.pipeline_parallel_size = 1
    return manifest


def write_manifest(run_dir: Path, **fields: Any) -> None:
    """Atomically (re)write the manifest with ``fields`` plus creation time (``build_manifest``).

    Raises:
        TypeError, ValueError: as ``build_manifest``.
        OSError: the run directory is not writable.
    """
    contract.write_manifest(run_dir, build_manifest(run_dir, **fields))


def planned_roles(run_dir: Path) -> list[ProcessRole]:
    """The roles the manifest plans, in its order (empty when it is missing or unreadable;
    names that are not roles are skipped)."""
    manifest = contract.read_manifest(run_dir)
    roles = []
    for entry in manifest.roles if manifest is not None else ():
        try:
            roles.append(ProcessRole.parse(entry.role))
        except ValueError:
            continue
    return roles
