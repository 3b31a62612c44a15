"""Every ``GLASSBOX_*`` environment variable, declared once.

Mirrors vLLM's ``vllm/envs.py``: one table of name, type, default and meaning. Read a
value as ``envs.GLASSBOX_CPU_KVCACHE_SPACE``: it is parsed from the environment at each
access, so tests can ``monkeypatch.setenv``. ``glassbox --help`` does not list these; the
generated reference is ``docs/configuration.md``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tracing import waits


def _bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 0 or 1 (or true/false, yes/no, on/off), got {value!r}")


def _auto_bool(value: str) -> bool | str:
    """``auto`` (or empty) stays ``"auto"``; anything else is a ``_bool``."""
    if value.strip().lower() in ("auto", ""):
        return "auto"
    try:
        return _bool(value)
    except ValueError:
        raise ValueError(f"expected auto, 0 or 1, got {value!r}") from None


FUSED_LOOP_THREADS = ("auto", "one", "all")


def _fused_loop_threads(value: str) -> str:
    v = value.strip().lower() or "auto"
    if v not in FUSED_LOOP_THREADS:
        raise ValueError(f"expected one of {', '.join(FUSED_LOOP_THREADS)}, got {value!r}")
    return v


def _cache_root(value: str) -> str:
    """A directory Glassbox may create and write: an existing non-directory or an existing
    directory it cannot write is refused (found in the first process, not by a worker's
    compile)."""
    path = os.path.expanduser(value.strip())
    if not path:
        raise ValueError("expected a directory path, got an empty value")
    existing = path
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        raise ValueError(f"{existing!r} exists and is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{existing!r} is not writable by this user")
    return value


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _log_level(value: str) -> str:
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}, got {value!r}")
    return level


_positive_float = waits.parse_seconds  # one parser of seconds, shared with tracing.waits


def _non_negative_float(value: str) -> float:
    number = float(value)
    if not number >= 0:  # also refuses NaN
        raise ValueError(f"expected a number of seconds >= 0, got {value!r}")
    return number


def _non_negative_int(value: str) -> int:
    if not value.strip().isdigit():
        raise ValueError(f"expected a whole number >= 0, got {value!r}")
    return int(value)


def _layer_partition(value: str) -> tuple[int, ...]:
    """``"2,2"`` → ``(2, 2)``: layer counts per pipeline stage, each a whole number >= 1.

    That they are one per stage and add up to the model's layers is checked where the model
    is known (``EngineConfig``, in the first process).
    """
    parts = value.split(",")
    if not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"expected comma-separated layer counts >= 1, one per pipeline stage, got {value!r}")
    return tuple(int(p) for p in parts)


def _cpu_list(text: str) -> tuple[int, ...]:
    """``"0-2,5"`` → ``(0, 1, 2, 5)``: CPU ids, in order, no repeats."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
            raise ValueError(f"{part.strip()!r} is not a CPU id or an ascending range like 0-3")
        cpus.extend(c for c in range(int(lo), int(hi if dash else lo) + 1) if c not in cpus)
    return tuple(cpus)


def _omp_threads_bind(value: str) -> str | tuple[tuple[int, ...], ...]:
    """``"auto"`` / ``"nobind"`` as they are; ``"0-1|2-3"`` → ``((0, 1), (2, 3))``: one CPU list
    per worker. Whether there is a list for every worker and the CPUs are usable is checked
    by each worker (``engine.worker.cpu.cpu_threads.plan_cpu_threads``), where both are known.
    """
    v = value.strip().lower()
    if v in ("auto", "nobind"):
        return v
    try:
        return tuple(_cpu_list(rank) for rank in v.split("|"))
    except ValueError as e:
        raise ValueError(f'expected "auto", "nobind" or CPU lists per worker like "0-1|2-3": {e}') from None


def _faults(value: str) -> tuple[Any, ...]:
    """A fault spec (``tracing.faults``): parsed here so a bad one fails in the first process."""
    from tracing.faults import parse_faults

    return tuple(parse_faults(value))


