"""Metrics: the per-request stats math, vLLM's Prometheus metrics, the periodic stats line.

Fast tests feed the ``OutputProcessor`` synthetic outputs with engine events and known
timestamps, and check the latencies, the ``IterationStats``, the Prometheus text and the
log line. Multiprocess mode is checked with three small interpreters sharing one folder.
Two slow tests start a real ``glassbox serve`` (one and two API servers) and check that
``/metrics`` counts exactly what was sent.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from frontend_fixtures import BOS_ID, EOS_ID, build_tokenizer_dir
from prometheus_client.parser import text_string_to_metric_families

import tracing
from engine import envs
from engine.core.messages import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from engine.frontend.engine_stats import EngineStatsTable
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.tokenizer import get_tokenizer
from engine.metrics import prometheus as prom
from engine.metrics.loggers import LoggingStatLogger, StatLoggerManager
from engine.metrics.stats import IterationStats
from engine.sampling_params import SamplingParams
from tracing import catalogue

ROOT = Path(__file__).resolve().parents[3]
QUEUED, SCHEDULED, PREEMPTED = (
    EngineCoreEventType.QUEUED,
    EngineCoreEventType.SCHEDULED,
    EngineCoreEventType.PREEMPTED,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return get_tokenizer(str(build_tokenizer_dir(tmp_path_factory.mktemp("tok"))))


def _processor(tokenizer) -> tuple[OutputProcessor, list[tuple[int, IterationStats]]]:
    processor = OutputProcessor(tokenizer)
    processor._mono_to_wall = 0.0  # engine-core timestamps below are wall-clock already
    seen: list[tuple[int, IterationStats]] = []
    processor.stats_sink = lambda engine, stats: seen.append((engine, stats))
    return processor, seen


def _add(processor, request_id: str, arrival: float, prompt_len: int = 3, max_tokens: int = 8) -> None:
    request = EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=[BOS_ID] + [5] * (prompt_len - 1),
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.5, top_p=0.9),
        eos_token_id=EOS_ID,
        arrival_time=arrival,
    )
    processor.add_request(request, None)


def _out(request_id, tokens, *, events=None, finish=None) -> EngineCoreOutput:
    events = [EngineCoreEvent(t, ts) for t, ts in events] if events else None
    return EngineCoreOutput(request_id=request_id, new_token_ids=tokens, events=events, finish_reason=finish)


# ---------------------------------------------------------------------------- the stats math


def test_request_latencies_from_events_and_token_times(tokenizer):
    processor, seen = _processor(tokenizer)
    t0 = time.time() - 100.0
    _add(processor, "r", arrival=t0, prompt_len=4)
    # Chunked prefill: a step with events and no token, then the first token at t0+3.
    processor.process_outputs(
        [_out("r", [], events=[(QUEUED, t0 + 0.5), (SCHEDULED, t0 + 1.0)])], t0 + 2.0, 1
    )
    processor.process_outputs([_out("r", [7])], t0 + 3.0, 1)
    # Preempted and rescheduled: counted, but inference still starts at the first SCHEDULED.
    processor.process_outputs([_out("r", [8], events=[(PREEMPTED, t0 + 3.5), (SCHEDULED, t0 + 3.8)])],
                              t0 + 4.0, 1)  # fmt: skip
    processor.process_outputs([_out("r", [9], finish=FinishReason.LENGTH)], t0 + 6.0, 1)

    assert [engine for engine, _ in seen] == [1, 1, 1, 1]
    its = [s for _, s in seen]
    assert [s.num_prompt_tokens for s in its] == [0, 4, 0, 0]  # counted once, at the first token
    assert [s.num_generation_tokens for s in its] == [0, 1, 1, 1]
    assert its[1].time_to_first_tokens_iter == [pytest.approx(its[1].iteration_timestamp - t0)]
    assert [s.inter_token_latencies_iter for s in its] == [[], [], [pytest.approx(1.0)], [pytest.approx(2.0)]]
    assert its[2].num_preempted_reqs == 1
    (done,) = its[3].finished_requests
    assert done.finish_reason == "length" and done.num_prompt_tokens == 4 and done.num_generation_tokens == 3
    assert done.max_tokens_param == 8
    assert done.queued_time == pytest.approx(0.5)
    assert done.prefill_time == pytest.approx(2.0)  # scheduled t0+1 → first token t0+3
    assert done.decode_time == pytest.approx(3.0)  # first token t0+3 → last token t0+6
    assert done.inference_time == pytest.approx(5.0)
    assert done.mean_time_per_output_token == pytest.approx(1.5)
    assert done.e2e_latency == pytest.approx(its[3].iteration_timestamp - t0)


def test_the_batch_origin_labels_that_batch_only(tokenizer):
    processor, seen = _processor(tokenizer)
    now = time.time()
    _add(processor, "a", arrival=now)
    processor.process_outputs([_out("a", [7])], now, 3)
    processor.process_outputs([_out("a", [8], finish=FinishReason.STOP)])
    assert [engine for engine, _ in seen] == [3, 0]
    assert seen[1][1].finished_requests[0].finish_reason == "stop"


def test_an_aborted_waiting_request_has_zero_phases(tokenizer):
    processor, seen = _processor(tokenizer)
    _add(processor, "w", arrival=time.time())
    processor.process_outputs([_out("w", [], events=[(QUEUED, time.time())], finish=FinishReason.ABORT)])
    (done,) = seen[0][1].finished_requests
    assert (done.queued_time, done.prefill_time, done.decode_time, done.inference_time) == (0, 0, 0, 0)
    assert done.finish_reason == "abort" and seen[0][1].num_prompt_tokens == 0


def test_llm_request_span_carries_gen_ai_and_latency_attributes(tokenizer, tmp_path):
    handle = tracing.setup_tracing("TestRole", in_memory=True)
    try:
        processor, _ = _processor(tokenizer)
        processor.model_name = "served-m"
        t0 = time.time() - 10.0
        _add(processor, "s", arrival=t0, prompt_len=5, max_tokens=2)
        processor.process_outputs(
            [_out("s", [7], events=[(QUEUED, t0 + 0.25), (SCHEDULED, t0 + 1.0)])], t0 + 2.0
        )
        processor.process_outputs([_out("s", [8], finish=FinishReason.LENGTH)], t0 + 2.5)
        (span,) = [s for s in handle.get_finished_spans() if s.name == catalogue.LLM_REQUEST]
    finally:
        tracing.shutdown_tracing()
    a = span.attributes
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == "served-m"
    assert a["gen_ai.request.max_tokens"] == 2 and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.usage.input_tokens"] == a["gen_ai.usage.prompt_tokens"] == 5
    assert a["gen_ai.usage.output_tokens"] == a["gen_ai.usage.completion_tokens"] == 2
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["gen_ai.latency.time_in_queue"] == pytest.approx(0.75)
    assert a["gen_ai.latency.time_in_model_prefill"] == pytest.approx(1.0)
    assert a["gen_ai.latency.time_in_model_decode"] == pytest.approx(0.5)
    assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(1.5)
    assert a["gen_ai.latency.time_to_first_token"] > 9.0 and a["gen_ai.latency.e2e"] > 9.0
    for key in a:
        assert key in catalogue.ATTRIBUTES
    assert set(catalogue.span_def(catalogue.LLM_REQUEST).attributes) <= set(a)


# ---------------------------------------------------------------------------- Prometheus


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """``(sample name, sorted labels) → value`` from Prometheus text (also checks it parses)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples, name: str, **labels) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    want = {k: str(v) for k, v in labels.items()}
    return sum(v for (n, ls), v in samples.items() if n == name and want.items() <= dict(ls).items())


