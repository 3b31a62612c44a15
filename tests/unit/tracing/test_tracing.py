"""Tests of tracing/: stage spans and parent links, status file, exporters, waits, import rule."""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
from opentelemetry.trace import SpanKind, StatusCode

import tracing
from tracing import catalogue
from tracing.exporters import CountingExporter, JsonLinesSpanExporter
from tracing.run_dir import ProcessStatus, read_status
from tracing.stage import open_stages

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def traced(tmp_path):
    """In-memory tracing with a status file; torn down after the test."""
    handle = tracing.setup_tracing(
        "TestRole", rank=3, in_memory=True, status_file=str(tmp_path / "TestRole.status.json")
    )
    yield handle
    tracing.shutdown_tracing()


def _by_name(spans):
    return {s.name: s for s in spans}


def test_nested_stages_are_linked_and_carry_attributes(traced):
    # One `with` holding two stages still nests them: the second opens inside the first.
    with (
        tracing.stage(catalogue.ENGINE_CORE_INIT, rank=0),
        tracing.stage(catalogue.WORKER_LOAD_MODEL, **{catalogue.ATTR_RANK: 1}) as st,
    ):
        st.set(catalogue.ATTR_MODEL_NAME, "tiny")
        st.set("kv_num_blocks", 42)  # keyword alias
    spans = _by_name(traced.get_finished_spans())
    outer, inner = spans["engine_core.init"], spans["worker.load_model"]
    assert inner.parent is not None and inner.parent.span_id == outer.context.span_id
    assert inner.context.trace_id == outer.context.trace_id
    assert outer.parent is None
    assert dict(inner.attributes) == {
        "glassbox.rank": 1,
        "glassbox.model.name": "tiny",
        "glassbox.kv.num_blocks": 42,
        "thread.name": "MainThread",  # the lane of glassbox trace's waterfall
    }
    assert outer.attributes["glassbox.rank"] == 0
    res = inner.resource.attributes
    assert (res["service.name"], res["glassbox.role"], res["glassbox.rank"], res["glassbox.pid"]) == (
        "glassbox",
        "TestRole",
        3,
        os.getpid(),
    )
    assert inner.end_time >= inner.start_time


def test_exception_marks_span_error_and_reraises(traced):
    with pytest.raises(ValueError, match="bad weights"), tracing.stage(catalogue.WORKER_LOAD_MODEL):
        raise ValueError("bad weights")
    (span,) = traced.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert "ValueError: bad weights" in span.status.description
    assert [e.name for e in span.events] == ["exception"]
    assert tracing.current_stage() is None  # the stack was unwound


def test_unknown_names_raise():
    with pytest.raises(KeyError, match="not in the catalogue"):
        tracing.stage("worker.load_modle")
    with pytest.raises(KeyError, match="not in the catalogue"):
        tracing.stage(catalogue.WORKER_LOAD_MODEL, rnak=0)


def test_status_file_names_the_current_lifecycle_stage(traced):
    path = traced.status_file
    before = read_status(path)
    assert before.stage is None and before.role == "TestRole" and before.pid == os.getpid()
    with tracing.stage(catalogue.EXECUTOR_INIT):
        with tracing.stage(catalogue.WORKER_LOAD_MODEL, rank=0):
            inside = read_status(path)
            assert tracing.current_stage() == "worker.load_model"
        between = read_status(path)
    after = read_status(path)
    assert inside.stage == "worker.load_model"
    assert inside.stage_stack == ["executor.init", "worker.load_model"]
    assert inside.rank == 3 and inside.entered_at <= inside.updated_at
    assert between.stage == "executor.init"
    assert between.last_finished.name == "worker.load_model"
    assert after.stage is None and after.stage_stack == []
    assert after.last_finished.name == "executor.init" and after.last_finished.error is None
    assert not list(Path(path).parent.glob("*.tmp"))  # atomic writes leave no temp files


def test_status_file_is_the_contracts_typed_record(traced, caplog):
    """Written and read through ``tracing.run_dir``'s one writer and reader."""
    with tracing.stage(catalogue.WORKER_LOAD_MODEL):
        status = read_status(traced.status_file)
    assert isinstance(status, ProcessStatus)
    assert (status.role, status.rank, status.stage_stack) == ("TestRole", 3, ["worker.load_model"])
    after = read_status(traced.status_file)
    assert after == ProcessStatus(
        role="TestRole", rank=3, pid=os.getpid(), stage=None, stage_stack=[], entered_at=None,
        updated_at=after.updated_at, last_finished=after.last_finished, faults=[], placement={}, runs_as={},
    )  # fmt: skip
    assert read_status(Path(traced.status_file).parent / "none.status.json") is None
    # A field of the wrong type is a caller's bug: logged, the file left as it was, no raise.
    before = Path(traced.status_file).read_bytes()
    traced.write_status({"stage_stack": "not a list"})
    assert Path(traced.status_file).read_bytes() == before
    assert "status file" in caplog.text


