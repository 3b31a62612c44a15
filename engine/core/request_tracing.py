"""A request's phases inside the engine core, as spans of the request's own trace.

The API server's ``api_server.request`` span travels in ``EngineCoreRequest.trace_headers``;
the engine core adds, as its children:

- ``scheduler.waiting``: queued → first scheduled (vLLM's time in queue);
- ``request.prefill``: first scheduled → first token, over ``glassbox.request.num_chunks``
  steps, **linked** to the ``engine_core.step`` spans that computed it (a step belongs to
  its own trace, shared by every request in the batch, so a request relates to it by a link,
  not as a parent);
- ``request.decode``: first token → last, over ``glassbox.request.num_steps`` steps, linked
  to its first and last step, with the finish reason.

An abort ends the phase the request is in at that moment, with finish reason ``abort``.

Kept cheap: nothing is tracked unless this process records spans and the request came with
trace context; at most ``MAX_LINKS`` links per prefill. vLLM records one flat ``llm_request``
span per request in the frontend; these phases are Glassbox's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.core.messages import EngineCoreOutputs, FinishReason
from engine.core.step_observer import StepObserver
from engine.sched.output import SchedulerOutput
from tracing import catalogue, is_recording, record_span
from tracing.propagation import extract_trace_context
from tracing.stage import Stage
from tracing.telemetry.events import StepRecord

MAX_LINKS = 16


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
        self.step(scheduler_output, prefill_ids, step_context,
                  [o.request_id for o in produced if o.new_token_ids],
                  {o.request_id: str(o.finish_reason) for o in produced if o.finished},
                  int(record.started_at * 1e9))  # fmt: skip

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
    ) -> None:
        """One engine step: ``prefill_ids`` computed prompt tokens in it (the rest of the
        scheduled requests decoded); ``token_ids`` got new tokens (the first one ends the
        prefill); ``finished``: request id → finish reason (``stop``, ``length``) of those
        that finished. ``step_started_ns``: when the step (its scheduling) began — a request
        first scheduled in it stopped waiting then."""
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
            if phases is None or phases.first_token_ns is None:
                continue
            record_span(catalogue.REQUEST_DECODE, start_ns=phases.first_token_ns, end_ns=now,
                        parent=phases.context, links=phases.decode_links,
                        attributes={catalogue.ATTR_GEN_AI_REQUEST_ID: request_id,
                                    catalogue.ATTR_NUM_STEPS: phases.num_decode_steps,
                                    catalogue.ATTR_GEN_AI_RESPONSE_FINISH_REASONS: [finish_reason]})  # fmt: skip
