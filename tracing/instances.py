"""The instance collector: running Glassbox instances, read from their run directories.

Every instance has a run directory (``tracing/run_dir.py``). Its manifest is the *planned*
tree — roles, ranks, the expected process count — and each process's status file gives its
pid and the lifecycle stage it is in. psutil adds what the kernel knows: state, parent,
uptime, RSS, threads, and the full process title (``glassbox::<role>``, read from the
command line because the kernel's short name stops at 15 characters). Comparing plan and
kernel answers "is everything up, and if not, which role is missing and why" without any
live telemetry, even when a process hangs.

Processes under a listed pid whose title is not ``glassbox::...`` (multiprocessing's
resource tracker, say) are *helpers*: returned apart and never counted.

This is data only: ``collect_instances()`` returns ``InstanceInfo`` records and
``instance_to_dict`` turns one into plain JSON data. The views are elsewhere —
``glassbox ps`` (``engine/cli/ps.py``), and engine-top (``tui/``). Like the contract it
reads, it imports no ``engine`` module and no torch. Role names stay opaque: a process's
kind comes from the manifest; for a role the manifest does not describe (an unplanned
process, or a manifest written by an older Glassbox), the caller may pass ``kind_of`` (the
engine's ``topology.kind_of``), else the kind is ``unknown``. vLLM has no counterpart.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tracing import run_dir as run_dirs

# Kinds the process-count formula counts, for manifest entries that do not say ``counted``.
# The offline LLM's process is the user's own, so it counts as nothing — except in "inproc"
# mode, where the whole engine runs inside it.
COUNTED_KINDS = ("api_server", "engine_core", "worker", "coordinator", "dp_coordinator")
# The process that owns an instance when it is no engine process itself: an offline LLM's,
# or a headless node's launcher (glassbox serve --headless). Shown, not counted.
OWNER_KINDS = ("frontend", "headless")
# psutil states of a process stopped by a signal (SIGSTOP, Ctrl-Z) or a debugger: alive, but
# it runs nothing until SIGCONT. The one rule for "stopped": the supervisor's StoppedWatch,
# /health, glassbox ps / doctor and engine-top read it here.
STOPPED_STATES = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
# Slack for comparing a process's start time with a time it wrote (clock granularity).
_PID_REUSE_SLACK_S = 2.0

KindOf = Callable[[str], str]


@dataclass
class ProcessInfo:
    """One row: a planned role (alive or not), an unplanned Glassbox process, or a helper.

    Attributes:
        role: the Glassbox role (``EngineCore_DP0``); None for a helper.
        kind: ``frontend``, ``api_server``, ``engine_core``, ``worker``, ``dp_coordinator``,
            ``helper`` or ``unknown``.
        pid: None when the role has not started.
        state: psutil's status (``running``, ``sleeping``, ``zombie``, ...), ``exited`` or
            ``not started``.
        counted: whether it counts toward the expected process count.
        planned: listed in the manifest.
        note: why a planned role is not alive (``no status file: not started``).
        ppid: the parent's pid (psutil); None when not alive.
        title: the full process title; None when not alive or unreadable.
        rank: the manifest's rank (an engine core's DP rank, a worker's rank in its engine),
            else the status file's.
        stage: innermost open lifecycle stage (status file), None when idle.
        stage_stack: open lifecycle stages, outermost first.
        time_in_stage_s: seconds in ``stage``; when idle, seconds since ``last_finished``.
        last_finished: name of the last lifecycle stage left.
        faults: injected faults that struck it (status file), as ``"SPEC in STAGE"``.
        placement: where a cluster scheduler put it (a Ray actor: ``node_id``, ``node_ip``,
            ``actor_id``; status file), else empty.
        runs_as: how a worker runs its model once warm (status file; ``runs_as_text``).
        pause: the deliberate pause it is in (``GLASSBOX_STARTUP_STAGE_DELAY_S``, status file):
            ``{"stage", "seconds", "env"}``, else None.
        uptime_s, rss_mib, threads: from psutil (seconds, MiB, count); None when not alive.
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
    faults: list[str] = field(default_factory=list)
    placement: dict[str, str] = field(default_factory=dict)
    runs_as: dict[str, str] = field(default_factory=dict)
    pause: dict[str, Any] | None = None
    uptime_s: float | None = None
    rss_mib: float | None = None
    threads: int | None = None
    depth: int = 0

    @property
    def alive(self) -> bool:
        return self.state not in ("exited", "not started", "zombie")

    @property
    def is_owner(self) -> bool:
        """The process that created the instance (the user's ``LLM``) when it is not itself
        one of the counted engine processes: shown, but not counted."""
        return self.kind in OWNER_KINDS and self.planned and not self.counted


