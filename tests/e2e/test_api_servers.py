"""Several API servers: ``--api-server-count A``, default the DP size.

APIServer_0 binds the listening socket, launches the engine cores and the coordinator, then
starts APIServer_1..A-1 on the same socket; each attaches to every engine core with its own
sockets. Checked on the real tree:

- ``serve -dp 2`` is 2 + 2 + 2 + 1 = 7 titled processes that ``glassbox ps`` counts as
  expected; concurrent requests are answered by both API servers (their access-log lines
  carry their role), each answer is its own request's (``echo`` gives the prompt back), the
  ``/metrics`` answer is the same whichever server gives it, and a terminal's Ctrl-C (SIGINT
  to the whole process group) stops everything with exit 0 and no root-cause block.
- ``serve --api-server-count 2``: SIGKILL of APIServer_1 brings the tree down within 5 s,
  with one root-cause block, printed last, naming it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from proc_utils import titled_processes, wait_gone
from server_utils import start_server

pytestmark = pytest.mark.slow


def _complete(base_url: str, model: str, prompt: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "echo": True, "temperature": 0}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _served_by(log: str) -> dict[str, int]:
    """Access-log lines of /v1/completions per API server role."""
    counts: dict[str, int] = {}
    for role in re.findall(r"^\((APIServer_\d+) pid=\d+\).*\"POST /v1/completions ", log, re.M):
        counts[role] = counts.get(role, 0) + 1
    return counts


def test_serve_dp2_runs_two_api_servers_that_share_the_port_and_stop_on_ctrl_c(tmp_path, default_model_dir):
    server = start_server(tmp_path, "--max-model-len", "256", "-dp", "2")
    try:
        tree = titled_processes(server.proc.pid, include_self=True)
        assert sorted(tree) == ["glassbox::APIServer_0", "glassbox::APIServer_1", "glassbox::DPCoordinator",
                                "glassbox::EngineCore_DP0", "glassbox::EngineCore_DP1",
                                "glassbox::Worker_DP0_PP0_TP0", "glassbox::Worker_DP1_PP0_TP0"]  # fmt: skip
        ps = subprocess.run([sys.executable, "-m", "engine.cli.main", "ps", "--json", "--run-dir",
                             str(server.run_dir)], capture_output=True, text=True, timeout=60)  # fmt: skip
        info = json.loads(ps.stdout)["instances"][0]
        assert info["expected_process_count"] == 7 and info["found_process_count"] == 7, info

        model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
        answers: dict[str, dict] = {}
        # The kernel hands each new connection to whichever server accepts first: send
        # rounds of concurrent requests (one connection each) until both have answered.
        for round_ in range(6):
            prompts = [f"Request {round_}-{i} says" for i in range(8)]
            threads = [
                threading.Thread(
                    target=lambda p=p: answers.__setitem__(p, _complete(server.base_url, model, p))
                )
                for p in prompts
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
            served = _served_by(server.log())
            if len(served) == 2:
                break
        assert set(served) == {"APIServer_0", "APIServer_1"}, served
        assert sum(served.values()) == len(answers)
        for prompt, answer in answers.items():  # each answer is its own request's
            assert answer["choices"][0]["text"].startswith(prompt), (prompt, answer)

        # Both servers hold every engine's stats: once idle, every scrape says the same.
        def scrape() -> str:
            text = httpx.get(server.base_url + "/metrics").text
            return "\n".join(line for line in text.splitlines() if line.startswith("vllm:"))

        deadline = time.monotonic() + 10
        while True:
            scrapes = {scrape() for _ in range(6)}
            if len(scrapes) == 1 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(scrapes) == 1, scrapes
        (metrics,) = scrapes
        assert 'engine="0"' in metrics and 'engine="1"' in metrics
        assert re.search(r'vllm:num_requests_running\{engine="0",model_name="[^"]+"\} 0.0', metrics), metrics

        pids = [p.pid for p in tree.values()]
        os.killpg(server.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
        assert server.proc.wait(15) == 0, server.log()[-3000:]
        assert wait_gone(pids) == []
        assert not server.run_dir.exists()
        assert "root cause" not in server.log()
    finally:
        server.kill_group()


def test_sigkill_of_the_second_api_server_brings_the_tree_down(tmp_path, default_model_dir):
    server = start_server(tmp_path, "--max-model-len", "256", "--api-server-count", "2")
    try:
        tree = titled_processes(server.proc.pid, include_self=True)
        assert sorted(tree) == ["glassbox::APIServer_0", "glassbox::APIServer_1", "glassbox::EngineCore_DP0",
                                "glassbox::Worker_DP0_PP0_TP0"]  # fmt: skip
        victim = tree["glassbox::APIServer_1"]
        pids = [p.pid for p in tree.values()]
        victim.kill()
        killed_at = time.monotonic()
        assert wait_gone(pids, timeout=5.0) == [], "the tree outlived APIServer_1 by 5 s"
        assert time.monotonic() - killed_at < 5.0
        assert server.proc.wait(5) == 1
        log = server.log().rstrip()
        block = log[log.rindex("Glassbox root cause") :]
        assert "process:   APIServer_1" in block and "SIGKILL" in block
        assert log.endswith("=" * 69)  # the root cause is printed last
        assert log.count("Glassbox root cause") == 1
        assert not server.run_dir.exists()
    finally:
        server.kill_group()
