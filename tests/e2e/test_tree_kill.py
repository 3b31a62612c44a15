"""SIGKILL of one worker deep in a ``-tp 2 -dp 2`` serving tree takes the whole tree down.

``glassbox serve --tensor-parallel-size 2 --data-parallel-size 2`` is A API servers + 2
engine cores + 4 workers + 1 DPCoordinator (A defaults to the DP size; the test reads every
role and pid from the run directory's manifest and status files, so it does not depend on
A). Once the server answers /health, ``Worker_DP1_PP0_TP1`` — the last worker of the second
engine, two levels below the API server — is SIGKILLed while idle. Then:

- every process the manifest plans is gone within 5 s of the kill (no orphan, however a
  process dies);
- the server exits non-zero, and the last thing on its stderr is one root-cause block
  naming ``Worker_DP1_PP0_TP1`` and SIGKILL;
- the run directory is removed, and with it the shared-memory queues (``*.mq`` ring
  files and their wake-up FIFOs) that lived in it.

The same holds on a loaded machine when the dead engine core is slow to stop (the last test).

The server is started here rather than with ``server_utils.start_server`` because that
helper merges stderr into stdout, and the root cause must be the last thing on *stderr*.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
from proc_utils import wait_gone
from server_utils import Server

from engine.distributed.topology import ProcessRole, RoleKind
from engine.utils.run_dir import planned_roles, status_file
from tracing.run_dir import read_status

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

VICTIM = ProcessRole.worker(1, 0, 1)  # Worker_DP1_PP0_TP1
TREE_GONE_DEADLINE_S = 5.0  # the whole tree is gone this soon after the kill
START_TIMEOUT_S = 120.0


def _start_server(base: Path, *args: str) -> tuple[Server, Path]:
    """``glassbox serve --host 127.0.0.1 --port 0 ARGS`` in its own session, stdout and stderr
    in separate files; returns once /health answers 200 (the port is read from the manifest)."""
    base.mkdir(parents=True, exist_ok=True)
    out_path, err_path = base / "server.stdout", base / "server.stderr"
    env = {**os.environ, "GLASSBOX_RUN_DIR_BASE": str(base)}
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "serve", "--host", "127.0.0.1",
                                 "--port", "0", *args],
                                stdout=out, stderr=err, env=env, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + START_TIMEOUT_S
    server = None
    try:
        while server is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"server did not start (exit {proc.poll()}):\n{err_path.read_text()[-3000:]}"
                )
            for path in base.glob("glassbox-*/manifest.json"):
                try:
                    manifest = json.loads(path.read_text())
                except ValueError:
                    continue
                if "port" in manifest:
                    port = manifest["port"]
                    server = Server(
                        proc, port, Path(manifest["run_dir"]), f"http://127.0.0.1:{port}", err_path
                    )
            time.sleep(0.05)
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"server never became healthy (exit {proc.poll()}):\n{server.log()[-3000:]}"
                )
            try:
                if httpx.get(server.base_url + "/health", timeout=1.0).status_code == 200:
                    return server, out_path
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
        raise


def _planned_pids(run_dir: Path, timeout: float = 30.0) -> dict[str, int]:
    """``{role name: pid}`` for every role the manifest plans, read from each role's status
    file (waits, bounded, until every planned process has written one)."""
    deadline = time.monotonic() + timeout
    while True:
        roles = planned_roles(run_dir)
        statuses = {r.name: read_status(status_file(run_dir, r)) for r in roles}
        pids = {name: s.pid for name, s in statuses.items() if s is not None and s.pid}
        if roles and len(pids) == len(roles):
            return pids
        missing = sorted(set(statuses) - set(pids)) if roles else ["manifest roles"]
        assert time.monotonic() < deadline, f"no pid after {timeout:.0f} s for {missing}"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def serve_tp2_dp2(tiny_dir):
    """``serve_tp2_dp2(*extra_args)``: a ``-tp 2 -dp 2`` server of a tiny model, (server, stdout
    path); every one started is killed (its process group) and its files removed afterwards."""
    model = tiny_dir("llama", num_heads=4, num_kv_heads=2)  # 4 heads, 2 KV heads: splits over TP 2
    started = []

    def start(*extra: str):
        base = Path(tempfile.mkdtemp(prefix="gbk", dir="/tmp"))  # short: ipc paths ≤ 107 characters
        started.append(base)
        srv, stdout_path = _start_server(
            base / "run", str(model), "--max-model-len", "128", "--kv-cache-memory-bytes", str(16 << 20),
            "--tensor-parallel-size", "2", "--data-parallel-size", "2", "--uvicorn-log-level", "warning", *extra,
        )  # fmt: skip
        started.append(srv)
        return srv, stdout_path

    yield start
    for item in started:
        if isinstance(item, Server):
            item.kill_group()
        else:
            shutil.rmtree(item, ignore_errors=True)


@pytest.fixture
def server(serve_tp2_dp2):
    return serve_tp2_dp2()


def test_sigkill_of_worker_dp1_tp1_takes_the_whole_tp2_dp2_tree_down(server):
    server, stdout_path = server
    run_dir = server.run_dir
    pids = _planned_pids(run_dir)
    roles = planned_roles(run_dir)
    assert VICTIM in roles, [r.name for r in roles]
    # The shape this test is about; the API-server count is whatever the manifest plans.
    expected = {ProcessRole.engine_core(k) for k in (0, 1)} | {ProcessRole.dp_coordinator()}
    expected |= {ProcessRole.worker(k, 0, t) for k in (0, 1) for t in (0, 1)}
    engine_side = {r for r in roles if r.kind is not RoleKind.API_SERVER}
    assert engine_side == expected, sorted(r.name for r in engine_side)
    assert any(r.kind is RoleKind.API_SERVER for r in roles)
    assert server.proc.pid in pids.values(), "the server process is one of the planned roles"
    dead_before = [name for name, pid in pids.items() if not _alive(pid)]
    assert not dead_before, f"planned processes not running before the kill: {dead_before}"
    # Every process below the server (multiprocessing helpers included), to look for orphans.
    descendants = {p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)}
    # The shared-memory queues: mmap'd ring files (*.mq) and their wake-up FIFOs.
    shm_files = [p for p in run_dir.iterdir() if p.suffix == ".mq" or stat.S_ISFIFO(p.lstat().st_mode)]
    assert any(p.suffix == ".mq" for p in shm_files), (
        f"no queue files in {run_dir}: {sorted(os.listdir(run_dir))}"
    )

    victim_pid = pids[VICTIM.name]
    os.kill(victim_pid, signal.SIGKILL)
    killed_at = time.monotonic()

    left = wait_gone(list(pids.values()), timeout=TREE_GONE_DEADLINE_S)
    gone_after = time.monotonic() - killed_at
    print(f"planned tree ({len(pids)} processes) gone {gone_after:.2f} s after SIGKILL of {VICTIM.name}")
    survivors = {name: pid for name, pid in pids.items() if pid in left}
    assert not survivors, f"still alive {gone_after:.2f} s after SIGKILL of {VICTIM.name}: {survivors}"
    orphans = [pid for pid in descendants if _alive(pid)]
    assert not orphans, f"processes below the server still alive after the planned tree went: {orphans}"

    code = server.proc.wait(10)
    assert code != 0, "the server exits non-zero when an engine process dies"

    stderr = server.log()
    lines = stderr.rstrip().splitlines()
    assert stderr.count("Glassbox root cause") == 1, (
        f"the root-cause block is printed once:\n{stderr[-3000:]}"
    )
    block_start = max(i for i, line in enumerate(lines) if "Glassbox root cause" in line)
    block = "\n".join(lines[block_start:])
    assert VICTIM.name in block and "SIGKILL" in block, block
    assert str(victim_pid) in block, block
    assert lines[-1].startswith("====="), f"the root-cause block is the last thing on stderr:\n{block}"
    assert "Glassbox root cause" not in stdout_path.read_text(errors="replace")

    # The run directory goes with the tree (its last survivor removes it), queues and all.
    deadline = time.monotonic() + TREE_GONE_DEADLINE_S
    while run_dir.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not run_dir.exists(), f"run directory left: {sorted(p.name for p in run_dir.iterdir())}"
    assert not [p.name for p in shm_files if p.exists()], "shared-memory queue files left"
    shm = Path("/dev/shm")
    if shm.is_dir():
        assert not [p for p in shm.iterdir() if run_dir.name in p.name], "shared-memory files of the run left"


def test_the_tree_goes_at_once_under_load_though_the_dead_engine_core_is_slow_to_exit(serve_tp2_dp2):
    """The API server acts on the engine core's last words (``ENGINE_CORE_DEAD``, sent as it
    starts to stop), not on its exit: the rest of the tree is stopped meanwhile, in parallel.
    It used to hear of an idle engine's death only when that process had exited, so the tree
    went down one process after another — over 5 s on a loaded machine. Here EngineCore_DP1
    takes 30 s to stop (a slow fault in its shutdown) and two busy loops load the CPUs: still,
    every process goes and the run directory is removed within a liveness bound."""
    server, _ = serve_tp2_dp2("--inject-fault", "engine_core.shutdown:slow:30@EngineCore_DP1")
    run_dir = server.run_dir
    pids = _planned_pids(run_dir)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        os.kill(pids[VICTIM.name], signal.SIGKILL)
        left = wait_gone(list(pids.values()), timeout=10.0)
        survivors = {name: pid for name, pid in pids.items() if pid in left}
        assert not survivors, f"still alive 10 s after SIGKILL of {VICTIM.name}: {survivors}"
        deadline = time.monotonic() + 5.0
        while run_dir.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not run_dir.exists(), "the run directory goes with the tree"
    finally:
        for proc in busy:
            proc.kill()
            proc.wait(10)
    assert server.proc.wait(10) == 1
    block = server.log()[server.log().rindex("Glassbox root cause") :]
    assert VICTIM.name in block and "SIGKILL" in block, block