@dataclass
class InstanceInfo:
    """One Glassbox instance, read from its run directory.

    Attributes:
        run_dir: the run directory.
        mode: the manifest's ``inproc``, ``mp``, ``serve`` or ``headless``; None before it is written.
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


def instance_to_dict(inst: InstanceInfo) -> dict[str, Any]:
    """``inst`` as plain JSON data: its fields, plus ``found_process_count``, ``missing``
    (``role``, ``reason``) and ``extra`` (``role``, ``pid``, ``title``)."""
    data = asdict(inst)
    data["run_dir"] = str(inst.run_dir)
    data["found_process_count"] = inst.found_process_count
    data["missing"] = [{"role": role, "reason": reason} for role, reason in inst.missing]
    data["extra"] = [{"role": p.role, "pid": p.pid, "title": p.title} for p in inst.extra]
    return data


# ------------------------------------------------------------------------ collection


def collect_instances(
    base: Path | None = None, include_stale: bool = False, kind_of: KindOf | None = None
) -> list[InstanceInfo]:
    """Every instance with a run directory under ``base`` (default: ``run_dir_base()``), oldest first.

    Stale instances (frontend pid gone) are left out unless ``include_stale``. ``kind_of``:
    see ``collect_instance``.
    """
    instances = [collect_instance(d, kind_of=kind_of) for d in run_dirs.list_run_dirs(base)]
    return sorted(
        (i for i in instances if include_stale or not i.stale),
        key=lambda i: (i.created_at or 0.0, str(i.run_dir)),
    )


def collect_instance(run_dir: Path, kind_of: KindOf | None = None) -> InstanceInfo:
    """Read one run directory and match its plan against the live processes.

    ``kind_of(role_name) -> kind``: the kind of a role the manifest gives no kind for
    (default: ``unknown``). Never raises for a missing or bad manifest or status file: those
    are listed in ``problems`` or shown as roles not started.
    """
    run_dir = Path(run_dir)
    problems: list[str] = []
    try:
        manifest = run_dirs.load_manifest(run_dir)
    except FileNotFoundError:
        manifest = run_dirs.Manifest()
        problems.append("manifest.json missing (the instance is starting, or died before writing it)")
    except run_dirs.RecordError as e:
        manifest = run_dirs.Manifest()
        problems.append(f"manifest.json unreadable: {e.reason}")
    except OSError as e:
        manifest = run_dirs.Manifest()
        problems.append(f"manifest.json unreadable: {e}")
    mode, created_at = manifest.mode, manifest.created_at
    statuses = {role: run_dirs.read_status(path) for role, path in run_dirs.status_paths(run_dir).items()}

    def kind(entry: run_dirs.PlannedProcess) -> str:
        if entry.kind:
            return entry.kind
        return kind_of(entry.role) if kind_of is not None else "unknown"

    frontend_pid = manifest.frontend_pid
    if frontend_pid is None:  # older manifests: the frontend's own entry, else the dir name
        entry = next((r for r in manifest.roles if kind(r) in OWNER_KINDS and r.pid), None)
        frontend_pid = entry.pid if entry else run_dirs.creator_pid(run_dir)
    frontend = _live_process(frontend_pid, started_before=created_at)

    now = time.time()
    rows: list[ProcessInfo] = []
    procs: dict[int, psutil.Process] = {}
    for entry in manifest.roles:
        role_kind = kind(entry)
        status = statuses.get(entry.role)
        if role_kind in OWNER_KINDS:
            pid, proc = frontend_pid, frontend
        else:
            pid = status.pid if status is not None and status.pid is not None else entry.pid
            written_at = status.updated_at if status is not None else None
            proc = _live_process(pid, started_before=written_at or created_at)
        counted = entry.counted if entry.counted is not None else _counts(role_kind, mode)
        rank = entry.rank if entry.rank is not None else (status.rank if status is not None else None)
        row = ProcessInfo(
            role=entry.role, kind=role_kind, pid=pid, state="", counted=counted, planned=True, rank=rank
        )
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
            role = run_dirs.role_from_title(_title(child))
            if role is not None:
                row = by_role.get(role)
                if row is None or row.alive:  # not planned, or a second process with one role
                    role_kind = kind(run_dirs.PlannedProcess(role=role))
                    row = ProcessInfo(
                        role=role, kind=role_kind, pid=None, state="",
                        counted=_counts(role_kind, mode), planned=False,
                    )  # fmt: skip
                    rows.append(row)
                    by_role.setdefault(role, row)
                row.pid, row.note = child.pid, None
                _fill_status(row, statuses.get(role), now)
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
        created_at=created_at, expected_process_count=manifest.expected_process_count,
        processes=rows, helpers=helpers, problems=problems,
    )  # fmt: skip


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


def runs_as_text(runs_as: dict[str, str]) -> str:
    """A worker's ``ProcessStatus.runs_as`` in one line: ``cpu bfloat16, compiled (inductor,
    1 graph), attention CPU_PAGED_CPP, 2 of 2 CPU threads, bfloat16 linears native
    (measured), step threads 2 (cached), compiled or eager: compiled (measured)``; "" when it
    recorded none.
    ``graphs_after_warm_up`` (a count for scripts) is already in ``compile``'s text."""
    return ", ".join(runs_as_parts(runs_as))


