"""``EngineCore``: the scheduler, the KV cache manager and the executor, stepped together.

Mirrors vLLM's ``vllm/v1/engine/core.py`` (``EngineCore``; ``EngineCoreProc``, the same
core in its own process with input/output threads, comes with the process tree). One
``step()`` is the whole engine in three calls:

    schedule()  →  execute_model()  →  update_from_output()

Start-up sizes the KV cache between the executor's creation and the scheduler's: the
workers profile memory, the core turns bytes into blocks (``kv_cache_planning``), logs the
capacity, and only then builds the ``Scheduler`` over that many blocks.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from engine.config import EngineConfig
from engine.core.messages import EngineCoreOutputs, EngineCoreRequest
from engine.core.request_tracing import RequestPhaseTracer
from engine.executor.abstract import Executor
from engine.kv_cache.kv_cache_interface import KVCacheConfig
from engine.kv_cache.kv_cache_planning import get_kv_cache_configs
from engine.kv_cache.kv_cache_utils import get_request_block_hasher
from engine.logger import init_logger
from engine.sched.output import SchedulerOutput
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler
from tracing import catalogue, stage
from tracing.telemetry import events
from tracing.telemetry.events import RequestProgress
from tracing.telemetry.publisher import get_publisher

logger = init_logger(__name__)

# Step records the flight recorder keeps (a ring buffer; see ``EngineCore.flight_recorder``).
FLIGHT_RECORDER_STEPS = 64


class EngineCore:
    """The engine's inner loop, in whatever process holds it.

    Args:
        config: the validated engine config (``cache_config.num_gpu_blocks`` is filled in).
        executor_class: ``Executor.get_class(config)`` unless a test passes another.
        log_stats: attach ``SchedulerStats`` to every step's outputs.

    Raises:
        ValueError: the KV cache cannot hold one ``max_model_len`` request.
    """

    def __init__(
        self,
        config: EngineConfig,
        executor_class: type[Executor] | None = None,
        log_stats: bool = True,
        run_dir: str | None = None,
    ):
        with stage(catalogue.ENGINE_CORE_INIT, rank=config.parallel_config.data_parallel_rank):
            self.config = config
            self.log_stats = log_stats
            executor_class = executor_class or Executor.get_class(config)
            self.model_executor = executor_class(config, run_dir=run_dir)
            try:
                self.kv_cache_config = self._initialize_kv_caches()
            except BaseException:
                # Stop the workers in order (not by their lifeline, as orphans would).
                self.model_executor.shutdown()
                raise
            self.scheduler = Scheduler(
                config.scheduler_config,
                config.cache_config,
                self.kv_cache_config,
                log_stats=log_stats,
                use_pp=config.parallel_config.pipeline_parallel_size > 1,
            )
            self.block_hasher = (
                get_request_block_hasher(config.cache_config.block_size)
                if config.cache_config.enable_prefix_caching
                else None
            )
            self.step_counter = 0
            # Request phases as spans of each request's own trace (when it came with one).
            self.request_tracer = RequestPhaseTracer()
            # The flight recorder: the last FLIGHT_RECORDER_STEPS step records, written beside
            # the crash report when the engine core dies.
            self.flight_recorder: deque[dict[str, Any]] = deque(maxlen=FLIGHT_RECORDER_STEPS)
            # The latest engine_core.step span's context (None unless spans are recorded).
            self.last_step_context = None
            # The last step's figures (``step()`` fills it; see ``_after_step``).
            self.last_step: dict[str, Any] | None = None
            self.step_delay_s = config.observability_config.step_delay_ms / 1e3

    def _initialize_kv_caches(self) -> KVCacheConfig:
        with stage(catalogue.ENGINE_CORE_INITIALIZE_KV_CACHE) as st:
            specs = self.model_executor.get_kv_cache_specs()
            available = self.model_executor.determine_available_memory()
            # One config per worker: pipeline stages hold different numbers of layers.
            kv_cache_configs = get_kv_cache_configs(self.config, specs, available)
            kv_cache_config = kv_cache_configs[0]
            self.config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
            spec = kv_cache_config.spec
            capacity = (kv_cache_config.num_blocks - 1) * spec.block_size
            max_len = self.config.model_config.max_model_len
            st.set(catalogue.ATTR_KV_NUM_BLOCKS, kv_cache_config.num_blocks)
            st.set(catalogue.ATTR_KV_BLOCK_SIZE, spec.block_size)
            st.set(catalogue.ATTR_KV_AVAILABLE_BYTES, min(available))
            logger.info(
                "KV cache: %d blocks of %d tokens (%.1f MiB), capacity %d tokens; "
                "maximum concurrency for %d tokens per request: %.2fx",
                kv_cache_config.num_blocks,
                spec.block_size,
                kv_cache_config.num_blocks * spec.bytes_per_block / (1 << 20),
                capacity,
                max_len,
                capacity / max_len,
            )
            self.model_executor.initialize_from_config(kv_cache_configs)
            return kv_cache_config

    def add_request(self, request: EngineCoreRequest) -> None:
        """Turn a frontend request into a scheduler ``Request`` and queue it."""
        self.scheduler.add_request(
            Request(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params,
                eos_token_id=request.eos_token_id,
                arrival_time=request.arrival_time,
                priority=request.priority,
                client_index=request.client_index,
                trace_headers=request.trace_headers,
                block_hasher=self.block_hasher,
            )
        )
        self.request_tracer.add(request.request_id, request.trace_headers)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop these requests now and free their KV blocks (unknown ids are ignored)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.request_tracer.abort(request_ids)

    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """One engine step.

        Returns:
            ``(outputs per client index, model_executed)``. Nothing runs when there is
            no request and no finished id left to hand to the workers.
        """
        if not self.scheduler.has_requests():
            return {}, False
        self.step_counter += 1
        started_at = time.time()
        t0 = time.perf_counter()
        with stage(catalogue.ENGINE_CORE_STEP, **{catalogue.ATTR_STEP_ID: self.step_counter}) as st:
            step_id = {catalogue.ATTR_STEP_ID: self.step_counter}
            with stage(catalogue.SCHEDULER_SCHEDULE, **step_id) as sched_span:
                scheduler_output = self.scheduler.schedule()
                batch, prefill_ids = self._classify_batch(scheduler_output)
                num_running, num_waiting = self.scheduler.get_request_counts()
                if sched_span.span is not None:  # the batch's figures, on this span and the step's
                    for span in (sched_span, st):
                        span.set(catalogue.ATTR_STEP_NUM_SCHEDULED_TOKENS,
                                 scheduler_output.total_num_scheduled_tokens)  # fmt: skip
                        span.set(
                            catalogue.ATTR_STEP_TOKEN_BUDGET,
                            self.config.scheduler_config.max_num_batched_tokens,
                        )
                        span.set(catalogue.ATTR_STEP_NUM_NEW_REQS, len(scheduler_output.scheduled_new_reqs))
                        span.set(
                            catalogue.ATTR_STEP_NUM_CACHED_REQS,
                            scheduler_output.scheduled_cached_reqs.num_reqs,
                        )
                        span.set(catalogue.ATTR_STEP_NUM_PREEMPTED, len(scheduler_output.preempted_req_ids))
                        span.set(catalogue.ATTR_STEP_NUM_RUNNING, num_running)
                        span.set(catalogue.ATTR_STEP_NUM_WAITING, num_waiting)
            t1 = time.perf_counter()
            with stage(catalogue.EXECUTOR_EXECUTE_MODEL, **step_id):
                model_output = self.model_executor.execute_model(scheduler_output)
            t2 = time.perf_counter()
            # update_from_output forgets the requests it finishes; live telemetry's finished
            # events carry their final counts, so keep this step's requests at hand.
            held = self._scheduled_requests(scheduler_output) if get_publisher() is not None else {}
            with stage(catalogue.SCHEDULER_UPDATE_FROM_OUTPUT, **step_id) as update_span:
                outputs = self.scheduler.update_from_output(scheduler_output, model_output)
                if update_span.span is not None:
                    after_running, after_waiting = self.scheduler.get_request_counts()
                    update_span.set(catalogue.ATTR_STEP_NUM_RUNNING, after_running)
                    update_span.set(catalogue.ATTR_STEP_NUM_WAITING, after_waiting)
                    update_span.set(catalogue.ATTR_KV_USAGE, self.scheduler.kv_cache_manager.usage)
            t3 = time.perf_counter()
            kv_usage = self.scheduler.kv_cache_manager.usage
            st.set(catalogue.ATTR_KV_USAGE, kv_usage)
            step_context = st.span.get_span_context() if st.span is not None else None
            self.last_step_context = step_context
            if self.request_tracer._phases:
                produced = [o for eco in outputs.values() for o in eco.outputs]
                self.request_tracer.step(scheduler_output, prefill_ids, step_context,
                                         [o.request_id for o in produced if o.new_token_ids],
                                         {o.request_id: str(o.finish_reason) for o in produced if o.finished},
                                         int(started_at * 1e9))  # fmt: skip
        num_running, num_waiting = self.scheduler.get_request_counts()
        # What engine-top's step panel shows (a StepRecord without its header).
        self.last_step = {
            "step_id": self.step_counter,
            "started_at": started_at,
            "duration_ms": (t3 - t0) * 1e3,
            "schedule_ms": (t1 - t0) * 1e3,
            "execute_ms": (t2 - t1) * 1e3,
            "update_ms": (t3 - t2) * 1e3,
            **batch,
            "tokens_scheduled": scheduler_output.total_num_scheduled_tokens,
            "token_budget": self.config.scheduler_config.max_num_batched_tokens,
            "num_running": num_running,
            "num_waiting": num_waiting,
            "num_preempted": len(scheduler_output.preempted_req_ids),
            "kv_usage": kv_usage,
        }
        self.flight_recorder.append(self.last_step)
        self._after_step(scheduler_output, outputs, held)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)  # --step-delay-ms: slow motion for a class
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def _scheduled_requests(self, scheduler_output: SchedulerOutput) -> dict[str, Request]:
        """This step's scheduled requests by id (read before ``update_from_output`` frees the
        finished ones)."""
        requests = self.scheduler.requests
        return {
            rid: r for rid in scheduler_output.num_scheduled_tokens if (r := requests.get(rid)) is not None
        }

    def _after_step(
        self,
        scheduler_output: SchedulerOutput,
        outputs: dict[int, EngineCoreOutputs],
        held: dict[str, Request] | None = None,
    ) -> None:
        """Live telemetry, when this process publishes it: the step's record and its
        requests' changes (scheduled, preempted, finished). ``held``: this step's requests
        (``_scheduled_requests``), for the final token counts of those that finished."""
        publisher = get_publisher()
        if publisher is None:
            return
        rank = self.config.parallel_config.data_parallel_rank
        publisher.mark_step()
        publisher.publish_step(engine_index=rank, **self.last_step)
        for new in scheduler_output.scheduled_new_reqs:
            publisher.publish_request_event(
                new.req_id, "scheduled", engine_index=rank, num_prompt_tokens=len(new.prompt_token_ids),
                num_computed_tokens=new.num_computed_tokens, num_blocks=len(new.block_ids[0]) if new.block_ids else 0,
            )  # fmt: skip
        for req_id in scheduler_output.preempted_req_ids:  # its KV freed: it recomputes from 0
            publisher.publish_request_event(req_id, "preempted", engine_index=rank, reason="KV cache full",
                                            num_computed_tokens=0)  # fmt: skip
        for client_outputs in outputs.values():
            for out in client_outputs.outputs:
                if out.finish_reason is None:
                    continue
                counts = {}
                if held and (r := held.get(out.request_id)) is not None:
                    counts = dict(num_prompt_tokens=r.num_prompt_tokens, num_computed_tokens=r.num_computed_tokens,
                                  num_output_tokens=r.num_output_tokens, num_blocks=0)  # fmt: skip
                publisher.publish_request_event(out.request_id, "finished", engine_index=rank,
                                                reason=str(out.finish_reason), **counts)  # fmt: skip

    def telemetry_requests(self) -> list[RequestProgress]:
        """The requests this engine holds now, with their progress, for live telemetry's
        snapshots (read from the heartbeat thread: copies of the queues, counters only)."""
        scheduler, rank = self.scheduler, self.config.parallel_config.data_parallel_rank
        block_ids = scheduler.kv_cache_manager.req_to_blocks
        return [
            RequestProgress(
                request_id=r.request_id,
                state=state,
                engine_index=rank,
                num_prompt_tokens=r.num_prompt_tokens,
                num_computed_tokens=r.num_computed_tokens,
                num_output_tokens=r.num_output_tokens,
                num_blocks=len(block_ids.get(r.request_id, ())),
                arrived_at=r.arrival_time,
            )  # fmt: skip
            for state, queue in (("running", list(scheduler.running)), ("waiting", list(scheduler.waiting)))
            for r in queue
        ]

    def telemetry_gauges(self) -> dict[str, float]:
        """Scheduler and KV-cache gauges for live telemetry (read from the heartbeat thread:
        lengths and counters only, nothing that changes state)."""
        scheduler = self.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        total = pool.num_gpu_blocks - 1  # the null block holds nothing
        free = pool.get_num_free_blocks()
        queries = scheduler.prefix_cache_queries
        return {
            events.GAUGE_WAITING: len(scheduler.waiting),
            events.GAUGE_RUNNING: len(scheduler.running),
            events.GAUGE_PREEMPTED: scheduler.num_preemptions,
            events.GAUGE_KV_TOTAL: total,
            events.GAUGE_KV_FREE: free,
            events.GAUGE_KV_USED: total - free,
            events.GAUGE_KV_CACHED: len(pool.cached_block_hash_to_block),
            events.GAUGE_PREFIX_HIT_RATE: scheduler.prefix_cache_hits / queries if queries else 0.0,
        }

    def _classify_batch(self, so: SchedulerOutput) -> tuple[dict[str, Any], set[str]]:
        """Split a step's requests into decodes (one token, past the prompt) and prefills
        (prompt tokens, or recomputation after preemption); a prefill that leaves tokens for
        a later step is a chunk. Returns the counts and the prefilling request ids."""
        decode_reqs = decode_tokens = prefill_reqs = prefill_tokens = chunked = 0
        prefill_ids: set[str] = set()
        requests = self.scheduler.requests
        for req_id, n in so.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None:
                continue
            computed = request.num_computed_tokens - n  # the scheduler has advanced it already
            if n == 1 and computed >= request.num_prompt_tokens:
                decode_reqs += 1
                decode_tokens += 1
            else:
                prefill_reqs += 1
                prefill_tokens += n
                prefill_ids.add(req_id)
                if computed + n < request.num_tokens:
                    chunked += 1
        return {
            "num_decode_reqs": decode_reqs,
            "num_decode_tokens": decode_tokens,
            "num_prefill_reqs": prefill_reqs,
            "num_prefill_tokens": prefill_tokens,
            "num_chunked_prefills": chunked,
        }, prefill_ids

    # Utility calls (the frontend reaches these through ``call_utility``).

    def get_scheduler_stats(self):
        return self.scheduler.make_stats()

    def get_kv_cache_info(self) -> dict[str, int]:
        pool = self.scheduler.kv_cache_manager.block_pool
        return {"num_blocks": self.kv_cache_config.num_blocks, "num_free_blocks": pool.get_num_free_blocks()}

    def execute_dummy_batch(self) -> None:
        """A dummy forward on the workers; the engine's scheduler and KV cache are untouched."""
        self.model_executor.execute_dummy_batch()

    def get_worker_comm_stats(self, reset: bool = False) -> list[dict[str, float]]:
        """Per worker, in rank order: seconds in ``execute_model`` and in TP collectives."""
        return self.model_executor.collective_rpc("get_comm_stats", args=(reset,))

    def shutdown(self) -> None:
        with stage(catalogue.ENGINE_CORE_SHUTDOWN):
            self.model_executor.shutdown()
