"""engine-top's views, read the way a person reads the screen.

Every test builds a ``LiveState`` by hand — a ``-tp 2 -dp 2`` server with 2 API servers
(2 + 2 + 4 + 1 coordinator = 9 processes) in a realistic moment — renders it through
``tui.views`` into a recording Rich console, and asserts on the plain text: each process
with its stage and the time in it, the token-budget bar of a step split into decode and
prefill, an alert with its hint, a dead worker with its signal, a stale heartbeat. The CLI
tests run ``engine-top`` in a subprocess against an empty run-directory base.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest
from rich.console import Console

from tracing import hints
from tracing.telemetry.events import (
    GAUGE_API_IN_FLIGHT,
    GAUGE_API_PENDING_OUTPUTS,
    GAUGE_API_WAITING_FOR_ENGINE,
    GAUGE_DP_RUNNING,
    GAUGE_DP_WAVE,
    GAUGE_DUMMY_STEPS,
    GAUGE_INPUT_QUEUE,
    GAUGE_KV_CACHED,
    GAUGE_KV_FREE,
    GAUGE_KV_TOTAL,
    GAUGE_KV_USED,
    GAUGE_MOE_A2A_MS,
    GAUGE_MOE_A2A_TOTAL_S,
    GAUGE_MOE_FIRST_EXPERT,
    GAUGE_MOE_FORWARD_TOTAL_S,
    GAUGE_MOE_LOCAL_EXPERTS,
    GAUGE_MOE_NUM_EXPERTS,
    GAUGE_MOE_STEP_ROWS,
    GAUGE_MQ_WRITTEN,
    GAUGE_OUTPUT_QUEUE,
    GAUGE_PREEMPTED,
    GAUGE_PREFIX_HIT_RATE,
    GAUGE_RUNNING,
    GAUGE_WAITING,
    GAUGE_WAITING_FOR_FSM,
    GAUGE_WORKER_THREADS,
    GAUGE_WORKER_THREADS_MAX,
    OpenStageInfo,
    RequestEvent,
    RequestProgress,
    ScheduledRequest,
    Snapshot,
    StepRecord,
    moe_expert_gauge,
)
from tracing.telemetry.state import Alert, LiveState, ProcessLive, RequestLive, WaitInfo
from tui import views
from tui.app import App, parse_keys

NOW = 1_700_000_000.0
RUN_DIR = "/run/user/1000/glassbox-4242-abcd"


def _stage(name: str, ago: float, level: str = "lifecycle", thread: str = "MainThread") -> OpenStageInfo:
    return OpenStageInfo(name=name, level=level, thread=thread, entered_at=NOW - ago)


def _proc(role: str, kind: str, pid: int, stages=(), **kw) -> ProcessLive:
    defaults = dict(
        state="running",
        link="live",
        heartbeat_at=NOW - 0.4,
        cpu_percent=12.0,
        rss_bytes=512 << 20,
        num_threads=9,
    )
    defaults.update(kw)
    return ProcessLive(role=role, kind=kind, pid=pid, stages=list(stages), **defaults)


def step(engine: int, step_id: int, decode: int, prefill: int, budget: int = 512, **kw) -> StepRecord:
    fields = dict(
        role=f"EngineCore_DP{engine}",
        pid=2000 + engine,
        seq=step_id,
        t=NOW - 0.1,
        engine_index=engine,
        step_id=step_id,
        started_at=NOW - 0.2 + step_id * 0.001,
        duration_ms=14.2,
        schedule_ms=0.6,
        execute_ms=13.1,
        update_ms=0.5,
        num_decode_reqs=decode,
        num_decode_tokens=decode,
        num_prefill_reqs=1 if prefill else 0,
        num_prefill_tokens=prefill,
        num_chunked_prefills=0,
        tokens_scheduled=decode + prefill,
        token_budget=budget,
        num_running=decode + (1 if prefill else 0),
        num_waiting=3,
        num_preempted=0,
        kv_usage=0.42,
    )
    fields.update(kw)
    return StepRecord(**fields)


def make_state() -> LiveState:
    """A -tp 2 -dp 2 server, 2 API servers, under load: one worker killed, one frozen,
    engine DP1 stuck in its busy loop while its heartbeat goes on."""
    p = {}
    for i in range(2):
        p[f"APIServer_{i}"] = _proc(
            f"APIServer_{i}", "api_server", 1000 + i, [],  # serving: no stage open between requests
            gauges={GAUGE_API_WAITING_FOR_ENGINE: 3.0 + i},
        )  # fmt: skip
    p["EngineCore_DP0"] = _proc(
        "EngineCore_DP0", "engine_core", 2000,
        [_stage("engine_core.step", 0.012, level="step")],
        last_step_at=NOW - 0.02, cpu_percent=98.0, rss_bytes=3 << 30, num_threads=14,
        gauges={GAUGE_INPUT_QUEUE: 2, GAUGE_WAITING: 3, GAUGE_RUNNING: 8, GAUGE_OUTPUT_QUEUE: 1,
                GAUGE_MQ_WRITTEN: 1520, "mq.read.0": 1520, "mq.read.1": 1517},
    )  # fmt: skip
    p["EngineCore_DP1"] = _proc(
        "EngineCore_DP1", "engine_core", 2001,
        [_stage("engine_core.step", 41.6, level="step"), _stage("executor.execute_model", 41.5, level="step")],
        last_step_at=NOW - 41.5, cpu_percent=0.0,
        waits=[WaitInfo(what="Worker_DP1_PP0_TP1 execute_model reply", started_at=NOW - 41.0, timeout_s=300.0)],
    )  # fmt: skip
    p["Worker_DP0_PP0_TP0"] = _proc(
        "Worker_DP0_PP0_TP0", "worker", 3000, [],
        last_step_at=NOW - 0.01, cpu_percent=100.0, rss_bytes=6 << 30,
        gauges={GAUGE_WORKER_THREADS: 1, GAUGE_WORKER_THREADS_MAX: 2},  # a core taken by another process
    )  # fmt: skip
    p["Worker_DP0_PP0_TP1"] = _proc(
        "Worker_DP0_PP0_TP1", "worker", 3001, state="dead", link="lost", heartbeat_at=NOW - 12.0,
        exit_description="killed by SIGKILL (exit status -9)",
    )  # fmt: skip
    p["Worker_DP1_PP0_TP0"] = _proc(
        "Worker_DP1_PP0_TP0", "worker", 3002, [_stage("worker.load_model", 0)],  # replaced below
        last_step_at=NOW - 41.6,
    )  # fmt: skip
    p["Worker_DP1_PP0_TP0"].stages = []  # idle: finished its step, waits for the next broadcast
    p["Worker_DP1_PP0_TP1"] = _proc(
        "Worker_DP1_PP0_TP1", "worker", 3003, [],
        state="stale", link="stale", heartbeat_at=NOW - 38.0, last_step_at=NOW - 80.0,
    )  # fmt: skip
    p["DPCoordinator"] = _proc("DPCoordinator", "dp_coordinator", 1500)

    steps = {
        0: deque(
            [
                step(0, 4410, decode=6, prefill=0),
                step(
                    0,
                    4411,
                    decode=128,
                    prefill=384,
                    scheduled_new_reqs=[
                        ScheduledRequest(
                            req_id="cmpl-c3",
                            num_scheduled_tokens=64,
                            num_computed_tokens=0,
                            num_new_blocks=4,
                            prefill=True,
                        )
                    ],
                    scheduled_cached_reqs=[
                        ScheduledRequest(
                            req_id="cmpl-a1",
                            num_scheduled_tokens=1,
                            num_computed_tokens=191,
                            num_new_blocks=1,
                        ),
                        ScheduledRequest(
                            req_id="cmpl-e5",
                            num_scheduled_tokens=320,
                            num_computed_tokens=320,
                            num_new_blocks=20,
                            prefill=True,
                        ),
                    ],
                ),
                step(0, 4412, decode=0, prefill=0, dummy=True),
            ]
        ),  # fmt: skip
        1: deque([step(1, 917, decode=30, prefill=100, num_preempted=2, kv_usage=0.93)]),
    }
    requests = {
        "cmpl-a1": RequestLive("cmpl-a1", "scheduled", 0, 200, 180, 12, 13, NOW - 5.0, NOW - 0.1),
        "cmpl-b2": RequestLive(
            "cmpl-b2", "preempted", 1, 900, 0, 40, 0, NOW - 42.0, NOW - 41.0, "KV cache full"
        ),
        "cmpl-c3": RequestLive("cmpl-c3", "arrived", 0, 64, -1, -1, -1, NOW - 0.3, NOW - 0.3),
    }
    queues = {
        f"EngineCore_DP0 {GAUGE_INPUT_QUEUE}": deque([0, 1, 3, 5, 2, 2]),
        f"EngineCore_DP0 {GAUGE_WAITING}": deque([0, 0, 1, 4, 3]),
        f"APIServer_0 {GAUGE_API_WAITING_FOR_ENGINE}": deque([1, 2, 3]),
    }
    alerts = [
        Alert(
            "error",
            "Worker_DP0_PP0_TP1",
            "Worker_DP0_PP0_TP1 (pid 28790) is dead: killed by SIGKILL (exit status -9)",
            hints.dead_hint(None),  # what the collector says of a process that wrote no crash report
        ),  # fmt: skip
        Alert(
            "warning",
            "EngineCore_DP1",
            "stage executor.execute_model open for 41.5s (usually < 0.1s)",
            "a worker does not answer the broadcast: look at the worker with the oldest heartbeat",
        ),  # fmt: skip
    ]
    return LiveState(
        run_dir=RUN_DIR, source="live", status="attached", mode="serve", model="Qwen/Qwen3-0.6B",
        tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=2, api_server_count=2,
        expected_count=9, found_count=8, started_at=NOW - 97.0, now=NOW, processes=p, queues=queues,
        steps=steps, requests=requests, alerts=alerts, events_received=12345, events_dropped=7,
    )  # fmt: skip


def render(renderable, width: int = 160, height: int | None = None) -> str:
    console = Console(record=True, width=width, height=height, color_system=None, force_terminal=False)
    console.print(renderable)
    return console.export_text()


def line_of(text: str, needle: str) -> str:
    """The first line that starts with ``needle`` (after a tree branch), else that holds it."""
    rows = text.splitlines()
    lines = [ln for ln in rows if ln.lstrip(" └").startswith(needle)] or [ln for ln in rows if needle in ln]
    assert lines, f"{needle!r} not on screen:\n{text}"
    return lines[0]


def _request_id(i: int) -> str:
    """An id as the API server makes them: ``cmpl-`` + 32 hex digits + ``-`` + the choice index."""
    return f"cmpl-{hashlib.sha256(str(i).encode()).hexdigest()[:32]}-0"


def dp_load_state() -> LiveState:
    """``glassbox serve -dp 2`` under 16 concurrent requests, as a fresh user watched it: 2 API
    servers, 2 engine cores each with its CPU worker (one core of its 2 taken by the other),
    a DP wave running, engine DP1 waiting for its worker's reply, requests just finished."""
    p: dict[str, ProcessLive] = {}
    for i in range(2):
        p[f"APIServer_{i}"] = _proc(f"APIServer_{i}", "api_server", 4100 + i, gauges={
            GAUGE_API_IN_FLIGHT: 8, GAUGE_API_WAITING_FOR_ENGINE: 1, GAUGE_API_PENDING_OUTPUTS: 0})  # fmt: skip
    for e in range(2):
        p[f"EngineCore_DP{e}"] = _proc(
            f"EngineCore_DP{e}", "engine_core", 4200 + e, [_stage("executor.execute_model", 0.4, level="step")],
            last_step_at=NOW - 0.05, cpu_percent=35.0, rss_bytes=700 << 20,
            waits=[WaitInfo(what=f"execute_model from Worker_DP{e}_PP0_TP0", started_at=NOW - 0.4, timeout_s=300.0)]
            if e == 1 else [],
            gauges={GAUGE_INPUT_QUEUE: 0, GAUGE_WAITING: 5 - e, GAUGE_RUNNING: 11 - e, GAUGE_OUTPUT_QUEUE: 0,
                    GAUGE_MQ_WRITTEN: 900, "mq.read.0": 900, GAUGE_KV_USED: 96, GAUGE_KV_TOTAL: 4095,
                    GAUGE_DP_WAVE: 1, GAUGE_DP_RUNNING: 1, GAUGE_DUMMY_STEPS: 3},
        )  # fmt: skip
        p[f"Worker_DP{e}_PP0_TP0"] = _proc(
            f"Worker_DP{e}_PP0_TP0", "worker", 4300 + e, last_step_at=NOW - 0.05, cpu_percent=100.0,
            rss_bytes=1300 << 20, gauges={GAUGE_WORKER_THREADS: 1, GAUGE_WORKER_THREADS_MAX: 2},
        )  # fmt: skip
    p["DPCoordinator"] = _proc("DPCoordinator", "dp_coordinator", 4150)
    requests = {}
    for i in range(16):
        rid = _request_id(i)
        requests[rid] = RequestLive(
            rid, "running", i % 2, 191, 191 + i, 1 + i, 13, NOW - 6.0 + i / 4, NOW - 0.1
        )
    for i in range(6):
        rid = _request_id(100 + i)
        requests[rid] = RequestLive(
            rid, "finished", i % 2, 191, 318, 128, 0, NOW - 6.9, NOW - 1.0 + i / 10, "length"
        )
    steps = {
        e: deque(step(e, 300 + k, decode=11 - e, prefill=0, budget=2048) for k in range(8)) for e in range(2)
    }
    queues = {
        f"EngineCore_DP{e} {g}": deque([1.0, 3.0, 5.0 - e])
        for e in range(2)
        for g in (GAUGE_WAITING, GAUGE_RUNNING)
    }
    return LiveState(
        run_dir="/run/user/1000/glassbox-4100-q7zk", source="live", status="attached", mode="serve",
        model="glassbox-tiny-llama", host="127.0.0.1", port=8000, tensor_parallel_size=1,
        pipeline_parallel_size=1, data_parallel_size=2, api_server_count=2, expected_count=7, found_count=7,
        started_at=NOW - 75.0, now=NOW, processes=p, queues=queues, steps=steps, requests=requests,
        events_received=48_210, events_sampled=13_377,
    )  # fmt: skip


