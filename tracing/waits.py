"""Bounded waits: every wait in Glassbox has a deadline and a name for what it awaits.

A hang is the worst failure a serving engine can show its user: nothing happens and
nothing says why. So no code here waits on an event, a future, a queue or a condition
without a deadline; when the deadline passes, ``WaitTimeout`` says what was awaited
("timed out after 5.0 s waiting for READY from EngineCore_DP0"). Each wait also sends
``wait_start`` / ``wait_end`` events through the stage hooks (``tracing.stage``), which is
where "waiting for X" telemetry and fault injection attach.

vLLM has no single helper: its waits are spread over ``zmq`` polls with timeouts and
``VLLM_*_TIMEOUT`` variables. On an event loop, ``wait_for_async`` is the same for asyncio
futures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tracing.stage import emit

T = TypeVar("T")

# Declared here (tracing/ imports no engine module) and used by engine/envs.py's table, so
# the name, default and parser of this variable exist once.
DEFAULT_TIMEOUT_ENV = "GLASSBOX_DEFAULT_WAIT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0


class WaitTimeout(TimeoutError):
    """A bounded wait passed its deadline. ``what`` and ``timeout_s`` (s) say which."""

    def __init__(self, what: str, timeout_s: float) -> None:
        self.what = what
        self.timeout_s = timeout_s
        super().__init__(f"timed out after {_seconds(timeout_s)} s waiting for {what}")


class WaitCancelled(Exception):
    """A bounded wait was cancelled (its ``cancel`` event was set) before it finished."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"cancelled while waiting for {what}")


def _seconds(t: float) -> str:
    return f"{t:.1f}" if t >= 1 else f"{t:.3g}"