def test_status_file_records_a_failed_stage(traced):
    with pytest.raises(RuntimeError), tracing.stage(catalogue.WORKER_INIT_DEVICE):
        raise RuntimeError("no device")
    last = read_status(traced.status_file).last_finished
    assert last.name == "worker.init_device" and last.error == "RuntimeError: no device"


def test_step_stages_do_not_touch_the_status_file(traced):
    before = Path(traced.status_file).read_bytes()
    mtime = os.stat(traced.status_file).st_mtime_ns
    time.sleep(0.01)
    with (
        tracing.stage(catalogue.ENGINE_CORE_STEP, step_id=7),
        tracing.stage(catalogue.SCHEDULER_SCHEDULE, step_num_scheduled_tokens=16),
    ):
        assert tracing.current_stage() == "scheduler.schedule"
    assert Path(traced.status_file).read_bytes() == before
    assert os.stat(traced.status_file).st_mtime_ns == mtime
    spans = _by_name(traced.get_finished_spans())
    assert spans["scheduler.schedule"].parent.span_id == spans["engine_core.step"].context.span_id


def test_open_stages_sees_other_threads(traced):
    entered, release = threading.Event(), threading.Event()

    def work():
        with tracing.stage(catalogue.WORKER_LOAD_MODEL):
            entered.set()
            release.wait(5)

    t = threading.Thread(target=work, name="loader")
    t.start()
    try:
        assert entered.wait(5)
        assert [(s.name, s.thread) for s in open_stages()] == [("worker.load_model", "loader")]
        assert tracing.current_stage() is None  # this thread is in no stage
        assert read_status(traced.status_file).stage == "worker.load_model"
    finally:
        release.set()
        t.join(5)
    assert open_stages() == []


def test_hooks_see_enter_and_exit_and_can_fail_a_stage(traced):
    events = []

    def record(event, name, attrs):
        events.append((event, name, dict(attrs)))

    def crash_on_load(event, name, attrs):
        if event == "enter" and name == catalogue.WORKER_LOAD_MODEL:
            raise RuntimeError("injected fault")

    remove = tracing.add_stage_hook(record)
    try:
        with tracing.stage(catalogue.WORKER_INIT_DEVICE, rank=2):
            pass
        assert [e[:2] for e in events] == [("enter", "worker.init_device"), ("exit", "worker.init_device")]
        assert events[0][2] == {"glassbox.rank": 2}
        assert events[1][2]["error"] is None and events[1][2]["duration_ms"] >= 0

        remove_crash = tracing.add_stage_hook(crash_on_load)
        with pytest.raises(RuntimeError, match="injected fault"), tracing.stage(catalogue.WORKER_LOAD_MODEL):
            pytest.fail("the body must not run when an enter hook raises")
        remove_crash()
    finally:
        remove()
    span = _by_name(traced.get_finished_spans())["worker.load_model"]
    assert span.status.status_code is StatusCode.ERROR
    assert tracing.current_stage() is None
    assert read_status(traced.status_file).last_finished.error == "RuntimeError: injected fault"


def test_record_span_starts_at_the_given_time(traced):
    arrival_ns = time.time_ns() - 2_000_000_000
    tracing.record_span(
        catalogue.LLM_REQUEST,
        start_ns=arrival_ns,
        attributes={catalogue.ATTR_GEN_AI_REQUEST_ID: "req-1", catalogue.ATTR_GEN_AI_USAGE_PROMPT_TOKENS: 5},
        kind=SpanKind.SERVER,
    )
    spans = _by_name(traced.get_finished_spans())
    req = spans["llm_request"]
    assert req.start_time == arrival_ns and req.kind is SpanKind.SERVER
    assert (req.end_time - req.start_time) / 1e9 >= 2.0
    assert req.attributes["gen_ai.request.id"] == "req-1"


