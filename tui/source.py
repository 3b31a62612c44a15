"""Where engine-top's data comes from: finding instances, opening a collector.

``find_instances`` lists the running Glassbox instances from their run directories
(``tracing.run_dir``: a directory's name gives its creator's pid, the manifest the planned
tree and the owner's pid) — the same rule as the collector's own search: an instance runs
while its owner does. ``open_live`` / ``open_replay`` start a
``tracing.telemetry.collector.Collector``, the one thing that turns telemetry into a
``LiveState``; it is imported when first needed, so ``engine-top --help`` and "no instance
found" answer at once.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracing import run_dir as run_dirs
from tracing.telemetry.state import LiveState


class SourceError(RuntimeError):
    """The data source cannot be opened; the message is one line for the user."""


@dataclass
class Instance:
    """A running instance: its run directory and (when written yet) its manifest."""

    run_dir: Path
    manifest: run_dirs.Manifest | None

    def describe(self, now: float | None = None) -> str:
        """One line: ``serve on 127.0.0.1:8000, TP=2 PP=1 DP=2, 9 processes, pid 4242, up 3m05s``."""
        m = self.manifest
        if m is None:
            return f"starting (no manifest yet), pid {run_dirs.creator_pid(self.run_dir)}"
        parts = [m.mode or "?"]
        if m.host and m.port:
            parts[0] += f" on {m.host}:{m.port}"
        tp, pp, dp = m.tensor_parallel_size or 1, m.pipeline_parallel_size or 1, m.data_parallel_size or 1
        parts.append(f"TP={tp} PP={pp} DP={dp}")
        if m.expected_process_count is not None:
            parts.append(f"{m.expected_process_count} processes")
        parts.append(f"pid {m.frontend_pid or run_dirs.creator_pid(self.run_dir)}")
        if m.created_at:
            age = max(0.0, (now or time.time()) - m.created_at)
            parts.append(f"up {int(age // 60)}m{int(age % 60):02d}s")
        return ", ".join(parts)


def describe_run_dir(run_dir: str | Path) -> str:
    """``Instance.describe`` for a run directory (its manifest read now)."""
    return Instance(Path(run_dir), run_dirs.read_manifest(run_dir)).describe()


def find_instances(base: Path | None = None) -> list[Instance]:
    """Every instance under the run-directory base whose owner is alive, oldest first.
    Never raises: an unreadable base or directory lists as nothing."""
    found = []
    for path in run_dirs.list_run_dirs(base):
        manifest = run_dirs.read_manifest(path)
        owner = manifest.frontend_pid if manifest is not None and manifest.frontend_pid else None
        if run_dirs.pid_alive(owner or run_dirs.creator_pid(path)):
            found.append(Instance(path, manifest))
    found.sort(key=lambda i: (i.manifest.created_at or 0.0) if i.manifest else float("inf"))
    return found


def _collector_class() -> Any:
    try:
        from tracing.telemetry.collector import Collector
    except ImportError as e:
        raise SourceError(
            f"the telemetry collector (tracing.telemetry.collector) is not available: {e}"
        ) from e
    return Collector


def open_live(run_dir: Path | None, base: Path | None = None) -> Any:
    """A started collector watching ``run_dir`` (None: the one running instance, found and
    re-found by the collector). Raises ``SourceError``."""
    try:
        return _collector_class()(run_dir, base=base).start()
    except SourceError:
        raise
    except Exception as e:
        raise SourceError(f"cannot watch {run_dir or 'the running instance'}: {e}") from e


def open_replay(path: Path, speed: float) -> Any:
    """A started collector replaying the recording at ``path`` (``speed`` 0: as fast as
    possible). Raises ``SourceError``."""
    if not path.is_file():
        raise SourceError(f"no recording at {path}")
    try:
        return _collector_class().from_recording(path, speed=speed).start()
    except SourceError:
        raise
    except Exception as e:
        raise SourceError(f"cannot replay {path}: {e}") from e


def replay_at(path: Path, step: int) -> LiveState:
    """A recording's state as of engine step ``step`` (``collector.replay_at``). Raises
    ``ValueError`` (no such step: the message says which it has) or ``OSError``."""
    try:
        from tracing.telemetry.collector import replay_at as seek
    except ImportError as e:
        raise SourceError(f"the telemetry collector is not available: {e}") from e
    return seek(path, step)


def recording_steps(path: Path) -> list[int]:
    """The engine step ids a recording holds, in order (``collector.recording_steps``)."""
    from tracing.telemetry.collector import recording_steps as steps

    return steps(path)


def close(collector: Any) -> None:
    """Stop a collector's thread; never raises."""
    if collector is None:
        return
    with contextlib.suppress(Exception):
        collector.stop()


def settled(state: LiveState) -> bool:
    """Whether every process of the state has been heard from (a heartbeat) or is dead —
    what ``--once`` waits for, a couple of seconds at most."""
    if not state.processes:
        return False
    return all(p.heartbeat_at is not None or p.gone for p in state.processes.values())


def first_snapshot(collector: Any, wait_s: float = 2.0) -> LiveState:
    """The collector's snapshot once every process has sent a heartbeat, or after ``wait_s``;
    for a replay, once it has been played to the end (or after ``wait_s``)."""
    done = getattr(collector, "done", None)
    if getattr(collector, "replay_path", None) is not None and done is not None:
        done.wait(wait_s)
        return collector.snapshot()
    return collector.wait_until(settled, wait_s)