def _stage_delay(value: str) -> float:
    """``GLASSBOX_STARTUP_STAGE_DELAY_S`` (``tracing.slow_motion``): parsed here so a bad value
    fails in the first process."""
    from tracing.slow_motion import parse_delay

    return parse_delay(value)


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str


ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in [
        EnvVar(
            "GLASSBOX_CPU_KVCACHE_SPACE",
            float,
            1.0,
            "KV-cache budget on CPU, in GiB (vLLM: VLLM_CPU_KVCACHE_SPACE). Small on purpose: "
            "never a share of all system memory. --kv-cache-memory-bytes overrides it.",
        ),
        EnvVar(
            "GLASSBOX_CPU_OMP_THREADS_BIND",
            _omp_threads_bind,
            "auto",
            "CPU workers' torch (OpenMP) threads (vLLM: VLLM_CPU_OMP_THREADS_BIND). auto: the CPUs "
            "this process may use are shared out evenly between the engine's local workers (DP x "
            "PP x TP): as many threads as CPUs in each share, and each worker pinned to its share "
            "when there are several (OMP_NUM_THREADS, when set, still gives the count); more "
            'workers than CPUs: one thread each, unpinned. "0-1|2-3": CPU lists, one per worker '
            "(in rank order, DP engine by DP engine), each worker pinned to its list with one "
            "thread per CPU. auto and lists also start every child process with a short OpenMP "
            "wait unless OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME is set: "
            "GOMP_SPINCOUNT=10000 with GLASSBOX_CPU_ADAPTIVE_THREADS (the default), else "
            "OMP_WAIT_POLICY=PASSIVE — a thread waiting for its team then sleeps instead of "
            "spinning, which keeps throughput up when another process takes a core, at some cost "
            'on an idle machine (docs/performance.md, "One core taken"). nobind: '
            "leave torch's threads, their affinity and OpenMP's wait policy as torch sets them. "
            "Applied in the worker's own process (and in the engine core with "
            "--distributed-executor-backend uni); a worker inside your process "
            "(GLASSBOX_ENABLE_MULTIPROCESSING=0) follows only explicit lists.",
        ),
        EnvVar(
            "GLASSBOX_CPU_ADAPTIVE_THREADS",
            _bool,
            True,
            "1: a CPU worker with two or more torch threads watches, every quarter second of "
            "stepping, how much of its CPUs other processes take (/proc/stat, Linux), and runs "
            "with fewer threads while they do (back to its share when they stop), so a taken "
            "core does not leave its OpenMP team waiting for a starved thread; children then "
            "start with GOMP_SPINCOUNT=10000 (a short spin: fast when quiet) instead of "
            "OMP_WAIT_POLICY=PASSIVE, unless an OpenMP wait variable is set. 0: a fixed thread "
            'count and OMP_WAIT_POLICY=PASSIVE (docs/performance.md, "Threads that follow '
            'the load").',
        ),
        EnvVar(
            "GLASSBOX_LOGGING_LEVEL",
            _log_level,
            "INFO",
            "Log level of the glassbox loggers (DEBUG, INFO, WARNING, ERROR).",
        ),
        EnvVar(
            "GLASSBOX_TORCH_COMPILE",
            _auto_bool,
            "auto",
            "0 runs the model eagerly, as --enforce-eager does, in every engine started from this "
            "environment (the tests about model math do, on their many tiny checkpoints). 1: the "
            "model forward is compiled with torch.compile (Inductor) unless --enforce-eager; see "
            "GLASSBOX_CACHE_ROOT for the compile cache. auto (unset): compiled, and on a CPU "
            "timed once against the eager step on this machine, which replaces it only where it "
            "measured clearly faster (the worker's status shows the verdict as compiled_step).",
        ),
        EnvVar(
            "GLASSBOX_CPU_FUSED_LOOP_THREADS",
            _fused_loop_threads,
            "auto",
            "Threads for the compiled step's own fused loops (Inductor's norms, RoPE, SiLU·mul, "
            "adds; the linears and attention always use the worker's threads). auto: a CPU "
            "worker times its steps both ways after warm-up, once per machine and model (cached "
            "like the other measured choices), and runs a decode step's loops, and a prefill "
            "step's, on one thread only where one measured faster for that kind of step; where "
            "nothing is timed (tensor, pipeline or expert parallelism), all. one / all: that, "
            "without timing. The worker's status shows the verdict as fused_loop_threads.",
        ),
        EnvVar(
            "GLASSBOX_CPU_KV_HUGE_PAGES",
            _bool,
            "1",
            "1: a CPU worker allocates its KV cache as one buffer advised onto 2 MiB pages "
            "(Linux transparent huge pages, MADV_HUGEPAGE; where THP is off the cache is on "
            "ordinary pages and nothing else changes): decode attention reads scattered KV "
            "blocks, and on 4 KiB pages each block costs TLB misses. The worker logs how much "
            "of the cache Linux put on huge pages, and its status (glassbox ps) shows the "
            "pages as kv_cache_pages. 0: ordinary 4 KiB pages.",
        ),
        EnvVar(
            "GLASSBOX_CACHE_ROOT",
            _cache_root,
            "~/.cache/glassbox",
            "Glassbox's cache directory (vLLM: VLLM_CACHE_ROOT), created when first needed. "
            "torch.compile's compiled graphs are kept in its torch_compile_cache/ (unless "
            "TORCHINDUCTOR_CACHE_DIR is set), so a second start of the same model and settings "
            "loads them instead of compiling; the C++ paged-attention kernel (CPU_PAGED_CPP) is "
            "built into its kernels/; a tree that ends after a failure keeps its post-mortem (manifest, "
            "status files, crash reports, root cause; the newest 10) in its post_mortem/, read by "
            "glassbox doctor --last.",
        ),
        EnvVar(
            "GLASSBOX_TRACE_FILE",
            str,
            None,
            "Write every finished OpenTelemetry span as one JSON line to this file (same as --trace-file).",
        ),
        EnvVar(
            "GLASSBOX_RUN_DIR_BASE",
            str,
            None,
            "Where run directories are created (default: $XDG_RUNTIME_DIR, else /dev/shm, else the "
            "temp dir).",
        ),
        EnvVar(
            "GLASSBOX_ENABLE_MULTIPROCESSING",
            _bool,
            True,
            "1: the offline LLM runs the engine core in its own process (SyncMPClient); 0: in the "
            "caller's process (InprocClient), for repeatable debugging (vLLM: "
            "VLLM_ENABLE_V1_MULTIPROCESSING).",
        ),
        EnvVar(
            "GLASSBOX_ENGINE_READY_TIMEOUT_S",
            _positive_float,
            600.0,
            "Deadline, in seconds, for the engine core to say READY after it was started; the "
            "expiry message names the late process and its stage (vLLM: VLLM_ENGINE_READY_TIMEOUT_S).",
        ),
        EnvVar(
            "GLASSBOX_EXECUTE_MODEL_TIMEOUT_S",
            _positive_float,
            300.0,
            "Deadline, in seconds, for the workers to answer one execute_model or collective_rpc "
            "call once started (start-up's calls, the torch.compile warm-up among them, have "
            "GLASSBOX_ENGINE_READY_TIMEOUT_S) (vLLM: VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS).",
        ),
        EnvVar(
            "GLASSBOX_MQ_TIMEOUT_S",
            _positive_float,
            300.0,
            "Deadline, in seconds, of one wait on the shared-memory broadcast queue; the expiry "
            "message names the reader that is behind.",
        ),
        EnvVar(
            "GLASSBOX_DIST_INIT_TIMEOUT_S",
            _positive_float,
            120.0,
            "Deadline, in seconds, for every tensor-parallel worker to join the torch.distributed "
            "rendezvous (TCP, on a free port found at run time); the expiry message names the ranks "
            "that never arrived.",
        ),
        EnvVar(
            "GLASSBOX_PP_LAYER_PARTITION",
            _layer_partition,
            None,
            'Decoder layers per pipeline stage, comma-separated (e.g. "3,1"): one count per stage, '
            "summing to num_hidden_layers (vLLM: VLLM_PP_LAYER_PARTITION). Unset: equal parts, the "
            "remainder to the stages before the last.",
        ),
        EnvVar(
            "GLASSBOX_STOPPED_TIMEOUT_S",
            _positive_float,
            5.0,
            "Seconds a child process may stay stopped by a signal (SIGSTOP, Ctrl-Z, a debugger) "
            "before its parent reports it by name and stops the tree: a stopped process answers "
            "nothing, and an idle tree would otherwise wait for it forever. /health answers 503, "
            "naming it, as soon as it is seen stopped (200 again after SIGCONT in time).",
        ),
        EnvVar(
            "GLASSBOX_HEARTBEAT_TIMEOUT_S",
            _non_negative_float,
            30.0,
            "Seconds a running child process may go without a heartbeat (its liveness thread "
            "touches its status file each second, whatever GLASSBOX_TELEMETRY says) before its "
            "parent reports it frozen by name and stops the tree: a native call holding the GIL "
            "or a deadlock stops every Python thread while the OS shows the process running. "
            "0 turns the check off.",
        ),
        EnvVar(
            "GLASSBOX_TELEMETRY",
            _bool,
            True,
            "1: every process publishes live telemetry (stages, waits, heartbeats, gauges, steps) "
            "on a ZMQ socket in its run directory, for engine-top; 0: off (no socket, no thread, "
            "no stage hook). Read by tracing/telemetry/publisher.py.",
        ),
        EnvVar(
            "GLASSBOX_DP_JOIN_TIMEOUT_S",
            _positive_float,
            600.0,
            "Multi-node data parallelism (docs/multi-node.md): deadline, in seconds, for every "
            "headless node's engine cores to join the head (counted from the head's start; the "
            "expiry message names the ranks that never joined), and for a headless engine core "
            "to get the head's answer (the head may start after it).",
        ),
        EnvVar(
            "GLASSBOX_DP_DUMMY_STEP_INTERVAL_S",
            _non_negative_float,
            0.02,
            "Data parallelism: the pause, in seconds, after each dummy batch an engine runs while "
            "its request wave runs and it has nothing to do (0: back to back, as vLLM). Without "
            "expert parallelism the engines share no collective, so the pause keeps an idle engine "
            "from taking the core a busy one needs; with --enable-expert-parallel every forward's "
            "all-to-alls wait for every engine, and dummy batches run back to back whatever this says.",
        ),
        EnvVar(
            "GLASSBOX_API_KEY",
            str,
            None,
            "API key the server requires on /v1/* (same as --api-key; vLLM: VLLM_API_KEY).",
        ),
        EnvVar(
            "GLASSBOX_RESPONSES_API_STORE_SIZE",
            _non_negative_int,
            256,
            "How many responses each API server keeps in memory for GET /v1/responses/{id}, "
            "/cancel and previous_response_id (those sent with store true; an LRU: past the bound "
            "the least recently used is forgotten, and asking for it is a 404). 0: nothing is "
            "kept, store is ignored and background is refused — vLLM's default; vLLM's "
            "VLLM_ENABLE_RESPONSES_API_STORE=1 keeps every response, without a bound.",
        ),
        EnvVar(
            "GLASSBOX_KEEP_ALIVE_ON_ENGINE_DEATH",
            _bool,
            False,
            "1 keeps the API server up when the engine dies (/health answers 503); by default it "
            "exits non-zero, as vLLM does (vLLM: VLLM_KEEP_ALIVE_ON_ENGINE_DEATH).",
        ),
        EnvVar(
            "GLASSBOX_LOG_STATS_INTERVAL",
            _positive_float,
            10.0,
            "Seconds between two periodic stats log lines (per engine: prompt and generation "
            "throughput, running, waiting, KV cache usage, prefix cache hit rate; DEBUG when idle) "
            "of each API server and of the offline LLM (vLLM: VLLM_LOG_STATS_INTERVAL).",
        ),
        EnvVar(
            "GLASSBOX_HTTP_TIMEOUT_KEEP_ALIVE",
            _positive_float,
            5.0,
            "Seconds an idle keep-alive HTTP connection stays open after its last response before "
            "the API server closes it (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE; docs/security.md).",
        ),
        EnvVar(
            waits.DEFAULT_TIMEOUT_ENV,
            _positive_float,
            waits.DEFAULT_TIMEOUT_S,
            "Deadline, in seconds, of a bounded wait that was given no deadline of its own.",
        ),
        EnvVar(
            "GLASSBOX_STARTUP_STAGE_DELAY_S",
            _stage_delay,
            0.0,
            "Start-up in slow motion, for teaching (tracing/slow_motion.py): every process pauses "
            "this many seconds as it enters each of its start-up (lifecycle) stages, so that "
            "glassbox ps and engine-top can be watched as the stages go by; each stage still does "
            "its work after the pause. The pause is shown as one: glassbox ps adds '(paused on "
            "purpose: GLASSBOX_STARTUP_STAGE_DELAY_S=N)' to the stage, engine-top a wait for 'a "
            "deliberate pause before STAGE'. 0: no pause.",
        ),
        EnvVar(
            "GLASSBOX_FAULT",
            _faults,
            None,
            "Fault injection, for teaching and tests (off by default; see docs/faults.md): "
            "STAGE:KIND[@ROLE][#N], several comma-separated, e.g. "
            "worker.load_model:hang@Worker_DP0_PP0_TP1. KIND: hang, freeze, crash, exit:<code>, "
            "kill:<signal>, slow:<seconds>; #N strikes the N-th entry of the stage (#* every one). "
            "Same as --inject-fault, which sets it for every child; each process it arms logs "
            "one WARNING line.",
        ),
    ]
}


def get(name: str) -> Any:
    """The parsed value of ``name``, or its default when unset or empty.

    Raises:
        ValueError: when the variable is set to a value its type cannot parse; the message
            names the variable.
    """
    var = ENV_VARS[name]
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return var.default
    try:
        return var.parse(raw)
    except ValueError as e:
        raise ValueError(f"{name}={raw!r} is not valid: {e}") from None


def validate_all() -> None:
    """Parse every ``GLASSBOX_*`` variable that is set, so a bad value fails in the first
    process, before anything is spawned (not later, inside a child that reads it).

    Raises:
        ValueError: the first variable set to a value its type cannot parse; the message
            names the variable, its value and what is expected.
    """
    for name in ENV_VARS:
        get(name)


def __getattr__(name: str) -> Any:
    if name in ENV_VARS:
        return get(name)
    raise AttributeError(f"module 'engine.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(ENV_VARS))