def test_jsonl_exporter_writes_one_line_per_span(tmp_path):
    trace_file = tmp_path / "spans.jsonl"
    tracing.setup_tracing("Writer", trace_file=str(trace_file))
    try:
        with tracing.stage(catalogue.EXECUTOR_INIT):
            with tracing.stage(catalogue.WORKER_LOAD_MODEL, rank=0):
                pass
            with pytest.raises(OSError), tracing.stage(catalogue.WORKER_INIT_DEVICE):
                raise OSError("gone")
        # Written as each span ends, before any shutdown or flush.
        lines = trace_file.read_text().splitlines()
        handle = tracing.get_handle()
        assert handle.health()[0].exported == 3 and handle.health()[0].dropped == 0
    finally:
        tracing.shutdown_tracing()
    records = [json.loads(line) for line in lines]
    assert [r["name"] for r in records] == ["worker.load_model", "worker.init_device", "executor.init"]
    outer = records[2]
    assert records[0]["parent_span_id"] == outer["span_id"] and outer["parent_span_id"] is None
    assert len(outer["trace_id"]) == 32 and len(outer["span_id"]) == 16
    assert records[0]["attributes"] == {"glassbox.rank": 0, "thread.name": "MainThread"}
    assert records[1]["status"] == "ERROR" and records[0]["status"] == "UNSET"
    assert records[0]["resource"] == {
        "service.name": "glassbox",
        "glassbox.role": "Writer",
        "glassbox.pid": os.getpid(),
    }
    assert outer["duration_ms"] == pytest.approx((outer["end_ns"] - outer["start_ns"]) / 1e6, abs=1e-3)


