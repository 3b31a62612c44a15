"""``EngineCore``: the scheduler, the KV cache manager and the executor, stepped together.

Mirrors vLLM's ``vllm/v1/engine/core.py`` (``EngineCore``; ``EngineCoreProc``, the same
core in its own process with input/output threads, is ``engine_core_proc.py``). One
``step()`` is the whole engine in three calls:

    schedule()  →  execute_model()  →  update_from_output()

each inside its span; the spans, the phase times and the step's ``StepRecord`` are the
``StepTracer``'s, and what watches the steps (the spans' figures, request phases, the flight
recorder, live telemetry) is a step observer (both in ``step_observer.py``).

Start-up sizes the KV cache between the executor's creation and the scheduler's: the
workers profile memory, the core turns bytes into blocks (``kv_cache_planning``), logs the
capacity, and only then builds the ``Scheduler`` over that many blocks.
"""

from __future__ import annotations

import functools
import time

from engine.config import EngineConfig
from engine.core.messages import EngineCoreOutputs, EngineCoreRequest
from engine.core.request_tracing import RequestPhaseTracer
from engine.core.step_observer import (
    FlightRecorder,
    StepObserver,
    StepSpanAttributes,
    StepTelemetry,
    StepTracer,
)
from engine.core.structured_output import StructuredOutputManager
from engine.executor.abstract import Executor
from engine.kv_cache.kv_cache_interface import KVCacheConfig
from engine.kv_cache.kv_cache_planning import get_kv_cache_configs
from engine.kv_cache.kv_cache_utils import get_request_block_hasher
from engine.logger import init_logger
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler
from tracing import catalogue, stage
from tracing.telemetry import events
from tracing.telemetry.events import RequestProgress, StepRecord

logger = init_logger(__name__)

# The longest the busy loop waits for a grammar to compile when nothing else can run (s);
# it then drains its input queue and looks again.
GRAMMAR_WAIT_S = 0.01


def tokenizer_json(tokenizer_dir: str) -> str:
    """The model's tokenizer as ``tokenizer.json`` text (added tokens included), for the
    grammar backend: what the API server's tokenizer is built from too."""
    from engine.frontend.tokenizer import get_tokenizer

    backend = get_tokenizer(tokenizer_dir).backend_tokenizer
    return backend.to_str()


