"""Clients through which the frontend talks to the engine core.

Mirrors vLLM's ``vllm/v1/engine/core_client.py``. The frontend never touches the engine
core's internals: it adds requests, aborts them and asks for outputs through an
``EngineCoreClient``. ``InprocClient`` (``GLASSBOX_ENABLE_MULTIPROCESSING=0`` once the
process tree exists) holds the ``EngineCore`` in the caller's process and steps it on each
``get_output()``; ``SyncMPClient`` and ``AsyncMPClient`` (next versions) talk to an engine
core process over ZMQ with the same three verbs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from engine.config import EngineConfig
from engine.core.messages import EngineCoreOutputs, EngineCoreRequest


class EngineCoreClient(ABC):
    """The frontend's handle on an engine core."""

    # Resolved by the worker: {"device": "cpu", "dtype": "float32"}.
    device_info: dict[str, str]
    num_gpu_blocks: int

    @staticmethod
    def make_client(config: EngineConfig) -> EngineCoreClient:
        return InprocClient(config)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs (in-process: runs one engine step to make it)."""

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """The engine core in the caller's process; ``get_output`` runs one ``step()``."""

    def __init__(self, config: EngineConfig) -> None:
        from engine.core.engine_core import EngineCore

        self.engine_core = EngineCore(config)
        self.device_info = self.engine_core.model_executor.device_info
        self.num_gpu_blocks = self.engine_core.kv_cache_config.num_blocks
        self.last_step_executed = False

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        outputs, self.last_step_executed = self.engine_core.step()
        return outputs.get(0) or EngineCoreOutputs()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