def parse_seconds(text: str) -> float:
    """A positive number of seconds from ``text`` (the parser of every ``*_TIMEOUT_S``
    variable, here and in ``engine/envs.py``).

    Raises:
        ValueError: not a number, or not > 0 (NaN included).
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise ValueError(f"expected a number of seconds > 0, got {text!r}")
    return value


def env_seconds(name: str, default: float) -> float:
    """``parse_seconds`` of environment variable ``name`` (``default`` if unset or empty).

    Raises:
        ValueError: the variable is set but is not a positive number; the message names it.
    """
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        return parse_seconds(raw)
    except ValueError as e:
        raise ValueError(f"{name}={raw!r} is not valid: {e}") from None


def default_timeout_s() -> float:
    """The deadline of a wait given ``timeout_s=None``: ``GLASSBOX_DEFAULT_WAIT_TIMEOUT_S``.

    Raises:
        ValueError: the variable is set but is not a positive number.
    """
    return env_seconds(DEFAULT_TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


Condition = Callable[[], Any] | threading.Event | concurrent.futures.Future


def _poll(condition: Condition, slice_s: float, cancel: threading.Event | None) -> tuple[bool, Any]:
    """Wait at most ``slice_s`` for ``condition``; returns (done, value)."""
    if isinstance(condition, threading.Event):
        return (True, True) if condition.wait(slice_s) else (False, None)
    if isinstance(condition, concurrent.futures.Future):
        try:
            return True, condition.result(timeout=slice_s)  # re-raises the future's exception
        except concurrent.futures.TimeoutError:
            return False, None
    value = condition()
    if value:
        return True, value
    if slice_s > 0:
        # Sleeping on the cancel event wakes up at once when the wait is cancelled.
        if cancel is not None:
            cancel.wait(slice_s)
        else:
            time.sleep(slice_s)
    return False, None


def wait_for(
    what: str,
    condition: Condition,
    *,
    timeout_s: float | None,
    poll_interval_s: float = 0.01,
    cancel: threading.Event | None = None,
) -> Any:
    """Wait until ``condition`` holds, at most ``timeout_s`` seconds.

    Args:
        what: what is awaited, for messages and telemetry ("READY from EngineCore_DP0").
        condition: a zero-argument callable (done when it returns something truthy), a
            ``threading.Event`` (done when set) or a ``concurrent.futures.Future`` (done
            when it has a result).
        timeout_s: deadline in seconds; None means ``default_timeout_s()``.
        poll_interval_s: how often a callable is re-checked (and, with ``cancel``, how
            often an event or future wait looks at the cancel event).
        cancel: when set, the wait stops with ``WaitCancelled``.

    Returns:
        The callable's truthy value, True for an event, or the future's result.

    Raises:
        WaitTimeout: the deadline passed first; the message names ``what``.
        WaitCancelled: ``cancel`` was set first.
        Exception: whatever the future raised (or the callable raised).
        TypeError: ``condition`` is none of the three kinds.
    """
    if not (callable(condition) or isinstance(condition, (threading.Event, concurrent.futures.Future))):
        raise TypeError(f"wait_for({what!r}): condition must be a callable, Event or Future")
    if timeout_s is None:
        timeout_s = default_timeout_s()
    # A lone event or future can block for the whole remaining time; polling is only
    # needed to re-check a callable or to notice a cancel.
    blocking = cancel is None and not callable(condition)
    return _run_wait(
        what,
        timeout_s,
        cancel,
        lambda remaining: _poll(
            condition, remaining if blocking else min(poll_interval_s, remaining), cancel
        ),
    )


def bounded_get(
    q: queue.Queue[T],
    what: str,
    timeout_s: float | None,
    *,
    cancel: threading.Event | None = None,
    poll_interval_s: float = 0.05,
) -> T:
    """``q.get()`` with a deadline: the next item, or ``WaitTimeout`` naming ``what``.

    Raises:
        WaitTimeout: nothing arrived within ``timeout_s`` s (None: ``default_timeout_s()``).
        WaitCancelled: ``cancel`` was set first.
    """
    if timeout_s is None:
        timeout_s = default_timeout_s()

    def poll(remaining: float) -> tuple[bool, Any]:
        try:
            return True, q.get(timeout=remaining if cancel is None else min(poll_interval_s, remaining))
        except queue.Empty:
            return False, None

    return _run_wait(what, timeout_s, cancel, poll)


def _run_wait(
    what: str,
    timeout_s: float,
    cancel: threading.Event | None,
    poll: Callable[[float], tuple[bool, Any]],
) -> Any:
    start = time.monotonic()
    deadline = start + timeout_s
    emit("wait_start", what, {"timeout_s": timeout_s})
    outcome = "error"
    try:
        while True:
            if cancel is not None and cancel.is_set():
                outcome = "cancelled"
                raise WaitCancelled(what)
            remaining = max(deadline - time.monotonic(), 0.0)
            done, value = poll(remaining)
            if done:
                outcome = "ok"
                return value
            if time.monotonic() >= deadline:
                outcome = "timeout"
                raise WaitTimeout(what, timeout_s)
    finally:
        emit("wait_end", what, {"outcome": outcome, "waited_ms": (time.monotonic() - start) * 1e3})


async def wait_for_async(
    what: str,
    futures: list[asyncio.Future[Any]],
    *,
    timeout_s: float | None,
    check: Callable[[], None] | None = None,
    poll_interval_s: float = 0.1,
) -> list[Any]:
    """On an event loop: wait until every future of ``futures`` is done, at most ``timeout_s``.

    ``check`` runs between slices of ``poll_interval_s`` (e.g. "are the engines alive?"; it
    raises to end the wait). Sends the same ``wait_start`` / ``wait_end`` events as
    ``wait_for``. Futures not done when the wait ends (timeout, ``check`` raised, the task
    was cancelled) are cancelled.

    Returns:
        the futures' results, in order.

    Raises:
        WaitTimeout: the deadline passed first; the message names ``what``.
        Exception: whatever ``check`` or a future raised.
    """
    if timeout_s is None:
        timeout_s = default_timeout_s()
    start = time.monotonic()
    deadline = start + timeout_s
    emit("wait_start", what, {"timeout_s": timeout_s})
    outcome = "error"
    try:
        while True:
            pending = [f for f in futures if not f.done()]
            if not pending:
                results = [f.result() for f in futures]
                outcome = "ok"
                return results
            if check is not None:
                check()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                outcome = "timeout"
                raise WaitTimeout(what, timeout_s)
            await asyncio.wait(pending, timeout=min(poll_interval_s, remaining))
    finally:
        for f in futures:
            if not f.done():
                f.cancel()  # given up: a late answer is dropped
        emit("wait_end", what, {"outcome": outcome, "waited_ms": (time.monotonic() - start) * 1e3})
