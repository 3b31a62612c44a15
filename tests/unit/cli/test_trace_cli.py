"""``glassbox trace FILE``: list the traces of a JSON-lines span file and draw one as a waterfall.

Span files here are written the way ``tracing.exporters.JsonLinesSpanExporter`` writes them
(one ``span_to_dict`` per line): a start-up across three processes with the catalogue's
nested lifecycle stages, a request crossing processes and threads, step traces, and lines a
reader must survive. One file comes from a real ``glassbox generate --trace-file`` run of the
bundled model. The assertions are on what a person sees at a fixed terminal width.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import trace as trace_cli
from tracing import catalogue as cat

CLI = [sys.executable, "-m", "engine.cli.main"]
ROOT = Path(__file__).resolve().parents[3]
T0 = 1_764_000_000_000_000_000  # ns since the epoch

API, CORE, WORKER = ("APIServer_0", 100, None), ("EngineCore_DP0", 200, 0), ("Worker_DP0_PP0_TP0", 300, 0)
STARTUP = "a1" * 16
OLD_STARTUP = "0b" * 16
REQUEST = "c3" * 16
CALLER_SPAN = "00f067aa0ba902b7"


def span(name, trace_id, span_id, parent, start_ms, end_ms, proc, *, thread="MainThread", attrs=None, status="UNSET"):  # fmt: skip
    role, pid, rank = proc
    start, end = T0 + int(start_ms * 1e6), T0 + int(end_ms * 1e6)
    return {
        "name": name,
        "trace_id": trace_id,
        "span_id": span_id.ljust(16, "0"),
        "parent_span_id": parent.ljust(16, "0") if parent else None,
        "kind": "INTERNAL",
        "start_ns": start,
        "end_ns": end,
        "duration_ms": round((end - start) / 1e6, 3),
        "attributes": attrs or {},
        "status": status,
        "status_description": None,
        "events": [],
        "resource": {"service.name": "glassbox", "glassbox.role": role, "glassbox.pid": pid}
        | ({"glassbox.rank": rank} if rank is not None else {}),
        "thread": thread,
    }


def startup_spans(trace_id=STARTUP, offset_ms=0.0):
    """APIServer_0 → EngineCore_DP0 → Worker_DP0_PP0_TP0, in the order spans end (as written)."""
    o = offset_ms
    s = [
        span(
            cat.PROCESS_SPAWN,
            trace_id,
            "a2",
            "a1",
            o + 1,
            o + 3,
            API,
            attrs={cat.ATTR_ROLE: "EngineCore_DP0"},
        ),
        span(cat.PROCESS_SPAWN, trace_id, "b2", "b1", o + 420, o + 422, CORE),
        span(
            cat.WORKER_INIT_DEVICE, trace_id, "c1", "b1", o + 900, o + 1000, WORKER, attrs={cat.ATTR_RANK: 0}
        ),
        span(
            cat.WORKER_LOAD_MODEL, trace_id, "c2", "b1", o + 1000, o + 1900, WORKER, attrs={cat.ATTR_RANK: 0}
        ),
        span(cat.EXECUTOR_INIT, trace_id, "b1", "b0", o + 410, o + 2000, CORE),
        span(cat.WORKER_DETERMINE_AVAILABLE_MEMORY, trace_id, "c3", "b3", o + 2010, o + 2300, WORKER),
        span(cat.WORKER_INITIALIZE_KV_CACHE, trace_id, "c4", "b3", o + 2300, o + 2500, WORKER),
        span(cat.WORKER_COMPILE_OR_WARM_UP_MODEL, trace_id, "c5", "b3", o + 2500, o + 2700, WORKER),
        span(cat.ENGINE_CORE_INITIALIZE_KV_CACHE, trace_id, "b3", "b0", o + 2000, o + 2800, CORE),
        span(cat.ENGINE_CORE_INIT, trace_id, "b0", "a1", o + 400, o + 2900, CORE, attrs={cat.ATTR_RANK: 0}),
        span(cat.ENGINE_CORE_HANDSHAKE, trace_id, "a1", None, o + 0, o + 3000, API),
    ]
    return s


def request_spans():
    """One request: its span in the API server, children in the engine core's input thread
    and main thread and in the worker. ``llm_request`` is the catalogue's; the child names
    stand for the cross-process request spans being added (not in the catalogue yet — the
    reader must draw names it does not know)."""
    rid = {cat.ATTR_GEN_AI_REQUEST_ID: "cmpl-abc123", cat.ATTR_GEN_AI_USAGE_PROMPT_TOKENS: 7}
    return [
        span("engine_core.input_thread", REQUEST, "e1", "d0", 2, 3, CORE, thread="EngineCoreInputThread"),
        span("worker.execute_model", REQUEST, "f1", "e2", 10, 90, WORKER),
        span("engine_core.schedule_request", REQUEST, "e2", "d0", 5, 100, CORE),
        span(cat.LLM_REQUEST, REQUEST, "d0", CALLER_SPAN, 0, 120, API, attrs=rid),
    ]


def step_spans(n=3):
    out = []
    for i in range(n):
        tid = f"{i + 1:02x}" * 16
        out.append(span(cat.SCHEDULER_SCHEDULE, tid, "51", "50", 5000 + i * 10, 5000 + i * 10 + 1, CORE))
        out.append(span(cat.ENGINE_CORE_STEP, tid, "50", None, 5000 + i * 10, 5000 + i * 10 + 4, CORE,
                        attrs={cat.ATTR_STEP_ID: i}))  # fmt: skip
    return out


@pytest.fixture
def span_file(tmp_path):
    lines = [json.dumps(s) for s in startup_spans(OLD_STARTUP, offset_ms=-60_000)]
    lines += [json.dumps(s) for s in startup_spans() + request_spans() + step_spans()]
    lines.insert(5, "this is not JSON")
    lines.insert(9, json.dumps({"hello": "a JSON line that is not a span"}))
    path = tmp_path / "spans.jsonl"
    # A process killed mid-write leaves a truncated last line, with no newline.
    path.write_text("\n".join(lines) + '\n{"name": "engine_core.st')
    return path


def cli(*args, columns=80):
    """``glassbox ARGS`` in a terminal ``columns`` wide (stdout is a pipe: no colour)."""
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1"}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)


def trace(*args, columns=80):
    """``glassbox trace ARGS``."""
    return cli("trace", *args, columns=columns)


def draw(trace, width, **kwargs) -> str:
    from rich.console import Console

    buf = io.StringIO()
    trace_cli.render_waterfall(trace, Console(file=buf, width=width, color_system=None), **kwargs)
    return buf.getvalue()


def lane_of(text: str, name: str) -> str:
    """The lane header above the first row drawing ``name``."""
    header = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and " pid " in line:
            header = line
        elif line.strip().split(" ")[0] == name:
            return header
    raise AssertionError(f"{name} not drawn:\n{text}")


# ------------------------------------------------------------------------ reading


def test_reader_counts_what_it_cannot_read_and_links_across_processes(span_file):
    f = trace_cli.load(span_file)
    assert f.skipped_lines == 2 and f.truncated_last_line
    assert [t.kind for t in f.traces] == ["start-up", "start-up", "request", "step", "step", "step"]
    startup = next(t for t in f.traces if t.trace_id == STARTUP)
    assert startup.root.name == cat.ENGINE_CORE_HANDSHAKE and len(startup.roots) == 1
    assert startup.processes == ["APIServer_0", "EngineCore_DP0", "Worker_DP0_PP0_TP0"]
    load_model = next(s for s in startup.spans if s.name == cat.WORKER_LOAD_MODEL)
    assert load_model.parent.name == cat.EXECUTOR_INIT and load_model.parent.role == "EngineCore_DP0"
    assert startup.slowest() is load_model  # 900 ms of its own; executor.init has 588 ms
    request = next(t for t in f.traces if t.kind == "request")
    assert request.request_id == "cmpl-abc123" and request.remote_parent == CALLER_SPAN


def test_reader_takes_the_resource_keys_an_otlp_backend_shows_and_the_older_bare_ones(tmp_path):
    new = span("worker.load_model", STARTUP, "aa", None, 0, 10, WORKER)
    assert new["resource"] == {"service.name": "glassbox", "glassbox.role": "Worker_DP0_PP0_TP0",
                               "glassbox.pid": 300, "glassbox.rank": 0}  # fmt: skip
    old = {**span("worker.init_device", STARTUP, "bb", None, 10, 20, WORKER),
           "resource": {"role": "Worker_DP0_PP0_TP1", "pid": 301, "rank": 1}}  # fmt: skip
    path = tmp_path / "spans.jsonl"
    path.write_text(json.dumps(new) + "\n" + json.dumps(old) + "\n")
    spans = {s.name: s for s in trace_cli.load(path).traces[0].spans}
    assert (spans["worker.load_model"].role, spans["worker.load_model"].pid, spans["worker.load_model"].rank) == (
        "Worker_DP0_PP0_TP0", 300, 0)  # fmt: skip
    assert (spans["worker.init_device"].role, spans["worker.init_device"].pid, spans["worker.init_device"].rank) == (
        "Worker_DP0_PP0_TP1", 301, 1)  # fmt: skip


# ------------------------------------------------------------------------ --list


def test_list_is_the_default_and_shows_each_trace(span_file):
    proc = trace(str(span_file))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert max(len(line) for line in out.splitlines()) <= 80, out
    assert " ".join(out.split()).startswith(f"{span_file}: 32 spans in 6 traces")
    assert "skipped: 2 lines not understood, the last line is truncated" in out
    rows = [line for line in out.splitlines() if line[:8] in (STARTUP[:8], OLD_STARTUP[:8], REQUEST[:8])]
    assert [r.split()[1] for r in rows] == ["start-up", "start-up", "request"], out
    assert "engine_core.handshake" in rows[1] and "3.00 s" in rows[1] and "APIServer_0" in rows[1]
    assert "Worker_DP0_PP0_TP0" in out and "request cmpl-abc123" in out
    assert "+ 3 step traces" in out and "--all lists them" in out
    assert trace(str(span_file), "--list").stdout == out

    wide = trace(str(span_file), "--list", "--all", columns=200).stdout
    row = next(line for line in wide.splitlines() if line.startswith(STARTUP[:8]))
    assert "APIServer_0, EngineCore_DP0, Worker_DP0_PP0_TP0" in row
    assert sum(" step " in line for line in wide.splitlines()) == 3


def test_list_json(span_file):
    data = json.loads(trace(str(span_file), "--json").stdout)
    assert data["skipped_lines"] == 2 and data["truncated_last_line"] is True
    startup = next(t for t in data["traces"] if t["trace_id"] == STARTUP)
    assert startup["kind"] == "start-up" and startup["num_spans"] == 11 and startup["duration_ms"] == 3000.0


# ------------------------------------------------------------------------ --startup


def test_startup_waterfall_at_80_columns(span_file):
    proc = trace(str(span_file), "--startup")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80, out
    assert lines[0].startswith("start-up trace · engine_core.handshake · 3.00 s · 11 spans in 3 processes")
    assert STARTUP in lines[1]  # the latest start-up, not the one a minute earlier
    # One lane per process and thread, in start order; each span in the lane of its process,
    # even when its parent ran in another one.
    headers = [line for line in lines if " pid " in line and not line.startswith(" ")]
    assert [h.split("  ")[0] for h in headers] == [
        "APIServer_0 / MainThread",
        "EngineCore_DP0 / MainThread",
        "Worker_DP0_PP0_TP0 / MainThread",
    ]
    assert "pid 300" in headers[2] and "under EngineCore_DP0 / MainThread" in headers[2]
    assert lane_of(out, cat.WORKER_LOAD_MODEL).startswith("Worker_DP0_PP0_TP0")
    assert lane_of(out, cat.ENGINE_CORE_INIT).startswith("EngineCore_DP0")
    # Nesting is indentation within a lane.
    indent = {
        line.strip().split()[0]: len(line) - len(line.lstrip()) for line in lines if line.startswith("  ")
    }
    assert indent[cat.ENGINE_CORE_INIT] < indent[cat.EXECUTOR_INIT] < indent[cat.PROCESS_SPAWN]
    # Bars on one time axis: the root spans it, load_model sits in its second third.
    root_row = next(line for line in lines if line.strip().startswith(cat.ENGINE_CORE_HANDSHAKE))
    load_row = next(line for line in lines if line.strip().startswith(cat.WORKER_LOAD_MODEL))
    assert root_row.count("█") >= 30 and "3.00 s" in root_row
    bar_start = root_row.index("█")
    assert 0.25 < (load_row.index("█") - bar_start) / root_row.count("█") < 0.4
    # The slowest stage: marked on its row and named at the bottom.
    assert load_row.rstrip().endswith("900.0 ms ◀")
    assert sum("◀" in line for line in lines if line.startswith("  ")) == 1
    assert (
        "◀ slowest stage: worker.load_model (900.0 ms of its own time, 30% of the trace) on Worker_DP0_PP0_TP0 / MainThread"
        in " ".join(out.split())
    )  # noqa: E501
    assert "skipped: 2 lines not understood" in out


def test_startup_waterfall_wide_and_with_a_fixed_bar_width(span_file):
    f = trace_cli.load(span_file)
    latest = trace_cli.select(f, startup=True)
    wide = draw(latest, 160)
    assert max(len(line) for line in wide.splitlines()) <= 160
    assert "900.0 ms ◀ slowest" in wide
    fixed = draw(latest, 160, bar_width=20)
    root_row = next(line for line in fixed.splitlines() if line.strip().startswith(cat.ENGINE_CORE_HANDSHAKE))
    assert root_row.count("█") == 20
    older = trace_cli.select(f, startup=True, trace_id=OLD_STARTUP[:6])
    assert older.trace_id == OLD_STARTUP


def test_startup_json_is_the_span_tree(span_file):
    data = json.loads(trace(str(span_file), "--startup", "--json").stdout)
    assert data["trace_id"] == STARTUP and data["slowest"]["name"] == cat.WORKER_LOAD_MODEL
    (root,) = data["spans"]
    core = next(c for c in root["children"] if c["name"] == cat.ENGINE_CORE_INIT)
    executor = next(c for c in core["children"] if c["name"] == cat.EXECUTOR_INIT)
    load = next(c for c in executor["children"] if c["name"] == cat.WORKER_LOAD_MODEL)
    assert load["role"] == "Worker_DP0_PP0_TP0" and load["offset_ms"] == 1000.0 and load["own_ms"] == 900.0
    assert executor["own_ms"] == 588.0


# ------------------------------------------------------------------------ --request


def test_request_waterfall_crosses_processes_and_threads(span_file):
    out = trace(str(span_file), "--request", "cmpl-abc123").stdout
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80, out
    assert lines[0].startswith("request trace · llm_request · request cmpl-abc123 · 120.0 ms")
    assert f"continues the caller's span {CALLER_SPAN}" in out
    assert "gen_ai.usage.prompt_tokens=7" in out
    headers = [line.split("  ")[0] for line in lines if " pid " in line and not line.startswith(" ")]
    assert headers == [
        "APIServer_0 / MainThread",
        "EngineCore_DP0 / EngineCoreInputThread",
        "EngineCore_DP0 / MainThread",
        "Worker_DP0_PP0_TP0 / MainThread",
    ]
    assert lane_of(out, "worker.execute_model").startswith("Worker_DP0_PP0_TP0")
    assert "◀ slowest span: worker.execute_model" in " ".join(out.split())
    # A trace id prefix works too.
    assert trace(str(span_file), "--request", REQUEST[:10]).stdout.splitlines()[0] == lines[0]
    assert trace(str(span_file), "--trace-id", REQUEST[:10]).stdout.splitlines()[0] == lines[0]


def test_a_request_names_the_step_traces_its_spans_link_to(tmp_path):
    """request.prefill / request.decode link the engine_core.step spans that computed them: the
    waterfall lists each linked trace with its duration, --json gives them as data."""
    steps = step_spans(2)
    first, second = "01" * 16, "02" * 16
    prefill = span("request.prefill", REQUEST, "e3", "d0", 4, 20, CORE)
    prefill["links"] = [{"trace_id": first, "span_id": "50".ljust(16, "0")}]
    decode = span("request.decode", REQUEST, "e4", "d0", 20, 100, CORE)
    decode["links"] = [
        {"trace_id": second, "span_id": "50".ljust(16, "0")},
        {"trace_id": "ab" * 16, "span_id": "1" * 16},
    ]
    path = tmp_path / "spans.jsonl"
    path.write_text("\n".join(json.dumps(s) for s in [*steps, *request_spans(), prefill, decode]) + "\n")
    out = " ".join(trace(str(path), "--request", "cmpl-abc123", columns=100).stdout.split())
    assert "request.prefill → 1 step trace: 01010101 (4.00 ms)" in out, out
    assert "request.decode → 2 step traces: 02020202 (4.00 ms), abababab (not in this file)" in out, out
    assert "draw one: --trace-id PREFIX" in out
    data = json.loads(trace(str(path), "--request", "cmpl-abc123", "--json").stdout)
    assert data["linked_traces"][0] == {"from": "request.prefill", "trace_id": first, "kind": "step",
                                        "root": cat.ENGINE_CORE_STEP, "duration_ms": 4.0}  # fmt: skip
    assert [(d["from"], d["root"]) for d in data["linked_traces"][1:]] == [
        ("request.decode", cat.ENGINE_CORE_STEP), ("request.decode", None)]  # fmt: skip
    (core_prefill,) = [c for r in data["spans"] for c in r["children"] if c["name"] == "request.prefill"]
    assert core_prefill["links"] == [{"trace_id": first, "span_id": "50".ljust(16, "0")}]
    # A trace without links says nothing about them.
    assert "linked traces" not in trace(str(path), "--trace-id", first[:8]).stdout


# ------------------------------------------------------------------------ errors and help


@pytest.mark.parametrize(
    "args, message",
    [
        (["{tmp}/missing.jsonl"], "missing.jsonl: no such file"),
        (["{tmp}", "--startup"], "is a directory"),
        (["{file}", "--request", "cmpl-nope"], "--request cmpl-nope: no trace with that request id"),
        (["{file}", "--trace-id", "ffff"], "--trace-id ffff: no such trace"),
        (["{file}", "--startup", "--trace-id", REQUEST[:8]], "is not a start-up trace"),
        (["{empty}", "--startup"], "--startup: no start-up trace"),
        (["{file}", "--startup", "--request", "x"], "not allowed with argument"),
    ],
)
def test_errors_are_one_line_and_exit_2(span_file, tmp_path, args, message):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    argv = [a.format(tmp=tmp_path, file=span_file, empty=empty) for a in args]
    proc = trace(*argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert proc.stderr.startswith("glassbox trace: error: ")


def test_help_lists_trace_and_every_flag_with_its_default():
    top = cli("--help")
    assert top.returncode == 0 and "trace" in top.stdout and "waterfall" in top.stdout
    sub = cli("trace", "--help", columns=200).stdout
    for flag in (
        "--list",
        "--startup",
        "--request ID",
        "--trace-id PREFIX",
        "--json",
        "--width COLUMNS",
        "--all",
    ):
        line = next(line for line in sub.split("options:")[1].splitlines() if line.strip().startswith(flag))
        assert "default" in line, line


# ------------------------------------------------------------------------ a real run


@pytest.mark.slow
def test_a_real_generate_run_draws_every_process(tmp_path):
    spans = tmp_path / "spans.jsonl"
    gen = cli("generate", "Hello", "--max-tokens", "4", "--trace-file", str(spans))
    assert gen.returncode == 0, gen.stderr[-2000:]

    listed = trace(str(spans), "--list")
    assert listed.returncode == 0, listed.stderr
    startup_row = next(line for line in listed.stdout.splitlines() if " start-up " in line)
    # The start-up trace begins with the config check, run before tracing was set up.
    assert cat.CLI_VALIDATE_CONFIG in startup_row and "LLM" in startup_row, listed.stdout
    assert " request " in listed.stdout and "step traces" in listed.stdout

    proc = trace(str(spans), "--startup")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80, out
    assert (
        lines[0].startswith(f"start-up trace · {cat.CLI_VALIDATE_CONFIG} · ") and "in 3 processes" in lines[0]
    )
    headers = [line.split("  ")[0] for line in lines if " pid " in line and not line.startswith(" ")]
    roles = [h.split(" / ")[0] for h in headers]
    assert roles == ["LLM", "EngineCore_DP0", "Worker_DP0_PP0_TP0"], out
    for name in (cat.CLI_VALIDATE_CONFIG, cat.LLM_INIT, cat.ENGINE_CORE_HANDSHAKE, cat.ENGINE_CORE_INIT,
                 cat.WORKER_LOAD_MODEL):  # fmt: skip
        assert lane_of(out, name) is not None
    assert lane_of(out, cat.CLI_VALIDATE_CONFIG) == lane_of(out, cat.LLM_INIT)  # one lane: LLM / MainThread
    assert lane_of(out, cat.WORKER_LOAD_MODEL).startswith("Worker_DP0_PP0_TP0")
    marked = [line for line in lines if line.startswith("  ") and line.rstrip().endswith("◀")]
    assert len(marked) == 1, out
    slowest = marked[0].split()[0]
    assert f"◀ slowest stage: {slowest} (" in " ".join(out.split())


def serving_wave(tmp_path: Path) -> Path:
    """A serving wave as the spans show it: one request's lone 128-token prefill step, then 15
    prefills in one step while it decodes, then decode steps; and the requests' TTFT parts."""
    core = ("EngineCore_DP0", 200, 0)
    lines, t = [], 0.0
    steps = [(40.0, 128, 1, 0), (240.0, 1921, 15, 1)] + [(18.0, 16, 0, 16)] * 3
    for i, (ms, tokens, new, cached) in enumerate(steps):
        attrs = {cat.ATTR_STEP_NUM_SCHEDULED_TOKENS: tokens, cat.ATTR_STEP_NUM_NEW_REQS: new,
                 cat.ATTR_STEP_NUM_CACHED_REQS: cached}  # fmt: skip
        lines.append(span("engine_core.step", f"{i:032x}", f"s{i}", None, t, t + ms, core, attrs=attrs))
        t += ms + 2.0
    api = ("APIServer_0", 100, None)
    for i in range(16):
        late = i > 0  # the 15 that came in during the lone step: it ran first, then their prefill
        attrs = {cat.ATTR_GEN_AI_REQUEST_ID: f"cmpl-{i:02d}",
                 cat.ATTR_GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 0.3 if late else 0.05,
                 cat.ATTR_GEN_AI_LATENCY_TIME_IN_QUEUE: 0.002,
                 cat.ATTR_GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: 0.24 if late else 0.04}  # fmt: skip
        lines.append(span("llm_request", f"{100 + i:032x}", f"r{i}", None, 0.0, 400.0, api, attrs=attrs))
    path = tmp_path / "wave.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_steps_lists_the_prompt_steps_and_splits_the_ttft_tail(tmp_path):
    done = subprocess.run([*CLI, "trace", str(serving_wave(tmp_path)), "--steps"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert (
        lines[0] == "5 engine steps in 0.3 s, 2 with prompt tokens; the steps that scheduled prompt tokens:"
    )
    assert lines[2].split() == ["0.000", "40.0", "128", "1", "0", "EngineCore_DP0"]
    assert lines[3].split() == ["0.042", "240.0", "1921", "15", "1", "EngineCore_DP0"]
    assert "(the other 3 steps decode only: median 18.0 ms)" in done.stdout
    assert (
        "time to first token of 16 requests: median 300 ms, p90 300 ms, p99 300 ms, max 300 ms" in done.stdout
    )
    # the slowest: 300 ms = 58 before the scheduler (the lone step's time, in the input queue) + 2 + 240
    slowest = [ln for ln in lines if ln.strip().startswith("cmpl-")]
    assert len(slowest) == 5 and slowest[0].split()[1:] == ["300", "ms", "=", "58", "+", "2", "+", "240"]


def test_steps_of_a_file_without_steps_says_so(tmp_path):
    path = tmp_path / "startup.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in startup_spans()))
    done = subprocess.run([*CLI, "trace", str(path), "--steps"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no engine_core.step spans in this file (the engine core's step traces)"
