"""Multi-node data parallelism: a head and headless nodes, on loopback.

vLLM's layout: the head runs ``serve -dp D --data-parallel-size-local K0
--data-parallel-address HOST --data-parallel-rpc-port P`` (API server, coordinator, ranks
0..K0-1); each other node runs ``serve --headless ... --data-parallel-start-rank R`` (its
engine cores only), which join the head over TCP. Here both "nodes" are separate process
trees on 127.0.0.1, each with its own run directory base and session.

Fast: the flags are checked in the first process, one line naming the flag.
Slow (real trees, the bundled model): requests are served by both ranks and ``glassbox ps``
on each node counts its own tree; SIGKILL of the headless tree → the head names rank 1 lost
and stops (vLLM's DP engines are all or nothing), nothing of either tree left. A rank that
never joins is named at the deadline; the head then stops, and the headless node that had
joined exits 0 (the head told it), leaving nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from proc_utils import session_members, wait_gone
from server_utils import Node, free_port_block, start_server

from engine.config import ConfigError
from engine.engine_args import EngineArgs

GLASSBOX = [sys.executable, "-m", "engine.cli.main"]


# ---------------------------------------------------------------------- fast: the flags


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"headless": True, "data_parallel_size": 2, "data_parallel_start_rank": 1}, "--data-parallel-address"),
        ({"data_parallel_size": 2, "data_parallel_size_local": 1}, "--data-parallel-address"),
        ({"headless": True, "data_parallel_size": 2, "data_parallel_start_rank": 1,
          "data_parallel_size_local": 2, "data_parallel_address": "127.0.0.1"}, "--data-parallel-start-rank"),
        ({"headless": True, "data_parallel_size": 2, "data_parallel_address": "127.0.0.1"},
         "--data-parallel-start-rank"),
        ({"data_parallel_size": 2, "data_parallel_start_rank": 1, "data_parallel_address": "h"},
         "--data-parallel-start-rank"),
        ({"data_parallel_size": 2, "data_parallel_size_local": 3}, "--data-parallel-size-local"),
        ({"data_parallel_size": 2, "data_parallel_size_local": 1, "data_parallel_address": "h",
          "data_parallel_rpc_port": 70000}, "--data-parallel-rpc-port"),
    ],
)  # fmt: skip
def test_multi_node_flags_are_checked_first_with_one_line_naming_the_flag(kwargs, flag):
    with pytest.raises(ConfigError) as err:
        EngineArgs(**kwargs).create_engine_config("serve")
    assert str(err.value).startswith(flag) and "\n" not in str(err.value)
    if flag == "--data-parallel-address" and len(kwargs) == 3:  # and from the CLI: exit 2, one line
        proc = subprocess.run([*GLASSBOX, "serve", "--headless", "-dp", "2", "--data-parallel-start-rank", "1"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert "--data-parallel-address" in proc.stderr.strip().splitlines()[-1], proc.stderr


def test_each_node_plans_only_its_own_ranks():
    from engine.distributed import topology

    head = EngineArgs(data_parallel_size=4, data_parallel_size_local=2, data_parallel_address="h",
                      tensor_parallel_size=2).create_engine_config("serve")  # fmt: skip
    plan = topology.plan(head, frontend="serve")
    # A defaults to the local DP size (vLLM): 2 API servers + 2 engine cores + 4 workers + 1 coordinator.
    assert plan.describe() == "2 API servers + 2 engine cores + 4 workers + 1 coordinator = 9"
    assert [r.name for r in plan.remote_engine_cores] == ["EngineCore_DP2", "EngineCore_DP3"]
    assert len(plan.engine_cores) == 4  # the ranks its clients talk to
    node = EngineArgs(data_parallel_size=4, data_parallel_start_rank=2, headless=True, data_parallel_address="h",
                      tensor_parallel_size=2).create_engine_config("serve")  # fmt: skip
    plan = topology.plan(node, frontend="headless")
    assert [r.name for r in plan.roles] == ["HeadlessNode", "EngineCore_DP2", "Worker_DP2_PP0_TP0",
                                            "Worker_DP2_PP0_TP1", "EngineCore_DP3", "Worker_DP3_PP0_TP0",
                                            "Worker_DP3_PP0_TP1"]  # fmt: skip
    assert (
        plan.expected_process_count == 6 and not plan.is_counted(plan.owner) and not plan.remote_engine_cores
    )
    assert topology.ProcessRole.parse("HeadlessNode").kind is topology.RoleKind.HEADLESS


def test_an_offline_llm_refuses_multi_node_dp():
    with pytest.raises(ConfigError, match="^--data-parallel-size-local: .*glassbox serve"):
        EngineArgs(
            data_parallel_size=2, data_parallel_size_local=1, data_parallel_address="h"
        ).create_engine_config()


# ---------------------------------------------------------------------- slow: two trees


@pytest.fixture
def short_tmp():
    """A short directory: run-directory bases must leave room for ipc socket paths (107 bytes)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="gbmn-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _ps(run_dir: Path) -> dict:
    out = subprocess.run([*GLASSBOX, "ps", "--json", "--run-dir", str(run_dir)], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    return json.loads(out.stdout)["instances"][0]


@pytest.mark.slow
def test_head_and_headless_node_serve_together_and_the_head_names_the_rank_it_lost(short_tmp):
    tmp_path = short_tmp
    port = free_port_block()
    node = Node(
        tmp_path / "node",
        port,
        "--max-model-len",
        "256",
        "-dp",
        "2",
        "--data-parallel-start-rank",
        "1",
        "--step-delay-ms",
        "40",
    )
    head = None
    try:
        head = start_server(tmp_path / "head", "--max-model-len", "256", "-dp", "2", "--data-parallel-size-local",
                            "1", "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port))  # fmt: skip
        # Each node's `glassbox ps` shows its own tree: the head 1 API server + DP0 + its worker
        # + the coordinator; the headless node DP1 + its worker (its launcher shown, not counted).
        head_ps, node_ps = _ps(head.run_dir), _ps(node.run_dir())
        assert (head_ps["expected_process_count"], head_ps["found_process_count"]) == (4, 4), head_ps
        assert {p["role"] for p in head_ps["processes"]} == {"APIServer_0", "EngineCore_DP0", "Worker_DP0_PP0_TP0",
                                                            "DPCoordinator"}  # fmt: skip
        assert node_ps["mode"] == "headless"
        assert (node_ps["expected_process_count"], node_ps["found_process_count"]) == (2, 2), node_ps
        assert [p["role"] for p in node_ps["processes"]] == [
            "HeadlessNode",
            "EngineCore_DP1",
            "Worker_DP1_PP0_TP0",
        ]

        model = httpx.get(head.base_url + "/v1/models").json()["data"][0]["id"]
        codes: list[int] = []

        def complete(i: int) -> None:
            body = {"model": model, "prompt": f"Hello {i}", "max_tokens": 8, "ignore_eos": True}
            codes.append(httpx.post(head.base_url + "/v1/completions", json=body, timeout=60).status_code)

        threads = [threading.Thread(target=complete, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert codes == [200] * 6
        metrics = httpx.get(head.base_url + "/metrics").text
        served = {
            line.split('engine="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("vllm:generation_tokens_total{")
        }
        assert served.get("0", 0) > 0 and served.get("1", 0) > 0, served  # both ranks generated

        # A second node claiming rank 1 is refused at once, naming the flag (it was silently
        # ignored by the head's ROUTER while node identities were their ranks: a fresh user's find).
        twin = Node(
            tmp_path / "twin", port, "--max-model-len", "256", "-dp", "2", "--data-parallel-start-rank", "1"
        )
        try:
            assert twin.proc.wait(60) != 0
            assert "rank 1 joined already" in twin.log(), twin.log()[-2000:]
        finally:
            twin.kill_group()
        assert head.proc.poll() is None  # the head serves on

        head_sid, node_sid = head.proc.pid, node.proc.pid  # each leads its own session
        # Two long requests in flight (one per engine: the second sees the first counted on
        # engine 0; rank 1 steps slowly, --step-delay-ms), then the headless node dies whole.
        long_codes: list[int] = []

        def long_request() -> None:
            body = {"model": model, "prompt": "long", "max_tokens": 200, "ignore_eos": True}
            try:
                long_codes.append(
                    httpx.post(head.base_url + "/v1/completions", json=body, timeout=60).status_code
                )
            except httpx.HTTPError:
                long_codes.append(-1)  # the server went away before answering

        longs = [threading.Thread(target=long_request) for _ in range(2)]
        for t in longs:
            t.start()
            time.sleep(0.2)
        time.sleep(0.5)
        killed_at = time.monotonic()
        os.killpg(node_sid, signal.SIGKILL)
        assert head.proc.wait(20) == 1, head.log()[-3000:]
        assert time.monotonic() - killed_at < 15
        for t in longs:
            t.join(30)
        assert len(long_codes) == 2 and any(code != 200 for code in long_codes), long_codes
        log = head.log()
        assert "Lost data-parallel rank(s) 1 (EngineCore_DP1)" in log, log[-3000:]
        root = log[log.rindex("Glassbox root cause") :]
        assert "EngineCore_DP1 (rank 1)" in root and "lost:" in root, root
        assert wait_gone(session_members(head_sid) + session_members(node_sid), timeout=10) == []
        assert not head.run_dir.exists()
    finally:
        node.kill_group()
        if head is not None:
            head.kill_group()


@pytest.mark.slow
def test_a_rank_that_never_joins_is_named_and_a_joined_headless_node_leaves_with_the_head(short_tmp):
    tmp_path = short_tmp
    port = free_port_block()
    env = {"GLASSBOX_DP_JOIN_TIMEOUT_S": "10"}
    head_log = tmp_path / "head.log"
    with open(head_log, "wb") as log:
        head = subprocess.Popen(
            [*GLASSBOX, "serve", "--port", "0", "--max-model-len", "256", "-dp", "3", "--data-parallel-size-local",
             "1", "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "GLASSBOX_RUN_DIR_BASE": str(tmp_path / "head"), **env},
        )  # fmt: skip
    node = Node(
        tmp_path / "node",
        port,
        "--max-model-len",
        "256",
        "-dp",
        "3",
        "--data-parallel-start-rank",
        "1",
        "-dpl",
        "1",
        env=env,
    )
    try:
        assert head.wait(60) == 1, head_log.read_text()[-3000:]
        text = head_log.read_text()
        assert "Data-parallel rank 1 joined" in text, text[-3000:]
        assert "Data-parallel rank(s) 2 (EngineCore_DP2) never joined" in text, text[-3000:]
        assert "GLASSBOX_DP_JOIN_TIMEOUT_S=10 s" in text
        # The joined node heard the head stop: it exits 0 and leaves nothing behind.
        assert node.proc.wait(30) == 0, node.log()[-3000:]
        assert "the head stopped" in node.log() or "stops" in node.log(), node.log()[-3000:]
        assert wait_gone(session_members(head.pid) + session_members(node.proc.pid), timeout=10) == []
        left = list((tmp_path / "node").glob("glassbox-*"))
        assert not left, ("the node's run directory is removed", [p.name for p in left[0].rglob("*")])
    finally:
        node.kill_group()
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        head.wait(10)
