"""The scheduler's view of one request.

Mirrors vLLM's ``vllm/v1/request.py`` (``Request``, ``RequestStatus``). Pure Python: the
scheduler and KV cache manager are tested without torch.

A request's life: WAITING → RUNNING → (PREEMPTED → RUNNING)* → FINISHED_*. Its
``num_computed_tokens`` catches up with ``num_tokens`` step by step; there is no separate
prefill or decode phase. A request with structured outputs starts as WAITING_FOR_FSM, and
becomes WAITING once its grammar is compiled (``structured_output_request``). A pooling request
(``pooling_params``, no sampling params) is all prefill: it finishes (FINISHED_STOPPED) when its
pooled vector arrives, with no output token.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

# A wire enum: it lives with the client ↔ engine-core messages; re-exported here.
from engine.core.messages import EngineCoreEvent, EngineCoreEventType, FinishReason
from engine.core.structured_output.request import StructuredOutputRequest
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.kv_cache.kv_cache_utils import BlockHash


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # its structured-output grammar is compiling
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    # vLLM 0.33's name: the grammar failed to compile in the engine or cannot be followed.
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """One sequence being generated.

    Args:
        request_id: unique id (a child of an ``n`` > 1 request has its own id).
        prompt_token_ids: the prompt, as token ids.
        sampling_params: validated ``SamplingParams``; ``max_tokens`` must be set. None for
            a pooling request.
        eos_token_id: the model's primary EOS id, or None.
        arrival_time: wall-clock seconds (``time.time()``) when the request arrived.
        priority: lower values are scheduled first under the priority policy.
        block_hasher: given the request, returns the hashes of its full blocks that are
            not hashed yet (``kv_cache_utils.get_request_block_hasher``); None disables
            prefix caching for this request.
        pooling_params: a pooling request's verified ``PoolingParams`` (then
            ``sampling_params`` is None): ``max_tokens`` is 1, as vLLM's, though none is made.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        client_index: int = 0,
        block_hasher: Callable[[Request], list[BlockHash]] | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.eos_token_id = eos_token_id
        # The constraint and its grammar (None without structured outputs).
        self.structured_output_request = StructuredOutputRequest.from_sampling_params(sampling_params)
        self.status = RequestStatus.WAITING_FOR_FSM if self.use_structured_output else RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        if pooling_params is not None:
            assert sampling_params is None, "a request pools or samples, not both"
            self.max_tokens = 1
        else:
            assert sampling_params is not None and sampling_params.max_tokens is not None, (
                "max_tokens is set by the input processor"
            )
            self.max_tokens = sampling_params.max_tokens

        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Prefix-cache hit in tokens, set when the request is first scheduled (-1 before).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Engine events not yet sent with an output (queued, scheduled, preempted).
        self.events: list[EngineCoreEvent] = []

        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        """Note an engine event (sent to the frontend with the request's next output)."""
        self.events.append(EngineCoreEvent(event_type, time.time() if timestamp is None else timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """The events since the last call (None when there are none)."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """True when no prefix-cache hit may be used: prompt logprobs need every prompt
        position computed (vLLM's property; its pooling tasks that need every position are
        left out here, and MEAN/CLS pooling run with prefix caching off)."""
        return self.sampling_params is not None and self.sampling_params.prompt_logprobs is not None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        """Record newly sampled tokens and hash any block they complete."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __lt__(self, other: Request) -> bool:
        # Tie-breaker for the priority heap: (priority, arrival_time) compare first.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
