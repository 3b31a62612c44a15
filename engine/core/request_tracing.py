"""A request's spans inside the engine core, as spans of the request's own trace.

The API server's ``api_server.request`` span travels in ``EngineCoreRequest.trace_headers``;
the engine core adds, as its children:

- ``engine_core.input``: received → decoded and put on ``input_queue``, on the input thread;
- ``engine_core.input_queue``: put on ``input_queue`` → taken off it by the busy loop;
- ``engine_core.abort``: an abort received → done, with the time it waited in the queue;
  these three from ``EngineCoreInputTracer``, which ``EngineCoreProc``'s input thread and
  busy loop call;
- ``scheduler.waiting``: queued → first scheduled (vLLM's time in queue);
- ``request.prefill``: first scheduled → first token, over ``glassbox.request.num_chunks``
  steps, **linked** to the ``engine_core.step`` spans that computed it (a step belongs to
  its own trace, shared by every request in the batch, so a request relates to it by a link,
  not as a parent);
- ``request.decode``: first token → last, over ``glassbox.request.num_steps`` steps, linked
  to its first and last step, with the finish reason.

A pooling request (``--runner pooling``) is all prefill: its ``request.prefill`` ends with the
step that brought its vector, and it has no ``request.decode``.

An abort ends the phase the request is in at that moment, with finish reason ``abort``.

Kept cheap: nothing is tracked unless this process records spans and the request came with
trace context; at most ``MAX_LINKS`` links per prefill. vLLM records one flat ``llm_request``
span per request in the frontend (``engine/frontend/request_tracing.py``); these spans are
Glassbox's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.core.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
)
from engine.core.step_observer import StepObserver
from engine.sched.output import SchedulerOutput
from tracing import catalogue, is_recording, record_span
from tracing.propagation import extract_trace_context
from tracing.stage import Stage
from tracing.telemetry.events import StepRecord

MAX_LINKS = 16


class EngineCoreInputTracer:
    """The spans of a traced request's way in: ``engine_core.input``,
    ``engine_core.input_queue`` and ``engine_core.abort`` (see the module docstring).

    The input thread passes each decoded item through ``received``; the busy loop calls
    ``dequeued`` for an ADD it takes off the queue and wraps an ABORT in ``aborting``. Only
    requests that came with trace context, in a process that records spans, are followed.
    """

    def __init__(self) -> None:
        # Request id → when the input thread put it on input_queue (Unix ns); written by the
        # input thread, popped by the busy loop.
        self._queued_ns: dict[str, int] = {}

    def received(self, item: tuple[EngineCoreRequestType, Any], received_ns: int) -> tuple[Any, ...]:
        """The input thread got ``item`` (``(type, message)``) at ``received_ns`` (Unix ns):
        a traced ADD gets its ``engine_core.input`` span and its queued time noted; a traced
        ABORT is returned as ``(type, message, received_ns)``, where its span starts. Returns
        what goes on ``input_queue``."""
        request_type, message = item
        if request_type == EngineCoreRequestType.ADD and message.trace_headers and is_recording():
            now = time.time_ns()
            record_span(catalogue.ENGINE_CORE_INPUT, start_ns=received_ns, end_ns=now,
                        parent=extract_trace_context(message.trace_headers),
                        attributes={catalogue.ATTR_GEN_AI_REQUEST_ID: message.request_id,
                                    catalogue.ATTR_MESSAGE_TYPE: EngineCoreRequestType.ADD.name,
                                    catalogue.ATTR_THREAD_NAME: threading.current_thread().name})  # fmt: skip
            self._queued_ns[message.request_id] = now
        elif request_type == EngineCoreRequestType.ABORT and message.trace_headers and is_recording():
            return (*item, received_ns)
        return item

    def dequeued(self, request: EngineCoreRequest, step_delay_ns: tuple[int, int] = (0, 0)) -> None:
        """The busy loop took ``request`` off ``input_queue``: its ``engine_core.input_queue``
        span, when ``received`` noted it. ``step_delay_ns``: the latest ``--step-delay-ms``
        pause (start, end in Unix ns); the part of the wait it covers is on the span
        (``glassbox.step.delay_ms``, 0 without a pause)."""
        queued_ns = self._queued_ns.pop(request.request_id, None)
        if queued_ns is not None:
            now = time.time_ns()
            paused_ns = max(0, min(now, step_delay_ns[1]) - max(queued_ns, step_delay_ns[0]))
            record_span(catalogue.ENGINE_CORE_INPUT_QUEUE, start_ns=queued_ns, end_ns=now,
                        parent=extract_trace_context(request.trace_headers),
                        attributes={catalogue.ATTR_GEN_AI_REQUEST_ID: request.request_id,
                                    catalogue.ATTR_QUEUE_WAIT_MS: (now - queued_ns) / 1e6,
                                    catalogue.ATTR_STEP_DELAY_MS: paused_ns / 1e6})  # fmt: skip

    @contextlib.contextmanager
    def aborting(self, abort: AbortRequests, received_ns: int | None) -> Iterator[None]:
        """Around the busy loop's abort of ``abort.request_ids``: the ``engine_core.abort``
        span, from ``received_ns`` (the input thread's, None when untraced) to the abort
        done, with the time it waited in the queue (``glassbox.queue.wait_ms``). No span when
        the abort raises."""
        taken_ns = time.time_ns()
        yield
        if received_ns is not None:  # in the caller's trace: received, waited, aborted
            record_span(catalogue.ENGINE_CORE_ABORT, start_ns=received_ns,
                        parent=extract_trace_context(abort.trace_headers),
                        attributes={catalogue.ATTR_REQUEST_IDS: abort.request_ids,
                                    catalogue.ATTR_QUEUE_WAIT_MS: (taken_ns - received_ns) / 1e6})  # fmt: skip


@dataclass
class _Phases:
    context: Any
    queued_ns: int
    scheduled_ns: int | None = None
    first_token_ns: int | None = None
    num_chunks: int = 0
    prefill_links: list[Any] = field(default_factory=list)
    num_decode_steps: int = 0
    decode_links: list[Any] = field(default_factory=list)


class RequestPhaseTracer(StepObserver):
    """Follows traced requests through the steps of one engine core.

    Call ``add`` when a request arrives, ``step`` after each engine step with its
    ``SchedulerOutput``, the step span's context and the requests that got their first token
    or finished, and ``abort`` for an abort. As a step observer of the engine core
    (``step_observer.py``) it calls ``step`` itself: ``on_schedule`` notes the step's span
    and prefills, ``on_step`` hands them over with the step's outputs.
    """

    def __init__(self) -> None:
        self._phases: dict[str, _Phases] = {}
        # This step's span and prefilling requests (on_schedule), for on_step.
        self._step_span: Stage | None = None
        self._prefill_ids: set[str] = set()

    def on_schedule(
        self, scheduler_output: SchedulerOutput, prefill_ids: set[str], step_span: Stage, schedule_span: Stage
    ) -> None:
        self._step_span, self._prefill_ids = step_span, prefill_ids

    def on_step(
        self, record: StepRecord, scheduler_output: SchedulerOutput, outputs: dict[int, EngineCoreOutputs]
    ) -> None:
        step_span, prefill_ids = self._step_span, self._prefill_ids
        self._step_span, self._prefill_ids = None, set()
        if not self._phases:
            return
        span = step_span.span if step_span is not None else None
        step_context = span.get_span_context() if span is not None else None
        produced = [o for eco in outputs.values() for o in eco.outputs]
        pooled = [o.request_id for o in produced if o.pooling_output is not None]
        self.step(scheduler_output, prefill_ids, step_context,
                  [o.request_id for o in produced if o.new_token_ids] + pooled,
                  {o.request_id: str(o.finish_reason) for o in produced if o.finished},
                  int(record.started_at * 1e9), pooled)  # fmt: skip

    def add(self, request_id: str, trace_headers: dict[str, str] | None) -> None:
        if trace_headers and is_recording():
            context = extract_trace_context(trace_headers)
            if context is not None:
                self._phases[request_id] = _Phases(context=context, queued_ns=time.time_ns())

    def abort(self, request_ids: list[str]) -> None:
        """These requests were aborted: the phase each was in ends now (``scheduler.waiting``,
        ``request.prefill`` or ``request.decode``), with finish reason ``abort``."""
        if not self._phases:
            return
        now = time.time_ns()
        reason = [str(FinishReason.ABORT)]
        for request_id in request_ids:
            phases = self._phases.pop(request_id, None)
            if phases is None:
                continue
            attributes = {catalogue.ATTR_GEN_AI_REQUEST_ID: request_id,
                          catalogue.ATTR_GEN_AI_RESPONSE_FINISH_REASONS: reason}  # fmt: skip
            if phases.scheduled_ns is None:
                record_span(catalogue.SCHEDULER_WAITING, start_ns=phases.queued_ns, end_ns=now,
                            parent=phases.context, attributes=attributes)  # fmt: skip
            elif phases.first_token_ns is None:
                attributes[catalogue.ATTR_NUM_CHUNKS] = phases.num_chunks
                record_span(catalogue.REQUEST_PREFILL, start_ns=phases.scheduled_ns, end_ns=now,
                            parent=phases.context, links=phases.prefill_links, attributes=attributes)  # fmt: skip
            else:
                attributes[catalogue.ATTR_NUM_STEPS] = phases.num_decode_steps
                record_span(catalogue.REQUEST_DECODE, start_ns=phases.first_token_ns, end_ns=now,
                            parent=phases.context, links=phases.decode_links, attributes=attributes)  # fmt: skip

    def step(
        self,
        scheduler_output: SchedulerOutput,
        prefill_ids: set[str],
        step_context: Any,
        token_ids: list[str],
        finished: dict[str, str],
        step_started_ns: int,
        pooled: Sequence[str] = (),
    ) -> None:
        """One engine step: ``prefill_ids`` computed prompt tokens in it (the rest of the
        scheduled requests decoded); ``token_ids`` got new tokens (the first one ends the
        prefill); ``finished``: request id → finish reason (``stop``, ``length``) of those
        that finished. ``step_started_ns``: when the step (its scheduling) began — a request
        first scheduled in it stopped waiting then. ``pooled``: pooling requests whose vector
        came (listed in ``token_ids`` too: it ends their prefill); they have no decode."""
        if not self._phases:
            return
        now = time.time_ns()
        for request_id in scheduler_output.num_scheduled_tokens:
            phases = self._phases.get(request_id)
            if phases is None:
                continue
            if phases.scheduled_ns is None:
                phases.scheduled_ns = max(step_started_ns, phases.queued_ns)
                record_span(catalogue.SCHEDULER_WAITING, start_ns=phases.queued_ns, end_ns=phases.scheduled_ns,
                            parent=phases.context,
                            attributes={catalogue.ATTR_GEN_AI_REQUEST_ID: request_id})  # fmt: skip
            if request_id in prefill_ids:
                phases.num_chunks += 1
                if len(phases.prefill_links) < MAX_LINKS:
                    phases.prefill_links.append(step_context)
            else:
                phases.num_decode_steps += 1
                if len(phases.decode_links) < 2:
                    phases.decode_links.append(step_context)
                else:
                    phases.decode_links[1] = step_context  # keep the first and the latest
        for request_id in token_ids:
            phases = self._phases.get(request_id)
            if phases is None or phases.first_token_ns is not None:
                continue
            phases.first_token_ns = now
            record_span(catalogue.REQUEST_PREFILL, start_ns=phases.scheduled_ns or phases.queued_ns, end_ns=now,
                        parent=phases.context, links=phases.prefill_links,
                        attributes={catalogue.ATTR_GEN_AI_REQUEST_ID: request_id,
                                    catalogue.ATTR_NUM_CHUNKS: phases.num_chunks})  # fmt: skip
        for request_id, finish_reason in finished.items():
            phases = self._phases.pop(request_id, None)
            if phases is None or phases.first_token_ns is None or request_id in pooled:
                continue
            record_span(catalogue.REQUEST_DECODE, start_ns=phases.first_token_ns, end_ns=now,
                        parent=phases.context, links=phases.decode_links,
                        attributes={catalogue.ATTR_GEN_AI_REQUEST_ID: request_id,
                                    catalogue.ATTR_NUM_STEPS: phases.num_decode_steps,
                                    catalogue.ATTR_GEN_AI_RESPONSE_FINISH_REASONS: [finish_reason]})  # fmt: skip
