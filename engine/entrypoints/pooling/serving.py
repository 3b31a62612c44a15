"""``POST /v1/embeddings`` and ``POST /pooling``: prompts in, one vector per prompt out.

Mirrors vLLM 0.32's ``vllm/entrypoints/pooling/embed/serving.py`` (``ServingEmbedding``),
``pooling/serving.py`` (``ServingPooling``) and what they share (``base/serving.py``). One
request may carry several prompts; each becomes its own engine request (``<id>-<i>``), all
run concurrently through ``AsyncLLM.encode``, and ``data[i]`` is prompt ``i``'s vector.

The flow is the completion route's, so the routes meet the same rules the same way: the model
check, the engine's liveness, each text refused before it is tokenized when it cannot fit,
every engine request built by ``InputProcessor.process_inputs`` (the pooling prompt rule: up
to ``max_model_len`` tokens, vLLM's for embeddings; ``PoolingParams.verify``) before any is
queued, the request's trace (``api_server.request`` with ``http.route``, the engine spans
under it), and the ``vllm:`` metrics the output processor records (prompt tokens, time to
first token, ``request_success`` with finished reason ``stop``).

Left out: chat-style inputs (``messages``), Cohere's ``/v2/embed``, binary responses
(``bytes``), truncation, and the other pooling tasks (``classify``, ``token_*``, ``plugin``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from engine.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    bad_request_from_value_error,
    merge_async_iterators,
    random_uuid,
)
from engine.entrypoints.pooling.protocol import (
    LEFT_OUT_FIELDS,
    EmbeddingCompletionRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    PoolingCompletionRequest,
    PoolingRequestFields,
    PoolingResponse,
    PoolingResponseData,
)
from engine.frontend.outputs import PoolingRequestOutput
from engine.frontend.request_tracing import start_request_trace
from engine.pooling_params import PoolingParams

# vLLM 0.32's names of the pooling tasks it removed, and its message for each.
_REMOVED_TASKS = {
    "score": "`score` task was removed; use `classify` instead.",
    "encode": "`encode` task was removed; use `token_embed` or `token_classify` instead.",
}


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A float32 vector as a response carries it: a list of numbers, or (``base64``) its
    float32 bytes in this machine's order, base64-encoded (vLLM's default ``embed_dtype``
    float32 and ``endianness`` native; the ``openai`` client decodes them with numpy)."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(vector, dtype=np.float32).tobytes()).decode("ascii")
    return vector.tolist()


class ServingPoolingBase(OpenAIServing):
    """What the two pooling routes share: checks, prompts, engine requests, the trace."""

    def check_pooling_fields(self, request: PoolingRequestFields) -> None:
        """Refuse what is left out (``protocol.LEFT_OUT_FIELDS``) and ``normalize`` (vLLM 0.32
        renamed it ``use_activation`` and refuses the old name); log unknown fields.

        Raises:
            OpenAIError: (400) naming the field.
        """
        extra = request.model_extra or {}
        if "normalize" in extra:
            raise OpenAIError(
                "Parameter `normalize` was removed; use `use_activation` instead.", param="normalize"
            )
        for field, message in LEFT_OUT_FIELDS.items():
            if getattr(request, field) is not None:
                raise OpenAIError(message, param=field)
        self.log_unknown_fields(request)

    async def pool(
        self,
        request: PoolingRequestFields,
        params: PoolingParams,
        request_id: str,
        route: str,
        headers: dict[str, str] | None,
        arrived_ns: int,
    ) -> tuple[list[list[int]], list[PoolingRequestOutput]]:
        """Run every prompt of ``request`` through the engine with ``params``: returns each
        prompt's token ids and its output, in the request's order.

        Raises:
            OpenAIError: a bad request (400), naming ``input`` or the params field at fault.
            EngineDeadError: the engine is dead (503).
        """
        tokenize_ns = time.time_ns()
        prompts = await asyncio.to_thread(
            self.render_prompts, request.input, "input", request.add_special_tokens
        )
        tokenized_ns = time.time_ns()
        process_inputs = self.engine.input_processor.process_inputs
        try:
            engine_requests = [
                process_inputs(f"{request_id}-{i}", {"prompt_token_ids": ids}, params)
                for i, (_, ids) in enumerate(prompts)
            ]
        except ValueError as e:
            raise bad_request_from_value_error(e, "input") from None
        rtrace = start_request_trace(request_id, headers, arrived_ns, route)
        rtrace.record_inputs(tokenize_ns, tokenized_ns)
        generators = []
        for engine_request in engine_requests:
            engine_request.trace_headers = rtrace.engine_headers
            generators.append(self.engine.encode(engine_request, params, engine_request.request_id))
        finals: list[PoolingRequestOutput | None] = [None] * len(prompts)
        error: BaseException | None = None
        outputs: AsyncIterator[tuple[int, Any]] = merge_async_iterators(*generators)
        try:
            async with contextlib.aclosing(outputs):
                async for i, output in outputs:
                    finals[i] = output
        except ValueError as e:
            error = e
            raise bad_request_from_value_error(e, "input") from None
        except BaseException as e:
            error = e
            raise
        finally:
            rtrace.end(error)
        assert all(final is not None for final in finals), "the engine ended a request without its output"
        return [ids for _, ids in prompts], finals  # type: ignore[return-value]

    def make_pooling_usage(self, prompt_token_ids: list[list[int]], finals: list[PoolingRequestOutput]):
        """The response's ``usage``: the prompts' tokens, none generated (vLLM's)."""
        num_cached = sum(final.num_cached_tokens for final in finals)
        return self.make_usage(sum(len(ids) for ids in prompt_token_ids), 0, num_cached)


class ServingEmbedding(ServingPoolingBase):
    """``POST /v1/embeddings`` (vLLM's ``ServingEmbedding``)."""

    async def create_embedding(
        self, request: EmbeddingCompletionRequest, headers: dict[str, str] | None = None
    ) -> EmbeddingResponse:
        """One embedding per prompt of ``request.input``, in its order.

        Raises:
            OpenAIError: a bad request (400), an unknown model (404).
            EngineDeadError: the engine is dead (503).
        """
        arrived_ns = time.time_ns()
        self.check_model(request.model)
        self.check_engine_alive()
        self.check_pooling_fields(request)
        request_id = f"embd-{random_uuid()}"
        prompts, finals = await self.pool(
            request, request.to_pooling_params(), request_id, "/v1/embeddings", headers, arrived_ns
        )
        return await asyncio.to_thread(self._response, request, request_id, prompts, finals)

    def _response(
        self,
        request: EmbeddingCompletionRequest,
        request_id: str,
        prompts: list[list[int]],
        finals: list[PoolingRequestOutput],
    ) -> EmbeddingResponse:
        data = [
            EmbeddingResponseData(
                index=i, embedding=encode_vector(final.outputs.data, request.encoding_format)
            )
            for i, final in enumerate(finals)
        ]
        usage = self.make_pooling_usage(prompts, finals)
        return EmbeddingResponse(id=request_id, model=self.served_model_name, data=data, usage=usage)


class ServingPooling(ServingPoolingBase):
    """``POST /pooling`` (vLLM's ``ServingPooling``): the pooled vectors of the model's task."""

    async def create_pooling(
        self, request: PoolingCompletionRequest, headers: dict[str, str] | None = None
    ) -> PoolingResponse:
        """The pooled vector of each prompt of ``request.input``, in its order (normalised
        unless ``use_activation`` is false).

        Raises:
            OpenAIError: a bad request (400: a task the model does not serve, ``dimensions``),
                an unknown model (404).
            EngineDeadError: the engine is dead (503).
        """
        arrived_ns = time.time_ns()
        self.check_model(request.model)
        self.check_engine_alive()
        self.check_pooling_fields(request)
        self._verify_pooling_task(request)
        request_id = f"pool-{random_uuid()}"
        prompts, finals = await self.pool(
            request, request.to_pooling_params(), request_id, "/pooling", headers, arrived_ns
        )
        return await asyncio.to_thread(self._response, request, request_id, prompts, finals)

    def _verify_pooling_task(self, request: PoolingCompletionRequest) -> None:
        """vLLM's ``_verify_pooling_task``: ``dimensions`` is not taken here, and ``task`` must be
        the model's (``embed``; None means it)."""
        if request.dimensions is not None:
            raise OpenAIError("dimensions is currently not supported", param="dimensions")
        task = request.task
        if task in _REMOVED_TASKS:
            raise OpenAIError(_REMOVED_TASKS[task], param="task")
        supported = self.engine.model_config.supported_tasks
        if task is not None and task not in supported:
            raise OpenAIError(f"Unsupported task: {task!r} Supported tasks: {supported}", param="task")

    def _response(
        self,
        request: PoolingCompletionRequest,
        request_id: str,
        prompts: list[list[int]],
        finals: list[PoolingRequestOutput],
    ) -> PoolingResponse:
        data = [
            PoolingResponseData(index=i, data=encode_vector(final.outputs.data, request.encoding_format))
            for i, final in enumerate(finals)
        ]
        usage = self.make_pooling_usage(prompts, finals)
        return PoolingResponse(id=request_id, model=self.served_model_name, data=data, usage=usage)
