"""Logging: every line starts with the process's role and pid.

Mirrors vLLM's ``vllm/logger.py`` (0.33 format): ``(Role pid=N) LEVEL MM-DD HH:MM:SS
[file.py:line] message``. The role is set once per process with ``set_process_role`` (the
engine core and workers will each set their own when they get their own processes).
"""

from __future__ import annotations

import logging
import sys

_ROLE = "Main"
_CONFIGURED = False
_HANDLER: logging.Handler | None = None


class _RoleFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.glassbox_role = _ROLE
        return True


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
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RoleFilter())
    handler.setFormatter(
        logging.Formatter(
            "(%(glassbox_role)s pid=%(process)d) %(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
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


__all__ = ["init_logger", "set_process_role", "get_process_role", "adopt_logger"]
