"""``EngineStatsTable``: the latest ``SchedulerStats`` of each engine core, kept by the client.

Every ``EngineCoreOutputs`` an engine core sends carries its ``scheduler_stats`` (running and
waiting requests, KV-cache usage, prefix-cache and preemption counters) and its
``engine_index`` (DP rank). The client's receive path writes them here as they arrive, so
readers never ask the engine: ``/metrics`` renders one ``engine="<rank>"`` series per row,
and the DP load balancer (waiting × 4 + running) reads the same rows.

The engine core sends stats with each step's outputs, on their own to a client that had no
outputs in a while, and once more after its last step before going idle: a table row
settles at 0 running once the engine's requests are done.

Written and read from one thread (the client's receive loop / the event loop) today; a lock
keeps it safe when a load balancer reads it from another.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from engine.core.messages import SchedulerStats


class EngineStatsTable:
    """Latest ``SchedulerStats`` per engine index (DP rank).

    Args:
        engine_indices: the engines this client talks to; each starts with empty stats
            (all zero), so a scrape before the first step still shows every engine.
    """

    def __init__(self, engine_indices: Iterable[int] = (0,)) -> None:
        self._lock = threading.Lock()
        self._stats: dict[int, SchedulerStats] = {index: SchedulerStats() for index in engine_indices}
        self._updated_at: dict[int, float] = {}

    def update(self, engine_index: int, stats: SchedulerStats) -> None:
        """Record ``stats`` as engine ``engine_index``'s latest (outputs of one engine arrive
        in order, so the latest to arrive is the newest)."""
        with self._lock:
            self._stats[engine_index] = stats
            self._updated_at[engine_index] = time.monotonic()

    def update_from_outputs(self, outputs) -> None:
        """Take the stats an ``EngineCoreOutputs`` carries, if any."""
        if outputs.scheduler_stats is not None:
            self.update(outputs.engine_index, outputs.scheduler_stats)

    def snapshot(self) -> dict[int, SchedulerStats]:
        """Engine index → its latest stats, in engine order (a copy: safe to keep)."""
        with self._lock:
            return dict(sorted(self._stats.items()))

    def seconds_since_update(self, engine_index: int) -> float | None:
        """How old engine ``engine_index``'s row is (None: no stats arrived yet)."""
        with self._lock:
            at = self._updated_at.get(engine_index)
        return None if at is None else time.monotonic() - at

    def __len__(self) -> int:
        return len(self._stats)
