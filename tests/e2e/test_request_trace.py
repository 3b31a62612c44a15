"""One request, one trace, across the process tree.

A real ``glassbox serve --trace-file F --collect-detailed-traces all``; a completion request
sent with a caller's W3C ``traceparent``. Every process appends its spans to F. Checked:

- the request's trace has the caller's trace id, and its root ``api_server.request`` is a
  child of the caller's span; under it, from the API server: ``api_server.process_inputs``
  and ``llm_request``; from the engine core: ``engine_core.input``,
  ``engine_core.input_queue``, ``scheduler.waiting``, ``request.prefill`` (linked to the
  ``engine_core.step`` spans that computed it) and ``request.decode``;
- each step is a trace of its own: the worker's ``worker.execute_model`` (with its
  broadcast-queue wait) is a child of the engine core's ``executor.execute_model`` in a step
  trace, with ``model_runner.forward`` / ``model_runner.sample`` under it — never in the
  start-up trace or a request's;
- the output thread's ``engine_core.output_send`` belongs to the step that made the outputs.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from server_utils import start_server

pytestmark = pytest.mark.slow

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


def _spans(path: Path) -> list[dict]:
    spans = []
    for line in path.read_text().splitlines():
        try:
            spans.append(json.loads(line))
        except ValueError:
            continue  # a line being written right now
    return spans


def test_a_request_is_one_trace_from_the_http_caller_through_the_engine_core(default_model_dir):
    base = Path(tempfile.mkdtemp(prefix="gbq", dir="/tmp"))  # short: ipc paths ≤ 107 chars
    trace_file = base / "spans.jsonl"
    server = start_server(base, "--max-model-len", "256", "--max-num-batched-tokens", "16",
                          "--trace-file", str(trace_file), "--collect-detailed-traces", "all")  # fmt: skip
    try:
        model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
        headers = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
        body = {"model": model, "prompt": "one two three four five six seven eight nine ten eleven twelve",
                "max_tokens": 5, "ignore_eos": True}  # fmt: skip
        response = httpx.post(server.base_url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]

        wanted = {"api_server.request", "api_server.process_inputs", "llm_request", "engine_core.input",
                  "engine_core.input_queue", "scheduler.waiting", "request.prefill", "request.decode"}  # fmt: skip
        deadline = time.monotonic() + 20
        while True:
            spans = _spans(trace_file)
            mine = [s for s in spans if s["trace_id"] == CALLER_TRACE]
            if wanted <= {s["name"] for s in mine} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        names = {s["name"]: s for s in mine}
        assert wanted <= set(names), sorted(names)

        root = names["api_server.request"]
        assert root["parent_span_id"] == CALLER_SPAN and root["resource"]["glassbox.role"] == "APIServer_0"
        for name in wanted - {"api_server.request"}:
            assert names[name]["parent_span_id"] == root["span_id"], name
        engine_side = {"engine_core.input", "engine_core.input_queue", "scheduler.waiting", "request.prefill",
                       "request.decode"}  # fmt: skip
        assert {names[n]["resource"]["glassbox.role"] for n in engine_side} == {"EngineCore_DP0"}
        # The prompt (>16 tokens) was prefilled in chunks; the prefill links those steps.
        prefill = names["request.prefill"]
        assert prefill["attributes"]["glassbox.request.num_chunks"] >= 2
        steps = {s["span_id"]: s for s in spans if s["name"] == "engine_core.step"}
        assert prefill["links"] and all(link["span_id"] in steps for link in prefill["links"])
        assert (
            names["request.decode"]["attributes"]["glassbox.request.num_steps"]
            == usage["completion_tokens"] - 1
        )
        # Order in time: queued before scheduled, prefill before decode, all inside the root.
        assert (
            names["scheduler.waiting"]["end_ns"] <= prefill["end_ns"] <= names["request.decode"]["start_ns"]
        )
        # The prefill starts when its first step began and covers the steps that computed it.
        linked = [steps[link["span_id"]] for link in prefill["links"]]
        assert names["scheduler.waiting"]["end_ns"] == prefill["start_ns"]
        assert prefill["start_ns"] <= min(s["start_ns"] for s in linked) + 1_000_000
        assert prefill["end_ns"] >= max(s["end_ns"] for s in linked) - 1_000_000
        assert root["start_ns"] <= names["engine_core.input"]["start_ns"]
        assert names["request.decode"]["end_ns"] <= root["end_ns"]

        # Steps are traces of their own; the worker's spans sit inside them.
        linked_step = steps[prefill["links"][0]["span_id"]]
        step_trace = [s for s in spans if s["trace_id"] == linked_step["trace_id"]]
        by_id = {s["span_id"]: s for s in step_trace}
        worker = [s for s in step_trace if s["name"] == "worker.execute_model"]
        assert worker, sorted({s["name"] for s in step_trace})
        parent = by_id[worker[0]["parent_span_id"]]
        assert (
            parent["name"] == "executor.execute_model"
            and parent["resource"]["glassbox.role"] == "EngineCore_DP0"
        )
        assert worker[0]["resource"]["glassbox.role"] == "Worker_DP0_PP0_TP0"
        assert worker[0]["attributes"]["glassbox.queue.wait_ms"] >= 0
        children = {s["name"] for s in step_trace if s["parent_span_id"] == worker[0]["span_id"]}
        assert {"model_runner.forward", "model_runner.sample"} <= children
        assert any(s["name"] == "engine_core.output_send" for s in step_trace)
        # Every span of this run carries the attributes the catalogue lists for it (on at
        # least one of its occurrences: some are set only when they apply).
        from tracing import catalogue

        seen: dict[str, set[str]] = {}
        for span in spans:
            seen.setdefault(span["name"], set()).update(span["attributes"])
        missing = {name: sorted(set(catalogue.SPANS[name].attributes) - keys)
                   for name, keys in seen.items() if set(catalogue.SPANS[name].attributes) - keys}  # fmt: skip
        assert not missing, json.dumps(missing)
        startup_traces = {s["trace_id"] for s in spans if s["name"] == "engine_core.handshake"}
        assert not any(s["trace_id"] in startup_traces | {CALLER_TRACE} for s in spans
                       if s["name"] == "worker.execute_model")  # fmt: skip
    finally:
        server.kill_group()
        shutil.rmtree(base, ignore_errors=True)


def test_serve_sends_start_up_and_request_traces_to_an_otlp_collector(default_model_dir):
    """``glassbox serve --otlp-traces-endpoint`` on a default install: a real OTLP/HTTP
    receiver gets the start-up trace from every process and the request's trace under the
    caller's trace id, its ``gen_ai.usage.*`` equal to the response's ``usage``."""
    from otlp_receiver import HttpOtlpReceiver

    base = Path(tempfile.mkdtemp(prefix="gbo", dir="/tmp"))
    with HttpOtlpReceiver() as receiver:
        server = start_server(base, "--max-model-len", "256", "--otlp-traces-endpoint", receiver.endpoint)
        try:
            model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
            headers = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
            body = {"model": model, "prompt": "Hello there", "max_tokens": 4, "ignore_eos": True}
            response = httpx.post(server.base_url + "/v1/completions", json=body, headers=headers, timeout=60)
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            spans = receiver.wait_for(
                lambda got: (
                    {"llm_request", "request.decode", "engine_core.handshake"} <= {s.name for s in got}
                )
            )
        finally:
            server.kill_group()
            shutil.rmtree(base, ignore_errors=True)
    startup = receiver.trace_of("engine_core.handshake")
    assert {s.role for s in startup} >= {"APIServer_0", "EngineCore_DP0", "Worker_DP0_PP0_TP0"}
    ids = {s.span_id for s in startup}
    assert all(s.parent_span_id in ids for s in startup if s.parent_span_id), "whole, parents included"
    request = [s for s in spans if s.trace_id == CALLER_TRACE]
    assert {s.role for s in request} == {"APIServer_0", "EngineCore_DP0"}
    (root,) = [s for s in request if s.name == "api_server.request"]
    assert root.parent_span_id == CALLER_SPAN
    (llm_request,) = [s for s in request if s.name == "llm_request"]
    assert llm_request.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert llm_request.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]


def test_a_stream_closed_by_its_client_is_aborted_in_the_trace_and_the_log(default_model_dir):
    """A client reads two chunks of a long stream and closes it. The trace file (read once the
    server has stopped) shows the abort end to end, in the caller's one trace: an
    ``engine_core.abort`` span for the ABORT message in the engine core, ``llm_request`` with
    finish reason ``abort``, the engine's ``request.decode`` ended (finish reason ``abort``),
    and a ``glassbox.client_disconnected`` event on ``api_server.request`` with the chunks the
    client got. ``--enable-log-requests`` logs ``Aborted request <id>.`` once."""
    import signal

    base = Path(tempfile.mkdtemp(prefix="gba", dir="/tmp"))
    trace_file = base / "spans.jsonl"
    # Slow motion: the request is still decoding when the client goes away.
    server = start_server(base, "--max-model-len", "256", "--step-delay-ms", "50", "--trace-file", str(trace_file),
                          "--enable-log-requests", "--disable-log-stats")  # fmt: skip
    try:
        headers = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
        body = {"prompt": "Hello there", "max_tokens": 200, "ignore_eos": True, "stream": True}
        chunks = []
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=headers,
                          timeout=60) as response:  # fmt: skip
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    chunks.append(json.loads(line[len("data: ") :]))
                    if len(chunks) == 2:
                        break  # leaving the block closes the connection
        engine_id = f"{chunks[0]['id']}-0"
        assert chunks[-1]["choices"][0]["finish_reason"] is None
        # The abort reached the engine core: its span is in the file (spans are written as they end).
        deadline = time.monotonic() + 60
        while not any(s["name"] == "engine_core.abort" for s in _spans(trace_file)):
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.1)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.log()[-3000:]
    finally:
        server.kill_group()
    try:
        log = server.log()
        aborted = [line for line in log.splitlines() if "Aborted request" in line]
        assert len(aborted) == 1 and aborted[0].endswith(f"Aborted request {engine_id}."), aborted
        assert "Traceback" not in log, log[-3000:]
        wanted = {"api_server.request", "llm_request", "request.decode", "engine_core.abort"}
        spans = [s for s in _spans(trace_file) if s["name"] in wanted]
        assert sorted(s["name"] for s in spans) == sorted(wanted), "each once"
        names = {s["name"]: s for s in spans}
        assert {s["trace_id"] for s in spans} == {CALLER_TRACE}
        root = names["api_server.request"]
        assert all(names[n]["parent_span_id"] == root["span_id"] for n in set(names) - {"api_server.request"})
        assert root["status"] == "UNSET"
        (event,) = [e for e in root["events"] if e["name"] == "glassbox.client_disconnected"]
        assert event["attributes"]["glassbox.response.num_chunks_sent"] >= 2
        llm_request = names["llm_request"]["attributes"]
        assert llm_request["gen_ai.response.finish_reasons"] == ["abort"]
        assert 2 <= llm_request["gen_ai.usage.completion_tokens"] < 200
        decode = names["request.decode"]
        assert decode["attributes"]["gen_ai.response.finish_reasons"] == ["abort"]
        assert 1 <= decode["attributes"]["glassbox.request.num_steps"] < 200
        abort = names["engine_core.abort"]
        assert abort["resource"]["glassbox.role"] == "EngineCore_DP0"
        assert abort["attributes"]["glassbox.request.ids"] == [engine_id]
        # The API server ends llm_request, then sends ABORT; the engine core ends the decode
        # while it handles it (after the API server's span may have ended: nobody waits).
        assert root["start_ns"] <= names["llm_request"]["end_ns"] <= abort["start_ns"] <= decode["end_ns"]
        assert decode["end_ns"] <= abort["end_ns"]
    finally:
        shutil.rmtree(base, ignore_errors=True)
