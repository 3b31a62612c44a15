"""Live telemetry (``tracing.telemetry``): publisher, collector, recorder, replay — CPU only.

Publisher and collector run in this process over a short temporary run directory with a
hand-written manifest (the contract's writer); no engine is imported. The frozen-process
test runs a publisher in a child process and SIGSTOPs it (always continued and killed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from tracing import catalogue
from tracing import run_dir as rd
from tracing.stage import stage
from tracing.telemetry import publisher as publisher_mod
from tracing.telemetry.collector import Collector, Recorder
from tracing.telemetry.events import (
    GAUGE_INPUT_QUEUE,
    GAUGE_RUNNING,
    Dropped,
    Gauges,
    Heartbeat,
    StageEntered,
    StageLeft,
    StepRecord,
    WaitEnded,
    WaitStarted,
    decode_event,
    read_recording,
)
from tracing.telemetry.publisher import TelemetryPublisher, get_publisher, start_telemetry
from tracing.waits import wait_for

ROOT = Path(__file__).resolve().parents[3]
ROLE = "EngineCore_DP0"


@pytest.fixture
def base():
    # ipc socket paths are limited to 107 characters: keep the base short (not pytest's tmp_path).
    path = Path(tempfile.mkdtemp(prefix="gbt-", dir="/tmp"))
    yield path
    rd.remove_run_dir(path)


def _manifest(run_dir: Path, roles: dict[str, int | None], expected: int | None = None) -> None:
    rd.write_manifest(
        run_dir,
        rd.Manifest(
            created_at=time.time(),
            run_dir=str(run_dir),
            mode="mp",
            frontend_pid=os.getpid(),
            roles=[
                rd.PlannedProcess(role=r, kind="engine_core", rank=0, pid=pid) for r, pid in roles.items()
            ],
            expected_process_count=len(roles) if expected is None else expected,
            data_parallel_size=1,
        ),
    )


@pytest.fixture
def run_dir(base):
    d = rd.make_run_dir(base)
    _manifest(d, {ROLE: os.getpid()})
    return d


def _step(i: int) -> dict:
    return dict(
        engine_index=0, step_id=i, started_at=time.time(), duration_ms=2.0, schedule_ms=0.2, execute_ms=1.6,
        update_ms=0.2, num_decode_reqs=3, num_decode_tokens=3, num_prefill_reqs=1, num_prefill_tokens=61,
        num_chunked_prefills=1, tokens_scheduled=64, token_budget=64, num_running=4, num_waiting=2,
        num_preempted=0, kv_usage=0.5,
    )  # fmt: skip


def _sub(address: str, rcvhwm: int | None = None) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    if rcvhwm is not None:
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return ctx, sock


def _attach(pub: TelemetryPublisher, sock: zmq.Socket) -> None:
    """Publish probes until ``sock`` receives one (ZMQ subscriptions arrive asynchronously)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pub.publish(Gauges, values={})
        if sock.poll(20):
            while sock.poll(50):
                sock.recv()
            return
    raise AssertionError("subscriber never attached")


def _read_all(sock: zmq.Socket, quiet_ms: int = 200) -> list:
    out = []
    while sock.poll(quiet_ms):
        out.append(decode_event(sock.recv()))
    return out


def test_stage_and_wait_visible_live_while_open(run_dir):
    with Collector(run_dir, refresh_s=0.1) as c, TelemetryPublisher(run_dir, ROLE, interval_s=0.2):
        c.wait_until(lambda s: ROLE in s.processes and s.processes[ROLE].heartbeat_at is not None, 5)
        with stage(catalogue.WORKER_LOAD_MODEL, rank=0, model_name="tiny"):
            st = c.wait_until(lambda s: s.processes[ROLE].stage == catalogue.WORKER_LOAD_MODEL, 5)
            assert st.processes[ROLE].stage == catalogue.WORKER_LOAD_MODEL  # still open
            assert st.model == "tiny"
            assert st.to_json()["processes"][ROLE]["stage"] == catalogue.WORKER_LOAD_MODEL
        st = c.wait_until(lambda s: s.processes[ROLE].stage is None, 5)
        assert st.processes[ROLE].last_stage_left == catalogue.WORKER_LOAD_MODEL
        assert st.stage_stats[catalogue.WORKER_LOAD_MODEL].count == 1

        release = threading.Event()
        t = threading.Thread(target=lambda: wait_for("READY from EngineCore_DP9", release, timeout_s=30))
        t.start()
        try:
            st = c.wait_until(
                lambda s: [w.what for w in s.processes[ROLE].waits] == ["READY from EngineCore_DP9"], 5
            )
            assert st.processes[ROLE].waits[0].timeout_s == 30
        finally:
            release.set()
            t.join()
        assert c.wait_until(lambda s: not s.processes[ROLE].waits, 5).processes[ROLE].waits == []

        with pytest.raises(RuntimeError), stage(catalogue.WORKER_INIT_DEVICE):
            raise RuntimeError("no device")
        st = c.wait_until(lambda s: s.processes[ROLE].last_error is not None, 5)
        assert st.processes[ROLE].last_error == "worker.init_device: RuntimeError: no device"


