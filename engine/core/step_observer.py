"""Step observers: everything that watches the engine core's steps, plugged in beside it.

``EngineCore.step()`` is the engine in three calls (schedule, execute, update). Its
``StepTracer`` wraps each in its span, times the phases and builds one ``StepRecord`` per step
(``tracing.telemetry.events``: tokens, budget, requests, KV usage, phase times); everything
else a step feeds subscribes here, so ``step()`` stays the three calls and a reader can read
it next to vLLM's::

    step()                                    StepTracer → each observer in EngineCore.step_observers
    ├─ tracer.step(): engine_core.step span
    │  ├─ tracer.phase(): scheduler.schedule span
    │  │    schedule(); tracer.scheduled()  ──▶  on_schedule(scheduler_output, prefill_ids, step_span, schedule_span)
    │  ├─ tracer.phase(): executor.execute_model span
    │  │    execute_model()
    │  └─ tracer.phase(): scheduler.update_from_output span
    │       update_from_output(); tracer.updated() ──▶  on_update(record, step_span, update_span)
    └─ (span ended) tracer.stepped(outputs) ──▶  on_step(record, scheduler_output, outputs)
    _dummy_step() (a DP dummy batch)        ──▶  on_dummy_step(record)

The observers an engine core holds (in this order):

- ``StepSpanAttributes``: the step and phase spans' attributes (``docs/spans.md``);
- ``RequestPhaseTracer`` (``request_tracing.py``): each traced request's phases;
- ``FlightRecorder``: the last steps, written beside the crash report when the core dies;
- ``StepTelemetry``: live telemetry's step records and request events (engine-top).

The coordinator's load report is not one: it must also follow inputs that arrive between
steps, so the busy loop sends it once per turn (``EngineCoreProc.run_busy_loop``).

vLLM has no counterpart: its ``EngineCore.step()`` returns the outputs and its stats ride on
them (``SchedulerStats``); spans, a flight recorder and live telemetry are Glassbox's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import msgspec
from opentelemetry import trace

from engine.core.messages import EngineCoreOutputs
from engine.sched.output import SchedulerOutput
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler
from tracing import catalogue, record_span, stage
from tracing.stage import Stage
from tracing.telemetry.events import MAX_STEP_REQUESTS, ScheduledRequest, StepRecord
from tracing.telemetry.publisher import telemetry

# Step records the flight recorder keeps (a ring buffer).
FLIGHT_RECORDER_STEPS = 64


class StepObserver:
    """Hooks into each engine step; every hook does nothing here (override the ones you need).

    Hooks run in the engine core's busy loop, on every step: keep them cheap, and let them
    raise only for a real bug (an exception fails the step, as a scheduler error would).
    """

    def on_schedule(
        self, scheduler_output: SchedulerOutput, prefill_ids: set[str], step_span: Stage, schedule_span: Stage
    ) -> None:
        """Inside ``scheduler.schedule``'s span, right after ``schedule()``: the requests are
        as the scheduler left them (finished ones not yet freed). ``prefill_ids``: the
        requests that compute prompt tokens in this step. Spans: ``Stage`` objects, open."""

    def on_update(self, record: StepRecord, step_span: Stage, update_span: Stage) -> None:
        """Inside ``scheduler.update_from_output``'s span, after it: ``record`` is the step's
        (its counts and KV usage as of now; its phase times end here)."""

    def on_step(
        self, record: StepRecord, scheduler_output: SchedulerOutput, outputs: dict[int, EngineCoreOutputs]
    ) -> None:
        """After the step's span ended: its record, what was scheduled and the outputs per
        client index."""

    def on_dummy_step(self, record: StepRecord) -> None:
        """After a DP dummy batch (``record.dummy``; every count 0)."""


class StepTracer:
    """What ``EngineCore.step()`` hands the glass: its spans, phase times and observers.

    ``step(step_id)`` opens ``engine_core.step`` and ``phase(name)`` each phase span inside it
    (``scheduler.schedule``, ``executor.execute_model``, ``scheduler.update_from_output``), all
    with ``glassbox.step.id``; ``scheduled`` (in the schedule span), ``updated`` (in the update
    span) and ``stepped`` (after the step span) call every observer's hook with what it needs:
    the step's prefilling requests, its ``StepRecord``, its outputs.

    Args:
        scheduler: the engine's scheduler (requests, counts, KV usage are read from it).
        engine_index: the DP rank, on every record.
        token_budget: ``max_num_batched_tokens``, on every record.
        observers: ``EngineCore.step_observers`` (the same list: a test may append to it).
        step_delay_ms: ``--step-delay-ms``, the pause after each step, on every record.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        engine_index: int,
        token_budget: int,
        observers: list[StepObserver],
        step_delay_ms: float = 0.0,
    ) -> None:
        self.scheduler = scheduler
        self.engine_index = engine_index
        self.token_budget = token_budget
        self.observers = observers
        self.step_delay_ms = step_delay_ms
        # The latest engine_core.step span's context (None unless spans are recorded): the
        # parent of its outputs' engine_core.output_send spans.
        self.last_step_context: Any = None
        self._attributes: dict[str, int] = {}
        self._started_at = 0.0  # Unix s
        self._marks: list[float] = []  # perf_counter s: the step's start, then each later phase's
        self._step_span: Stage | None = None
        self._phase_span: Stage | None = None
        self._scheduler_output: SchedulerOutput | None = None
        self._batch: dict[str, Any] = {}
        self._record: StepRecord | None = None
        self._bitmask_ms = 0.0

    @contextlib.contextmanager
    def step(self, step_id: int) -> Iterator[None]:
        """The ``engine_core.step`` span around one step (numbered ``step_id``, from 1)."""
        self._attributes = {catalogue.ATTR_STEP_ID: step_id}
        self._started_at, self._marks = time.time(), [time.perf_counter()]
        self._bitmask_ms = 0.0
        with stage(catalogue.ENGINE_CORE_STEP, **self._attributes) as self._step_span:
            yield
        span = self._step_span.span
        self.last_step_context = span.get_span_context() if span is not None else None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """One phase's span inside the step; every phase after the first marks its start (the
        grammar bitmask, between schedule and execute, counts as scheduling and is timed
        apart: ``bitmask_ms``)."""
        if name == catalogue.STRUCTURED_OUTPUT_GRAMMAR_BITMASK:
            start = time.perf_counter()
            so = self._scheduler_output
            rows = len(so.structured_output_request_ids) if so is not None else 0
            with stage(name, **self._attributes, **{catalogue.ATTR_SO_NUM_REQS: rows}):
                yield
            self._bitmask_ms = (time.perf_counter() - start) * 1e3
            return
        if name != catalogue.SCHEDULER_SCHEDULE:
            self._marks.append(time.perf_counter())
        with stage(name, **self._attributes) as self._phase_span:
            yield

    def scheduled(self, scheduler_output: SchedulerOutput) -> None:
        """Right after ``schedule()``, in its span: ``on_schedule`` for every observer."""
        self._scheduler_output = scheduler_output
        self._batch, prefill_ids = self._classify_batch(scheduler_output)
        pooling_ids = {r for r in scheduler_output.num_scheduled_tokens if self._is_pooling(r)}
        self._batch.update(self._scheduled_requests(scheduler_output, prefill_ids, pooling_ids))
        for observer in self.observers:
            observer.on_schedule(scheduler_output, prefill_ids, self._step_span, self._phase_span)

    def updated(self) -> None:
        """Right after ``update_from_output()``, in its span (which ends the update phase
        now): the step's ``StepRecord``, and ``on_update`` for every observer."""
        self._record = record = self._step_record()
        for observer in self.observers:
            observer.on_update(record, self._step_span, self._phase_span)

    def stepped(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        """After the step's span ended: ``on_step`` for every observer."""
        for observer in self.observers:
            observer.on_step(self._record, self._scheduler_output, outputs)

    @staticmethod
    def record_output_send(step_context: Any, queued_ns: int, taken_ns: int) -> None:
        """The ``engine_core.output_send`` span of one step's message, a child of its
        ``engine_core.step`` (``step_context``: ``last_step_context`` as the message was
        queued): from ``taken_ns`` (the output thread took it off ``output_queue``) to now,
        with the time it waited there since ``queued_ns`` (Unix ns). Called on the output
        thread."""
        record_span(catalogue.ENGINE_CORE_OUTPUT_SEND, start_ns=taken_ns,
                    parent=trace.set_span_in_context(trace.NonRecordingSpan(step_context)),
                    attributes={catalogue.ATTR_QUEUE_WAIT_MS: (taken_ns - queued_ns) / 1e6,
                                catalogue.ATTR_THREAD_NAME: threading.current_thread().name})  # fmt: skip

    def _step_record(self) -> StepRecord:
        """This step's figures, as ``update_from_output`` ends."""
        (t0, t1, t2), t3 = self._marks, time.perf_counter()
        scheduler_output = self._scheduler_output
        num_running, num_waiting = self.scheduler.get_request_counts()
        return StepRecord(
            engine_index=self.engine_index,
            step_id=self._attributes[catalogue.ATTR_STEP_ID],
            started_at=self._started_at,
            duration_ms=(t3 - t0) * 1e3,
            schedule_ms=(t1 - t0) * 1e3,
            execute_ms=(t2 - t1) * 1e3,
            update_ms=(t3 - t2) * 1e3,
            **self._batch,
            tokens_scheduled=scheduler_output.total_num_scheduled_tokens,
            token_budget=self.token_budget,
            num_running=num_running,
            num_waiting=num_waiting,
            num_preempted=len(scheduler_output.preempted_req_ids),
            kv_usage=self.scheduler.kv_cache_manager.usage,
            step_delay_ms=self.step_delay_ms,
            num_structured_reqs=len(scheduler_output.structured_output_request_ids),
            num_waiting_for_fsm=self.scheduler.num_waiting_for_fsm(),
            bitmask_ms=self._bitmask_ms,
        )

    def _is_pooling(self, req_id: str) -> bool:
        request = self.scheduler.requests.get(req_id)
        return request is not None and request.pooling_params is not None

    @staticmethod
    def _scheduled_requests(
        so: SchedulerOutput, prefill_ids: set[str], pooling_ids: set[str]
    ) -> dict[str, Any]:
        """The step's ``SchedulerOutput`` request by request (``ScheduledRequest``): its new
        requests, its cached ones (running on or resumed), at most ``MAX_STEP_REQUESTS`` in
        all, and the finished ids it hands to the workers. ``pooling_ids``: the pooling
        requests among them (all prefill)."""
        new = [
            ScheduledRequest(
                req_id=r.req_id,
                num_scheduled_tokens=so.num_scheduled_tokens.get(r.req_id, 0),
                num_computed_tokens=r.num_computed_tokens,
                num_new_blocks=len(r.block_ids[0]) if r.block_ids else 0,
                prefill=r.req_id in prefill_ids,
                pooling=r.req_id in pooling_ids,
            )  # fmt: skip
            for r in so.scheduled_new_reqs[:MAX_STEP_REQUESTS]
        ]
        cached_data = so.scheduled_cached_reqs
        cached = []
        for i, req_id in enumerate(cached_data.req_ids[: MAX_STEP_REQUESTS - len(new)]):
            blocks = cached_data.new_block_ids[i]
            cached.append(
                ScheduledRequest(
                    req_id=req_id,
                    num_scheduled_tokens=so.num_scheduled_tokens.get(req_id, 0),
                    num_computed_tokens=cached_data.num_computed_tokens[i],
                    num_new_blocks=len(blocks[0]) if blocks else 0,
                    prefill=req_id in prefill_ids,
                    resumed=cached_data.resumed_from_preemption[i],
                    pooling=req_id in pooling_ids,
                )  # fmt: skip
            )
        return {
            "scheduled_new_reqs": new,
            "scheduled_cached_reqs": cached,
            "finished_req_ids": sorted(so.finished_req_ids)[:MAX_STEP_REQUESTS],
        }

    def _classify_batch(self, so: SchedulerOutput) -> tuple[dict[str, int], set[str]]:
        """Split a step's requests into decodes (one token, past the prompt) and prefills
        (prompt tokens, or recomputation after preemption); a prefill that leaves tokens for
        a later step is a chunk. Returns the counts and the prefilling request ids."""
        decode_reqs = decode_tokens = prefill_reqs = prefill_tokens = chunked = 0
        prefill_ids: set[str] = set()
        requests = self.scheduler.requests
        for req_id, n in so.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None:
                continue
            computed = request.num_computed_tokens - n  # the scheduler has advanced it already
            if n == 1 and computed >= request.num_prompt_tokens:
                decode_reqs += 1
                decode_tokens += 1
            else:
                prefill_reqs += 1
                prefill_tokens += n
                prefill_ids.add(req_id)
                if computed + n < request.num_tokens:
                    chunked += 1
        return {
            "num_decode_reqs": decode_reqs,
            "num_decode_tokens": decode_tokens,
            "num_prefill_reqs": prefill_reqs,
            "num_prefill_tokens": prefill_tokens,
            "num_chunked_prefills": chunked,
        }, prefill_ids


class StepSpanAttributes(StepObserver):
    """The batch's figures on ``engine_core.step`` and its phase spans (``docs/spans.md``).

    ``scheduler.schedule`` and ``engine_core.step`` get the scheduled tokens, the budget, the
    new / cached / preempted request counts and the running / waiting counts after
    scheduling; ``scheduler.update_from_output`` the counts after it and the KV usage;
    ``engine_core.step`` the KV usage at its end. Figures are read only when the span is
    recorded (the step's KV usage always: it is on the stage, seen by stage hooks).
    """

    def __init__(self, scheduler: Scheduler, token_budget: int) -> None:
        self.scheduler = scheduler
        self.token_budget = token_budget  # max_num_batched_tokens

    def on_schedule(
        self, scheduler_output: SchedulerOutput, prefill_ids: set[str], step_span: Stage, schedule_span: Stage
    ) -> None:
        if schedule_span.span is None:
            return
        num_running, num_waiting = self.scheduler.get_request_counts()
        for span in (schedule_span, step_span):
            span.set(catalogue.ATTR_STEP_NUM_SCHEDULED_TOKENS, scheduler_output.total_num_scheduled_tokens)
            span.set(catalogue.ATTR_STEP_TOKEN_BUDGET, self.token_budget)
            span.set(catalogue.ATTR_STEP_NUM_NEW_REQS, len(scheduler_output.scheduled_new_reqs))
            span.set(catalogue.ATTR_STEP_NUM_CACHED_REQS, scheduler_output.scheduled_cached_reqs.num_reqs)
            span.set(catalogue.ATTR_STEP_NUM_PREEMPTED, len(scheduler_output.preempted_req_ids))
            span.set(catalogue.ATTR_STEP_NUM_RUNNING, num_running)
            span.set(catalogue.ATTR_STEP_NUM_WAITING, num_waiting)

    def on_update(self, record: StepRecord, step_span: Stage, update_span: Stage) -> None:
        if update_span.span is not None:
            update_span.set(catalogue.ATTR_STEP_NUM_RUNNING, record.num_running)
            update_span.set(catalogue.ATTR_STEP_NUM_WAITING, record.num_waiting)
            update_span.set(catalogue.ATTR_KV_USAGE, record.kv_usage)
        step_span.set(catalogue.ATTR_KV_USAGE, record.kv_usage)


class FlightRecorder(StepObserver):
    """The last ``FLIGHT_RECORDER_STEPS`` step records (``StepRecord.figures()``, oldest
    first), written beside the crash report when the engine core dies
    (``processes.write_flight_record``; ``glassbox doctor`` shows them). Iterable and sized
    like the deque it holds; dummy batches are not kept (they hold no request)."""

    def __init__(self, maxlen: int = FLIGHT_RECORDER_STEPS) -> None:
        self.steps: deque[dict[str, Any]] = deque(maxlen=maxlen)

    def on_step(
        self, record: StepRecord, scheduler_output: SchedulerOutput, outputs: dict[int, EngineCoreOutputs]
    ) -> None:
        self.steps.append(msgspec.to_builtins(record.figures()))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)