def readme_state() -> LiveState:
    """README's picture: ``make run`` (the default tiny model, one API server, one engine, one
    CPU worker) while ``glassbox bench serve`` sends 12 requests at a time."""
    p = {
        "APIServer_0": _proc("APIServer_0", "api_server", 28748, cpu_percent=2.0, rss_bytes=97 << 20,
                             num_threads=11, heartbeat_at=NOW - 0.1,
                             gauges={GAUGE_API_IN_FLIGHT: 12, GAUGE_API_WAITING_FOR_ENGINE: 0,
                                     GAUGE_API_PENDING_OUTPUTS: 0}),
        "EngineCore_DP0": _proc("EngineCore_DP0", "engine_core", 28761, [_stage("engine_core.step", 0.004, "step")],
                                cpu_percent=9.0, rss_bytes=340 << 20, num_threads=10, heartbeat_at=NOW - 0.3,
                                last_step_at=NOW - 0.01,
                                gauges={GAUGE_INPUT_QUEUE: 0, GAUGE_WAITING: 0, GAUGE_RUNNING: 12,
                                        GAUGE_OUTPUT_QUEUE: 0, GAUGE_MQ_WRITTEN: 190, "mq.read.0": 190,
                                        GAUGE_KV_USED: 176, GAUGE_KV_TOTAL: 16383}),
        "Worker_DP0_PP0_TP0": _proc("Worker_DP0_PP0_TP0", "worker", 28772, cpu_percent=73.0, rss_bytes=1300 << 20,
                                    num_threads=7, heartbeat_at=NOW - 0.0, last_step_at=NOW - 0.01,
                                    gauges={GAUGE_WORKER_THREADS: 2, GAUGE_WORKER_THREADS_MAX: 2}),
    }  # fmt: skip
    requests = {}
    for i in range(12):
        rid = _request_id(1000 + i)
        out = 34 - 2 * i
        requests[rid] = RequestLive(rid, "running", 0, 200, 199 + out, out, 13 + out // 16, NOW - 2.7 + i / 15,
                                    NOW - 0.05)  # fmt: skip
    for i in range(2):
        rid = _request_id(2000 + i)
        requests[rid] = RequestLive(
            rid, "finished", 0, 200, 263, 64, 0, NOW - 4.2, NOW - 1.5 + i / 2, "length"
        )
    steps = {0: deque(step(0, 83 + k, decode=12, prefill=0, budget=2048, kv_usage=0.011,
                           duration_ms=9.6 + (k % 3) * 0.7, num_waiting=0) for k in range(12))}  # fmt: skip
    queues = {
        f"APIServer_0 {GAUGE_API_IN_FLIGHT}": deque([4.0, 12.0, 12.0, 12.0]),
        f"EngineCore_DP0 {GAUGE_RUNNING}": deque([2.0, 10.0, 12.0, 12.0]),
        f"EngineCore_DP0 {GAUGE_KV_USED}": deque([30.0, 150.0, 168.0, 176.0]),
    }
    return LiveState(
        run_dir="/run/user/1000/glassbox-28748-x6ia", source="live", status="attached", mode="serve",
        model="glassbox-tiny-llama", host="127.0.0.1", port=8000, tensor_parallel_size=1,
        pipeline_parallel_size=1, data_parallel_size=1, api_server_count=1, expected_count=3, found_count=3,
        started_at=NOW - 13.0, now=NOW, processes=p, queues=queues, steps=steps, requests=requests,
        events_received=2_113, events_sampled=466,
    )  # fmt: skip


# ------------------------------------------------------------------------------ processes


def make_starting_state() -> LiveState:
    """The same -tp 2 -dp 2 server 20 s into start-up: every process in a lifecycle stage."""
    state = make_state()
    stages = {
        "APIServer_0": ("api_server.attach", 14.0),
        "APIServer_1": ("api_server.attach", 13.2),
        "EngineCore_DP0": ("engine_core.initialize_kv_cache", 2.5),
        "EngineCore_DP1": ("executor.init", 18.0),
        "Worker_DP0_PP0_TP0": ("worker.initialize_kv_cache", 2.4),
        "Worker_DP0_PP0_TP1": ("worker.initialize_kv_cache", 2.3),
        "Worker_DP1_PP0_TP0": ("worker.load_model", 16.0),
        "Worker_DP1_PP0_TP1": ("worker.load_model", 75.0),
    }
    for role, proc in state.processes.items():
        proc.state, proc.link, proc.heartbeat_at, proc.last_step_at = "starting", "live", NOW - 0.3, None
        proc.exit_description, proc.waits = None, []
        name, ago = stages.get(role, (None, 0.0))
        proc.stages = [_stage(name, ago)] if name else []
    state.steps, state.requests, state.alerts, state.found_count = {}, {}, [], 9
    return state


