"""``glassbox ps``: run directories read back against real processes.

Each test builds a run directory under ``GLASSBOX_RUN_DIR_BASE`` the way the engine's
processes will: a manifest of the planned tree and one status file per started process.
The pids in them are real processes spawned here — a fake frontend whose children set
``glassbox::<role>`` titles — so psutil, titles and parent links are the real thing. Every
tree runs in its own session and is killed by process group at teardown.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from engine.cli.main import main
from engine.cli.ps import collect_instances

pytestmark = pytest.mark.timeout(60)

# One fake process: sets its title, spawns its subtree, writes its status file, then waits.
# argv: RUN_DIR READY_DIR NODE_JSON, where a node is {"name", "title"?, "status"?, "children"?,
# "exit"?} ("exit": leave once up, unreaped by the parent, which sleeps on).
FAKE_PROCESS = r"""
import json, os, subprocess, sys, time
import setproctitle

run_dir, ready_dir, node = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if node.get("title"):
    setproctitle.setproctitle(node["title"])
kids = [subprocess.Popen([sys.executable, __file__, run_dir, ready_dir, json.dumps(c)])
        for c in node.get("children", [])]
if node.get("status"):
    now = time.time()
    status = {"role": node["name"], "rank": 0, "pid": os.getpid(), "stage_stack": [node["status"]],
              "stage": node["status"], "entered_at": now - 5.0, "updated_at": now, "last_finished": None}
    tmp = os.path.join(run_dir, node["name"] + ".status.json.tmp")
    with open(tmp, "w") as f:
        json.dump(status, f)
    os.replace(tmp, os.path.join(run_dir, node["name"] + ".status.json"))
open(os.path.join(ready_dir, node["name"]), "w").close()
if node.get("exit"):  # gone at once; its parent never waits for it: a zombie
    sys.exit(0)