def test_heartbeats_come_from_their_own_thread_while_main_is_busy(run_dir):
    with TelemetryPublisher(run_dir, ROLE, interval_s=0.2, hook=False) as pub:
        ctx, sock = _sub(pub.address)
        try:
            _attach(pub, sock)
            t0 = time.monotonic()
            end = t0 + 1.2
            with stage(catalogue.ENGINE_CORE_STEP):
                x = 0
                while time.monotonic() < end:  # a busy main thread (pure Python)
                    x += 1
            beats = [e for e in _read_all(sock, 100) if isinstance(e, Heartbeat)]
        finally:
            sock.close(0)
            ctx.term()
    assert len(beats) >= 4, f"{len(beats)} heartbeats in 1.2 s at interval 0.2 s"
    assert any(s.name == catalogue.ENGINE_CORE_STEP for b in beats for s in b.stages)
    assert beats[0].rss_bytes > 0 and beats[0].num_threads >= 2


def test_slow_subscriber_never_blocks_and_drops_are_counted(run_dir):
    with TelemetryPublisher(
        run_dir, ROLE, sndhwm=100, max_steps_per_s=None, hook=False, heartbeat=False
    ) as pub:
        ctx, sock = _sub(pub.address, rcvhwm=100)
        try:
            _attach(pub, sock)
            n = 10_000
            worst = 0.0
            t0 = time.perf_counter()
            for i in range(n):
                t1 = time.perf_counter()
                pub.publish_step(**_step(i))
                worst = max(worst, time.perf_counter() - t1)
            elapsed = time.perf_counter() - t0
            refused = pub.pending_dropped().get("step", 0)
            assert elapsed < 3.0, f"10,000 publishes took {elapsed:.2f} s"
            assert worst < 0.1, f"one publish took {worst * 1e3:.1f} ms"
            assert refused > 0, "the subscriber never filled up"
            received = _read_all(sock)  # now it reads: what it got, then the Dropped
            pub.beat(snapshot=False)
            received += _read_all(sock)
        finally:
            sock.close(0)
            ctx.term()
    steps = [e for e in received if isinstance(e, StepRecord)]
    dropped = [e for e in received if isinstance(e, Dropped)]
    assert len(dropped) == 1
    assert dropped[0].counts["step"] == refused == dropped[0].refused["step"]
    assert dropped[0].sampled == {}  # refused is a real loss, not sampling
    assert len(steps) + refused == n
    # Every refused event took a seq number: between two received steps, the gap in seq is
    # exactly the gap in step ids.
    assert all(b.seq - a.seq == b.step_id - a.step_id for a, b in zip(steps, steps[1:], strict=False))


def test_fast_steps_are_sampled_and_the_count_published(run_dir):
    with (
        Collector(run_dir, refresh_s=0.1) as c,
        TelemetryPublisher(run_dir, ROLE, interval_s=0.2, max_steps_per_s=50, hook=False) as pub,
    ):
        c.wait_until(lambda s: ROLE in s.processes and s.processes[ROLE].heartbeat_at is not None, 5)
        for i in range(500):  # far more than 50 in well under a second
            pub.publish_step(**_step(i))
        st = c.wait_until(lambda s: s.processes[ROLE].dropped_by_kind.get("step", 0) >= 450, 5)
    steps = st.steps[0]
    assert len(steps) == 50
    assert st.processes[ROLE].dropped_by_kind["step"] == 450
    assert st.processes[ROLE].dropped_events == 450  # seq gaps seen by the collector
    assert st.processes[ROLE].refused_events == 0  # sampled on purpose, nothing refused
    assert (st.processes[ROLE].sampled_events, st.processes[ROLE].lost_events) == (450, 0)
    assert (st.events_sampled, st.events_lost) == (450, 0)
    assert st.processes[ROLE].last_step_at is not None


