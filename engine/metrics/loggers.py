"""The stat loggers: the periodic stats log line and the Prometheus metrics, fed together
(vLLM: ``vllm/v1/metrics/loggers.py`` ``LoggingStatLogger``, ``StatLoggerManager``).

``StatLoggerManager`` is what the output processor calls (``record``) after each batch of
engine outputs, with the engine (DP rank) that sent it; it feeds the ``PrometheusStatLogger``
and the ``LoggingStatLogger``. ``log()``, every ``GLASSBOX_LOG_STATS_INTERVAL`` seconds
(``run_log_loop``), writes one line per engine, like vLLM's::

    Engine 000: Avg prompt throughput: 52.1 tokens/s, Avg generation throughput: 148.0 tokens/s,
    Running: 3 reqs, Waiting: 0 reqs, KV cache usage: 4.2%, Prefix cache hit rate: 35.0%

- throughputs: tokens this process's requests got from that engine over the interval;
- running, waiting, KV cache usage: the engine's latest ``SchedulerStats``;
- prefix cache hit rate: hits / queries over the interval (the engine's cumulative counters'
  growth; vLLM uses a window of the last 1000 requests), the lifetime rate if no query came;
- at INFO while there is traffic, at DEBUG when both throughputs are 0 (quiet when idle).

Several API servers: vLLM drops the logging logger then (``client_count > 1``). Glassbox
keeps one per server: each line starts with the server's role and says the throughput is
``this server's`` share (the engine-wide figures are the same in every server's line). One
more line gives the span exporters' health (``Tracing: jsonl: 12 exported, 0 dropped``), at
WARNING when spans were dropped during the interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

from engine.logger import init_logger
from engine.metrics.prometheus import (
    EngineStatsCollector,
    PrometheusStatLogger,
    TracingHealthCollector,
    multiprocess_dir,
    render,
    tracing_health,
)
from engine.metrics.stats import IterationStats

logger = init_logger(__name__)


class LoggingStatLogger:
    """Token throughput per engine between two ``log()`` calls, plus the engine's state.

    Args:
        stats_table: the ``EngineStatsTable`` (latest ``SchedulerStats`` per engine), or None
            (offline ``LLM`` without one: only throughputs).
        role: prefixed to each line when not None (several API servers).
    """

    def __init__(self, stats_table: Any, role: str | None = None) -> None:
        self.stats_table = stats_table
        self.role = role
        self.prompt_tokens: dict[int, int] = {}
        self.generation_tokens: dict[int, int] = {}
        self.last_log_time = time.monotonic()
        self.last_prefix: dict[int, tuple[int, int]] = {}
        self.last_dropped: dict[str, int] = {}

    def record(self, engine_index: int, stats: IterationStats) -> None:
        if stats.num_prompt_tokens:
            self.prompt_tokens[engine_index] = (
                self.prompt_tokens.get(engine_index, 0) + stats.num_prompt_tokens
            )
        if stats.num_generation_tokens:
            self.generation_tokens[engine_index] = (
                self.generation_tokens.get(engine_index, 0) + stats.num_generation_tokens
            )

    def lines(self, now: float | None = None) -> list[tuple[int, str]]:
        """``(level, text)`` per engine for the interval that ends now; starts a new interval."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self.last_log_time, 1e-9)
        self.last_log_time = now
        snapshot = self.stats_table.snapshot() if self.stats_table is not None else {}
        engines = sorted(set(snapshot) | set(self.prompt_tokens) | set(self.generation_tokens))
        prefix = f"{self.role} " if self.role else ""
        share = " (this server's requests)" if self.role else ""
        out = []
        for index in engines:
            prompt_tps = self.prompt_tokens.pop(index, 0) / elapsed
            gen_tps = self.generation_tokens.pop(index, 0) / elapsed
            text = (
                f"{prefix}Engine {index:03d}: Avg prompt throughput{share}: {prompt_tps:.1f} tokens/s, "
                f"Avg generation throughput{share}: {gen_tps:.1f} tokens/s"
            )
            stats = snapshot.get(index)
            if stats is not None:
                queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
                last_q, last_h = self.last_prefix.get(index, (0, 0))
                self.last_prefix[index] = (queries, hits)
                dq, dh = queries - last_q, hits - last_h
                rate = dh / dq if dq > 0 else (hits / queries if queries else 0.0)
                text += (
                    f", Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
                    f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, Prefix cache hit rate: {rate * 100:.1f}%"
                )
            level = logging.INFO if prompt_tps or gen_tps else logging.DEBUG
            out.append((level, text))
        return out

    def tracing_line(self, health: Iterable[Any], level: int) -> tuple[int, str] | None:
        """One line of exporter health; WARNING when an exporter dropped spans since the last."""
        parts = []
        for h in health:
            dropped_now = h.dropped - self.last_dropped.get(h.name, 0)
            self.last_dropped[h.name] = h.dropped
            if dropped_now > 0:
                level = logging.WARNING
            part = f"{h.name}: {h.exported} exported, {h.dropped} dropped"
            queued = getattr(h, "queued", None)
            if queued is not None:
                part += f", {queued} queued"
            if h.last_error:
                part += f" (last error: {h.last_error})"
            parts.append(part)
        if not parts:
            return None
        prefix = f"{self.role} " if self.role else ""
        return level, f"{prefix}Tracing exporters: " + "; ".join(parts)

    def log(self) -> None:
        lines = self.lines()
        for level, text in lines:
            logger.log(level, "%s", text)
        busiest = min((level for level, _ in lines), default=logging.DEBUG)
        tracing = self.tracing_line(tracing_health(), busiest)
        if tracing is not None:
            logger.log(tracing[0], "%s", tracing[1])


