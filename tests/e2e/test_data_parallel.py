"""Data parallelism: N engine cores, one DPCoordinator, request waves.

Fast tests check the pieces in-process: the coordinator publishes (waiting, running) per
engine at most every 100 ms while they change and never while they don't; the client scores
engines ``waiting * 4 + running`` from the latest publish plus what it sent since, honours a
pinned ``data_parallel_rank`` and routes aborts to the engine that has the request; the
coordinator runs a wave from the first request until every engine is at zero, and an engine
starts a wave once (and again when one ends under its late requests).
Slow tests run the real tree: ``LLM(data_parallel_size=2)`` gives dp 1's greedy tokens with
both engines busy, a pinned request lands on its engine while the other runs dummy
batches until the wave ends, the titles and ``glassbox ps`` count
2 + 2 + 1, SIGKILL of the ``DPCoordinator`` or of ``EngineCore_DP1`` brings the tree down
(the latter within 5 s mid-generate) with one root cause naming it;
``glassbox serve -dp 2 --api-server-count 1`` is 1 + 2 + 2 + 1 = 6 processes that answer and
stop on SIGTERM (the default, two API servers, is in ``test_api_servers.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import types

import httpx
import psutil
import pytest
import zmq
from proc_utils import titled_processes, wait_gone
from server_utils import start_server
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.config import ConfigError, ParallelConfig
from engine.core.coordinator import DPCoordinator
from engine.core.coordinator_messages import (
    CoordinatorSpawnPayload,
    DPWave,
    EngineLoad,
    EngineLoads,
    EngineToCoordinator,
    StartWave,
    coordinator_addresses,
    decode_as,
    wave_address,
)
from engine.core.messages import EngineCoreRequest
from engine.frontend.core_client import SyncMPClient
from engine.utils.processes import EngineDeadError
from engine.utils.wire import ProtocolError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(7, 7 + n))} for n in (3, 9, 20, 33, 41, 64)]


# ---------------------------------------------------------------------- fast: the pieces


def test_config_accepts_dp_and_refuses_it_without_processes(monkeypatch):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    assert ParallelConfig(data_parallel_size=2).data_parallel_size == 2
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    with pytest.raises(ConfigError, match="--data-parallel-size"):
        ParallelConfig(data_parallel_size=2)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_coordinator_publishes_changes_at_most_every_100_ms(tmp_path):
    clock = FakeClock()
    engines_to_coordinator, to_clients = coordinator_addresses(tmp_path)
    coordinator = DPCoordinator(
        CoordinatorSpawnPayload(
            input_address=engines_to_coordinator, publish_address=to_clients, data_parallel_size=2
        ),  # fmt: skip
        clock=clock,
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(to_clients)
    try:
        # PUB/SUB drops what is sent before the subscription is in place: publish until one arrives.
        deadline = time.monotonic() + 5
        while not sub.poll(50):
            assert time.monotonic() < deadline
            coordinator.dirty, clock.now = True, clock.now + 1
            coordinator.maybe_publish()
        while sub.poll(10):
            sub.recv()
        clock.now += 1
        assert not coordinator.maybe_publish(), "nothing changed: nothing is published"
        coordinator.record(EngineLoad(engine_index=1, num_waiting=3, num_running=2))
        assert coordinator.maybe_publish()
        loads = decode_as(EngineLoads, sub.recv())
        assert [tuple(c) for c in loads.counts] == [(0, 0), (3, 2)]
        coordinator.record(EngineLoad(engine_index=0, num_waiting=1, num_running=0))
        clock.now += 0.05
        assert not coordinator.maybe_publish(), "a change within 100 ms waits"
        clock.now += 0.06
        assert coordinator.maybe_publish()
        later = decode_as(EngineLoads, sub.recv())
        assert later.seq > loads.seq and [tuple(c) for c in later.counts] == [(1, 0), (3, 2)]
    finally:
        sub.close(linger=0)
        ctx.term()
        coordinator.close()


def test_coordinator_runs_a_wave_from_the_first_request_until_every_engine_is_at_zero(tmp_path):
    engines_to_coordinator, to_clients = coordinator_addresses(tmp_path)
    waves = wave_address(tmp_path)
    coordinator = DPCoordinator(CoordinatorSpawnPayload(input_address=engines_to_coordinator, publish_address=to_clients,
                                                        data_parallel_size=2, wave_address=waves))  # fmt: skip
    sent: list[DPWave] = []
    coordinator._send_wave = sent.append
    try:
        coordinator.handle(StartWave(engine_index=1, wave=0))
        assert sent == [DPWave(wave=0, running=True, exclude_engine=1)] and coordinator.engines_running
        coordinator.handle(StartWave(engine_index=0, wave=0))  # it runs already: nothing new
        coordinator.handle(EngineLoad(engine_index=1, num_waiting=1, num_running=0))
        coordinator.handle(EngineLoad(engine_index=1, num_waiting=0, num_running=1))
        assert len(sent) == 1
        coordinator.handle(EngineLoad(engine_index=1, num_waiting=0, num_running=0))
        assert sent[-1] == DPWave(wave=1, running=False) and not coordinator.engines_running
        coordinator.handle(StartWave(engine_index=0, wave=0))  # a stale start: ignored
        assert len(sent) == 2
        coordinator.handle(StartWave(engine_index=0, wave=1))
        assert sent[-1] == DPWave(wave=1, running=True, exclude_engine=0)
        with pytest.raises(ProtocolError, match="StartWave from engine 5"):
            coordinator.handle(StartWave(engine_index=5, wave=1))
    finally:
        coordinator.close()


def test_a_new_wave_is_not_ended_by_an_idle_engine_before_the_starter_reports_its_load(tmp_path):
    """On a loaded machine the idle engine's first (0, 0) could reach the coordinator between
    the starter's StartWave and its EngineLoad, and end the wave at once: one request, two
    waves. The start carries the starter's load."""
    engines_to_coordinator, to_clients = coordinator_addresses(tmp_path)
    coordinator = DPCoordinator(CoordinatorSpawnPayload(input_address=engines_to_coordinator, publish_address=to_clients,
                                                        data_parallel_size=2, wave_address=wave_address(tmp_path)))  # fmt: skip
    sent: list[DPWave] = []
    coordinator._send_wave = sent.append
    try:
        coordinator.handle(StartWave(engine_index=0, wave=0, num_waiting=1))
        coordinator.handle(
            EngineLoad(engine_index=1, num_waiting=0, num_running=0)
        )  # the idle engine's first report
        assert coordinator.engines_running and sent == [DPWave(wave=0, running=True, exclude_engine=0)]
        assert coordinator.counts == [(1, 0), (0, 0)]
        coordinator.handle(EngineLoad(engine_index=0, num_waiting=0, num_running=0))  # its request finished
        assert not coordinator.engines_running and sent[-1] == DPWave(wave=1, running=False)
    finally:
        coordinator.close()


