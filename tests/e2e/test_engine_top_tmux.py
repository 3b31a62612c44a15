"""engine-top for real, in tmux: a terminal, a server, load, a kill, ``q``.

``engine-top`` starts first, in a detached tmux session, and shows that no instance runs;
then ``glassbox serve`` starts and engine-top attaches by itself; the tree is shown running;
under ``glassbox bench serve`` load (with ``--step-delay-ms`` so the queues fill) the queues
panel shows a depth above zero and the steps panel budget bars with decode (█) and prefill
(▒) tokens; a worker SIGKILLed is shown dead with its signal; ``q`` exits 0. Everything is
read with ``tmux capture-pane``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from server_utils import start_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

ROOT = Path(__file__).resolve().parents[2]


def _tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=10).stdout


def _wait_screen(session: str, predicate: Callable[[str], bool], timeout_s: float, what: str) -> str:
    deadline = time.monotonic() + timeout_s
    screen = ""
    while time.monotonic() < deadline:
        screen = _tmux("capture-pane", "-p", "-t", session)
        if predicate(screen):
            return screen
        time.sleep(0.25)
    raise AssertionError(f"engine-top never showed {what}; last screen:\n{screen}")


def test_engine_top_in_tmux_attaches_follows_load_shows_a_death_and_quits(default_model_dir):
    base = Path(tempfile.mkdtemp(prefix="gbx", dir="/tmp"))  # short: ipc paths ≤ 107 chars
    session = f"gbtop{os.getpid()}"
    exit_file = base / "top.exit"
    env_prefix = f"GLASSBOX_RUN_DIR_BASE={shlex.quote(str(base))} PYTHONPATH={shlex.quote(str(ROOT))}"
    # COLUMNS/LINES from pytest's environment would override the pane's real size.
    command = (f"env -u COLUMNS -u LINES {env_prefix} {shlex.quote(sys.executable)} -m tui; "
               f"echo $? > {shlex.quote(str(exit_file))}")  # fmt: skip
    server = None
    try:
        _tmux("new-session", "-d", "-s", session, "-x", "200", "-y", "60", command)
        _tmux("resize-window", "-t", session, "-x", "200", "-y", "60")  # detached: no client sets it
        _wait_screen(session, lambda s: "no running Glassbox instance" in s, 30,
                     "that no instance runs")  # fmt: skip

        server = start_server(base, "--max-model-len", "512", "--max-num-batched-tokens", "96",
                              "--step-delay-ms", "40", "--uvicorn-log-level", "warning")  # fmt: skip
        roles = ("APIServer_0", "EngineCore_DP0", "Worker_DP0_PP0_TP0")

        def tree_running(screen: str) -> bool:
            return all(re.search(rf"{role}\s+\d+\s+running", screen) for role in roles)

        _wait_screen(session, tree_running, 60, "the tree running")

        bench = subprocess.Popen(
            [sys.executable, "-m", "engine.cli.main", "bench", "serve", "--base-url", server.base_url,
             "--num-prompts", "48", "--random-input-len", "160", "--random-output-len", "24",
             "--max-concurrency", "24", "--ignore-eos"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        try:

            def loaded(screen: str) -> bool:
                waiting = re.search(r"\swaiting\s+(\d+)\s", screen)  # the queues panel's row
                bars = [line for line in screen.splitlines() if "█" in line and "▒" in line]
                return bool(waiting and int(waiting.group(1)) > 0 and bars)

            _wait_screen(
                session, loaded, 90, "a waiting queue above zero and a step with decode and prefill tokens"
            )
        finally:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait(10)

        worker = re.search(r"Worker_DP0_PP0_TP0\s+(\d+)", _tmux("capture-pane", "-p", "-t", session))
        os.kill(int(worker.group(1)), signal.SIGKILL)
        _wait_screen(session, lambda s: re.search(r"Worker_DP0_PP0_TP0.*killed by SIGKILL", s) is not None, 30,
                     "the worker dead with its signal")  # fmt: skip

        _tmux("send-keys", "-t", session, "q")
        deadline = time.monotonic() + 15
        while not exit_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert exit_file.read_text().strip() == "0"
    finally:
        _tmux("kill-session", "-t", session)
        if server is not None:
            server.kill_group()
        shutil.rmtree(base, ignore_errors=True)
