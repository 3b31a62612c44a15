"""``glassbox ps``: the running Glassbox instances and the processes of each.

Every instance has a run directory (``engine/utils/run_dir.py``). Its manifest is the
*planned* tree — roles, ranks, the expected process count (A + DP + N, plus 1 coordinator
when DP > 1) — and each process's status file gives its pid and the lifecycle stage it is
in. psutil adds what the kernel knows: state, parent, uptime, RSS, threads, and the full
process title (``glassbox::<role>``, read from the command line because the kernel's short
name stops at 15 characters). Comparing plan and kernel answers "is everything up, and if
not, which role is missing and why" without any live telemetry, even when a process hangs.

Processes under a listed pid whose title is not ``glassbox::...`` (multiprocessing's
resource tracker, say) are *helpers*: shown apart and never counted.

Data and rendering are kept apart: ``collect_instances()`` returns ``InstanceInfo``
records (also for ``engine-top`` and ``glassbox doctor``); ``render_table`` and
``to_json`` turn them into text. vLLM has no such command — its processes are found with
``ps`` by their ``VLLM::EngineCore`` titles — so this one is ours.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from engine.cli.help_formatter import DefaultsHelpFormatter
from engine.distributed import topology
from engine.utils import run_dir as run_dirs

TITLE_PREFIX = topology.TITLE_PREFIX
# Roles the process-count formula counts. The offline LLM's process is the user's own, so
# it counts as nothing — except in "inproc" mode, where the whole engine runs inside it.
COUNTED_KINDS = ("api_server", "engine_core", "worker", "coordinator", "dp_coordinator")
# Slack for comparing a process's start time with a time it wrote (clock granularity).
_PID_REUSE_SLACK_S = 2.0

DESCRIPTION = """List the running Glassbox instances (one per run directory) and, for each,
its process tree: role, pid, state, current lifecycle stage and time in it, uptime, RSS and
threads. Compares the processes found with the count the manifest expects and names the
missing roles. Helper processes (e.g. multiprocessing's resource tracker) are shown apart
and not counted."""


@dataclass
class ProcessInfo:
    """One row: a planned role (alive or not), an unplanned Glassbox process, or a helper.

    Attributes:
        role: the Glassbox role (``EngineCore_DP0``); None for a helper.
        kind: ``frontend``, ``api_server``, ``engine_core``, ``worker``, ``dp_coordinator``
            or ``helper``.
        pid: None when the role has not started.
        state: psutil's status (``running``, ``sleeping``, ``zombie``, ...), ``exited`` or
            ``not started``.
        counted: whether it counts toward the expected process count.
        planned: listed in the manifest.
        note: why a planned role is not alive (``no status file: not started``).
        stage: innermost open lifecycle stage (status file), None when idle.
        time_in_stage_s: seconds in ``stage``; when idle, seconds since ``last_finished``.
        last_finished: name of the last lifecycle stage left.
        uptime_s, rss_mib, threads: from psutil; None when not alive.
        depth: nesting under the frontend among the rows shown (for indenting).
    """

    role: str | None
    kind: str
    pid: int | None
    state: str
    counted: bool
    planned: bool
    note: str | None = None
    ppid: int | None = None
    title: str | None = None
    rank: int | None = None
    stage: str | None = None
    stage_stack: list[str] = field(default_factory=list)
    time_in_stage_s: float | None = None
    last_finished: str | None = None
    uptime_s: float | None = None
    rss_mib: float | None = None
    threads: int | None = None
    depth: int = 0

    @property
    def alive(self) -> bool:
        return self.state not in ("exited", "not started", "zombie")


@dataclass
class InstanceInfo:
    """One Glassbox instance, read from its run directory.

    Attributes:
        run_dir: the run directory.
        mode: the manifest's ``inproc``, ``mp`` or ``serve``; None before it is written.
        frontend_pid: the process that owns the instance (the user's ``LLM`` or the server).
        stale: the frontend is gone; the directory was left behind (or its processes orphaned).
        created_at: Unix time the manifest was written.
        expected_process_count: from the manifest; None when it is not written yet.
        processes: planned roles in manifest order, then unplanned ``glassbox::`` processes.
        helpers: non-Glassbox processes in the tree (not counted).
        problems: what could not be read (e.g. ``manifest.json missing``).
    """

    run_dir: Path
    mode: str | None
    frontend_pid: int | None
    stale: bool
    created_at: float | None
    expected_process_count: int | None
    processes: list[ProcessInfo] = field(default_factory=list)
    helpers: list[ProcessInfo] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def found_process_count(self) -> int:
        return sum(p.counted and p.alive for p in self.processes)

    @property
    def extra(self) -> list[ProcessInfo]:
        """Live Glassbox processes of this instance that its plan does not name."""
        return [p for p in self.processes if not p.planned and p.kind != "helper" and p.alive]

    @property
    def missing(self) -> list[tuple[str, str]]:
        """``(role, reason)`` for each counted planned role that is not alive."""
        return [
            (p.role, p.note or p.state) for p in self.processes if p.planned and p.counted and not p.alive
        ]


# ------------------------------------------------------------------------ collection


def collect_instances(base: Path | None = None, include_stale: bool = False) -> list[InstanceInfo]:
    """Every instance with a run directory under ``base`` (default: ``run_dir_base()``), oldest first.

    Stale instances (frontend pid gone) are left out unless ``include_stale``.
    """
    instances = [collect_instance(d) for d in run_dirs.list_run_dirs(base)]
    return sorted(
        (i for i in instances if include_stale or not i.stale),
        key=lambda i: (i.created_at or 0.0, str(i.run_dir)),
    )


def collect_instance(run_dir: Path) -> InstanceInfo:
    """Read one run directory and match its plan against the live processes."""
    from tracing.setup import read_status_file

    run_dir = Path(run_dir)
    problems: list[str] = []
    try:
        manifest = run_dirs.read_manifest(run_dir)
    except FileNotFoundError:
        manifest = {}
        problems.append("manifest.json missing (the instance is starting, or died before writing it)")
    except (OSError, ValueError) as e:
        manifest = {}
        problems.append(f"manifest.json unreadable: {e}")
    mode = manifest.get("mode")
    created_at = manifest.get("created_at")
    roles = [dict(r) for r in manifest.get("roles", [])]
    statuses = {role: read_status_file(path) for role, path in run_dirs.status_files(run_dir).items()}

    frontend_pid = manifest.get("frontend_pid")
    if frontend_pid is None:  # older manifests: the frontend's own entry, else the dir name
        entry = next((r for r in roles if _kind(r) == "frontend" and r.get("pid")), None)
        frontend_pid = entry["pid"] if entry else run_dirs.creator_pid(run_dir)
    frontend = _live_process(frontend_pid, started_before=created_at)

    now = time.time()
    rows: list[ProcessInfo] = []
    procs: dict[int, psutil.Process] = {}
    for entry in roles:
        role, kind = entry.get("role"), _kind(entry)
        status = statuses.get(role) or {}
        if kind == "frontend":
            pid, proc = frontend_pid, frontend
        else:
            pid = status.get("pid", entry.get("pid"))
            proc = _live_process(pid, started_before=status.get("updated_at") or created_at)
        row = ProcessInfo(
            role=role, kind=kind, pid=pid, state="", counted=_counts(kind, mode), planned=True,
            rank=entry.get("rank", status.get("rank")),
        )  # fmt: skip
        _fill_status(row, status, now)
        if proc is not None:
            procs[proc.pid] = proc
            _fill_process(row, proc, now)
        else:
            _mark_absent(row)
        rows.append(row)

    # Walk the tree below every live listed process: a child titled glassbox::<role> that
    # has no status file yet is that role just starting; anything else is a helper.
    helpers: list[ProcessInfo] = []
    by_role = {r.role: r for r in rows}
    roots = ([frontend] if frontend is not None else []) + list(procs.values())
    seen = {p.pid for p in roots}
    for root in roots:
        for child in _children(root):
            if child.pid in seen:
                continue
            seen.add(child.pid)
            title = _title(child)
            role = topology.name_from_title(title)
            if role is not None:
                row = by_role.get(role)
                if row is None or row.alive:  # not planned, or a second process with one role
                    row = ProcessInfo(
                        role=role, kind=_kind({"role": role}), pid=None, state="",
                        counted=_counts(_kind({"role": role}), mode), planned=False,
                    )  # fmt: skip
                    rows.append(row)
                    by_role.setdefault(role, row)
                row.pid, row.note = child.pid, None
                _fill_status(row, statuses.get(role) or {}, now)
                _fill_process(row, child, now)
            else:
                helper = ProcessInfo(
                    role=None, kind="helper", pid=child.pid, state="", counted=False, planned=False
                )
                _fill_process(helper, child, now)
                helpers.append(helper)

    _set_depths(rows, frontend_pid)
    return InstanceInfo(
        run_dir=run_dir, mode=mode, frontend_pid=frontend_pid, stale=frontend is None,
        created_at=created_at, expected_process_count=manifest.get("expected_process_count"),
        processes=rows, helpers=helpers, problems=problems,
    )  # fmt: skip


def _kind(entry: dict[str, Any]) -> str:
    """A role's kind: the manifest's, else read off the role name (``unknown`` if it is not one)."""
    if entry.get("kind"):
        return entry["kind"]
    return topology.kind_of(entry.get("role") or "")


def _counts(kind: str, mode: str | None) -> bool:
    return kind in COUNTED_KINDS or (mode == "inproc" and kind == "frontend")


def _live_process(pid: int | None, started_before: float | None) -> psutil.Process | None:
    """The process ``pid`` if it exists and is not a newer process that reused the pid.

    ``started_before`` is a time the process itself wrote (manifest or status file): a
    process that started after it cannot be the writer.
    """
    if not pid:
        return None
    try:
        proc = psutil.Process(pid)
        if started_before is not None and proc.create_time() > started_before + _PID_REUSE_SLACK_S:
            return None
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return proc


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def _title(proc: psutil.Process) -> str | None:
    """The full process title (``glassbox::Worker_DP0_PP0_TP0``), or None when unreadable."""
    try:
        # setproctitle rewrites argv in place; psutil may hand it back split on spaces.
        return " ".join(proc.cmdline()).strip()
    except psutil.Error:
        return None


def _fill_status(row: ProcessInfo, status: dict[str, Any], now: float) -> None:
    row.stage = status.get("stage")
    row.stage_stack = list(status.get("stage_stack") or [])
    last = status.get("last_finished") or {}
    row.last_finished = last.get("name")
    since = status.get("entered_at") if row.stage else last.get("finished_at")
    row.time_in_stage_s = max(0.0, now - since) if since else None


def _fill_process(row: ProcessInfo, proc: psutil.Process, now: float) -> None:
    try:
        with proc.oneshot():
            row.state = proc.status()
            row.ppid = proc.ppid()
            row.uptime_s = max(0.0, now - proc.create_time())
            if row.state == psutil.STATUS_ZOMBIE:
                row.note = f"pid {proc.pid} is a zombie (exited, not yet reaped by its parent)"
                return
            row.title = _title(proc)
            row.rss_mib = proc.memory_info().rss / 2**20
            row.threads = proc.num_threads()
    except psutil.NoSuchProcess:
        row.state, row.note = "exited", f"pid {proc.pid} exited"
    except psutil.AccessDenied:
        row.state = row.state or "unknown"


def _mark_absent(row: ProcessInfo) -> None:
    if row.pid is None:
        row.state, row.note = "not started", "no status file: not started"
        return
    row.state = "exited"
    where = f" in stage {row.stage}" if row.stage else ""
    row.note = f"pid {row.pid} exited{where}"
    row.time_in_stage_s = None  # the clock stopped when it died


def _set_depths(rows: list[ProcessInfo], frontend_pid: int | None) -> None:
    parents = {r.pid: r.ppid for r in rows if r.pid is not None and r.alive}
    for r in rows:
        depth, pid = 0, r.pid
        while pid in parents and pid != frontend_pid and depth < 8:
            pid, depth = parents[pid], depth + 1
        r.depth = depth if pid == frontend_pid else 0


# ------------------------------------------------------------------------ rendering


def to_json(instances: list[InstanceInfo]) -> dict[str, Any]:
    """The instances as plain JSON data (what ``--json`` prints)."""
    out = []
    for inst in instances:
        data = asdict(inst)
        data["run_dir"] = str(inst.run_dir)
        data["found_process_count"] = inst.found_process_count
        data["missing"] = [{"role": role, "reason": reason} for role, reason in inst.missing]
        data["extra"] = [{"role": p.role, "pid": p.pid, "title": p.title} for p in inst.extra]
        out.append(data)
    return {"instances": out}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, s = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{s:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def _is_owner(p: ProcessInfo) -> bool:
    """The process that created the instance (the user's ``LLM``) when it is not itself one of
    the planned engine processes: shown, but not counted."""
    return p.kind == "frontend" and p.planned and not p.counted


def count_line(inst: InstanceInfo) -> str:
    """``processes: found F of expected E``, naming any row that is shown but not counted.

    For an offline ``LLM`` three rows are shown and two counted: ``processes: found 2 of
    expected 2 (not counted: LLM pid 4972, the owner — the process that created the engine)``.
    """
    line = f"processes: found {inst.found_process_count} of expected {_or_dash(inst.expected_process_count)}"
    owners = [p for p in inst.processes if _is_owner(p)]
    if owners:
        names = ", ".join(f"{p.role} pid {_or_dash(p.pid)}" for p in owners)
        line += f" (not counted: {names}, the owner — the process that created the engine)"
    return line


def render_table(instances: list[InstanceInfo], console) -> None:
    """Print each instance as a Rich table plus its found/expected line (``console``: a Rich Console)."""
    from rich.markup import escape
    from rich.table import Table

    for inst in instances:
        tag = " [red]stale: frontend gone[/red]" if inst.stale else ""
        console.print(
            f"[bold]{escape(str(inst.run_dir))}[/bold]  mode={inst.mode or '?'}  "
            f"frontend pid={_or_dash(inst.frontend_pid)}{tag}"
        )
        for problem in inst.problems:
            console.print(f"  [yellow]{escape(problem)}[/yellow]")
        table = Table(box=None, pad_edge=False, header_style="bold")
        for name in ("ROLE", "PID", "PPID", "STATE", "STAGE", "IN STAGE", "UPTIME", "RSS MiB", "THREADS"):
            table.add_column(
                name,
                no_wrap=True,
                justify="right" if name in ("PID", "PPID", "RSS MiB", "THREADS") else "left",
            )
        for p in inst.processes:
            state = p.state if p.alive else f"[red]{p.state}[/red]"
            if p.stage:
                stage = escape(p.stage)
            elif p.last_finished and p.alive:
                stage = f"[dim]idle, after {escape(p.last_finished)}[/dim]"
            else:
                stage = "-"
            role = (
                "  " * p.depth
                + escape(p.role or "?")
                + ("" if p.planned else " [yellow](unplanned)[/yellow]")
                + (" [dim](owner)[/dim]" if _is_owner(p) else "")
            )
            rss = f"{p.rss_mib:.0f}" if p.rss_mib is not None else "-"
            table.add_row(role, _or_dash(p.pid), _or_dash(p.ppid), state, stage, _duration(p.time_in_stage_s),
                          _duration(p.uptime_s), rss, _or_dash(p.threads))  # fmt: skip
        console.print(table)
        console.print(escape(count_line(inst)))
        if inst.missing:
            console.print(
                "[red]missing:[/red] " + ", ".join(f"{escape(r)} ({escape(why)})" for r, why in inst.missing)
            )
        if inst.extra:
            console.print(
                "[red]extra:[/red] "
                + ", ".join(
                    f"{escape(p.role or p.title or '?')} (pid {p.pid}, not in the plan)" for p in inst.extra
                )
            )
        if inst.helpers:
            helpers = Table(box=None, pad_edge=False, header_style="bold", title_justify="left",
                            title="helpers (not counted)")  # fmt: skip
            for name in ("PID", "PPID", "STATE", "UPTIME", "RSS MiB", "COMMAND"):
                helpers.add_column(name, no_wrap=name != "COMMAND")
            for h in inst.helpers:
                rss = f"{h.rss_mib:.0f}" if h.rss_mib is not None else "-"
                helpers.add_row(str(h.pid), _or_dash(h.ppid), h.state, _duration(h.uptime_s), rss,
                                escape(h.title or "?"))  # fmt: skip
            console.print(helpers)
        console.print()


# ------------------------------------------------------------------------ command


def add_subparser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "ps",
        help="List running Glassbox instances and their processes.",
        description=DESCRIPTION,
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--all", action="store_true", help="Also show stale run directories (frontend gone).")
    p.add_argument("--json", action="store_true", help="Print the same data as JSON.")
    p.add_argument("--run-dir", metavar="DIR", help="Show only this run directory (stale or not).")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from rich.console import Console

    if args.run_dir:
        run_dir = Path(args.run_dir)
        if not run_dir.is_dir():
            parser.error(f"--run-dir: {run_dir} is not a directory")
        instances = [collect_instance(run_dir)]
        hidden = 0
    else:
        everything = collect_instances(include_stale=True)
        instances = [i for i in everything if args.all or not i.stale]
        hidden = len(everything) - len(instances)
    if args.json:
        print(json.dumps(to_json(instances), indent=2))
        return 0
    # Piped output keeps Rich's plain text but must not be squeezed to 80 columns.
    console = Console(file=sys.stdout, highlight=False, width=None if sys.stdout.isatty() else 200)
    if not instances:
        console.print("no running glassbox instances")
    else:
        render_table(instances, console)
    if hidden:
        console.print(
            f"[dim]({hidden} stale run director{'y' if hidden == 1 else 'ies'} hidden; --all shows them)[/dim]"
        )
    return 0