def eos_token_ids(model_config) -> list[int]:
    """Every id that ends an output: the primary EOS and ``generation_config.json``'s."""
    ids = [] if model_config.eos_token_id is None else [model_config.eos_token_id]
    eos = model_config.generation_config.get("eos_token_id")
    for token_id in [eos] if isinstance(eos, int) else (eos or []):
        if token_id not in ids:
            ids.append(token_id)
    return ids


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
            self.structured_output_manager = StructuredOutputManager(
                config.structured_outputs_config,
                functools.partial(tokenizer_json, config.model_config.tokenizer),
                config.model_config.vocab_size,
                eos_token_ids(config.model_config),
                config.scheduler_config.max_num_seqs,
            )
            self.scheduler = Scheduler(
                config.scheduler_config,
                config.cache_config,
                self.kv_cache_config,
                log_stats=log_stats,
                use_pp=config.parallel_config.pipeline_parallel_size > 1,
                structured_output_manager=self.structured_output_manager,
            )
            self.block_hasher = (
                get_request_block_hasher(config.cache_config.block_size)
                if config.cache_config.enable_prefix_caching
                else None
            )
            self.step_counter = 0
            # Request phases as spans of each request's own trace (when it came with one).
            self.request_tracer = RequestPhaseTracer()
            # The last steps' records, written beside the crash report when the core dies.
            self.flight_recorder = FlightRecorder()
            # What watches each step (step_observer.py): spans, request phases, the flight
            # recorder, live telemetry; a test may add its own.
            self.step_observers: list[StepObserver] = [
                StepSpanAttributes(self.scheduler, config.scheduler_config.max_num_batched_tokens),
                self.request_tracer,
                self.flight_recorder,
                StepTelemetry(self.scheduler),
            ]
            # The step's spans and phase times, and the hooks of step_observers.
            self.step_tracer = StepTracer(
                self.scheduler,
                config.parallel_config.data_parallel_rank,
                config.scheduler_config.max_num_batched_tokens,
                self.step_observers,
                config.observability_config.step_delay_ms,
            )
            self.step_delay_s = config.observability_config.step_delay_ms / 1e3
            # The latest --step-delay-ms pause, (start, end) in Unix ns: a request that waited
            # in input_queue through it is told so (its engine_core.input_queue span).
            self.last_step_delay_ns: tuple[int, int] = (0, 0)

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
            # What one block costs and the numbers it is made of (the spec's bytes_per_block).
            st.set(catalogue.ATTR_KV_BYTES_PER_BLOCK, spec.bytes_per_block)
            st.set(catalogue.ATTR_KV_NUM_LAYERS, spec.num_layers)
            st.set(catalogue.ATTR_KV_NUM_KV_HEADS, spec.num_kv_heads)
            st.set(catalogue.ATTR_KV_HEAD_SIZE, spec.head_size)
            st.set(catalogue.ATTR_KV_DTYPE_SIZE, spec.dtype_size)
            logger.info(
                "KV cache: %d blocks of %d tokens (%.1f MiB), capacity %d tokens; "
                "maximum concurrency for %d tokens per request: %.2fx; one block is %d bytes = "
                "2 (K and V) · %d tokens · %d layers · %d KV heads · %d head_dim · %d bytes per element",
                kv_cache_config.num_blocks,
                spec.block_size,
                kv_cache_config.num_blocks * spec.bytes_per_block / (1 << 20),
                capacity,
                max_len,
                capacity / max_len,
                spec.bytes_per_block,
                spec.block_size,
                spec.num_layers,
                spec.num_kv_heads,
                spec.head_size,
                spec.dtype_size,
            )
            self.model_executor.initialize_from_config(kv_cache_configs)
            return kv_cache_config

    def add_request(self, request: EngineCoreRequest) -> None:
        """Turn a frontend request into a scheduler ``Request`` and queue it; a structured one
        starts compiling its grammar (in the manager's threads) and waits as WAITING_FOR_FSM."""
        core_request = Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            client_index=request.client_index,
            block_hasher=self.block_hasher,
            pooling_params=request.pooling_params,
        )
        self.structured_output_manager.grammar_init(core_request, request.trace_headers)
        self.scheduler.add_request(core_request)
        self.request_tracer.add(request.request_id, request.trace_headers)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop these requests now and free their KV blocks (unknown ids are ignored)."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.request_tracer.abort(request_ids)

    def step(self) -> tuple[dict[int, EngineCoreOutputs], bool]:
        """One engine step: schedule, execute, update, each in its span (``step_tracer``),
        whose ``StepRecord`` goes to every one of ``step_observers``.

        Returns:
            ``(outputs per client index, model_executed)``. Nothing runs when there is
            no request and no finished id left to hand to the workers.
        """
        if not self.scheduler.has_requests():
            return {}, False
        if self._only_waiting_for_grammars():
            # Nothing can run until a grammar compiles: wait for one (bounded) rather than
            # spin empty steps.
            self.structured_output_manager.wait_for_any_grammar(GRAMMAR_WAIT_S)
            return {}, False
        self.step_counter += 1
        tracer = self.step_tracer
        with tracer.step(self.step_counter):
            with tracer.phase(catalogue.SCHEDULER_SCHEDULE):
                scheduler_output = self.scheduler.schedule()
                tracer.scheduled(scheduler_output)
            if scheduler_output.structured_output_request_ids:
                with tracer.phase(catalogue.STRUCTURED_OUTPUT_GRAMMAR_BITMASK):
                    self.scheduler.get_grammar_bitmask(scheduler_output)
            with tracer.phase(catalogue.EXECUTOR_EXECUTE_MODEL):
                model_output = self.model_executor.execute_model(scheduler_output)
            with tracer.phase(catalogue.SCHEDULER_UPDATE_FROM_OUTPUT):
                outputs = self.scheduler.update_from_output(scheduler_output, model_output)
                tracer.updated()
        tracer.stepped(outputs)
        if self.step_delay_s:  # --step-delay-ms: slow motion for a class, apart from the step's time
            with stage(catalogue.ENGINE_CORE_STEP_DELAY, step_id=self.step_counter,
                       step_delay_ms=self.step_delay_s * 1e3):  # fmt: skip
                start_ns = time.time_ns()
                time.sleep(self.step_delay_s)
                self.last_step_delay_ns = (start_ns, time.time_ns())
        return outputs, scheduler_output.total_num_scheduled_tokens > 0

    def _only_waiting_for_grammars(self) -> bool:
        """Every unfinished request waits for its grammar, and no finished id waits to be
        handed to the workers."""
        scheduler = self.scheduler
        return (
            self.structured_output_manager.num_pending > 0
            and not scheduler.running
            and not scheduler.has_finished_requests()
            and all(r.status == RequestStatus.WAITING_FOR_FSM and r.structured_output_request.grammar is None
                    for r in scheduler.waiting)
        )  # fmt: skip

    def dummy_step_record(self, started_at: float, duration_ms: float) -> StepRecord:
        """A DP dummy batch's record (no request: every count 0): ``started_at`` Unix s,
        ``duration_ms`` all of it executing. Its ``step_id`` is the last real step's."""
        return StepRecord(
            engine_index=self.config.parallel_config.data_parallel_rank,
            step_id=self.step_counter,
            started_at=started_at,
            duration_ms=duration_ms,
            execute_ms=duration_ms,
            token_budget=self.config.scheduler_config.max_num_batched_tokens,
            kv_usage=self.scheduler.kv_cache_manager.usage,
            dummy=True,
        )

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
                num_blocks=len(blocks := list(block_ids.get(r.request_id, ()))),
                arrived_at=r.arrival_time,
                block_ids=[block.block_id for block in blocks],
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
            events.GAUGE_WAITING_FOR_FSM: scheduler.num_waiting_for_fsm(),
            events.GAUGE_RUNNING: len(scheduler.running),
            events.GAUGE_PREEMPTED: scheduler.num_preemptions,
            events.GAUGE_KV_TOTAL: total,
            events.GAUGE_KV_FREE: free,
            events.GAUGE_KV_USED: total - free,
            events.GAUGE_KV_CACHED: pool.num_free_cached_blocks,
            events.GAUGE_PREFIX_HIT_RATE: scheduler.prefix_cache_hits / queries if queries else 0.0,
        }

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
            self.structured_output_manager.clear_backend()
            self.model_executor.shutdown()
