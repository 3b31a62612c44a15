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

from engine.config import EngineConfig
from engine.core.messages import EngineCoreOutputs, EngineCoreRequest
from engine.executor.abstract import Executor
from engine.kv_cache.kv_cache_interface import KVCacheConfig
from engine.kv_cache.kv_cache_planning import get_kv_cache_configs
from engine.kv_cache.kv_cache_utils import get_request_block_hasher
from engine.logger import init_logger
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler
from tracing import catalogue, stage

logger = init_logger(__name__)


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
        with stage(catalogue.ENGINE_CORE_INIT):
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

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop these requests now and free their KV blocks (unknown ids are ignored)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """One engine step.

        Returns:
            ``(outputs per client index, model_executed)``. Nothing runs when there is
            no request and no finished id left to hand to the workers.
        """
        if not self.scheduler.has_requests():
            return {}, False
        self.step_counter += 1
        with stage(catalogue.ENGINE_CORE_STEP, **{catalogue.ATTR_STEP_ID: self.step_counter}) as st:
            with stage(catalogue.SCHEDULER_SCHEDULE) as sched_span:
                scheduler_output = self.scheduler.schedule()
                num_running, num_waiting = self.scheduler.get_request_counts()
                sched_span.set(
                    catalogue.ATTR_STEP_NUM_SCHEDULED_TOKENS, scheduler_output.total_num_scheduled_tokens
                )
                sched_span.set(
                    catalogue.ATTR_STEP_TOKEN_BUDGET, self.config.scheduler_config.max_num_batched_tokens
                )
                sched_span.set(catalogue.ATTR_STEP_NUM_NEW_REQS, len(scheduler_output.scheduled_new_reqs))
                sched_span.set(
                    catalogue.ATTR_STEP_NUM_CACHED_REQS, scheduler_output.scheduled_cached_reqs.num_reqs
                )
                sched_span.set(catalogue.ATTR_STEP_NUM_PREEMPTED, len(scheduler_output.preempted_req_ids))
                sched_span.set(catalogue.ATTR_STEP_NUM_RUNNING, num_running)
                sched_span.set(catalogue.ATTR_STEP_NUM_WAITING, num_waiting)
            with stage(catalogue.EXECUTOR_EXECUTE_MODEL):
                model_output = self.model_executor.execute_model(scheduler_output)
            with stage(catalogue.SCHEDULER_UPDATE_FROM_OUTPUT):
                outputs = self.scheduler.update_from_output(scheduler_output, model_output)
            st.set(catalogue.ATTR_KV_USAGE, self.scheduler.kv_cache_manager.usage)
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    # Utility calls (the frontend reaches these through ``call_utility``).

    def get_scheduler_stats(self):
        return self.scheduler.make_stats()

    def get_kv_cache_info(self) -> dict[str, int]:
        pool = self.scheduler.kv_cache_manager.block_pool
        return {"num_blocks": self.kv_cache_config.num_blocks, "num_free_blocks": pool.get_num_free_blocks()}

    def get_worker_comm_stats(self, reset: bool = False) -> list[dict[str, float]]:
        """Per worker, in rank order: seconds in ``execute_model`` and in TP collectives."""
        return self.model_executor.collective_rpc("get_comm_stats", args=(reset,))

    def shutdown(self) -> None:
        with stage(catalogue.ENGINE_CORE_SHUTDOWN):
            self.model_executor.shutdown()