def test_every_process_shows_with_its_stage_and_time_in_it():
    state = make_starting_state()
    text = render(views.render_processes(state))
    expect = {
        "APIServer_0": "api_server.attach 14s",
        "APIServer_1": "api_server.attach 13s",
        "EngineCore_DP0": "engine_core.initialize_kv_cache 2.5s",
        "EngineCore_DP1": "executor.init 18s",
        "Worker_DP0_PP0_TP0": "worker.initialize_kv_cache 2.4s",
        "Worker_DP0_PP0_TP1": "worker.initialize_kv_cache 2.3s",
        "Worker_DP1_PP0_TP0": "worker.load_model 16s",
        "Worker_DP1_PP0_TP1": "worker.load_model 1m15s",
    }
    for role, stage in expect.items():
        row = line_of(text, role)
        assert stage in row and "starting" in row, row
        assert str(state.processes[role].pid) in row
    assert "idle" not in line_of(text, "DPCoordinator") and "starting" in line_of(text, "DPCoordinator")
    assert "9/9 found" in render(views.render_header(state, views.ViewOptions()))


def test_serving_processes_show_step_stages_waits_and_idle():
    state = make_state()
    text = render(views.render_processes(state))
    assert "engine_core.step 0.0s" in line_of(text, "EngineCore_DP0")
    assert "executor.execute_model 42s" in line_of(text, "EngineCore_DP1")
    # a bounded wait is named on the line under its process, with how long of its deadline
    rows = text.splitlines()
    engine1 = rows.index(line_of(text, "EngineCore_DP1"))
    assert "⏳ waiting for Worker_DP1_PP0_TP1 execute_model reply: 41s of 5m00s" in rows[engine1 + 1]
    # between requests an API server has no stage open
    assert "idle" in line_of(text, "APIServer_0") and "idle" in line_of(text, "Worker_DP1_PP0_TP0")
    # CPU, RSS and threads of a live process
    row = line_of(text, "EngineCore_DP0")
    assert "98" in row and "3.0G" in row and "14" in row


def test_a_busy_process_between_two_stages_is_serving_not_idle():
    """Found by a student: under load engine-top called a worker at 73 % CPU, stepping every
    10 ms, "idle" (its stages last milliseconds, so a sample mostly falls between two), and
    an API server streaming 12 requests idle too."""
    state = make_state()
    worker, api = state.processes["Worker_DP1_PP0_TP0"], state.processes["APIServer_0"]
    worker.stages, worker.last_step_at = [], NOW - 0.2
    api.stages, api.gauges = [], {**api.gauges, GAUGE_API_IN_FLIGHT: 12}
    text = render(views.render_processes(state))
    assert "serving (between steps)" in line_of(text, "Worker_DP1_PP0_TP0")
    assert "serving 12 requests" in line_of(text, "APIServer_0")
    worker.last_step_at, api.gauges = NOW - 5.0, {**api.gauges, GAUGE_API_IN_FLIGHT: 0}
    text = render(views.render_processes(state))
    assert "idle" in line_of(text, "Worker_DP1_PP0_TP0") and "idle" in line_of(text, "APIServer_0")


def test_tree_puts_workers_under_their_engine_core():
    text = render(views.render_processes(make_state()))
    order = [
        "APIServer_0", "APIServer_1", "EngineCore_DP0", "Worker_DP0_PP0_TP0", "Worker_DP0_PP0_TP1",
        "EngineCore_DP1", "Worker_DP1_PP0_TP0", "Worker_DP1_PP0_TP1", "DPCoordinator",
    ]  # fmt: skip
    starts = [ln.lstrip(" └").split()[0] for ln in text.splitlines()[2:] if ln.lstrip(" └")[:1].isalpha()]
    positions = [starts.index(role) for role in order]
    assert positions == sorted(positions)
    assert "└ Worker_DP0_PP0_TP0" in text  # indented under its engine
    assert "└ EngineCore" not in text


def test_dead_process_shows_its_signal():
    row = line_of(render(views.render_processes(make_state())), "Worker_DP0_PP0_TP1")
    assert "dead" in row
    assert "killed by SIGKILL (exit status -9)" in row


def test_a_ray_actor_worker_shows_where_ray_placed_it():
    state = make_state()
    state.processes["Worker_DP0_PP0_TP0"].placement = {
        "node_id": "5f3e9a0c11223344", "node_ip": "10.0.0.5", "actor_id": "1a2b3c4d5e6f7788"}  # fmt: skip
    text = render(views.render_processes(state))
    lines = text.splitlines()
    row = next(i for i, ln in enumerate(lines) if "Worker_DP0_PP0_TP0" in ln)
    assert "placed as Ray actor 1a2b3c4d on node 10.0.0.5 (5f3e9a0c)" in lines[row + 1]
    assert "placed as" not in line_of(text, "Worker_DP0_PP0_TP1")  # an mp worker: nothing


def test_stale_heartbeat_is_marked_and_greyed():
    state = make_state()
    row = line_of(render(views.render_processes(state)), "Worker_DP1_PP0_TP1")
    assert "stale ⚠" in row
    assert "38s!" in row  # heartbeat age, flagged
    # greyed: the row's style in the rendered table
    console = Console(record=True, width=160, force_terminal=True, color_system="truecolor")
    console.print(views.render_processes(state))
    html = console.export_html(inline_styles=True)
    stale_row = next(ln for ln in html.splitlines() if "└ Worker_DP1_PP0_TP1" in ln)
    fresh_row = next(ln for ln in html.splitlines() if "└ Worker_DP0_PP0_TP0" in ln)
    assert "#808080" in stale_row and "#808080" not in fresh_row  # grey50


def test_stale_is_derived_from_heartbeat_age_too():
    state = make_state()
    state.processes["APIServer_1"].heartbeat_at = NOW - 9.0  # the collector has not flagged it yet
    assert "stale ⚠" in line_of(render(views.render_processes(state)), "APIServer_1")


def test_fresh_heartbeat_with_growing_step_age_is_visible():
    # EngineCore_DP1's heartbeat thread answers (0.4s) but its loop's last step is 41s old
    row = line_of(render(views.render_processes(make_state())), "EngineCore_DP1")
    assert "0.4s" in row and "42s" in row


# ------------------------------------------------------------------------------ steps


def test_budget_bar_splits_decode_and_prefill_in_proportion():
    bar = views.budget_bar(step(0, 1, decode=128, prefill=256, budget=512), width=32).plain
    assert len(bar) == 32
    assert bar == "█" * 8 + "▒" * 16 + "·" * 8  # 128/512·32 = 8 decode, 256/512·32 = 16 prefill
    full = views.budget_bar(step(0, 2, decode=0, prefill=512), width=20).plain
    assert full == "▒" * 20
    tiny = views.budget_bar(step(0, 3, decode=1, prefill=0, budget=8192), width=20).plain
    assert tiny == "█" + "·" * 19  # any token gets at least one cell
    assert "dummy" in views.budget_bar(step(0, 4, 0, 0, dummy=True), width=20).plain


def test_steps_table_shows_budget_kv_preemptions_and_time_split():
    state = make_state()
    text = render(views.render_steps(state, engine=0, bar_width=24))
    row = line_of(text, "4411")
    assert "█" * 6 + "▒" * 18 in row  # 128 decode + 384 prefill of 512 = 6 + 18 cells of 24
    assert "128+384/512" in row
    assert "42%" in row
    assert "14.2" in row and "0.6/13.1/0.5" in row
    dummy = line_of(text, "4412")
    assert "dummy" in dummy
    # newest first
    assert text.index("4412") < text.index("4411") < text.index("4410")
    one = render(views.render_steps(state, engine=1, bar_width=24))
    row = line_of(one, "917")
    assert "93%" in row and " 2 " in row  # KV usage, 2 preemptions
    assert "4411" not in one  # only engine DP1


def test_the_scheduled_panel_shows_each_requests_tokens_and_new_blocks():
    text = render(views.panel("scheduled", make_state(), views.ViewOptions(engine=0)))
    assert "step 4411: SchedulerOutput" in text  # the newest real step: 4412 is a dummy batch
    new = line_of(text, "cmpl-c3")
    assert (
        " new " in new
        and " 64 " in new
        and "prefill" in new
        and "0 → 64" in new
        and new.rstrip(" │").endswith("4")
    )
    decode = line_of(text, "cmpl-a1")
    assert " cached " in decode and "decode" in decode and "191 → 192" in decode
    assert "… 126 more scheduled" in text  # 129 requests, 3 listed


def test_a_pooling_request_shows_as_pooling_in_the_scheduled_panel():
    state = make_state()
    pooled = ScheduledRequest(req_id="embd-9", num_scheduled_tokens=40, num_computed_tokens=0, num_new_blocks=3,
                              prefill=True, pooling=True)  # fmt: skip
    state.steps[0].append(step(0, 4413, decode=0, prefill=40, scheduled_new_reqs=[pooled]))
    row = line_of(render(views.panel("scheduled", state, views.ViewOptions(engine=0)), width=200), "embd-9")
    assert " new " in row and " 40 " in row and "pooling" in row and "prefill" not in row


def test_an_empty_step_says_it_only_hands_finished_ids_to_the_workers():
    state = make_state()
    state.steps[0].append(step(0, 4413, decode=0, prefill=0, num_running=0, finished_req_ids=["cmpl-a1"]))
    text = render(views.panel("scheduled", state, views.ViewOptions(engine=0)), width=200)
    assert "nothing scheduled (0+0)" in text and "hands their finished_req_ids to the workers" in text
    assert "finished_req_ids (the workers forget them): cmpl-a1" in text
    assert "A 0+0 step after requests finish" in render(views.render_help(), width=500)