def test_over_the_request_rate_a_requests_end_is_never_sampled_away(run_dir):
    """Found under load: above 2,000 request events a second the rest were sampled away,
    ends too, so a request's final counts (and its end) could be lost; its finished and
    aborted events always go out, and the sampling is reported as sampled, not lost."""
    with TelemetryPublisher(run_dir, ROLE, hook=False, heartbeat=False) as pub:
        ctx, sock = _sub(pub.address, rcvhwm=10_000)
        try:
            _attach(pub, sock)
            pub._request_window.limit = 50  # the rate limit, reached at once
            for i in range(60):
                pub.publish_request_event(f"r{i}", "scheduled", engine_index=0)
            assert pub.publish_request_event("r1", "finished", engine_index=0, reason="stop",
                                             num_prompt_tokens=8, num_computed_tokens=11, num_output_tokens=4)  # fmt: skip
            assert pub.publish_request_event("r2", "aborted", reason="client disconnected")
            pub.beat(snapshot=False)
            received = _read_all(sock)
        finally:
            sock.close(0)
            ctx.term()
    ends = [(e.request_id, e.event, e.num_computed_tokens) for e in received if getattr(e, "event", "") in ("finished", "aborted")]  # fmt: skip
    assert ends == [("r1", "finished", 11), ("r2", "aborted", -1)]
    (dropped,) = [e for e in received if isinstance(e, Dropped)]
    scheduled = sum(1 for e in received if getattr(e, "event", "") == "scheduled")
    assert 0 < dropped.sampled["request"] == dropped.counts["request"] == 60 - scheduled
    assert not dropped.refused


def test_gauges_providers_pushes_and_a_failing_provider(run_dir, caplog):
    def bad():
        raise ValueError("broken provider")

    with (
        Collector(run_dir, refresh_s=0.1) as c,
        TelemetryPublisher(run_dir, ROLE, interval_s=0.1, hook=False) as pub,
    ):
        pub.add_gauge_provider(bad)
        pub.add_gauge_provider(lambda: {GAUGE_RUNNING: 4})
        for i in range(200):
            pub.publish_gauges({GAUGE_INPUT_QUEUE: i})
        st = c.wait_until(
            lambda s: s.processes.get(ROLE) and s.processes[ROLE].gauges.get(GAUGE_INPUT_QUEUE) == 199, 5
        )
        st = c.wait_until(lambda s: s.processes[ROLE].gauges.get(GAUGE_RUNNING) == 4, 5)
        time.sleep(0.3)
    assert st.processes[ROLE].gauges[GAUGE_INPUT_QUEUE] == 199  # latest wins
    # Coalesced to ≤ 10/s, not 200 samples (none at all when the subscription joined late and
    # the value came with a Snapshot).
    assert len(st.queues.get(f"{ROLE} {GAUGE_INPUT_QUEUE}", ())) <= 5
    assert sum("broken provider" in r.getMessage() or "failed" in r.getMessage() for r in caplog.records) == 1


