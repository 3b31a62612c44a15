"""Expert parallelism (``--enable-expert-parallel``): the experts split over DP × TP ranks, and the
DP engines in lockstep because every forward's all-to-alls need every rank.

Fast tests check what is decided before anything starts (a dense model, experts that do not
split, pipeline parallelism, another executor: each refused naming its flag), the coordinator
leaving the end of a wave to the engines, and the engines' side of the lockstep against a real
one-rank gloo group (a wave ends only at a sync step at which no engine has work; engine 0
says so). The slow ones run the real tree: ``-dp 2 --enable-expert-parallel`` gives
transformers' greedy tokens with both engines busy and with one idle (its dummy batches join
the all-to-alls; both engines end the wave together); ``-dp 2 -tp 2`` too, each of four
workers holding two of eight experts.
"""

from __future__ import annotations

import time
import types

import pytest
from tiny_models import hf_greedy

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.core.coordinator import DPCoordinator
from engine.core.coordinator_messages import (
    CoordinatorSpawnPayload,
    DPWave,
    EngineLoad,
    EngineToCoordinator,
    StartWave,
    WaveComplete,
    coordinator_addresses,
    decode_as,
    wave_address,
)
from engine.core.messages import EngineCoreRequest
from engine.engine_args import EngineArgs

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [list(range(7, 7 + n)) for n in (3, 20, 41, 9)]


# ---------------------------------------------------------------------- fast: the pieces


@pytest.mark.parametrize(
    "arch, kwargs, flag, reason",
    [
        ("llama", dict(data_parallel_size=2), "--enable-expert-parallel", "has no experts"),
        ("mixtral", dict(data_parallel_size=3), "--enable-expert-parallel", "4 experts do not split evenly"),
        ("mixtral", dict(pipeline_parallel_size=2), "--pipeline-parallel-size", "without pipeline"),
        (
            "mixtral",
            dict(data_parallel_size=2, distributed_executor_backend="uni"),
            "--distributed-executor-backend",
            "use mp",
        ),  # fmt: skip
        ("mixtral", dict(data_parallel_size=2, tensor_parallel_size=2), None, None),
    ],
)
def test_expert_parallel_is_checked_in_the_first_process(tiny_dir, monkeypatch, arch, kwargs, flag, reason):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    path = tiny_dir(arch, num_experts=4) if arch != "llama" else tiny_dir(arch)
    args = EngineArgs(model=str(path), max_model_len=64, enable_expert_parallel=True, **kwargs)
    if flag is None:
        pc = args.create_engine_config().parallel_config
        assert (pc.expert_parallel_size, pc.world_size_across_dp, pc.expert_parallel_across_dp) == (
            4,
            4,
            True,
        )
        return
    with pytest.raises(ConfigError, match=reason) as err:
        args.create_engine_config()
    assert err.value.flag == flag


def test_the_first_process_picks_the_two_meeting_ports_once(tiny_dir, monkeypatch):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    pc = EngineArgs(model=str(tiny_dir("mixtral")), data_parallel_size=2, enable_expert_parallel=True,
                    max_model_len=64).create_engine_config().parallel_config  # fmt: skip
    assert pc.data_parallel_master_port is None
    pc.assign_dp_ports()
    ports = (pc.data_parallel_master_port, pc.data_parallel_worker_port)
    assert all(ports) and ports[0] != ports[1]
    pc.assign_dp_ports()
    assert (pc.data_parallel_master_port, pc.data_parallel_worker_port) == ports