def test_the_step_delay_stands_apart_from_the_steps_own_time():
    state = make_state()
    state.steps[0].append(step(0, 4413, decode=3, prefill=0, step_delay_ms=200.0))
    text = render(views.render_steps(state, engine=0, bar_width=24))
    assert "+delay" in text.splitlines()[0]
    row = line_of(text, "4413")
    assert " 14.2 " in row and " 200 " in row  # its own 14.2 ms, then the 200 ms pause
    assert "+delay" not in render(views.render_steps(make_state(), engine=0))  # no flag: no column


def test_structured_output_steps_show_grammar_rows_and_waiting_grammars():
    state = make_state()
    assert "grammar" not in render(views.render_steps(state, engine=0))  # no grammar in view: no column
    state.steps[0].append(step(0, 4413, decode=5, prefill=0, num_structured_reqs=4, num_waiting_for_fsm=2,
                               bitmask_ms=1.3))  # fmt: skip
    text = render(views.render_steps(state, engine=0, bar_width=24))
    assert "grammar" in text.splitlines()[0]
    assert "4/2 · 1.3" in line_of(text, "4413")  # 4 sampled under a grammar, 2 wait for theirs, 1.3 ms
    assert " 0/0 " in line_of(text, "4411")
    assert "4/2" in line_of(render(views.render_steps(state, engine=0, compact=True)), "4413")
    # The queues panel has a "waiting grammar" row once a request waited so, not before.
    assert "waiting grammar" not in render(views.render_queues(state))
    state.processes["EngineCore_DP0"].gauges[GAUGE_WAITING_FOR_FSM] = 2
    assert " 2 " in line_of(render(views.render_queues(state)), "waiting grammar")
    assert "'grammar' S/F · M" in render(views.render_help(), width=500)  # the help says how to read it


def test_steps_of_all_engines_carry_the_engine_column():
    text = render(views.render_steps(make_state(), engine=None))
    assert "DP" in text.splitlines()[0]
    assert "917" in text and "4411" in text


# ------------------------------------------------------------------------------ queues, requests, alerts


def test_queues_show_depth_sparkline_and_broadcast_lag():
    text = render(views.render_queues(make_state()))
    row = line_of(text, "input_queue")
    assert " 2 " in row
    assert views.sparkline([0, 1, 3, 5, 2, 2]) in row
    assert views.sparkline([0, 1, 3, 5, 2, 2]) == " ▂▅█▃▃"
    lag = line_of(text, "broadcast lag")
    assert " 3 " in lag  # written 1520 − slowest reader 1517
    assert "→ engine core" in text
    threads = line_of(text, "threads (of 2)")  # the worker's governor, one core taken
    assert "Worker_DP0_PP0_TP0" in threads and " 1 " in threads


@pytest.mark.parametrize("width", [48, 64, 90])
def test_a_narrow_queues_panel_keeps_the_values_when_the_sparklines_are_full(width):
    """Found by a fresh user in tmux: once the sparklines held 24 samples, the "now" column
    was squeezed out of the panel and the values could not be read."""
    state = make_state()
    for key in list(state.queues):
        state.queues[key] = deque([float(i % 5) for i in range(60)], maxlen=60)
    state.queues["Worker_DP0_PP0_TP0 " + GAUGE_WORKER_THREADS] = deque([2.0] * 40 + [1.0] * 20, maxlen=60)
    text = render(views.render_queues(state), width=width)
    # Digits show only in the "now" column (the sparklines are block glyphs).
    assert re.search(r"\s2(\s|$)", line_of(text, "EngineCore_DP0")), text  # its input_queue: 2
    assert re.search(r"\s1(\s|$)", line_of(text, "Worker_DP0_PP0")), text  # 1 CPU thread


def test_requests_panel_filters_by_engine_and_sorts():
    state = make_state()
    text = render(views.render_requests(state, engine=None, sort="age"))
    assert text.index("cmpl-b2") < text.index("cmpl-a1") < text.index("cmpl-c3")  # oldest first
    row = line_of(text, "cmpl-a1")
    assert "180/212" in row and "13" in row and "5.0s" in row  # computed/total, blocks, age
    assert "KV cache full" in line_of(text, "cmpl-b2")
    only0 = render(views.render_requests(state, engine=0, sort="id"))
    assert "cmpl-b2" not in only0
    assert only0.index("cmpl-a1") < only0.index("cmpl-c3")


def test_requests_in_flight_come_before_the_recently_finished():
    """Found by a fresh user under load: finished requests (kept a few seconds, oldest first)
    filled the panel and pushed the ones still running out of sight."""
    state = make_state()
    for i in range(6):
        rid = f"cmpl-done{i}"
        state.requests[rid] = RequestLive(rid, "finished", 0, 64, 128, 64, 0, NOW - 9.0 + i, NOW - 1.0)
    text = render(views.render_requests(state, engine=None, sort="age", max_rows=5))
    assert "cmpl-b2" in text and "cmpl-a1" in text and "cmpl-c3" in text  # every live one shows
    assert text.index("cmpl-c3") < text.index("finished in the last 5s: 6 (5 not shown)")
    assert "cmpl-done0" in text  # the one finished row that fits


def loaded_state() -> LiveState:
    """Under a 16-request load, at 2,000 request events a second: real request ids; live
    requests in every state; five just finished; one aborted as the engine died (its reason
    as an older API server recorded it: a Python repr, root cause and all)."""
    state = make_state()
    state.requests = {}
    live = [
        "first_token",
        "scheduled",
        "running",
        "waiting",
        "preempted",
        "running",
        "first_token",
        "arrived",
    ]
    for i in range(16):
        rid = f"cmpl-{i:02d}8e7d6c5b4a39281706f5e4d3c2b1a0-0"
        st = live[i % len(live)]
        computed = {"arrived": -1, "waiting": 0, "preempted": 0}.get(st, 128 + i)
        state.requests[rid] = RequestLive(rid, st, i % 2, 128, computed, i, 9, NOW - 20.0 + i, NOW - 0.2,
                                          "KV cache full" if st == "preempted" else None)  # fmt: skip
    for i in range(5):
        rid = f"cmpl-f{i}8e7d6c5b4a39281706f5e4d3c2b1a0-0"
        state.requests[rid] = RequestLive(
            rid, "finished", 0, 128, 143, 16, 0, NOW - 3.0, NOW - 1.0 + i / 10, "length"
        )
    dead = "EngineDeadError('The engine died; see the root cause below.\\n=== EngineCore_DP0 (pid 2000) ===')"
    state.requests["cmpl-dead"] = RequestLive(
        "cmpl-dead", "aborted", 0, 128, 131, 3, 9, NOW - 2.0, NOW - 0.5, dead
    )
    return state


STATE_WORDS = (
    "first_token",
    "scheduled",
    "running",
    "waiting",
    "preempted",
    "arrived",
    "finished",
    "aborted",
)


def _requests_lines(text: str) -> list[str]:
    """The requests panel's lines (the right half of a side-by-side screen), border cut off."""
    out = []
    for line in text.splitlines():
        for part in line.split("││"):
            part = part.strip("│ ")
            if part.startswith(("cmpl-", "request ", "finished in the last")):
                out.append(part)
    return out


@pytest.mark.parametrize("width", [100, 120])
@pytest.mark.parametrize("where", ["screen", "expanded", "once"])
def test_requests_panel_reads_whole_at_100_and_120_columns(width, where):
    """Found by a user at 120 columns: the requests panel cut its headers to "computed/t…"
    and "b…" and its states to "fini…". Headers, state words and token counts must read
    whole at 100-120 columns (only an id, from its end, or a reason is ever cut)."""
    state = loaded_state()
    if where == "once":
        text = render(views.panel("requests", state, views.ViewOptions(), width=width, wrap=True), width)
    else:
        opts = views.ViewOptions(expanded="requests" if where == "expanded" else None)
        text = render(views.render_screen(state, opts, width, 50), width, 50)
    lines = _requests_lines(text)
    (head,) = [ln for ln in lines if ln.startswith("request ")]
    words = head.split()
    assert "…" not in head and words[:2] == ["request", "state"], head
    assert words[-1] == "age" and ("computed" in words or "computed/total" in words), head
    assert "KV" in words or "blocks" in words, head
    rows = [ln for ln in lines if ln.startswith("cmpl-")]
    assert len(rows) >= 4, text
    for row in rows:
        cells = row.split()
        assert any(w in row for w in STATE_WORDS), row  # the state word whole
        assert any(re.fullmatch(r"(—|\d+)/\d+", c) for c in cells), row  # computed/total whole
        assert re.fullmatch(r"[\dsmh.]+", cells[-1]), row  # the age whole
    first = next(r for r in rows if "first_token" in r)
    assert re.search(r"\b1\d\d/1\d\d\b", first), first


def _panel_lines(text: str, title: str) -> list[str]:
    """The lines inside the panel titled ``title`` (left or right of a side-by-side screen, or
    alone), without its border."""
    out, inside, side = [], False, 0
    for line in text.splitlines():
        parts = line.split("││") if "││" in line or "╮╭" in line else [line]
        if "╮╭" in line:
            parts = line.split("╮╭")
        if not inside:
            for i, part in enumerate(parts):
                if part.lstrip("╭").startswith(f"─ {title}"):
                    inside, side = True, i
            continue
        part = parts[side] if side < len(parts) else ""
        if part.lstrip().startswith("╰") or part.rstrip().endswith("╯"):
            break
        out.append(part.strip("│ "))
    return out


QUEUE_VALUES = {  # dp_load_state()'s engine DP0 and its worker, and each API server
    "HTTP in flight": "8", "→ engine core": "1", "to stream": "0", "input_queue": "0", "waiting": "5",
    "running": "11", "output_queue": "0", "broadcast lag": "0", "KV blocks": "96", "DP wave (runs)": "1",
    "dummy steps": "3", "threads (of 2)": "1",
}  # fmt: skip


