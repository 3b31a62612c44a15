"""The glass of a worker's steps: what ``Worker.execute_model`` is timed and counted for.

Not in vLLM (its ``gpu_worker.py`` has no per-step telemetry). ``Worker`` runs each step
inside ``WorkerStepTelemetry.step()``, which keeps what the live telemetry (``engine-top``'s
worker gauges), the benchmarks (``get_comm_stats``) and the status file (``glassbox ps``,
``doctor``: graphs torch.compile made after warm-up) read; the reference code of a step stays
the model's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tracing.stage import set_runs_as
from tracing.telemetry import events
from tracing.telemetry.publisher import telemetry


def compile_text(mode: str, graphs: int, late: int = 0) -> str:
    """``eager``, ``compiled (inductor, 1 graph)``, or with ``late`` graphs made after warm-up
    (a failed guard: each cost a step seconds of compile) ``compiled (inductor, 2 graphs, 1
    after warm-up)``: the status file's ``compile`` fact."""
    if mode == "eager":
        return "eager"
    return f"compiled ({mode}, {graphs} graph{'s' * (graphs != 1)}" + (
        f", {late} after warm-up)" if late else ")"
    )


class WorkerStepTelemetry:
    """One worker's step counters: ``execute_model`` calls (``num_steps``), the last one's
    time (``last_forward_ms``, ms), their total (``execute_model_s``, s; reset by
    ``get_comm_stats(reset=True)``) and the graphs compiled after warm-up so far."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.last_forward_ms = 0.0
        self.execute_model_s = 0.0
        self.graphs_after_warm_up = 0

    @contextmanager
    def step(self, model_runner: Any) -> Iterator[None]:
        """Time one ``execute_model`` of ``model_runner``'s model, count it and mark the step
        in the live telemetry; a graph compiled during it goes into the status file. A step
        that raises is not counted."""
        start = time.perf_counter()
        yield
        self.note_late_graphs(model_runner)
        elapsed = time.perf_counter() - start
        self.execute_model_s += elapsed
        self.num_steps += 1
        self.last_forward_ms = elapsed * 1e3
        telemetry().mark_step()

    def note_late_graphs(self, model_runner: Any) -> None:
        """After a step (or a dummy batch): a graph compiled after warm-up goes into the
        status file at once."""
        compiled = model_runner.compiled if model_runner is not None else None
        if compiled is not None and compiled.graphs_after_warm_up != self.graphs_after_warm_up:
            self.graphs_after_warm_up = late = compiled.graphs_after_warm_up
            set_runs_as({"compile": compile_text("inductor", compiled.num_graphs, late),
                         "graphs_after_warm_up": late})  # fmt: skip

    def gauges(self) -> dict[str, float]:
        """Live-telemetry gauges: ``execute_model`` calls so far and the last one's time (ms)."""
        return {
            events.GAUGE_WORKER_STEP: self.num_steps,
            events.GAUGE_WORKER_FORWARD_MS: self.last_forward_ms,
        }
