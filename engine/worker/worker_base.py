"""``WorkerWrapperBase``: what an executor holds for each worker before the worker exists.

Mirrors vLLM's ``vllm/v1/worker/worker_base.py``. The wrapper is cheap to build (it only
keeps the config and its ``rpc_rank``, the worker's index in the executor); the real
``Worker`` (``CPUWorker`` on a CPU) is built by the ``init_worker`` RPC, so a worker process can report "alive"
before anything heavy happens. Every other call is forwarded to the worker, which is how
``collective_rpc("load_model")`` reaches ``Worker.load_model``.
"""

from __future__ import annotations

from typing import Any

from engine.config import EngineConfig
from tracing import catalogue, stage


class WorkerWrapperBase:
    """Holds config and rank; builds the ``Worker`` on ``init_worker``.

    Args:
        config: the whole engine config.
        rpc_rank: index of this worker in its executor (also its tensor-parallel rank here).
    """

    def __init__(self, config: EngineConfig, rpc_rank: int = 0) -> None:
        with stage(catalogue.WORKER_WRAPPER_INIT, **{catalogue.ATTR_RANK: rpc_rank}):
            self.config = config
            self.rpc_rank = rpc_rank
            self.worker: Any = None

    def init_worker(self, all_kwargs: list[dict[str, Any]]) -> None:
        """Build the worker from ``all_kwargs[rpc_rank]`` (local_rank, rank, ...)."""
        with stage(catalogue.WORKER_INIT_WORKER, **{catalogue.ATTR_RANK: self.rpc_rank}):
            kwargs = all_kwargs[self.rpc_rank]
            self.worker = _worker_cls(self.config, kwargs.get("local_rank", 0))(config=self.config, **kwargs)

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        """Hand the worker its own entry of the per-worker KV cache configs (rank order)."""
        self.worker.initialize_from_config(kv_cache_configs[self.rpc_rank])

    def execute_method(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on the wrapper if it has it, else on the worker."""
        target = self if hasattr(type(self), method) else self.worker
        if target is None:
            raise RuntimeError(f"worker {self.rpc_rank}: {method!r} called before init_worker")
        return getattr(target, method)(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        worker = self.__dict__.get("worker")
        if worker is None:
            raise AttributeError(name)
        return getattr(worker, name)


def _worker_cls(config: EngineConfig, local_rank: int) -> type:
    """``CPUWorker`` (``engine/worker/cpu/cpu_worker.py``) for a worker on the CPU, else
    ``Worker`` (vLLM: the platform's ``worker_cls``). A device setting that does not resolve
    gets ``Worker``, whose ``init_device`` reports it."""
    from engine.config import ConfigError
    from engine.model.loader import resolve_device
    from engine.worker.worker import Worker

    try:
        device = resolve_device(config.device_config.device, local_rank)
    except ConfigError:
        return Worker
    if device.type != "cpu":
        return Worker
    from engine.worker.cpu.cpu_worker import CPUWorker

    return CPUWorker
