"""Step observers: everything that watches the engine core's steps, plugged in beside it.

``EngineCore.step()`` is the engine in three calls (schedule, execute, update) and builds
one ``StepRecord`` per step (``tracing.telemetry.events``: tokens, budget, requests, KV
usage, phase times). Everything else a step feeds subscribes here, so ``step()`` stays the
three calls and a reader can read it next to vLLM's::

    step()                                    each observer in EngineCore.step_observers
    ├─ engine_core.step span
    │  ├─ scheduler.schedule span
    │  │    schedule()                  ──▶   on_schedule(scheduler_output, prefill_ids, step_span, schedule_span)
    │  ├─ executor.execute_model span
    │  │    execute_model()
    │  └─ scheduler.update_from_output span
    │       update_from_output(); record ──▶  on_update(record, step_span, update_span)
    └─ (span ended)                     ──▶   on_step(record, scheduler_output, outputs)
    _dummy_step() (a DP dummy batch)    ──▶   on_dummy_step(record)

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

from collections import deque
from collections.abc import Iterator
from typing import Any

from engine.core.messages import EngineCoreOutputs
from engine.sched.output import SchedulerOutput
from engine.sched.request import Request
from engine.sched.scheduler import Scheduler
from tracing import catalogue
from tracing.stage import Stage
from tracing.telemetry.events import StepRecord
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
        self.steps.append(record.figures())

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
