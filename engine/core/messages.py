"""Messages between the frontend (``LLM`` / ``AsyncLLM``) and the engine core.

Mirrors vLLM's ``vllm/v1/engine/__init__.py``. In-process (``InprocClient``) these are
passed as Python objects; the multiprocess clients encode them with msgspec (msgpack) as
positional arrays (``array_like``), as vLLM does: the **field order is the wire format**, so
new fields go at the end, with defaults.
Fields later work needs (``client_index``, ``data_parallel_rank``, ``current_wave``,
``priority``, ``trace_headers``) are already here.
"""

from __future__ import annotations

import enum
import time

import msgspec

from engine.outputs import LogprobsLists
from engine.sampling_params import SamplingParams
from engine.sched.request import FinishReason


class EngineCoreRequestType(enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    START_DP_WAVE = b"\x02"
    UTILITY = b"\x03"
    # Internal: put on the engine core's own input queue when a worker died.
    EXECUTOR_FAILED = b"\x04"


class EngineCoreRequest(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True, gc=False):
    """A tokenized, validated request on its way to the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    data_parallel_rank: int | None = None
    client_index: int = 0
    current_wave: int = 0
    priority: int = 0
    trace_headers: dict[str, str] | None = None


class EngineCoreOutput(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True, gc=False):
    """New tokens (and maybe a finish) for one request, from one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, kw_only=True, array_like=True, gc=False):
    """Scheduler state after a step (vLLM ``vllm/v1/metrics/stats.py``).

    ``kv_cache_usage`` is the fraction of usable blocks in use (0..1). Prefix-cache
    figures are cumulative token counts since start.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    step_counter: int = 0
    num_scheduled_tokens: int = 0


class EngineCoreOutputs(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine step produced for one client."""

    engine_index: int = 0
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = msgspec.field(default_factory=time.monotonic)
    finished_requests: set[str] | None = None


class EngineHandshake(msgspec.Struct, kw_only=True, array_like=True):
    """Start-up messages from an engine core to its frontend.

    HELLO is sent as soon as the engine core's sockets are connected (nothing heavy has
    happened yet); READY once its workers are up and the KV cache is sized, carrying what
    only the worker could resolve (device, dtype) and the number of KV blocks.
    """

    kind: str  # "HELLO" | "READY"
    role: str
    pid: int
    data_parallel_rank: int = 0
    num_gpu_blocks: int = 0
    device: str = ""
    dtype: str = ""
    max_model_len: int = 0


# Frame tags on the engine → frontend socket (the first frame of each multipart message).
TAG_HANDSHAKE = b"H"
TAG_OUTPUTS = b"O"
TAG_UTILITY = b"U"
# A lone frame the engine core sends when it dies (vLLM: ``EngineCoreProc.ENGINE_CORE_DEAD``),
# followed by a frame with the root-cause block.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