class StatLoggerManager:
    """Feeds the Prometheus metrics and the log line from the output processor, and renders
    ``/metrics`` (vLLM's ``StatLoggerManager``).

    Args:
        model_name: the served model name (``model_name`` label).
        stats_table: the client's ``EngineStatsTable``.
        max_model_len: top of the token-count histogram buckets.
        role: this process's role (``APIServer_0``...), for exporter health; with
            ``several_servers`` it is also shown in each log line.
        log_stats: keep the periodic log line (``False``: Prometheus only).
    """

    def __init__(
        self,
        model_name: str,
        stats_table: Any,
        max_model_len: int,
        *,
        role: str = "APIServer_0",
        several_servers: bool = False,
        log_stats: bool = True,
    ) -> None:
        engines = list(stats_table.snapshot()) if stats_table is not None else [0]
        self.prometheus = PrometheusStatLogger(model_name, engines, max_model_len)
        self.logging = (
            LoggingStatLogger(stats_table, role if several_servers else None) if log_stats else None
        )
        share_dir = multiprocess_dir()
        self.health = TracingHealthCollector(role, tracing_health, share_dir if several_servers else None)
        self.collectors = [self.health]
        if stats_table is not None:
            self.collectors.insert(0, EngineStatsCollector(model_name, stats_table))

    def record(self, engine_index: int, stats: IterationStats) -> None:
        """One batch's figures (the output processor's ``stats_sink``)."""
        self.prometheus.record(engine_index, stats)
        if self.logging is not None:
            self.logging.record(engine_index, stats)

    def log(self) -> None:
        """The periodic log line(s); also shares this server's exporter health."""
        if self.logging is not None:
            self.logging.log()
        self.health.publish()

    def render(self) -> tuple[bytes, str]:
        """``/metrics``: the Prometheus text and its content type."""
        return render(self.prometheus, self.collectors)


async def run_log_loop(manager: StatLoggerManager, interval_s: float) -> None:
    """Call ``manager.log()`` every ``interval_s`` seconds until cancelled (vLLM: the API
    server's ``lifespan`` task calling ``do_log_stats``). A failure is logged, never raised."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            manager.log()
        except Exception:  # a stats line must never stop the server
            logger.exception("stats logging failed")


def attach(engine: Any, manager: StatLoggerManager, model_name: str) -> None:
    """Connect ``manager`` to an ``AsyncLLM``'s output processor (the output handler passes
    each batch's engine index and timestamp to ``process_outputs``)."""
    processor = getattr(engine, "output_processor", None)
    if processor is None:
        return
    processor.stats_sink = manager.record
    processor.model_name = model_name
