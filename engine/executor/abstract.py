"""``Executor``: the one way the engine core reaches its workers.

Mirrors vLLM's ``vllm/v1/executor/abstract.py``. The engine core never calls a worker
directly: it calls ``collective_rpc(method, args)``, which runs ``method`` on every worker
and returns their results in rank order. ``UniProcExecutor`` does that with a plain call in
the same process; ``MultiprocExecutor`` broadcasts it over shared memory to worker
processes; ``RayDistributedExecutor`` calls one Ray actor per worker — the engine core's
code is the same either way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from engine.config import EngineConfig
from engine.kv_cache.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from engine.outputs import ModelRunnerOutput
from engine.sched.output import SchedulerOutput


class Executor(ABC):
    """Base of all executors.

    Raises (from ``get_class``):
        ValueError: unknown ``distributed_executor_backend``.
    """

    def __init__(self, config: EngineConfig, run_dir: str | None = None) -> None:
        self.config = config
        # Where multiprocess executors keep their queues and workers their status files.
        self.run_dir = run_dir
        # Set by init_device on every worker; the driver's copy is reported to the frontend.
        self.device_info: dict[str, str] = {}
        try:
            self._init_executor()
        except BaseException:
            # Failed or interrupted (SIGTERM, Ctrl-C) part-way: stop the workers already
            # started, in order, rather than leave them to their lifelines (a SIGSTOPped
            # one would never read its lifeline again).
            self.shutdown()
            raise

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        backend = config.parallel_config.distributed_executor_backend
        if backend == "uni":
            from engine.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor
        if backend == "mp":
            from engine.executor.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor
        if backend == "ray":
            try:
                from engine.executor.ray_executor import RayDistributedExecutor
            except ImportError as e:  # ParallelConfig checks first; a broken install lands here
                from engine.config import RAY_INSTALL_HINT, ConfigError

                raise ConfigError(
                    "--distributed-executor-backend",
                    "ray",
                    f"Ray cannot be imported ({e}): {RAY_INSTALL_HINT}",
                ) from None
            return RayDistributedExecutor
        raise ValueError(f"distributed_executor_backend {backend!r} is not available in this version")

    @abstractmethod
    def _init_executor(self) -> None:
        """Create the workers and run init_worker → init_device → load_model."""

    @abstractmethod
    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run ``method(*args, **kwargs)`` on every worker; results in rank order."""

    def _start_workers(self, all_kwargs: list[dict[str, Any]]) -> None:
        """The first three lifecycle RPCs, the same for every executor:
        ``init_worker`` (build each Worker) → ``init_device`` → ``load_model``."""
        self.collective_rpc("init_worker", args=(all_kwargs,))
        self.device_info = self.collective_rpc("init_device")[0]
        self.collective_rpc("load_model")

    def determine_available_memory(self) -> list[int]:
        """KV-cache bytes each worker can spend (after a profile run)."""
        return self.collective_rpc("determine_available_memory")

    def get_kv_cache_specs(self) -> list[FullAttentionSpec]:
        return self.collective_rpc("get_kv_cache_spec")

    def initialize_from_config(self, kv_cache_configs: list[KVCacheConfig]) -> None:
        """Allocate the KV caches, then warm up (vLLM does both in this call).

        ``kv_cache_configs`` has one entry per worker, in rank order (pipeline stages differ in
        their layers); each worker's wrapper picks its own.
        """
        self.collective_rpc("initialize_from_config", args=(kv_cache_configs,))
        self.collective_rpc("compile_or_warm_up_model")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", args=(scheduler_output,))[0]

    def telemetry_gauges(self) -> dict[str, float]:
        """Live-telemetry gauges of the executor itself (the broadcast queue, with workers)."""
        return {}

    def execute_dummy_batch(self) -> None:
        """A dummy forward on every worker (data parallelism: an engine with nothing to do
        steps while its wave runs; vLLM: ``execute_dummy_batch``)."""
        self.collective_rpc("execute_dummy_batch")

    def check_health(self) -> None:
        self.collective_rpc("check_health")

    def register_failure_callback(self, callback) -> None:
        """Call ``callback(error)`` when a worker dies (executors with worker processes)."""
        self.failure_callback = callback

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release their resources."""
