"""Per-request and per-batch stats, computed in the frontend (vLLM: ``vllm/v1/metrics/stats.py``).

All times are wall-clock seconds (``time.time()``), one clock for the whole machine: the
engine core stamps its events (QUEUED, SCHEDULED, PREEMPTED) with ``time.time()``, and the
frontend stamps the batch that carried a request's tokens. vLLM uses the engine core's
monotonic step timestamp for token times; Glassbox uses the engine-core timestamp too when
the caller passes it (converted to wall-clock), else the moment the frontend processes the
batch (which adds the engine → frontend hop to each figure, a few hundred microseconds).

The phases of one request, as vLLM defines them::

    arrival ── queued ─────── scheduled ──────── first token ─────── last token ── finished
             (engine event)  (first SCHEDULED)   (first batch with     (latest batch
                                                   a token)              with a token)
    queue time      = scheduled - queued
    prefill time    = first token - scheduled
    decode time     = last token - first token
    inference time  = last token - scheduled
    time to first token (TTFT) = first token seen by the frontend - arrival
    e2e latency     = finished (frontend) - arrival
    inter-token latency = time between two consecutive batches that carried tokens

A preemption (the request's KV blocks freed, recomputed later) is counted, but the first
SCHEDULED stays the start of inference: the recomputation is part of inference, as in vLLM.

A pooling request's vector stands for its first token, as in vLLM (its prefill is done): its
prompt tokens are counted and a time to first token observed then; it has no generation
tokens and no decode time.

Kept cheap: a few float assignments per output; lists only for the batch being processed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.core.messages import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput


@dataclass(slots=True)
class RequestStateStats:
    """One request's timestamps so far (vLLM's ``RequestStateStats``); 0.0 = not yet.

    The output processor keeps one per request; it feeds the stat loggers and the
    ``llm_request`` span, and is ``RequestOutput.metrics`` when the processor has
    ``log_stats``. Wall-clock seconds throughout (see above; vLLM's token and event stamps
    are the engine core's monotonic clock). ``first_token_latency`` is seconds from arrival
    to the first token reaching the frontend; ``finished_time`` (not in vLLM) is when the
    frontend saw the request finish, None before.
    """

    arrival_time: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    finished_time: float | None = None


@dataclass(slots=True)
class FinishedRequestStats:
    """One finished request's figures (vLLM's ``FinishedRequestStats``); seconds and tokens.

    A phase the request never reached (aborted while waiting: no SCHEDULED, no token) is 0.0.
    """

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None
    queued_time: float
    prefill_time: float
    inference_time: float
    decode_time: float
    mean_time_per_output_token: float


def finished_request_stats(
    stats: RequestStateStats,
    finish_reason: str,
    num_prompt_tokens: int,
    max_tokens_param: int | None,
    now: float,
) -> FinishedRequestStats:
    """The figures of a request that finished at ``now`` (wall-clock seconds)."""
    scheduled, first, last = stats.scheduled_ts, stats.first_token_ts, stats.last_token_ts
    queued = stats.queued_ts or stats.arrival_time
    decode_time = last - first if first and last else 0.0
    n = stats.num_generation_tokens
    return FinishedRequestStats(
        finish_reason=finish_reason,
        e2e_latency=now - stats.arrival_time,
        num_prompt_tokens=num_prompt_tokens,
        num_generation_tokens=n,
        max_tokens_param=max_tokens_param,
        queued_time=_non_negative(scheduled - queued) if scheduled else 0.0,
        prefill_time=_non_negative(first - scheduled) if scheduled and first else 0.0,
        inference_time=_non_negative(last - scheduled) if scheduled and last else 0.0,
        decode_time=_non_negative(decode_time),
        mean_time_per_output_token=_non_negative(decode_time) / (n - 1) if n > 1 else 0.0,
    )


def _non_negative(seconds: float) -> float:
    # Two processes' clocks are one system clock, but an NTP step between two stamps could
    # make a difference negative; a histogram must never see that.
    return seconds if seconds > 0.0 else 0.0


@dataclass(slots=True)
class IterationStats:
    """What one batch of engine outputs added (vLLM's ``IterationStats``).

    ``iteration_timestamp``: when the frontend processed the batch (wall-clock seconds).
    """

    iteration_timestamp: float
    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0
    num_preempted_reqs: int = 0
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)

    def update_from_output(
        self, output: EngineCoreOutput, prompt_len: int, stats: RequestStateStats, token_ts: float
    ) -> None:
        """Take one request's output of this batch (vLLM's ``IterationStats.update_from_output``):
        its engine-core events, then its new tokens, if any, made at ``token_ts`` (wall-clock s)."""
        if output.events:
            self.update_from_events(output.events, stats)
        if output.new_token_ids:
            self.update_from_tokens(len(output.new_token_ids), prompt_len, stats, token_ts)
        elif output.pooling_output is not None:
            self.update_from_pooling(prompt_len, stats, token_ts)

    def update_from_pooling(self, prompt_len: int, stats: RequestStateStats, token_ts: float) -> None:
        """A pooling request's vector arrived in this batch (made at ``token_ts``, wall-clock s):
        its prefill is done, so its prompt tokens count and its time to first token is now."""
        self.num_prompt_tokens += prompt_len
        latency = self.iteration_timestamp - stats.arrival_time
        stats.first_token_latency = latency
        self.time_to_first_tokens_iter.append(latency)
        stats.first_token_ts = stats.last_token_ts = token_ts

    def update_from_events(self, events: Iterable[EngineCoreEvent], stats: RequestStateStats) -> None:
        """Take a request's engine-core events: queued, first scheduled, preemptions."""
        for event in events:
            if event.type == EngineCoreEventType.QUEUED:
                stats.queued_ts = event.timestamp
            elif event.type == EngineCoreEventType.SCHEDULED:
                if not stats.scheduled_ts:  # a reschedule after preemption is still inference
                    stats.scheduled_ts = event.timestamp
            elif event.type == EngineCoreEventType.PREEMPTED:
                stats.num_preemptions += 1
                self.num_preempted_reqs += 1

    def update_from_tokens(
        self, num_new_tokens: int, prompt_len: int, stats: RequestStateStats, token_ts: float
    ) -> None:
        """``num_new_tokens`` (> 0) tokens of one request arrived in this batch.

        The first batch with a token also counts the prompt's tokens (vLLM counts prompt
        tokens when the prefill is done) and gives the time to first token; each later one
        gives an inter-token latency.
        """
        self.num_generation_tokens += num_new_tokens
        if stats.num_generation_tokens == 0:
            self.num_prompt_tokens += prompt_len
            latency = self.iteration_timestamp - stats.arrival_time
            stats.first_token_latency = latency
            self.time_to_first_tokens_iter.append(latency)
            stats.first_token_ts = token_ts
        else:
            self.inter_token_latencies_iter.append(_non_negative(token_ts - stats.last_token_ts))
        stats.last_token_ts = token_ts
        stats.num_generation_tokens += num_new_tokens
