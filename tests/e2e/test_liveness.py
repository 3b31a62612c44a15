"""Liveness does not depend on live telemetry.

A parent reports a child "frozen" when the child's status-file mtime stops moving while the
OS shows it running (``StoppedWatch.frozen_for``, ``GLASSBOX_HEARTBEAT_TIMEOUT_S``). The
mtime is set each second by a liveness thread every child starts
(``supervisor.start_liveness_beat``), so ``GLASSBOX_TELEMETRY=0`` leaves the check working
and an idle tree healthy. A child that really stops beating is still reported (here by
hand; ``tests/e2e/test_fault_matrix.py`` strikes a real process with ``gil``).
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
from server_utils import start_server

from engine.utils import supervisor
from tracing import run_dir as run_dirs
from tracing.telemetry.publisher import telemetry_enabled

HEARTBEAT_TIMEOUT_S = 2.0


def _wait_mtime_after(path, t: float, timeout: float = 30.0) -> float:
    deadline = time.monotonic() + timeout
    while (mtime := os.stat(path).st_mtime) <= t:
        assert time.monotonic() < deadline, f"{path.name}'s mtime never moved past {t}"
        time.sleep(0.05)
    return mtime


def test_the_liveness_beat_moves_the_status_file_mtime_with_telemetry_off(tmp_path, monkeypatch):
    monkeypatch.setenv("GLASSBOX_TELEMETRY", "0")
    assert not telemetry_enabled()
    path = run_dirs.status_path(tmp_path, "Worker_DP0_PP0_TP0")
    path.write_text("{}")
    an_hour_ago = time.time() - 3600
    os.utime(path, (an_hour_ago, an_hour_ago))
    watch = supervisor.StoppedWatch(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    assert watch.frozen_for(os.getpid(), path) is None  # first look: not yet seen beating

    stop = threading.Event()
    beat = supervisor.start_liveness_beat(path, interval_s=0.05, stop=stop)
    try:
        first = _wait_mtime_after(path, an_hour_ago)
        assert first > time.time() - 60  # set to now, not nudged
        _wait_mtime_after(path, first)  # and again: it beats, not touches once
        assert watch.frozen_for(os.getpid(), path) is None  # beating: alive
    finally:
        stop.set()
        beat.join(5)
    assert not beat.is_alive()

    # The beat stopped (as a native call holding the GIL stops it) while this process runs:
    # over the timeout, the watch reports it frozen, with the age of the last beat.
    os.utime(path, (an_hour_ago, an_hour_ago))
    frozen = watch.frozen_for(os.getpid(), path)
    assert frozen is not None and frozen > 3500
    assert "frozen: running but no heartbeat" in watch.describe_frozen(frozen)


@pytest.mark.slow
def test_an_idle_server_with_telemetry_off_stays_up_past_the_heartbeat_timeout(tmp_path):
    """With GLASSBOX_TELEMETRY=0 the engine core used to call its worker frozen after
    GLASSBOX_HEARTBEAT_TIMEOUT_S of idleness (nothing touched its status file) and the
    server exited. Now it stays healthy idle for several timeouts and still answers."""
    env = {"GLASSBOX_TELEMETRY": "0", "GLASSBOX_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S)}
    server = start_server(tmp_path, "--max-model-len", "256", env=env)
    try:
        assert not list(server.run_dir.glob("*.tel")), "telemetry is off: no publisher socket"
        client = httpx.Client(base_url=server.base_url, timeout=60)
        model = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 200

        # Idle: each watched child's status file beats (seen 4 times past the request), and
        # the tree is still up after three heartbeat timeouts.
        idle_from = time.time()
        watched = [run_dirs.status_path(server.run_dir, r) for r in ("EngineCore_DP0", "Worker_DP0_PP0_TP0")]
        beats = {p: [os.stat(p).st_mtime] for p in watched}
        while min(len(b) for b in beats.values()) < 5 or time.time() - idle_from < 3 * HEARTBEAT_TIMEOUT_S:
            assert server.proc.poll() is None, f"the server exited while idle:\n{server.log()[-3000:]}"
            assert time.time() - idle_from < 60, f"no beat in {[p.name for p in watched]}: {beats}"
            for p, seen in beats.items():
                if (mtime := os.stat(p).st_mtime) != seen[-1]:
                    seen.append(mtime)
            time.sleep(0.1)

        assert client.get("/health").status_code == 200
        reply = client.post("/v1/completions", json=body)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
        assert "frozen" not in server.log()
    finally:
        server.kill_group()