def _fake_iteration(ttft=0.2, itls=(0.05, 0.06), reason="stop") -> IterationStats:
    from engine.metrics.stats import FinishedRequestStats

    stats = IterationStats(time.time(), num_generation_tokens=3, num_prompt_tokens=7)
    stats.time_to_first_tokens_iter.append(ttft)
    stats.inter_token_latencies_iter.extend(itls)
    stats.finished_requests.append(FinishedRequestStats(reason, 0.4, 7, 3, 16, 0.01, 0.1, 0.3, 0.2, 0.1))
    return stats


def test_prometheus_text_has_vllms_names_labels_and_buckets():
    table = EngineStatsTable([0, 1])
    table.update(1, SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25,
                                   prefix_cache_queries=10, prefix_cache_hits=4, num_preemptions=3))  # fmt: skip
    manager = StatLoggerManager("m", table, 512)
    manager.record(1, _fake_iteration())
    manager.record(1, _fake_iteration(reason="length"))
    body, content_type = manager.render()
    assert content_type.startswith("text/plain")
    text = body.decode()
    s = _samples(text)
    assert _value(s, "vllm:prompt_tokens_total", engine=1, model_name="m") == 14
    assert _value(s, "vllm:prompt_tokens_total", engine=0) == 0  # every engine shows up
    assert _value(s, "vllm:generation_tokens_total", engine=1) == 6
    assert _value(s, "vllm:request_success_total", engine=1, finished_reason="stop") == 1
    assert _value(s, "vllm:request_success_total", engine=1, finished_reason="length") == 1
    assert _value(s, "vllm:request_success_total", engine=1, finished_reason="abort") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens"):  # fmt: skip
        assert _value(s, f"vllm:{name}_count", engine=1) == 2, name
    assert _value(s, "vllm:inter_token_latency_seconds_count", engine=1) == 4
    assert _value(s, "vllm:inter_token_latency_seconds_sum", engine=1) == pytest.approx(0.22)
    assert _value(s, "vllm:num_requests_running", engine=1) == 2
    assert _value(s, "vllm:num_requests_waiting", engine=1) == 1
    assert _value(s, "vllm:kv_cache_usage_perc", engine=1) == 0.25
    assert _value(s, "vllm:prefix_cache_queries_total", engine=1) == 10
    assert _value(s, "vllm:prefix_cache_hits_total", engine=1) == 4
    assert _value(s, "vllm:num_preemptions_total", engine=1) == 3
    # vLLM's bucket boundaries.
    les = sorted(float(dict(ls)["le"]) for (n, ls), _ in s.items()
                 if n == "vllm:time_to_first_token_seconds_bucket" and dict(ls)["engine"] == "1")  # fmt: skip
    assert les == [*prom.TTFT_BUCKETS, float("inf")]
    les = sorted(float(dict(ls)["le"]) for (n, ls), _ in s.items()
                 if n == "vllm:request_prompt_tokens_bucket" and dict(ls)["engine"] == "1")  # fmt: skip
    assert les == [1, 2, 5, 10, 20, 50, 100, 200, 500, float("inf")]
    assert prom.REQUEST_LATENCY_BUCKETS[0] == 0.3 and prom.REQUEST_LATENCY_BUCKETS[-1] == 7680.0
    assert prom.ITL_BUCKETS[0] == 0.01 and prom.ITL_BUCKETS[-1] == 80.0
    assert "_created" not in text


