"""A request's spans in the frontend process (the API server, or ``LLM``): the one place they
are made.

Two spans, both in the request's own trace (a child of the caller's W3C ``traceparent`` when
one came):

- ``api_server.request`` (``RequestTrace``, ``start_request_trace``): the root of the request
  in the API server, from the HTTP arrival to the last byte sent, with
  ``api_server.process_inputs`` (tokenization) under it. Its context is what the engine
  requests carry (``EngineCoreRequest.trace_headers``), so the engine core's spans for the
  request (``engine/core/request_tracing.py``) join this trace. vLLM makes no span in its
  API server; it only passes the incoming headers on (``OpenAIServing._get_trace_headers``
  with ``extract_trace_headers``, in ``vllm/entrypoints/openai/serving_engine.py`` and
  ``vllm/tracing.py``).
- ``llm_request`` (``do_tracing``): arrival → finish, made by the output processor when a
  request finishes or is aborted, with the GenAI semantic-convention attributes and vLLM's
  latency attributes (seconds). vLLM's counterpart is ``OutputProcessor.do_tracing`` in
  ``vllm/v1/engine/output_processor.py``.

Cheap when tracing records nothing: no span, no attribute built, and the caller's headers
pass through unchanged.

Also here, the request's side of live telemetry in the API server (``LiveRequests``): the
``arrived``, ``first_token`` and ``aborted`` events engine-top shows for each request, and the
gauge of requests still waiting for the engine's first output. vLLM has no counterpart.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from engine.utils.processes import EngineDeadError
from tracing import add_span_event, catalogue, is_recording, record_span, start_span
from tracing.propagation import TRACE_HEADERS, extract_trace_context, inject_trace_headers
from tracing.telemetry.publisher import telemetry

if TYPE_CHECKING:
    from engine.frontend.output_processor import RequestState
    from engine.frontend.outputs import PoolingRequestOutput, RequestOutput
    from engine.metrics.stats import FinishedRequestStats


def extract_trace_headers(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace-context headers (``traceparent``, ``tracestate``) of an HTTP request,
    or None when it has none (vLLM: ``extract_trace_headers`` in ``vllm/tracing.py``)."""
    found = {name: headers[name] for name in TRACE_HEADERS if name in headers}
    return found or None


def start_request_trace(
    request_id: str, headers: Mapping[str, str] | None, arrived_ns: int, route: str
) -> RequestTrace:
    """The ``api_server.request`` span of one request (see ``RequestTrace``), from its HTTP
    ``headers``, its arrival (Unix ns) and the ``route`` it came in on
    (``"/v1/chat/completions"``, ...)."""
    return RequestTrace(request_id, extract_trace_headers(headers or {}), arrived_ns, route)


