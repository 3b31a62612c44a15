"""CPU workers' torch threads: ``GLASSBOX_CPU_OMP_THREADS_BIND`` is parsed
and checked in the first process, each worker applies its thread count and CPU affinity in its
own process before its first torch op, every child starts with OpenMP's passive wait policy
unless the user chose one, and the engine core never loads torch (it does no math)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from tiny_models import build_tiny_checkpoint

from engine import LLM, SamplingParams, envs
from engine.config import ConfigError
from engine.utils.processes import OPENMP_WAIT_ADAPTIVE, OPENMP_WAIT_DEFAULTS, openmp_wait_env
from engine.worker.cpu.cpu_threads import CpuThreadPlan, _cpu_ranges, plan_cpu_threads

BIND = "GLASSBOX_CPU_OMP_THREADS_BIND"


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("auto", "auto"),
        (" NoBind ", "nobind"),
        ("0-1", ((0, 1),)),
        ("0-1|2-3", ((0, 1), (2, 3))),
        ("0,2|1,3", ((0, 2), (1, 3))),
        ("3", ((3,),)),
        ("0-2,1", ((0, 1, 2),)),
    ],
)
def test_good_values_parse(monkeypatch, value, parsed):
    monkeypatch.setenv(BIND, value)
    assert parsed == envs.GLASSBOX_CPU_OMP_THREADS_BIND


def test_unset_is_auto(monkeypatch):
    monkeypatch.delenv(BIND, raising=False)
    assert envs.GLASSBOX_CPU_OMP_THREADS_BIND == "auto"


@pytest.mark.parametrize("value", ["0-x", "3-1", "-1", "0 1", "0-1||2-3", "all", "0-1|"])
def test_bad_values_name_the_variable(monkeypatch, value):
    monkeypatch.setenv(BIND, value)
    with pytest.raises(ValueError, match=BIND):
        envs.validate_all()


def test_a_bad_value_is_one_line_exit_2_and_nothing_starts(tmp_path):
    env = {**os.environ, BIND: "0-x", "GLASSBOX_RUN_DIR_BASE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "engine.cli.main", "generate", "hi", "--max-tokens", "1"],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and BIND in lines[0] and "0-x" in lines[0], lines
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- the plan


def test_auto_one_worker_takes_every_usable_cpu_unpinned():
    assert plan_cpu_threads("auto", 0, 1, {0, 1}, None, own_process=True) == CpuThreadPlan(
        2, None, "auto: 2 usable CPUs, 1 worker(s)"
    )


def test_auto_shares_cpus_between_workers_and_pins_each():
    usable = {0, 1, 2, 3, 4}
    plans = [plan_cpu_threads("auto", i, 2, usable, None, own_process=True) for i in range(2)]
    assert [(p.num_threads, p.cpus) for p in plans] == [(3, (0, 1, 2)), (2, (3, 4))]


def test_auto_with_no_more_cpus_than_workers_gives_one_thread_each_unpinned():
    for workers in (2, 3):
        plan = plan_cpu_threads("auto", 1, workers, {0, 1}, None, own_process=True)
        assert (plan.num_threads, plan.cpus) == (1, None)


def test_auto_respects_the_users_omp_num_threads():
    plan = plan_cpu_threads("auto", 0, 1, {0, 1, 2, 3}, "1", own_process=True)
    assert plan.num_threads == 1 and "OMP_NUM_THREADS=1" in plan.why
    assert plan_cpu_threads("auto", 0, 1, {0, 1}, "junk", own_process=True).num_threads == 2


def test_auto_leaves_the_callers_process_alone():
    assert plan_cpu_threads("auto", 0, 1, {0, 1}, None, own_process=False).placement == (None, None)


def test_nobind_changes_nothing():
    assert plan_cpu_threads("nobind", 0, 1, {0, 1}, None, own_process=True).placement == (None, None)


def test_lists_pin_each_worker_to_its_own_with_a_thread_per_cpu():
    bind = ((0, 1), (2, 3))
    assert plan_cpu_threads(bind, 1, 2, {0, 1, 2, 3}, "8", own_process=False).placement == (2, (2, 3))


def test_lists_too_short_or_unusable_cpus_are_config_errors():
    with pytest.raises(ConfigError, match=f"{BIND}.*2 workers but 1 list"):
        plan_cpu_threads(((0,),), 1, 2, {0, 1}, None, own_process=True)
    with pytest.raises(ConfigError, match=f"{BIND}.*CPU 7 is not one this process may use"):
        plan_cpu_threads(((0, 7),), 0, 1, {0, 1}, None, own_process=True)


def test_cpu_ranges_read_back():
    assert _cpu_ranges((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"


# ---------------------------------------------------------------- OpenMP wait policy at spawn


def _wait_settings(env: dict[str, str]) -> str:
    """How the worker's log line shows its OpenMP wait variables."""
    return f"OMP_WAIT_POLICY={env.get('OMP_WAIT_POLICY', 'unset')}, GOMP_SPINCOUNT={env.get('GOMP_SPINCOUNT', 'unset')}"