def runs_as_parts(runs_as: dict[str, str]) -> list[str]:
    """``runs_as_text``'s phrases, one per entry (``["cpu bfloat16", "attention
    CPU_PAGED_CPP", ...]``): what a narrow view wraps between, never inside."""
    worded = {"device", "dtype", "graphs_after_warm_up", *(key for key, _ in _RUNS_AS_WORDS)}
    parts = []
    head = " ".join(runs_as[k] for k in ("device", "dtype") if runs_as.get(k))
    if head:
        parts.append(head)
    parts += [template.format(runs_as[key]) for key, template in _RUNS_AS_WORDS if runs_as.get(key)]
    parts = ["1 CPU thread" if part == "1 CPU threads" else part for part in parts]
    parts += [f"{k} {v}" for k, v in sorted(runs_as.items()) if k not in worded]
    return parts


# How runs_as_text words each of a worker's ``runs_as`` entries after its device and dtype, in order.
_RUNS_AS_WORDS = (
    ("compile", "{}"),
    ("attention", "attention {}"),
    ("cpu_threads", "{} CPU threads"),
    ("kv_cache_pages", "KV cache on {}"),
    ("bf16_linear", "bfloat16 linears {}"),
    ("f32_linear", "float32 linears {}"),
    ("linear_kernel", "own linear kernel {}"),
    ("brgemm_linear", "brgemm linears {}"),
    ("bf16_attention", "bfloat16 prefill attention {}"),
    ("step_threads", "step threads {}"),
    ("compiled_step", "compiled or eager: {}"),
    ("fused_loop_threads", "fused loops on {}"),
    ("attention_task_shape", "decode attention tasks: {}"),
)


def placement_text(placement: dict[str, str]) -> str:
    """``"Ray actor 1a2b3c4d on node 10.0.0.5 (5f3e9a0c)"`` for a process a Ray cluster placed
    (``ProcessStatus.placement``); "" for one its parent spawned."""
    if not placement.get("actor_id"):
        return ""
    node = placement.get("node_ip") or "?"
    node_id = placement.get("node_id", "")[:8]
    return f"Ray actor {placement['actor_id'][:8]} on node {node}" + (f" ({node_id})" if node_id else "")


def _fill_status(row: ProcessInfo, status: run_dirs.ProcessStatus | None, now: float) -> None:
    if status is None:
        status = run_dirs.ProcessStatus()
    row.stage = status.stage
    row.stage_stack = list(status.stage_stack)
    last = status.last_finished
    row.last_finished = last.name if last is not None else None
    row.faults = [f"{f.spec} in {f.stage}" for f in status.faults]
    row.placement = dict(status.placement)
    row.runs_as = dict(status.runs_as)
    if status.pause is not None:
        row.pause = {"stage": status.pause.stage, "seconds": status.pause.seconds, "env": status.pause.env}
    since = status.entered_at if row.stage else (last.finished_at if last is not None else None)
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
    # A zombie still has its parent (the one that has not reaped it): it stays in the tree.
    parents = {
        r.pid: r.ppid for r in rows if r.pid is not None and r.ppid is not None and r.state != "exited"
    }
    for r in rows:
        depth, pid = 0, r.pid
        while pid in parents and pid != frontend_pid and depth < 8:
            pid, depth = parents[pid], depth + 1
        r.depth = depth if pid == frontend_pid else 0


__all__ = [
    "STOPPED_STATES",
    "COUNTED_KINDS",
    "OWNER_KINDS",
    "InstanceInfo",
    "ProcessInfo",
    "collect_instance",
    "collect_instances",
    "instance_to_dict",
]