def test_an_engine_starts_a_wave_once_and_restarts_one_that_ended_under_its_requests():
    """The engine side of waves, without a process: ``_maybe_start_wave`` and ``_on_wave``."""
    from engine.core.engine_core_proc import EngineCoreProc

    engine = EngineCoreProc.__new__(EngineCoreProc)
    engine.data_parallel_rank, engine.current_wave, engine.engines_running = 1, 0, False
    engine._coordinator_backlog = []
    sent: list[bytes] = []
    engine.coordinator_socket = types.SimpleNamespace(send=lambda data, flags=0: sent.append(data))
    unfinished = [0]
    engine.scheduler = types.SimpleNamespace(has_unfinished_requests=lambda: unfinished[0] > 0,
                                             waiting=["a request"], running=[])  # fmt: skip

    engine._maybe_start_wave()
    engine._maybe_start_wave()  # running already: one StartWave only
    # the engine's load goes with the start, and counts as sent
    assert [decode_as(EngineToCoordinator, m) for m in sent] == [
        StartWave(engine_index=1, wave=0, num_waiting=1)
    ]
    assert engine.load_sent == (1, 0)
    engine.scheduler.waiting = []
    engine._on_wave(DPWave(wave=0, running=True, exclude_engine=1))
    assert engine.engines_running and engine.current_wave == 0
    # The wave ends while a request that came late is still here: the engine starts the next.
    unfinished[0] = 1
    engine._on_wave(DPWave(wave=1, running=False))
    assert engine.engines_running and engine.current_wave == 1
    assert decode_as(EngineToCoordinator, sent[-1]) == StartWave(engine_index=1, wave=1)
    assert engine.load_sent == (0, 0)
    # Another engine's wave: follow it; its end, with nothing here: stop.
    unfinished[0] = 0
    engine._on_wave(DPWave(wave=1, running=False))  # not newer: ignored
    assert engine.engines_running
    engine._on_wave(DPWave(wave=2, running=False))
    assert not engine.engines_running and engine.current_wave == 2
    engine._on_wave(DPWave(wave=2, running=True, exclude_engine=0))
    assert engine.engines_running and len(sent) == 2


