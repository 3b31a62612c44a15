"""OTLP out of the box: protocol and endpoint as the OpenTelemetry
spec says, a real receiver (tests/otlp_receiver.py) gets whole start-up traces over HTTP and
gRPC, an unreachable collector is one warning per process while serving goes on, and exporter
health (exported, dropped, queued, last error) reaches TracingHandle.health(), the heartbeat,
LiveState and engine-top's header.
"""

from __future__ import annotations

import io
import logging
import time

import pytest
from otlp_receiver import GrpcOtlpReceiver, HttpOtlpReceiver, closed_port
from rich.console import Console

import tracing
from tracing import catalogue
from tracing.setup import OtlpSettingError, check_traces_sampler, resolve_otlp
from tracing.telemetry.events import ExporterStatus, Heartbeat
from tracing.telemetry.publisher import _exporter_statuses
from tracing.telemetry.state import LiveState
from tui import views

OTEL_VARS = (
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_TRACES_SAMPLER",
    "OTEL_BSP_MAX_QUEUE_SIZE",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
)


@pytest.fixture(autouse=True)
def _clean_otel_env(monkeypatch):
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    tracing.shutdown_tracing()


@pytest.fixture
def process_log():
    """What the process's log handlers get (the root's and the ``tracing`` logger's), as text
    (``LEVEL name: message`` lines), WARNING and up."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    loggers = [logging.getLogger(), logging.getLogger("tracing")]
    for lg in loggers:
        lg.addHandler(handler)
    yield stream
    for lg in loggers:
        lg.removeHandler(handler)


def _stages(n: int = 1) -> None:
    for _ in range(n):
        with tracing.stage(catalogue.EXECUTOR_INIT), tracing.stage(catalogue.WORKER_LOAD_MODEL):
            pass


def _otlp_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "OTLP traces" in r.getMessage()
    ]


# ------------------------------------------------------------------------------ protocol rules


@pytest.mark.parametrize(
    ("flag", "env", "endpoint", "protocol", "why"),
    [
        ("http://c:4318/v1/traces", {}, "http://c:4318/v1/traces", "http/protobuf", "inferred from the /v1/traces"),
        ("http://c:4318", {}, "http://c:4318", "http/protobuf", "inferred from port 4318"),
        ("http://c:4317", {}, "http://c:4317", "grpc", "inferred from port 4317"),
        ("http://c:9999", {}, "http://c:9999", "grpc", "default"),
        ("c:4317", {}, "c:4317", "grpc", "inferred from port 4317"),
        ("http://c:4318/v1/traces", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "http://c:4318/v1/traces", "grpc",
         "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ("http://c:1", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
         "http://c:1", "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
        (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4318/v1/traces", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"},
         "http://t:4318/v1/traces", "http/protobuf", "inferred"),
        # The generic variable is a base URL: /v1/traces is appended for HTTP, not for gRPC.
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:4318"}, "http://b:4318/v1/traces", "http/protobuf", "port"),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:4317/"}, "http://b:4317/", "grpc", "port 4317"),
        ("http://f:4317", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4318/v1/traces"}, "http://f:4317", "grpc",
         "port 4317"),
    ],
)  # fmt: skip
def test_endpoint_and_protocol_follow_the_spec(flag, env, endpoint, protocol, why):
    target = resolve_otlp(flag, env)
    assert (target.endpoint, target.protocol) == (endpoint, protocol)
    assert why in target.protocol_from or why in target.explain()


def test_no_endpoint_anywhere_is_no_otlp():
    assert resolve_otlp(None, {"OTEL_EXPORTER_OTLP_PROTOCOL": "bogus"}) is None  # nothing to check
    assert resolve_otlp("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}) is None  # empty is unset


@pytest.mark.parametrize(
    ("flag", "env", "setting"),
    [
        ("http://c:4318/v1/traces", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
        ("http://c:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "udp"}, "OTEL_EXPORTER_OTLP_PROTOCOL"),
        ("not a url", {}, "--otlp-traces-endpoint"),
        ("http://:4318/v1/traces", {}, "--otlp-traces-endpoint"),
        ("http://c:99999/v1/traces", {}, "--otlp-traces-endpoint"),
        ("ftp://c:4318", {}, "--otlp-traces-endpoint"),
        ("c:4318/v1/traces", {}, "--otlp-traces-endpoint"),
        (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "localhost"}, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        ("c:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "--otlp-traces-endpoint"),
    ],
)  # fmt: skip
def test_bad_settings_name_the_flag_or_variable(flag, env, setting):
    with pytest.raises(OtlpSettingError) as err:
        resolve_otlp(flag, env)
    assert err.value.setting == setting
    assert str(err.value).startswith(f"{setting}: invalid value")


def test_bad_protocol_is_a_config_error_naming_it(monkeypatch):
    from engine.config import ConfigError, ObservabilityConfig

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ConfigError) as err:
        ObservabilityConfig(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")
    assert err.value.flag == "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
    assert "'http/json'" in str(err.value) and "\n" not in str(err.value)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    with pytest.raises(ConfigError, match="^--otlp-traces-endpoint: invalid value 'http//x'"):
        ObservabilityConfig(otlp_traces_endpoint="http//x")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "sometimes")
    with pytest.raises(ConfigError, match="^OTEL_TRACES_SAMPLER: invalid value 'sometimes'"):
        ObservabilityConfig(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")
    monkeypatch.delenv("OTEL_TRACES_SAMPLER")
    assert ObservabilityConfig(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")  # fine


def test_cli_bad_protocol_exits_2_with_one_line(monkeypatch, capsys, default_model_dir):
    from engine.cli.main import main

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift")
    argv = ["serve", str(default_model_dir), "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"]
    with pytest.raises(SystemExit) as exit_:
        rc = main(argv)
        raise SystemExit(rc)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("OTEL_EXPORTER_OTLP_PROTOCOL: invalid value 'thrift'" in line for line in err), err


def test_sampler_from_the_environment_is_honoured(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    handle = tracing.setup_tracing("Sampled", in_memory=True)
    _stages()
    assert handle.get_finished_spans() == ()
    check_traces_sampler({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio"})
    with pytest.raises(OtlpSettingError):
        check_traces_sampler({"OTEL_TRACES_SAMPLER": "never"})


# ------------------------------------------------------------------------------ in process


@pytest.mark.parametrize("receiver_cls", [HttpOtlpReceiver, GrpcOtlpReceiver])
def test_spans_reach_the_receiver_and_are_counted(receiver_cls, caplog):
    caplog.set_level(logging.INFO, logger="tracing")
    with receiver_cls() as rx:
        handle = tracing.setup_tracing("Sender", rank=2, otlp_endpoint=rx.endpoint)
        assert handle.otlp.protocol == rx.protocol
        _stages(3)
        spans = rx.wait_for(lambda s: len(s) == 6, timeout=10)
        by_id = {s.span_id: s for s in spans}
        for s in spans:
            if s.name == catalogue.WORKER_LOAD_MODEL:
                assert by_id[s.parent_span_id].name == catalogue.EXECUTOR_INIT
                assert s.trace_id == by_id[s.parent_span_id].trace_id
        assert spans[0].resource["glassbox.role"] == "Sender" and spans[0].resource["glassbox.rank"] == 2
        deadline = time.monotonic() + 5
        while handle.health()[0].exported < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        (health,) = handle.health()
        assert (health.name, health.exported, health.dropped, health.queued) == ("otlp", 6, 0, 0)
        assert (health.endpoint, health.protocol, health.last_error) == (rx.endpoint, rx.protocol, None)
    infos = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.INFO and "OTLP traces to" in r.getMessage()
    ]
    assert len(infos) == 1 and rx.protocol in infos[0]


def test_collector_down_is_one_warning_and_counted_drops(caplog, process_log):
    caplog.set_level(logging.DEBUG)
    log = process_log
    endpoint = f"http://127.0.0.1:{closed_port()}/v1/traces"
    handle = tracing.setup_tracing("Lonely", otlp_endpoint=endpoint, in_memory=True)
    _stages(2)
    deadline = time.monotonic() + 10
    while handle.health()[1].last_error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    _stages(2)
    assert len(handle.get_finished_spans()) == 8  # the other exporters go on
    started = time.monotonic()
    tracing.shutdown_tracing()
    assert time.monotonic() - started < 3  # a failing collector gets no flush
    otlp = handle.health()[1]
    assert otlp.exported == 0 and otlp.dropped == 8 and otlp.failed_exports >= 1
    assert otlp.last_error == "Connection refused" and otlp.last_error_at is not None
    warnings = _otlp_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert endpoint in warnings[0] and "Connection refused" in warnings[0]
    # The SDK's own retry lines went to debug level: nothing of them in the process's log
    # (caplog sees every non-propagating logger, so the log's handlers are read instead).
    text = log.getvalue()
    assert "Transient error" not in text and "Shutdown in progress" not in text and "Traceback" not in text
    assert text.count("WARNING") == 1, text
    assert "otlp: 0 exported, 8 dropped" in handle.health_summary()


def test_a_full_batch_queue_counts_its_drops(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2")
    with HttpOtlpReceiver() as rx:
        rx.fail_with = 503  # retried for seconds: the queue fills meanwhile
        handle = tracing.setup_tracing("Busy", otlp_endpoint=rx.endpoint)
        _stages(10)  # 20 spans into a queue of 4
        health = handle.health()[0]
        assert health.dropped_queue_full >= 10 and health.dropped >= health.dropped_queue_full
        assert health.queued <= 4
        tracing.shutdown_tracing()
        final = handle.health()[0]
    assert final.exported + final.dropped == 20  # every span accounted for


def test_health_goes_out_in_the_heartbeat_and_into_the_header():
    with HttpOtlpReceiver() as rx:
        tracing.setup_tracing("Beat", otlp_endpoint=rx.endpoint, in_memory=True)
        _stages()
        statuses = _exporter_statuses()
    assert [s.name for s in statuses] == ["in_memory", "otlp"]
    assert statuses[0].exported == 2 and statuses[1].endpoint == rx.endpoint
    tracing.shutdown_tracing()
    assert _exporter_statuses() == []

    now = time.time()
    state = LiveState(now=now)
    ok = [ExporterStatus(name="otlp", exported=1234, dropped=0)]
    failing = [ExporterStatus(name="otlp", exported=0, dropped=12, failed_exports=3,
                              last_error="Connection refused", last_error_at=now - 3)]  # fmt: skip
    for role, exporters in (("EngineCore_DP0", ok), ("Worker_DP0_PP0_TP0", failing)):
        state.apply(Heartbeat(role=role, pid=1, seq=0, t=now, cpu_percent=0.0, rss_bytes=0, num_threads=1,
                              exporters=exporters))  # fmt: skip
    assert state.processes["Worker_DP0_PP0_TP0"].exporters == failing
    assert state.processes["Worker_DP0_PP0_TP0"].copy().exporters == failing
    console = Console(width=200, record=True, color_system=None)
    console.print(views.render_header(state, views.ViewOptions()))
    text = console.export_text()
    assert "traces otlp 1234 sent, 12 dropped, last error 3.0s ago: Connection refused" in text
    # A heartbeat from an older publisher (no exporters field) still decodes.
    old = Heartbeat(role="x", pid=1, seq=0, t=now, cpu_percent=0.0, rss_bytes=0, num_threads=1)
    assert old.exporters == []


# ------------------------------------------------------------------------------ the process tree


def _llm(monkeypatch, model, endpoint):
    from engine import LLM

    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    return LLM(str(model), max_model_len=128, otlp_traces_endpoint=endpoint)


def _start_up_checks(rx, llm_role: str) -> None:
    names = {catalogue.LLM_INIT, catalogue.ENGINE_CORE_INIT, catalogue.WORKER_LOAD_MODEL}
    spans = rx.wait_for(lambda s: names <= {x.name for x in s}, timeout=30)
    startup = [s for s in spans if s.trace_id == rx.trace_of(catalogue.LLM_INIT)[0].trace_id]
    roles = {s.role for s in startup}
    assert llm_role in roles and any(r.startswith("EngineCore") for r in roles)
    assert any(r.startswith("Worker") for r in roles), roles
    by_id = {s.span_id: s for s in startup}
    (root,) = [s for s in startup if s.name == catalogue.LLM_INIT]
    assert root.parent_span_id is None
    (core_init,) = [s for s in startup if s.name == catalogue.ENGINE_CORE_INIT]
    assert by_id[core_init.parent_span_id].role == llm_role  # across the process boundary
    (load,) = [s for s in startup if s.name == catalogue.WORKER_LOAD_MODEL]
    parent = by_id[load.parent_span_id]  # the receiver got the worker's parent too
    assert parent.role.startswith("EngineCore") and load.role.startswith("Worker")
    assert load.pid != parent.pid != root.pid
    # Every span of the start-up trace has its parent in the trace (it arrived whole).
    assert all(s.parent_span_id is None or s.parent_span_id in by_id for s in startup)


@pytest.mark.slow
def test_start_up_trace_arrives_whole_over_http(monkeypatch, tiny_dir, reap_children):
    from engine import SamplingParams

    model = tiny_dir("llama", tie_word_embeddings=True)
    with HttpOtlpReceiver() as rx:
        llm = _llm(monkeypatch, model, rx.endpoint)
        try:
            out = llm.generate("a b c", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 2
            _start_up_checks(rx, llm.tracing.role)
        finally:
            llm.shutdown()


@pytest.mark.slow
def test_start_up_trace_over_grpc(monkeypatch, tiny_dir, reap_children):
    model = tiny_dir("llama", tie_word_embeddings=True)
    with GrpcOtlpReceiver() as rx:
        llm = _llm(monkeypatch, model, rx.endpoint)
        try:
            assert llm.tracing.otlp.protocol == "grpc"
            _start_up_checks(rx, llm.tracing.role)
        finally:
            llm.shutdown()


@pytest.mark.slow
def test_collector_down_serving_goes_on_one_warning_per_process(
    monkeypatch, tiny_dir, reap_children, capfd, caplog
):
    from engine import SamplingParams

    caplog.set_level(logging.INFO, logger="tracing")
    model = tiny_dir("llama", tie_word_embeddings=True)
    endpoint = f"http://127.0.0.1:{closed_port()}/v1/traces"
    llm = _llm(monkeypatch, model, endpoint)
    try:
        out = llm.generate(["a b", "c"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]
        deadline = time.monotonic() + 10
        while llm.tracing.health()[0].last_error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        (health,) = llm.tracing.health()
        assert health.exported == 0 and health.last_error == "Connection refused"
        time.sleep(1.5)  # the children's first exports fail too
    finally:
        started = time.monotonic()
        llm.shutdown()
        tracing.shutdown_tracing()
    assert time.monotonic() - started < 15
    assert llm.tracing.health()[0].dropped >= 1  # llm.init at least, counted
    # One WARNING per process: this one (caplog) and each child (their stderr).
    assert len(_otlp_warnings(caplog)) == 1
    err = capfd.readouterr().err
    child_warnings = [line for line in err.splitlines() if "OTLP traces to" in line and "failed" in line]
    assert len(child_warnings) == 2, child_warnings  # the engine core and the worker
    assert all(endpoint in line for line in child_warnings)
    assert "Traceback" not in err and "Transient error" not in err