class StepTelemetry(StepObserver):
    """Live telemetry, when this process publishes it (``telemetry()``): each step's
    record (``StepRecord``, also a mark of progress for the heartbeat's ``last_step_at``)
    and its requests' changes as ``RequestEvent`` — scheduled, preempted (its KV freed: it
    recomputes from 0), finished (with its final counts). Nothing is read without a
    publisher."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        # This step's requests by id: update_from_output forgets the ones it finishes, and
        # their finished events carry their final counts.
        self._held: dict[str, Request] = {}

    def on_schedule(
        self, scheduler_output: SchedulerOutput, prefill_ids: set[str], step_span: Stage, schedule_span: Stage
    ) -> None:
        requests = self.scheduler.requests
        self._held = (
            {rid: r for rid in scheduler_output.num_scheduled_tokens if (r := requests.get(rid)) is not None}
            if telemetry().enabled
            else {}
        )

    def on_step(
        self, record: StepRecord, scheduler_output: SchedulerOutput, outputs: dict[int, EngineCoreOutputs]
    ) -> None:
        held, self._held = self._held, {}
        publisher = telemetry()
        if not publisher.enabled:  # nothing to build the events for
            return
        rank = record.engine_index
        publisher.mark_step()
        publisher.publish_step(**record.figures())
        for new in scheduler_output.scheduled_new_reqs:
            publisher.publish_request_event(
                new.req_id, "scheduled", engine_index=rank, num_prompt_tokens=len(new.prompt_token_ids),
                num_computed_tokens=new.num_computed_tokens, num_blocks=len(new.block_ids[0]) if new.block_ids else 0,
            )  # fmt: skip
        for req_id in scheduler_output.preempted_req_ids:
            publisher.publish_request_event(req_id, "preempted", engine_index=rank, reason="KV cache full",
                                            num_computed_tokens=0)  # fmt: skip
        for client_outputs in outputs.values():
            for out in client_outputs.outputs:
                if out.finish_reason is None:
                    continue
                counts = {}
                if (r := held.get(out.request_id)) is not None:
                    counts = dict(num_prompt_tokens=r.num_prompt_tokens, num_computed_tokens=r.num_computed_tokens,
                                  num_output_tokens=r.num_output_tokens, num_blocks=0)  # fmt: skip
                publisher.publish_request_event(out.request_id, "finished", engine_index=rank,
                                                reason=str(out.finish_reason), **counts)  # fmt: skip

    def on_dummy_step(self, record: StepRecord) -> None:
        publisher = telemetry()
        publisher.mark_step()
        publisher.publish_step(**record.figures())
