"""``glassbox trace FILE --steps``: the engine steps of a span file and where each request's
time to first token went.

A serving benchmark's TTFT percentiles say how long the first token took, not why. The
span file knows: every engine step is an ``engine_core.step`` span (how many tokens it
scheduled, how many requests were new to it, how many it continued), and every request's
``llm_request`` span carries its time to first token split the way vLLM's request metrics
split it — ``gen_ai.latency.time_in_queue`` (in the scheduler's waiting queue until a step
admitted it) and ``gen_ai.latency.time_in_model_prefill`` (from that step to its first
token: the steps that computed its prompt). What is left of the TTFT was spent before the
scheduler: the API server's work (tokenizing, the chat template), the hand-off, and the
engine core's input queue, where a request arriving during a step waits for that step to end.

It prints the steps that scheduled prompt tokens (``--all``: every step), when each ran,
for how long and with how many tokens, then the TTFT percentiles and the slowest requests'
TTFTs split into those three parts — the table ``docs/performance.md`` reads a serving
benchmark's TTFT tail from. Nothing here is vLLM's: it reads Glassbox's own spans.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from tracing import catalogue

STEP = "engine_core.step"
REQUEST = "llm_request"


@dataclass(frozen=True)
class StepRow:
    """One engine step: start (ns), duration (ms), tokens scheduled, requests new to it,
    requests it continued, and the engine core that ran it."""

    start_ns: int
    ms: float
    tokens: int
    new: int
    cached: int
    engine: str

    @property
    def prompt_tokens(self) -> bool:
        """Whether it scheduled prompt tokens (a new request, or more tokens than requests:
        a prefill chunk of a request it continued)."""
        return self.new > 0 or self.tokens > self.new + self.cached


@dataclass(frozen=True)
class RequestTTFT:
    """One request's time to first token (ms) and its parts (ms)."""

    request_id: str
    ttft_ms: float
    queue_ms: float
    prefill_ms: float

    @property
    def before_engine_ms(self) -> float:
        return max(0.0, self.ttft_ms - self.queue_ms - self.prefill_ms)


def _int(attrs: dict[str, Any], key: str) -> int:
    value = attrs.get(key)
    return value if isinstance(value, int) else 0


def step_rows(spans: list[Any]) -> list[StepRow]:
    """The file's ``engine_core.step`` spans as rows, by start time (``spans``: the trace
    module's ``Span`` objects)."""
    rows = [
        StepRow(
            s.start_ns,
            s.duration_ns / 1e6,
            _int(s.attributes, catalogue.ATTR_STEP_NUM_SCHEDULED_TOKENS),
            _int(s.attributes, catalogue.ATTR_STEP_NUM_NEW_REQS),
            _int(s.attributes, catalogue.ATTR_STEP_NUM_CACHED_REQS),
            s.role or "?",
        )  # fmt: skip
        for s in spans
        if s.name == STEP
    ]
    return sorted(rows, key=lambda r: r.start_ns)


def request_ttfts(spans: list[Any]) -> list[RequestTTFT]:
    """Each finished request's TTFT and its parts, from its ``llm_request`` span."""
    out = []
    for s in spans:
        if s.name != REQUEST:
            continue
        a = s.attributes
        ttft = a.get(catalogue.ATTR_GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN)
        if not isinstance(ttft, (int, float)):
            continue
        queue = a.get(catalogue.ATTR_GEN_AI_LATENCY_TIME_IN_QUEUE) or 0.0
        prefill = a.get(catalogue.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL) or 0.0
        out.append(RequestTTFT(str(a.get(catalogue.ATTR_GEN_AI_REQUEST_ID, "?")), 1e3 * ttft, 1e3 * queue,
                               1e3 * prefill))  # fmt: skip
    return out


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0–1) of ``values`` by linear interpolation (as numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def out(console, text: str) -> None:
    console.print(text, soft_wrap=True)  # one line each, whatever the terminal's width


def render_steps(spans: list[Any], console, *, show_all: bool = False, slowest: int = 5) -> None:
    """Print the steps (those with prompt tokens, or ``show_all``) and the TTFT breakdown."""
    steps = step_rows(spans)
    if not steps:
        out(console, "no engine_core.step spans in this file (the engine core's step traces)")
        return
    t0 = steps[0].start_ns
    shown = steps if show_all else [s for s in steps if s.prompt_tokens]
    with_prompt = sum(s.prompt_tokens for s in steps)
    span_s = (steps[-1].start_ns - t0) / 1e9 + steps[-1].ms / 1e3
    what = "every step" if show_all else "the steps that scheduled prompt tokens"
    out(console, f"{len(steps)} engine steps in {span_s:.1f} s, {with_prompt} with prompt tokens; {what}:")
    out(console, f"  {'at (s)':>9}  {'ms':>7}  {'tokens':>6}  {'new':>4}  {'running':>7}  engine")
    for s in shown:
        out(
            console,
            f"  {(s.start_ns - t0) / 1e9:9.3f}  {s.ms:7.1f}  {s.tokens:6d}  {s.new:4d}  {s.cached:7d}  {s.engine}",
        )
    decode = [s.ms for s in steps if not s.prompt_tokens and s.tokens]
    if decode:
        out(
            console,
            f"  (the other {len(decode)} steps decode only: median {statistics.median(decode):.1f} ms)",
        )
    ttfts = request_ttfts(spans)
    if not ttfts:
        return
    values = [r.ttft_ms for r in ttfts]
    out(console, f"\ntime to first token of {len(ttfts)} requests: median {statistics.median(values):.0f} ms, "
                  f"p90 {percentile(values, 0.9):.0f} ms, p99 {percentile(values, 0.99):.0f} ms, "
                  f"max {max(values):.0f} ms")  # fmt: skip
    out(console, "  the slowest, TTFT = before the scheduler (API server, hand-off, the engine core's input queue "
                 "while a step runs) + waiting (the scheduler's queue) + prefill (its prompt's steps):")  # fmt: skip
    for r in sorted(ttfts, key=lambda r: -r.ttft_ms)[:slowest]:
        out(console, f"  {r.request_id}  {r.ttft_ms:6.0f} ms = {r.before_engine_ms:5.0f} + "
                      f"{r.queue_ms:5.0f} + {r.prefill_ms:5.0f}")  # fmt: skip
