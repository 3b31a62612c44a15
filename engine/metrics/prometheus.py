"""vLLM's Prometheus metrics, with vLLM's names, labels and buckets (vLLM:
``vllm/v1/metrics/loggers.py`` ``PrometheusStatLogger``, ``vllm/v1/metrics/prometheus.py``).

Three sources, one scrape:

- **request metrics** (counters and histograms: tokens, finished requests, TTFT, inter-token
  latency, e2e / queue / prefill / decode / inference time, prompt and generation lengths):
  recorded by ``PrometheusStatLogger.record`` from each ``IterationStats`` the output
  processor makes, labelled with the engine (DP rank) that served the request. Each API
  server sees only its own requests, so with several API servers these live in
  prometheus_client's **multiprocess mode**: every process writes its values to mmap'ed files
  in ``PROMETHEUS_MULTIPROC_DIR`` (inside the run directory) and a scrape, whichever server
  answers, sums the files of all of them (``MultiProcessCollector``).
- **engine gauges and counters** (running, waiting, KV usage, prefix-cache queries and hits,
  preemptions): rendered at scrape time from the ``EngineStatsTable`` (the latest
  ``SchedulerStats`` each engine sent). Every engine sends its stats to every API server, so
  any server has them all: a custom collector, never summed across processes.
- **exporter health** (``glassbox:tracing_*``): each API server's own span exporters
  (``tracing.get_handle().health()``), labelled ``role`` and ``exporter``. With several API
  servers each one also writes its figures to a small JSON file next to the multiprocess
  files (at each scrape it answers and each stats-log interval), and a scrape shows every
  server's row: the answering server's live, the others' at most one interval old.

``setup_multiprocess_prometheus`` must run before anything imports prometheus_client's value
classes (``prometheus_client.values`` picks the mmap'ed kind once, at import), which is why
this module imports prometheus_client only inside functions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from engine.core.messages import GRAMMAR_COMPILE_BUCKETS
from engine.metrics.stats import IterationStats

PROMETHEUS_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
# Our folder in the run directory (removed with it at shutdown).
MULTIPROC_SUBDIR = "prometheus"

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort")

# vLLM 0.32's buckets (seconds).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


# ---------------------------------------------------------------------------- multiprocess


def setup_multiprocess_prometheus(run_dir: Path) -> Path:
    """Turn on prometheus_client's multiprocess mode for this process and its children.

    Sets ``PROMETHEUS_MULTIPROC_DIR`` in ``os.environ`` (children spawned afterwards inherit
    it) to ``<run_dir>/prometheus``, created empty. A value the user set is kept (vLLM does
    the same) — that folder must be emptied between runs, or old figures add up.

    Call it before prometheus_client's metrics are imported anywhere in this process.
    """
    user_dir = os.environ.get(PROMETHEUS_MULTIPROC_DIR)
    if user_dir:
        path = Path(user_dir)
    else:
        path = Path(run_dir) / MULTIPROC_SUBDIR
        os.environ[PROMETHEUS_MULTIPROC_DIR] = str(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def multiprocess_dir() -> Path | None:
    """The multiprocess folder when this process is in multiprocess mode, else None."""
    value = os.environ.get(PROMETHEUS_MULTIPROC_DIR)
    return Path(value) if value else None


def mark_process_dead(pid: int | None = None) -> None:
    """Drop this process's live-gauge files at exit (prometheus_client's ``mark_process_dead``)."""
    path = multiprocess_dir()
    if path is None:
        return
    from prometheus_client import multiprocess

    try:
        multiprocess.mark_process_dead(os.getpid() if pid is None else pid, str(path))
    except OSError:  # the run directory is already gone
        pass


# ---------------------------------------------------------------------------- request metrics


class PrometheusStatLogger:
    """The request-level ``vllm:*`` counters and histograms, one series per engine.

    Args:
        model_name: the served model name (label ``model_name``).
        engine_indices: the DP ranks (label ``engine``); children are bound up front, so
            every engine shows zeros before its first request, and ``record`` does no label
            lookup.
        max_model_len: the top of the token-count buckets.

    The metrics live in a private ``CollectorRegistry`` (so several apps in one process do
    not collide); ``registry`` is what a single-process scrape renders. In multiprocess mode
    the values are also in the mmap'ed files, which the scrape reads instead.
    """

    def __init__(self, model_name: str, engine_indices: Iterable[int], max_model_len: int) -> None:
        import prometheus_client
        from prometheus_client import CollectorRegistry, Counter, Histogram

        # No ``*_created`` series (vLLM's dashboards do not read them; they double the text).
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry()
        reg = self.registry
        token_buckets = build_1_2_5_buckets(max(max_model_len, 1))

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Any:
            return Counter(name, doc, labelnames=(*LABELS, *extra), registry=reg)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Any:
            return Histogram(name, doc, labelnames=LABELS, buckets=list(buckets), registry=reg)

        prompt = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        generation = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)  # fmt: skip
        itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)  # fmt: skip
        e2e = histogram("vllm:e2e_request_latency_seconds",
                        "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)  # fmt: skip
        queue = histogram("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)  # fmt: skip
        prefill = histogram("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)  # fmt: skip
        decode = histogram("vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)  # fmt: skip
        inference = histogram("vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)  # fmt: skip
        req_prompt = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        req_gen = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                            token_buckets)  # fmt: skip

        self._by_engine: dict[int, _EngineSeries] = {}
        for index in engine_indices:
            labels = (model_name, str(index))
            self._by_engine[index] = _EngineSeries(
                prompt=prompt.labels(*labels),
                generation=generation.labels(*labels),
                success={r: success.labels(*labels, r) for r in FINISH_REASONS},
                ttft=ttft.labels(*labels),
                itl=itl.labels(*labels),
                e2e=e2e.labels(*labels),
                queue=queue.labels(*labels),
                prefill=prefill.labels(*labels),
                decode=decode.labels(*labels),
                inference=inference.labels(*labels),
                req_prompt=req_prompt.labels(*labels),
                req_gen=req_gen.labels(*labels),
            )
        self._success = success
        self._labels_of = lambda index: (model_name, str(index))
        self._factory = (
            prompt,
            generation,
            ttft,
            itl,
            e2e,
            queue,
            prefill,
            decode,
            inference,
            req_prompt,
            req_gen,
        )

    def _series(self, engine_index: int) -> _EngineSeries:
        series = self._by_engine.get(engine_index)
        if series is None:  # an engine we were not told of (elastic DP one day): bind it now
            labels = self._labels_of(engine_index)
            p, g, t, i, e, q, pf, d, inf, rp, rg = (m.labels(*labels) for m in self._factory)
            series = self._by_engine[engine_index] = _EngineSeries(
                prompt=p, generation=g, success={r: self._success.labels(*labels, r) for r in FINISH_REASONS},
                ttft=t, itl=i, e2e=e, queue=q, prefill=pf, decode=d, inference=inf, req_prompt=rp, req_gen=rg,
            )  # fmt: skip
        return series

    def record(self, engine_index: int, stats: IterationStats) -> None:
        """Add one batch's figures to engine ``engine_index``'s series."""
        s = self._series(engine_index)
        if stats.num_prompt_tokens:
            s.prompt.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            s.generation.inc(stats.num_generation_tokens)
        for latency in stats.time_to_first_tokens_iter:
            s.ttft.observe(latency)
        for latency in stats.inter_token_latencies_iter:
            s.itl.observe(latency)
        for done in stats.finished_requests:
            success = s.success.get(done.finish_reason)
            if success is None:
                labels = self._labels_of(engine_index)
                success = s.success[done.finish_reason] = self._success.labels(*labels, done.finish_reason)
            success.inc()
            s.e2e.observe(done.e2e_latency)
            s.queue.observe(done.queued_time)
            s.prefill.observe(done.prefill_time)
            s.decode.observe(done.decode_time)
            s.inference.observe(done.inference_time)
            s.req_prompt.observe(done.num_prompt_tokens)
            s.req_gen.observe(done.num_generation_tokens)


class _EngineSeries:
    """The metric children of one engine, bound once."""

    __slots__ = ("prompt", "generation", "success", "ttft", "itl", "e2e", "queue", "prefill", "decode",
                 "inference", "req_prompt", "req_gen")  # fmt: skip

    def __init__(self, **children: Any) -> None:
        for name, child in children.items():
            setattr(self, name, child)


# ---------------------------------------------------------------------------- engine stats


class EngineStatsCollector:
    """vLLM's scheduler gauges and counters, one series per engine, from an ``EngineStatsTable``.

    Labels as vLLM's: ``model_name`` (the served name) and ``engine`` (the DP rank).
    ``vllm:kv_cache_usage_perc`` is a fraction (0..1), as in vLLM despite its name. The
    prefix-cache and preemption counters are the engine's own cumulative counts.
    """

    def __init__(self, model_name: str, stats_table: Any) -> None:
        self.model_name = model_name
        self.stats_table = stats_table

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        G, C = GaugeMetricFamily, CounterMetricFamily
        specs = (
            (G, "vllm:num_requests_running", "Number of requests in model execution batches.",
             lambda s: s.num_running_reqs),
            (G, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             lambda s: s.num_waiting_reqs),
            (G, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             lambda s: s.kv_cache_usage),
            (C, "vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.", lambda s: s.prefix_cache_queries),
            (C, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             lambda s: s.prefix_cache_hits),
            (C, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             lambda s: s.num_preemptions),
        )  # fmt: skip
        rows = self.stats_table.snapshot().items()
        for kind, name, doc, value_of in specs:
            family = kind(name, doc, labels=list(LABELS))
            for engine_index, stats in rows:
                family.add_metric([self.model_name, str(engine_index)], value_of(stats))
            yield family
        yield from self._structured_output_families(rows)

    def _structured_output_families(self, rows):
        """Glassbox's structured-output metrics (vLLM has none): the requests waiting for their
        grammar, and the grammar compile times (a histogram kept by the engine core since start)."""
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        waiting = GaugeMetricFamily("glassbox:num_requests_waiting_for_grammar",
                                    "Requests waiting for their structured-output grammar to compile "
                                    "(WAITING_FOR_FSM).", labels=list(LABELS))  # fmt: skip
        compile_time = HistogramMetricFamily("glassbox:structured_output_compile_seconds",
                                             "Histogram of structured-output grammar compile time in seconds.",
                                             labels=list(LABELS))  # fmt: skip
        for engine_index, stats in rows:
            labels = [self.model_name, str(engine_index)]
            waiting.add_metric(labels, stats.num_waiting_for_fsm)
            counts = stats.grammar_compile_counts or [0] * (len(GRAMMAR_COMPILE_BUCKETS) + 1)
            cumulative, buckets = 0, []
            for bound, count in zip((*GRAMMAR_COMPILE_BUCKETS, float("inf")), counts):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
            compile_time.add_metric(labels, buckets, stats.grammar_compile_seconds_sum)
        yield waiting
        yield compile_time


# ---------------------------------------------------------------------------- exporter health

HEALTH_FILE_PREFIX = "tracing_health_"


class TracingHealthCollector:
    """Span-exporter health: ``glassbox:tracing_spans_exported_total``,
    ``glassbox:tracing_spans_dropped_total``, ``glassbox:tracing_spans_queued`` and
    ``glassbox:tracing_last_error_timestamp_seconds``, labels ``role`` and ``exporter``.

    ``health``: returns this process's ``ExporterHealth`` list. ``share_dir``: with several
    API servers, the multiprocess folder where each writes its rows (``publish``) and from
    which the answering server reads the others'.
    """

    def __init__(self, role: str, health: Callable[[], list[Any]], share_dir: Path | None = None) -> None:
        self.role = role
        self.health = health
        self.share_dir = share_dir

    def rows(self) -> list[dict[str, Any]]:
        """This process's exporters as plain rows; with none (tracing off), one row of zeros
        for ``exporter="none"``, so the counters show a sample (0) rather than a bare
        ``# TYPE`` line."""
        health = self.health()
        if not health:
            return [{"role": self.role, "exporter": "none", "exported": 0, "dropped": 0, "queued": None,
                     "last_error_at": None}]  # fmt: skip
        rows = []
        for h in health:
            rows.append({
                "role": self.role,
                "exporter": h.name,
                "exported": h.exported,
                "dropped": h.dropped,
                "queued": getattr(h, "queued", None),
                "last_error_at": h.last_error_at,
            })  # fmt: skip
        return rows

    def publish(self) -> None:
        """Write this process's rows for the other API servers' scrapes (several servers only)."""
        if self.share_dir is None:
            return
        path = self.share_dir / f"{HEALTH_FILE_PREFIX}{self.role}.json"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self.rows()))
            os.replace(tmp, path)
        except OSError:  # the run directory is being removed
            pass

    def all_rows(self) -> list[dict[str, Any]]:
        rows = self.rows()
        if self.share_dir is not None:
            self.publish()
            for path in sorted(self.share_dir.glob(f"{HEALTH_FILE_PREFIX}*.json")):
                if path.name == f"{HEALTH_FILE_PREFIX}{self.role}.json":
                    continue
                try:
                    rows += json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
        return rows

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["role", "exporter"]
        exported = CounterMetricFamily(
            "glassbox:tracing_spans_exported", "Spans an exporter sent.", labels=labels
        )
        dropped = CounterMetricFamily(
            "glassbox:tracing_spans_dropped", "Spans an exporter failed to send (lost).", labels=labels
        )
        queued = GaugeMetricFamily(
            "glassbox:tracing_spans_queued", "Spans waiting in the exporter's batch queue.", labels=labels
        )
        last_error = GaugeMetricFamily(
            "glassbox:tracing_last_error_timestamp_seconds",
            "Unix time of the exporter's last export error (0: none).",
            labels=labels,
        )
        for row in self.all_rows():
            values = [row["role"], row["exporter"]]
            exported.add_metric(values, row["exported"])
            dropped.add_metric(values, row["dropped"])
            if row.get("queued") is not None:
                queued.add_metric(values, row["queued"])
            last_error.add_metric(values, row.get("last_error_at") or 0.0)
        yield from (exported, dropped, queued, last_error)


def tracing_health() -> list[Any]:
    """This process's exporter health (none when tracing is not set up)."""
    from tracing import get_handle

    handle = get_handle()
    return handle.health() if handle is not None else []


# ---------------------------------------------------------------------------- scrape


def render(stat_logger: PrometheusStatLogger, custom: Iterable[Any]) -> tuple[bytes, str]:
    """The Prometheus text of one scrape, and its content type.

    Single process: ``stat_logger``'s registry. Multiprocess mode: the request metrics of
    every API server, summed from the mmap'ed files. Either way plus ``custom`` collectors.
    """
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    path = multiprocess_dir()
    if path is None:
        registry = stat_logger.registry
        extra = CollectorRegistry()
        for collector in custom:
            extra.register(collector)
        return generate_latest(registry) + generate_latest(extra), CONTENT_TYPE_LATEST
    from prometheus_client import multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(path))
    for collector in custom:
        registry.register(collector)
    return generate_latest(registry), CONTENT_TYPE_LATEST