def test_setup_twice_replaces_cleanly(tmp_path, caplog):
    first = tracing.setup_tracing("First", in_memory=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = tracing.setup_tracing("Second", rank=1, in_memory=True)
    try:
        with tracing.stage(catalogue.ENGINE_CORE_INIT):
            pass
        assert first.get_finished_spans() == ()
        (span,) = second.get_finished_spans()
        assert span.resource.attributes["glassbox.role"] == "Second"
        assert tracing.get_finished_spans() == (span,)
        assert "Overriding" not in caplog.text
    finally:
        tracing.shutdown_tracing()
    tracing.shutdown_tracing()  # twice is harmless
    assert tracing.get_handle() is None


def test_exporter_failures_are_counted_not_raised():
    class Broken(JsonLinesSpanExporter):
        def export(self, spans):
            raise OSError("disk full")

    exporter = CountingExporter(Broken(os.devnull), "broken")
    handle = tracing.setup_tracing("Health", in_memory=True)
    try:
        with tracing.stage(catalogue.EXECUTOR_INIT):
            pass
        spans = handle.get_finished_spans()
        exporter.export(spans)
        exporter.export(spans)
    finally:
        tracing.shutdown_tracing()
    assert (exporter.health.exported, exporter.health.dropped) == (0, 2)
    assert exporter.health.last_error == "OSError: disk full"


def test_otlp_without_package_fails_soft(caplog, monkeypatch):
    # The exporters are dependencies now; a missing one is simulated (import fails).
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    handle = tracing.setup_tracing("Otlp", otlp_endpoint="http://localhost:4317", in_memory=True)
    try:
        with tracing.stage(catalogue.EXECUTOR_INIT):
            pass
        assert len(handle.get_finished_spans()) == 1  # the other exporters still work
        assert "OTLP traces to http://localhost:4317 (grpc) disabled" in caplog.text
        assert "otlp: 0 exported, 0 dropped (last error: OTLP traces" in handle.health_summary()
    finally:
        tracing.shutdown_tracing()


# ---------------------------------------------------------------------------------------
# Bounded waits
# ---------------------------------------------------------------------------------------


def test_wait_for_timeout_names_what_was_awaited():
    start = time.monotonic()
    with pytest.raises(tracing.WaitTimeout) as err:
        tracing.wait_for("READY from EngineCore_DP0", lambda: False, timeout_s=0.1)
    assert 0.1 <= time.monotonic() - start < 1.0  # not early; late only by scheduling noise
    assert str(err.value) == "timed out after 0.1 s waiting for READY from EngineCore_DP0"
    assert isinstance(err.value, TimeoutError) and err.value.what == "READY from EngineCore_DP0"
    with pytest.raises(tracing.WaitTimeout, match=r"after 5\.0 s waiting for an event"):
        raise tracing.WaitTimeout("an event", 5.0)


def test_wait_for_returns_the_value_of_each_kind_of_condition():
    counter = iter(range(10))
    assert tracing.wait_for("third poll", lambda: next(counter) >= 2 and "done", timeout_s=2) == "done"
    event = threading.Event()
    threading.Timer(0.05, event.set).start()
    assert tracing.wait_for("event", event, timeout_s=2) is True
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert (
            tracing.wait_for("future", pool.submit(lambda: None), timeout_s=2) is None
        )  # falsy result is fine
        assert tracing.wait_for("future", pool.submit(lambda: 7), timeout_s=2) == 7
        failing = pool.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            tracing.wait_for("failing future", failing, timeout_s=2)
    with pytest.raises(TypeError):
        tracing.wait_for("nothing", 42, timeout_s=1)


def test_wait_for_cancel_stops_the_wait_early():
    cancel = threading.Event()
    threading.Timer(0.05, cancel.set).start()
    start = time.monotonic()
    with pytest.raises(tracing.WaitCancelled, match="cancelled while waiting for shutdown"):
        tracing.wait_for("shutdown", threading.Event(), timeout_s=10, cancel=cancel)
    assert time.monotonic() - start < 2


def test_bounded_get_and_wait_events():
    events = []
    remove = tracing.add_stage_hook(lambda event, name, attrs: events.append((event, name, dict(attrs))))
    try:
        q: queue.Queue[int] = queue.Queue()
        q.put(5)
        assert tracing.bounded_get(q, "input_queue item", timeout_s=1) == 5
        with pytest.raises(tracing.WaitTimeout, match="waiting for input_queue item"):
            tracing.bounded_get(q, "input_queue item", timeout_s=0.05)
    finally:
        remove()
    assert [(e, n) for e, n, _ in events] == [
        ("wait_start", "input_queue item"),
        ("wait_end", "input_queue item"),
    ] * 2
    assert events[0][2] == {"timeout_s": 1}
    assert [a["outcome"] for e, _, a in events if e == "wait_end"] == ["ok", "timeout"]


def test_wait_for_async_returns_results_times_out_naming_it_and_runs_its_check():
    import asyncio

    from tracing.waits import wait_for_async

    events = []
    remove = tracing.add_stage_hook(
        lambda event, name, attrs: events.append((event, name, attrs.get("outcome")))
    )

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = [loop.create_future(), loop.create_future()]
        loop.call_later(0.05, done[0].set_result, "a")
        loop.call_later(0.1, done[1].set_result, "b")
        assert await wait_for_async("two answers", done, timeout_s=2, poll_interval_s=0.01) == ["a", "b"]
        never = loop.create_future()
        with pytest.raises(tracing.WaitTimeout, match="after 0.1 s waiting for an answer"):
            await wait_for_async("an answer", [never], timeout_s=0.1, poll_interval_s=0.02)
        assert never.cancelled()  # given up: a late answer goes nowhere
        checks = []

        def engines_alive() -> None:
            checks.append(1)
            if len(checks) == 3:
                raise RuntimeError("engine died")

        with pytest.raises(RuntimeError, match="engine died"):
            await wait_for_async("an answer", [loop.create_future()], timeout_s=5, check=engines_alive,
                                 poll_interval_s=0.01)  # fmt: skip

    try:
        asyncio.run(main())
    finally:
        remove()
    assert [o for e, _, o in events if e == "wait_end"] == ["ok", "timeout", "error"]


def test_default_timeout_comes_from_the_environment(monkeypatch):
    from tracing.waits import default_timeout_s

    monkeypatch.setenv("GLASSBOX_DEFAULT_WAIT_TIMEOUT_S", "0.05")
    with pytest.raises(tracing.WaitTimeout, match="after 0.05 s"):
        tracing.wait_for("nothing", lambda: False, timeout_s=None)
    monkeypatch.setenv("GLASSBOX_DEFAULT_WAIT_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="GLASSBOX_DEFAULT_WAIT_TIMEOUT_S"):
        default_timeout_s()


# ---------------------------------------------------------------------------------------
# Rules that keep the package honest (import rules: tests/e2e/test_import_rules.py)
# ---------------------------------------------------------------------------------------


def test_docs_spans_md_is_current():
    docs = (REPO / "docs" / "spans.md").read_text()
    assert docs == catalogue.render_markdown(), "regenerate: python -m tracing.catalogue > docs/spans.md"


def test_catalogue_names_and_levels():
    assert catalogue.span_def("worker.load_model").level == catalogue.LIFECYCLE
    assert catalogue.span_def("scheduler.schedule").level == catalogue.STEP
    assert catalogue.span_def("llm_request").level == catalogue.REQUEST
    assert catalogue.ALIASES["step_num_scheduled_tokens"] == "glassbox.step.num_scheduled_tokens"
    assert catalogue.ATTR_GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN == "gen_ai.latency.time_to_first_token"
    assert len(catalogue.ALIASES) == len(catalogue.ATTRIBUTES)  # no two keys share an alias
