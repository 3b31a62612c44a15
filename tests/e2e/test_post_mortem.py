"""Post-mortems: what a tree that ended after a failure leaves for ``glassbox doctor``.

A run directory lives in memory and goes with its tree; after a failure its manifest, status
files, crash reports, flight recorders and root cause are first kept under
``<GLASSBOX_CACHE_ROOT>/post_mortem/`` (bounded). ``glassbox doctor --last`` reads the newest,
``--run-dir`` a removed directory's; ``glassbox ps --all`` lists stale run directories and
``--clean`` removes them, keeping their post-mortems.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from engine.cli.main import main
from tracing import run_dir as contract

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "engine.cli.main"]

pytestmark = pytest.mark.timeout(240)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _run_dir(base: Path, *, crash: bool = True) -> Path:
    """A run directory as a tree SIGKILLed whole leaves it: every pid dead."""
    run_dir = base / f"glassbox-{_dead_pid()}-{os.urandom(3).hex()}"
    run_dir.mkdir(parents=True)
    now = time.time()
    roles = [
        contract.PlannedProcess(role="APIServer_0", kind="api_server", counted=True),
        contract.PlannedProcess(role="EngineCore_DP0", kind="engine_core", rank=0),
        contract.PlannedProcess(role="Worker_DP0_PP0_TP0", kind="worker", rank=0),
    ]
    contract.write_manifest(run_dir, contract.Manifest(
        created_at=now - 30, run_dir=str(run_dir), mode="serve", frontend_pid=_dead_pid(), roles=roles,
        expected_process_count=3,
    ))  # fmt: skip
    for role in ("APIServer_0", "EngineCore_DP0", "Worker_DP0_PP0_TP0"):
        contract.write_status(contract.status_path(run_dir, role), contract.ProcessStatus(
            role=role, pid=_dead_pid(), stage="worker.load_model", stage_stack=["worker.load_model"],
            entered_at=now - 20, updated_at=now - 20,
        ))  # fmt: skip
    if crash:
        contract.write_crash_report(run_dir, contract.CrashReport(
            role="Worker_DP0_PP0_TP0", rank=0, pid=1234, stage="worker.load_model",
            exception="OSError: [Errno 5] Input/output error", traceback="Traceback...", time=now,
        ))  # fmt: skip
    return run_dir


def test_doctor_never_names_a_crash_report_that_does_not_exist(run_and_cache_dirs, capsys):
    """A worker SIGKILLed writes no crash report: doctor used to send the reader to
    ``<role>.crash.json`` anyway. It names the real file when there is one."""
    base, _ = run_and_cache_dirs
    for crash in (False, True):
        run_dir = _run_dir(base, crash=crash)
        assert main(["doctor", "--run-dir", str(run_dir), "--json"]) == 1
        report = json.loads(capsys.readouterr().out)
        assert report["culprit"] == "Worker_DP0_PP0_TP0"
        named = [w for w in report["hint"].split() if ".crash.json" in w]
        assert all(Path(w.strip("()")).is_file() for w in named), report["hint"]
        if crash:
            assert named, report["hint"]
            worker = next(p for p in report["processes"] if p["role"] == "Worker_DP0_PP0_TP0")
            assert Path(worker["crash"]["file"]).is_file()
        else:
            assert "no crash report" in report["hint"]
        shutil.rmtree(run_dir)


def test_ps_all_lists_a_stale_run_dir_and_clean_removes_it_keeping_its_post_mortem(run_and_cache_dirs):
    base, cache = run_and_cache_dirs
    stale = _run_dir(base)
    live = base / f"glassbox-{os.getpid()}-live"  # this process is alive: never stale
    live.mkdir()
    ps = subprocess.run([*CLI, "ps", "--all"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                        stdin=subprocess.DEVNULL, env=os.environ)  # fmt: skip
    assert ps.returncode == 0, ps.stderr
    assert "1 stale run directory" in ps.stdout and str(stale) in ps.stdout
    assert "glassbox ps --all --clean removes them" in ps.stdout  # no terminal: it only says how
    assert stale.is_dir()

    ps = subprocess.run([*CLI, "ps", "--all", "--clean"], cwd=ROOT, capture_output=True, text=True,
                        timeout=60, stdin=subprocess.DEVNULL, env=os.environ)  # fmt: skip
    assert ps.returncode == 0, ps.stderr
    assert "removed 1 of 1" in ps.stdout, ps.stdout
    assert not stale.exists() and live.is_dir()
    kept = cache / "post_mortem" / stale.name
    assert (kept / "Worker_DP0_PP0_TP0.crash.json").is_file() and (kept / "manifest.json").is_file()

    # The SIGKILLed tree's post-mortem is what doctor --last reads, and --run-dir finds it.
    for args in (["--last"], ["--run-dir", str(stale)]):
        doc = subprocess.run([*CLI, "doctor", *args, "--json"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, env=os.environ)  # fmt: skip
        assert doc.returncode == 1, doc.stderr
        report = json.loads(doc.stdout)
        assert report["gone"]["kept_in"] == str(kept) and report["gone"]["run_dir"] == str(stale)
        assert report["culprit"] == "Worker_DP0_PP0_TP0"
    text = subprocess.run([*CLI, "doctor", "--last"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=os.environ).stdout  # fmt: skip
    assert text.startswith("the tree is gone: it ended at ") and f"{stale} was removed" in text


def test_only_the_newest_post_mortems_are_kept_and_big_files_are_skipped(tmp_path):
    root = tmp_path / "post_mortem"
    names = []
    for i in range(contract.POST_MORTEMS_KEPT + 2):
        run_dir = _run_dir(tmp_path / "runs")
        if i == 0:
            (run_dir / "EngineCore_DP0.flight.json").write_bytes(
                b"[" + b" " * contract.POST_MORTEM_FILE_CAP + b"]"
            )
        kept = contract.keep_post_mortem(run_dir, root, reason="the engine died", ended_at=1000.0 + i)
        assert kept is not None
        names.append(run_dir.name)
        if i == 0:
            pm = contract.read_post_mortem(kept)
            assert (
                "EngineCore_DP0.flight.json" not in pm.files
                and not (kept / "EngineCore_DP0.flight.json").exists()
            )
            assert any(s.startswith("EngineCore_DP0.flight.json: ") for s in pm.skipped)
            assert "Worker_DP0_PP0_TP0.crash.json" in pm.files
    left = sorted(p.name for p in root.iterdir())
    assert left == sorted(names[2:])  # the two oldest are gone
    assert [p.name for p, _ in contract.list_post_mortems(root)] == names[2:][::-1]  # newest first


def test_a_post_mortem_keeps_each_file_with_the_time_it_was_written(tmp_path):
    # The blame rule orders failures by when each status file was written: a copy stamped
    # with the copying time would make the first failure the first file copied.
    run_dir = _run_dir(tmp_path / "runs")
    written = {}
    for i, path in enumerate(sorted(run_dir.glob("*.json"))):
        os.utime(path, (1_000_000.0 + i, 1_000_000.0 + i))
        written[path.name] = 1_000_000.0 + i
    kept = contract.keep_post_mortem(
        run_dir, tmp_path / "post_mortem", reason="the engine died", ended_at=2e6
    )
    assert kept is not None and written
    for name, at in written.items():
        if (kept / name).exists():
            assert (kept / name).stat().st_mtime == at, name


@pytest.mark.slow
def test_a_worker_crash_while_serving_leaves_a_post_mortem_doctor_last_reads(reap_children):
    """A worker crashes in its second step: the server exits 1 and removes its run directory;
    ``glassbox doctor --last`` then names the worker from the kept post-mortem, whose crash
    report and root cause are files there."""
    base = Path(tempfile.mkdtemp(prefix="gbp", dir="/tmp"))  # short: ipc paths ≤ 107 chars
    cache = base / "cache"
    cache.mkdir()
    shared = Path(os.environ.get("GLASSBOX_CACHE_ROOT") or "~/.cache/glassbox").expanduser()
    for sub in ("torch_compile_cache", "kernels"):  # the compile cache stays shared (warm)
        (shared / sub).mkdir(parents=True, exist_ok=True)
        (cache / sub).symlink_to(shared / sub)
    role = "Worker_DP0_PP0_TP0"
    env = {**os.environ, "GLASSBOX_RUN_DIR_BASE": str(base), "GLASSBOX_CACHE_ROOT": str(cache)}
    env.pop("GLASSBOX_FAULT", None)
    log_path = base / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*CLI, "serve", "--port", "0", "--inject-fault", f"worker.execute_model:crash@{role}#2"],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        manifest = None
        while manifest is None and proc.poll() is None and time.monotonic() < deadline:
            for path in base.glob("glassbox-*/manifest.json"):
                data = json.loads(path.read_text() or "{}")
                manifest = data if "port" in data else None
            time.sleep(0.05)
        assert manifest is not None, log_path.read_text()[-3000:]
        url = f"http://127.0.0.1:{manifest['port']}"
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        body = {"model": manifest["model"], "prompt": "Once upon a time", "max_tokens": 8}
        try:
            httpx.post(url + "/v1/completions", json=body, timeout=60)  # its second step kills the worker
        except httpx.HTTPError:
            pass  # the server may go before it answers
        assert proc.wait(timeout=120) == 1, log_path.read_text()[-3000:]
        run_dir = Path(manifest["run_dir"])
        assert not run_dir.exists()  # removed, as always

        doc = subprocess.run([*CLI, "doctor", "--last", "--json"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60, env=env)  # fmt: skip
        assert doc.returncode == 1, doc.stderr
        report = json.loads(doc.stdout)
        assert report["culprit"] == role and report["verdict"] == "dead", report["diagnosis"]
        assert report["gone"]["run_dir"] == str(run_dir) and report["gone"]["reason"] == "the engine died"
        kept = Path(report["gone"]["kept_in"])
        assert kept == cache / "post_mortem" / run_dir.name
        worker = next(p for p in report["processes"] if p["role"] == role)
        assert (
            Path(worker["crash"]["file"]) == kept / f"{role}.crash.json"
            and (kept / f"{role}.crash.json").is_file()
        )
        assert "InjectedFault" in worker["crash"]["exception"], worker["crash"]
        cause = (kept / contract.ROOT_CAUSE).read_text()
        assert role in cause and cause.strip() in log_path.read_text()  # what the server printed last
        assert (kept / "EngineCore_DP0.flight.json").is_file()  # the engine core's last steps
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait(10)
        shutil.rmtree(base, ignore_errors=True)


def test_doctor_on_a_gone_tree_prints_words_not_python_values(run_and_cache_dirs, capsys):
    """A gone tree: an engine core's echo report reads "stopped because <worker> failed" (not
    the root-cause text again), a report without a stage prints no "(stage None)", and no
    "stacks" heading stands over nothing (every process is dead)."""
    base, _ = run_and_cache_dirs
    run_dir = _run_dir(base, crash=True)
    contract.write_crash_report(run_dir, contract.CrashReport(
        role="EngineCore_DP0", rank=0, pid=1235, stage=None, time=time.time(),
        exception="EngineDeadError: The engine died; see the root cause below.\n=== Glassbox root cause ===",
        caused_by="Worker_DP0_PP0_TP0",
    ))  # fmt: skip
    contract.write_crash_report(run_dir, contract.CrashReport(
        role="APIServer_0", pid=1236, stage=None, exception="OSError: disk full", time=time.time() + 1,
    ))  # fmt: skip
    assert main(["doctor", "--run-dir", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert "crash report: stopped because Worker_DP0_PP0_TP0 failed" in out, out
    assert "crash report: OSError: disk full\n" in out, out
    assert "(stage None)" not in out and "=== Glassbox root cause ===" not in out, out
    assert "stacks (" not in out, out
