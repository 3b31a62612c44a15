"""Engine-core outputs (token ids) → ``RequestOutput``s (text), in the frontend.

Mirrors vLLM's ``vllm/v1/engine/output_processor.py`` (``OutputProcessor``,
``RequestState``, ``OutputProcessorOutput``), ``vllm/v1/engine/logprobs.py`` (logprob rows
→ dicts) and ``vllm/v1/engine/parallel_sampling.py`` (``ParentRequest``).

The idea: the engine core knows token ids only. For each request the frontend keeps a
``RequestState`` — its detokenizer, logprobs so far, timings — and turns each step's
``EngineCoreOutput`` into the user's ``RequestOutput``. Stop strings are matched here, on
text; a match finishes the request at once and its id goes into ``reqs_to_abort`` so the
caller tells the engine to free it.

``n`` > 1: the engine has no notion of a request with several samples. The frontend turns
parent request "abc" into children "0_abc", "1_abc", ... (``ParentRequest``), each an
ordinary ``n=1`` request, and gathers their ``CompletionOutput``s back under "abc" by index.

Output kinds (``SamplingParams.output_kind``): CUMULATIVE — everything so far each time;
DELTA — only what is new since the request's previous output; FINAL_ONLY — one output, when
the request (all its children) finished.

Deviation from vLLM: a parent gets *one* ``RequestOutput`` per ``process_outputs`` call,
holding all children (CUMULATIVE), the children that moved (DELTA) or all of them at the
end (FINAL_ONLY); vLLM emits one per child output and lets the per-request collector merge
them.

Stats (vLLM's ``IterationStats``): every request keeps a ``RequestStateStats``
(``engine/metrics/stats.py``: queued and first-scheduled times from the engine core's events,
first and last token times from the batches that carried tokens). Each ``process_outputs``
call fills one ``IterationStats`` (tokens, time to first token, inter-token latencies,
finished requests) and hands it to ``stats_sink(engine_index, iteration_stats)`` when one is
set (the API server's ``StatLoggerManager``: Prometheus and the periodic log line). A
finished request's figures also go on its ``llm_request`` span (``gen_ai.*`` attributes), which
``request_tracing.do_tracing`` makes.

A pooling request (``pooling_params``, ``--runner pooling``) has no detokenizer and no
logprobs: its one output carries the pooled vector (``EngineCoreOutput.pooling_output``), and
becomes a ``PoolingRequestOutput`` (vLLM's ``make_request_output`` with a pooling output).

Left out: per-request asyncio queues (the caller routes ``request_outputs`` by
``request_id``), LoRA.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.core.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from engine.frontend.detokenizer import IncrementalDetokenizer, backend_tokenizer
from engine.frontend.outputs import (
    CompletionOutput,
    Logprob,
    LogprobsDict,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from engine.frontend.request_tracing import do_tracing
from engine.metrics import stats as metrics_stats
from engine.metrics.stats import RequestStateStats
from engine.outputs import Float32Tensor, LogprobsLists
from engine.pooling_params import PoolingParams
from engine.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    """A request with ``n`` > 1, fanned out into ``n`` child requests.

    Args:
        request_id: the user's request id; children are ``f"{index}_{request_id}"``.
        sampling_params: the user's params (``n`` > 1); not modified.
    """

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.output_kind = sampling_params.output_kind
        # Children not finished yet.
        self.child_requests: set[str] = set()
        # index → the child's latest CompletionOutput (CUMULATIVE, FINAL_ONLY) or its
        # deltas not yet handed out (DELTA).
        self.completions: dict[int, CompletionOutput] = {}
        # Taken from child 0 only, so that each prompt position is reported once.
        self.prompt_logprobs: list[LogprobsDict | None] | None = None
        self.num_cached_tokens = 0
        self.metrics: RequestStateStats | None = None
        # The children's shared prompt, and whether a child added an output since the last
        # ``make_request_output`` (set by ``add_child_output``).
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self.updated = False

    @property
    def n(self) -> int:
        return self.sampling_params.n

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        """The child's request id and params for sample ``index`` (0 ≤ index < n).

        Each child gets its own copy with ``n=1``. With a seed, child ``i`` gets
        ``seed + i`` (vLLM's rule): the ``n`` samples differ from each other, a rerun
        repeats them, and child 0 repeats what ``n=1`` with that seed would give.
        """
        if not 0 <= index < self.n:
            raise ValueError(f"child index {index} is outside [0, n={self.n})")
        child_id = f"{index}_{self.request_id}"
        params = self.sampling_params.clone()
        params.n = 1
        if params.seed is not None:
            params.seed = params.seed + index
        self.child_requests.add(child_id)
        return child_id, params

    def add_child_output(self, child: RequestState, completion: CompletionOutput) -> None:
        """Record a child's completion from this step (child 0 also brings the prompt
        logprobs, the cached-token count and the stats, so each is reported once)."""
        self.updated = True
        self.prompt, self.prompt_token_ids = child.prompt, child.prompt_token_ids
        if child.request_index == 0:
            prompt_logprobs = child.take_prompt_logprobs()
            if prompt_logprobs is not None:
                delta = self.output_kind == RequestOutputKind.DELTA
                self.prompt_logprobs = (
                    (self.prompt_logprobs or []) + prompt_logprobs if delta else prompt_logprobs
                )
            self.num_cached_tokens = child.num_cached_tokens
            self.metrics = child.metrics
        if completion.finished():
            self.child_requests.discard(child.request_id)
        old = self.completions.get(completion.index)
        if self.output_kind == RequestOutputKind.DELTA and old is not None:
            # Two deltas of one child before the parent's output was made: join them.
            completion = CompletionOutput(
                index=completion.index,
                text=old.text + completion.text,
                token_ids=old.token_ids + completion.token_ids,
                cumulative_logprob=completion.cumulative_logprob,
                logprobs=None if completion.logprobs is None else (old.logprobs or []) + completion.logprobs,
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
                text_offsets=None
                if completion.text_offsets is None
                else (old.text_offsets or []) + completion.text_offsets,
            )
        self.completions[completion.index] = completion

    @property
    def finished(self) -> bool:
        return not self.child_requests

    def make_request_output(self) -> RequestOutput | None:
        """The parent's output after this step, or None when its kind says not yet."""
        self.updated = False
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        if not self.completions:
            return None
        outputs = [self.completions[i] for i in sorted(self.completions)]
        prompt_logprobs = self.prompt_logprobs
        if self.output_kind == RequestOutputKind.DELTA:
            self.completions = {}
            self.prompt_logprobs = None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
        )


