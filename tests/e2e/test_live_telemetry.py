"""Live telemetry from a real tree: what engine-top's collector sees.

- During start-up (a worker held with SIGSTOP while it is in a start-up stage, found from its
  status file): every process is listed with the stage it is in — the API server waiting
  for the engine's READY, the worker in its stage; the frozen worker's heartbeat goes stale.
- Serving under load (chunked prefills: ``--max-num-batched-tokens 64``): step records with
  prefill and decode tokens and a budget of 64, request events through to ``finished``, the
  engine core's and API server's gauges, the broadcast queue's positions.
- A worker SIGKILLed: shown dead, with the signal, as the tree goes down.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_utils import start_server

from tracing import run_dir as contract
from tracing.telemetry import events
from tracing.telemetry.collector import Collector

pytestmark = pytest.mark.slow


def _complete(base_url: str, model: str, prompt: str, max_tokens: int) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    return httpx.post(base_url + "/v1/completions", json=body, timeout=120).status_code


@pytest.fixture
def short_base():
    """A run-directory base with a short path: ipc socket paths are limited to 107 characters."""
    base = Path(tempfile.mkdtemp(prefix="gbt", dir="/tmp"))
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_serving_tree_publishes_steps_requests_gauges_and_deaths(short_base, default_model_dir):
    server = start_server(short_base, "--max-model-len", "512", "--max-num-batched-tokens", "64")
    try:
        with Collector(server.run_dir, refresh_s=0.2) as collector:
            roles = ["APIServer_0", "EngineCore_DP0", "Worker_DP0_PP0_TP0"]
            state = collector.wait_until(
                lambda s: all(s.processes.get(r) and s.processes[r].heartbeat_at for r in roles), 15
            )
            assert all(state.processes[r].state == "running" for r in roles), state.to_json()["processes"]

            model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
            # First one long prompt alone, on an idle engine: its chunked prefill steps are
            # published whole (step records are sampled once over 50 a second, and a fast
            # engine's later chunks could be sampled away).
            assert _complete(server.base_url, model, "word " * 150, 2) == 200
            codes: list[int] = []
            threads = [
                threading.Thread(target=lambda i=i: codes.append(
                    _complete(server.base_url, model, "word " * (40 + 30 * i), 24)))
                for i in range(4)
            ]  # fmt: skip
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert codes == [200] * 4

            def served(s) -> bool:
                steps = list(s.steps.get(0, ()))
                finished = [r for r in s.requests.values() if r.state == "finished"]
                return (
                    any(st.num_prefill_tokens > 0 for st in steps)
                    and any(st.num_decode_tokens > 0 for st in steps)
                    and len(finished) >= 4
                )

            state = collector.wait_until(served, 15)
            steps = list(state.steps[0])
            assert all(st.token_budget == 64 and st.tokens_scheduled <= 64 for st in steps)
            assert any(st.num_chunked_prefills > 0 for st in steps), "prompts over 64 tokens come in chunks"
            for st in steps:
                assert st.tokens_scheduled == st.num_prefill_tokens + st.num_decode_tokens
                assert st.schedule_ms + st.execute_ms + st.update_ms <= st.duration_ms + 0.01
            finished = [r for r in state.requests.values() if r.state == "finished"]
            assert {r.reason for r in finished} == {"length"} and all(r.engine_index == 0 for r in finished)
            # Each carries its final counts (its finished event's, not a snapshot's taken up
            # to a second before): the prompt and every output token but the last computed.
            assert {r.num_output_tokens for r in finished} <= {2, 24}, [
                dataclasses.asdict(r) for r in finished
            ]
            assert all(
                r.num_computed_tokens == r.num_prompt_tokens + r.num_output_tokens - 1 for r in finished
            )

            engine = state.processes["EngineCore_DP0"].gauges
            assert engine[events.GAUGE_KV_TOTAL] > 0 and engine[events.GAUGE_KV_USED] >= 0
            assert engine[events.GAUGE_MQ_WRITTEN] > 0 and f"{events.GAUGE_MQ_READER_PREFIX}0" in engine
            api = state.processes["APIServer_0"].gauges
            assert {events.GAUGE_API_IN_FLIGHT, events.GAUGE_API_WAITING_FOR_ENGINE} <= set(api)
            # The worker's gauges come with its next heartbeat (once a second).
            state = collector.wait_until(
                lambda s: s.processes["Worker_DP0_PP0_TP0"].gauges.get(events.GAUGE_WORKER_STEP, 0) > 0, 5
            )

            # A worker killed: shown dead with its signal, as the tree goes down.
            worker = state.processes["Worker_DP0_PP0_TP0"]
            os.kill(worker.pid, signal.SIGKILL)
            # psutil sees a zombie first; the engine core, its parent, then says how it ended.
            state = collector.wait_until(
                lambda s: "SIGKILL" in (s.processes["Worker_DP0_PP0_TP0"].exit_description or ""), 10
            )
            assert state.processes["Worker_DP0_PP0_TP0"].state == "dead"
        assert server.proc.wait(15) == 1
    finally:
        server.kill_group()


def test_engine_top_once_json_names_each_process_stage_during_start_up(short_base, default_model_dir):
    """A worker SIGSTOPped in a start-up stage holds the tree in start-up: ``engine-top --once
    --json`` names the stage every process is in."""
    base = short_base
    # The frozen worker is watched for no longer than this test: the tree must stay in start-up.
    env = {**os.environ, "GLASSBOX_RUN_DIR_BASE": str(base), "GLASSBOX_STOPPED_TIMEOUT_S": "600"}
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "serve", "--port", "0", "--max-model-len", "256"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)  # fmt: skip
    worker_pid = None
    try:
        deadline = time.monotonic() + 60
        while worker_pid is None:
            assert time.monotonic() < deadline and proc.poll() is None, "the worker never started"
            for status_path in base.glob("glassbox-*/Worker_DP0_PP0_TP0.status.json"):
                status = contract.read_status(status_path)
                if status is not None and status.stage and status.pid:
                    worker_pid = status.pid
                    os.kill(worker_pid, signal.SIGSTOP)  # held in whatever start-up stage it is in
            time.sleep(0.02)
        (run_dir,) = list(base.glob("glassbox-*"))
        held = contract.read_status(contract.status_path(run_dir, "Worker_DP0_PP0_TP0")).stage
        time.sleep(4)  # the frozen worker's heartbeat goes stale (3 s)
        top = subprocess.run([sys.executable, "-m", "tui", "--once", "--json", "--run-dir", str(run_dir)],
                             capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
        assert top.returncode == 0, top.stderr
        state = json.loads(top.stdout)
        processes = {p["role"]: p for p in state["processes"].values()} if isinstance(state["processes"], dict) \
            else {p["role"]: p for p in state["processes"]}  # fmt: skip
        assert processes["APIServer_0"]["stage"] == "engine_core.handshake"
        assert processes["EngineCore_DP0"]["stage"] is not None
        assert processes["Worker_DP0_PP0_TP0"]["stage"] == held
        assert processes["Worker_DP0_PP0_TP0"]["state"] == "stale"
    finally:
        if worker_pid is not None:
            try:
                os.kill(worker_pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        for leftover in base.glob("glassbox-*"):
            contract.remove_run_dir(Path(leftover))