def test_exporter_health_is_in_the_scrape(tmp_path):
    tracing.setup_tracing("APIServer_0", trace_file=str(tmp_path / "t.jsonl"))
    try:
        with tracing.stage(catalogue.CLI_VALIDATE_CONFIG):
            pass
        manager = StatLoggerManager("m", EngineStatsTable([0]), 64)
        s = _samples(manager.render()[0].decode())
    finally:
        tracing.shutdown_tracing()
    names = {n for n, _ in s}
    assert {"glassbox:tracing_spans_exported_total", "glassbox:tracing_spans_dropped_total",
            "glassbox:tracing_last_error_timestamp_seconds"} <= names  # fmt: skip
    assert _value(s, "glassbox:tracing_spans_dropped_total", role="APIServer_0", exporter="jsonl") == 0


def test_exporter_counters_show_zero_when_no_exporter_is_set_up():
    tracing.setup_tracing("APIServer_0")  # no trace file, no OTLP endpoint: no exporter
    try:
        text = StatLoggerManager("m", EngineStatsTable([0]), 64).render()[0].decode()
    finally:
        tracing.shutdown_tracing()
    samples = {(n, dict(ls).get("exporter")): v for (n, ls), v in _samples(text).items()}
    for name in ("glassbox:tracing_spans_exported_total", "glassbox:tracing_spans_dropped_total"):
        assert samples.get((name, "none")) == 0, text  # a sample, not only a "# TYPE" line


