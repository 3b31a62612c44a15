"""Fault injection: make a chosen stage of a chosen process hang, freeze, crash, exit, die
of a signal or slow down — on purpose, deterministically, so a hung start-up or a crashing
worker can be taught and tested (``docs/faults.md``).

A fault spec is ``STAGE:KIND[@ROLE][#N]``; several are separated by ``,``::

    worker.load_model:hang@Worker_DP0_PP0_TP1
    worker.determine_available_memory:freeze@Worker_DP0_PP0_TP0
    engine_core.init:exit:3
    engine_core.step:slow:0.5@EngineCore_DP0#20
    worker.execute_model:crash@Worker_DP0_PP0_TP0#*

- ``STAGE``: a span name of the catalogue (``tracing/catalogue.py``, ``docs/spans.md``) of
  level ``lifecycle`` or ``step`` — the stages entered through ``tracing.stage``. Request
  spans are recorded after the fact and cannot be struck.
- ``KIND``: ``hang`` (the stage never returns: its thread blocks for good, the process's
  other threads — heartbeat, lifeline — go on; SIGTERM still stops it), ``freeze`` (the
  whole process stops: SIGSTOP to itself, heartbeat included; SIGCONT resumes the stage),
  ``gil`` (a native call that holds the GIL and never returns: every Python thread stops,
  heartbeat included, while the OS shows the process running — what a C extension stuck
  in a loop looks like; a signal still ends it),
  ``crash`` (raise ``InjectedFault`` inside the stage), ``exit:<code>`` (``os._exit(code)``,
  no clean-up, no crash report), ``kill:<signal>`` (send the signal, by name or number, to
  itself), ``slow:<seconds>`` (sleep, then go on).
- ``@ROLE``: a whole role name (``Worker_DP0_PP0_TP1``, ``EngineCore_DP0``, ``APIServer_0``,
  ``DPCoordinator``, ``LLM``); without it, every process that enters the stage. The first
  process refuses a role its tree does not have, or one that never enters the stage (the
  catalogue's ``entered_by``; ``TopologyPlan.check_fault_targets``).
- ``#N``: strike the N-th time this process enters the stage (default 1, the first);
  ``#*``: every time.

The spec comes from ``GLASSBOX_FAULT`` (the CLI's ``--inject-fault`` and ``LLM(inject_fault=...)``
set it in the first process, so every child inherits it). ``setup_tracing(role)`` calls
``install_faults(role)``, which registers one stage hook (a dict lookup for every stage that
is not targeted) and logs one WARNING line naming the faults of this process.

Imports no ``engine`` and no torch.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tracing import catalogue
from tracing.stage import add_stage_hook, forget_faults, record_fault

logger = logging.getLogger(__name__)

ENV = "GLASSBOX_FAULT"
FLAG = "--inject-fault"

KINDS = ("hang", "freeze", "gil", "crash", "exit", "kill", "slow")
_NEEDS_ARG = {"exit": "exit:<code>", "kill": "kill:<signal>", "slow": "slow:<seconds>"}
GRAMMAR = (
    "STAGE:KIND[@ROLE][#N], KIND one of hang, freeze, gil, crash, exit:<code>, kill:<signal>, slow:<seconds>"
)

_SPEC = re.compile(
    r"^(?P<stage>[^:@#]*):(?P<kind>[^:@#]*)(?::(?P<arg>[^@#]*))?(?:@(?P<role>[^@#]*))?(?:#(?P<n>[^@#]*))?$"
)
_ROLE = re.compile(r"^[A-Za-z0-9_.\-]+$")


class InjectedFault(RuntimeError):
    """The exception a ``crash`` fault raises inside its stage."""


@dataclass(frozen=True)
class Fault:
    """One parsed fault.

    Attributes:
        stage: the catalogue span name it strikes.
        kind: one of ``KINDS``.
        arg: the exit code (``exit``), signal number (``kill``) or seconds (``slow``); else None.
        role: the whole role name it is limited to; None: every process.
        occurrence: strike the N-th entry of the stage in the process; None: every entry.
    """

    stage: str
    kind: str
    arg: int | float | None = None
    role: str | None = None
    occurrence: int | None = 1

    def applies_to(self, role: str) -> bool:
        return self.role is None or self.role == role

    def strikes(self, entry: int) -> bool:
        """Whether the ``entry``-th entry of the stage (1-based) is struck."""
        return self.occurrence is None or entry == self.occurrence

    def __str__(self) -> str:
        kind = self.kind
        if self.kind == "kill":
            kind += f":{_signal_name(int(self.arg))}"  # type: ignore[arg-type]
        elif self.arg is not None:
            kind += f":{self.arg:g}" if self.kind == "slow" else f":{self.arg}"
        role = f"@{self.role}" if self.role else ""
        n = "#*" if self.occurrence is None else ("" if self.occurrence == 1 else f"#{self.occurrence}")
        return f"{self.stage}:{kind}{role}{n}"

    def describe(self) -> str:
        """What the fault does, in words (for the log)."""
        if self.kind == "exit":
            return f"the process exits at once with code {self.arg}"
        if self.kind == "kill":
            return f"the process sends itself {_signal_name(int(self.arg))}"  # type: ignore[arg-type]
        if self.kind == "slow":
            return f"the stage sleeps {self.arg:g} s first"
        return {
            "hang": "the stage never returns (this thread blocks; heartbeat goes on)",
            "freeze": "the whole process stops (SIGSTOP; SIGCONT resumes it)",
            "gil": "a native call holds the GIL: every Python thread stops, heartbeat included, "
            "while the OS shows the process running (a signal still ends it)",
            "crash": "the stage raises InjectedFault",
        }[self.kind]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _parse_signal(text: str) -> int:
    value = text.strip()
    if value.isdigit():
        try:
            return int(signal.Signals(int(value)))
        except ValueError:
            raise ValueError(f"kill:{text}: no signal number {value} on this system") from None
    name = value.upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return int(signal.Signals[name])
    except KeyError:
        known = [s.name for s in signal.Signals]
        close = difflib.get_close_matches(name, known, n=3)
        hint = (
            f"; did you mean {', '.join(close)}?"
            if close
            else " (e.g. SIGKILL, SIGTERM, SIGSEGV or a number)"
        )
        raise ValueError(f"kill:{text}: unknown signal {text!r}{hint}") from None


def _check_stage(name: str, spec: str) -> str:
    span = catalogue.SPANS.get(name)
    if span is None:
        if not name:
            raise ValueError(f"fault {spec!r}: no stage before ':' (expected {GRAMMAR})")
        stages = [s.name for s in catalogue.SPANS.values() if s.level != catalogue.REQUEST]
        close = difflib.get_close_matches(name, stages, n=3, cutoff=0.5)
        close += [s for s in stages if name in s and s not in close][: max(0, 3 - len(close))]
        hint = f"did you mean {', '.join(close)}?" if close else "see docs/spans.md for the stage names"
        raise ValueError(f"fault {spec!r}: unknown stage {name!r}; {hint}")
    if span.level == catalogue.REQUEST:
        raise ValueError(
            f"fault {spec!r}: {name} is a request span (recorded after the fact); a fault can strike "
            f"only a lifecycle or step stage"
        )
    return name


def _parse_one(spec: str) -> Fault:
    match = _SPEC.match(spec)
    if match is None:
        raise ValueError(f"fault {spec!r}: expected {GRAMMAR}")
    stage = _check_stage(match["stage"].strip(), spec)
    kind, arg_text = match["kind"].strip().lower(), match["arg"]
    if kind not in KINDS:
        close = difflib.get_close_matches(kind, KINDS, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ValueError(f"fault {spec!r}: unknown kind {kind!r} (one of {', '.join(KINDS)}){hint}")
    arg: int | float | None = None
    if kind in _NEEDS_ARG:
        if arg_text is None or not arg_text.strip():
            raise ValueError(f"fault {spec!r}: {kind} needs a value: {_NEEDS_ARG[kind]}")
        arg_text = arg_text.strip()
        if kind == "exit":
            if not arg_text.isdigit() or not 0 <= int(arg_text) <= 255:
                raise ValueError(
                    f"fault {spec!r}: exit code must be a whole number in 0..255, got {arg_text!r}"
                )
            arg = int(arg_text)
        elif kind == "kill":
            try:
                arg = _parse_signal(arg_text)
            except ValueError as e:
                raise ValueError(f"fault {spec!r}: {e}") from None
        else:
            try:
                arg = float(arg_text)
            except ValueError:
                arg = math.nan
            if not (math.isfinite(arg) and arg > 0):
                raise ValueError(f"fault {spec!r}: slow needs a number of seconds > 0, got {arg_text!r}")
    elif arg_text is not None:
        raise ValueError(f"fault {spec!r}: {kind} takes no value (got {kind}:{arg_text})")
    role = match["role"]
    if role is not None:
        role = role.strip()
        if not _ROLE.match(role):
            raise ValueError(
                f"fault {spec!r}: @ROLE must be a whole role name such as Worker_DP0_PP0_TP0, "
                f"EngineCore_DP0, APIServer_0, DPCoordinator or LLM, got {role!r}"
            )
    occurrence: int | None = 1
    n = match["n"]
    if n is not None:
        n = n.strip()
        if n == "*":
            occurrence = None
        elif n.isdigit() and int(n) >= 1:
            occurrence = int(n)
        else:
            raise ValueError(f"fault {spec!r}: #N must be a whole number >= 1 or *, got {n!r}")
    return Fault(stage=stage, kind=kind, arg=arg, role=role, occurrence=occurrence)


def parse_faults(text: str) -> list[Fault]:
    """Parse a fault spec (``STAGE:KIND[@ROLE][#N]``, several separated by ``,``).

    Pure: reads nothing but ``text`` and the catalogue. Empty text (or only commas and
    spaces) gives an empty list.

    Raises:
        ValueError: one line naming the bad fault and what is wrong (an unknown stage comes
            with the close matches).
    """
    faults = []
    for part in str(text).split(","):
        spec = part.strip()
        if spec:
            faults.append(_parse_one(spec))
    return faults


# ------------------------------------------------------------------------------ striking

_ANNOUNCE_S = 0.2  # s a freeze, kill or exit waits so live telemetry can say it struck
_release = threading.Event()  # replaced by release_hangs(); a hang waits on the one it saw
_installed: Callable[[], None] | None = None
_armed: frozenset[str] = frozenset()  # stage names a fault of this process targets
_install_lock = threading.Lock()


def release_hangs() -> None:
    """Let every thread blocked by a ``hang`` fault go on (for tests; nothing in Glassbox
    calls it). Later hangs block again."""
    global _release
    old, _release = _release, threading.Event()
    old.set()


def _hang() -> None:
    released = _release
    # A wait in short slices: SIGTERM's handler (SystemExit in the main thread) runs between
    # them, so a hung process can still be stopped; other threads are not held.
    while not released.wait(0.5):
        pass


def strike(fault: Fault, role: str, entry: int) -> None:
    """Do what ``fault`` says, now, inside its stage (called by the hook on ``enter``)."""
    logger.warning(
        "FAULT INJECTED: %s strikes %s (pid %d) at %s (entry %d): %s",
        fault, role, os.getpid(), fault.stage, entry, fault.describe(),
    )  # fmt: skip
    kind = fault.kind
    record_fault(str(fault), fault.stage, kind)
    if kind in ("freeze", "gil", "kill", "exit"):
        # The process is about to stop or end: give the telemetry socket's I/O thread a
        # moment to send the heartbeat that carries the fault.
        time.sleep(_ANNOUNCE_S)
    if kind == "slow":
        time.sleep(float(fault.arg))  # type: ignore[arg-type]
    elif kind == "crash":
        raise InjectedFault(f"injected fault {fault} struck {role} at stage {fault.stage} ({ENV})")
    elif kind == "hang":
        _hang()
    elif kind == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "gil":
        _hold_the_gil()
    elif kind == "kill":
        _flush()
        os.kill(os.getpid(), int(fault.arg))  # type: ignore[arg-type]
    elif kind == "exit":
        _flush()
        os._exit(int(fault.arg))  # type: ignore[arg-type]


def _hold_the_gil() -> None:
    # ctypes.PyDLL keeps the GIL during the call (CDLL would release it): libc's sleep then
    # stops every Python thread of the process. A signal interrupts the sleep, and its
    # Python handler (SIGTERM → SystemExit) runs as the call returns.
    import ctypes

    libc = ctypes.PyDLL(None)
    while True:
        libc.sleep(3600)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not stop the fault
            pass


class _FaultHook:
    """The stage hook: per targeted stage, its faults and how often it was entered."""

    def __init__(self, role: str, faults: list[Fault]) -> None:
        self.role = role
        self.by_stage: dict[str, list[Fault]] = {}
        for fault in faults:
            self.by_stage.setdefault(fault.stage, []).append(fault)
        self.entries: dict[str, int] = dict.fromkeys(self.by_stage, 0)
        self.lock = threading.Lock()

    def __call__(self, event: str, name: str, attrs: Mapping[str, Any]) -> None:
        faults = self.by_stage.get(name)
        if faults is None or event != "enter":
            return
        with self.lock:
            self.entries[name] += 1
            entry = self.entries[name]
        for fault in faults:
            if fault.strikes(entry):
                strike(fault, self.role, entry)


def install_faults(role: str, text: str | None = None, *, quiet: bool = False) -> list[Fault]:
    """Arm the faults of ``text`` (default: ``$GLASSBOX_FAULT``) that apply to ``role``.

    Replaces what an earlier call armed in this process (so each ``setup_tracing`` starts
    from the environment as it is); with no spec, disarms and returns ``[]``. When a spec is
    set, logs one WARNING line naming the faults of this process (or saying none applies).

    Returns:
        the faults armed in this process.

    Raises:
        ValueError: the spec does not parse (the first process has checked it already).
    """
    global _installed, _armed
    if text is None:
        text = os.environ.get(ENV, "")
    faults = parse_faults(text) if text else []
    mine = [f for f in faults if f.applies_to(role)]
    with _install_lock:
        if _installed is not None:
            _installed()
            _installed = None
        if mine:
            _installed = add_stage_hook(_FaultHook(role, mine))
        _armed = frozenset(f.stage for f in mine)
    if mine and not quiet:
        logger.warning(
            "FAULT INJECTION ON in %s (pid %d): %s — armed: struck on purpose if this process enters that stage (%s)",
            role, os.getpid(), "; ".join(f"{f} ({f.describe()})" for f in mine), ENV,
        )  # fmt: skip
    elif faults and not quiet:
        logger.warning(
            "FAULT INJECTION ON (%s=%s): no fault targets %s (pid %d)", ENV, text, role, os.getpid()
        )
    return mine


def arm_before_config(role: str, text: str | None) -> None:
    """Arm ``text``'s faults for ``role`` before the configuration is validated, so a fault
    can strike ``cli.validate_config`` too (the first process's first stage). Quiet, and a
    spec that does not parse arms nothing: the validation that follows reports it."""
    if text is None:
        text = os.environ.get(ENV, "")
    try:
        install_faults(role, text, quiet=True)
    except ValueError:
        pass


def armed_stages() -> frozenset[str]:
    """The stage names a fault armed in this process targets. Stages entered only on demand
    (a worker's per-step ``worker.execute_model``, ``model_runner.forward``, ``model_runner.sample``: with
    ``--collect-detailed-traces``) are also entered when a fault targets them, so any stage
    of the catalogue can be struck."""
    return _armed


def uninstall_faults() -> None:
    """Disarm the faults armed in this process, and forget those that struck (tests)."""
    global _installed, _armed
    forget_faults()
    with _install_lock:
        _armed = frozenset()
        if _installed is not None:
            _installed()
            _installed = None