class RequestTrace:
    """The root of one request's trace in the API server: ``api_server.request``, from the
    HTTP arrival (``arrived_ns``) to the last byte sent, a child of the caller's W3C
    ``traceparent`` when one came (vLLM honours it the same way).

    ``engine_headers`` is what the engine requests carry (``EngineCoreRequest.trace_headers``):
    this span's context, so the engine core's spans for the request (input thread, queues,
    the scheduler's waiting, prefill, decode) and the ``llm_request`` span join this trace.
    When tracing records nothing, the caller's headers pass through unchanged.
    """

    def __init__(self, request_id: str, incoming: dict[str, str] | None, arrived_ns: int, route: str) -> None:
        self.request_id = request_id
        self.engine_headers = incoming
        self.span = None
        self._ended = False
        if is_recording():
            attributes = {catalogue.ATTR_GEN_AI_REQUEST_ID: request_id, catalogue.ATTR_HTTP_ROUTE: route}
            self.span = start_span(catalogue.API_SERVER_REQUEST, parent=extract_trace_context(incoming),
                                   attributes=attributes, kind=SpanKind.SERVER, start_ns=arrived_ns)  # fmt: skip
            self.context = trace.set_span_in_context(self.span)
            self.engine_headers = inject_trace_headers(self.context) or incoming

    def record_inputs(self, start_ns: int, end_ns: int) -> None:
        """``api_server.process_inputs``: tokenization (and the chat template), timed by the caller."""
        if self.span is None:
            return
        record_span(catalogue.API_SERVER_PROCESS_INPUTS, start_ns=start_ns, end_ns=end_ns, parent=self.context,
                    attributes={catalogue.ATTR_GEN_AI_REQUEST_ID: self.request_id})  # fmt: skip

    def end(self, error: BaseException | None = None, num_chunks_sent: int = 0) -> None:
        """End the span. ``error``: what ended the request early; a ``CancelledError`` or
        ``GeneratorExit`` is the client going away (the route cancelled the work, or the
        stream was closed after ``num_chunks_sent`` chunks): a ``glassbox.client_disconnected``
        event, not an error status. Anything else is recorded as the span's error."""
        if self.span is None or self._ended:
            return
        self._ended = True
        if isinstance(error, (GeneratorExit, asyncio.CancelledError)):
            add_span_event(self.span, catalogue.EVENT_CLIENT_DISCONNECTED,
                           {catalogue.ATTR_NUM_CHUNKS_SENT: num_chunks_sent})  # fmt: skip
        elif error is not None:
            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        self.span.end()

    def wrap_stream(self, stream: AsyncIterator[str]) -> AsyncIterator[str]:
        """``stream``, with the span ended after its last chunk (or when it is closed early);
        ``stream`` itself when there is no span (tracing records nothing): one async
        generator less for every chunk to pass through."""
        if self.span is None:
            return stream
        return self._wrap_stream(stream)

    async def _wrap_stream(self, stream: AsyncIterator[str]) -> AsyncIterator[str]:
        error: BaseException | None = None
        num_chunks = 0
        try:
            # Closing us closes ``stream`` first (its engine abort runs inside this span).
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    yield chunk
                    num_chunks += 1
        except BaseException as e:
            error = e
            raise
        finally:
            self.end(error, num_chunks)