@pytest.mark.parametrize("width", [100, 120])
@pytest.mark.parametrize("where", ["screen", "expanded"])
def test_queue_labels_read_whole_at_100_and_120_columns(width, where):
    """Found by a fresh user against ``serve -dp 2`` under load, at 100 and 120 columns: both
    scheduler rows read "schedule…", so waiting and running could not be told apart, and
    "KV block…", "DP wave 1 …", "HTTP in …", "… 8 more (…" were cut too. Every label, process
    name and value reads whole, and so does the "… N more" line."""
    opts = views.ViewOptions(expanded="queues" if where == "expanded" else None)
    text = render(views.render_screen(dp_load_state(), opts, width, 60), width, 60)
    lines = [ln for ln in _panel_lines(text, "queues") if ln and not ln.startswith(("process ", "─"))]
    for line in lines:
        assert "…" not in line or re.fullmatch(r"… \d+ more \(e: expand\)", line), text
    for label, value in QUEUE_VALUES.items():
        assert any(re.search(rf"(^|\s){re.escape(label)}\s+{value}(\s|$)", ln) for ln in lines), (label, text)
    assert any(ln.startswith("Worker_DP0_PP0_TP0 ") for ln in lines), text
    if where == "expanded":  # all of them: engine DP1's too
        dp1 = lines[next(i for i, ln in enumerate(lines) if ln.startswith("EngineCore_DP1 ")) :]
        assert re.search(r"waiting\s+4\b", "\n".join(dp1)) and re.search(r"running\s+10\b", "\n".join(dp1))
    else:
        assert re.fullmatch(r"… \d+ more \(e: expand\)", lines[-1]), text


@pytest.mark.parametrize("width", [100, 120])
def test_header_lines_read_whole_at_100_and_120_columns(width):
    """Found by a user at 100 columns: the header's first line read "API servers…" with ~16
    columns to spare, as another line's long right part set a shared column's width."""
    text = render(views.render_screen(dp_load_state(), views.ViewOptions(), width, 50), width, 50)
    first, second, third = (ln.strip("│ ") for ln in text.splitlines()[1:4])
    assert "…" not in first + second + third, text
    assert first.startswith("engine-top  glassbox-tiny-llama  TP=1 PP=1 DP=2  API servers=2 ")
    assert first.endswith("LIVE  refresh 0.5s")
    assert second.endswith("events 48,210 · sampled out 13,377") and "7/7 found" in second
    assert "serve on 127.0.0.1:8000 · run dir /run/user/1000/glassbox-4100-q7zk" in third


@pytest.mark.parametrize("width", [100, 120])
@pytest.mark.parametrize("in_flight", [0, 2])
def test_finished_requests_read_whole_under_the_column_headers(width, in_flight):
    """Found by a user at 100 columns: the finished rows had no column header (nothing in
    flight above them) and a cut reason, "finished: …  0  318/319  0 6.9s"."""
    state = dp_load_state()
    live = [rid for rid, r in state.requests.items() if r.state == "running"]
    for rid in live[in_flight:]:
        del state.requests[rid]
    text = render(views.render_screen(state, views.ViewOptions(), width, 50), width, 50)
    lines = _requests_lines(text)
    (head,) = [ln for ln in lines if ln.startswith("request ")]
    assert head.split()[:2] == ["request", "state"] and head.split()[-1] == "age", text
    done = [ln for ln in lines if ln.startswith("cmpl-") and "finished" in ln]
    assert len(done) >= 4 and lines.index(head) < lines.index(done[0]), text
    for row in done:
        assert "finished: length" in row and " 318/319 " in row and row.endswith(" 6.9s"), row
    assert len([ln for ln in lines if ln.startswith("cmpl-") and " running " in ln]) == in_flight


@pytest.mark.parametrize("width", [100, 120])
def test_a_wait_reads_whole_under_its_process_at_100_and_120_columns(width):
    """Found by a user at 120 columns: the engine core's wait line, in the stage column,
    read "⏳ waiting for execute_model from Worke…". It now runs across the panel under its
    process, and the panel grows by its line (the last process still shows)."""
    text = render(views.render_screen(dp_load_state(), views.ViewOptions(), width, 50), width, 50)
    rows = _panel_lines(text, "processes")
    engine1 = rows.index(line_of("\n".join(rows), "EngineCore_DP1"))
    assert rows[engine1 + 1] == "⏳ waiting for execute_model from Worker_DP1_PP0_TP0: 0.4s of 5m00s"
    assert rows[-1].startswith("DPCoordinator ") and "└ Worker_DP1_PP0_TP0" in rows[-2]


def test_finished_requests_stand_apart_from_those_in_flight():
    """Found by a user under load: a panel titled "in flight" listed finished rows while
    the API server's "HTTP in flight" said 16. The title counts the ones in flight; the
    finished come after them, under a line of their own, newest first."""
    state = loaded_state()
    text = render(views.panel("requests", state, views.ViewOptions(), width=120, wrap=True), 120)
    assert "requests · 16 in flight, 6 finished" in text
    lines = text.splitlines()
    section = next(i for i, ln in enumerate(lines) if "finished in the last 5s: 6" in ln)
    above, below = "\n".join(lines[:section]), "\n".join(lines[section:])
    assert "finished" not in above.replace("6 finished", "") and "aborted" not in above
    assert below.count("finished: length") == 5 and "aborted" in below
    assert not any(w in below for w in STATE_WORDS[:6])  # nothing in flight down there
    ids = [ln.split("│")[1].split()[0] for ln in lines[section + 1 :] if "cmpl-f" in ln]
    assert ids[0].startswith("cmpl-f4") and ids[-1].startswith("cmpl-f0")  # newest first


def test_an_aborted_request_after_the_engine_died_reads_in_plain_words():
    """Found by a user: after an engine death rows showed raw Python, "aborted
    (EngineDeadError('The engine died; see the root cause below.\\n=". The API server now
    says "engine died", and a recording with the old repr reads the same."""
    from engine.frontend.async_llm import abort_reason
    from engine.utils.processes import EngineDeadError

    assert (
        abort_reason(EngineDeadError("=== EngineCore_DP0 (pid 2000) ===\nkilled by SIGKILL")) == "engine died"
    )
    assert abort_reason(ValueError("bad\nsecond line")) == "ValueError: bad"
    state = loaded_state()
    state.requests["cmpl-dead2"] = RequestLive("cmpl-dead2", "aborted", 0, 128, 0, 0, 0, NOW - 1.0, NOW - 0.4,
                                               abort_reason(EngineDeadError("root cause")))  # fmt: skip
    for width in (100, 120):
        text = render(views.panel("requests", state, views.ViewOptions(), width=width, wrap=True), width)
        assert line_of(text, "cmpl-dead ").count("aborted: engine died") == 1
        assert "aborted: engine died" in line_of(text, "cmpl-dead2")
        assert "EngineDeadError" not in text and "\\n" not in text and "root cause" not in text


def test_finished_and_first_token_rows_show_their_true_computed_counts():
    """Found by a user: finished and first-token rows showed 0/128 computed — the counts of
    the scheduled event, as the once-a-second snapshot never saw a short request. The
    finished event carries the final counts, first_token the prompt computed; events from
    the API server and the engine core arrive in any order, and a late one never undoes
    the end."""
    from tracing.telemetry.events import RequestEvent

    def ev(role: str, seq: int, rid: str, event: str, **kw) -> RequestEvent:
        return RequestEvent(role=role, pid=1000 if role.startswith("API") else 2000, seq=seq, t=NOW - 1 + seq / 100,
                            request_id=rid, event=event, **kw)  # fmt: skip

    state = LiveState(now=NOW)
    for e in (
        ev("APIServer_0", 0, "cmpl-a", "arrived", num_prompt_tokens=128),
        ev("APIServer_0", 1, "cmpl-b", "arrived", num_prompt_tokens=128),
        ev("EngineCore_DP0", 0, "cmpl-a", "scheduled", engine_index=0, num_prompt_tokens=128,
           num_computed_tokens=0, num_blocks=8),
        ev("EngineCore_DP0", 1, "cmpl-b", "scheduled", engine_index=0, num_prompt_tokens=128,
           num_computed_tokens=0, num_blocks=8),
        ev("EngineCore_DP0", 2, "cmpl-a", "finished", engine_index=0, reason="length", num_prompt_tokens=128,
           num_computed_tokens=143, num_output_tokens=16, num_blocks=0),
        # the API server's first_token for cmpl-a comes after the engine's finished
        ev("APIServer_0", 2, "cmpl-a", "first_token", num_prompt_tokens=128, num_computed_tokens=128,
           num_output_tokens=1),
        ev("APIServer_0", 3, "cmpl-b", "first_token", num_prompt_tokens=128, num_computed_tokens=128,
           num_output_tokens=1),
        ev("EngineCore_DP0", 3, "cmpl-b", "preempted", engine_index=0, reason="KV cache full",
           num_computed_tokens=0),
    ):  # fmt: skip
        state.apply(e)
    a, b = state.requests["cmpl-a"], state.requests["cmpl-b"]
    assert (a.state, a.num_computed_tokens, a.num_output_tokens, a.reason) == ("finished", 143, 16, "length")
    assert (b.state, b.num_computed_tokens, b.num_output_tokens) == ("preempted", 0, 1)
    text = render(views.panel("requests", state, views.ViewOptions(), width=120, wrap=True), 120)
    assert "143/144" in line_of(text, "cmpl-a") and "finished: length" in line_of(text, "cmpl-a")
    assert "0/129" in line_of(text, "cmpl-b")  # preempted: it recomputes from 0
    state.apply(ev("APIServer_0", 4, "cmpl-c", "arrived", num_prompt_tokens=64))
    state.apply(ev("EngineCore_DP0", 4, "cmpl-c", "scheduled", engine_index=0, num_prompt_tokens=64,
                   num_computed_tokens=0))  # fmt: skip
    state.apply(ev("APIServer_0", 5, "cmpl-c", "first_token", num_prompt_tokens=64, num_computed_tokens=64,
                   num_output_tokens=1))  # fmt: skip
    row = line_of(
        render(views.panel("requests", state, views.ViewOptions(), width=120, wrap=True), 120), "cmpl-c"
    )
    assert "first_token" in row and "64/65" in row


