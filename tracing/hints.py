"""The hint catalogue: for every stage, what being stuck there usually means and what to check.

One table, read by everything that names a stuck stage — engine-top's alerts (through the
telemetry collector's ``stage_hint``), ``glassbox doctor``'s diagnosis and the start-up
deadline message (``engine.utils.supervisor.describe_laggard``) — so the three say the
same words. ``docs/troubleshooting-hangs.md`` carries the same table, generated from this one::

    python -m tracing.hints        # the Markdown table (a test checks the doc matches)

Each entry gives ``slow_after_s`` (past it a stage is "far longer than usual": engine-top's
alert floor), ``hint`` (one line: what it usually means, then what to check) and ``typical``
(how long the stage usually takes, in words). Every lifecycle span of the catalogue
(``tracing/catalogue.py``) must have an entry (a test checks it); step spans have entries
where a stuck step has a known meaning, and any other name falls back to its catalogue doc.

Besides stages, a few situations have a fixed hint too (``NOT_STARTED``, ``STOPPED``,
``FROZEN``, ``DEAD``, ``NO_CRASH_REPORT``) — a process that never wrote a status file, one
stopped by a signal, one whose heartbeat stopped, one that died and wrote why, one that died
without a word (killed from outside); ``dead_hint`` picks between the last two.

Imports no ``engine`` module and no torch (engine-top and doctor work without the engine).
vLLM has no counterpart: its start-up only says "Waiting for 1 local, 0 remote core engine
proc(s) to start".
"""

from __future__ import annotations

from dataclasses import dataclass

from tracing import catalogue


@dataclass(frozen=True)
class StageHint:
    """What a stage usually costs and what a long one usually means.

    Attributes:
        slow_after_s: past this (s) a stage is "far longer than usual" (engine-top's floor;
            once a stage has been seen leaving 3 times, 5 × its mean counts too).
        hint: what being stuck there usually means, then what to check (one line).
        typical: how long it usually takes, in words.
    """

    slow_after_s: float
    hint: str
    typical: str = ""


_SEE_DEEPER = "run `glassbox doctor` (or `glassbox ps`) to see which process is still in a stage"

