"""What the scheduler hands to the executor each step.

Mirrors vLLM's ``vllm/v1/core/sched/output.py``. These structs cross the engine-core →
worker boundary (the shared-memory broadcast in the multiprocess executor), so they are
msgspec structs and carry only plain data.

The worker keeps its own mirror of every request (``CachedRequestState`` in the model
runner): a new request arrives once, whole, in ``scheduled_new_reqs``; afterwards only the
deltas travel in ``scheduled_cached_reqs``.
"""

from __future__ import annotations

import msgspec

from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, kw_only=True):
    """A request the worker has not seen before (first scheduled this step).

    ``block_ids`` is one list per KV-cache group (we have one group: full attention).
    ``num_computed_tokens`` is the prefix-cache hit, in tokens: those positions already sit
    in the KV cache and are not recomputed. A pooling request carries ``pooling_params``
    and no ``sampling_params``.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None
    eos_token_id: int | None
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None

    @classmethod
    def from_request(cls, request, block_ids: tuple[list[int], ...]) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            pooling_params=request.pooling_params,
        )


class CachedRequestData(msgspec.Struct, kw_only=True):
    """Deltas for requests the worker already knows, one entry per request (parallel lists).

    - ``resumed_from_preemption[i]``: the request was preempted (its blocks freed, its
      computed tokens reset to 0) and is scheduled again; ``new_block_ids[i]`` then
      **replaces** its block table. Otherwise ``new_block_ids[i]`` is appended (None when
      no block was added).
    - ``resumed_req_token_ids[i]``: for a resumed request, all its tokens (prompt and
      output so far), so the worker can rebuild its state; None otherwise.
    - ``num_computed_tokens[i]``: tokens already in the KV cache before this step.
    - ``new_token_ids[i]``: the tokens scheduled this step (for a decode, the one sampled
      last step). Filled only with pipeline parallelism, where the stages before the last
      sample nothing and learn the outputs from here; empty otherwise.
    """

    req_ids: list[str] = msgspec.field(default_factory=list)
    resumed_from_preemption: list[bool] = msgspec.field(default_factory=list)
    resumed_req_token_ids: list[list[int] | None] = msgspec.field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = msgspec.field(default_factory=list)
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)
    new_token_ids: list[list[int]] = msgspec.field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @classmethod
    def make_empty(cls) -> CachedRequestData:
        return cls()


class SchedulerOutput(msgspec.Struct, kw_only=True):
    """One step's plan: which requests run and how many tokens each computes.

    ``num_scheduled_tokens[req_id]`` tokens of each request are computed this step (a
    prefill chunk or one decode token); their sum is ``total_num_scheduled_tokens`` and
    never exceeds ``max_num_batched_tokens``. ``finished_req_ids`` lists requests that
    finished or were aborted since the last step, so the worker can drop their state.
    ``grammar_bitmask`` masks the logits of ``structured_output_request_ids`` before sampling.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = msgspec.field(default_factory=set)
    num_common_prefix_blocks: int = 0
    # Structured outputs: the requests that sample under a grammar this step, and their
    # allowed tokens, row i for structured_output_request_ids[i]: the bytes of an int32 array
    # (len(ids), ceil(vocab_size / 32)), bit j of word w allowing token 32 * w + j (numpy's
    # ``tobytes``; vLLM ships the numpy array itself). None when no request has a grammar.
    structured_output_request_ids: list[str] = msgspec.field(default_factory=list)
    grammar_bitmask: bytes | None = None
