"""Shared fixtures: tiny checkpoints built with transformers, and the bundled model path."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests run what users run: engines and servers start on their defaults (the compiled step,
# the default attention backend). Tests about the eager path or about model math ask for it
# (``--enforce-eager``, ``enforce_eager=True``, or the ``eager`` fixture below). The compile
# cache (GLASSBOX_CACHE_ROOT) is shared by every start, so a graph shape compiles once.


def pytest_configure(config):
    """Short temporary directories. A run directory's ipc socket paths are limited to 107
    bytes (``GLASSBOX_RUN_DIR_BASE`` at most 64 characters), and pytest's default base
    (``/tmp/pytest-of-<user>/pytest-<n>/``) with pytest-xdist's ``popen-gw<i>/`` on top leaves
    a test's ``tmp_path`` too long for a server. So this run's base is ``/tmp/gb<uid>/<pid>/``
    (xdist's workers get theirs below it); the directories of the newest three runs are kept,
    as pytest keeps its own, and a run still going is never removed."""
    import shutil
    import tempfile

    import psutil

    if config.option.basetemp is not None or hasattr(config, "workerinput"):
        return  # given on the command line, or an xdist worker (its controller chose it)
    root = Path(tempfile.gettempdir()) / f"gb{os.getuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    finished = [p for p in root.iterdir() if not (p.name.isdigit() and psutil.pid_exists(int(p.name)))]
    for old in sorted(finished, key=lambda p: p.stat().st_mtime)[:-2]:
        shutil.rmtree(old, ignore_errors=True)
    config.option.basetemp = str(root / str(os.getpid()))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from engine.config import DEFAULT_MODEL

    return Path(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_model_dir):
    """``tiny_dir(arch, **kwargs)``: a tiny checkpoint (``build_tiny_checkpoint``) with the
    bundled model's tokenizer, in a fresh directory."""
    from tiny_models import build_tiny_checkpoint

    def build(arch: str, **kwargs):
        return build_tiny_checkpoint(
            tmp_path_factory.mktemp(arch), arch, tokenizer_dir=default_model_dir, **kwargs
        )

    return build


class _QuietMachine:
    """A load meter that sees no other process (``measured_choice.load_meter``'s shape)."""

    def others(self) -> float:
        return 0.0


@pytest.fixture
def measured_choices_here(tmp_path, monkeypatch):
    """The measured choices (engine/model/cpu/measured_choice.py) of this test alone: a cache
    of its own under ``tmp_path``, and a machine that reads as quiet while they are timed."""
    from engine.model.cpu import measured_choice

    monkeypatch.setenv("GLASSBOX_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(measured_choice, "load_meter", _QuietMachine)
    return tmp_path


@pytest.fixture
def run_and_cache_dirs(tmp_path, monkeypatch):
    """(run-dir base, cache root) under ``tmp_path``, both set in the environment that
    engines, ``glassbox ps`` and ``glassbox doctor`` read (post-mortems go to the cache)."""
    base, cache = tmp_path / "runs", tmp_path / "cache"
    base.mkdir()
    monkeypatch.setenv("GLASSBOX_RUN_DIR_BASE", str(base))
    monkeypatch.setenv("GLASSBOX_CACHE_ROOT", str(cache))
    return base, cache


@pytest.fixture
def eager(monkeypatch):
    """Engines started by this test (and servers it spawns) run their model eagerly: for tests
    about the eager path or about model math on many tiny checkpoints (each would compile)."""
    monkeypatch.setenv("GLASSBOX_TORCH_COMPILE", "0")


@pytest.fixture
def reap_children():
    """After the test, SIGKILL every process it left (and their process groups)."""
    import psutil

    yield
    for child in psutil.Process().children(recursive=True):
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        child.kill()
