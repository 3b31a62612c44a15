"""Shared fixtures: tiny checkpoints built with transformers, and the bundled model path."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

# Keep every run directory of the test session in one place we can inspect.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from engine.config import DEFAULT_MODEL

    return Path(DEFAULT_MODEL)
