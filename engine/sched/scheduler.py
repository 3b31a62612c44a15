"""The V1 scheduler: which requests compute how many tokens in the next step.

THE idea: there is no prefill phase and no decode phase. Every request has
``num_computed_tokens`` (tokens whose KV is in the cache) catching up with ``num_tokens``
(prompt plus outputs so far). Each step shares one token budget
(``max_num_batched_tokens``) among the requests: a decode is a request 1 token behind, a
prefill is one many tokens behind, and a long prefill simply takes several steps (chunked
prefill). A request whose prompt is fully computed after a step gets a sampled token.

One step, ``schedule()``:
  1. RUNNING requests first, in order — so decodes get their token before any new prompt
     does. Each gets ``min(tokens behind, threshold, budget left)``. When the KV cache
     cannot hold them, a running request is *preempted*: its blocks are freed, its
     computed tokens reset to 0 (recompute later), and it goes back to the front of
     WAITING. FCFS preempts the last running request; PRIORITY the lowest-priority,
     latest-arrived one.
  2. WAITING requests next — only if nothing was preempted this step (the cache is
     full) — while budget and ``max_num_seqs`` allow: each starts after its prefix-cache
     hit and takes what budget is left. A request still WAITING_FOR_FSM (its structured-
     output grammar compiling) is passed over and keeps its place; one whose compile failed
     finishes with FINISHED_ERROR.
  3. Scheduled tokens are counted as computed right away, so the next ``schedule()`` can
     plan the next chunk before this one's results arrive.

``update_from_output()`` then appends each sampled token, checks stop conditions, frees
finished requests, and returns the per-client ``EngineCoreOutputs``.

Pooling requests (``--runner pooling``) go the same way with nothing to sample: all prefill,
chunked like any prompt (only LAST pooling allows it: the config turns chunked prefill and
prefix caching off for MEAN and CLS, so their prompts are scheduled whole), and finished
(FINISHED_STOPPED, its blocks freed) by the step whose ``pooler_output`` carries their vector.

Mirrors vLLM's ``vllm/v1/core/sched/scheduler.py`` (vLLM 0.32, the one version Glassbox
mirrors). Structured outputs: the scheduler lists the step's structured requests that sample
(``structured_output_request_ids``), ``get_grammar_bitmask`` asks the
``StructuredOutputManager`` for their bitmask, and ``update_from_output`` advances their
grammars. Left out: speculative decoding, async scheduling, encoder inputs
and multimodal, LoRA, KV connectors (disaggregated prefill), KV events,
cascade attention (``num_common_prefix_blocks`` is always 0).

Pure Python: no torch, no ZMQ, no HTTP.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from engine.config import CacheConfig, SchedulerConfig
from engine.core.messages import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from engine.kv_cache.kv_cache_interface import KVCacheConfig
from engine.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager
from engine.outputs import LogprobsLists, ModelRunnerOutput
from engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine.sched.request import Request, RequestStatus
from engine.sched.request_queue import SchedulingPolicy, create_request_queue
from engine.sched.utils import check_stop


class Scheduler:
    """Plans each engine step and books its results.

    Deliberate deviation: vLLM's constructor takes the whole ``VllmConfig``; ours takes
    only the three parts it reads, so tests build a scheduler without a model directory.

    Args:
        scheduler_config: token budget, ``max_num_seqs``, ``max_model_len``, chunked
            prefill, ``long_prefill_token_threshold``, policy.
        cache_config: ``enable_prefix_caching``; its ``block_size`` must match the KV spec.
        kv_cache_config: the sized KV cache (blocks, block size).
        log_stats: build ``SchedulerStats`` for every step's outputs.
        structured_output_manager: compiles grammars and builds bitmasks (the engine core's);
            None when no request will carry structured outputs (tests).

    The engine checks at start-up that one ``max_model_len`` request fits in the cache
    (vLLM's ``check_enough_kv_cache_memory``). Should a request still need more blocks
    than the whole pool, ``schedule()`` raises RuntimeError rather than spin forever.

    Raises:
        ValueError: ``cache_config.block_size`` differs from the KV spec's block size.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        kv_cache_config: KVCacheConfig,
        log_stats: bool = True,
        use_pp: bool = False,
        structured_output_manager=None,
    ) -> None:
        if cache_config.block_size != kv_cache_config.spec.block_size:
            raise ValueError(
                f"block_size mismatch: cache_config has {cache_config.block_size}, "
                f"the KV cache spec has {kv_cache_config.spec.block_size}"
            )
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.kv_cache_config = kv_cache_config
        self.log_stats = log_stats
        self.structured_output_manager = structured_output_manager
        # Pipeline parallelism: tell the workers the scheduled token ids (new_token_ids).
        self.use_pp = use_pp

        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.policy = SchedulingPolicy(scheduler_config.policy)

        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished or aborted since the last step; the next SchedulerOutput tells the
        # workers so they drop their copies of these requests.
        self.finished_req_ids: set[str] = set()
        # Requests the scheduler ended itself (FINISHED_ERROR) since the last outputs were made:
        # update_from_output reports them.
        self.errored_reqs: list[Request] = []

        self.kv_cache_manager = KVCacheManager(
            kv_cache_config,
            max_model_len=self.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            log_stats=log_stats,
        )

        # Counters for SchedulerStats (cumulative since start, except the last step's tokens).
        self.step_counter = 0
        self.num_preemptions = 0
        self.num_scheduled_tokens_last_step = 0
        # vLLM's vllm:prefix_cache_queries / _hits: tokens of requests admitted for the first
        # time (a preempted request's re-admission is PrefixCacheStats.preempted_*).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------------ requests in/out

    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING).

        Raises:
            ValueError: prompt longer than ``max_model_len``, or a request id already in
                use. The frontend's rule (``validate_prompt``, which also refuses an empty
                prompt) is stricter — it leaves room for one output token; this is only the
                backstop that keeps the loop from stalling on a request that could never be
                scheduled.
        """
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"{request.request_id}: the prompt has {request.num_tokens} tokens, "
                f"more than max_model_len={self.max_model_len}"
            )
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        self.waiting.add_request(request)
        self.requests[request.request_id] = request
        request.record_event(EngineCoreEventType.QUEUED)

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """End requests from outside the scheduler (abort, or a stop string matched).

        Each is removed from running or waiting, gets ``finished_status``, has its KV
        blocks freed, and is listed in the next step's ``finished_req_ids``. Unknown or
        already-finished ids are ignored (an abort can race with a natural finish).
        """
        assert RequestStatus.is_finished(finished_status), f"{finished_status!r} is not a finished status"
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        running_to_remove: set[str] = set()
        waiting_to_remove: list[Request] = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                running_to_remove.add(request_id)
            else:
                waiting_to_remove.append(request)
            request.status = finished_status
            self._free_request(request)
        if running_to_remove:
            self.running = [r for r in self.running if r.request_id not in running_to_remove]
        if waiting_to_remove:
            self.waiting.remove_requests(waiting_to_remove)

    def _free_request(self, request: Request) -> None:
        """Forget a finished request: release its blocks, tell the workers next step."""
        assert request.is_finished()
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see the module docstring for the two passes).

        Returns:
            ``SchedulerOutput``: new requests (whole), deltas for known ones, tokens per
            request (summing to at most ``max_num_batched_tokens``), and the ids finished
            or preempted since the last step.

        Raises:
            RuntimeError: a request cannot fit even with the whole KV cache to itself.
        """
        scheduled_new_reqs: list[Request] = []
        scheduled_resumed_reqs: list[Request] = []
        scheduled_running_reqs: list[Request] = []
        preempted_reqs: list[Request] = []
        req_to_new_blocks: dict[str, KVCacheBlocks] = {}
        num_scheduled_tokens: dict[str, int] = {}
        token_budget = self.max_num_scheduled_tokens
        threshold = self.scheduler_config.long_prefill_token_threshold

        # Step 1: RUNNING requests, in order.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = request.num_tokens - request.num_computed_tokens
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            num_new_tokens = min(num_new_tokens, token_budget)
            # No slot past max_model_len. vLLM caps at max_model_len - 1 - computed because
            # speculative tokens could overshoot; we have none, and that -1 would leave the
            # last token of a max_model_len-long prompt unscheduled forever. check_stop
            # ends every request once it reaches max_model_len tokens.
            num_new_tokens = min(num_new_tokens, self.max_model_len - request.num_computed_tokens)
            if num_new_tokens == 0:
                req_index += 1
                continue

            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
                if new_blocks is not None:
                    break
                # The cache is full: free a running request's blocks and try again.
                if self.policy is SchedulingPolicy.PRIORITY:
                    victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                    self.running.remove(victim)
                    if victim in scheduled_running_reqs:
                        # Already scheduled this step: take back its tokens and blocks.
                        scheduled_running_reqs.remove(victim)
                        token_budget += num_scheduled_tokens.pop(victim.request_id)
                        del req_to_new_blocks[victim.request_id]
                        req_index -= 1
                else:
                    victim = self.running.pop()
                self._preempt(victim)
                preempted_reqs.append(victim)
                if victim is request:
                    if not self.running:
                        self._raise_does_not_fit(request, request.num_computed_tokens + num_new_tokens)
                    break
            if new_blocks is None:
                break  # the request preempted itself; nothing after it can fit either

            scheduled_running_reqs.append(request)
            req_to_new_blocks[request.request_id] = new_blocks
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1

        # Step 2: WAITING requests, unless step 1 showed the cache is full.
        skipped_waiting_reqs: list[Request] = []
        if not preempted_reqs:
            while self.waiting and token_budget > 0 and len(self.running) < self.max_num_running_reqs:
                request = self.waiting.peek_request()
                if request.status == RequestStatus.WAITING_FOR_FSM:
                    grammar = request.structured_output_request.grammar
                    if grammar is None:  # still compiling: set aside, it keeps its place
                        skipped_waiting_reqs.append(self.waiting.pop_request())
                        continue
                    if isinstance(grammar, Exception):  # compile failed (the API server checks first)
                        self.waiting.pop_request()
                        request.status = RequestStatus.FINISHED_ERROR
                        request.stop_reason = f"grammar compile failed: {grammar}"
                        self._free_request(request)
                        self.errored_reqs.append(request)
                        continue
                    request.status = RequestStatus.WAITING
                # A waiting request has computed nothing (preemption resets it to 0), so it
                # starts after its prefix-cache hit. (vLLM skips the lookup for a request a KV
                # connector loaded; we have no connectors.)
                hit_blocks, num_computed_tokens = self.kv_cache_manager.get_computed_blocks(request)

                # The hit is at most num_tokens - 1, so at least one token is left to compute.
                num_new_tokens = request.num_tokens - num_computed_tokens
                if 0 < threshold < num_new_tokens:
                    num_new_tokens = threshold
                if not self.scheduler_config.enable_chunked_prefill and num_new_tokens > token_budget:
                    break  # without chunking a prompt goes whole or waits
                num_new_tokens = min(num_new_tokens, token_budget)

                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens, num_computed_tokens, hit_blocks
                )
                if new_blocks is None:
                    if not self.running:
                        self._raise_does_not_fit(request, num_computed_tokens + num_new_tokens)
                    break

                # Counted now that it is admitted: a request that did not fit above is
                # looked up again next step, and must not count its tokens twice.
                self.kv_cache_manager.record_prefix_cache_stats(request, num_computed_tokens)
                self.waiting.pop_request()
                self.running.append(request)
                if request.status == RequestStatus.WAITING:
                    scheduled_new_reqs.append(request)
                else:
                    assert request.status == RequestStatus.PREEMPTED, request
                    scheduled_resumed_reqs.append(request)
                # New and resumed requests get their whole block table, hit blocks included.
                req_to_new_blocks[request.request_id] = self.kv_cache_manager.get_blocks(request.request_id)
                num_scheduled_tokens[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens
                request.status = RequestStatus.RUNNING
                request.record_event(EngineCoreEventType.SCHEDULED)
                request.num_computed_tokens = num_computed_tokens
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_computed_tokens

        if skipped_waiting_reqs:
            self.waiting.prepend_requests(skipped_waiting_reqs)

        total_num_scheduled_tokens = sum(num_scheduled_tokens.values())
        assert total_num_scheduled_tokens <= self.max_num_scheduled_tokens
        assert token_budget >= 0
        assert len(self.running) <= self.max_num_running_reqs

        scheduler_output = SchedulerOutput(
            scheduled_new_reqs=[
                NewRequestData.from_request(req, req_to_new_blocks[req.request_id].get_block_ids())
                for req in scheduled_new_reqs
            ],
            scheduled_cached_reqs=self._make_cached_request_data(
                scheduled_running_reqs, scheduled_resumed_reqs, req_to_new_blocks, num_scheduled_tokens
            ),
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total_num_scheduled_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={req.request_id for req in preempted_reqs},
            structured_output_request_ids=self._structured_output_request_ids(num_scheduled_tokens),
        )
        self._update_after_schedule(scheduler_output)
        return scheduler_output

    def _structured_output_request_ids(self, num_scheduled_tokens: dict[str, int]) -> list[str]:
        """The scheduled structured requests that sample this step (their prompt is complete
        after it): one bitmask row each, in this order."""
        return [
            request_id
            for request_id, num_tokens in num_scheduled_tokens.items()
            if (request := self.requests[request_id]).use_structured_output
            and request.num_computed_tokens + num_tokens >= request.num_tokens
        ]

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """Fill ``scheduler_output.grammar_bitmask`` for its structured requests (vLLM's name;
        the engine core calls it between ``schedule()`` and ``execute_model``, in its own span).
        Called before ``_update_after_schedule``'s counts matter: it reads outputs only."""
        ids = scheduler_output.structured_output_request_ids
        if not ids or self.structured_output_manager is None:
            return
        bitmask = self.structured_output_manager.grammar_bitmask(self.requests, ids)
        scheduler_output.grammar_bitmask = bitmask.tobytes()

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop its KV, reset its progress, queue it at the front."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.record_event(EngineCoreEventType.PREEMPTED)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _raise_does_not_fit(self, request: Request, num_tokens: int) -> None:
        # Nothing else holds a block, so waiting cannot help: fail loudly instead of looping.
        num_usable = self.kv_cache_config.num_blocks - 1
        raise RuntimeError(
            f"{request.request_id}: {num_tokens} tokens do not "
            f"fit in the whole KV cache ({num_usable} blocks of {self.kv_cache_config.spec.block_size} "
            f"tokens) even with no other request running; the engine should have rejected "
            f"max_model_len={self.max_model_len} at start-up"
        )

    def _make_cached_request_data(
        self,
        running_reqs: list[Request],
        resumed_reqs: list[Request],
        req_to_new_blocks: dict[str, KVCacheBlocks],
        num_scheduled_tokens: dict[str, int],
    ) -> CachedRequestData:
        """Deltas for requests the workers know, running ones first, then resumed ones: new
        blocks, or a resumed request's whole token list and block table (the workers dropped
        it when it was preempted); with PP also the scheduled token ids (vLLM fills
        ``new_token_ids`` only then too; a resumed request's ride in its token list)."""
        data = CachedRequestData.make_empty()
        for index, req in enumerate(itertools.chain(running_reqs, resumed_reqs)):
            resumed = index >= len(running_reqs)
            new_blocks = req_to_new_blocks[req.request_id]
            data.req_ids.append(req.request_id)
            data.resumed_from_preemption.append(resumed)
            data.resumed_req_token_ids.append(list(req.all_token_ids) if resumed else None)
            if self.use_pp:
                start = req.num_computed_tokens
                end = start if resumed else start + num_scheduled_tokens[req.request_id]
                data.new_token_ids.append(list(req.all_token_ids[start:end]))
            data.new_block_ids.append(new_blocks.get_block_ids() if resumed or len(new_blocks) else None)
            data.num_computed_tokens.append(req.num_computed_tokens)
        return data

    def _update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        # Count the scheduled tokens as computed now, so the next schedule() plans the
        # following chunk without waiting for this step's results.
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += num_tokens
        # The output holds the old set; start a fresh one for the next step.
        self.finished_req_ids = set()
        self.step_counter += 1
        self.num_scheduled_tokens_last_step = scheduler_output.total_num_scheduled_tokens

    # ------------------------------------------------------------------ results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        """Book one step's sampled tokens; stop and free finished requests.

        For each scheduled request still known: append its sampled tokens (none for a
        prefill chunk that left part of the prompt), running ``check_stop`` after each one
        and dropping any after a stop; a pooling request whose vector came finishes
        (vLLM: "pooling stops as soon as there is output"). An ``EngineCoreOutput`` is
        emitted when there are new tokens, prompt logprobs, a vector, or a finish.

        Returns:
            ``{client_index: EngineCoreOutputs}``. With ``log_stats``, client 0's entry
            (created if needed) carries this step's ``SchedulerStats``.

        Raises:
            KeyError: a scheduled request is missing from ``model_runner_output``.
        """
        outputs: dict[int, list[EngineCoreOutput]] = {}
        stopped_ids: set[str] = set()
        for request_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(request_id)
            if request is None:
                continue  # aborted while the step ran
            req_index = model_runner_output.req_id_to_index[request_id]
            new_token_ids = model_runner_output.sampled_token_ids[req_index]
            pooler_outputs = model_runner_output.pooler_output
            pooler_output = pooler_outputs[req_index] if pooler_outputs else None

            stopped = False
            if request.pooling_params is not None and pooler_output is not None:
                request.status = RequestStatus.FINISHED_STOPPED
                stopped = True
            for num_new, token_id in enumerate(new_token_ids, 1):
                request.append_output_token_ids(token_id)
                stopped = check_stop(request, self.max_model_len)
                if stopped:
                    new_token_ids = new_token_ids[:num_new]  # the tokens after a stop are dropped
                    break

            if new_token_ids and self.structured_output_manager is not None:
                stopped = self._advance_grammar(request, new_token_ids, stopped)

            new_logprobs = model_runner_output.logprobs.get(request_id)
            if new_logprobs is not None and len(new_logprobs.ranks) > len(new_token_ids):
                new_logprobs = _first_rows(new_logprobs, len(new_token_ids))
            new_prompt_logprobs = model_runner_output.prompt_logprobs_dict.get(request_id)

            if stopped:
                self._free_request(request)
                stopped_ids.add(request_id)
            if new_token_ids or new_prompt_logprobs is not None or stopped:
                outputs.setdefault(request.client_index, []).append(
                    EngineCoreOutput(
                        request_id=request_id,
                        new_token_ids=new_token_ids,
                        new_logprobs=new_logprobs,
                        new_prompt_logprobs=new_prompt_logprobs,
                        finish_reason=request.get_finished_reason(),
                        stop_reason=request.stop_reason,
                        num_cached_tokens=max(request.num_cached_tokens, 0),
                        events=request.take_events(),
                        pooling_output=pooler_output,
                    )
                )

        if stopped_ids:
            self.running = [r for r in self.running if r.request_id not in stopped_ids]
        for request in self.errored_reqs:
            outputs.setdefault(request.client_index, []).append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    stop_reason=request.stop_reason,
                    events=request.take_events(),
                )
            )
        self.errored_reqs = []

        engine_core_outputs = {
            client_index: EngineCoreOutputs(outputs=client_outputs)
            for client_index, client_outputs in outputs.items()
        }
        stats = self.make_stats()
        if stats is not None:
            engine_core_outputs.setdefault(0, EngineCoreOutputs()).scheduler_stats = stats
        return engine_core_outputs

    def _advance_grammar(self, request: Request, new_token_ids: list[int], stopped: bool) -> bool:
        """Advance the request's grammar by its new tokens (vLLM: ``accept_tokens``). A token
        the grammar refuses ends the request with FINISHED_ERROR; a grammar that is complete
        ends it with FINISHED_STOPPED. Returns whether the request stopped."""
        if not self.structured_output_manager.should_advance(request):
            return stopped
        grammar = request.structured_output_request.grammar
        if not grammar.accept_tokens(request.request_id, new_token_ids) or grammar.error():
            # Even an EOS that check_stop took: the grammar did not allow the output to end there.
            request.status = RequestStatus.FINISHED_ERROR
            request.stop_reason = f"structured output: {grammar.error()}"
            return True
        if not stopped and grammar.is_terminated():
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        return stopped

    # ------------------------------------------------------------------ state and stats

    def get_request_counts(self) -> tuple[int, int]:
        """(running, waiting) request counts."""
        return len(self.running), len(self.waiting)

    def num_waiting_for_fsm(self) -> int:
        """Waiting requests whose grammar is still compiling (WAITING_FOR_FSM)."""
        return sum(1 for r in self.waiting if r.status == RequestStatus.WAITING_FOR_FSM)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_finished_requests(self) -> bool:
        """True when finished ids still wait to be sent to the workers in a step."""
        return len(self.finished_req_ids) > 0

    def has_requests(self) -> bool:
        """Work for the busy loop: unfinished requests, or finished ids to hand over."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False while any request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats | None:
        """Scheduler state after the latest step (None unless ``log_stats``)."""
        if not self.log_stats:
            return None
        # Not None: the KV cache manager logs stats whenever the scheduler does.
        prefix_stats = self.kv_cache_manager.make_prefix_cache_stats()
        self.prefix_cache_queries += prefix_stats.queries
        self.prefix_cache_hits += prefix_stats.hits
        counts, seconds_sum = [], 0.0
        if self.structured_output_manager is not None:
            counts, seconds_sum = self.structured_output_manager.compile_time_histogram()
        return SchedulerStats(
            num_waiting_for_fsm=self.num_waiting_for_fsm(),
            grammar_compile_counts=counts,
            grammar_compile_seconds_sum=seconds_sum,
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            step_counter=self.step_counter,
            num_scheduled_tokens=self.num_scheduled_tokens_last_step,
        )


def _first_rows(logprobs: LogprobsLists, num_rows: int) -> LogprobsLists:
    """The first ``num_rows`` rows (tokens after a stop are dropped, so are their logprobs)."""
    return LogprobsLists(
        logprob_token_ids=logprobs.logprob_token_ids[:num_rows],
        logprobs=logprobs.logprobs[:num_rows],
        ranks=logprobs.ranks[:num_rows],
    )
