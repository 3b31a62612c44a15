"""``glassbox doctor``: what is wrong with a running, hung or dead instance, in plain words.

It attaches to the one running instance (or ``--run-dir DIR``: any run directory, also one
left behind by an instance that died, or one removed after a failure whose post-mortem is
kept; ``--last``: the newest kept post-mortem or stale run directory, said to be gone and
when it ended; with several running it lists them) and puts together everything the tree
already writes down:

- the tree against the expected count and each process's OS state (``tracing.instances``,
  as ``glassbox ps``);
- each process's live stage, time in it, heartbeat age and open waits, from ~2 s of live
  telemetry (``tracing.telemetry.collector``); the status files when there is none;
- crash reports (``<role>.crash.json``);
- each live process's Python stack: SIGUSR1 makes it dump every thread through faulthandler
  into ``<role>.stacks`` (``tracing.stacks``, registered at process start); a stopped process
  cannot dump (doctor says so); ``py-spy dump`` is a second source when installed;
- a **diagnosis**: the process that explains the state — a dead one, a stopped one, a frozen
  one, else the deepest one stuck in a stage longest — with its stage, time, the hint for
  that stage (``tracing.hints``, the words engine-top and the deadline messages use) and the
  line its main thread waits at.

Exit 0 when healthy (every planned process up, out of start-up, heartbeats fresh), 1 when
not (also when no instance is running), 2 for a usage error or several instances to choose from. ``--json`` prints the same as
data. Every wait is bounded and a half-written run directory is read as far as it goes.
vLLM has no counterpart (its users read "Engine core initialization failed. See root cause
above" and reach for py-spy).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from engine.cli.help_formatter import DefaultsHelpFormatter
from engine.cli.ps import collect_instance
from engine.utils import processes
from engine.utils import run_dir as run_dirs
from tracing import blame, hints
from tracing import run_dir as contract
from tracing import stacks as stack_dumps
from tracing.instances import STOPPED_STATES, InstanceInfo, placement_text, runs_as_text
from tracing.telemetry.state import IDLE_POLL_WAIT_S

DESCRIPTION = """Diagnose a Glassbox instance: its process tree against the plan, each
process's state, stage and time in it, heartbeat age, crash reports and Python stacks
(SIGUSR1 → faulthandler; py-spy when installed), then a diagnosis in plain words with what to
check. Exit status 0 when healthy, 1 when not."""

EXIT_HEALTHY, EXIT_SICK, EXIT_USAGE = 0, 1, 2
# The deeper in the tree, the more likely the cause: a worker holds its engine core, which
# holds the API server.
_DEPTH = {
    "worker": 3,
    "engine_core": 2,
    "dp_coordinator": 1,
    "coordinator": 1,
    "api_server": 1,
    "frontend": 0,
    "headless": 0,
}
_UNNAMED_THREAD = re.compile(r"^(Thread-\d+|Dummy-\d+|ThreadPoolExecutor-|asyncio_|pydevd)")


@dataclass
class ProcessReport:
    """One process as doctor sees it (``--json``: ``processes``)."""

    role: str
    kind: str
    pid: int | None
    rank: int | None
    os_state: str  # psutil's word, "exited" or "not started"
    state: str  # running, starting, stopped, frozen, dead, not started
    stage: str | None = None
    time_in_stage_s: float | None = None
    heartbeat_age_s: float | None = None
    waits: list[str] = field(default_factory=list)
    note: str | None = None
    crash: dict[str, Any] | None = None
    stack_error: str | None = None
    threads: list[dict[str, Any]] = field(default_factory=list)
    other_threads: int = 0
    py_spy: str | None = None
    depth: int = 0
    faults: list[str] = field(default_factory=list)
    flight: list[dict[str, Any]] = field(default_factory=list)
    # Where ``flight`` came from: "flight recorder" (written as it died) or the live telemetry
    # heard while doctor watched (only the steps of those seconds).
    flight_source: str = ""
    placed: str = ""  # where a Ray cluster placed it (tracing.instances.placement_text)
    runs_as: str = ""  # how a worker runs its model (tracing.instances.runs_as_text)
    collectives: list[str] = field(default_factory=list)  # a worker in a step: "tp all_reduce #3 (inside)"

    @property
    def main_top(self) -> str | None:
        main = next((t for t in self.threads if t.get("main")), None)
        return main.get("waits_at") or main["top"] if main else None


@dataclass
class Report:
    run_dir: str
    mode: str | None
    expected: int | None
    found: int
    live_telemetry: bool
    processes: list[ProcessReport]
    alerts: list[dict[str, Any]]
    problems: list[str]
    healthy: bool = False
    verdict: str = ""
    diagnosis: str = ""
    hint: str = ""
    culprit: str | None = None
    culprit_stage: str | None = None  # the stage the culprit failed in or is in (tracing.blame)
    now: float = 0.0  # Unix time (s) the report describes
    # The tree is gone (a kept post-mortem, or a stale run directory): where it lived, when
    # and why it ended, the root cause it printed (``_gone``); None for a live one.
    gone: dict[str, Any] | None = None
    blame: Any = field(default=None, repr=False)  # tracing.blame.Blame, or None


# ------------------------------------------------------------------------ gathering


def _live_state(run_dir: Path, inst: InstanceInfo, watch_s: float):
    """~``watch_s`` of live telemetry (a ``LiveState``), or None when nothing publishes."""
    from tracing.telemetry.collector import Collector

    alive = {p.role for p in inst.processes if p.role and p.alive and p.state not in STOPPED_STATES}
    if not alive:
        return None
    collector = Collector(run_dir).start()
    try:

        def every_alive_beat(state) -> bool:
            return all(
                (p := state.processes.get(role)) is not None and p.heartbeat_at is not None for role in alive
            )

        state = collector.wait_until(every_alive_beat, watch_s)
    finally:
        collector.stop()
    if not any(p.heartbeat_at is not None for p in state.processes.values()):
        return None
    return state


def _os_state_now(pid: int | None) -> str | None:
    """psutil's word for ``pid``'s state now, or None when it cannot be read."""
    if pid is None:
        return None
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return None


def _gather(run_dir: Path, watch_s: float, want_stacks: bool, stack_timeout_s: float) -> Report:
    inst = collect_instance(run_dir)
    live = None
    if not inst.stale:
        try:
            live = _live_state(run_dir, inst, watch_s)
        except Exception as e:  # telemetry is a bonus: never let it sink the diagnosis
            inst.problems.append(f"live telemetry unavailable: {e}")
    now = live.now if live is not None else time.time()
    reports: list[ProcessReport] = []
    for p in inst.processes:
        if p.role is None:
            continue
        rep = ProcessReport(role=p.role, kind=p.kind, pid=p.pid, rank=p.rank, os_state=p.state,
                            state="", note=p.note, depth=_DEPTH.get(p.kind, 0))  # fmt: skip
        rep.stage, rep.time_in_stage_s = p.stage, p.time_in_stage_s if p.stage else None
        comm = contract.read_comm(run_dir, p.role)
        lp = live.processes.get(p.role) if live is not None else None
        if lp is not None and lp.heartbeat_at is not None:
            rep.heartbeat_age_s = round(max(0.0, now - lp.heartbeat_at), 2)
            if lp.stages:
                rep.stage = lp.stage
                rep.time_in_stage_s = max(0.0, now - (lp.stage_entered_at or now))
            elif p.alive and p.state not in STOPPED_STATES:
                rep.stage, rep.time_in_stage_s = None, None
            # Short waits are idle polls repeated by design (engine-top hides them too).
            rep.waits = [
                f"{w.what} for {now - w.started_at:.1f} s (deadline {w.timeout_s:.0f} s)"
                for w in lp.waits
                if w.timeout_s >= IDLE_POLL_WAIT_S
            ]
        if not rep.stage and comm is not None and comm.rpc:
            # Inside a step RPC (no lifecycle stage): busy, not idle; a dead worker died in it
            # (its clock stopped then, as a lifecycle stage's does).
            rep.stage = f"worker.{comm.rpc}"
            rep.time_in_stage_s = max(0.0, now - (comm.rpc_entered_at or now)) if p.alive else None
            rep.collectives = [f"{g.group} {g.kind} #{g.seq}" + (" (inside)" if g.inside else "")
                               for g in comm.groups if g.seq]  # fmt: skip
        if rep.time_in_stage_s is not None:
            rep.time_in_stage_s = round(rep.time_in_stage_s, 2)
        rep.faults = list(p.faults)
        rep.placed = placement_text(p.placement)
        rep.runs_as = runs_as_text(p.runs_as)
        if lp is not None:
            rep.faults += [
                f"{f.spec} in {f.stage}" for f in lp.faults if f"{f.spec} in {f.stage}" not in rep.faults
            ]
        rep.flight, rep.flight_source = _flight(run_dir, p, live, watch_s)
        crash = contract.read_crash_report(run_dir, p.role)
        if crash is not None:
            rep.crash = {"stage": crash.stage, "exception": crash.exception, "pid": crash.pid,
                         "traceback_tail": (crash.traceback or "").strip().splitlines()[-6:],
                         "caused_by": crash.caused_by}  # fmt: skip
        if not p.alive:
            rep.state = "not started" if p.state == "not started" else "dead"
        elif p.state in STOPPED_STATES:
            rep.state = "stopped"
        elif lp is not None and lp.state == "stale":
            # The OS state above was read before the live watch: a process that stopped during
            # the watch reads as stale there. A fresh look decides between stopped and frozen.
            rep.os_state = _os_state_now(p.pid) or rep.os_state
            rep.state = "stopped" if rep.os_state in STOPPED_STATES else "frozen"
        elif rep.stage and (lp is None or lp.state == "starting" or _is_lifecycle(rep.stage)):
            rep.state = "starting"
        else:
            rep.state = "running"
        reports.append(rep)
    if want_stacks:
        _collect_stacks(run_dir, reports, stack_timeout_s)
    alerts = [asdict(a) for a in live.alerts] if live is not None else []
    known = {}
    for rep in reports:
        if rep.state in ("stopped", "frozen"):
            word = (
                f"stopped by a signal (os state {rep.os_state})"
                if rep.state == "stopped"
                else "frozen: no heartbeat"
            )
            known[rep.role] = blame.Seen(rep.role, **{rep.state: word})
    culprit = blame.blame_run_dir(run_dir, now, known)
    return Report(blame=culprit, run_dir=str(run_dir), mode=inst.mode, expected=inst.expected_process_count,
                  found=inst.found_process_count, live_telemetry=live is not None, processes=reports,
                  alerts=alerts, problems=list(inst.problems), now=now)  # fmt: skip


FLIGHT_STEPS = 8  # the last steps doctor shows of each engine core


def _flight(run_dir: Path, p, live, watch_s: float) -> tuple[list[dict[str, Any]], str]:
    """An engine core's last steps and where they came from: the live telemetry heard in
    doctor's ``watch_s`` (only those seconds' steps), else the flight recorder it wrote as it
    died (``<role>.flight.json``); ``([], "")`` for any other process or neither."""
    if p.kind != "engine_core":
        return [], ""
    steps: list[dict[str, Any]] = []
    source = "flight recorder"
    if live is not None and p.rank is not None and live.steps.get(p.rank):
        steps = [
            {f: getattr(r, f) for f in r.__struct_fields__} for r in list(live.steps[p.rank])[-FLIGHT_STEPS:]
        ]
        source = f"heard in {watch_s:g} s of live telemetry"
    else:
        try:
            data = json.loads(processes.flight_file(run_dir, p.role).read_text())
            steps = [s for s in (data.get("steps") or []) if isinstance(s, dict)][-FLIGHT_STEPS:]
        except (OSError, ValueError, AttributeError):
            steps = []
    keep = ("step_id", "started_at", "duration_ms", "num_decode_tokens", "num_prefill_tokens",
            "token_budget", "num_running", "num_waiting", "kv_usage", "dummy")  # fmt: skip
    return [{k: s[k] for k in keep if k in s} for s in steps], (source if steps else "")


def _is_lifecycle(stage: str) -> bool:
    from tracing import catalogue

    spec = catalogue.SPANS.get(stage)
    return spec is not None and spec.level == catalogue.LIFECYCLE and not stage.endswith(".shutdown")


def _boilerplate(file: str, func: str) -> bool:
    """Frames every thread has (the interpreter's start-up, threading's bootstrap)."""
    return file.startswith("<frozen runpy>") or (
        file.endswith("/threading.py") and func in ("_bootstrap", "_bootstrap_inner", "run")
    )


def _collect_stacks(run_dir: Path, reports: list[ProcessReport], timeout_s: float) -> None:
    py_spy = shutil.which("py-spy")

    def one(rep: ProcessReport) -> None:
        if rep.pid is None or rep.state in ("dead", "not started"):
            return
        if rep.state == "stopped":
            rep.stack_error = (
                f"stopped: it cannot dump its stack until continued (kill -CONT {rep.pid}); "
                f"py-spy dump --pid {rep.pid} reads it from outside"
            )
        else:
            result = stack_dumps.request_dump(run_dir, rep.role, rep.pid, timeout_s=timeout_s)
            rep.stack_error = result.error
            for t in result.threads:
                named = t.name is not None and not _UNNAMED_THREAD.match(t.name)
                if t.main or named:
                    rep.threads.append({"name": t.name or ("MainThread" if t.main else t.ident),
                                        "ident": t.ident, "main": t.main, "top": t.top,
                                        "waits_at": stack_dumps.where_waits(t.frames),
                                        "frames": [f"{stack_dumps.short_path(f)}:{n} in {fn}" for f, n, fn in t.frames
                                                   if not _boilerplate(f, fn)]})  # fmt: skip
                else:
                    rep.other_threads += 1
        if py_spy:
            try:
                out = subprocess.run([py_spy, "dump", "--pid", str(rep.pid)], capture_output=True,
                                     text=True, timeout=5.0)  # fmt: skip
                rep.py_spy = (out.stdout or out.stderr).strip() or None
            except (OSError, subprocess.SubprocessError) as e:
                rep.py_spy = f"py-spy failed: {e}"

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(one, reports))


# ------------------------------------------------------------------------ diagnosis


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return f"{seconds:.1f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


def _who(rep: ProcessReport) -> str:
    return f"{rep.role} (pid {rep.pid})" if rep.pid else rep.role


def diagnose(report: Report) -> None:
    """Fill ``healthy``, ``verdict``, ``diagnosis``, ``hint`` and ``culprit``."""
    procs = report.processes
    counted = [p for p in procs if p.kind != "frontend" or report.mode == "inproc"]
    deepest_first = sorted(procs, key=lambda p: (-p.depth, -(p.time_in_stage_s or 0.0)))

    def where(rep: ProcessReport) -> str:
        if rep.stage:
            return f" in stage {rep.stage} for {_age(rep.time_in_stage_s)}"
        return ""

    def at(rep: ProcessReport) -> str:
        return f"; its main thread waits at {rep.main_top}" if rep.main_top else ""

    def stage_words(rep: ProcessReport) -> str:
        return f" {rep.stage}: {hints.stage_hint(rep.stage).hint}." if rep.stage else ""

    def settle(verdict: str, rep: ProcessReport | None, text: str, hint: str) -> None:
        struck = rep.faults if rep is not None and rep.faults else [f for p in procs for f in p.faults]
        if struck and verdict != "healthy":
            # Said plainly: this state was asked for (a lesson, a test), not found.
            text += f" An injected fault struck: {'; '.join(struck)} (--inject-fault / GLASSBOX_FAULT)."
        report.verdict, report.diagnosis, report.hint = verdict, text, hint
        report.culprit = rep.role if rep is not None else None
        report.healthy = verdict == "healthy"

    culprit = report.blame
    if culprit is not None:
        # The one blame rule (tracing/blame.py), as the root-cause block and engine-top's alert.
        rep = next((p for p in procs if p.role == culprit.role), None)
        if rep is not None:
            words = {"failed": "failed", "dead": "is dead", "stopped": "is stopped",
                     "frozen": "is frozen", "waited_on": "holds up its peers", "held": "is held",
                     "late": "was still at work"}  # fmt: skip
            stage = culprit.stage
            in_stage = f" in stage {stage}" if stage else ""
            text = f"{_who(rep)} {words[culprit.verdict]}{in_stage}: {culprit.reason}{at(rep)}."
            verdict = {"failed": "dead", "waited_on": "stuck", "held": "stuck", "late": "stuck"}.get(
                culprit.verdict, culprit.verdict
            )
            hint = {"dead": hints.DEAD + ".", "failed": hints.DEAD + ".",
                    "stopped": hints.STOPPED.replace("<pid>", str(rep.pid)) + ".",
                    "frozen": hints.FROZEN.replace("<pid>", str(rep.pid)) + "."}.get(culprit.verdict, "")  # fmt: skip
            if report.gone is not None:  # nothing left to continue or to dump: what ended it, said so
                hint = {"stopped": hints.GONE_STOPPED + ".", "frozen": hints.GONE_FROZEN + "."}.get(
                    culprit.verdict, hint
                )
            if stage:
                hint = (hint + " " if hint else "") + f"{stage}: {hints.stage_hint(stage).hint}."
            settle(verdict, rep, text, hint)
            report.culprit_stage = stage
            return
    dead = [p for p in deepest_first if p.state == "dead" and (p.kind != "frontend" or p.crash)]
    dead.sort(key=lambda p: p.crash is None)  # one with a crash report explains itself
    if dead:
        rep = dead[0]
        stage = rep.stage or (rep.crash or {}).get("stage")
        how = rep.note or "exited"
        crash = f"; crashed: {rep.crash['exception']}" if rep.crash and rep.crash.get("exception") else ""
        in_stage = f" (last seen in stage {stage})" if stage else ""
        others = f" ({len(dead) - 1} more dead)" if len(dead) > 1 else ""
        settle("dead", rep, f"{_who(rep)} is dead: {how}{in_stage}{crash}{others}.", hints.DEAD)
        return
    stopped = [p for p in deepest_first if p.state == "stopped"]
    if stopped:
        rep = stopped[0]
        text = (f"{_who(rep)} is stopped (SIGSTOP, Ctrl-Z or a debugger){where(rep)}; a stopped process "
                f"cannot dump its stack while stopped.")  # fmt: skip
        settle("stopped", rep, text, hints.STOPPED.replace("<pid>", str(rep.pid)) + "." + stage_words(rep))
        return
    frozen = [p for p in deepest_first if p.state == "frozen"]
    if frozen:
        rep = frozen[0]
        text = f"{_who(rep)} is frozen: no heartbeat for {_age(rep.heartbeat_age_s)}{where(rep)}{at(rep)}."
        settle("frozen", rep, text, hints.FROZEN.replace("<pid>", str(rep.pid)) + "." + stage_words(rep))
        return
    held = [p for p in deepest_first if p.stage and any(f.endswith(f" in {p.stage}") for f in p.faults)]
    if held:
        # Held by an injected fault: said at once, whatever the stage's usual ceiling.
        rep = held[0]
        settle("stuck", rep, f"{_who(rep)} is held{where(rep)}{at(rep)}.",
               f"{rep.stage}: {hints.stage_hint(rep.stage).hint}.")  # fmt: skip
        return
    stopping = [p for p in deepest_first if p.stage and p.stage.endswith(".shutdown")]
    if stopping:
        rep = stopping[0]
        settle("stopping", rep, f"{_who(rep)} is shutting down{where(rep)}: the instance is stopping.",
               "run glassbox doctor again in a moment (--run-dir DIR once it is gone), or read its log.")  # fmt: skip
        return
    in_stage = [p for p in deepest_first if p.stage and p.state in ("starting", "running")]
    if in_stage:
        rep = in_stage[0]
        h = hints.stage_hint(rep.stage)
        slow = (rep.time_in_stage_s or 0.0) > h.slow_after_s
        if slow or _is_lifecycle(rep.stage):
            verdict = "stuck" if slow else "starting"
            lead = "is stuck" if slow else "is still starting"
            usual = f" (usually {h.typical}; alert after {h.slow_after_s:g} s)" if h.typical else ""
            text = f"{_who(rep)} {lead}{where(rep)}{usual}{at(rep)}."
            settle(verdict, rep, text, f"{rep.stage}: {h.hint}.")
            return
    missing = [p for p in counted if p.state == "not started"]
    if missing:
        rep = missing[0]
        settle("starting", rep, f"{rep.role} has not started (no status file).", hints.NOT_STARTED + ".")
        return
    if report.expected is not None and report.found != report.expected:
        settle("incomplete", None, f"{report.found} of {report.expected} expected processes found.",
               "a planned process is missing or an extra one runs: see glassbox ps.")  # fmt: skip
        return
    errors = [a for a in report.alerts if a.get("severity") == "error"]
    if errors:
        # engine-top sees something doctor's own rules did not (e.g. a death just reported).
        first = errors[0]
        settle("unhealthy", None, f"engine-top alerts: {first['message']}.", (first.get("hint") or "") + ".")
        return
    n = len([p for p in counted if p.state == "running"])  # as glassbox ps counts: not the owner
    source = "heartbeats fresh" if report.live_telemetry else "no live telemetry (status files only)"
    settle("healthy", None, f"healthy: {n} processes running, none in a start-up stage, {source}.", "")


# ------------------------------------------------------------------------ rendering


def to_json(report: Report) -> dict[str, Any]:
    data = asdict(report)
    data.pop("blame", None)
    for entry, rep in zip(data["processes"], report.processes, strict=True):
        entry["main_top"] = rep.main_top
    return data


def render_text(report: Report, out, max_frames: int = 6) -> None:
    w = out.write
    w(f"glassbox doctor: {report.run_dir}  mode={report.mode or '?'}\n")
    w(f"processes: found {report.found} of expected {report.expected if report.expected is not None else '?'}"
      f"  (live telemetry: {'yes' if report.live_telemetry else 'no, status files only'})\n")  # fmt: skip
    for problem in report.problems:
        w(f"  ! {problem}\n")
    w("\n")

    def indent_of(p: ProcessReport) -> str:
        return "  " * max(0, p.depth - 1) if p.kind != "frontend" else ""

    # One column width for the indented roles, so pid, state and stage line up at every depth.
    role_width = max([24, *(len(indent_of(p) + p.role) for p in report.processes)])
    for p in report.processes:
        indent = indent_of(p)
        timed = p.stage and p.time_in_stage_s is not None  # a dead one's clock stopped: no time
        stage = f"{p.stage} for {_age(p.time_in_stage_s)}" if timed else (p.stage or "idle")
        beat = f"heartbeat {_age(p.heartbeat_age_s)} ago" if p.heartbeat_age_s is not None else "no heartbeat"
        w(f"{indent + p.role:<{role_width}} pid {p.pid or '-':<7} {p.state:<10} {stage:<44} {beat}\n")
        if p.placed:
            w(f"{indent}    placed as {p.placed}\n")
        if p.runs_as:
            w(f"{indent}    runs as {p.runs_as}\n")
        if p.note and p.state in ("dead", "not started"):
            w(f"{indent}    {p.note}\n")
        for wait in p.waits:
            w(f"{indent}    waiting for {wait}\n")
        if p.collectives:
            w(f"{indent}    collectives this step: {', '.join(p.collectives)}\n")
        for fault in p.faults:
            w(f"{indent}    injected fault struck: {fault}\n")
        if p.crash and p.crash.get("caused_by"):
            # An echo: it stopped because another process failed (the diagnosis names that one).
            w(f"{indent}    crash report: stopped because {p.crash['caused_by']} failed\n")
        elif p.crash:
            where = f" (stage {p.crash['stage']})" if p.crash.get("stage") else ""
            w(f"{indent}    crash report: {p.crash.get('exception')}{where}\n")
            for line in p.crash.get("traceback_tail") or []:
                w(f"{indent}      {line}\n")
    for p in report.processes:
        if p.flight:
            w(f"\nlast steps of {p.role} ({p.flight_source or 'flight recorder'}, oldest first):\n")
            for st in p.flight:
                w("  " + _step_line(st, report) + "\n")
    live = [p for p in report.processes if p.state not in ("dead", "not started")]
    if live:
        w("\nstacks (main thread and named threads; most recent call first):\n")
    for p in live:
        w(f"\n  {p.role} (pid {p.pid}):\n")
        if p.stack_error:
            w(f"    no stack: {p.stack_error}\n")
        for t in p.threads:
            w(f"    {t['name']}{' (main)' if t['main'] and t['name'] != 'MainThread' else ''}:\n")
            for frame in t["frames"][:max_frames]:
                w(f"      {frame}\n")
            if len(t["frames"]) > max_frames:
                w(f"      ... {len(t['frames']) - max_frames} more frames\n")
        if p.other_threads:
            w(f"    (+ {p.other_threads} other threads)\n")
        if p.py_spy:
            w("    py-spy:\n" + "".join(f"      {line}\n" for line in p.py_spy.splitlines()))
    if report.alerts:
        w("\nalerts (engine-top):\n")
        for a in report.alerts:
            w(f"  {a['severity']}: {a['message']}" + (f" — {a['hint']}" if a.get("hint") else "") + "\n")
    w(f"\ndiagnosis: {report.diagnosis}\n")
    if report.hint:
        w(f"what to check: {report.hint}\n")


def _step_line(st: dict[str, Any], report: Report) -> str:
    if st.get("dummy"):
        what = "dummy batch (DP wave)"
    else:
        what = (f"{st.get('num_decode_tokens', 0)} decode + {st.get('num_prefill_tokens', 0)} prefill tokens "
                f"of {st.get('token_budget', '?')}")  # fmt: skip
    ago = f", {_age(report.now - st['started_at'])} ago" if report.now and st.get("started_at") else ""
    return (f"#{st.get('step_id')}: {what}, {st.get('num_running', 0)} running, "
            f"{st.get('num_waiting', 0)} waiting, KV {float(st.get('kv_usage') or 0):.0%}, "
            f"{float(st.get('duration_ms') or 0):.1f} ms{ago}")  # fmt: skip


# ------------------------------------------------------------------------ command


def add_subparser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="Diagnose a running, hung or dead instance (stages, heartbeats, stacks, a diagnosis).",
        description=DESCRIPTION,
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument(
        "--run-dir",
        metavar="DIR",
        help="Diagnose this run directory (also one left by a dead instance, or one removed after a failure "
        "whose post-mortem is kept).",
    )
    p.add_argument(
        "--last",
        action="store_true",
        help="Diagnose the instance that ended last after a failure: the newest kept post-mortem "
        "(<GLASSBOX_CACHE_ROOT>/post_mortem) or stale run directory, whichever is newer.",
    )
    p.add_argument("--json", action="store_true", help="Print the report as JSON.")
    p.add_argument(
        "--watch",
        type=float,
        default=2.0,
        metavar="S",
        help="Seconds to listen to live telemetry (at most; less when every process has beaten).",
    )
    p.add_argument("--no-stacks", action="store_true", help="Do not ask the processes for their stacks.")
    p.set_defaults(func=run)  # fmt: skip


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.watch < 0 or args.watch > 60:
        parser.error(f"--watch: {args.watch:g} is out of range (0 to 60 s)")
    gone: dict[str, Any] | None = None
    if args.last and args.run_dir:
        parser.error("--last: give --last or --run-dir DIR, not both")
    if args.last:
        found = _last_ended()
        if found is None:
            msg = (f"no post-mortem under {run_dirs.post_mortem_root()} and no stale run directory under "
                   f"{run_dirs.run_dir_base()}: nothing ended after a failure")  # fmt: skip
            if args.json:
                print(json.dumps({"run_dir": None, "healthy": False, "verdict": "none", "diagnosis": msg}))
            else:
                print(msg)
            return EXIT_SICK
        run_dir, gone = found
    elif args.run_dir:
        run_dir = Path(args.run_dir)
        if not run_dir.is_dir():
            kept = contract.find_post_mortem(run_dir, run_dirs.post_mortem_root())
            if kept is None:
                parser.error(f"--run-dir: {run_dir} is not a directory (and no post-mortem of it is kept in "
                             f"{run_dirs.post_mortem_root()})")  # fmt: skip
            run_dir, gone = kept, _kept_facts(kept)
        elif contract.read_post_mortem(run_dir) is not None:  # a kept post-mortem named directly
            gone = _kept_facts(run_dir)
    else:
        from tracing.telemetry.collector import list_instances

        base = run_dirs.run_dir_base()
        running = list_instances(base)
        if not running:
            stale = [d for d in contract.list_run_dirs(base) if d not in running]
            msg = f"no running Glassbox instance under {base}: nothing to diagnose"
            if stale:
                msg += (f"\n{len(stale)} run director{'y' if len(stale) == 1 else 'ies'} left by instances that "
                        f"are gone (glassbox doctor --run-dir DIR diagnoses one):\n"
                        + "\n".join(f"  {d}" for d in stale))  # fmt: skip
            kept = contract.list_post_mortems(run_dirs.post_mortem_root())
            if kept:
                msg += (f"\n{len(kept)} post-mortem{'' if len(kept) == 1 else 's'} of instances that ended after "
                        f"a failure kept in {run_dirs.post_mortem_root()}; the newest ended "
                        f"{_when(kept[0][1].ended_at)} (glassbox doctor --last diagnoses it)")  # fmt: skip
            if args.json:
                print(json.dumps({"run_dir": None, "healthy": False, "verdict": "none", "diagnosis": msg}))
            else:
                print(msg)
            return EXIT_SICK  # nothing serving is not healthy (an ops probe must not read it so)
        if len(running) > 1:
            msg = f"{len(running)} instances are running; pick one with --run-dir:\n" + "\n".join(
                f"  {d}" for d in running
            )
            if args.json:
                print(json.dumps({"run_dir": None, "healthy": False, "verdict": "choose",
                                  "candidates": [str(d) for d in running]}))  # fmt: skip
            else:
                print(msg)
            return EXIT_USAGE
        run_dir = running[0]
    if gone is not None:  # nothing of the tree is alive: no telemetry to wait for, no stack to ask
        report = _gather(run_dir, 0.0, False, stack_timeout_s=1.0)
    else:
        report = _gather(run_dir, args.watch, not args.no_stacks, stack_timeout_s=1.0)
    report.gone = gone
    if gone is not None:
        _take_recorded_verdict(report, gone)
    diagnose(report)
    _name_existing_files(report, run_dir)
    if args.json:
        print(json.dumps(to_json(report), indent=2))
    else:
        if gone is not None:
            _render_gone_head(gone, sys.stdout)
        render_text(report, sys.stdout)
        if gone is not None and gone.get("root_cause"):
            sys.stdout.write(f"\nroot cause, as the instance printed it ({gone['root_cause_file']}):\n"
                             + "".join(f"  {line}\n" for line in gone["root_cause"].splitlines()))  # fmt: skip
    return EXIT_HEALTHY if report.healthy else EXIT_SICK


# ------------------------------------------------------------------------ a tree that is gone


def _when(t: float | None) -> str:
    if t is None:
        return "at an unknown time"
    return (
        f"at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t))} ({_age(max(0.0, time.time() - t))} ago)"
    )


def _kept_facts(kept: Path) -> dict[str, Any]:
    """What ``Report.gone`` says of a kept post-mortem (``tracing.run_dir.PostMortem``)."""
    pm = contract.read_post_mortem(kept)
    assert pm is not None  # the caller found it by its post_mortem.json
    cause_file = kept / contract.ROOT_CAUSE
    try:
        cause = cause_file.read_text(errors="replace")
    except OSError:
        cause = None
    return {"kept_in": str(kept), "run_dir": pm.run_dir, "ended_at": pm.ended_at, "reason": pm.reason,
            "root_cause": cause, "root_cause_file": str(cause_file) if cause is not None else None,
            "skipped": list(pm.skipped), "telemetry_record": pm.telemetry_record,
            "telemetry_record_file": str(kept / pm.telemetry_record_file) if pm.telemetry_record_file else None}  # fmt: skip


def _take_recorded_verdict(report: Report, gone: dict[str, Any]) -> None:
    """A tree that is gone: the culprit is the one its root-cause block named, as it stood
    then (``recorded_blame``), not one judged now from files the teardown has since changed;
    its row says how it stood. Without a block (a stale run directory), the rule judges the
    files (``_gather``)."""
    recorded = blame.recorded_blame(gone["root_cause"], report.now) if gone.get("root_cause") else None
    rep = next((p for p in report.processes if recorded is not None and p.role == recorded.role), None)
    if recorded is None or rep is None:
        return
    report.blame = recorded
    exit_text = (blame.root_cause_fields(gone["root_cause"]).get("exit") or [""])[0]
    if rep.state == "dead" and exit_text.startswith(blame.STILL_RUNNING):
        rep.note = f"{rep.note or 'exited'}: the teardown ended it; the root cause saw it {exit_text}"


def _last_ended() -> tuple[Path, dict[str, Any]] | None:
    """The newest of the kept post-mortems and the stale run directories (by when each
    ended), with its ``Report.gone``; None when there is neither."""
    candidates: list[tuple[float, Path, dict[str, Any] | None]] = []
    kept = contract.list_post_mortems(run_dirs.post_mortem_root())
    if kept:
        candidates.append((kept[0][1].ended_at, kept[0][0], None))
    for stale in contract.stale_run_dirs(run_dirs.run_dir_base()):
        ended = contract.last_written_at(stale)
        if ended is not None:
            facts = {"kept_in": None, "run_dir": str(stale), "ended_at": ended, "reason": contract.STALE_REASON,
                     "root_cause": None, "root_cause_file": None, "skipped": []}  # fmt: skip
            candidates.append((ended, stale, facts))
    if not candidates:
        return None
    _, path, facts = max(candidates, key=lambda c: c[0])
    return path, facts if facts is not None else _kept_facts(path)


def _render_gone_head(gone: dict[str, Any], out) -> None:
    out.write(f"the tree is gone: it ended {_when(gone.get('ended_at'))}: {gone.get('reason')}\n")
    if gone.get("kept_in"):
        out.write(f"its run directory {gone['run_dir']} was removed; read from the post-mortem kept in "
                  f"{gone['kept_in']}\n")  # fmt: skip
    else:
        out.write(
            f"read from its stale run directory {gone['run_dir']} (glassbox ps --all --clean removes it)\n"
        )
    for line in gone.get("skipped") or []:
        out.write(f"  not kept: {line}\n")
    if gone.get("telemetry_record_file"):
        out.write(f"its telemetry recording: engine-top --replay {gone['telemetry_record_file']}\n")
    out.write("\n")


# Where doctor's words name a file of the run directory by pattern (hints.DEAD does).
_CRASH_FILE_PATTERN = f"<role>{contract.CRASH_SUFFIX}"
NO_CRASH_REPORT = hints.NO_CRASH_REPORT  # engine-top's words too


def _name_existing_files(report: Report, run_dir: Path) -> None:
    """Doctor names only files that exist: each crash report's path (``crash["file"]``), and
    the hint's ``<role>.crash.json`` made the culprit's real path, or, when it wrote none,
    words saying so."""
    for rep in report.processes:
        if rep.crash is not None:
            path = contract.crash_path(run_dir, rep.role)
            rep.crash["file"] = str(path) if path.is_file() else None
    if _CRASH_FILE_PATTERN in report.hint:
        path = contract.crash_path(run_dir, report.culprit) if report.culprit else None
        if path is not None and path.is_file():
            report.hint = report.hint.replace(_CRASH_FILE_PATTERN, str(path))
        else:
            report.hint = NO_CRASH_REPORT
