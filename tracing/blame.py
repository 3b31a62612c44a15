"""The blame rule: which process of a tree is at fault, and in which stage. One rule, used
by the root-cause block (``engine/utils/processes.py``), ``glassbox doctor`` and engine-top's
alert (``tracing.telemetry.collector``), so the three never disagree.

The rule, in order (the first that names someone wins):

1. **the rank a collective waits for**: a worker inside collective #k of its TP (or PP, or
   EP) group for over ``WAITING_S`` (or that died inside it) is a victim, whatever it did next
   (a gloo timeout, its engine core's deadline); the culprit is a peer of that group that has
   not reached #k of the same step (followed to the end of the chain) — "TP0 waits in
   all_reduce #3 for TP1, which is still in worker.execute_model" (``CommPosition``) — with
   its own trouble (failed, dead, stopped, frozen, held) when it has one. The EP group (expert
   parallelism) spans every DP engine's workers: a late peer of another engine that sits
   between steps was never sent the step, so the culprit is its engine core ("DP0_TP0 waits
   in all_to_all #1 for DP1_TP0, which is still at step 40: EngineCore_DP1 never sent it step
   41").
2. **the first failure**: of the processes that failed — a crash report of their own (not an
   echo: ``CrashReport.caused_by`` names whom it follows), or dead without one (killed from
   outside, ``exit:<code>``) — the one whose failure came first: its crash report's time,
   else its status file's last write (its heartbeat, ~1 s before it died). A clean exit
   (status 0, a parent's SIGTERM) is no failure.
3. **stopped** by a signal, then **frozen** (running, no heartbeat), as their watcher says.
4. **held by an injected fault** in the stage it is in now.

Nothing else is blamed here: a tree that is merely slow is the callers' business (doctor's
"stuck in a stage", the start-up laggard).

Imports no ``engine`` (engine-top uses it against a run directory alone). vLLM has no
counterpart: its root cause is whatever the first process to notice printed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from tracing import run_dir as contract

WAITING_S = 1.0  # inside one collective this long: waiting for a peer, not just passing through
STEP_RPCS = ("execute_model", "execute_dummy_batch")
_DEPTH = {"worker": 3, "engine_core": 2, "dp_coordinator": 1, "api_server": 1, "frontend": 0}


@dataclass
class Seen:
    """One process as the rule sees it: the run directory's records plus what its watcher
    knows (``returncode`` only a parent knows; ``stopped``/``frozen`` a supervisor's words)."""

    role: str
    kind: str | None = None
    pid: int | None = None
    rank: int | None = None
    dp_rank: int | None = None
    pp_rank: int | None = None
    tp_rank: int | None = None
    alive: bool = True
    started: bool = True
    returncode: int | None = None
    stopped: str | None = None  # e.g. "stopped by a signal (SIGSTOP?) for 12 s"
    frozen: str | None = None
    status: contract.ProcessStatus | None = None
    status_written_at: float | None = None
    crash: contract.CrashReport | None = None
    comm: contract.CommPosition | None = None

    @property
    def stage(self) -> str | None:
        """The stage it failed in, or is in now: its crash report's, its open lifecycle stage,
        else the step RPC it runs (``worker.execute_model``)."""
        if self.crash is not None and self.crash.stage:
            return self.crash.stage
        if self.status is not None and self.status.stage:
            return self.status.stage
        if self.comm is not None and self.comm.rpc:
            return f"worker.{self.comm.rpc}"
        return None

    def short(self, group: str) -> str:
        """A worker's name within its ``group``: ``TP1`` in a TP group (``PP1_TP1`` past the
        first stage), ``PP1`` in a PP group (``PP1_TP1`` with TP), ``DP1_TP0`` in the EP group
        (every engine's workers); else the role."""
        if self.kind != "worker" or self.tp_rank is None or self.pp_rank is None:
            return self.role
        if group == "ep":
            return f"DP{self.dp_rank}_TP{self.tp_rank}"
        if group == "tp":
            return f"TP{self.tp_rank}" if self.pp_rank == 0 else f"PP{self.pp_rank}_TP{self.tp_rank}"
        return f"PP{self.pp_rank}" if self.tp_rank == 0 else f"PP{self.pp_rank}_TP{self.tp_rank}"


@dataclass
class Blame:
    """The culprit: ``verdict`` is ``failed`` (its own exception), ``dead`` (no report),
    ``stopped``, ``frozen``, ``waited_on`` (a peer waits in a collective for it), ``held``
    (an injected fault holds it) or, read back from a root-cause block only (``recorded_blame``),
    ``late`` (still at work in a stage when a deadline ended the tree: its note says which).
    ``reason``: one line saying so; ``victims``: who waits on it."""

    role: str
    verdict: str
    stage: str | None
    reason: str
    pid: int | None = None
    exception: str | None = None
    victims: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- observing


def observe(run_dir: str | os.PathLike[str], known: dict[str, Seen] | None = None) -> list[Seen]:
    """Every planned process of ``run_dir`` (the manifest; the status files when there is
    none), read from its records. ``known``: what the caller knows better, by role (a
    parent's ``returncode``, a supervisor's ``stopped``/``frozen``); its fields win."""
    run_dir = Path(run_dir)
    manifest = contract.read_manifest(run_dir)
    planned = list(manifest.roles) if manifest is not None else []
    names = [p.role for p in planned]
    names += [r for r in contract.status_paths(run_dir) if r not in names]
    by_plan = {p.role: p for p in planned}
    seen = []
    for role in names:
        plan = by_plan.get(role)
        path = contract.status_path(run_dir, role)
        status = contract.read_status(path)
        try:
            written = os.stat(path).st_mtime
        except OSError:
            written = None
        s = Seen(role=role, status=status, status_written_at=written,
                 crash=contract.read_crash_report(run_dir, role), comm=contract.read_comm(run_dir, role))  # fmt: skip
        if plan is not None:
            s.kind, s.rank, s.dp_rank, s.pp_rank, s.tp_rank = (
                plan.kind,
                plan.rank,
                plan.dp_rank,
                plan.pp_rank,
                plan.tp_rank,
            )
        s.pid = (status.pid if status is not None else None) or (plan.pid if plan is not None else None)
        if s.rank is None and status is not None:
            s.rank = status.rank
        s.started = status is not None or s.crash is not None
        s.alive = s.started and contract.pid_alive(s.pid)
        if s.crash is not None and s.pid is None:
            s.pid = s.crash.pid
        better = (known or {}).get(role)
        if better is not None:
            for name in ("returncode", "stopped", "frozen", "pid"):
                if getattr(better, name) is not None:
                    setattr(s, name, getattr(better, name))
            if better.returncode is not None:
                s.alive = False
            if better.kind is not None:
                s.kind = better.kind
        seen.append(s)
    return seen


# --------------------------------------------------------------------------- the rule


def _failed_at(s: Seen) -> float | None:
    """When ``s`` failed (Unix s), or None when it did not (alive and no report of its own)."""
    if s.crash is not None and s.crash.caused_by is None and s.crash.exception:
        return s.crash.time if s.crash.time is not None else 0.0
    if s.crash is not None and s.crash.caused_by is not None:
        return None  # an echo: it names whom it follows
    if s.started and not s.alive and s.returncode != 0:
        return s.status_written_at if s.status_written_at is not None else 0.0
    return None


def _own_verdict(s: Seen) -> tuple[str, str] | None:
    """``s``'s own trouble, as (verdict, words), or None when it has none of its own."""
    if s.crash is not None and s.crash.caused_by is None and s.crash.exception:
        return "failed", f"failed: {s.crash.exception}"
    if s.started and not s.alive and s.returncode != 0 and s.crash is None:
        return "dead", "died without a crash report"
    if s.alive and s.stopped:
        return "stopped", s.stopped
    if s.alive and s.frozen:
        return "frozen", s.frozen
    stage = s.stage
    if s.alive and stage and s.status is not None and any(f.stage == stage for f in s.status.faults):
        return "held", f"held by an injected fault in {stage}"
    return None


def find_culprit(seen: list[Seen], now: float) -> Blame | None:
    """The process at fault in ``seen`` as of ``now`` (Unix s), or None (see the module).

    The collective rule comes first: a rank that waits in (or died waiting in) collective #k
    for a peer that never reached it is a victim, whatever it then did (a gloo timeout, its
    engine core's deadline); the peer is named, with its own trouble when it has one.
    """
    waited = _waited_on(seen, now)
    if waited is not None:
        culprit = next(s for s in seen if s.role == waited.role)
        own = _own_verdict(culprit)
        if own is not None:
            waited.verdict = own[0]
            it = {"held": "", "stopped": "it is ", "frozen": "it is "}.get(own[0], "it ")
            waited.reason += f"; {it}{own[1]}"
            if culprit.crash is not None and culprit.crash.caused_by is None:
                waited.exception = culprit.crash.exception
        return waited
    # A report, or an exit status its parent read, first, earliest first; a process merely
    # gone (its status unknown here: perhaps stopped with the tree) only when nothing else
    # failed, and then the deepest (a worker's death takes its parents with it; the order
    # their status files were last written in says nothing about who went first).
    failed = []
    for i, s in enumerate(seen):
        if (t := _failed_at(s)) is None:
            continue
        depth = -_DEPTH.get(s.kind or "", 0)
        known = s.crash is not None or s.returncode is not None
        failed.append(((0, t, depth, i) if known else (1, depth, t, i), s))
    if failed:
        s = min(failed, key=lambda x: x[0])[1]
        if s.crash is not None and s.crash.exception:
            return Blame(s.role, "failed", s.stage, f"{s.role} failed first: {s.crash.exception}", s.pid,
                         s.crash.exception)  # fmt: skip
        return Blame(s.role, "dead", s.stage, f"{s.role} died first, without a crash report", s.pid)
    for s in seen:  # only echoes: follow the first to whom it names
        target = next((t for t in seen if s.crash is not None and t.role == s.crash.caused_by), None)
        if target is not None and target is not s:
            return Blame(target.role, "dead", target.stage, f"{s.role} stopped because {target.role} failed",
                         target.pid)  # fmt: skip
    deepest = sorted(seen, key=lambda s: -_DEPTH.get(s.kind or "", 0))
    for verdict in ("stopped", "frozen", "held"):
        for s in deepest:
            own = _own_verdict(s)
            if own is not None and own[0] == verdict:
                return Blame(s.role, verdict, s.stage, f"{s.role} is {own[1]}", s.pid)
    return None


def _peers(seen: list[Seen], s: Seen, group: str) -> list[Seen]:
    """The other workers of ``s``'s ``group`` (``tp``: same engine and stage; ``pp``: same
    engine and TP rank; ``ep``: every engine's workers of the same stage)."""
    same = "tp_rank" if group == "pp" else "pp_rank"
    return [
        p
        for p in seen
        if p is not s
        and p.kind == "worker"
        and (group == "ep" or p.dp_rank == s.dp_rank)
        and getattr(p, same) == getattr(s, same)
        and p.comm is not None
    ]


def _engine_that_never_sent(seen: list[Seen], worker: Seen, waiter: Seen) -> Seen | None:
    """Expert parallelism: ``worker`` (of another engine than ``waiter``) is alive between steps
    — its engine core never sent it the step ``waiter`` is in (a busy loop stuck, or an idle
    engine's dummy batches stopped): that engine core, or None."""
    if worker.dp_rank == waiter.dp_rank or not worker.alive or worker.comm is None or worker.comm.rpc:
        return None
    return next((p for p in seen if p.kind == "engine_core" and p.dp_rank == worker.dp_rank), None)


def _behind(peer: Seen, step: int, group: str, seq: int) -> bool:
    """Whether ``peer`` has not reached collective ``seq`` of ``group`` in step ``step``."""
    assert peer.comm is not None
    if peer.comm.step < step:
        return True
    pos = peer.comm.group(group)
    return peer.comm.step == step and pos is not None and pos.seq < seq


def _waiting(s: Seen, now: float) -> tuple[str, contract.CollectivePosition] | None:
    """The group and collective ``s`` waits in (over ``WAITING_S``), or died in."""
    if s.comm is None or s.comm.rpc not in STEP_RPCS:
        return None  # only a step's collectives are the same on every rank (not a warm-up's)
    for pos in s.comm.groups:
        if pos.inside and pos.entered_at is not None and (not s.alive or now - pos.entered_at >= WAITING_S):
            return pos.group, pos
    return None


def _waited_on(seen: list[Seen], now: float) -> Blame | None:
    """Rule 1: a worker waiting in collective #k whose peer never reached #k."""
    for s in seen:
        waiting = _waiting(s, now)
        if waiting is None:
            continue
        group, pos = waiting
        assert s.comm is not None
        late = [p for p in _peers(seen, s, group) if _behind(p, s.comm.step, group, pos.seq)]
        if not late:
            continue
        culprit, chain = late[0], [s.role]
        for _ in range(len(seen)):  # the late peer may itself wait on another
            inner = _waiting(culprit, now)
            if inner is None or culprit.comm is None:
                break
            nxt = [
                p
                for p in _peers(seen, culprit, inner[0])
                if _behind(p, culprit.comm.step, inner[0], inner[1].seq)
            ]
            if not nxt or nxt[0].role in chain:
                break
            chain.append(culprit.role)
            culprit = nxt[0]
        stage = culprit.stage
        where = f"still in {stage}" if stage else "between steps"
        if culprit.comm is not None and culprit.comm.step < s.comm.step:
            where = f"still at step {culprit.comm.step}" + (f", in {stage}" if stage else "")
        verb = "waits" if s.alive else "died waiting"
        reason = (f"{s.short(group)} {verb} in {pos.kind} #{pos.seq} for {culprit.short(group)}, which is {where}"
                  f" ({now - (pos.entered_at or now):.0f} s)")  # fmt: skip
        engine = _engine_that_never_sent(seen, culprit, s) if group == "ep" else None
        if engine is not None:  # the worker only waits for its own engine core's next step
            chain.append(culprit.role)
            reason += f": {engine.role} never sent it step {s.comm.step}"
            return Blame(engine.role, "waited_on", engine.stage, reason, engine.pid, victims=chain)
        return Blame(culprit.role, "waited_on", stage, reason, culprit.pid, victims=chain)
    return None


def blame_run_dir(
    run_dir: str | os.PathLike[str], now: float, known: dict[str, Seen] | None = None
) -> Blame | None:
    """``find_culprit(observe(run_dir, known), now)``."""
    return find_culprit(observe(run_dir, known), now)


__all__ = ["WAITING_S", "Blame", "Seen", "blame_run_dir", "find_culprit", "observe"]


# ---------------------------------------------------------------- the root cause, read back

# The root-cause block's lines (``engine.utils.processes.format_root_cause``) read back by
# ``glassbox doctor --last`` and engine-top once an instance is gone.
_ROOT_CAUSE_KEYS = ("process", "pid", "stage", "exit", "exception", "why", "fault", "note")
STILL_RUNNING = "still running"


def root_cause_fields(text: str) -> dict[str, list[str]]:
    """``key → values`` of a root-cause block's ``key: value`` lines (first one first)."""
    fields: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key in _ROOT_CAUSE_KEYS and value.startswith(" "):
            fields.setdefault(key, []).append(value.strip())
    return fields


def recorded_blame(root_cause: str, now: float) -> Blame | None:
    """The verdict a root-cause block recorded when it was written, judged again by the one
    blame rule (``tracing.find_culprit``) from what the block says of its process: alive
    and stopped or frozen then, its exit status, its exception, its stage (``worker.execute_model
    (step 322)``: the step RPC it was in), the injected faults that struck it, and the peers
    waiting on it (``why:``). None when the block names no process or the rule no verdict.

    A tree that is gone cannot be judged from its files alone: the teardown killed whatever
    was stopped or frozen (it then reads as dead, without a crash report), and what only a
    watcher knew (stopped, frozen, an exit status) is written nowhere else."""
    fields = root_cause_fields(root_cause)
    words = (fields.get("process") or [""])[0].split()
    if not words:
        return None
    role = words[0]
    pid_text = (fields.get("pid") or ["?"])[0]
    pid = int(pid_text) if pid_text.isdigit() else None
    stage_text = (fields.get("stage") or ["unknown"])[0]
    m = re.fullmatch(r"(\S+)(?: \(step \d+\))?", stage_text)  # a stage, or the step RPC it ran
    stage = m.group(1) if m and stage_text != "unknown" else None
    exit_text = (fields.get("exit") or [""])[0]
    alive = exit_text.startswith(STILL_RUNNING)
    trouble = exit_text[len(STILL_RUNNING) :].strip().removeprefix("(").removesuffix(")") if alive else ""
    code = re.search(r"exit status (-?\d+)\)$|exited with code (-?\d+)$", exit_text)
    returncode = int(code.group(1) or code.group(2)) if code and not alive else None
    exception = (fields.get("exception") or ["none"])[0]
    exception = None if exception.startswith("none") else exception
    faults = [contract.StruckFault(spec=f.group(1), stage=f.group(2), kind="", struck_at=0.0)
              for line in fields.get("fault", []) if (f := re.match(r"injected (\S+) struck in (\S+)", line))]  # fmt: skip
    seen = Seen(
        role, pid=pid, alive=alive, returncode=returncode,
        stopped=trouble if trouble.startswith("stopped") else None,
        frozen=trouble if trouble.startswith("frozen") else None,
        status=contract.ProcessStatus(role=role, pid=pid, stage=stage, faults=faults),
        crash=contract.CrashReport(role=role, pid=pid, stage=stage, exception=exception) if exception else None,
    )  # fmt: skip
    found = find_culprit([seen], now)
    why = fields.get("why")
    if why:  # peers waited on it in a collective: the rule's first clause, its words recorded
        verdict = found.verdict if found is not None else "waited_on"
        return Blame(role, verdict, stage, why[0], pid, exception)
    note = fields.get("note")
    if found is None and alive and stage and note:
        # Alive, in a stage, no trouble of its own: the deadline the note names (start-up's,
        # GLASSBOX_ENGINE_READY_TIMEOUT_S) ran out while it worked; the teardown killed it since.
        return Blame(role, "late", stage, note[0].rstrip("."), pid)
    return found
