"""``UniProcExecutor``: one worker, inside the engine core's own process.

Mirrors vLLM's ``UniProcExecutor``. ``collective_rpc`` is a direct method call on the single
``WorkerWrapperBase``; no process, queue or process group is involved
(``--distributed-executor-backend uni``).
"""

from __future__ import annotations

from typing import Any

from engine.executor.abstract import Executor
from engine.worker.worker_base import WorkerWrapperBase
from tracing import catalogue, stage


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        with stage(catalogue.EXECUTOR_INIT):
            self.driver_worker = WorkerWrapperBase(self.config, rpc_rank=0)
            self._start_workers(
                [{"local_rank": 0, "rank": 0, "distributed_init_method": None, "is_driver_worker": True}]
            )

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        # In-process: nothing to wait for, so the timeout does not apply.
        return [self.driver_worker.execute_method(method, *args, **(kwargs or {}))]

    def execute_model(self, scheduler_output):
        # The hot path: skip the generic RPC dispatch.
        return self.driver_worker.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        worker = getattr(self, "driver_worker", None)
        if worker is not None and worker.worker is not None:
            worker.worker.shutdown()