HINTS: dict[str, StageHint] = {
    # --- lifecycle: the first process --------------------------------------------------
    catalogue.CLI_VALIDATE_CONFIG: StageHint(
        10,
        "building the EngineConfig: reading the model's config.json and tokenizer files; check the "
        "model path and the filesystem it is on (slow or network disk?)",
        "under 1 s",
    ),
    catalogue.LLM_INIT: StageHint(
        180,
        f"the whole offline start-up; it waits on its children: {_SEE_DEEPER}",
        "seconds (tiny model, CPU) to minutes (large model)",
    ),
    catalogue.PROCESS_SPAWN: StageHint(
        30,
        "a fresh interpreter importing the engine; torch's import is slow on a cold disk; check the "
        "child's log lines and that the virtualenv imports (python -c 'import torch')",
        "1-5 s",
    ),
    catalogue.ENGINE_CORE_HANDSHAKE: StageHint(
        180,
        f"waiting for HELLO then READY from the engine core, which waits for its workers: {_SEE_DEEPER}",
        "the engine core's whole start-up",
    ),
    catalogue.API_SERVER_START_OTHERS: StageHint(
        120,
        "waiting until APIServer_1.. serve: one is still starting or died; see its stage and the log "
        "(a port or socket it cannot use?)",
        "1-5 s per server",
    ),
    catalogue.API_SERVER_ATTACH: StageHint(
        120,
        "waiting for CONNECTED from the engine cores APIServer_0 started: are they still starting? "
        "see their stages",
        "under 1 s once the engines are ready",
    ),
    # --- lifecycle: the engine core ---------------------------------------------------
    catalogue.ENGINE_CORE_INIT_DP_GROUP: StageHint(
        30,
        "expert parallelism across DP engines: the engine cores meet in their own gloo group "
        "(GLASSBOX_DIST_INIT_TIMEOUT_S); an engine core still loading its model, or one that died, "
        "holds the others here: see which engine core is not in this stage",
        "under 1 s once every engine core is ready",
    ),
    catalogue.ENGINE_CORE_JOIN_HEAD: StageHint(
        60,
        "a headless node's engine core waits for the head's answer on --data-parallel-address:"
        "--data-parallel-rpc-port: is the head running (it may start later), is the port open, "
        "does its -dp match?",
        "under 1 s once the head runs",
    ),
    catalogue.ENGINE_CORE_INIT: StageHint(
        180,
        "building executor, KV cache and scheduler; it waits on the workers: see which worker is "
        "still in a stage",
        "the workers' start-up, plus under 1 s",
    ),
    catalogue.EXECUTOR_INIT: StageHint(
        180,
        "starting the workers and waiting for each to load the model: see which worker is behind "
        "(a worker that never starts: its imports or the worker class)",
        "the slowest worker's init_device + load_model",
    ),
    catalogue.ENGINE_CORE_INITIALIZE_KV_CACHE: StageHint(
        60,
        "sizing the KV cache and telling every worker: a worker that does not answer blocks here; "
        "see the workers' stages",
        "under 1 s",
    ),
    catalogue.ENGINE_CORE_SHUTDOWN: StageHint(
        30,
        "stopping the busy loop and the workers: a worker that does not exit blocks here (stopped? "
        "in a native call?)",
        "under 1 s",
    ),
    catalogue.DP_COORDINATOR_INIT: StageHint(
        5,
        "binding three ipc sockets in the run directory: a hang here points at the run directory "
        "(a full or read-only disk); check the coordinator's log",
        "milliseconds",
    ),
    catalogue.DP_COORDINATOR_SHUTDOWN: StageHint(
        5,
        "closing its sockets (linger 0): nothing waits here",
        "milliseconds",
    ),
    # --- lifecycle: each worker ---------------------------------------------------------
    catalogue.WORKER_WRAPPER_INIT: StageHint(
        5,
        "nothing heavy happens here: a hang before init_worker points at an import (torch, a "
        "plugin) or the worker class; check the worker's log and its stack",
        "milliseconds",
    ),
    catalogue.WORKER_INIT_WORKER: StageHint(
        30,
        "importing and building the worker class: an import that hangs or a bad worker class; "
        "check the stack for the import line",
        "1-5 s (torch's import)",
    ),
    catalogue.WORKER_INIT_DEVICE: StageHint(
        60,
        "picking the device and joining the distributed group (the rendezvous): a peer rank that "
        "never arrives, a port in use or blocked, a rank or world-size mismatch; check that every "
        "rank is in this stage",
        "under 2 s",
    ),
    catalogue.WORKER_LOAD_MODEL: StageHint(
        120,
        "reading the weights: a slow or network disk, or a checkpoint far larger than memory "
        "(swapping); check the checkpoint's size and the disk's read rate",
        "seconds (tiny model) to minutes (tens of GB)",
    ),
    catalogue.WORKER_DETERMINE_AVAILABLE_MEMORY: StageHint(
        60,
        "the profile run at the largest batch (max_num_batched_tokens x max_num_seqs): slow on CPU "
        "when that batch is large; lower --max-num-batched-tokens to check",
        "under 5 s",
    ),
    catalogue.WORKER_INITIALIZE_KV_CACHE: StageHint(
        60,
        "allocating the KV-cache tensors: a very large num_blocks or memory pressure (swap); check "
        "--gpu-memory-utilization, --kv-cache-memory-bytes (GLASSBOX_CPU_KVCACHE_SPACE on CPU) and free memory",
        "under 1 s",
    ),
    catalogue.WORKER_COMPILE_OR_WARM_UP_MODEL: StageHint(
        120,
        "warm-up runs; a cold compile (torch.compile, CUDA graphs) takes longest the first time; "
        "check the stack for the compiler",
        "under 5 s without compiling",
    ),
    # --- step stages ----------------------------------------------------------------------
    catalogue.ENGINE_CORE_STEP: StageHint(
        10,
        "one engine step: a forward pass that does not return (a worker hung, stopped or dead?); "
        "see the workers' stages",
        "milliseconds",
    ),
    catalogue.SCHEDULER_SCHEDULE: StageHint(
        5,
        "the scheduler is pure Python: a very long queue or a bug; its stack shows the loop",
        "microseconds",
    ),
    catalogue.EXECUTOR_EXECUTE_MODEL: StageHint(
        10,
        "waiting for the workers' forward pass: see the workers' stages and the broadcast queue lag",
        "milliseconds",
    ),
    catalogue.SCHEDULER_UPDATE_FROM_OUTPUT: StageHint(
        5, "appending tokens and freeing requests: pure Python", "microseconds"
    ),
    catalogue.WORKER_EXECUTE_MODEL: StageHint(
        10, "one forward pass and sampling on a worker: a hung kernel or collective", "milliseconds"
    ),
    catalogue.MOE_DISPATCH: StageHint(
        5,
        "expert parallelism: the all-to-all needs every worker of every DP engine; one has not "
        "reached it (a rank still in an earlier layer or step, or an engine whose dummy batches "
        "stopped): glassbox doctor names it",
        "milliseconds",
    ),
    catalogue.MOE_COMBINE: StageHint(
        5,
        "expert parallelism: the all-to-all back needs every worker of every DP engine; one has not "
        "reached it: glassbox doctor names it",
        "milliseconds",
    ),
}