_MP_CHILD = """
import json, sys, time
from engine.metrics.prometheus import setup_multiprocess_prometheus
setup_multiprocess_prometheus(sys.argv[1])  # before prometheus_client is imported
from engine.frontend.engine_stats import EngineStatsTable
from engine.metrics.loggers import StatLoggerManager
from engine.metrics.stats import IterationStats
m = StatLoggerManager("m", EngineStatsTable([0, 1]), 128, role=sys.argv[2], several_servers=True)
for engine in json.loads(sys.argv[3]):
    s = IterationStats(time.time(), num_prompt_tokens=5, num_generation_tokens=2)
    m.record(engine, s)
m.log()
if sys.argv[4] == "render":
    print(m.render()[0].decode())
"""


def test_multiprocess_mode_sums_every_api_server(tmp_path):
    env_dir = tmp_path / "run"
    env_dir.mkdir()

    def child(role, engines, render):
        env = {k: v for k, v in __import__("os").environ.items() if k != prom.PROMETHEUS_MULTIPROC_DIR}
        return subprocess.run([sys.executable, "-c", _MP_CHILD, str(env_dir), role, json.dumps(engines), render],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip

    child("APIServer_1", [0, 0, 1], "no")
    text = child("APIServer_0", [1], "render")
    s = _samples(text)
    assert _value(s, "vllm:prompt_tokens_total", engine=0) == 10
    assert _value(s, "vllm:prompt_tokens_total", engine=1) == 10
    assert _value(s, "vllm:generation_tokens_total") == 8
    assert (env_dir / prom.MULTIPROC_SUBDIR).is_dir()


# ---------------------------------------------------------------------------- the log line


def test_log_line_per_engine_info_when_busy_debug_when_idle():
    table = EngineStatsTable([0, 1])
    table.update(0, SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.5,
                                   prefix_cache_queries=100, prefix_cache_hits=25))  # fmt: skip
    stat_logger = LoggingStatLogger(table, role="APIServer_1")
    stat_logger.last_log_time = 0.0
    stat_logger.record(0, IterationStats(0.0, num_prompt_tokens=40, num_generation_tokens=20))
    (level0, line0), (level1, line1) = stat_logger.lines(now=10.0)
    assert level0 == logging.INFO and level1 == logging.DEBUG
    assert line0.startswith(
        "APIServer_1 Engine 000: Avg prompt throughput (this server's requests): 4.0 tokens/s"
    )
    assert "Avg generation throughput (this server's requests): 2.0 tokens/s" in line0
    assert "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 50.0%, Prefix cache hit rate: 25.0%" in line0
    # The next interval: nothing new → DEBUG; the hit rate is the interval's.
    table.update(0, SchedulerStats(prefix_cache_queries=200, prefix_cache_hits=125))
    ((level, line), _) = stat_logger.lines(now=20.0)
    assert level == logging.DEBUG and "0.0 tokens/s" in line and "Prefix cache hit rate: 100.0%" in line


