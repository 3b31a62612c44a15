"""Start a real ``glassbox serve`` for tests: port 0, its own run-directory base, own process group."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


class LoggedProcess:
    """A process started in its own session with its output in ``log_path``."""

    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill_group(self) -> None:
        """SIGKILL its whole session (it leads its process group), then reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@dataclass
class Server(LoggedProcess):
    proc: subprocess.Popen
    port: int
    run_dir: Path
    base_url: str
    log_path: Path


def start_server(
    base: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120.0, ready: str = "health"
) -> Server:
    """Start ``glassbox serve --port 0 ARGS`` and wait until /health answers 200.

    The bound port is read from the run directory's manifest (written right after bind).
    Output goes to ``base/server.log``. ``ready="run-dir"``: return once that manifest is
    there, without waiting for /health (a server whose start-up hangs on purpose, an
    ``--inject-fault``, never gets healthy).

    Raises:
        RuntimeError: the server exited or did not become healthy within ``timeout``.
    """
    if ready not in ("health", "run-dir"):
        raise ValueError(f"ready must be 'health' or 'run-dir', not {ready!r}")
    base.mkdir(parents=True, exist_ok=True)
    log_path = base / "server.log"
    full_env = {**os.environ, "GLASSBOX_RUN_DIR_BASE": str(base), **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.cli.main", "serve", "--port", "0", *args],
            stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + timeout
    manifest = None
    while manifest is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not start (exit {proc.poll()}):\n{log_path.read_text()[-3000:]}")
        for path in base.glob("glassbox-*/manifest.json"):
            try:
                data = json.loads(path.read_text())
            except ValueError:
                continue
            if "port" in data:
                manifest = data
        time.sleep(0.05)
    server = Server(
        proc, manifest["port"], Path(manifest["run_dir"]), f"http://127.0.0.1:{manifest['port']}", log_path
    )
    if ready == "run-dir":
        return server
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            server.kill_group()
            raise RuntimeError(f"server never became healthy (exit {proc.poll()}):\n{server.log()[-3000:]}")
        try:
            if httpx.get(server.base_url + "/health", timeout=1.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


def free_port_block(n: int = 8) -> int:
    """A port P with P..P+n-1 free now (the head uses P and the next 2 + 2 × API servers)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + n > 65535:
            continue
        free = True
        for q in range(port, port + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", q))
                except OSError:
                    free = False
                    break
        if free:
            return port
    raise RuntimeError("no block of free ports")


class Node(LoggedProcess):
    """``glassbox serve --headless`` in its own session, with its own run-directory base."""

    def __init__(self, base: Path, port: int, *args: str, env: dict[str, str] | None = None) -> None:
        base.mkdir(parents=True, exist_ok=True)
        self.base, self.log_path = base, base / "node.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "engine.cli.main", "serve", "--headless", "--data-parallel-address", "127.0.0.1",
                 "--data-parallel-rpc-port", str(port), *args],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "GLASSBOX_RUN_DIR_BASE": str(base), **(env or {})},
            )  # fmt: skip

    def run_dir(self, timeout: float = 60) -> Path:
        deadline = time.monotonic() + timeout
        while True:
            found = list(self.base.glob("glassbox-*/manifest.json"))
            if found:
                return found[0].parent
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
            time.sleep(0.05)
