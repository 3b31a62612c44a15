"""``Executor``: the one way the engine core reaches its workers.

Mirrors vLLM's ``vllm/v1/executor/abstract.py``. The engine core never calls a worker
directly: it calls ``collective_rpc(method, args)``, which runs ``method`` on every worker
and returns their results in rank order. ``UniProcExecutor`` does that with a plain call in
the same process; ``MultiprocExecutor`` broadcasts it over shared memory to worker
processes; ``RayDistributedExecutor`` calls one Ray actor per worker — the engine core's
code is the same either way.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine import envs
from engine.config import ConfigError, EngineConfig
from engine.kv_cache.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from engine.logger import init_logger
from engine.outputs import ModelRunnerOutput
from engine.sched.output import SchedulerOutput
from engine.utils import run_dir as run_dirs
from engine.utils.processes import ChildProcess, EngineDeadError
from engine.utils.supervisor import Supervisor
from engine.utils.wire import ErrorKind, ProtocolError
from tracing.run_dir import ProcessStatus, read_status

logger = init_logger(__name__)


class Executor(ABC):
    """Base of all executors.

    Raises (from ``get_class``):
        ValueError: unknown ``distributed_executor_backend``.
    """

    def __init__(self, config: EngineConfig, run_dir: str | None = None) -> None:
        self.config = config
        # Where multiprocess executors keep their queues and workers their status files.
        self.run_dir = run_dir
        # Executors with workers in other processes: each rank's role name, and the supervisor
        # that turns the first worker failure into this executor's EngineDeadError.
        self.roles: list[str] = []
        self.supervisor: Supervisor | None = None
        self.failure_callback: Callable[[EngineDeadError], None] | None = None
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

    # ---------------------------------------------- for executors with worker processes
    # (``roles``: each rank's role name; ``run_dir``: where their status files are;
    # ``supervisor``: the one failure, and the callback it goes to.)

    @property
    def failure(self) -> EngineDeadError | None:
        """The first worker failure (``supervisor.failure``), or None."""
        return self.supervisor.failure if self.supervisor is not None else None

    def _raise_if_failed(self) -> None:
        """Raises the first worker failure, if there was one (``EngineDeadError``)."""
        if self.supervisor is not None:
            self.supervisor.raise_if_failed()

    def _on_failure(self, error: EngineDeadError, child: ChildProcess | None) -> None:
        """The supervisor's callback: hand the failure to the engine core's (once)."""
        if self.failure_callback is not None:
            self.failure_callback(error)

    def _describe_reader(self, rank: int) -> str:
        """Worker ``rank``'s lifecycle stage and time in it, from its status file."""
        role = self.roles[rank]
        status = read_status(run_dirs.status_file(Path(self.run_dir), role)) or ProcessStatus()
        if status.stage:
            return f"{role} is in stage {status.stage} for {time.time() - (status.entered_at or time.time()):.1f} s"
        last = status.last_finished.name if status.last_finished is not None else None
        return (
            f"{role} is past start-up (last lifecycle stage {last})" if last else f"{role} reports no stage"
        )

    def _blame_dead_peer(self, rank: int) -> None:
        """Fail with a dead peer of ``rank`` as the root cause, if one died (a peer's death
        makes the survivors' collective fail first); executors with several workers override it."""
        return None

    def _raise_for_worker_error(self, rank: int, method: str, reply: Any) -> None:
        """Worker ``rank``'s failed ``WorkerReply`` to ``method`` → the caller's error where the
        worker's error is the caller's (a ``ConfigError`` as one line naming the flag, a
        ``ValueError`` naming the worker). Otherwise returns, after a dead peer had its chance
        to be blamed: the executor then fails the engine naming the worker.

        Raises:
            ProtocolError: a failure reply without an error.
            ConfigError, ValueError: as above.
        """
        error = reply.error
        if error is None:
            raise ProtocolError(f"{self.roles[rank]} reported a failure of {method!r} without an error")
        if error.kind is ErrorKind.CONFIG:
            # A bad setting found where torch lives (e.g. --device cuda without CUDA): the
            # caller's error, one line naming the flag, no traceback.
            logger.debug("%s failed in %s:\n%s", self.roles[rank], method, error.traceback)
            raise ConfigError.from_message(error.message, flag=error.flag or "")
        self._blame_dead_peer(rank)
        logger.error("%s failed in %s:\n%s", self.roles[rank], method, error.traceback)
        if error.kind is ErrorKind.VALUE:
            raise ValueError(f"{self.roles[rank]} failed in {method}: {error.type}: {error.message}")

    def _start_workers(self, all_kwargs: list[dict[str, Any]]) -> None:
        """The first three lifecycle RPCs, the same for every executor:
        ``init_worker`` (build each Worker) → ``init_device`` → ``load_model``."""
        self._start_up_rpc("init_worker", args=(all_kwargs,))
        self.device_info = self._start_up_rpc("init_device")[0]
        self._start_up_rpc("load_model")

    def _start_up_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """A lifecycle RPC of start-up, bounded by ``GLASSBOX_ENGINE_READY_TIMEOUT_S``, not by
        a step's ``GLASSBOX_EXECUTE_MODEL_TIMEOUT_S``: a cold torch.compile on a loaded
        machine takes minutes (vLLM waits on these without a deadline)."""
        return self.collective_rpc(method, timeout=envs.GLASSBOX_ENGINE_READY_TIMEOUT_S, args=args)

    def determine_available_memory(self) -> list[int]:
        """KV-cache bytes each worker can spend (after a profile run)."""
        return self._start_up_rpc("determine_available_memory")

    def get_kv_cache_specs(self) -> list[FullAttentionSpec]:
        return self._start_up_rpc("get_kv_cache_spec")

    def initialize_from_config(self, kv_cache_configs: list[KVCacheConfig]) -> None:
        """Allocate the KV caches, then warm up (vLLM does both in this call).

        ``kv_cache_configs`` has one entry per worker, in rank order (pipeline stages differ in
        their layers); each worker's wrapper picks its own.
        """
        self._start_up_rpc("initialize_from_config", args=(kv_cache_configs,))
        self._start_up_rpc("compile_or_warm_up_model")

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

    def register_failure_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call ``callback(error)`` when a worker dies (executors with worker processes; from
        the supervisor's thread, or the thread whose call saw the failure)."""
        self.failure_callback = callback

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release their resources."""