# Situations that are not a stage.
NOT_STARTED = (
    "the process never wrote a status file: it is still spawning (importing), or its spawn "
    "failed; check the log for its first lines"
)
STOPPED = (
    "the process is stopped (SIGSTOP, Ctrl-Z or a debugger): it cannot run or dump its stack; "
    "`kill -CONT <pid>` resumes it"
)
FROZEN = (
    "its heartbeat stopped: a native call holding the GIL, a deadlock, or the machine swapping; "
    "its stack (or `py-spy dump --pid <pid>`) shows where"
)
DEAD = "its crash report (<role>.crash.json) says why; the rest of the tree stops with it"
# A dead process that wrote no crash report (SIGKILL, the OOM killer: nothing runs to write it).
NO_CRASH_REPORT = (
    "it wrote no crash report: it was killed from outside (SIGKILL, the OOM killer: see dmesg) or "
    "died before it could; the exit status in the log says how; the rest of the tree stops with it"
)
# A culprit that was stopped or frozen when a tree that is gone ended: its parent's deadline
# tore the tree down (the teardown killed it: no crash report, no stack). Doctor's and engine-top's.
GONE_STOPPED = (
    "it was stopped by a signal (SIGSTOP, Ctrl-Z or a debugger) when its tree was torn down (a child "
    "stopped past GLASSBOX_STOPPED_TIMEOUT_S stops the tree): find what stopped it, or start with "
    "GLASSBOX_STOPPED_TIMEOUT_S=300 to look at it longer"
)
GONE_FROZEN = (
    "its heartbeat had stopped when its tree was torn down (a native call holding the GIL, a deadlock, "
    "or the machine swapping; a child frozen past GLASSBOX_HEARTBEAT_TIMEOUT_S stops the tree): run it "
    "again and read its stack (glassbox doctor, py-spy dump) before that deadline"
)


def dead_hint(crash_file: str | None, caused_by: str | None = None) -> str:
    """What to read about a dead process: its crash report (``crash_file``, the real path,
    when it wrote one: ``DEAD`` naming it), an echo's (``caused_by``: it stopped because that
    process failed), else ``NO_CRASH_REPORT`` — doctor's words for the same three cases."""
    if crash_file and caused_by:
        return f"it stopped because {caused_by} failed (its crash report, {crash_file}, says so): see the root cause"
    if crash_file:
        return DEAD.replace("<role>.crash.json", crash_file)
    return NO_CRASH_REPORT


DEFAULT_SLOW_AFTER_S = {catalogue.LIFECYCLE: 120.0, catalogue.STEP: 10.0, catalogue.REQUEST: 600.0}


def stage_hint(name: str) -> StageHint:
    """The hint for stage ``name``: from ``HINTS``, else its catalogue doc and a default by level."""
    hint = HINTS.get(name)
    if hint is not None:
        return hint
    spec = catalogue.SPANS.get(name)
    level = spec.level if spec is not None else catalogue.STEP
    # A catalogue doc is a sentence; a hint is a clause its readers end themselves ("…: HINT.").
    doc = spec.doc.rstrip().removesuffix(".") if spec is not None else ""
    return StageHint(DEFAULT_SLOW_AFTER_S.get(level, 60.0), doc)


def render_markdown() -> str:
    """The hint table as Markdown (what ``docs/troubleshooting-hangs.md`` embeds)."""
    lines = [
        "| stage | usually takes | alert after | when stuck here: what it means, what to check |",
        "|---|---|---|---|",
    ]
    for name, h in HINTS.items():
        lines.append(f"| `{name}` | {h.typical or '—'} | {h.slow_after_s:g} s | {h.hint} |")
    return "\n".join(lines) + "\n"


__all__ = [
    "DEAD",
    "DEFAULT_SLOW_AFTER_S",
    "FROZEN",
    "GONE_FROZEN",
    "GONE_STOPPED",
    "HINTS",
    "NOT_STARTED",
    "NO_CRASH_REPORT",
    "STOPPED",
    "StageHint",
    "dead_hint",
    "render_markdown",
    "stage_hint",
]

if __name__ == "__main__":
    print(render_markdown(), end="")