def kv_state() -> LiveState:
    """One engine core as its snapshot reports it: "cmpl-b" reused the 2 blocks of the
    prefix it shares with "cmpl-a" (ids 1 and 2), "cmpl-c" waits, preempted; 3 freed blocks
    still hold a prefix (cached), the rest are empty."""
    progress = [
        RequestProgress(request_id="cmpl-a", state="running", engine_index=0, num_prompt_tokens=40,
                        num_computed_tokens=44, num_output_tokens=5, num_blocks=3, arrived_at=NOW - 3.0,
                        block_ids=[1, 2, 3]),
        RequestProgress(request_id="cmpl-b", state="running", engine_index=0, num_prompt_tokens=38,
                        num_computed_tokens=38, num_output_tokens=1, num_blocks=3, arrived_at=NOW - 2.0,
                        block_ids=[1, 2, 7]),
        RequestProgress(request_id="cmpl-c", state="waiting", engine_index=0, num_prompt_tokens=30,
                        num_computed_tokens=0, num_output_tokens=0, num_blocks=0, arrived_at=NOW - 1.0),
    ]  # fmt: skip
    gauges = {GAUGE_KV_TOTAL: 15, GAUGE_KV_FREE: 11, GAUGE_KV_USED: 4, GAUGE_KV_CACHED: 3,
              GAUGE_PREFIX_HIT_RATE: 32 / 78, GAUGE_PREEMPTED: 1}  # fmt: skip
    state = LiveState(run_dir=RUN_DIR, now=NOW, mode="serve", data_parallel_size=1)
    state.processes["EngineCore_DP0"] = _proc("EngineCore_DP0", "engine_core", 2000)  # its heartbeat said so
    state.apply(Snapshot(role="EngineCore_DP0", pid=2000, seq=1, t=NOW - 0.5, stages=[], gauges=gauges,
                         requests=progress))  # fmt: skip
    return state


def test_kv_panel_shows_the_pool_and_which_request_holds_which_blocks():
    text = render(views.panel("kv", kv_state(), views.ViewOptions(), width=120), width=120)
    assert "4 used · 3 cached · 8 empty of 15 blocks" in text
    assert "prefix hits 41.0% · preemptions 1" in text
    assert re.search(r"cmpl-a\s+running\s+3\s+1-3\b", line_of(text, "cmpl-a"))
    assert re.search(r"cmpl-b\s+running\s+3\s+1-2 7\b", line_of(text, "cmpl-b"))
    assert "cmpl-c" not in text  # holds no block
    # the first block is shared: a holder list is sorted by it, a in front of b
    assert text.index("cmpl-a") < text.index("cmpl-b")


def test_a_finished_request_leaves_the_kv_panel_at_once():
    state = kv_state()
    state.apply(RequestEvent(role="EngineCore_DP0", pid=2000, seq=2, t=NOW - 0.2, request_id="cmpl-b",
                             event="finished", engine_index=0, reason="length", num_blocks=0))  # fmt: skip
    text = render(views.panel("kv", state, views.ViewOptions(), width=120), width=120)
    assert "cmpl-b" not in text and "cmpl-a" in text


def test_block_runs():
    assert views.block_runs([1, 2, 3, 7, 9, 10]) == "1-3 7 9-10"
    assert views.block_runs([5, 4]) == "5 4"  # table order, not sorted
    assert views.block_runs([]) == ""


def test_queues_panel_has_the_prefix_cache_rows():
    text = render(views.panel("queues", kv_state(), views.ViewOptions(), width=120), width=120)
    assert re.search(r"KV cached\s+3\b", text)
    assert re.search(r"prefix hit %\s+41\b", text)


def moe_state() -> LiveState:
    """``-dp 2 --enable-expert-parallel`` on the bundled mixture of experts (4 experts, 2 per
    rank), as its two workers' snapshots report it (the figures of a recorded run): engine 0
    served the requests, engine 1 ran dummy batches — yet its experts took rows from engine 0's
    tokens, and its all-to-alls waited for engine 0's longer forwards."""
    state = LiveState(run_dir=RUN_DIR, now=NOW, mode="serve", data_parallel_size=2)
    figures = {
        "Worker_DP0_PP0_TP0": (0, {0: 5120.0, 1: 4860.0}, 96.0, 1.9, 0.8, 4.0),
        "Worker_DP1_PP0_TP0": (2, {2: 5540.0, 3: 4950.0}, 104.0, 7.5, 2.3, 4.1),
    }
    for i, (role, (first, rows, last, a2a_ms, a2a_s, fwd_s)) in enumerate(figures.items()):
        gauges = {GAUGE_MOE_NUM_EXPERTS: 4, GAUGE_MOE_FIRST_EXPERT: first, GAUGE_MOE_LOCAL_EXPERTS: 2,
                  GAUGE_MOE_STEP_ROWS: last, GAUGE_MOE_A2A_MS: a2a_ms, GAUGE_MOE_A2A_TOTAL_S: a2a_s,
                  GAUGE_MOE_FORWARD_TOTAL_S: fwd_s, **{moe_expert_gauge(e): n for e, n in rows.items()}}  # fmt: skip
        state.processes[role] = _proc(role, "worker", 3000 + i)
        state.apply(Snapshot(role=role, pid=3000 + i, seq=1, t=NOW - 0.5, stages=[], gauges=gauges))
    return state


def test_the_experts_panel_shows_each_ranks_experts_their_load_and_the_all_to_all_wait():
    text = render(views.panel("experts", moe_state(), views.ViewOptions(), width=120), width=120)
    row0, row1 = line_of(text, "Worker_DP0_PP0_TP0"), line_of(text, "Worker_DP1_PP0_TP0")
    assert re.search(r"0-1 of 4\s+e0 51%  e1 49%\s+██···\s+49%\s+96\s+1\.9 · 20%", row0), row0
    assert re.search(r"2-3 of 4\s+e2 53%  e3 47%\s+███··\s+51%\s+104\s+7\.5 · 56%", row1), row1
    assert "experts · DP1" in render(
        views.panel("experts", moe_state(), views.ViewOptions(engine=1)), width=120
    )
    narrow = render(views.panel("experts", moe_state(), views.ViewOptions(), width=80), width=80)
    assert "e2 53%  e3 47%" in line_of(narrow, "Worker_DP1_PP0_TP0")  # reads whole at 80 columns
    only_dp1 = render(views.render_experts(moe_state(), engine=1), width=120)
    assert "Worker_DP0" not in only_dp1 and "Worker_DP1_PP0_TP0" in only_dp1


def test_queues_show_each_ranks_expert_rows_and_all_to_all_time_and_once_shows_the_experts():
    state = moe_state()
    text = render(views.panel("queues", state, views.ViewOptions(), width=120), width=120)
    assert re.search(r"Worker_DP1_PP0_TP0\s+expert rows \(2-3 of 4\)\s+104\b", text), text
    assert re.search(r"all-to-all ms\s+8\b", text), text  # 7.5 ms, as the queues round
    assert "moe." not in text  # the raw gauges are not queues
    assert "experts · all engines" in render(views.render_once(state), width=120)
    assert "experts ·" not in render(views.render_once(make_state()), width=120)  # a dense model: no panel


def test_stuck_stage_alert_with_its_hint():
    text = render(views.render_alerts(make_state()), width=200)
    assert "EngineCore_DP1: stage executor.execute_model open for 41.5s" in text
    assert "hint: a worker does not answer the broadcast" in text
    assert text.index("ERROR") < text.index("WARN")  # errors first


def test_an_injected_fault_is_an_alert_at_once_with_the_stages_hint():
    """From a heartbeat's ``faults`` (or the status file's): an error while the process is
    still in the struck stage, a fading warning once it left, gone after FAULT_ALERT_S."""
    from tracing.telemetry.collector import FAULT_ALERT_S, compute_alerts
    from tracing.telemetry.events import StruckFaultInfo

    spec = "worker.determine_available_memory:hang@Worker_DP0_PP0_TP0"
    fault = StruckFaultInfo(
        spec=spec, stage="worker.determine_available_memory", kind="hang", struck_at=NOW - 2
    )
    worker = _proc("Worker_DP0_PP0_TP0", "worker", 3001, [_stage("worker.determine_available_memory", 2.5)],
                   state="starting", faults=[fault])  # fmt: skip
    state = LiveState(now=NOW, processes={worker.role: worker})
    (alert,) = [a for a in compute_alerts(state) if "injected" in a.message]
    assert (alert.severity, alert.role) == ("error", "Worker_DP0_PP0_TP0")
    assert alert.message == f"injected hang struck in worker.determine_available_memory 2.0 s ago ({spec})"
    assert alert.hint.startswith("worker.determine_available_memory: the profile run")
    state.alerts = compute_alerts(state)
    text = render(views.render_alerts(state), width=200)
    assert "ERROR Worker_DP0_PP0_TP0: injected hang struck in worker.determine_available_memory" in text
    worker.stages = []  # a slow fault: the stage was left
    assert [a.severity for a in compute_alerts(state) if "injected" in a.message] == ["warning"]
    state.now = NOW + FAULT_ALERT_S + 5
    assert not [a for a in compute_alerts(state) if "injected" in a.message]


