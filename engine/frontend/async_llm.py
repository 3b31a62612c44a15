"""``AsyncLLM``: the engine as the API server sees it — ``generate()`` as an async stream.

Mirrors vLLM's ``vllm/v1/engine/async_llm.py``. It holds the same three pieces as the offline
``LLM`` — ``InputProcessor``, ``OutputProcessor``, and an engine-core client (here
``AsyncMPClient``) — plus one background task, the **output handler**, which pulls
``EngineCoreOutputs`` from the engine core, runs them through the output processor
(detokenize, stop strings, ``n`` fan-in) and hands each ``RequestOutput`` to the queue of the
``generate()`` call waiting for it.

``encode()`` is ``generate()``'s twin for a pooling model (``--runner pooling``): the same
path with ``PoolingParams``, one ``PoolingRequestOutput`` at the end (vLLM's
``AsyncLLM.encode``).

Imports no torch: the engine core and workers, in their own processes, hold the model.

Errors: ``generate()`` raises ``ValueError`` for a bad prompt (too long, bad token ids) before
anything is queued, and ``EngineDeadError`` when the engine died — also for requests already
streaming, which end with that error.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import msgspec

from engine.config import EngineConfig
from engine.core.messages import EngineCoreRequest, EnginesInfo
from engine.frontend.core_client import AsyncMPClient
from engine.frontend.engine_stats import EngineStatsTable
from engine.frontend.input_processor import InputProcessor
from engine.frontend.output_processor import OutputProcessor, ParentRequest
from engine.frontend.outputs import PoolingRequestOutput, PromptType, RequestOutput
from engine.frontend.request_tracing import LiveRequests
from engine.frontend.request_tracing import abort_reason as abort_reason  # re-exported: its old home
from engine.frontend.tokenizer import get_tokenizer
from engine.logger import init_logger
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.utils.processes import EngineDeadError
from tracing.propagation import attached_trace_context
from tracing.telemetry import events

logger = init_logger(__name__)


class AsyncLLM:
    """The asynchronous engine client used by the API server.

    Args:
        config: the validated engine config.
        run_dir: this instance's run directory (sockets, status files, manifest).
        client_index: this API server's index among the engine cores' clients.
        num_clients: how many API servers there are (``--api-server-count``).
        engines: None for API server 0, which launches the engine cores; for the others,
            what API server 0 learned at start-up (``EnginesInfo``), to attach to them.
    """

    def __init__(
        self,
        config: EngineConfig,
        run_dir: Path,
        *,
        client_index: int = 0,
        num_clients: int = 1,
        engines: EnginesInfo | None = None,
    ) -> None:
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = get_tokenizer(config.model_config.tokenizer)
        if config.model_config.chat_template is not None:  # --chat-template replaces the tokenizer's
            self.tokenizer.chat_template = config.model_config.chat_template
        self.log_requests = config.observability_config.enable_log_requests
        self.input_processor = InputProcessor(
            config.model_config,
            self.tokenizer,
            config.parallel_config.data_parallel_size,
            config.structured_outputs_config,
        )
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=False)
        self.engine_core = AsyncMPClient(
            config, run_dir, client_index=client_index, num_clients=num_clients, engines=engines
        )
        self.queues: dict[str, asyncio.Queue[RequestOutput | PoolingRequestOutput | BaseException]] = {}
        # The requests' live-telemetry events, and those waiting for the engine's first output.
        self.live_requests = LiveRequests()
        self.output_handler: asyncio.Task | None = None
        self.dead_error: EngineDeadError | None = None
        # Set by ``abort_all`` (the server shutting down): every later ``generate()`` raises it.
        self.refuse_error: BaseException | None = None
        # Called once with the error when the engine dies (the server decides what to do).
        self.on_engine_dead: list[Any] = []

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's defaults, overridden by the model's (``ModelConfig.get_diff_sampling_param``:
        ``--generation-config``). The API server fills a request's unset fields from these."""
        return SamplingParams.from_defaults(self.model_config.get_diff_sampling_param())

    # ------------------------------------------------------------------ requests

    async def generate(
        self,
        prompt: EngineCoreRequest | PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        trace_headers: dict[str, str] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream ``RequestOutput``s for one request (``sampling_params.output_kind`` decides
        whether each carries everything so far or only what is new).

        ``prompt``: a prompt, which the input processor turns into the engine request here,
        or that engine request itself, built by the caller (``InputProcessor.process_inputs``:
        the API server does, so that a bad request is refused before a stream answers 200);
        then ``sampling_params``, ``priority`` and ``trace_headers`` are the request's own
        (vLLM's ``AsyncLLM.add_request`` takes either too).

        Closing the generator early (a client that went away) aborts the request in the
        engine, so its KV blocks are freed.

        Raises:
            ValueError: bad prompt or parameters (nothing was queued).
            EngineDeadError: the engine is dead, or died while this request ran.
        """
        request, text = self._check_and_process(request_id, prompt, sampling_params, priority, trace_headers)
        parent, requests = None, [request]
        if request.sampling_params.n > 1:
            parent, requests = self._fan_out(request_id, request)
        async for output in self._run_requests(request_id, requests, text, parent, sampling_params):
            yield output

    async def encode(
        self,
        prompt: EngineCoreRequest | PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        priority: int = 0,
        trace_headers: dict[str, str] | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Pool one prompt (a ``--runner pooling`` model): yields its one
        ``PoolingRequestOutput`` when the engine finished it (vLLM's ``AsyncLLM.encode``).

        ``prompt`` as for ``generate``: a prompt, or the engine request the caller built with
        ``InputProcessor.process_inputs`` and these ``pooling_params``. Closing the generator
        early aborts the request in the engine.

        Raises:
            ValueError: bad prompt or parameters, or a model that does not pool (nothing was
                queued).
            EngineDeadError: the engine is dead, or died while this request ran.
        """
        request, text = self._check_and_process(request_id, prompt, pooling_params, priority, trace_headers)
        async for output in self._run_requests(request_id, [request], text, None, pooling_params):
            yield output

    def _check_and_process(
        self,
        request_id: str,
        prompt: EngineCoreRequest | PromptType,
        params: SamplingParams | PoolingParams,
        priority: int,
        trace_headers: dict[str, str] | None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Refuse a request when the engine is dead or shutting down; else its engine
        request (built here unless the caller built it) and its prompt text."""
        if self.dead_error is not None:
            raise self.dead_error
        if self.refuse_error is not None:
            raise copy.copy(self.refuse_error)
        self._ensure_output_handler()
        if isinstance(prompt, EngineCoreRequest):
            return prompt, None
        return self._process_inputs(request_id, prompt, params, priority, trace_headers)

    async def _run_requests(
        self,
        request_id: str,
        requests: list[EngineCoreRequest],
        text: str | None,
        parent: ParentRequest | None,
        params: SamplingParams | PoolingParams,
    ) -> AsyncGenerator[RequestOutput | PoolingRequestOutput, None]:
        """Send ``requests`` (one, or ``n`` children of ``parent``) to the engine and yield the
        outputs that come back under ``request_id`` until the last; an early close aborts."""
        request = requests[0]
        if self.log_requests:
            self._log_request(request_id, text, request.prompt_token_ids, params)
        queue: asyncio.Queue[RequestOutput | PoolingRequestOutput | BaseException] = asyncio.Queue()
        self.queues[request_id] = queue
        finished = False
        try:
            with self.live_requests.track(request_id, len(requests[0].prompt_token_ids)) as live:
                for index, child in enumerate(requests):
                    self.output_processor.add_request(child, text, parent, index)
                    await self.engine_core.add_request_async(child)
                while not finished:
                    item = await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    live.output(item)
                    finished = item.finished
                    yield item
        finally:
            self.queues.pop(request_id, None)
            if not finished:
                # Shielded: a cancelled HTTP handler must still get its abort through. In the
                # request's trace: the ABORT message carries its context to the engine core.
                with attached_trace_context(request.trace_headers):
                    await asyncio.shield(self.abort(request_id))

    def _process_inputs(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        priority: int,
        trace_headers: dict[str, str] | None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """The engine request for a prompt ``generate()`` or ``encode()`` was given (the input
        processor's), and the prompt's text for the outputs (None for token ids)."""
        request = self.input_processor.process_inputs(
            request_id, prompt, params, None, priority, trace_headers
        )
        return request, prompt if isinstance(prompt, str) else prompt.get("prompt")

    @staticmethod
    def _fan_out(
        request_id: str, request: EngineCoreRequest
    ) -> tuple[ParentRequest, list[EngineCoreRequest]]:
        """``n`` > 1: one engine request per sample, gathered back under ``request_id`` by the
        returned ``ParentRequest`` (vLLM's ``AsyncLLM.add_request``)."""
        parent = ParentRequest(request_id, request.sampling_params)
        children = map(parent.get_child_info, range(parent.n))
        return parent, [
            msgspec.structs.replace(request, request_id=i, sampling_params=p) for i, p in children
        ]

    def _log_request(
        self,
        request_id: str,
        text: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
    ) -> None:
        """``--enable-log-requests``: one line per request (vLLM's ``RequestLogger``), with the
        prompt cut to ``--max-log-len`` characters / token ids. Params show only the fields
        that differ from their defaults (``SamplingParams()``'s or ``PoolingParams()``'s)."""
        limit = self.config.observability_config.max_log_len
        ids = prompt_token_ids if limit is None else prompt_token_ids[:limit]
        if text is None:  # token ids only (chat prompts, rendered by the server): show them as text
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if limit is not None:
            text = text[:limit]
        logger.info(
            "Received request %s: prompt: %r, prompt_token_ids: %s (%d tokens), params: %s",
            request_id,
            text,
            ids,
            len(prompt_token_ids),
            msgspec.json.encode(params).decode(),
        )

    async def abort(self, request_id: str) -> None:
        """Stop a request (or a parent and all its children) and free its KV blocks.

        Each one still in flight ends its ``llm_request`` span with finish reason ``abort``;
        ``--enable-log-requests`` logs ``Aborted request <id>.`` (vLLM's line). Unknown or
        finished ids do nothing.
        """
        child_ids = self.output_processor.abort_requests([request_id])
        if child_ids and self.dead_error is None:
            try:
                await self.engine_core.abort_requests_async(child_ids)
            except EngineDeadError:
                pass
        if child_ids and self.log_requests:
            logger.info("Aborted request %s.", request_id)

    def abort_all(self, error: BaseException) -> int:
        """End every request in flight with ``error`` and refuse new ones with it.

        Each open ``generate()`` raises (a copy of) ``error`` after the outputs it already
        has, then aborts its request in the engine as any early end does (its KV blocks are
        freed); every later ``generate()`` call raises it at once. The API server calls this
        when its ``--shutdown-timeout`` has run out, with the error its clients should see
        (vLLM: the requests still running when the drain times out are aborted).

        Returns:
            How many requests were in flight.
        """
        self.refuse_error = error
        for queue in self.queues.values():
            queue.put_nowait(copy.copy(error))
        return len(self.queues)

    # ------------------------------------------------------------------ output handler

    def start_output_handler(self) -> None:
        """Start reading the engines' outputs now rather than at the first request (needs a
        running event loop). The API server calls it as it starts serving: an engine core's
        last words (``ENGINE_CORE_DEAD``) come on the output socket, and an idle server that
        does not read it learns of the death only once the engine core's process has exited —
        seconds later under load, with the rest of the tree waiting on it."""
        self._ensure_output_handler()

    def _ensure_output_handler(self) -> None:
        if self.output_handler is None:
            self.output_handler = asyncio.get_running_loop().create_task(self._run_output_handler(),
                                                                         name="AsyncLLM.output_handler")  # fmt: skip

    async def _run_output_handler(self) -> None:
        """Pull engine outputs forever; route each ``RequestOutput`` to its request's queue."""
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                processed = self.output_processor.process_outputs(
                    outputs.outputs, outputs.timestamp, outputs.engine_index
                )
                if processed.reqs_to_abort:
                    await self.engine_core.abort_requests_async(processed.reqs_to_abort)
                for out in processed.request_outputs:
                    queue = self.queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except EngineDeadError as e:
            self._engine_died(e)
        # A bug in the frontend must not leave requests hanging. (A CancelledError, the
        # shutdown cancelling this task, is a BaseException: it passes.)
        except Exception as e:
            logger.exception("output handler failed")
            self._engine_died(EngineDeadError(f"the API server's output handler failed: {e!r}"))

    def _engine_died(self, error: EngineDeadError) -> None:
        self.dead_error = error
        for queue in self.queues.values():
            queue.put_nowait(error)
        for callback in self.on_engine_dead:
            callback(error)

    # ------------------------------------------------------------------ utilities

    @property
    def stats_table(self) -> EngineStatsTable:
        """The latest ``SchedulerStats`` per engine, kept up to date by the output handler
        from the stats that come with the outputs (what ``/metrics`` reads)."""
        return self.engine_core.stats_table

    async def get_scheduler_stats(self):
        """The scheduler's counters now (running, waiting, KV usage, ...), asked of the engine
        core by a utility call; ``stats_table`` has the same figures without one."""
        self._ensure_output_handler()
        return await self.engine_core.call_utility_async("get_scheduler_stats")

    async def get_kv_cache_info(self) -> dict[str, int]:
        self._ensure_output_handler()
        return await self.engine_core.call_utility_async("get_kv_cache_info")

    def telemetry_gauges(self) -> dict[str, float]:
        """This API server's queue gauges for live telemetry (called from the heartbeat thread)."""
        return {
            events.GAUGE_API_WAITING_FOR_ENGINE: len(self.live_requests.waiting_for_engine),
            events.GAUGE_API_PENDING_OUTPUTS: sum(q.qsize() for q in list(self.queues.values())),
        }

    async def check_health(self) -> None:
        """Raises ``EngineDeadError`` when the engine is dead."""
        if self.dead_error is not None:
            raise self.dead_error
        self.engine_core._check_alive()

    def tree_problems(self) -> list[str]:
        """Why the process tree cannot serve now: one line per process of it that is stopped
        by a signal, frozen or dead (role, pid, why); empty while all run. ``/health``
        answers 503 with them, before the supervisor's timeouts tear the tree down."""
        return self.engine_core.tree_problems()

    def shutdown(self) -> None:
        if self.output_handler is not None:
            self.output_handler.cancel()
        self.engine_core.shutdown()