def test_record_then_replay_gives_the_same_state(run_dir, base):
    path = base / "rec.bin"
    rec = Recorder()
    with Collector(run_dir, refresh_s=0.1) as c:
        pub = TelemetryPublisher(run_dir, ROLE, interval_s=0.2)
        try:
            rec.start(run_dir, path)
            c.wait_until(lambda s: ROLE in s.processes and s.processes[ROLE].heartbeat_at is not None, 5)
            deadline = time.monotonic() + 5
            while rec.frames_written < 4 and time.monotonic() < deadline:  # RunInfo + heartbeats
                time.sleep(0.05)
            with stage(catalogue.ENGINE_CORE_INIT, rank=0):
                for i in range(5):
                    pub.publish_step(**_step(i))
                pub.publish_request_event("r1", "arrived", num_prompt_tokens=61)
                pub.publish_request_event("r1", "scheduled", engine_index=0, num_blocks=4)
                pub.publish_gauges({GAUGE_INPUT_QUEUE: 3})
                time.sleep(0.5)
        finally:
            pub.close()
        last_seq = pub.seq - 1
        live = c.wait_until(lambda s: s.processes[ROLE].last_seq == last_seq, 5)
        time.sleep(0.2)
        rec.stop()
    assert rec.frames_written > 10
    with open(path, "rb") as f:
        kinds = {type(e).__name__ for e in read_recording(f)}
    assert {"RunInfo", "Heartbeat", "StageEntered", "StageLeft", "StepRecord", "RequestEvent"} <= kinds

    replay = Collector.from_recording(path, speed=0).start()
    assert replay.done.wait(10)
    again = replay.snapshot()
    replay.stop()
    assert again.source == "replay" and again.status == "replay_done"
    a, b = live.processes[ROLE], again.processes[ROLE]
    for name in (
        "stages",
        "gauges",
        "heartbeat_at",
        "last_step_at",
        "cpu_percent",
        "rss_bytes",
        "last_stage_left",
    ):
        assert getattr(a, name) == getattr(b, name), name
    assert a.last_seq == b.last_seq
    assert [s.step_id for s in live.steps[0]] == [s.step_id for s in again.steps[0]] == list(range(5))
    assert live.to_json()["requests"] == again.to_json()["requests"]
    assert again.requests["r1"].num_blocks == 4 and again.requests["r1"].num_prompt_tokens == 61
    assert again.expected_count == 1 and again.found_count == 1  # from the recorded RunInfo
    assert list(live.queues[f"{ROLE} {GAUGE_INPUT_QUEUE}"])[-1] == 3.0
    assert list(again.queues[f"{ROLE} {GAUGE_INPUT_QUEUE}"])[-1] == 3.0


def test_collector_without_a_server_says_so_then_attaches(base):
    with Collector(base=base, refresh_s=0.1) as c:
        st = c.wait_until(lambda s: c.refreshes >= 2, 5)
        assert st.status == "searching" and "no running Glassbox instance" in st.message
        assert st.processes == {} and Collector.list_instances(base) == []

        d = rd.make_run_dir(base)
        _manifest(d, {ROLE: os.getpid(), "APIServer_0": None}, expected=2)
        st = c.wait_until(lambda s: s.status == "attached", 5)
        assert st.processes[ROLE].link == "connecting" and st.processes["APIServer_0"].state == "planned"
        with TelemetryPublisher(d, ROLE, interval_s=0.2, hook=False):
            st = c.wait_until(lambda s: s.processes[ROLE].state == "running", 5)
            assert st.processes[ROLE].link == "live"
            assert st.expected_count == 2 and st.found_count == 1
            assert Collector.list_instances(base) == [d]
            # the API server appears later: picked up from its socket file
            with TelemetryPublisher(d, "APIServer_0", interval_s=0.2, hook=False):
                st = c.wait_until(lambda s: s.processes["APIServer_0"].heartbeat_at is not None, 5)
                assert st.processes["APIServer_0"].link == "live"


def test_collector_waits_for_a_run_dir_that_does_not_exist_yet(base):
    with Collector(base / "glassbox-1-nothere", refresh_s=0.1) as c:
        st = c.wait_until(lambda s: c.refreshes >= 2, 5)
    assert st.status == "waiting" and "waiting for" in st.message


CHILD = """
import sys, time
from tracing.telemetry.publisher import start_telemetry
from tracing.stage import stage
from tracing import catalogue
pub = start_telemetry(sys.argv[1], sys.argv[2], interval_s=0.2)
with stage(catalogue.WORKER_LOAD_MODEL, rank=0):
    print("ready", flush=True)
    time.sleep(60)
"""


