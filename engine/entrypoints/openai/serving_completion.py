"""``POST /v1/completions``: prompts in, text out (whole, or streamed as Server-Sent Events).

Mirrors vLLM's ``vllm/entrypoints/openai/serving_completion.py``
(``OpenAIServingCompletion``). One request may carry several prompts; each becomes its own
engine request (``<id>-<i>``), run concurrently, and prompt ``i``'s sample ``j`` is choice
``i * n + j``.

A full response asks the engine for ``FINAL_ONLY`` outputs (one per prompt, at the end); a
stream asks for ``DELTA`` outputs, so each chunk carries only new text — and text that could
still turn into a stop string is held back by the output processor, never sent. As in vLLM, a
stream has one chunk per engine output that brought new tokens, even when its text is empty
(a byte token that completes no character yet, a skipped special token, text held back):
a client sees every step, and ``vllm bench serve`` times the first token at the first chunk.

``logprobs.text_offset`` is where each token's text starts in the choice's text: the
``CompletionOutput.text_offsets`` the output processor's detokenizer recorded as it decoded
the tokens — the same offsets whole or streamed, whatever text a stream still holds back, and
a character split over several byte tokens counts once. Only an echoed prompt's offsets are
found here, by decoding the prompt the same way (``_echo``).

Left out: ``suffix``, ``best_of``, prompt embeddings, ``prompt_logprobs`` as a separate
field, ``continuous_usage_stats``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from engine.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamChoiceWire,
    CompletionStreamResponse,
)
from engine.entrypoints.openai.serving_engine import (
    MIN_LOGPROB,
    SSE_DONE,
    OpenAIServing,
    StreamChunks,
    bad_request_from_value_error,
    check_finished_without_error,
    merge_async_iterators,
    random_uuid,
    sse_event,
    stream_error_event,
)
from engine.entrypoints.openai.structured_outputs import structured_outputs_of
from engine.frontend.detokenizer import IncrementalDetokenizer, backend_tokenizer
from engine.frontend.outputs import CompletionOutput, LogprobsDict, RequestOutput
from engine.frontend.request_tracing import RequestTrace, start_request_trace
from engine.logger import init_logger

logger = init_logger(__name__)


class OpenAIServingCompletion(OpenAIServing):
    """The completions route (vLLM's ``OpenAIServingCompletion``)."""

    async def create_completion(
        self, request: CompletionRequest, headers: dict[str, str] | None = None
    ) -> CompletionResponse | AsyncIterator[str]:
        """Serve one completions request.

        Returns:
            The ``CompletionResponse``, or (``stream``) an async iterator of SSE lines that
            ends with ``data: [DONE]``. Closing that iterator aborts the engine requests.

        Raises:
            OpenAIError: a bad request (400), an unknown model (404).
            EngineDeadError: the engine is dead (503).
        """
        arrived_ns = time.time_ns()
        self.check_model(request.model)
        self.check_engine_alive()
        self.check_unsupported(request)
        max_tokens = self.resolve_max_tokens(request.max_tokens)
        structured_outputs, renames = structured_outputs_of(request)
        # Tokenizing a long prompt takes a while: off the event loop, so other requests stream on.
        tokenize_ns = time.time_ns()
        prompts = await asyncio.to_thread(self.render_prompts, request.prompt, "prompt")
        tokenized_ns = time.time_ns()
        request_id = f"cmpl-{random_uuid()}"
        process_inputs = self.engine.input_processor.process_inputs
        try:
            params = request.to_sampling_params(max_tokens, self.default_sampling_params, structured_outputs)
            engine_requests = [
                process_inputs(f"{request_id}-{i}", {"prompt_token_ids": ids}, params)
                for i, (_, ids) in enumerate(prompts)
            ]
        except ValueError as e:
            raise bad_request_from_value_error(e, "prompt", renames) from None

        rtrace = start_request_trace(request_id, headers, arrived_ns, "/v1/completions")
        rtrace.record_inputs(tokenize_ns, tokenized_ns)
        generators = []
        for engine_request in engine_requests:
            engine_request.trace_headers = rtrace.engine_headers
            generators.append(self.engine.generate(engine_request, params, engine_request.request_id))
        outputs = merge_async_iterators(*generators)
        if request.stream:
            return rtrace.wrap_stream(self._stream(request, request_id, prompts, outputs))
        return await self._full(request, request_id, prompts, outputs, rtrace)

    async def _full(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[tuple[str | None, list[int]]],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        rtrace: RequestTrace,
    ) -> CompletionResponse:
        """The whole response, once every prompt's final output came (``FINAL_ONLY``)."""
        finals: list[RequestOutput | None] = [None] * len(prompts)
        error: BaseException | None = None
        try:
            async with contextlib.aclosing(outputs):
                async for i, output in outputs:
                    finals[i] = output
        except ValueError as e:
            error = e
            raise bad_request_from_value_error(e, "prompt") from None
        except BaseException as e:
            error = e
            raise
        finally:
            rtrace.end(error)
        # An echo replays the prompt through a detokenizer, logprobs make a dict per token:
        # off the event loop.
        return await asyncio.to_thread(self._full_response, request, request_id, prompts, finals)

    def _echo(self, text: str | None, token_ids: list[int], with_offsets: bool) -> tuple[str, list[int]]:
        """The prompt as echoed, and (``with_offsets``) each prompt token's offset in it.

        A text prompt is echoed as sent; token ids as their decoding, special tokens shown
        (a prompt ending mid-character ends in U+FFFD). Offsets come from decoding the ids
        one at a time, as the output's do; for a text prompt the decoding that reproduces
        the text is used (special tokens skipped, such as an added BOS, or shown).
        """
        if text is None:
            text = backend_tokenizer(self.tokenizer).decode(token_ids, skip_special_tokens=False)
            if not with_offsets:
                return text, []
            return text, self._replay(token_ids, skip_special_tokens=False).token_offsets
        if not with_offsets:
            return text, []
        replays = [self._replay(token_ids, skip_special_tokens=skip) for skip in (True, False)]
        best = next((r for r in replays if r.output_text == text), replays[0])
        return text, [min(offset, len(text)) for offset in best.token_offsets]

    def _choice_output(
        self,
        request: CompletionRequest,
        out: CompletionOutput,
        shift: int,
        echo: tuple[str, list[int]] | None,
        prompt_ids: list[int],
        prompt_logprobs: list[LogprobsDict | None] | None,
    ) -> tuple[str, list[int], CompletionLogProbs | None]:
        """One output of a choice, as a response shows it: text, token ids and (``logprobs``
        asked for) the logprobs object. Whole and streamed responses both build it here.

        Args:
            out: the engine's output (a stream's delta, or a full response's whole output).
            shift: characters in front of the output's text (the echo a stream already sent
                in the choice's first chunk); its text offsets move by that much.
            echo: ``_echo``'s prompt text and token offsets, to put in front of the output
                (the choice's first chunk, or a full response), or None.
            prompt_ids, prompt_logprobs: the prompt's token ids and per-token logprobs (None
                for tokens without any), used only with ``echo``.
        """
        text, token_ids, top = out.text, list(out.token_ids), out.logprobs
        offsets = [shift + offset for offset in out.text_offsets or ()]
        if echo is not None:
            echo_text, echo_offsets = echo
            text, token_ids = echo_text + text, prompt_ids + token_ids
            top = (prompt_logprobs or [None] * len(prompt_ids)) + (top or [])
            offsets = echo_offsets + [len(echo_text) + offset for offset in offsets]
        if request.logprobs is None or top is None:
            return text, token_ids, None
        return text, token_ids, self.create_logprobs(token_ids, top, request.logprobs, offsets)

    def _echoes(
        self, request: CompletionRequest, prompts: list[tuple[str | None, list[int]]]
    ) -> list[tuple[str, list[int]] | None]:
        """Per prompt, its ``_echo`` (None for each when the request does not echo)."""
        if not request.echo:
            return [None] * len(prompts)
        return [self._echo(text, ids, request.logprobs is not None) for text, ids in prompts]

    def _replay(self, token_ids: list[int], skip_special_tokens: bool) -> IncrementalDetokenizer:
        """A detokenizer fed the prompt's ``token_ids``, for its ``token_offsets`` (as the
        output's were recorded)."""
        detok = IncrementalDetokenizer(self.tokenizer, [], skip_special_tokens=skip_special_tokens)
        detok.update(token_ids)
        return detok

    # ------------------------------------------------------------------ full response

    def _full_response(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[tuple[str | None, list[int]]],
        finals: list[RequestOutput | None],
    ) -> CompletionResponse:
        choices: list[CompletionResponseChoice] = []
        prompt_tokens = completion_tokens = num_cached_tokens = 0
        echoes = self._echoes(request, prompts)
        for i, ((_, prompt_ids), final) in enumerate(zip(prompts, finals)):
            assert final is not None, "the engine ended a request without a final output"
            prompt_tokens += len(prompt_ids)
            num_cached_tokens += final.num_cached_tokens
            for out in final.outputs:
                completion_tokens += len(out.token_ids)
                check_finished_without_error(out.finish_reason, out.stop_reason)
                text, _, logprobs = self._choice_output(
                    request, out, 0, echoes[i], prompt_ids, final.prompt_logprobs
                )
                choices.append(
                    CompletionResponseChoice(
                        index=i * request.n + out.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                    )
                )
        usage = self.make_usage(prompt_tokens, completion_tokens, num_cached_tokens)
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(id=request_id, model=self.served_model_name, choices=choices, usage=usage)

    # ------------------------------------------------------------------ stream

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        prompts: list[tuple[str | None, list[int]]],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[str]:
        """SSE chunks, one per choice that moved; usage last (``include_usage``); ``[DONE]``."""
        n = request.n
        created = int(time.time())
        chunks = StreamChunks(CompletionStreamResponse(id=request_id, created=created, model=self.served_model_name,
                                                       choices=[]))  # fmt: skip
        shift = [0] * (len(prompts) * n)  # characters of echoed prompt before each choice's output
        prompt_logprobs: list[list[LogprobsDict | None] | None] = [None] * len(prompts)
        completion_tokens = 0
        num_cached_tokens = [0] * len(prompts)  # per prompt, the latest its outputs said
        try:
            # Each choice's echo, until its first chunk (which starts with it) takes it.
            echoes = [echo for echo in self._echoes(request, prompts) for _ in range(n)]
            async with contextlib.aclosing(outputs):
                async for p, output in outputs:
                    num_cached_tokens[p] = output.num_cached_tokens
                    if output.prompt_logprobs:
                        prompt_logprobs[p] = (prompt_logprobs[p] or []) + output.prompt_logprobs
                    for out in output.outputs:
                        i = p * n + out.index
                        completion_tokens += len(out.token_ids)
                        check_finished_without_error(out.finish_reason, out.stop_reason)
                        echo, echoes[i] = echoes[i], None
                        text, token_ids, logprobs = self._choice_output(
                            request, out, shift[i], echo, prompts[p][1], prompt_logprobs[p]
                        )
                        if echo is not None:
                            shift[i] = len(echo[0])
                        if not text and not token_ids and out.finish_reason is None:
                            continue  # nothing new for this choice (vLLM: "don't return empty chunks")
                        yield chunks.event(
                            CompletionStreamChoiceWire(i, text, logprobs, out.finish_reason, out.stop_reason)
                        )
            if request.stream_options is not None and request.stream_options.include_usage:
                yield self._usage_event(
                    request_id, created, prompts, completion_tokens, sum(num_cached_tokens)
                )
        except Exception as e:
            yield stream_error_event(e, request_id, "prompt")
        yield SSE_DONE

    def _usage_event(
        self,
        request_id: str,
        created: int,
        prompts: list[tuple[str | None, list[int]]],
        completion_tokens: int,
        num_cached_tokens: int,
    ) -> str:
        """A stream's last chunk before ``[DONE]`` when ``stream_options.include_usage`` asks for it."""
        usage = self.make_usage(sum(len(ids) for _, ids in prompts), completion_tokens, num_cached_tokens)
        return sse_event(CompletionStreamResponse(id=request_id, created=created, model=self.served_model_name,
                                                  choices=[], usage=usage))  # fmt: skip

    # ------------------------------------------------------------------ logprobs

    def create_logprobs(
        self,
        token_ids: list[int],
        top_logprobs: list[LogprobsDict | None],
        num_top: int,
        text_offsets: list[int],
    ) -> CompletionLogProbs:
        """The legacy logprobs object for ``token_ids`` (vLLM: ``_create_completion_logprobs``).

        Args:
            token_ids: the tokens shown (prompt tokens first when echoing).
            top_logprobs: per token, its ``{token_id: Logprob}`` (sampled token plus top-N),
                or None (a prompt's first token).
            num_top: N; alternatives of rank ≤ N are listed, plus the sampled token.
            text_offsets: per token, where its text starts in the choice's whole text (echoed
                prompt included) — not the sum of the tokens' lengths: a token holding part
                of a character decodes alone to U+FFFD, and a stream's text lags behind its
                tokens while a possible stop string is held back.
        """
        result = CompletionLogProbs()
        for token_id, step, offset in zip(token_ids, top_logprobs, text_offsets):
            chosen = step.get(token_id) if step is not None else None
            token = self.token_text(token_id, chosen.decoded_token if chosen is not None else None)
            result.tokens.append(token)
            result.text_offset.append(offset)
            if step is None or chosen is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(max(chosen.logprob, MIN_LOGPROB))
            result.top_logprobs.append(
                {
                    self.token_text(tid, lp.decoded_token): max(lp.logprob, MIN_LOGPROB)
                    for tid, lp in step.items()
                    if tid == token_id or (lp.rank is not None and lp.rank <= num_top)
                }
            )
        return result