# ------------------------------------------------------------------------------ header and screens


def test_header_expected_vs_found_and_links():
    state = make_state()
    text = render(views.render_header(state, views.ViewOptions()))
    assert "8/9 found (1 missing)" in text
    assert "TP=2 PP=1 DP=2" in text and "API servers=2" in text
    assert "Qwen/Qwen3-0.6B" in text
    assert "uptime 1m37s" in text
    assert "7 live" in text and "1 stale" in text
    assert "LIVE" in text and "events 12,345" in text
    paused = render(views.render_header(state, views.ViewOptions(paused=True)))
    assert "PAUSED" in paused
    state.source = "replay"
    assert "REPLAY" in render(views.render_header(state, views.ViewOptions()))


def test_header_tells_sampled_out_events_from_lost_ones():
    """Found by a user: "events 5795 (dropped 33013)" read as a fault, though it was sampling.
    The publishers' Dropped reports split it: sampled out on purpose (dim) and truly lost (a
    full socket), each counted apart."""
    from tracing.telemetry.events import Dropped

    state = make_state()
    state.events_received = 5_795
    state.apply(Dropped(role="EngineCore_DP0", pid=2000, seq=10, t=NOW, counts={"step": 33_000, "stage": 13},
                        sampled={"step": 33_000, "stage": 13}))  # fmt: skip
    line = line_of(render(views.render_header(state, views.ViewOptions())), "processes")
    assert "events 5,796 · sampled out 33,013" in line and "lost" not in line and "dropped" not in line
    state.apply(Dropped(role="APIServer_0", pid=1000, seq=10, t=NOW, counts={"request": 12, "stage": 4},
                        refused={"request": 12}, sampled={"stage": 4}))  # fmt: skip
    line = line_of(render(views.render_header(state, views.ViewOptions())), "processes")
    assert "events 5,797 · sampled out 33,017 · lost 12" in line
    assert (state.events_refused, state.processes["APIServer_0"].lost_events) == (12, 12)


def test_once_screen_has_every_panel():
    text = render(views.render_once(make_state()), width=140)
    for title in ("processes", "queues", "scheduler steps", "SchedulerOutput", "requests · 3 in flight",
                  "alerts (2)"):  # fmt: skip
        assert title in text
    assert "█ decode" in text and "▒ prefill" in text


def test_full_screen_layout_renders_every_size_and_mode():
    state = make_state()
    for width, height in ((80, 24), (120, 40), (200, 60)):
        console = Console(record=True, width=width, height=height, color_system=None)
        for opts in (views.ViewOptions(), views.ViewOptions(expanded="steps", engine=1),
                     views.ViewOptions(show_help=True), views.ViewOptions(notice="instance gone")):  # fmt: skip
            console.print(views.render_screen(state, opts, width, height))
    text = console.export_text()
    assert "engine-top keys" in text and "instance gone" in text


def test_empty_state_renders_without_error():
    text = render(views.render_once(LiveState(now=NOW)))
    assert "no process seen yet" in text and "no alerts" in text


# ------------------------------------------------------------------------------ the docs' pictures

REPO = Path(__file__).resolve().parents[3]
README_SIZE = (100, 44)  # README's picture: the live screen of a 100 × 44 terminal
DOCS_WIDTH = 120  # docs/engine-top.md's: `engine-top --once`, 120 columns (not a terminal)


def docs_state() -> LiveState:
    """docs/engine-top.md's picture: ``make_state()`` with one request just finished, and
    events sampled out by the publishers."""
    state = make_state()
    state.requests["cmpl-d4"] = RequestLive(
        "cmpl-d4", "finished", 0, 96, 111, 16, 0, NOW - 2.5, NOW - 0.5, "length"
    )
    state.events_sampled = 4_210
    return state


def pictures() -> dict[Path, str]:
    """What README's and docs/engine-top.md's engine-top pictures must show, as the real
    renderer draws them from the made-up states above (each line without trailing blanks)."""
    width, height = README_SIZE
    readme = render(views.render_screen(readme_state(), views.ViewOptions(), width, height), width, height)
    docs = render(views.render_once(docs_state(), views.ViewOptions(), DOCS_WIDTH), DOCS_WIDTH)
    return {REPO / "README.md": readme, REPO / "docs" / "engine-top.md": docs}


def _picture_span(doc: str) -> tuple[int, int]:
    """Where the engine-top picture is in ``doc``: its one text block drawn from "╭─ glassbox"."""
    start = doc.index("```text\n╭─ glassbox") + len("```text\n")
    return start, doc.index("```", start)


def _plain(picture: str) -> str:
    return "".join(line.rstrip() + "\n" for line in picture.rstrip("\n").splitlines())


def test_the_readme_and_docs_pictures_are_what_engine_top_draws():
    """Found by a fresh user: README's picture no longer matched the real screen (queues and
    requests side by side, DP and KV columns). Both pictures are drawn by ``tui.views``."""
    assert "in a {} × {} terminal".format(*README_SIZE) in (REPO / "README.md").read_text()
    for path, picture in pictures().items():
        doc = path.read_text()
        start, end = _picture_span(doc)
        assert doc[start:end] == _plain(picture), (
            f"{path.name}'s picture is not what engine-top draws: run python tests/unit/tui/test_engine_top_views.py"
        )


# ------------------------------------------------------------------------------ keys


def test_parse_keys():
    assert parse_keys(b"q") == ["q"]
    assert parse_keys(b"\t3 s") == ["tab", "3", " ", "s"]
    assert parse_keys(b"\x1b") == ["esc"]
    assert parse_keys(b"\x1b[A+") == ["up", "+"]


def test_keys_change_the_view():
    app = App(open_live=lambda p: None)
    app.state = make_state()
    app.handle_key("tab")
    assert app.opts.engine == 0
    app.handle_key("tab")
    app.handle_key("tab")
    assert app.opts.engine is None  # all → DP0 → DP1 → all
    app.handle_key("1")
    assert app.opts.engine == 1
    app.handle_key("s")
    assert app.opts.request_sort == "state"
    app.handle_key("e")
    assert app.opts.expanded == "processes"
    app.handle_key("esc")
    assert app.opts.expanded is None
    app.handle_key(" ")
    assert app.opts.paused
    app.handle_key("+")
    assert app.opts.refresh_s == 0.25
    app.handle_key("-")
    app.handle_key("-")
    assert app.opts.refresh_s == 1.0
    app.handle_key("q")
    assert app.quit


def test_paused_app_keeps_the_frozen_state():
    class Fake:
        def __init__(self):
            self.n = 0

        def snapshot(self):
            self.n += 1
            return LiveState(now=NOW + self.n)

        def close(self):
            pass

    app = App(replay=None)
    app.collector, app.attached, app._next_scan = Fake(), None, float("inf")
    app.poll()
    first = app.state
    app.handle_key(" ")
    app.poll()
    assert app.state is first
    app.handle_key(" ")
    app.poll()
    assert app.state is not first


class FakeCollector:
    def __init__(self, state: LiveState):
        self.state, self.stopped = state, False

    def snapshot(self) -> LiveState:
        return self.state

    def stop(self) -> None:
        self.stopped = True


def test_picker_lists_instances_and_a_digit_attaches():
    picking = LiveState(status="choose", candidates=["/tmp/glassbox-1-a", "/tmp/glassbox-2-b"], now=NOW)
    opened: list = []

    def open_live(run_dir, base):
        opened.append(run_dir)
        return FakeCollector(picking if run_dir is None else make_state())

    app = App(open_live=open_live)
    app.poll()
    text = render(app.render(120, 40))
    assert "several Glassbox instances run" in text and "/tmp/glassbox-2-b" in text
    first = app.collector
    app.handle_key("2")
    assert opened == [None, Path("/tmp/glassbox-2-b")] and first.stopped
    app.poll()
    assert "EngineCore_DP0" in render(app.render(160, 50), width=160)


def test_waiting_and_gone_screens():
    app = App(
        open_live=lambda run_dir, base: FakeCollector(LiveState(status="searching", message="no running X"))
    )
    app.poll()
    assert "no running X" in render(app.render(100, 30))
    gone = make_state()
    gone.status, gone.message = "gone", "the instance in /x is gone (its owner exited)"
    app = App(open_live=lambda run_dir, base: FakeCollector(gone))
    app.poll()
    text = render(app.render(120, 50), width=120)
    assert "is gone (its owner exited) — last state shown" in text and "Worker_DP0_PP0_TP1" in text
    assert "✗ the instance in /x is gone" in text  # its processes did not all stop cleanly


def test_an_instance_that_stopped_cleanly_reads_exited_with_no_alert():
    from tracing.telemetry.collector import compute_alerts

    # SIGTERM to the server: every process exited 0 (the children said so in their last
    # heartbeats), the owner stopped with the instance. Nothing is red, nothing alerts.
    stopped = make_state()
    stopped.status, stopped.message = "gone", "the instance in /x is gone"
    for p in stopped.processes.values():
        if p.state != "planned":
            p.exit_description = "exited with code 0"
    stopped.instance_ended(clean=True)
    stopped.derive(stopped.now)
    stopped.alerts = compute_alerts(stopped)
    app = App(open_live=lambda run_dir, base: FakeCollector(stopped))
    app.poll()
    text = render(app.render(160, 50), width=160)
    assert "✓ the instance in /x is gone: it stopped cleanly — last state shown" in text
    assert "✓ exited with code 0" in text and "✗" not in text and "is dead" not in text
    assert stopped.alerts == []


