"""Request and engine metrics: the stats structs, Prometheus metrics and the periodic stats log line.

Mirrors vLLM's ``vllm/v1/metrics/``:

- ``stats.py``: ``RequestStateStats`` (one request's timestamps, kept by the
  ``OutputProcessor``), ``FinishedRequestStats`` (its latencies once it ends) and
  ``IterationStats`` (what one batch of engine outputs added: tokens, time to first token,
  inter-token latencies, finished requests). Pure Python, no Prometheus.
- ``prometheus.py``: vLLM's ``vllm:*`` metrics (names, labels, buckets) and the exporter-health
  ``glassbox:tracing_*`` metrics; single- or multi-process (several API servers).
- ``loggers.py``: the periodic stats log line (vLLM's ``LoggingStatLogger``) and
  ``StatLoggerManager``, which feeds both from the output processor.

Imports no torch: it runs in the API server process. ``docs/metrics.md`` lists every metric.
"""