def test_with_expert_parallelism_the_coordinator_leaves_the_end_of_a_wave_to_the_engines(tmp_path):
    engines_to_coordinator, to_clients = coordinator_addresses(tmp_path)
    coordinator = DPCoordinator(CoordinatorSpawnPayload(
        input_address=engines_to_coordinator, publish_address=to_clients, data_parallel_size=2,
        wave_address=wave_address(tmp_path), engines_end_waves=True))  # fmt: skip
    sent: list[DPWave] = []
    coordinator._send_wave = sent.append
    try:
        coordinator.handle(StartWave(engine_index=1, wave=0))
        assert sent == [DPWave(wave=0, running=True, exclude_engine=1)]
        coordinator.handle(EngineLoad(engine_index=1, num_waiting=0, num_running=1))
        coordinator.handle(EngineLoad(engine_index=1, num_waiting=0, num_running=0))
        # Both at zero, but an engine told to stop now could still be needed in an all-to-all.
        assert coordinator.engines_running and len(sent) == 1
        coordinator.handle(WaveComplete(engine_index=0, wave=0))
        assert not coordinator.engines_running and coordinator.current_wave == 1
        coordinator.handle(StartWave(engine_index=0, wave=1))
        coordinator.handle(WaveComplete(engine_index=0, wave=0))  # late news of the old wave: ignored
        assert coordinator.engines_running and coordinator.current_wave == 1
    finally:
        coordinator.close()


@pytest.fixture
def one_rank_dp_group():
    """A real gloo DP group of one engine core (the all-reduce is then this engine's own answer)."""
    from engine.distributed.parallel_state import get_distributed_init_method, stateless_init_dp_group

    return stateless_init_dp_group(get_distributed_init_method(), 0, 1, timeout_s=10, op_timeout_s=10)


def test_lockstep_engines_run_one_forward_a_turn_and_end_a_wave_only_at_a_sync_step(one_rank_dp_group):
    from engine.core.engine_core_proc import DP_WAVE_SYNC_STEPS, EngineCoreProc

    engine = EngineCoreProc.__new__(EngineCoreProc)
    engine.data_parallel_rank, engine.current_wave, engine.engines_running = 0, 0, True
    engine.dp_group, engine.wave_step, engine._coordinator_backlog = one_rank_dp_group, 0, []
    sent: list[bytes] = []
    engine.coordinator_socket = types.SimpleNamespace(send=lambda data, flags=0: sent.append(data))
    work = [True]
    engine.scheduler = types.SimpleNamespace(has_requests=lambda: work[0])
    dummies: list[int] = []
    engine._dummy_step = lambda: dummies.append(engine.wave_step)

    for _ in range(DP_WAVE_SYNC_STEPS):  # busy: its own steps, no dummy batch; the sync sees work
        engine._lockstep_turn(stepped=True)
    assert engine.engines_running and dummies == [] and sent == []
    work[0] = False
    for _ in range(DP_WAVE_SYNC_STEPS - 1):  # idle now: a dummy batch a turn, the wave goes on
        engine._lockstep_turn(stepped=False)
    assert engine.engines_running and len(dummies) == DP_WAVE_SYNC_STEPS - 1
    engine._lockstep_turn(stepped=False)  # the sync step: nobody has work, the wave ends here
    assert not engine.engines_running and engine.current_wave == 1 and engine.wave_step == 0
    assert [decode_as(EngineToCoordinator, m) for m in sent] == [WaveComplete(engine_index=0, wave=0)]
    engine._lockstep_turn(stepped=False)  # outside a wave: nothing runs
    assert len(dummies) == DP_WAVE_SYNC_STEPS


# ---------------------------------------------------------------------- slow: the real tree