def test_a_collector_that_cannot_open_is_retried_not_fatal():
    def broken(run_dir, base):
        raise RuntimeError("zmq said no")

    app = App(open_live=broken)
    app.poll()
    assert app.collector is None and "zmq said no" in render(app.render(100, 30))


# ------------------------------------------------------------------------------ CLI


def _cli(*args: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, GLASSBOX_RUN_DIR_BASE=str(tmp_path), COLUMNS="120")
    return subprocess.run([sys.executable, "-m", "tui.cli", *args], capture_output=True, text=True,
                          timeout=30, env=env)  # fmt: skip


def test_once_without_instance_exits_1_with_one_line(tmp_path):
    out = _cli("--once", tmp_path=tmp_path)
    assert out.returncode == 1
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no running Glassbox instance found" in lines[0]
    missing = _cli("--once", "--run-dir", str(tmp_path / "nope"), tmp_path=tmp_path)
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1


def test_help_lists_every_flag(tmp_path):
    out = _cli("--help", tmp_path=tmp_path)
    assert out.returncode == 0
    for flag in ("--run-dir", "--once", "--json", "--replay", "--speed", "--refresh"):
        assert flag in out.stdout


@pytest.mark.parametrize("args", [["--speed", "2"], ["--refresh", "0"], ["--replay", "x", "--speed", "-1"]])
def test_bad_flags_exit_2(tmp_path, args):
    out = _cli(*args, tmp_path=tmp_path)
    assert out.returncode == 2 and "engine-top: error:" in out.stderr


def test_json_shape():
    pytest.importorskip("tracing.telemetry.collector", reason="LiveState.to_json comes with the collector")
    data = make_state().to_json()
    assert data["expected_count"] == 9 and data["found_count"] == 8
    assert set(data["processes"]) >= {"EngineCore_DP0", "Worker_DP0_PP0_TP1"}


# ------------------------------------------------------------------------------ against the real collector


@pytest.fixture
def instance():
    """A short run-directory base with one instance: a manifest planning an engine core (this
    process) and one worker that never starts, and a telemetry publisher for the engine core."""
    import tempfile
    import time as _time

    from tracing import run_dir as rd

    telemetry = pytest.importorskip("tracing.telemetry.publisher")
    base = Path(tempfile.mkdtemp(prefix="gbtop-", dir="/tmp"))  # ipc paths ≤ 107 characters
    run_dir = rd.make_run_dir(base)
    roles = [
        rd.PlannedProcess(role="EngineCore_DP0", kind="engine_core", rank=0, dp_rank=0, pid=os.getpid()),
        rd.PlannedProcess(role="Worker_DP0_PP0_TP0", kind="worker", rank=0, dp_rank=0, pp_rank=0, tp_rank=0),
    ]
    rd.write_manifest(run_dir, rd.Manifest(
        created_at=_time.time(), run_dir=str(run_dir), mode="serve", frontend_pid=os.getpid(), roles=roles,
        expected_process_count=2, data_parallel_size=1, tensor_parallel_size=1, world_size=1,
    ))  # fmt: skip
    pub = telemetry.TelemetryPublisher(run_dir, "EngineCore_DP0", interval_s=0.2, hook=True)
    try:
        yield base, run_dir, pub
    finally:
        pub.close()
        rd.remove_run_dir(base)


def _step_fields(i: int) -> dict:
    s = step(0, i, decode=16, prefill=48, budget=64)
    return {f: getattr(s, f) for f in s.__struct_fields__ if f not in ("role", "pid", "seq", "t")}


def test_once_and_json_against_a_live_publisher(instance):
    import json
    import threading
    import time as _time

    from tracing import catalogue
    from tracing.stage import stage

    base, run_dir, pub = instance
    done = threading.Event()

    def keep_stepping() -> None:  # a subscriber that joins late still sees step 7
        while not done.is_set():
            pub.publish_step(**_step_fields(7))
            done.wait(0.05)

    stepper = threading.Thread(target=keep_stepping, daemon=True)
    with stage(catalogue.ENGINE_CORE_INITIALIZE_KV_CACHE, rank=0):
        stepper.start()
        try:
            _time.sleep(0.3)
            once = _cli("--once", tmp_path=base)
            js = _cli("--json", tmp_path=base)
        finally:
            done.set()
            stepper.join(5)
    assert once.returncode == 0, once.stderr
    row = line_of(once.stdout, "EngineCore_DP0")
    assert catalogue.ENGINE_CORE_INITIALIZE_KV_CACHE in row and "starting" in row  # a start-up stage
    assert "planned" in line_of(once.stdout, "Worker_DP0_PP0_TP0")  # never started
    assert "1/2 found (1 missing)" in once.stdout
    # step 7's bar (not a process row whose CPU% happens to read 7)
    bar = next(ln for ln in once.stdout.splitlines() if "    7 " in ln and ("█" in ln or "▒" in ln))
    d, p = bar.count("█"), bar.count("▒")
    assert "·" not in bar and d + p >= 10 and round(4 * d / (d + p)) == 1  # 16 decode + 48 prefill = 64
    assert js.returncode == 0, js.stderr
    data = json.loads(js.stdout)
    assert data["processes"]["EngineCore_DP0"]["stage"] == catalogue.ENGINE_CORE_INITIALIZE_KV_CACHE
    assert data["expected_count"] == 2 and data["status"] == "attached"
    assert data["steps"]["0"][-1]["step_id"] == 7


def test_replay_once_prints_the_end_of_a_recording(instance):
    import time as _time

    from tracing.telemetry.collector import Recorder

    base, run_dir, pub = instance
    path = base / "rec.bin"
    rec = Recorder()
    rec.start(run_dir, path)
    try:
        deadline = _time.monotonic() + 5
        while rec.frames_written < 3 and _time.monotonic() < deadline:  # subscribed: heartbeats arrive
            _time.sleep(0.05)
        for i in range(3):
            pub.publish_step(**_step_fields(i))
        pub.publish_request_event("cmpl-r1", "scheduled", engine_index=0, num_prompt_tokens=48, num_blocks=3)
        _time.sleep(0.4)
    finally:
        rec.stop()
    out = _cli("--once", "--replay", str(path), tmp_path=base)
    assert out.returncode == 0, out.stderr
    assert "REPLAY" in out.stdout and "cmpl-r1" in out.stdout
    assert line_of(out.stdout, "    2 ")  # the last step recorded


def _pty_engine_top(args: list[str], base: Path):
    import pty

    master, slave = pty.openpty()
    env = dict(os.environ, GLASSBOX_RUN_DIR_BASE=str(base), TERM="xterm-256color", COLUMNS="120", LINES="40")

    def controlling_terminal() -> None:  # after setsid: the pty becomes its terminal, as in a shell
        import fcntl
        import termios

        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        # A shell gives a program it starts the default SIGINT; a test runner started in the
        # background by a script inherits it ignored, and so would engine-top (Ctrl-C lost).
        import signal

        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen([sys.executable, "-m", "tui.cli", *args], stdin=slave, stdout=slave, stderr=slave,
                            env=env, start_new_session=True, preexec_fn=controlling_terminal)  # fmt: skip
    os.close(slave)
    return proc, master


def _read_until(master: int, needle: bytes, timeout_s: float = 10.0) -> bytes:
    import select
    import time as _time

    out = b""
    deadline = _time.monotonic() + timeout_s
    while needle not in out and _time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                out += os.read(master, 65536)
            except OSError:
                break
    return out


@pytest.mark.parametrize("how", ["q", "ctrl-c", "SIGTERM"])
def test_live_screen_quits_and_restores_the_terminal(instance, how):
    import signal
    import termios
    import time as _time

    base, run_dir, pub = instance
    proc, master = _pty_engine_top(["--refresh", "0.2"], base)
    try:
        before = termios.tcgetattr(master)
        screen = _read_until(master, b"EngineCore_DP0")
        assert b"EngineCore_DP0" in screen, screen[-2000:]
        assert b"\x1b[?1049h" in screen  # the alternate screen
        if how == "q":
            os.write(master, b"q")
        elif how == "ctrl-c":
            os.write(master, b"\x03")  # the terminal turns it into SIGINT
        else:
            proc.send_signal(signal.SIGTERM)
        # Read the screen meanwhile, as a terminal does: a pty nobody reads blocks the last
        # redraws and the exit's own writes.
        rest = b""
        deadline = _time.monotonic() + 30
        while proc.poll() is None and _time.monotonic() < deadline:
            rest += _read_until(master, b"\x1b[?1049l", timeout_s=0.5)
        rc = proc.wait(timeout=5)
        rest += _read_until(master, b"\x1b[?1049l", timeout_s=2)
        assert rc == (128 + signal.SIGTERM if how == "SIGTERM" else 0)
        assert b"\x1b[?1049l" in screen + rest  # left the alternate screen
        assert termios.tcgetattr(master)[3] == before[3]  # echo and canonical mode as they were
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_live_screen_waits_when_no_instance(tmp_path):
    proc, master = _pty_engine_top(["--refresh", "0.2"], tmp_path)
    try:
        screen = _read_until(master, b"no running Glassbox instance")
        assert b"no running Glassbox instance" in screen
        assert proc.poll() is None  # still there, retrying
        os.write(master, b"q")
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


if __name__ == "__main__":  # redraw the pictures in README.md and docs/engine-top.md
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # render() prints as it records
        drawn = pictures()
    for path, picture in drawn.items():
        doc = path.read_text()
        start, end = _picture_span(doc)
        path.write_text(doc[:start] + _plain(picture) + doc[end:])
        print(f"redrew the picture in {path}")
