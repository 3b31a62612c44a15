"""The glass of a worker's steps: what ``Worker.execute_model`` is timed and counted for.

Not in vLLM (its ``gpu_worker.py`` has no per-step telemetry). ``Worker`` runs each step
inside ``WorkerStepTelemetry.step()``, which keeps what the live telemetry (``engine-top``'s
worker gauges), the benchmarks (``get_comm_stats``) and the status file (``glassbox ps``,
``doctor``: graphs torch.compile made after warm-up) read; the worker process runs each RPC
inside ``observed_rpc()`` (its caller's trace context, its span, the comm board). The
reference code of a step stays the model's.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from tracing import catalogue, faults, stage
from tracing.propagation import attached_trace_context
from tracing.stage import set_runs_as
from tracing.telemetry import events
from tracing.telemetry.publisher import telemetry

if TYPE_CHECKING:
    from engine.executor.messages import WorkerRPC
    from tracing.run_dir import CommBoard


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


@contextmanager
def observed_rpc(
    rpc_msg: WorkerRPC, rank: int, worker_spans: bool, board: CommBoard | None
) -> Iterator[None]:
    """The glass around one RPC in a worker process: ``board`` (this worker's
    ``CommPosition`` writer) told the RPC as it begins and, unless it raises, ends (so a worker
    inside ``execute_model`` reads as busy, not idle, and its steps are counted); the call runs
    under its caller's span (the RPC's W3C trace context), ``execute_model`` in a
    ``worker.execute_model`` stage (its attribute: how long the RPC waited in the queue, ms)
    when ``worker_spans`` asks for it or a fault is armed there."""
    if board is not None:
        board.rpc_enter(rpc_msg.method)
    with attached_trace_context(rpc_msg.trace_headers), _execute_model_stage(rpc_msg, rank, worker_spans):
        yield
    if board is not None:
        board.rpc_exit()


def _execute_model_stage(rpc_msg: WorkerRPC, rank: int, worker_spans: bool):
    """The ``worker.execute_model`` stage of an ``execute_model`` RPC, or nothing."""
    if rpc_msg.method != "execute_model" or not (
        worker_spans or catalogue.WORKER_EXECUTE_MODEL in faults.armed_stages()
    ):
        return contextlib.nullcontext()
    waited_ms = max(time.time() - rpc_msg.sent_at, 0.0) * 1e3
    return stage(catalogue.WORKER_EXECUTE_MODEL, rank=rank, **{catalogue.ATTR_QUEUE_WAIT_MS: waited_ms})
