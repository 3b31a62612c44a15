"""Logging: every line starts with the process's role and pid.

Mirrors vLLM's ``vllm/logger.py`` (0.32 format): ``(Role pid=N) LEVEL MM-DD HH:MM:SS
[file.py:line] message``. The role is set once per process with ``set_process_role`` (the
engine core and workers will each set their own when they get their own processes).

In a child process (the process harness, ``engine/utils/process_harness.py``) ``decorate_logs``
also prefixes every line written to ``sys.stdout`` and ``sys.stderr`` — a bare ``print()``, a
``warnings.warn``, a library's own logging, a traceback — as vLLM's ``decorate_logs`` does;
Glassbox's handler then leaves the prefix to the stream, so each line carries it once. Native
writes to file descriptors 1 and 2 (C extensions) bypass ``sys.stdout`` and stay bare.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

_ROLE = "Main"
_CONFIGURED = False
_HANDLER: logging.Handler | None = None


class _RoleFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.glassbox_role = _ROLE
        return True


class _RoleHandler(logging.StreamHandler):
    """A stream handler whose lines start with ``(Role pid=N) ``, unless its stream already
    prefixes every line (``decorate_logs``): then the prefix is left to the stream."""

    def format(self, record: logging.LogRecord) -> str:
        decorated = getattr(self.stream, "glassbox_prefix", None) is not None
        record.glassbox_prefix = "" if decorated else f"({_ROLE} pid={record.process}) "
        return super().format(record)


def set_process_role(role: str) -> None:
    """Name this process in every later log line (e.g. ``EngineCore_DP0``)."""
    global _ROLE
    _ROLE = role


def get_process_role() -> str:
    return _ROLE


def _configure() -> None:
    global _CONFIGURED, _HANDLER
    if _CONFIGURED:
        return
    handler = _RoleHandler(sys.stderr)
    handler.addFilter(_RoleFilter())
    handler.setFormatter(
        logging.Formatter(
            "%(glassbox_prefix)s%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
            datefmt="%m-%d %H:%M:%S",
        )
    )
    for name in ("engine", "tracing"):
        root = logging.getLogger(name)
        root.addHandler(handler)
        root.setLevel(_level())
        root.propagate = False
    _HANDLER = handler
    _CONFIGURED = True


def adopt_logger(name: str, level: str) -> None:
    """Send library logger ``name`` (e.g. ``uvicorn``) through the glassbox handler, so its
    lines carry the role prefix too — with several API servers, which one logged."""
    _configure()
    adopted = logging.getLogger(name)
    adopted.handlers[:] = [_HANDLER]
    adopted.setLevel(level.upper() if level != "trace" else 5)
    adopted.propagate = False


def _add_prefix(file: TextIO, prefix: str) -> None:
    """Make ``file.write`` start each line with ``prefix`` (vLLM: ``_add_prefix``)."""
    if getattr(file, "glassbox_prefix", None) is not None:  # once per stream
        return
    file_write = file.write
    start_new_line = True

    def write_with_prefix(s: str) -> int:
        nonlocal start_new_line
        if not s:
            return 0
        lines = s.split("\n")
        out = []
        for i, line in enumerate(lines):
            last = i == len(lines) - 1
            if last and not line:  # s ended with a newline: the next write starts a line
                start_new_line = True
                break
            if start_new_line:
                out.append(prefix)
            out.append(line if last else line + "\n")
            start_new_line = not last
        file_write("".join(out))
        return len(s)

    file.write = write_with_prefix  # type: ignore[method-assign]
    file.glassbox_prefix = prefix  # type: ignore[attr-defined]


def decorate_logs(process_name: str | None = None) -> None:
    """Prefix every line this process writes to ``sys.stdout`` and ``sys.stderr`` with
    ``(process_name pid=N) `` (default: the role of ``set_process_role``).

    For child processes only (the process harness calls it): the user's own process (an
    ``LLM`` script, the first API server) keeps its streams as they are. Glassbox's log lines
    get the prefix once, from the stream. vLLM: ``vllm.utils.system_utils.decorate_logs``.
    """
    prefix = f"({process_name or _ROLE} pid={os.getpid()}) "
    _add_prefix(sys.stdout, prefix)
    _add_prefix(sys.stderr, prefix)


def _level() -> str:
    # A bad GLASSBOX_LOGGING_LEVEL is reported by envs.validate_all() as one line; logging
    # set up at import time must not turn it into a traceback first.
    from engine import envs

    try:
        return envs.GLASSBOX_LOGGING_LEVEL
    except ValueError:
        return "INFO"


def init_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (``__name__``), under the glassbox handler."""
    _configure()
    return logging.getLogger(name)


__all__ = ["init_logger", "set_process_role", "get_process_role", "adopt_logger", "decorate_logs"]
