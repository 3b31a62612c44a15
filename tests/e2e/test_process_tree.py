"""The engine as a process tree: the user's process → EngineCore_DP0 → Worker_DP0_PP0_TP0.

Greedy tokens through the tree equal the in-process engine's; the tree has exactly the
titled processes the manifest plans; and nothing is ever left behind — not after SIGKILL
of the user's process, not after SIGKILL of the worker mid-generate, not after a script
forgets to shut down. Kills are triggered by events (a request finishing, a line printed),
never by sleeps; every test kills what it started.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from proc_utils import titled_processes, wait_gone
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams
from engine.utils.processes import EngineDeadError

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": list(range(7, 7 + n))} for n in (3, 20, 41, 64)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tree"), "llama", tie_word_embeddings=True,
                                 tokenizer_dir=default_model_dir)  # fmt: skip


@pytest.fixture
def cleanup():
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for child in psutil.Process().children(recursive=True):
        child.kill()


def test_tree_gives_the_in_process_tokens_and_has_two_titled_children(tiny, monkeypatch):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    with LLM(str(tiny), max_model_len=128) as llm:
        inproc = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    with LLM(str(tiny), max_model_len=128) as llm:
        tree = titled_processes(os.getpid())
        assert sorted(tree) == ["glassbox::EngineCore_DP0", "glassbox::Worker_DP0_PP0_TP0"]
        core, worker = tree["glassbox::EngineCore_DP0"], tree["glassbox::Worker_DP0_PP0_TP0"]
        assert core.ppid() == os.getpid() and worker.ppid() == core.pid
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        ps = subprocess.run([sys.executable, "-m", "engine.cli.main", "ps", "--json"], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
        run_dir = llm.run_dir
    assert got == inproc
    assert ps.returncode == 0, ps.stderr
    mine = [i for i in json.loads(ps.stdout)["instances"] if i["run_dir"] == str(run_dir)]
    assert len(mine) == 1
    assert mine[0]["expected_process_count"] == 2 and mine[0]["found_process_count"] == 2
    assert mine[0]["missing"] == []
    assert not run_dir.exists()
    assert wait_gone([core.pid, worker.pid]) == []


def test_uni_backend_has_one_titled_child(tiny, monkeypatch):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    with LLM(str(tiny), max_model_len=128, distributed_executor_backend="uni") as llm:
        assert list(titled_processes(os.getpid())) == ["glassbox::EngineCore_DP0"]
        assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_sigkill_of_worker_mid_generate_raises_engine_dead_error(tiny, monkeypatch, cleanup):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    llm = LLM(str(tiny), max_model_len=512)
    try:
        tree = titled_processes(os.getpid())
        core, worker = tree["glassbox::EngineCore_DP0"], tree["glassbox::Worker_DP0_PP0_TP0"]
        params = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=400, ignore_eos=True)]

        def kill_worker_on_first_finish(done: int, total: int) -> None:
            if done == 1:
                os.kill(worker.pid, signal.SIGKILL)

        start = time.monotonic()
        with pytest.raises(EngineDeadError) as err:
            llm.generate(["a", "b"], params, use_tqdm=kill_worker_on_first_finish)
        assert time.monotonic() - start < 10
        assert "Worker_DP0_PP0_TP0" in err.value.root_cause
        assert "SIGKILL" in err.value.root_cause
        assert wait_gone([core.pid, worker.pid]) == []
    finally:
        llm.shutdown()
    assert not llm.run_dir.exists()


USER_SCRIPT = """
import os, sys, time
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=512)
print("RUN_DIR", llm.run_dir, flush=True)
out = llm.generate(["a"], SamplingParams(max_tokens=2))
print("GENERATED", flush=True)
if sys.argv[2] == "wait":
    time.sleep(120)
elif sys.argv[2] == "generate-forever":
    llm.generate(["b"] * 4, SamplingParams(max_tokens=500, ignore_eos=True))
# "exit": leave without shutdown(): interpreter exit must clean up
"""


def _start_script(tmp_path, tiny, mode, cleanup) -> tuple[subprocess.Popen, Path]:
    script = tmp_path / "user_script.py"  # no `if __name__ == "__main__":` guard, on purpose
    script.write_text(textwrap.dedent(USER_SCRIPT))
    proc = subprocess.Popen([sys.executable, str(script), str(tiny), mode], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    cleanup.append(proc)
    first = proc.stdout.readline()
    assert first.startswith("RUN_DIR"), first
    assert proc.stdout.readline().startswith("GENERATED")
    return proc, Path(first.split()[1])


def test_sigkill_of_user_process_leaves_nothing_behind(tmp_path, tiny, cleanup):
    proc, run_dir = _start_script(tmp_path, tiny, "wait", cleanup)
    children = [p.pid for p in titled_processes(proc.pid).values()]
    assert len(children) == 2
    assert any(run_dir.glob("*.sock")) and (run_dir / "manifest.json").exists()
    proc.send_signal(signal.SIGKILL)
    proc.wait(5)
    assert wait_gone(children) == []
    deadline = time.monotonic() + 5
    while run_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not run_dir.exists(), "the run directory (sockets, shared memory) must go with the tree"


def test_script_without_main_guard_and_without_shutdown_cleans_up_at_exit(tmp_path, tiny, cleanup):
    proc, run_dir = _start_script(tmp_path, tiny, "exit", cleanup)
    children = [p.pid for p in titled_processes(proc.pid).values()]
    assert proc.wait(30) == 0
    assert wait_gone(children) == []
    assert not run_dir.exists()


def test_ctrl_c_during_generate_stops_the_tree(tmp_path, tiny, cleanup):
    proc, run_dir = _start_script(tmp_path, tiny, "generate-forever", cleanup)
    children = [p.pid for p in titled_processes(proc.pid).values()]
    proc.send_signal(signal.SIGINT)
    proc.wait(10)
    assert wait_gone(children) == []
    assert not run_dir.exists()


def test_ready_deadline_names_the_late_process_and_its_stage(tiny, monkeypatch):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    monkeypatch.setenv("GLASSBOX_ENGINE_READY_TIMEOUT_S", "1.5")
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(TimeoutError) as err:
        LLM(str(tiny), max_model_len=128)
    message = str(err.value)
    assert "GLASSBOX_ENGINE_READY_TIMEOUT_S=1.5" in message
    assert ("EngineCore_DP0" in message) or ("Worker_DP0_PP0_TP0" in message)
    assert ("in stage" in message) or ("has not started" in message)
    leftovers = [p.pid for p in set(psutil.Process().children(recursive=True)) - before]
    assert wait_gone(leftovers) == []


def test_an_engine_that_never_said_hello_is_named_with_its_pid(tiny, monkeypatch):
    # 0.2 s: the engine core is still importing torch, before its status file exists; the
    # client that spawned it knows its pid all the same.
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    monkeypatch.setenv("GLASSBOX_ENGINE_READY_TIMEOUT_S", "0.2")
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(TimeoutError) as err:
        LLM(str(tiny), max_model_len=128)
    root = err.value.root_cause
    # Usually it never said HELLO by then (no status file yet); a fast machine may get past it.
    assert "process:   EngineCore_DP0" in root, root
    pid = re.search(r"^pid:\s+(\S+)$", root, re.M)[1]
    assert pid.isdigit() and int(pid) != os.getpid(), root
    assert f"EngineCore_DP0 (pid {pid})" in str(err.value), root
    leftovers = [p.pid for p in set(psutil.Process().children(recursive=True)) - before]
    assert wait_gone(leftovers) == []
