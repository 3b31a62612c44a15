"""The engine core's input spans (``EngineCoreInputTracer``): a traced request's way in through
``input_queue``, and an abort, in the caller's own trace; untraced items pass untouched."""

from __future__ import annotations

import pytest

import tracing
from engine.core.messages import AbortRequests, EngineCoreRequest, EngineCoreRequestType
from engine.core.request_tracing import EngineCoreInputTracer
from engine.sampling_params import SamplingParams
from tracing import catalogue
from tracing.propagation import inject_trace_headers

ADD, ABORT = EngineCoreRequestType.ADD, EngineCoreRequestType.ABORT


def _request(request_id: str, trace_headers: dict[str, str] | None) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=[1, 2], sampling_params=SamplingParams(),
                             eos_token_id=None, arrival_time=0.0, trace_headers=trace_headers)  # fmt: skip


@pytest.fixture
def handle():
    yield tracing.setup_tracing("EngineCore_DP0", in_memory=True)
    tracing.shutdown_tracing()


def test_a_traced_request_and_abort_get_their_input_spans_in_the_callers_trace(handle):
    tracer = EngineCoreInputTracer()
    with tracing.stage(catalogue.API_SERVER_REQUEST) as caller:
        headers = inject_trace_headers()
    trace_id = caller.span.get_span_context().trace_id

    untraced = (ADD, _request("u", None))
    assert tracer.received(untraced, 1) is untraced
    tracer.dequeued(untraced[1])
    add = tracer.received((ADD, _request("r", headers)), 1_000)
    assert add[:1] == (ADD,) and len(add) == 2  # an ADD's queued time is kept by the tracer
    tracer.dequeued(add[1])
    abort = tracer.received((ABORT, AbortRequests(request_ids=["r"], trace_headers=headers)), 2_000)
    assert abort[0] == ABORT and abort[2] == 2_000  # its span starts where the input thread got it
    with tracer.aborting(abort[1], abort[2]):
        pass

    spans = {s.name: s for s in handle.get_finished_spans() if s.name != catalogue.API_SERVER_REQUEST}
    assert set(spans) == {
        catalogue.ENGINE_CORE_INPUT,
        catalogue.ENGINE_CORE_INPUT_QUEUE,
        catalogue.ENGINE_CORE_ABORT,
    }
    assert {s.context.trace_id for s in spans.values()} == {trace_id}
    queued = spans[catalogue.ENGINE_CORE_INPUT_QUEUE]
    assert queued.start_time == spans[catalogue.ENGINE_CORE_INPUT].end_time
    assert queued.attributes["gen_ai.request.id"] == "r" and queued.attributes["glassbox.queue.wait_ms"] >= 0
    assert spans[catalogue.ENGINE_CORE_ABORT].start_time == 2_000
    assert tuple(spans[catalogue.ENGINE_CORE_ABORT].attributes["glassbox.request.ids"]) == ("r",)


def test_the_input_thread_span_names_its_thread_and_a_wait_says_how_much_was_the_step_delay(handle):
    import threading
    import time

    tracer = EngineCoreInputTracer()
    with tracing.stage(catalogue.API_SERVER_REQUEST):
        headers = inject_trace_headers()
    got = []
    reader = threading.Thread(target=lambda: got.append(tracer.received((ADD, _request("r", headers)), 1_000)),
                              name="EngineCoreInputThread")  # fmt: skip
    reader.start()
    reader.join()
    queued_ns = time.time_ns()
    time.sleep(0.01)
    # the busy loop paused (--step-delay-ms) from before the request was queued until 5 ms ago
    tracer.dequeued(got[0][1], step_delay_ns=(queued_ns - 50_000_000, time.time_ns() - 5_000_000))
    spans = {s.name: s for s in handle.get_finished_spans()}
    assert spans[catalogue.ENGINE_CORE_INPUT].attributes["thread.name"] == "EngineCoreInputThread"
    wait = spans[catalogue.ENGINE_CORE_INPUT_QUEUE].attributes
    assert 0 < wait["glassbox.step.delay_ms"] < wait["glassbox.queue.wait_ms"]
    tracer2 = EngineCoreInputTracer()
    add = tracer2.received((ADD, _request("s", headers)), 2_000)
    tracer2.dequeued(add[1])  # no pause: none of the wait was one
    last = [s for s in handle.get_finished_spans() if s.name == catalogue.ENGINE_CORE_INPUT_QUEUE][-1]
    assert last.attributes["glassbox.step.delay_ms"] == 0.0