def test_frozen_process_goes_stale_then_dead_with_its_signal(run_dir):
    role = "Worker_DP0_PP0_TP0"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(run_dir), role],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        _manifest(run_dir, {ROLE: os.getpid(), role: child.pid})
        assert child.stdout.readline().strip() == "ready"
        with Collector(run_dir, refresh_s=0.1, stale_after_s=1.0) as c:
            st = c.wait_until(
                lambda s: role in s.processes and s.processes[role].heartbeat_at is not None, 10
            )
            assert st.processes[role].stage == catalogue.WORKER_LOAD_MODEL
            os.kill(child.pid, signal.SIGSTOP)
            st = c.wait_until(lambda s: s.processes[role].state == "stale" and s.alerts, 10)
            assert st.processes[role].state == "stale"
            alert = next(a for a in st.alerts if a.role == role and "no heartbeat" in a.message)
            assert alert.severity == "error" and "SIGCONT" in alert.hint
            os.kill(child.pid, signal.SIGCONT)
            st = c.wait_until(lambda s: s.processes[role].state == "starting", 10)
            child.kill()
            child.wait(5)
            # the parent reports how its child ended
            with TelemetryPublisher(run_dir, ROLE, interval_s=0.2, hook=False) as parent:
                parent.note_child_exit(role, "killed by SIGKILL (exit status -9)")
                st = c.wait_until(
                    lambda s: s.processes[role].exit_description == "killed by SIGKILL (exit status -9)", 5
                )
            assert st.processes[role].state == "dead"
            st = c.wait_until(lambda s: any(a.role == role and "SIGKILL" in a.message for a in s.alerts), 5)
            alert = next(a for a in st.alerts if a.role == role and "SIGKILL" in a.message)
            assert alert.severity == "error" and "is dead" in alert.message
    finally:
        try:
            os.kill(child.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        child.kill()
        child.wait(5)


def test_stuck_stage_alert_names_the_stage_and_a_hint(run_dir):
    from tracing.telemetry.collector import StageHint, stage_hint

    def hints(name):
        if name == catalogue.WORKER_LOAD_MODEL:
            return StageHint(0.3, "reading the weights")
        return stage_hint(name)

    with (
        Collector(run_dir, refresh_s=0.1, hints=hints) as c,
        TelemetryPublisher(run_dir, ROLE, interval_s=0.2),
        stage(catalogue.WORKER_LOAD_MODEL),
    ):
        st = c.wait_until(lambda s: any(catalogue.WORKER_LOAD_MODEL in a.message for a in s.alerts), 5)
    alert = next(a for a in st.alerts if catalogue.WORKER_LOAD_MODEL in a.message)
    assert alert.role == ROLE and alert.hint == "reading the weights" and "usually under" in alert.message


def test_telemetry_switched_off_by_the_environment(run_dir, monkeypatch):
    monkeypatch.setenv(publisher_mod.ENV_TELEMETRY, "0")
    assert start_telemetry(run_dir, ROLE) is None
    assert get_publisher() is None
    monkeypatch.setenv(publisher_mod.ENV_TELEMETRY, "1")
    pub = start_telemetry(run_dir, ROLE, interval_s=0.2)
    try:
        assert pub is not None and get_publisher() is pub and start_telemetry(run_dir, ROLE) is pub
    finally:
        publisher_mod.stop_telemetry()
    assert get_publisher() is None


OFF_CHILD = """
import sys, threading
from tracing import catalogue
from tracing.stage import stage
from tracing.telemetry.events import RequestEvent
from tracing.telemetry.publisher import NULL_PUBLISHER, get_publisher, start_telemetry, telemetry
assert start_telemetry(sys.argv[1], sys.argv[2]) is None and get_publisher() is None
pub = telemetry()
assert pub is NULL_PUBLISHER and not pub.enabled
with stage(catalogue.WORKER_LOAD_MODEL, rank=0):
    sent = [pub.publish(RequestEvent, request_id="r", event="arrived"), pub.publish_step(step_id=1),
            pub.publish_request_event("r", "finished", reason="stop")]
    pub.mark_step()
    pub.publish_gauges({"engine.input_queue": 1})
    pub.add_gauge_provider(lambda: {"engine.input_queue": 2})()
    pub.set_requests_provider(lambda: [])
    pub.note_child_exit("Worker_DP0_PP0_TP0", "killed by SIGKILL (exit status -9)")
assert sent == [False, False, False], sent
print(",".join(sorted(t.name for t in threading.enumerate())))
"""


def test_a_process_with_telemetry_off_publishes_nothing_and_raises_nothing(run_dir):
    """Engine code calls ``telemetry()``'s methods with no None guard: with
    ``GLASSBOX_TELEMETRY=0`` they do nothing — no socket, no heartbeat thread, no error."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), publisher_mod.ENV_TELEMETRY: "0"}
    child = subprocess.run([sys.executable, "-c", OFF_CHILD, str(run_dir), ROLE], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "MainThread"
    assert list(run_dir.glob("*.tel")) == []


def test_the_null_publisher_has_the_engine_methods_of_the_publisher():
    """Every method engine code may call on ``TelemetryPublisher`` is on ``NullPublisher``, with
    the same signature (the owner's own methods, closing and beating, are not)."""
    import inspect

    owners = {"beat", "close", "pending_dropped", "seq"}
    engine_api = {n for n in dir(TelemetryPublisher) if not n.startswith("_")} - owners - {"enabled"}
    null_api = {n for n in dir(publisher_mod.NullPublisher) if not n.startswith("_")} - {"enabled"}
    assert null_api == engine_api
    for name in engine_api:
        real, null = getattr(TelemetryPublisher, name), getattr(publisher_mod.NullPublisher, name)
        assert inspect.signature(null) == inspect.signature(real), name


def test_the_stage_hook_is_cheap(run_dir):
    """Step-level stages rate-limited away cost about a microsecond per hook call; the bound
    here is loose (a loaded CI machine), the measured figures are in docs/telemetry.md."""
    with TelemetryPublisher(run_dir, ROLE, hook=True, heartbeat=False, stage_rate=0):
        n = 5000
        t0 = time.perf_counter()
        for _ in range(n):
            with stage(catalogue.SCHEDULER_SCHEDULE):
                pass
        with_hook = (time.perf_counter() - t0) / n
    assert with_hook < 100e-6, f"{with_hook * 1e6:.1f} µs per stage with the hook"


def test_live_state_json_is_plain_data(run_dir):
    with Collector(run_dir, refresh_s=0.1) as c, TelemetryPublisher(run_dir, ROLE, interval_s=0.2) as pub:
        c.wait_until(lambda s: ROLE in s.processes and s.processes[ROLE].heartbeat_at is not None, 5)
        pub.publish_step(**_step(0))
        st = c.wait_until(lambda s: 0 in s.steps, 5)
    data = msgspec.json.decode(msgspec.json.encode(st.to_json()))
    assert data["steps"]["0"][0]["tokens_scheduled"] == 64
    assert data["processes"][ROLE]["role"] == ROLE


def test_ends_of_rate_limited_stages_and_waits_follow_a_heartbeat_that_listed_them(run_dir):
    """A stage or wait whose start was rate-limited away still shows in a heartbeat (every
    open one does); its end must then be published too, or engine-top shows it open and
    aging until the next heartbeat — under load, an EngineCore "waiting for execute_model"
    that read as a stuck step. Without a heartbeat in between, the end stays unpublished."""
    what = "execute_model from Worker_X"
    with TelemetryPublisher(run_dir, ROLE, hook=True, heartbeat=False, stage_rate=0) as pub:
        ctx, sock = _sub(pub.address)
        try:
            _attach(pub, sock)
            with stage(catalogue.SCHEDULER_SCHEDULE):  # rate-limited away, no heartbeat meanwhile
                pass
            release = threading.Event()
            waiter = threading.Thread(target=lambda: wait_for(what, release.is_set, timeout_s=30))
            with stage(catalogue.SCHEDULER_SCHEDULE):  # rate-limited away, then listed by a heartbeat
                waiter.start()
                deadline = time.monotonic() + 5
                while not pub._waits and time.monotonic() < deadline:
                    time.sleep(0.01)
                pub.beat(snapshot=False)
                release.set()
                waiter.join(5)
            events = _read_all(sock)
        finally:
            sock.close(0)
            ctx.term()
    beats = [e for e in events if isinstance(e, Heartbeat)]
    assert [s.name for s in beats[0].stages] == [catalogue.SCHEDULER_SCHEDULE]
    assert [w.what for w in beats[0].waits] == [what]
    assert [e.name for e in events if isinstance(e, StageEntered)] == []  # both enters rate-limited
    assert [e.name for e in events if isinstance(e, StageLeft)] == [
        catalogue.SCHEDULER_SCHEDULE
    ]  # the listed one
    assert [e.what for e in events if isinstance(e, WaitStarted)] == []
    assert [e.what for e in events if isinstance(e, WaitEnded)] == [what]


def test_a_process_the_os_shows_stopped_is_stopped_to_engine_tops_blame_at_once():
    """As doctor reads it: the OS state, not a heartbeat gone stale seconds later. Found in a
    lesson: engine-top's root cause said a SIGSTOPped worker "is held by an injected fault"
    (the fault struck just before its SIGSTOP) while doctor said it "is stopped"."""
    from tracing.telemetry.collector import _known_troubles
    from tracing.telemetry.state import LiveState

    state = LiveState()
    state.now = time.time()
    proc = state._process("Worker_DP0_PP0_TP1")
    proc.state, proc.heartbeat_at, proc.pid = "running", state.now - 0.5, os.getpid()
    state.apply_liveness({"Worker_DP0_PP0_TP1": "stopped"}, 1)
    known = _known_troubles(state)
    assert known["Worker_DP0_PP0_TP1"].stopped == "stopped by a signal (os state stopped)"
    state.apply_liveness({"Worker_DP0_PP0_TP1": "running"}, 1)
    assert _known_troubles(state) == {}  # running, beating: nothing to say


def _running_state(*roles: str):
    from tracing.telemetry.state import LiveState

    state = LiveState()
    state.now = time.time()
    for i, role in enumerate(roles):
        proc = state._process(role)
        proc.state, proc.heartbeat_at, proc.pid = "running", state.now - 0.2, 1000 + i
    return state


def test_a_process_that_reports_its_own_clean_exit_reads_exited_not_dead_and_raises_no_alert():
    from tracing.telemetry.collector import compute_alerts
    from tracing.telemetry.events import Heartbeat

    state = _running_state("EngineCore_DP0", "Worker_DP0_PP0_TP0")
    # the worker's own last heartbeat (the harness, exit status 0), then its parent's word
    state.apply(Heartbeat(role="Worker_DP0_PP0_TP0", pid=1001, seq=5, t=state.now, cpu_percent=0.0,
                          rss_bytes=0, num_threads=1, exited={"Worker_DP0_PP0_TP0": "exited with code 0"}))  # fmt: skip
    state.derive(state.now + 0.1)
    worker = state.processes["Worker_DP0_PP0_TP0"]
    assert (worker.state, worker.exit_description) == ("exited", "exited with code 0")
    assert not worker.alive and worker.gone
    assert [a for a in compute_alerts(state) if a.role == "Worker_DP0_PP0_TP0"] == []


def test_a_clean_end_of_the_instance_reads_exited_but_a_killed_process_stays_dead():
    from tracing.telemetry.collector import compute_alerts

    state = _running_state("APIServer_0", "EngineCore_DP0", "Worker_DP0_PP0_TP0")
    state.processes["Worker_DP0_PP0_TP0"].exit_description = "killed by SIGKILL (exit status -9)"
    state.instance_ended(clean=True)  # its run directory removed, no post-mortem kept
    state.derive(state.now + 0.1)
    assert state.processes["APIServer_0"].state == "exited"  # the owner: stopped with the instance
    assert state.processes["EngineCore_DP0"].state == "exited"
    assert state.processes["Worker_DP0_PP0_TP0"].state == "dead"  # its parent said how it died
    alerts = compute_alerts(state)
    assert [(a.severity, a.role) for a in alerts if "is dead" in a.message] == [
        ("error", "Worker_DP0_PP0_TP0")
    ]


def test_an_instance_that_ended_after_a_failure_leaves_its_processes_dead():
    from tracing.telemetry.collector import compute_alerts

    state = _running_state("APIServer_0", "EngineCore_DP0")
    state.instance_ended(clean=False)  # a post-mortem was kept: the tree ended after a failure
    state.derive(state.now + 0.1)
    assert {p.state for p in state.processes.values()} == {"dead"}
    assert sorted(a.role for a in compute_alerts(state) if "is dead" in a.message) == [
        "APIServer_0",
        "EngineCore_DP0",
    ]