def do_tracing(state: RequestState, done: FinishedRequestStats, model_name: str | None, now: float) -> None:
    """The ``llm_request`` span of a request that finished (or was aborted) at ``now`` (Unix s):
    arrival → finish, a child of the trace context the request came with.

    Carries the GenAI semantic-convention attributes and vLLM's latency attributes (seconds,
    from ``done``); the ones a request never reached (no token yet, never scheduled) are
    left out. A no-op, before any attribute is built, when tracing records nothing.
    """
    if not is_recording():
        return
    params = state.sampling_params
    req = state.stats
    num_prompt = len(state.prompt_token_ids)
    attributes: dict[str, Any] = {
        catalogue.ATTR_GEN_AI_REQUEST_ID: state.request_id,
        catalogue.ATTR_GEN_AI_REQUEST_MODEL: model_name,
        catalogue.ATTR_GEN_AI_RESPONSE_MODEL: model_name,
        catalogue.ATTR_GEN_AI_USAGE_PROMPT_TOKENS: num_prompt,
        catalogue.ATTR_GEN_AI_USAGE_COMPLETION_TOKENS: req.num_generation_tokens,
        catalogue.ATTR_GEN_AI_USAGE_INPUT_TOKENS: num_prompt,
        catalogue.ATTR_GEN_AI_USAGE_OUTPUT_TOKENS: req.num_generation_tokens,
        catalogue.ATTR_REQUEST_NUM_CACHED_TOKENS: state.num_cached_tokens,
        catalogue.ATTR_GEN_AI_RESPONSE_FINISH_REASONS: [done.finish_reason],
        catalogue.ATTR_GEN_AI_LATENCY_E2E: done.e2e_latency,
    }
    if params is not None:  # a pooling request has no sampling params
        attributes[catalogue.ATTR_GEN_AI_REQUEST_MAX_TOKENS] = params.max_tokens
        attributes[catalogue.ATTR_GEN_AI_REQUEST_TEMPERATURE] = params.temperature
        attributes[catalogue.ATTR_GEN_AI_REQUEST_TOP_P] = params.top_p
        attributes[catalogue.ATTR_GEN_AI_REQUEST_N] = params.n
    if req.scheduled_ts:
        attributes[catalogue.ATTR_GEN_AI_LATENCY_TIME_IN_QUEUE] = done.queued_time
    if req.num_generation_tokens or req.first_token_ts:
        attributes[catalogue.ATTR_GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = req.first_token_latency
        if req.scheduled_ts:
            attributes[catalogue.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = done.prefill_time
            attributes[catalogue.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = done.inference_time
        attributes[catalogue.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = done.decode_time
    record_span(
        catalogue.LLM_REQUEST,
        start_ns=int(req.arrival_time * 1e9),
        end_ns=int(now * 1e9),
        attributes=attributes,
        parent=extract_trace_context(state.trace_headers),
        kind=SpanKind.SERVER,
    )


def abort_reason(error: BaseException) -> str:
    """Why a request ended unfinished, in plain words for live telemetry's ``aborted`` event
    (engine-top shows "aborted: engine died"): "client disconnected", "engine died", else the
    exception's type and the first line of its message, at most 80 characters."""
    if isinstance(error, (GeneratorExit, asyncio.CancelledError)):
        return "client disconnected"
    if isinstance(error, EngineDeadError):
        return "engine died"
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = f"{type(error).__name__}: {first}" if first else type(error).__name__
    return text if len(text) <= 80 else text[:79] + "…"


class LiveRequests:
    """The API server's requests as live telemetry sees them (engine-top's request rows).

    ``track`` wraps one ``AsyncLLM.generate`` call: ``arrived`` as it starts, ``first_token``
    with the first output (its whole prompt was computed by then), ``aborted`` (with
    ``abort_reason``) when it ends unfinished. ``waiting_for_engine``: the requests sent to
    the engine that have no output yet (the ``api.waiting_for_engine`` gauge). All calls
    are no-ops but a set update when telemetry is off (``NULL_PUBLISHER``).
    """

    def __init__(self) -> None:
        self.waiting_for_engine: set[str] = set()

    @contextlib.contextmanager
    def track(self, request_id: str, num_prompt_tokens: int) -> Iterator[LiveRequest]:
        live = LiveRequest(self, request_id)
        telemetry().publish_request_event(request_id, "arrived", num_prompt_tokens=num_prompt_tokens)
        self.waiting_for_engine.add(request_id)
        error: BaseException | None = None
        try:
            yield live
        except BaseException as e:
            error = e
            raise
        finally:
            self.waiting_for_engine.discard(request_id)
            if not live.finished:
                reason = "not finished" if error is None else abort_reason(error)
                telemetry().publish_request_event(request_id, "aborted", reason=reason)


class LiveRequest:
    """One request ``LiveRequests.track`` follows; ``output`` is told each ``RequestOutput``."""

    def __init__(self, requests: LiveRequests, request_id: str) -> None:
        self.requests = requests
        self.request_id = request_id
        self.finished = False

    def output(self, output: RequestOutput | PoolingRequestOutput) -> None:
        self.finished = output.finished
        if self.request_id in self.requests.waiting_for_engine:
            self.requests.waiting_for_engine.discard(self.request_id)
            n_prompt = len(output.prompt_token_ids)  # a first token: its whole prompt was computed
            # A pooling request's vector stands for its first token (and has no output tokens).
            outputs = output.outputs if isinstance(output.outputs, list) else []
            telemetry().publish_request_event(
                self.request_id, "first_token", num_prompt_tokens=n_prompt, num_computed_tokens=n_prompt,
                num_output_tokens=sum(len(o.token_ids) for o in outputs),
            )  # fmt: skip