def test_log_stats_interval_is_validated(monkeypatch):
    assert envs.GLASSBOX_LOG_STATS_INTERVAL == 10.0
    monkeypatch.setenv("GLASSBOX_LOG_STATS_INTERVAL", "0.5")
    assert envs.GLASSBOX_LOG_STATS_INTERVAL == 0.5
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv("GLASSBOX_LOG_STATS_INTERVAL", bad)
        with pytest.raises(ValueError, match="GLASSBOX_LOG_STATS_INTERVAL"):
            envs.validate_all()


# ---------------------------------------------------------------------------- real servers


def _model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def _complete(url: str, prompt: str, max_tokens: int, **extra) -> dict:
    body = {"model": _model(url), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    response = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _scrape(url: str) -> dict:
    return _samples(httpx.get(url + "/metrics", timeout=10).text)


def _check_totals(s, sent: list[dict]) -> None:
    n = len(sent)
    reasons: dict[str, int] = {}
    for r in sent:
        reason = r["choices"][0]["finish_reason"]
        reasons[reason] = reasons.get(reason, 0) + 1
    for reason, count in reasons.items():
        assert _value(s, "vllm:request_success_total", finished_reason=reason) == count
    assert _value(s, "vllm:request_success_total") == n
    assert _value(s, "vllm:prompt_tokens_total") == sum(r["usage"]["prompt_tokens"] for r in sent)
    assert _value(s, "vllm:generation_tokens_total") == sum(r["usage"]["completion_tokens"] for r in sent)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens"):  # fmt: skip
        assert _value(s, f"vllm:{name}_count") == n, name
    # One inter-token latency per token after the first (one token per step here).
    itl = sum(r["usage"]["completion_tokens"] - 1 for r in sent)
    assert _value(s, "vllm:inter_token_latency_seconds_count") == itl
    assert _value(s, "vllm:e2e_request_latency_seconds_sum") > 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_serve_metrics_equal_what_was_sent_and_the_stats_line_is_logged(default_model_dir):
    from server_utils import start_server

    base = Path(tempfile.mkdtemp(prefix="gbm", dir="/tmp"))
    server = start_server(base, "--max-model-len", "256", env={"GLASSBOX_LOG_STATS_INTERVAL": "0.5"})
    try:
        sent = [_complete(server.base_url, p, m) for p, m in
                [("The quick brown fox", 5), ("import os", 3), ("Once upon a time", 8), ("Hello", 1)]]  # fmt: skip
        s = _scrape(server.base_url)
        _check_totals(s, sent)
        assert {n for n, _ in s} >= {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                                     "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                                     "vllm:num_preemptions_total"}  # fmt: skip
        deadline = time.monotonic() + 10
        while "Engine 000: Avg prompt throughput" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        line = next(ln for ln in server.log().splitlines() if "Engine 000: Avg prompt throughput" in ln)
        assert "INFO" in line and "Running:" in line and "KV cache usage:" in line
    finally:
        server.kill_group()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_api_servers_give_the_same_totals_whichever_answers(default_model_dir):
    from server_utils import start_server

    base = Path(tempfile.mkdtemp(prefix="gbm", dir="/tmp"))
    server = start_server(base, "--max-model-len", "256", "--api-server-count", "2",
                          env={"GLASSBOX_LOG_STATS_INTERVAL": "0.5"})  # fmt: skip
    try:
        sent = []
        for i in range(8):  # new connections: the kernel spreads them over both servers
            sent.append(_complete(server.base_url, f"Request number {i} says", 2 + i % 3))
        assert (server.run_dir / prom.MULTIPROC_SUBDIR).is_dir()
        for _ in range(6):  # repeated scrapes land on either server
            _check_totals(_scrape(server.base_url), sent)
        # Each server logs its own share; an idle interval logs at DEBUG (not shown).
        deadline = time.monotonic() + 10
        while "Engine 000: Avg prompt throughput (this server's requests)" not in server.log():
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.2)
        assert any(f"APIServer_{i} Engine 000" in server.log() for i in (0, 1))
    finally:
        server.kill_group()
