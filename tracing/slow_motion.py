"""Start-up in slow motion: a deliberate pause at the start of every start-up stage.

``GLASSBOX_STARTUP_STAGE_DELAY_S=2`` makes each process of the tree wait 2 s as it enters
each of its lifecycle start-up stages (every ``lifecycle`` stage of the span catalogue but
the shut-down ones), so that a student can watch the stages go by in ``glassbox ps`` and
engine-top. Nothing is faked: every stage still does its work, after its pause.

A pause is shown as what it is, never as a hang or a fault:

- it is a bounded wait (``tracing.waits``) named ``a deliberate pause before STAGE
  (GLASSBOX_STARTUP_STAGE_DELAY_S=2)``: engine-top's wait row says so;
- the process's status file carries it (``ProcessStatus.pause``) while it lasts, and
  ``glassbox ps`` adds ``(paused on purpose: GLASSBOX_STARTUP_STAGE_DELAY_S=2)`` to the
  stage.

The variable is checked in the first process, with every ``GLASSBOX_*`` (``engine/envs.py``);
``setup_tracing(role)`` calls ``install_stage_delay(role)``. Imports no ``engine``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from tracing import catalogue
from tracing.stage import add_stage_hook, set_pause
from tracing.waits import wait_for

logger = logging.getLogger(__name__)

ENV = "GLASSBOX_STARTUP_STAGE_DELAY_S"
PAUSE_PREFIX = "a deliberate pause before "

_installed: Callable[[], None] | None = None


def parse_delay(value: str) -> float:
    """Seconds ``>= 0`` (0: no pause).

    Raises:
        ValueError: not a finite number of seconds >= 0.
    """
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"expected a number of seconds >= 0, got {value!r}")
    return seconds


def paused_stages() -> frozenset[str]:
    """The stages a pause is taken before: the catalogue's start-up lifecycle stages."""
    return frozenset(
        s.name
        for s in catalogue.SPANS.values()
        if s.level == catalogue.LIFECYCLE and "shutdown" not in s.name
    )


def pause_what(stage: str, seconds: float) -> str:
    """The pause's wait name (engine-top's wait row, a deadline message)."""
    return f"{PAUSE_PREFIX}{stage} ({ENV}={seconds:g})"


class _PauseHook:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.stages = paused_stages()

    def __call__(self, event: str, name: str, attrs: Mapping[str, Any]) -> None:
        if event != "enter" or name not in self.stages:
            return
        end = time.monotonic() + self.seconds
        set_pause({"stage": name, "seconds": self.seconds, "since": time.time(), "env": ENV})
        try:
            # A wait in slices (SIGTERM's handler still runs between them), named for what it is.
            wait_for(pause_what(name, self.seconds), lambda: time.monotonic() >= end,
                     timeout_s=2 * self.seconds + 5, poll_interval_s=0.1)  # fmt: skip
        finally:
            set_pause(None)


def install_stage_delay(role: str, text: str | None = None) -> float:
    """Arm the pause of ``text`` (default: ``$GLASSBOX_STARTUP_STAGE_DELAY_S``) in this process.

    Replaces what an earlier call armed; unset, empty or 0 disarms. Logs one WARNING line
    when armed. Returns the seconds armed (0: none). A value that does not parse arms
    nothing (the first process has refused it already).
    """
    global _installed
    if text is None:
        text = os.environ.get(ENV, "")
    try:
        seconds = parse_delay(text) if text.strip() else 0.0
    except ValueError:
        seconds = 0.0
    if _installed is not None:
        _installed()
        _installed = None
    if seconds > 0:
        _installed = add_stage_hook(_PauseHook(seconds))
        logger.warning(
            "START-UP IN SLOW MOTION in %s (pid %d): a deliberate pause of %g s before each start-up stage (%s)",
            role, os.getpid(), seconds, ENV,
        )  # fmt: skip
    return seconds


def uninstall_stage_delay() -> None:
    """Disarm the pause (tests)."""
    install_stage_delay("", "")