def test_children_get_the_short_wait_unless_the_user_chose():
    # Adaptive threads (the default): a short spin, libgomp's default is 300,000.
    assert openmp_wait_env({}) == OPENMP_WAIT_ADAPTIVE == {"GOMP_SPINCOUNT": "10000"}
    assert openmp_wait_env({BIND: "0-1"}) == OPENMP_WAIT_ADAPTIVE
    # A fixed thread count: sleep at once, or a taken core stalls the team.
    fixed = {"GLASSBOX_CPU_ADAPTIVE_THREADS": "0"}
    assert openmp_wait_env(fixed) == OPENMP_WAIT_DEFAULTS == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert openmp_wait_env({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert openmp_wait_env({"GOMP_SPINCOUNT": "300000", **fixed}) == {}
    assert openmp_wait_env({"KMP_BLOCKTIME": "200"}) == {}
    assert openmp_wait_env({BIND: "nobind"}) == {}


# ---------------------------------------------------------------- in a real process tree


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("threads"), "llama", tie_word_embeddings=True,
                                 tokenizer_dir=default_model_dir)  # fmt: skip


def _tree(llm) -> tuple[psutil.Process, psutil.Process]:
    core = psutil.Process(llm.engine_core.engine_proc.pid)
    (worker,) = core.children()
    return core, worker


def _loads_torch(proc: psutil.Process) -> bool:
    return "libtorch" in Path(f"/proc/{proc.pid}/maps").read_text()


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_worker_applies_a_cpu_list_and_the_engine_core_never_loads_torch(tiny, monkeypatch, capfd):
    cpu = min(os.sched_getaffinity(0))
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    monkeypatch.setenv(BIND, str(cpu))
    with LLM(str(tiny), max_model_len=128) as llm:
        out = llm.generate([{"prompt_token_ids": [7, 8, 9]}], SamplingParams(temperature=0, max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4
        core, worker = _tree(llm)
        assert worker.cpu_affinity() == [cpu]
        assert _loads_torch(worker) and not _loads_torch(core)
        # What glassbox ps / doctor show of how the worker runs (its status file, once warm).
        from tracing import run_dir as contract

        status = contract.read_status(contract.status_path(llm.run_dir, "Worker_DP0_PP0_TP0"))
        assert status is not None and status.runs_as["device"] == "cpu"
        assert (
            status.runs_as["cpu_threads"] == "1"
            and status.runs_as["compile"] == "compiled (inductor, 1 graph)"
        )
    # (The worker's environment is read from its own log line: setproctitle overwrites
    # /proc/<pid>/environ.)
    err = capfd.readouterr().err
    line = f"Worker rank 0: 1 torch thread(s) on CPUs {cpu} ({BIND}={cpu} for this worker); "
    assert line + _wait_settings(OPENMP_WAIT_ADAPTIVE) in err, err[-3000:]


@pytest.mark.slow
def test_the_users_openmp_settings_are_respected(tiny, monkeypatch, capfd):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    monkeypatch.delenv(BIND, raising=False)  # auto
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with LLM(str(tiny), max_model_len=128) as llm:
        llm.generate([{"prompt_token_ids": [7, 8, 9]}], SamplingParams(temperature=0, max_tokens=2))
    err = capfd.readouterr().err
    assert re.search(r"Worker rank 0: 1 torch thread\(s\) on CPUs \S+ \(auto: \d+ usable CPUs, 1 worker\(s\), "
                     r"OMP_NUM_THREADS=1\); OMP_WAIT_POLICY=ACTIVE, GOMP_SPINCOUNT=unset", err), err[-3000:]  # fmt: skip
    assert "step_threads: 1 (forced by OMP_NUM_THREADS=1)" in err, err[-3000:]  # not timed


@pytest.mark.slow
def test_on_defaults_the_worker_times_its_threads_and_compiled_step_and_runs_as_it_chose(tiny, monkeypatch):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1")
    for name in (BIND, "OMP_NUM_THREADS", "GLASSBOX_TORCH_COMPILE"):
        monkeypatch.delenv(name, raising=False)
    with LLM(str(tiny), max_model_len=128) as llm:
        out = llm.generate([{"prompt_token_ids": [7, 8, 9]}], SamplingParams(temperature=0, max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4
        from tracing import run_dir as contract

        runs_as = contract.read_status(contract.status_path(llm.run_dir, "Worker_DP0_PP0_TP0")).runs_as
    # Each verdict says how it was reached: timed now, or an earlier start's timing read back.
    threads, how = runs_as["step_threads"].split(" ", 1)
    assert how in ("(measured)", "(cached)", "(the only candidate)"), runs_as
    # The worker runs with at most what it chose ("N of M" while its governor follows the load).
    assert runs_as["cpu_threads"].split(" of ")[-1] == threads, runs_as
    mode, how = runs_as["compiled_step"].split(" ", 1)
    assert how in ("(measured)", "(cached)") and mode in ("compiled", "eager"), runs_as
    assert runs_as["compile"].startswith("compiled (") == (mode == "compiled"), runs_as


@pytest.mark.slow
def test_a_served_tree_loads_torch_in_the_worker_only(tmp_path):
    """The API server and the engine core do no math: torch's libraries are never mapped in
    them, even after a request (so they have no OpenMP threads to count or to spin)."""
    import httpx
    from proc_utils import titled_processes
    from server_utils import start_server

    server = start_server(tmp_path, "--max-model-len", "256")
    try:
        reply = httpx.post(server.base_url + "/v1/completions", timeout=60,
                           json={"prompt": "Return the", "max_tokens": 4, "temperature": 0})  # fmt: skip
        assert reply.status_code == 200, reply.text
        tree = titled_processes(server.proc.pid, include_self=True)
        loads = {title: _loads_torch(proc) for title, proc in tree.items()}
        assert loads == {
            "glassbox::APIServer_0": False,
            "glassbox::EngineCore_DP0": False,
            "glassbox::Worker_DP0_PP0_TP0": True,
        }
    finally:
        server.kill_group()


@pytest.mark.slow
def test_a_cpu_the_worker_may_not_use_is_one_line_exit_2(tmp_path):
    """Found in the worker (where the usable CPUs are known), reported like a bad flag."""
    bad = max(os.sched_getaffinity(0)) + 1 if hasattr(os, "sched_getaffinity") else 4096
    env = {**os.environ, BIND: str(bad), "GLASSBOX_RUN_DIR_BASE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "engine.cli.main", "generate", "hi", "--max-tokens", "1"],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert BIND in last and f"CPU {bad} is not one this process may use" in last, last


def test_an_engine_in_the_callers_process_gets_the_short_openmp_wait_before_torch_loads():
    # libgomp reads its wait variables once, when torch loads it: InprocClient sets them first
    # where it still can, and leaves a process that loaded torch (or chose) alone.
    code = (
        "import os, sys\n"
        "from engine.utils.processes import use_openmp_wait_here\n"
        "first = use_openmp_wait_here()\n"
        "import torch\n"
        "os.environ.pop('GOMP_SPINCOUNT', None)\n"
        "print(first, use_openmp_wait_here(), os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
    }
    env.pop("GLASSBOX_CPU_ADAPTIVE_THREADS", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.strip() == "{'GOMP_SPINCOUNT': '10000'} {} None", done.stderr[-2000:]
    chose = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**env, "OMP_WAIT_POLICY": "ACTIVE"})  # fmt: skip
    assert chose.stdout.strip() == "{} {} None", chose.stderr[-2000:]


def test_an_engine_in_the_callers_process_keeps_the_callers_threads_and_follows_the_load_below_them(
    tiny, monkeypatch, caplog
):
    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "0")
    monkeypatch.delenv(BIND, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    from engine.model.cpu.op_threads import get_op_threads, set_op_threads

    before = torch.get_num_threads()
    set_op_threads(1)  # what an earlier engine of this process chose: not the caller's count
    with LLM(str(tiny), max_model_len=128, enforce_eager=True) as llm:
        llm.generate([{"prompt_token_ids": [7, 8, 9]}], SamplingParams(temperature=0, max_tokens=2))
    assert torch.get_num_threads() == before  # the caller's count, untouched
    assert get_op_threads() == before  # and no choice of this engine's left behind for the next one
    if before >= 2:
        assert (
            "in the caller's process: left as they are, fewer while other processes take CPUs" in caplog.text
        )