def _generate(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _wave_over(client) -> list[dict]:
    deadline = time.monotonic() + 30
    while True:
        waves = client.call_utility_each("get_dp_state")
        if not any(w["engines_running"] for w in waves):
            return waves
        assert time.monotonic() < deadline, waves
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dp2_expert_parallel_equals_transformers_busy_and_with_one_engine_idle(tiny_dir, monkeypatch,
                                                                                reap_children):  # fmt: skip
    path = tiny_dir("mixtral", num_heads=4, num_kv_heads=2, num_experts=4)
    expected = [hf_greedy(path, p, GREEDY.max_tokens) for p in PROMPTS]
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    with LLM(str(path), max_model_len=128, data_parallel_size=2, enable_expert_parallel=True,
             max_num_batched_tokens=16) as llm:  # fmt: skip
        client = llm.engine_core
        assert _generate(llm) == expected  # both engines busy, prompts prefilled in chunks
        assert min(client.load_balancer.requests_sent) >= 1

        # One request pinned to engine 1: engine 0 has nothing, yet its dummy batches join
        # every all-to-all, and both engines end the wave together.
        before = _wave_over(client)
        comm_before = client.call_utility_each("get_worker_comm_stats")
        request = EngineCoreRequest(request_id="pinned", prompt_token_ids=PROMPTS[2], sampling_params=GREEDY,
                                    eos_token_id=None, arrival_time=time.time(), data_parallel_rank=1)  # fmt: skip
        client.add_request(request)
        tokens, engines = [], set()
        while True:
            out = client.get_output()
            for o in out.outputs:
                if o.request_id == "pinned":
                    tokens += o.new_token_ids
                    engines.add(out.engine_index)
            if any(o.request_id == "pinned" and o.finished for o in out.outputs):
                break
        assert tokens == expected[2] and engines == {1}
        after = _wave_over(client)
        assert after[0]["num_dummy_steps"] > before[0]["num_dummy_steps"]  # the idle engine stepped
        assert after[0]["current_wave"] == after[1]["current_wave"] > before[0]["current_wave"]
        comm = client.call_utility_each("get_worker_comm_stats")
        for engine_before, engine_after in zip(comm_before, comm):  # each engine's one worker
            assert engine_after[0]["all_to_all_calls"] > engine_before[0]["all_to_all_calls"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dp2_tp2_expert_parallel_equals_transformers(tiny_dir, monkeypatch, reap_children):
    # 8 experts over 4 ranks (2 engines × 2 TP workers): two whole experts on each.
    path = tiny_dir("qwen3_moe", num_heads=4, num_kv_heads=2, num_experts=8)
    expected = [hf_greedy(path, p, GREEDY.max_tokens) for p in PROMPTS]
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    with LLM(str(path), max_model_len=128, data_parallel_size=2, tensor_parallel_size=2,
             enable_expert_parallel=True, max_num_batched_tokens=16) as llm:  # fmt: skip
        assert _generate(llm) == expected


# ---------------------------------------------------------------------- slow: what a person sees


@pytest.fixture(scope="module")
def ep_server(tmp_path_factory):
    """``glassbox serve`` on the bundled mixture of experts, ``-dp 2 --enable-expert-parallel``
    (float32, for transformers' tokens), with each MoE phase a span in a trace file."""
    import tempfile
    from pathlib import Path

    from server_utils import start_server

    from engine.config import MOE_MODEL

    base = Path(tempfile.mkdtemp(prefix="gbep", dir="/tmp"))  # short: ipc paths ≤ 107 chars
    trace = base / "spans.jsonl"
    server = start_server(base, "--model", MOE_MODEL, "-dp", "2", "--enable-expert-parallel", "--dtype",
                          "float32", "--max-model-len", "512", "--api-server-count", "1",
                          "--collect-detailed-traces", "model", "--trace-file", str(trace),
                          "--uvicorn-log-level", "warning", timeout=240)  # fmt: skip
    try:
        yield server, trace
    finally:
        server.kill_group()
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def _complete(server, prompt: str, max_tokens: int = 16) -> dict:
    import httpx

    body = {"model": "glassbox-tiny-moe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_ep_answers_transformers_text_and_shows_experts_spans_and_memory(ep_server):
    """One request at a time, so one engine is always idle; then what a person sees of it: the
    start-up log's memory split, engine-top's experts, the MoE phases' spans."""
    import json
    import re
    import subprocess
    import sys

    from tokenizers import Tokenizer

    from engine.config import MOE_MODEL

    server, trace = ep_server
    tokenizer = Tokenizer.from_file(f"{MOE_MODEL}/tokenizer.json")
    for prompt in ("The following", "This module"):
        expected = tokenizer.decode(hf_greedy(MOE_MODEL, tokenizer.encode(prompt).ids, 16))
        assert _complete(server, prompt)["choices"][0]["text"] == expected

    log = server.log()
    for worker, experts in (
        ("Worker_DP0_PP0_TP0", "experts 0-1 of 4"),
        ("Worker_DP1_PP0_TP0", "experts 2-3 of 4"),
    ):
        line = next(ln for ln in log.splitlines() if worker in ln and "Memory of rank" in ln)
        assert f"KV cache 1024.0 MiB, routed experts 4.1 MiB ({experts} in each of 4 layers" in line, line

    top = subprocess.run([sys.executable, "-m", "tui", "--once", "--run-dir", str(server.run_dir)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert top.returncode == 0, top.stderr
    # the experts panel: each rank's experts, each one's share of its rows, the rank's load
    for worker, experts in (("Worker_DP0_PP0_TP0", r"0-1 of 4\s+e0 \d+%  e1 \d+%"),
                            ("Worker_DP1_PP0_TP0", r"2-3 of 4\s+e2 \d+%  e3 \d+%")):  # fmt: skip
        assert re.search(rf"{worker}\s+{experts}\s+█*·*\s+\d+%", top.stdout), top.stdout

    spans = [json.loads(line) for line in trace.read_text().splitlines() if '"moe.' in line]
    dispatch = [s for s in spans if s["name"] == "moe.dispatch"]
    assert {s["resource"]["glassbox.role"] for s in dispatch} == {"Worker_DP0_PP0_TP0", "Worker_DP1_PP0_TP0"}
    assert all("glassbox.moe.collective_ms" in s["attributes"] for s in dispatch)
    assert {s["name"] for s in spans} == {"moe.router", "moe.dispatch", "moe.experts", "moe.combine"}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_engine_top_in_tmux_shows_each_ranks_experts_and_all_to_all_time(ep_server):
    """engine-top in a real terminal (tmux) attached to the expert-parallel server: ``e`` pressed
    until the experts panel fills the screen, which shows each rank's experts, their shares of
    its rows and its time in the all-to-alls."""
    import os
    import re
    import shlex
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    server, _ = ep_server
    root = Path(__file__).resolve().parents[2]
    session = f"gbep{os.getpid()}"
    exit_file = server.run_dir.parent / "top.exit"

    def tmux(*args: str) -> str:
        return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=10).stdout

    def wait_screen(predicate, what: str, timeout_s: float = 60) -> str:
        deadline = time.monotonic() + timeout_s
        screen = ""
        while time.monotonic() < deadline:
            screen = tmux("capture-pane", "-p", "-t", session)
            if predicate(screen):
                return screen
            _complete(server, "The following", 4)  # traffic: rows for the experts, all-to-alls
        raise AssertionError(f"engine-top never showed {what}; last screen:\n{screen}")

    env = (
        f"GLASSBOX_RUN_DIR_BASE={shlex.quote(str(server.run_dir.parent))} PYTHONPATH={shlex.quote(str(root))}"
    )
    command = (f"env -u COLUMNS -u LINES {env} {shlex.quote(sys.executable)} -m tui; "
               f"echo $? > {shlex.quote(str(exit_file))}")  # fmt: skip
    try:
        tmux("new-session", "-d", "-s", session, "-x", "200", "-y", "60", command)
        tmux("resize-window", "-t", session, "-x", "200", "-y", "60")
        wait_screen(lambda s: re.search(r"Worker_DP1_PP0_TP0\s+\d+\s+running", s), "the tree running")
        for _ in range(views_index_of_experts()):  # e, e, ...: the experts panel fills the screen
            tmux("send-keys", "-t", session, "e")
        rows = (r"Worker_DP0_PP0_TP0\s+0-1 of 4\s+e0 \d+%\s+e1 \d+%.*\d+\.\d+ · \d+%",
                r"Worker_DP1_PP0_TP0\s+2-3 of 4\s+e2 \d+%\s+e3 \d+%.*\d+\.\d+ · \d+%")  # fmt: skip
        # each rank's row once its worker's gauges have reached this engine-top (each link
        # connects on its own, so one rank's row may come a heartbeat before the other's)
        wait_screen(lambda s: "rows by expert" in s and all(re.search(row, s) for row in rows),
                    "both ranks' experts, with the all-to-all times")  # fmt: skip
        tmux("send-keys", "-t", session, "q")
        deadline = time.monotonic() + 15
        while not exit_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert exit_file.read_text().strip() == "0"
    finally:
        tmux("kill-session", "-t", session)


def views_index_of_experts() -> int:
    """``e`` presses from the full screen to the experts panel alone."""
    from tui import views

    return views.PANELS.index("experts") + 1
