"""``ObservabilityConfig``: tracing, request logging, telemetry recording and fault injection.

vLLM's counterpart is ``vllm/config/observability.py`` (``otlp_traces_endpoint``,
``collect_detailed_traces``); the trace file, telemetry record, step delay and fault spec
are Glassbox additions. The OTLP settings are checked here, in the first process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.config.utils import ConfigError


@dataclass
class ObservabilityConfig:
    """Tracing and request logging.

    ``trace_file``: every finished span as one JSON line (Glassbox addition).
    ``enable_log_requests``: the API server logs one line per request (id, prompt, params),
    with prompts cut to ``max_log_len`` characters / token ids (None: whole). vLLM keeps
    these two among its frontend arguments; here they travel in the config so the API
    server's ``AsyncLLM`` sees them.
    ``telemetry_record``: write every process's live telemetry to this file (engine-top
    ``--replay`` plays it). ``step_delay_ms``: sleep this long after each engine step, so a
    class can watch the scheduler in slow motion (both Glassbox additions).
    ``inject_fault``: the fault spec (``--inject-fault``, else ``GLASSBOX_FAULT``) the first
    process puts in ``GLASSBOX_FAULT`` for every child (``tracing.faults``, ``docs/faults.md``).
    """

    otlp_traces_endpoint: str | None = None
    trace_file: str | None = None
    enable_log_requests: bool = False
    max_log_len: int | None = None
    telemetry_record: str | None = None
    step_delay_ms: float = 0.0
    collect_detailed_traces: str | None = None
    inject_fault: str | None = None

    DETAILED_TRACE_LEVELS = ("model", "worker", "all")

    @property
    def collect_model_forward_time(self) -> bool:
        """``model`` (or worker/all): the workers' forward and sampling spans (vLLM's property)."""
        return self.collect_detailed_traces is not None

    @property
    def collect_worker_traces(self) -> bool:
        """``worker`` or ``all``: each worker's ``worker.execute_model`` span per step."""
        return bool(self.collect_detailed_traces) and bool(
            {"worker", "all"} & set(self.collect_detailed_traces.split(","))
        )

    def __post_init__(self) -> None:
        if (
            not isinstance(self.step_delay_ms, (int, float))
            or isinstance(self.step_delay_ms, bool)
            or not 0 <= self.step_delay_ms <= 60_000
        ):
            raise ConfigError(
                "--step-delay-ms", self.step_delay_ms, "must be a number of milliseconds in 0..60000"
            )
        if self.inject_fault is not None:
            from tracing.faults import parse_faults

            try:
                faults = parse_faults(self.inject_fault)
            except ValueError as e:
                raise ConfigError("--inject-fault", self.inject_fault, str(e)) from None
            self.inject_fault = ",".join(str(f) for f in faults) or None
        if self.collect_detailed_traces is not None:
            levels = [x.strip() for x in str(self.collect_detailed_traces).split(",")]
            if not levels or any(x not in self.DETAILED_TRACE_LEVELS for x in levels):
                raise ConfigError("--collect-detailed-traces", self.collect_detailed_traces,
                                  f"must be one or more of {', '.join(self.DETAILED_TRACE_LEVELS)}, comma-separated")  # fmt: skip
            self.collect_detailed_traces = ",".join(levels)
        if self.telemetry_record is not None:
            parent = os.path.dirname(os.path.abspath(self.telemetry_record))
            if os.path.isdir(self.telemetry_record) or not os.access(parent, os.W_OK):
                raise ConfigError("--telemetry-record", self.telemetry_record,
                                  "must be a file path in a writable directory")  # fmt: skip
        if self.max_log_len is not None and (
            not isinstance(self.max_log_len, int)
            or isinstance(self.max_log_len, bool)
            or self.max_log_len < 0
        ):
            raise ConfigError("--max-log-len", self.max_log_len, "must be an integer >= 0")
        self._check_otlp()

    def _check_otlp(self) -> None:
        """OTLP settings (the flag, ``OTEL_EXPORTER_OTLP_*``, ``OTEL_TRACES_SAMPLER``) are
        checked here, in the first process, so a bad one is one line and exit 2 instead of a
        warning in every process (``tracing.setup.resolve_otlp``; docs/otlp.md)."""
        if self.otlp_traces_endpoint is not None and not isinstance(self.otlp_traces_endpoint, str):
            raise ConfigError("--otlp-traces-endpoint", self.otlp_traces_endpoint, "must be a URL")
        from tracing.setup import OtlpSettingError, check_traces_sampler, resolve_otlp

        try:
            target = resolve_otlp(self.otlp_traces_endpoint)
            if target is not None or self.trace_file:
                check_traces_sampler()
        except OtlpSettingError as e:
            raise ConfigError(e.setting, e.value, e.allowed) from None