def _wave_over(client: SyncMPClient) -> list[dict]:
    """Each engine's wave state once the coordinator has ended the wave (both at zero)."""
    deadline = time.monotonic() + 10
    while True:
        waves = client.call_utility_each("get_dp_state")
        if not any(w["engines_running"] for w in waves):
            return waves
        assert time.monotonic() < deadline, waves
        time.sleep(0.05)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("dp"), "llama", tie_word_embeddings=True,
                                 tokenizer_dir=default_model_dir)  # fmt: skip


@pytest.fixture
def cleanup():
    yield
    for child in psutil.Process().children(recursive=True):
        child.kill()


@pytest.mark.slow
def test_dp2_llm_equals_dp1_spreads_work_honours_pins_counts_five_processes_and_dies_whole(
    tiny, monkeypatch, cleanup
):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    with LLM(str(tiny), max_model_len=128) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    with LLM(str(tiny), max_model_len=128, data_parallel_size=2) as llm:
        tree = titled_processes(os.getpid())
        assert sorted(tree) == ["glassbox::DPCoordinator", "glassbox::EngineCore_DP0", "glassbox::EngineCore_DP1",
                                "glassbox::Worker_DP0_PP0_TP0", "glassbox::Worker_DP1_PP0_TP0"]  # fmt: skip
        for k in (0, 1):
            assert tree[f"glassbox::Worker_DP{k}_PP0_TP0"].ppid() == tree[f"glassbox::EngineCore_DP{k}"].pid
        ps = subprocess.run([sys.executable, "-m", "engine.cli.main", "ps", "--json", "--run-dir", str(llm.run_dir)],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
        info = json.loads(ps.stdout)["instances"][0]
        assert info["expected_process_count"] == 5 and info["found_process_count"] == 5, info

        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        client = llm.engine_core
        stats = client.stats_table.snapshot()
        assert sorted(stats) == [0, 1]
        assert all(s.step_counter > 0 for s in stats.values()), "both engines stepped"
        assert min(client.load_balancer.requests_sent) >= 2, client.load_balancer.requests_sent

        # A request pinned to engine 1 runs there (its outputs say engine_index 1), and
        # starts a wave: engine 0, with nothing to do, runs dummy batches meanwhile.
        waves_before = _wave_over(client)
        before = list(client.load_balancer.requests_sent)
        pinned = EngineCoreRequest(request_id="pinned", prompt_token_ids=[5, 6, 7],
                                   sampling_params=SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                                   eos_token_id=None, arrival_time=time.time(), data_parallel_rank=1)  # fmt: skip
        client.add_request(pinned)
        engines = set()
        while True:
            out = client.get_output()
            engines |= {out.engine_index for o in out.outputs if o.request_id == "pinned"}
            if any(o.request_id == "pinned" and o.finished for o in out.outputs):
                break
        assert engines == {1}
        assert client.load_balancer.requests_sent == [before[0], before[1] + 1]
        waves = _wave_over(client)
        dummy = [w["num_dummy_steps"] - b["num_dummy_steps"] for w, b in zip(waves, waves_before)]
        assert dummy[0] > 0, waves  # the idle engine stepped while engine 1 worked
        assert waves[0]["current_wave"] == waves[1]["current_wave"] > waves_before[0]["current_wave"]
        run_dir = llm.run_dir

        # The coordinator dying is noticed too, even while outputs stream: one root cause.
        os.kill(tree["glassbox::DPCoordinator"].pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError) as err:
            llm.generate(PROMPTS, SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
        assert "DPCoordinator" in err.value.root_cause and "SIGKILL" in err.value.root_cause
    assert got == expected
    assert wait_gone([p.pid for p in tree.values()]) == []
    assert not run_dir.exists()


@pytest.mark.slow
def test_sigkill_of_engine_core_dp1_mid_generate_brings_the_tree_down(tiny, monkeypatch, cleanup):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    llm = LLM(str(tiny), max_model_len=512, data_parallel_size=2)
    try:
        tree = titled_processes(os.getpid())
        assert len(tree) == 5
        victim = tree["glassbox::EngineCore_DP1"]
        params = [SamplingParams(max_tokens=1)] + [SamplingParams(max_tokens=400, ignore_eos=True)] * 3
        killed_at: list[float] = []

        def kill_on_first_finish(done: int, total: int) -> None:
            if done == 1 and not killed_at:
                os.kill(victim.pid, signal.SIGKILL)
                killed_at.append(time.monotonic())

        with pytest.raises(EngineDeadError) as err:
            llm.generate(["a", "b", "c", "d"], params, use_tqdm=kill_on_first_finish)
        assert killed_at and time.monotonic() - killed_at[0] < 5
        assert "EngineCore_DP1" in err.value.root_cause and "SIGKILL" in err.value.root_cause
        # The rest (engine 0, both workers, the coordinator) went down with it.
        assert wait_gone([p.pid for p in tree.values()], timeout=5) == []
    finally:
        llm.shutdown()
    assert not llm.run_dir.exists()


@pytest.mark.slow
def test_serve_dp2_with_one_api_server_is_six_processes_that_answer_and_stop(tmp_path, default_model_dir):
    server = start_server(tmp_path, "--max-model-len", "256", "-dp", "2", "--api-server-count", "1")
    try:
        tree = titled_processes(server.proc.pid, include_self=True)
        assert sorted(tree) == ["glassbox::APIServer_0", "glassbox::DPCoordinator", "glassbox::EngineCore_DP0",
                                "glassbox::EngineCore_DP1", "glassbox::Worker_DP0_PP0_TP0",
                                "glassbox::Worker_DP1_PP0_TP0"]  # fmt: skip
        ps = subprocess.run([sys.executable, "-m", "engine.cli.main", "ps", "--json", "--run-dir",
                             str(server.run_dir)], capture_output=True, text=True, timeout=60)  # fmt: skip
        info = json.loads(ps.stdout)["instances"][0]
        assert info["expected_process_count"] == 6 and info["found_process_count"] == 6, info
        results: list[int] = []

        def complete(i: int) -> None:
            body = {"model": httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"],
                    "prompt": f"Hello {i}", "max_tokens": 16, "ignore_eos": True}  # fmt: skip
            results.append(httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).status_code)

        threads = [threading.Thread(target=complete, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert results == [200] * 6
        metrics = httpx.get(server.base_url + "/metrics").text
        assert 'engine="0"' in metrics and 'engine="1"' in metrics
        pids = [p.pid for p in tree.values()]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(15) == 0
        assert wait_gone(pids) == []
        assert not server.run_dir.exists()
    finally:
        server.kill_group()