class RequestState:
    """The frontend's state of one engine request (one child when ``n`` > 1): for a pooling
    request ``sampling_params``, ``detokenizer`` and the logprobs are None."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        tokenizer: object,
        parent_req: ParentRequest | None,
        request_index: int,
        log_stats: bool,
    ) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.parent_req = parent_req
        self.request_index = request_index
        self.pooling_params: PoolingParams | None = request.pooling_params
        self.logprobs: list[LogprobsDict] | None = None
        self.cumulative_logprob: float | None = None
        self.prompt_logprobs: list[LogprobsDict | None] | None = None
        if params is None:  # pooling: one output, no text
            self.output_kind = RequestOutputKind.FINAL_ONLY
            self.detokenizer: IncrementalDetokenizer | None = None
        else:
            self.output_kind = params.output_kind
            self.detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
            if params.logprobs is not None:
                self.logprobs, self.cumulative_logprob = [], 0.0
            # Position 0 has no logprob: nothing comes before the first prompt token.
            if params.prompt_logprobs is not None:
                self.prompt_logprobs = [None]
        self.num_cached_tokens = 0
        # The request's one stats object (a few floats), always kept: the stat loggers and
        # the llm_request span read it; RequestOutput.metrics shows it only with log_stats.
        self.stats = RequestStateStats(arrival_time=request.arrival_time)
        self.metrics = self.stats if log_stats else None
        self.sampling_params = params
        self.trace_headers = request.trace_headers

    def make_pooling_output(self, pooling_output: Float32Tensor) -> PoolingRequestOutput:
        """A pooling request's one output, holding its vector (read as numpy: no torch here)."""
        return PoolingRequestOutput(
            request_id=self.request_id,
            outputs=PoolingOutput(data=pooling_output.numpy()),
            prompt_token_ids=self.prompt_token_ids,
            num_cached_tokens=self.num_cached_tokens,
            finished=True,
            metrics=self.metrics,
        )

    def make_request_output(
        self, new_token_ids: list[int], finish_reason: FinishReason | None, stop_reason: int | str | None
    ) -> RequestOutput | None:
        """This step's output (vLLM's ``RequestState.make_request_output``), or None: nothing
        to show yet (a step that computed only part of the prompt; FINAL_ONLY before the end),
        or a child of an ``n`` > 1 request, whose completion goes to its parent (which makes
        one output per ``process_outputs`` call)."""
        finished = finish_reason is not None
        if not finished and (not new_token_ids or self.output_kind == RequestOutputKind.FINAL_ONLY):
            return None
        completion = self._new_completion_output(len(new_token_ids), finish_reason, stop_reason)
        if self.parent_req is not None:
            self.parent_req.add_child_output(self, completion)
            return None
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.take_prompt_logprobs(),
            outputs=[completion],
            finished=finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
        )

    def _new_completion_output(
        self, num_new_tokens: int, finish_reason: FinishReason | None, stop_reason: int | str | None
    ) -> CompletionOutput:
        """This step's completion, shaped by the output kind (vLLM's ``_new_completion_output``)."""
        finished = finish_reason is not None
        delta = self.output_kind == RequestOutputKind.DELTA

        def shaped(items: list | None) -> list | None:
            """DELTA: the entries of this step's tokens; else a copy of all (later steps append
            to our lists, and an output already handed to the user must not change)."""
            if items is None:
                return None
            return items[len(items) - num_new_tokens :] if delta else list(items)

        return CompletionOutput(
            index=self.request_index,
            text=self.detokenizer.get_next_output_text(finished, delta),
            token_ids=shaped(self.detokenizer.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=shaped(self.logprobs),
            finish_reason=str(finish_reason) if finished else None,
            stop_reason=stop_reason if finished else None,
            # With logprobs, where each token's text starts (the completions API's text_offset).
            text_offsets=shaped(self.detokenizer.token_offsets),
        )

    def take_prompt_logprobs(self) -> list[LogprobsDict | None] | None:
        """Prompt logprobs for the next output: all of them, or (DELTA) the unsent ones, which
        are forgotten (vLLM's ``pop_prompt_logprobs``). The prompt's last chunk brings the
        last of them, before the first output, so the list handed out no longer grows."""
        prompt_logprobs = self.prompt_logprobs
        if self.output_kind == RequestOutputKind.DELTA and prompt_logprobs:
            self.prompt_logprobs = []
        return prompt_logprobs or None


@dataclass
class OutputProcessorOutput:
    """What one ``process_outputs`` call produced.

    ``request_outputs``: one per user request that has something to show (a parent's id
    for ``n`` > 1; a ``PoolingRequestOutput`` for a pooling request). ``reqs_to_abort``: engine request ids a stop string finished; the
    caller must abort them in the engine core, which has not seen the stop.
    """

    request_outputs: list[RequestOutput | PoolingRequestOutput]
    reqs_to_abort: list[str]


class OutputProcessor:
    """Turns ``EngineCoreOutput``s into ``RequestOutput``s (vLLM's ``OutputProcessor``).

    Args:
        tokenizer: the model's ``PreTrainedTokenizerFast`` (or a ``tokenizers.Tokenizer``).
        log_stats: fill ``RequestOutput.metrics`` with timings.
    """

    def __init__(self, tokenizer: object, log_stats: bool = False) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        # Called with (engine_index, IterationStats) after each process_outputs call.
        self.stats_sink: Callable[[int, metrics_stats.IterationStats], None] | None = None
        # The served model name, for the llm_request span (gen_ai.request/response.model).
        self.model_name: str | None = None
        # Engine-core monotonic timestamps → wall clock (one system-wide monotonic clock).
        self._mono_to_wall = time.time() - time.monotonic()

    def get_num_unfinished_requests(self) -> int:
        """Unfinished engine requests (each child of an ``n`` > 1 request counts)."""
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: ParentRequest | None = None,
        request_index: int = 0,
    ) -> None:
        """Start tracking an engine request (a child of ``parent_req`` when given).

        Raises:
            ValueError: the request id is already being tracked.
        """
        request_id = request.request_id
        if request_id in self.request_states:
            raise ValueError(f"request id {request_id!r} is already running")
        self.request_states[request_id] = RequestState(
            request, prompt, self.tokenizer, parent_req, request_index, self.log_stats
        )
        if parent_req is not None:
            self.parent_requests[parent_req.request_id] = parent_req

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Stop tracking requests; return the engine request ids to abort.

        Accepts engine request ids and parent ids (a parent id stands for all of its
        unfinished children). Unknown ids are ignored. No output is produced for them; each
        one's ``llm_request`` span ends now, with finish reason ``abort``.
        """
        to_abort: list[str] = []
        now = time.time()
        for request_id in request_ids:
            state = self.request_states.pop(request_id, None)
            if state is not None:
                to_abort.append(request_id)
                self._update_stats_from_finished(state, FinishReason.ABORT, now)
                if state.parent_req is not None:
                    state.parent_req.child_requests.discard(request_id)
                    if state.parent_req.finished:
                        self.parent_requests.pop(state.parent_req.request_id, None)
            elif (parent := self.parent_requests.pop(request_id, None)) is not None:
                children = sorted(parent.child_requests)
                to_abort.extend(self.abort_requests(children))
        return to_abort

    def process_outputs(
        self,
        engine_core_outputs: list[EngineCoreOutput],
        engine_core_timestamp: float | None = None,
        engine_index: int = 0,
    ) -> OutputProcessorOutput:
        """Detokenize one step's outputs, match stop strings, build ``RequestOutput``s.

        Args:
            engine_core_outputs: ``EngineCoreOutputs.outputs`` of one step (or a chunk of it).
            engine_core_timestamp: ``EngineCoreOutputs.timestamp`` (engine-core monotonic
                seconds), used for ``metrics`` and the stats only.
            engine_index: ``EngineCoreOutputs.engine_index`` (the DP rank that sent them),
                the ``engine`` label of the stats.

        Outputs for ids no longer tracked (aborted, or stopped by a stop string while the
        engine was already computing the next step) are ignored.
        """
        request_outputs: list[RequestOutput | PoolingRequestOutput] = []
        reqs_to_abort: list[str] = []
        now = time.time()
        iteration = metrics_stats.IterationStats(now)
        # When this batch's tokens were made: the engine core's stamp (wall clock) if known.
        token_ts = now if engine_core_timestamp is None else engine_core_timestamp + self._mono_to_wall

        for output in engine_core_outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue
            # 1) Stats.
            iteration.update_from_output(output, len(state.prompt_token_ids), state.stats, token_ts)
            finish_reason, stop_reason = output.finish_reason, output.stop_reason
            state.num_cached_tokens = output.num_cached_tokens

            if state.detokenizer is None:  # pooling: its vector comes with its finish
                if output.pooling_output is not None:
                    request_outputs.append(state.make_pooling_output(output.pooling_output))
                if finish_reason is not None:
                    del self.request_states[output.request_id]
                    iteration.finished_requests.append(
                        self._update_stats_from_finished(state, finish_reason, now)
                    )
                continue

            # 2) Text, and stop strings. The engine core matches no stop strings: a "stop"
            #    from it is EOS or a stop token id, on the last token.
            stop_str = state.detokenizer.update(output.new_token_ids, finish_reason == FinishReason.STOP)
            if stop_str is not None:
                finish_reason, stop_reason = FinishReason.STOP, stop_str

            # 3) Logprobs: the engine sends rows only for a request that asked.
            if output.new_logprobs is not None or output.new_prompt_logprobs is not None:
                self._update_logprobs(state, output)

            # 4) The user's output (a child's goes to its parent).
            request_output = state.make_request_output(output.new_token_ids, finish_reason, stop_reason)
            if request_output is not None:
                request_outputs.append(request_output)

            # 5) Free a finished request; one a stop string finished, the engine core must abort.
            if finish_reason is not None:
                del self.request_states[output.request_id]
                if not output.finished:
                    reqs_to_abort.append(output.request_id)
                done = self._update_stats_from_finished(state, finish_reason, now)
                iteration.finished_requests.append(done)

        if self.parent_requests:
            request_outputs.extend(self._make_parent_outputs())
        if self.stats_sink is not None:
            self.stats_sink(engine_index, iteration)
        return OutputProcessorOutput(request_outputs=request_outputs, reqs_to_abort=reqs_to_abort)

    def _make_parent_outputs(self) -> list[RequestOutput]:
        """``n`` > 1: one output per parent whose children moved in this ``process_outputs``
        call (the deviation in the module docstring); a finished parent is forgotten."""
        outputs: list[RequestOutput] = []
        for parent in [p for p in self.parent_requests.values() if p.updated]:
            parent_output = parent.make_request_output()
            if parent_output is not None:
                outputs.append(parent_output)
            if parent.finished:
                del self.parent_requests[parent.request_id]
        return outputs

    def _update_stats_from_finished(
        self, state: RequestState, finish_reason: FinishReason, now: float
    ) -> metrics_stats.FinishedRequestStats:
        """The figures of ``state``'s request, finished (or aborted) at ``now`` (wall-clock s);
        its ``llm_request`` span ends with them (vLLM's ``_update_stats_from_finished``)."""
        state.stats.finished_time = now
        max_tokens = state.sampling_params.max_tokens if state.sampling_params is not None else None
        done = metrics_stats.finished_request_stats(
            state.stats, str(finish_reason), len(state.prompt_token_ids), max_tokens, now
        )
        do_tracing(state, done, self.model_name, now)
        return done

    # ------------------------------------------------------------------ logprobs

    def _update_logprobs(self, state: RequestState, output: EngineCoreOutput) -> None:
        """Take the logprob rows an output carries (vLLM's ``LogprobsProcessor.update_from_output``)."""
        if output.new_logprobs is not None:
            self._update_sample_logprobs(state, output.new_logprobs)
        if output.new_prompt_logprobs is not None:
            self._update_prompt_logprobs(state, output.new_prompt_logprobs)

    def _update_sample_logprobs(self, state: RequestState, lists: LogprobsLists) -> None:
        if state.logprobs is not None:
            state.logprobs.extend(self._to_dicts(lists, state.sampling_params.detokenize))
            # The first entry of each row is the sampled token.
            state.cumulative_logprob += sum(lp[0] for lp in lists.logprobs)

    def _update_prompt_logprobs(self, state: RequestState, lists: LogprobsLists) -> None:
        if state.prompt_logprobs is not None:
            state.prompt_logprobs.extend(self._to_dicts(lists, state.sampling_params.detokenize))

    def _to_dicts(self, lists: LogprobsLists, decode: bool) -> list[LogprobsDict]:
        """Logprob rows → one ``{token_id: Logprob}`` per position.

        Row layout (``LogprobsLists``): the chosen token first, with its vocabulary rank
        from ``ranks``, then the top-N best first, ranked 1..N. When the chosen token is
        also in the top-N, both entries agree, so one dict key is enough.
        """
        decoded: list[str] | list[None]
        flat_ids = [t for row in lists.logprob_token_ids for t in row]
        if decode:
            # Each token decoded alone, special tokens shown (vLLM does the same).
            tokenizer = backend_tokenizer(self.tokenizer)
            decoded = tokenizer.decode_batch([[t] for t in flat_ids], skip_special_tokens=False)
        else:
            decoded = [None] * len(flat_ids)
        rows: list[LogprobsDict] = []
        k = 0
        for token_ids, logprobs, rank in zip(lists.logprob_token_ids, lists.logprobs, lists.ranks):
            row: LogprobsDict = {}
            for j, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
                row[token_id] = Logprob(
                    logprob=logprob, rank=rank if j == 0 else j, decoded_token=decoded[k + j]
                )
            k += len(token_ids)
            rows.append(row)
        return rows
