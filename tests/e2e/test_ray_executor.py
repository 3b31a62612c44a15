"""The Ray executor (``--distributed-executor-backend ray``): workers as Ray actors.

The fast test checks the one-line error without Ray. The slow ones run real Ray on this
host: ``-tp 2`` on a Ray instance the engine core starts itself gives transformers' greedy
tokens (as the mp executor does) through actors titled like mp workers, counted by
``glassbox ps`` with where Ray placed them, and
stops Ray after; on a Ray instance this test starts (the engine core joins it through
``RAY_ADDRESS``), SIGKILL of one actor's process fails the engine with Ray's death cause
in the root-cause block, and the actors and their placement group are gone after.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from proc_utils import generate_killing_on_first_finish, titled_processes, wait_gone
from tiny_models import hf_greedy

from engine import LLM, SamplingParams
from engine.config import ConfigError, ParallelConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [list(range(7, 7 + n)) for n in (3, 20, 41)]
WORKERS = ["glassbox::Worker_DP0_PP0_TP0", "glassbox::Worker_DP0_PP0_TP1"]


def test_ray_backend_without_ray_is_one_line_naming_the_flag_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails, as when not installed
    with pytest.raises(ConfigError) as err:
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray")
    message = str(err.value)
    assert err.value.flag == "--distributed-executor-backend"
    assert "\n" not in message
    assert message.startswith("--distributed-executor-backend: ")
    assert 'pip install -e ".[ray]" in the Glassbox checkout' in message


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tp2_on_ray_equals_transformers_through_titled_actors_and_ray_stops_after(
    tiny_dir, monkeypatch, reap_children
):
    pytest.importorskip("ray")
    path = tiny_dir("llama", num_heads=4, num_kv_heads=2)
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # The reference is transformers (the mp executor equals it in test_tensor_parallel.py):
    # one engine start fewer than comparing with an mp engine here.
    expected = [hf_greedy(path, p, GREEDY.max_tokens) for p in PROMPTS]
    with LLM(
        str(path),
        max_model_len=128,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        enforce_eager=True,
    ) as llm:
        assert llm.config.parallel_config.distributed_executor_backend == "ray"
        tree = titled_processes(os.getpid())
        core = tree["glassbox::EngineCore_DP0"]
        # The actors are the raylet's children (Ray started them), below the engine core that
        # started Ray, and hold the titles of mp workers.
        workers = [tree[title] for title in WORKERS]
        assert all(core.pid in {p.pid for p in w.parents()} for w in workers)
        assert all(w.ppid() != core.pid for w in workers)
        got = _generate(llm)
        ps = subprocess.run([sys.executable, "-m", "engine.cli.main", "ps", "--json"], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
        assert ps.returncode == 0, ps.stderr
        mine = [i for i in json.loads(ps.stdout)["instances"] if i["run_dir"] == str(llm.run_dir)]
        assert len(mine) == 1
        assert mine[0]["expected_process_count"] == 3 and mine[0]["found_process_count"] == 3
        assert mine[0]["missing"] == []
        # Each worker says where Ray placed it: actor id and node, from its status file.
        placed = {p["role"]: p["placement"] for p in mine[0]["processes"] if p["role"].startswith("Worker_")}
        assert len(placed) == 2 and all(pl["actor_id"] and pl["node_ip"] for pl in placed.values()), placed
        text = subprocess.run([sys.executable, "-m", "engine.cli.main", "ps", "--run-dir", str(llm.run_dir)],
                              capture_output=True, text=True, timeout=60).stdout  # fmt: skip
        assert f"Ray actor {placed['Worker_DP0_PP0_TP1']['actor_id'][:8]} on node" in text, text
        ray_procs = [p.pid for p in core.children(recursive=True)]
        run_dir = llm.run_dir
    assert got == expected
    # The executor started Ray, so it stopped it: actors, raylet and GCS gone with the core.
    assert wait_gone([core.pid, *(w.pid for w in workers), *ray_procs], timeout=15) == []
    assert not run_dir.exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigkill_of_one_actor_fails_the_engine_with_rays_death_cause(tiny_dir, monkeypatch, reap_children):
    ray = pytest.importorskip("ray")
    path = tiny_dir("llama", num_heads=4, num_kv_heads=2)
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's Unix sockets live under its temporary directory: a short one (pytest's are too long).
    ray_temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False,
             _temp_dir=ray_temp)  # fmt: skip
    try:
        # The engine core (its own process) joins this test's Ray instance.
        monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        llm = LLM(
            str(path),
            max_model_len=512,
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            enforce_eager=True,
        )
        try:
            tree = titled_processes(os.getpid())
            core = tree["glassbox::EngineCore_DP0"]
            workers = [tree[title] for title in WORKERS]
            error, elapsed = generate_killing_on_first_finish(llm, workers[1].pid)
            assert elapsed < 15
            root = error.root_cause
            assert "Worker_DP0_PP0_TP1" in root
            assert "the Ray actor died" in root
            assert "Ray: The actor is dead because its worker process has died" in root
        finally:
            llm.shutdown()
        assert not llm.run_dir.exists()
        assert wait_gone([core.pid, *(w.pid for w in workers)], timeout=15) == []
        # This test's Ray outlives the engine (it did not start it), without its placement group.
        assert ray.is_initialized()
        groups = ray.util.placement_group_table().values()
        assert all(g["state"] == "REMOVED" for g in groups), list(groups)
    finally:
        ray.shutdown()
        shutil.rmtree(ray_temp, ignore_errors=True)


def test_a_ray_address_where_nothing_listens_is_one_line_naming_it():
    import socket

    from engine.config import ConfigError, check_ray_address

    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match="RAY_ADDRESS.*no Ray cluster answers there"):
            check_ray_address(f"127.0.0.1:{port}", timeout_s=2)
    check_ray_address("auto")  # left to Ray
