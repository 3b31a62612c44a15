"""The run directory: one per engine instance, where its processes leave their traces.

Holds the manifest (planned roles, pids, expected process count) and each process's status
file (its current lifecycle stage, written by ``tracing.stage``). Later it also holds the
ZMQ ipc sockets and the live-telemetry sockets, which is why paths are kept short (ipc
socket paths are limited to 107 characters). ``glassbox ps`` and ``engine-top`` find
running instances by listing these directories.

Created under ``GLASSBOX_RUN_DIR_BASE``, else ``$XDG_RUNTIME_DIR``, else the temp dir, with
mode 0700, and removed when the instance shuts down.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

RUN_DIR_PREFIX = "glassbox-"
MANIFEST = "manifest.json"


def run_dir_base() -> Path:
    from engine import envs

    base = envs.GLASSBOX_RUN_DIR_BASE or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base)


def create_run_dir() -> Path:
    """Make a fresh run directory (mode 0700) and return its path."""
    base = run_dir_base()
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-", dir=base))


def status_file(run_dir: Path, role: str) -> Path:
    """Where process ``role`` records its current stage."""
    return run_dir / f"{role}.status.json"


def write_manifest(run_dir: Path, **fields: object) -> None:
    """Atomically (re)write the manifest with ``fields`` plus creation time."""
    data = {"created_at": time.time(), "run_dir": str(run_dir), **fields}
    tmp = run_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, run_dir / MANIFEST)


def read_manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / MANIFEST).read_text())


def remove_run_dir(run_dir: Path) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)