time.sleep(60)
"""


def _nodes(node: dict) -> list[str]:
    return [node["name"]] + [n for c in node.get("children", []) for n in _nodes(c)]


@pytest.fixture
def base(monkeypatch) -> Path:
    # Short (not under pytest's tmp_path): the sockets inside must fit 107 characters.
    base = Path(tempfile.mkdtemp(prefix="gbps", dir="/tmp"))
    monkeypatch.setenv("GLASSBOX_RUN_DIR_BASE", str(base))
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def spawn_tree(tmp_path):
    """``spawn_tree(run_dir, node)`` starts a process tree and waits until every node is up."""
    script = tmp_path / "fake_process.py"
    script.write_text(FAKE_PROCESS)
    started: list[subprocess.Popen] = []

    def spawn(run_dir: Path, node: dict) -> subprocess.Popen:
        ready = tmp_path / f"ready-{len(started)}"
        ready.mkdir()
        proc = subprocess.Popen(
            [sys.executable, str(script), str(run_dir), str(ready), json.dumps(node)], start_new_session=True
        )
        started.append(proc)
        deadline = time.monotonic() + 20
        while not all((ready / n).exists() for n in _nodes(node)):
            assert proc.poll() is None, f"fake process tree died with exit code {proc.returncode}"
            assert time.monotonic() < deadline, (
                f"fake process tree not up after 20 s: waiting for {_nodes(node)}"
            )
            time.sleep(0.05)
        return proc

    yield spawn
    for proc in started:
        with contextlib.suppress(ProcessLookupError):  # the whole tree: it runs in its own session
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=20)
    return proc.pid


def _run_dir(base: Path, name: str, **manifest: object) -> Path:
    run_dir = base / f"glassbox-{name}"
    run_dir.mkdir()
    (run_dir / "manifest.json").write_text(
        json.dumps({"created_at": time.time(), "run_dir": str(run_dir), **manifest})
    )
    return run_dir


def _ps(capsys, *args: str) -> tuple[int, str]:
    code = main(["ps", *args])
    return code, capsys.readouterr().out


def _ps_json(capsys, *args: str) -> list[dict]:
    code, out = _ps(capsys, "--json", *args)
    assert code == 0
    return json.loads(out)["instances"]


# A TP=3 plan: the engine core and worker TP0 run (TP0 a child of the engine core, next
# to a helper with a plain title), TP1 started and died, TP2 never started.
ROLES = [
    {"role": "LLM", "kind": "frontend"},
    {"role": "EngineCore_DP0", "rank": 0, "kind": "engine_core"},
    {"role": "Worker_DP0_PP0_TP0", "rank": 0, "kind": "worker"},
    {"role": "Worker_DP0_PP0_TP1", "rank": 1, "kind": "worker"},
    {"role": "Worker_DP0_PP0_TP2", "rank": 2, "kind": "worker"},
]
TREE = {
    "name": "LLM",
    "status": "llm.init",
    "children": [
        {
            "name": "EngineCore_DP0",
            "title": "glassbox::EngineCore_DP0",
            "status": "engine_core.handshake",
            "children": [
                {
                    "name": "Worker_DP0_PP0_TP0",
                    "title": "glassbox::Worker_DP0_PP0_TP0",
                    "status": "worker.load_model",
                },
                {"name": "helper"},
            ],
        }
    ],
}


@pytest.fixture
def mp_instance(base, spawn_tree):
    """A live "mp" instance with two of four counted roles up; returns (run_dir, frontend pid, dead pid)."""
    run_dir = base / "glassbox-1-live"
    run_dir.mkdir()
    frontend = spawn_tree(run_dir, TREE)
    dead = _dead_pid()
    (run_dir / "Worker_DP0_PP0_TP1.status.json").write_text(
        json.dumps({"role": "Worker_DP0_PP0_TP1", "rank": 1, "pid": dead, "stage": "worker.init_device",
                    "stage_stack": ["worker.init_device"], "entered_at": time.time() - 3,
                    "updated_at": time.time() - 3, "last_finished": None})
    )  # fmt: skip
    (run_dir / "manifest.json").write_text(
        json.dumps({"created_at": time.time(), "run_dir": str(run_dir), "mode": "mp", "frontend_pid": frontend.pid,
                    "roles": ROLES, "expected_process_count": 4, "api_server_count": 0,
                    "data_parallel_size": 1, "world_size": 3})
    )  # fmt: skip
    return run_dir, frontend.pid, dead


def test_json_lists_found_roles_with_stage_and_names_the_missing(capsys, mp_instance):
    run_dir, frontend_pid, dead = mp_instance
    [inst] = _ps_json(capsys)
    assert inst["run_dir"] == str(run_dir) and inst["mode"] == "mp" and not inst["stale"]
    assert inst["frontend_pid"] == frontend_pid
    rows = {p["role"]: p for p in inst["processes"]}
    assert list(rows) == [r["role"] for r in ROLES]  # the plan's order
    core, worker = rows["EngineCore_DP0"], rows["Worker_DP0_PP0_TP0"]
    assert core["ppid"] == frontend_pid and worker["ppid"] == core["pid"]
    assert core["title"] == "glassbox::EngineCore_DP0"
    assert (core["stage"], worker["stage"]) == ("engine_core.handshake", "worker.load_model")
    assert 4.0 <= core["time_in_stage_s"] < 30  # entered 5 s before the status file was written
    assert core["state"] in ("sleeping", "running") and core["rss_mib"] > 1 and core["threads"] >= 1
    assert rows["LLM"]["pid"] == frontend_pid and not rows["LLM"]["counted"]
    assert (rows["Worker_DP0_PP0_TP1"]["state"], rows["Worker_DP0_PP0_TP2"]["state"]) == (
        "exited",
        "not started",
    )
    assert (inst["found_process_count"], inst["expected_process_count"]) == (2, 4)
    assert inst["missing"] == [
        {"role": "Worker_DP0_PP0_TP1", "reason": f"pid {dead} exited in stage worker.init_device"},
        {"role": "Worker_DP0_PP0_TP2", "reason": "no status file: not started"},
    ]


def test_helper_child_is_shown_apart_and_not_counted(capsys, mp_instance):
    [inst] = _ps_json(capsys)
    core_pid = next(p["pid"] for p in inst["processes"] if p["role"] == "EngineCore_DP0")
    [helper] = inst["helpers"]
    assert helper["ppid"] == core_pid and not helper["counted"] and helper["role"] is None
    assert not helper["title"].startswith("glassbox::")
    assert inst["found_process_count"] == 2  # the helper is not among them


def test_table_shows_tree_counts_and_missing_roles(capsys, mp_instance):
    _, frontend_pid, dead = mp_instance
    code, out = _ps(capsys)
    assert code == 0
    lines = out.splitlines()
    core = next(line for line in lines if "EngineCore_DP0" in line)
    assert "engine_core.handshake" in core and str(frontend_pid) in core
    assert "  Worker_DP0_PP0_TP0" in out  # indented under its engine core
    assert "processes: found 2 of expected 4" in out
    assert f"Worker_DP0_PP0_TP1 (pid {dead} exited in stage worker.init_device)" in out
    assert "Worker_DP0_PP0_TP2 (no status file: not started)" in out
    assert "helpers (not counted)" in out


def test_a_worker_says_how_it_runs_its_model(capsys, mp_instance):
    """Once warm, a worker records device, dtype, compile mode, attention backend, CPU
    threads and its measured speed choices in its status file (``tracing.stage.set_runs_as``); ps shows them in one line."""
    run_dir = mp_instance[0]
    path = run_dir / "Worker_DP0_PP0_TP0.status.json"
    status = json.loads(path.read_text())
    status["runs_as"] = {"device": "cpu", "dtype": "bfloat16", "compile": "compiled (inductor, 1 graph)",
                         "attention": "CPU_PAGED_CPP", "cpu_threads": "1 of 2",
                         "bf16_linear": "native (measured)"}  # fmt: skip
    path.write_text(json.dumps(status))
    code, out = _ps(capsys)
    assert code == 0
    line = ("Worker_DP0_PP0_TP0 runs as: cpu bfloat16, compiled (inductor, 1 graph), attention CPU_PAGED_CPP, "
            "1 of 2 CPU threads, bfloat16 linears native (measured)")  # fmt: skip
    assert line in out
    [inst] = _ps_json(capsys)
    worker = next(p for p in inst["processes"] if p["role"] == "Worker_DP0_PP0_TP0")
    assert worker["runs_as"]["cpu_threads"] == "1 of 2"


def test_role_started_but_without_status_file_is_found_by_title(base, spawn_tree, capsys):
    run_dir = base / "glassbox-2-early"
    run_dir.mkdir()
    tree = {"name": "LLM", "children": [{"name": "EngineCore_DP0", "title": "glassbox::EngineCore_DP0"}]}
    frontend = spawn_tree(run_dir, tree)
    _write = {"mode": "mp", "frontend_pid": frontend.pid, "roles": ROLES[:2], "expected_process_count": 1}
    (run_dir / "manifest.json").write_text(json.dumps({"created_at": time.time(), **_write}))
    [inst] = _ps_json(capsys)
    core = next(p for p in inst["processes"] if p["role"] == "EngineCore_DP0")
    assert core["pid"] is not None and core["ppid"] == frontend.pid and core["stage"] is None
    assert (inst["found_process_count"], inst["missing"], inst["helpers"]) == (1, [], [])


def test_stale_run_dir_hidden_unless_all(base, capsys):
    dead = _dead_pid()
    stale = _run_dir(
        base, f"{dead}-gone", mode="mp", frontend_pid=dead, roles=ROLES[:2], expected_process_count=1
    )
    code, out = _ps(capsys)
    assert code == 0 and "no running glassbox instances" in out and "1 stale run directory hidden" in out
    assert _ps_json(capsys) == []
    [inst] = _ps_json(capsys, "--all")
    assert inst["run_dir"] == str(stale) and inst["stale"]
    assert inst["missing"] == [{"role": "EngineCore_DP0", "reason": "no status file: not started"}]
    code, out = _ps(capsys, "--all")
    assert "stale" in out and str(stale) in out
    [inst] = _ps_json(capsys, "--run-dir", str(stale))  # named explicitly: shown even when stale
    assert inst["stale"]


def test_a_zombie_worker_stays_indented_under_its_engine_core(base, spawn_tree, capsys):
    """Found by a user: a worker that exited but was not yet reaped (a zombie) was printed
    unindented at the root of the tree, as if it were no engine core's."""
    import psutil

    run_dir = base / "glassbox-2-zombie"
    run_dir.mkdir()
    tree = {"name": "LLM", "status": "llm.init", "children": [
        {"name": "EngineCore_DP0", "title": "glassbox::EngineCore_DP0", "status": "engine_core.init", "children": [
            {"name": "Worker_DP0_PP0_TP0", "title": "glassbox::Worker_DP0_PP0_TP0", "status": "worker.load_model",
             "exit": True},
        ]}]}  # fmt: skip
    frontend = spawn_tree(run_dir, tree)
    (run_dir / "manifest.json").write_text(
        json.dumps({"created_at": time.time(), "run_dir": str(run_dir), "mode": "mp", "frontend_pid": frontend.pid,
                    "roles": ROLES[:3], "expected_process_count": 2})
    )  # fmt: skip
    worker_pid = json.loads((run_dir / "Worker_DP0_PP0_TP0.status.json").read_text())["pid"]
    deadline = time.monotonic() + 20
    while psutil.Process(worker_pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the worker did not exit"
        time.sleep(0.05)
    [inst] = _ps_json(capsys)
    rows = {p["role"]: (p["depth"], p["state"] == "zombie") for p in inst["processes"]}
    assert rows == {"LLM": (0, False), "EngineCore_DP0": (1, False), "Worker_DP0_PP0_TP0": (2, True)}
    code, out = _ps(capsys)
    row = next(line for line in out.splitlines() if "Worker_DP0_PP0_TP0" in line)
    assert code == 0 and row.startswith("    Worker_DP0_PP0_TP0 ") and "zombie" in row, out


def test_no_instances_exits_zero_with_message(base, capsys):
    (base / "not-a-run-dir").mkdir()
    assert _ps(capsys) == (
        0,
        f"no running glassbox instances under {base} (set GLASSBOX_RUN_DIR_BASE to where the instance was started)\n",
    )
    assert collect_instances(base, include_stale=True) == []
    # --all looked for stale run directories too, and says it found none either
    assert _ps(capsys, "--all") == (
        0,
        f"no running glassbox instances under {base} (set GLASSBOX_RUN_DIR_BASE to where the instance was started)\n"
        f"no stale run directories under {base} either\n",
    )


def test_bad_run_dir_is_one_line_exit_2(base, capsys):
    with pytest.raises(SystemExit) as e:
        main(["ps", "--run-dir", str(base / "nope")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("glassbox ps: error: --run-dir:") and err.count("\n") == 1


def test_cli_prints_plain_table_when_piped(mp_instance):
    run_dir, _, _ = mp_instance
    env = {**os.environ, "GLASSBOX_RUN_DIR_BASE": str(run_dir.parent)}
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli.main", "ps"], capture_output=True, text=True, timeout=30, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert "\x1b[" not in proc.stdout  # no colour codes in a pipe
    assert "processes: found 2 of expected 4" in proc.stdout


@pytest.mark.parametrize("multiprocess", [False, True], ids=["inproc", "mp"])
def test_ps_sees_a_live_llm(base, capsys, monkeypatch, multiprocess):
    from engine import LLM

    monkeypatch.setenv("GLASSBOX_ENABLE_MULTIPROCESSING", "1" if multiprocess else "0")
    with LLM(max_model_len=64, num_gpu_blocks_override=16) as llm:
        [inst] = _ps_json(capsys)
        assert inst["run_dir"] == str(llm.run_dir) and not inst["stale"]
        assert inst["mode"] == ("mp" if multiprocess else "inproc")
        assert inst["frontend_pid"] == os.getpid()
        rows = {p["role"]: p for p in inst["processes"]}
        assert (rows["LLM"]["pid"], rows["LLM"]["kind"]) == (os.getpid(), "frontend")
        assert rows["LLM"]["last_finished"] == "llm.init"  # written by the real stage helper
        if multiprocess:
            core = rows["EngineCore_DP0"]
            assert core["ppid"] == os.getpid() and core["title"] == "glassbox::EngineCore_DP0"
            assert core["last_finished"] == "engine_core.init" and core["state"] != "zombie"
        else:
            assert list(rows) == ["LLM"]
        assert inst["found_process_count"] == inst["expected_process_count"] >= 1
        assert inst["missing"] == []
        code, table = _ps(capsys)
        if multiprocess:
            # Three rows, two counted: the table says which row is the owner, and why.
            assert code == 0 and "LLM (owner)" in table
            assert f"processes: found 2 of expected 2 (not counted: LLM pid {os.getpid()}, the owner" in table
        else:
            # In-process, the LLM's process is the whole engine: counted, not an owner apart.
            assert "processes: found 1 of expected 1\n" in table and "(owner)" not in table
    code, out = _ps(capsys)
    assert (code, out.startswith(f"no running glassbox instances under {base} ")) == (
        0,
        True,
    )  # run dir removed


def test_new_run_dir_sweeps_away_dead_ones_and_keeps_live_ones(tmp_path, monkeypatch):
    """A tree killed all at once (e.g. its process group SIGKILLed) leaves its run dir; the
    next instance removes it, but never one with a live process."""
    import subprocess as sp
    import sys as _sys

    from engine.utils import run_dir as run_dirs

    monkeypatch.setenv("GLASSBOX_RUN_DIR_BASE", str(tmp_path))
    monkeypatch.setenv("GLASSBOX_CACHE_ROOT", str(tmp_path / "cache"))  # where the post-mortem goes
    dead = sp.run([_sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"glassbox-{dead_pid}-stale"
    stale.mkdir()
    (stale / "EngineCore_DP0.status.json").write_text(f'{{"pid": {dead_pid}}}')
    live = tmp_path / f"glassbox-{os.getpid()}-live"
    live.mkdir()
    fresh = run_dirs.create_run_dir()
    assert not stale.exists()
    assert live.exists() and fresh.exists()
    # What a post-mortem needs of the swept one is kept first (glassbox doctor --last reads it).
    kept = tmp_path / "cache" / "post_mortem" / stale.name
    assert (kept / "EngineCore_DP0.status.json").read_text() == f'{{"pid": {dead_pid}}}'


def test_a_glassbox_process_the_plan_does_not_name_is_listed_as_extra(base, spawn_tree, capsys):
    run_dir = base / "glassbox-2-extra"
    run_dir.mkdir()
    tree = {"name": "LLM", "status": "llm.init", "children": [
        {"name": "EngineCore_DP0", "title": "glassbox::EngineCore_DP0", "status": "engine_core.init", "children": [
            {"name": "Worker_DP0_PP0_TP0", "title": "glassbox::Worker_DP0_PP0_TP0", "status": "worker.load_model"},
            {"name": "Worker_DP0_PP0_TP7", "title": "glassbox::Worker_DP0_PP0_TP7", "status": "worker.load_model"},
        ]}]}  # fmt: skip
    frontend = spawn_tree(run_dir, tree)
    (run_dir / "manifest.json").write_text(
        json.dumps({"created_at": time.time(), "run_dir": str(run_dir), "mode": "mp", "frontend_pid": frontend.pid,
                    "roles": ROLES[:3], "expected_process_count": 2, "api_server_count": 0,
                    "data_parallel_size": 1, "world_size": 1})
    )  # fmt: skip
    [inst] = _ps_json(capsys, "--run-dir", str(run_dir))
    assert [e["role"] for e in inst["extra"]] == ["Worker_DP0_PP0_TP7"]
    assert (inst["found_process_count"], inst["expected_process_count"], inst["missing"]) == (3, 2, [])
    code, table = _ps(capsys, "--run-dir", str(run_dir))
    assert "extra: Worker_DP0_PP0_TP7 (pid" in table and "not in the plan" in table


def test_a_manifest_written_by_the_engine_reads_as_the_old_one_did(capsys, mp_instance):
    """The engine's adapter writes richer entries (ranks, title, counted); ps shows the same."""
    from engine.config import ParallelConfig
    from engine.distributed import topology
    from engine.utils import run_dir as run_dirs

    run_dir, frontend_pid, _ = mp_instance
    keys = (
        "role",
        "kind",
        "pid",
        "ppid",
        "state",
        "counted",
        "planned",
        "note",
        "rank",
        "stage",
        "title",
        "depth",
    )

    def view() -> dict:
        [inst] = _ps_json(capsys)
        rows = [{k: p[k] for k in keys} for p in inst["processes"]]
        return {k: inst[k] for k in ("mode", "frontend_pid", "expected_process_count", "missing", "extra",
                                     "found_process_count", "stale")} | {"rows": rows}  # fmt: skip

    old = view()
    plan = topology.plan(ParallelConfig(tensor_parallel_size=3, distributed_executor_backend="mp"))
    assert [r.name for r in plan.roles] == [r["role"] for r in ROLES]
    run_dirs.write_manifest(run_dir, **{**run_dirs.plan_tree(plan), "frontend_pid": frontend_pid})
    assert (
        json.loads((run_dir / "manifest.json").read_text())["roles"][2]["title"]
        == "glassbox::Worker_DP0_PP0_TP0"
    )
    assert view() == old


def test_the_collector_alone_keeps_role_names_opaque(base, spawn_tree):
    """Without the engine, a role the manifest does not describe has kind ``unknown`` and is
    not counted; ``glassbox ps`` reads its kind off the name through the topology."""
    from engine.cli import ps
    from tracing import instances

    run_dir = base / "glassbox-2-opaque"
    run_dir.mkdir()
    tree = {"name": "LLM", "children": [
        {"name": "EngineCore_DP0", "title": "glassbox::EngineCore_DP0", "status": "engine_core.init", "children": [
            {"name": "Worker_DP0_PP0_TP7", "title": "glassbox::Worker_DP0_PP0_TP7", "status": "worker.load_model"},
        ]}]}  # fmt: skip
    frontend = spawn_tree(run_dir, tree)
    (run_dir / "manifest.json").write_text(
        json.dumps({"created_at": time.time(), "mode": "mp", "frontend_pid": frontend.pid,
                    "roles": ROLES[:2], "expected_process_count": 1})
    )  # fmt: skip
    bare, viewed = instances.collect_instance(run_dir), ps.collect_instance(run_dir)
    assert [(p.role, p.kind, p.counted) for p in bare.extra] == [("Worker_DP0_PP0_TP7", "unknown", False)]
    assert [(p.role, p.kind, p.counted) for p in viewed.extra] == [("Worker_DP0_PP0_TP7", "worker", True)]
    assert ps.to_json([viewed])["instances"][0]["extra"][0]["role"] == "Worker_DP0_PP0_TP7"
