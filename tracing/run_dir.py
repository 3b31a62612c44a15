"""The run-directory contract: what a Glassbox instance leaves on disk, typed, in one place.

Every instance (an offline ``LLM`` or a server) owns one run directory, named
``glassbox-<creator pid>-<random>`` under the base directory (``run_dir_base``), mode 0700.
Besides the ZMQ ipc sockets and shared-memory files of the engine, it holds three kinds of
small JSON file — JSON because people read them with ``cat`` while a server hangs::

    manifest.json              Manifest        the planned tree, written by the owner
    <role>.status.json         ProcessStatus   each process's current lifecycle stage
    <role>.crash.json          CrashReport     why a process died, written as it dies

and, for each worker, one small binary file it rewrites in place (an mmap, no system call)::

    <role>.comm                CommPosition    the RPC and the collective it is in (``CommBoard``)

Each is written through one atomic writer (``write_record``: a temp file, then
``os.replace``, so a reader never sees half a file) and read by one reader per kind
(``read_manifest``, ``read_status``, ``read_crash_report``) that returns the typed struct, or
None when the file is missing or does not decode. Readers are lenient about missing and
unknown fields, so a newer or older Glassbox's files still read.

Who uses it: the engine writes (through ``engine/utils/run_dir.py``, which turns the
topology plan into the manifest, and ``tracing.setup``, which writes status files);
``glassbox ps``, ``engine-top`` and the engine's own deadline messages and root-cause
reports read. So this module imports no ``engine`` module and no torch (a test checks it in a
fresh interpreter): engine-top must work where the engine cannot even be imported.

Role names (``EngineCore_DP0``) are opaque strings here: this module never builds or parses
one. The engine's topology plan does (``engine/distributed/topology.py``) and writes the
structured fields (kind, ranks, title) into the manifest's entries. A file name is a role
name plus a suffix; a process title is ``TITLE_PREFIX`` plus a role name.

The base directory is ``$GLASSBOX_RUN_DIR_BASE`` (read here, in ``run_dir_base`` only; the
engine declares the variable in ``engine/envs.py``), else ``$XDG_RUNTIME_DIR``, else
``/dev/shm``, else the temp dir. A memory-backed filesystem matters: the workers'
shared-memory queues are files in the run directory, and on a disk-backed one the kernel
would write their pages back to disk. Paths stay short: an ipc socket path is limited to
107 characters.

A run directory goes with its tree. After a failure, what a post-mortem needs is first
copied to ``<cache root>/post_mortem/<run-dir name>/`` (``keep_post_mortem``; bounded, see
"post-mortems" below), where ``glassbox doctor --last`` finds it (``list_post_mortems``,
``find_post_mortem``, ``read_post_mortem``). The engine passes its validated
``GLASSBOX_CACHE_ROOT``; ``post_mortem_root`` reads the variable itself only for readers
without the engine.

vLLM has no run directory (its ipc sockets are loose files in the temp dir, found by
nobody); this contract is ours.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import TypeVar

import msgspec

ENV_RUN_DIR_BASE = "GLASSBOX_RUN_DIR_BASE"
RUN_DIR_PREFIX = "glassbox-"
MANIFEST = "manifest.json"
STATUS_SUFFIX = ".status.json"
CRASH_SUFFIX = ".crash.json"
COMM_SUFFIX = ".comm"
TITLE_PREFIX = "glassbox::"
# Unix socket paths are limited to 107 bytes: base + "/glassbox-<pid>-<8>" (≤ 26) + a
# socket name must fit. The engine's own sockets (≤ 17 with the slash) fit a base of up to
# MAX_BASE_LEN (a longer $GLASSBOX_RUN_DIR_BASE is refused in the first process); the
# telemetry sockets (<role>.tel, ≤ 24) a base of up to TELEMETRY_BASE_LEN — a longer
# $XDG_RUNTIME_DIR is skipped for that reason.
MAX_BASE_LEN = 64
TELEMETRY_BASE_LEN = 57

# make_run_dir names a directory glassbox-<creator pid>-<random>.
_RUN_DIR_NAME = re.compile(rf"^{re.escape(RUN_DIR_PREFIX)}(\d+)-")


# --------------------------------------------------------------------------- the records


class PlannedProcess(msgspec.Struct, omit_defaults=True):
    """One process of the planned tree: an entry of ``Manifest.roles``.

    Written by the engine from its topology plan; every field but ``role`` may be missing
    in a manifest written by an older Glassbox (or by hand, in tests).

    Attributes:
        role: the role name (``Worker_DP0_PP1_TP0``), an opaque string here.
        kind: ``frontend``, ``api_server``, ``engine_core``, ``worker`` or ``dp_coordinator``.
        rank: an engine core's DP rank, or a worker's rank inside its engine
            (``pp_rank * tensor_parallel_size + tp_rank``); else None.
        dp_rank, pp_rank, tp_rank: an engine core's or worker's ranks (pp/tp: workers only).
        api_index: an API server's index.
        pid: the process id, when the manifest's writer knows it (its own process).
        title: the process title (``glassbox::Worker_DP0_PP1_TP0``).
        status_file: the status file's name in the run directory.
        counted: whether the process counts toward ``Manifest.expected_process_count``
            (False for an offline ``LLM``'s own process, the owner).
    """

    role: str
    kind: str | None = None
    rank: int | None = None
    dp_rank: int | None = None
    pp_rank: int | None = None
    tp_rank: int | None = None
    api_index: int | None = None
    pid: int | None = None
    title: str | None = None
    status_file: str | None = None
    counted: bool | None = None


class Manifest(msgspec.Struct, omit_defaults=True):
    """``manifest.json``: the planned process tree of one instance, written by its owner.

    Attributes:
        created_at: Unix time (s) the manifest was written.
        run_dir: the run directory's path.
        mode: ``serve`` (API servers own the engines), ``mp`` (an offline ``LLM`` owns engine
            processes) or ``inproc`` (the engine runs inside the ``LLM``'s process).
        frontend_pid: the process that owns the instance (the ``LLM``'s, or ``APIServer_0``).
        roles: every planned process, in start-up order.
        expected_process_count: how many of ``roles`` are counted (A + DP + DP·PP·TP, + 1
            coordinator when DP > 1, under ``serve``).
        api_server_count, data_parallel_size, world_size (PP × TP, workers per engine),
        tensor_parallel_size, pipeline_parallel_size: the shape.
        host, port: where a server listens (``serve`` only).
        model: the served model name.
    """

    created_at: float | None = None
    run_dir: str | None = None
    mode: str | None = None
    frontend_pid: int | None = None
    roles: list[PlannedProcess] = msgspec.field(default_factory=list)
    expected_process_count: int | None = None
    api_server_count: int | None = None
    data_parallel_size: int | None = None
    world_size: int | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    host: str | None = None
    port: int | None = None
    model: str | None = None


class FinishedStage(msgspec.Struct):
    """The last lifecycle stage a process left (``ProcessStatus.last_finished``).

    Attributes:
        name: the stage's span name (``worker.load_model``).
        duration_ms: how long it ran, in milliseconds.
        error: ``"<ExceptionType>: <message>"`` when it raised, else None.
        finished_at: Unix time (s) it was left.
    """

    name: str
    duration_ms: float | None = None
    error: str | None = None
    finished_at: float | None = None


class StruckFault(msgspec.Struct):
    """An injected fault (``tracing.faults``) that struck this process.

    Attributes:
        spec: the fault as written (``worker.load_model:hang@Worker_DP0_PP0_TP0#1``).
        stage: the stage it struck in.
        kind: hang, freeze, crash, exit, kill or slow.
        struck_at: Unix time (s) it struck.
        thread: the thread it struck.
    """

    spec: str
    stage: str
    kind: str
    struck_at: float
    thread: str = ""


class Pause(msgspec.Struct):
    """A deliberate pause the process is in (``ProcessStatus.pause``, ``tracing.slow_motion``).

    Attributes:
        stage: the stage it pauses at the start of.
        seconds: how long the pause is.
        since: Unix time (s) it began.
        env: the variable that asked for it (``GLASSBOX_STARTUP_STAGE_DELAY_S``).
    """

    stage: str
    seconds: float
    since: float | None = None
    env: str | None = None


class ProcessStatus(msgspec.Struct):
    """``<role>.status.json``: a process's current lifecycle stage, rewritten at each change.

    Written by ``tracing.setup`` whenever a lifecycle stage is entered or left (step-level
    stages are too frequent and never touch it), so it names the stage even of a frozen
    process. Every field may be missing in a file written by hand or by an older version.

    Attributes:
        role: the writer's role name.
        rank: its worker or DP rank, or None.
        pid: its process id.
        stage: the innermost open lifecycle stage, or None between stages.
        stage_stack: the open lifecycle stages, outermost first.
        entered_at: Unix time (s) ``stage`` was entered.
        updated_at: Unix time (s) the file was written.
        last_finished: the last lifecycle stage left, or None.
        faults: injected faults that struck this process (``StruckFault``), oldest first.
        placement: where a cluster scheduler put this process, when one did (a Ray actor:
            ``node_id``, ``node_ip``, ``actor_id``); empty for a process its parent spawned.
        runs_as: how a worker runs its model once warm (``device``, ``dtype``, ``compile``,
            ``attention``, ``cpu_threads``; ``graphs_after_warm_up`` once torch.compile made a
            graph after warm-up), as short texts; empty for other processes.
        pause: the deliberate pause it is in now (``GLASSBOX_STARTUP_STAGE_DELAY_S``), else None.
    """

    role: str | None = None
    rank: int | None = None
    pid: int | None = None
    stage: str | None = None
    stage_stack: list[str] = msgspec.field(default_factory=list)
    entered_at: float | None = None
    updated_at: float | None = None
    last_finished: FinishedStage | None = None
    faults: list[StruckFault] = msgspec.field(default_factory=list)
    placement: dict[str, str] = msgspec.field(default_factory=dict)
    runs_as: dict[str, str] = msgspec.field(default_factory=dict)
    pause: Pause | None = None


class CrashReport(msgspec.Struct):
    """``<role>.crash.json``: why a process died, written by the process as it dies.

    Attributes:
        role: the dying process's role name.
        rank: its worker or DP rank, or None.
        pid: its process id.
        stage: the stage it was in (None: none, or unknown).
        exception: ``"<ExceptionType>: <message>"``.
        traceback: the formatted traceback.
        time: Unix time (s) it was written.
        caused_by: the role whose failure this death follows (an engine core stopping because
            its worker died): the report is an echo, and the blame rule
            (``tracing.blame``) looks at that process instead. None: its own failure.
    """

    role: str
    rank: int | None = None
    pid: int | None = None
    stage: str | None = None
    exception: str | None = None
    traceback: str | None = None
    time: float | None = None
    caused_by: str | None = None


# The RPCs and collectives a CommPosition can name, by code (0: none). Appending keeps old
# files readable; a code past the end reads as "other".
COMM_RPCS = ("", "execute_model", "execute_dummy_batch", "other")
COMM_KINDS = ("", "all_reduce", "all_gather", "send", "recv", "broadcast", "barrier", "all_to_all")
COMM_GROUPS = ("tp", "pp", "ep")
# step, rpc code, rpc entered at, then per group (tp, pp, ep): collectives entered this step, the
# kind of the last one, 1 while inside it, when it was entered. Little-endian, 8-byte fields.
_COMM = struct.Struct("<qqd" + "qqqd" * len(COMM_GROUPS))
_Q, _QD, _QQQ, _QQQD = (struct.Struct(f) for f in ("<q", "<qd", "<qqq", "<qqqd"))  # the writer's parts


class CollectivePosition(msgspec.Struct):
    """Where a worker is in one group's collectives (``CommPosition.groups``).

    Attributes:
        group: ``tp``, ``pp`` or ``ep`` (expert parallelism: every worker of every DP engine).
        seq: collectives of this group entered in the current step (the k of "all_reduce #k").
        kind: the last one entered: ``all_reduce``, ``all_gather``, ``send``, ``recv``,
            ``broadcast``, ``barrier`` or ``all_to_all`` ("" before the first).
        inside: whether the worker is inside it now (waiting for its peers).
        entered_at: Unix time (s) it was entered.
    """

    group: str
    seq: int = 0
    kind: str = ""
    inside: bool = False
    entered_at: float | None = None


class CommPosition(msgspec.Struct):
    """``<role>.comm``: the RPC a worker is running and where it is in its collectives.

    Rewritten in place by ``CommBoard`` at every RPC and collective (a few hundred
    nanoseconds: no system call), so a reader can tell a rank waiting in all-reduce #3 from
    the rank that never reached it. Torn reads are possible (fields are written one by
    one); each field is consistent on its own.

    Attributes:
        step: the worker's steps so far (``execute_model`` and ``execute_dummy_batch`` RPCs).
        rpc: the RPC it runs now, or the one that raised ("" between RPCs).
        rpc_entered_at: Unix time (s) that RPC began.
        groups: one ``CollectivePosition`` per group, ``tp``, ``pp`` then ``ep``.
    """

    step: int = 0
    rpc: str = ""
    rpc_entered_at: float | None = None
    groups: list[CollectivePosition] = msgspec.field(default_factory=list)

    def group(self, name: str) -> CollectivePosition | None:
        return next((g for g in self.groups if g.group == name), None)


def comm_path(run_dir: str | os.PathLike[str], role: str) -> Path:
    """Where worker ``role`` keeps its ``CommPosition``."""
    return Path(run_dir) / f"{role}{COMM_SUFFIX}"


def _name(table: tuple[str, ...], code: int) -> str:
    return table[code] if 0 <= code < len(table) else "other"


def read_comm(run_dir: str | os.PathLike[str], role: str) -> CommPosition | None:
    """The ``CommPosition`` of worker ``role``, or None when it keeps none (not a worker,
    not started, or the file is short)."""
    try:
        with open(comm_path(run_dir, role), "rb") as f:
            data = f.read(_COMM.size)
    except OSError:
        return None
    if len(data) < _COMM.size:
        return None
    step, rpc, rpc_at, *rest = _COMM.unpack(data)
    groups = [
        CollectivePosition(name, seq, _name(COMM_KINDS, kind), bool(inside), at or None)
        for name, (seq, kind, inside, at) in zip(
            COMM_GROUPS, (rest[i : i + 4] for i in range(0, len(rest), 4)), strict=True
        )
    ]
    rpc_name = _name(COMM_RPCS, rpc)
    return CommPosition(step, rpc_name, rpc_at if rpc_name else None, groups)


class CommBoard:
    """The writer of one worker's ``<role>.comm`` (an mmap of ``CommPosition``'s bytes).

    ``rpc_enter``/``rpc_exit`` around each RPC, ``enter``/``leave`` around each collective;
    each is a ``struct.pack_into`` on the mapping. Never raises once open.

    Raises:
        OSError: the file cannot be created (the constructor only).
    """

    def __init__(self, run_dir: str | os.PathLike[str], role: str) -> None:
        import mmap

        path = comm_path(run_dir, role)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _COMM.size)
            self._map = mmap.mmap(fd, _COMM.size)
        finally:
            os.close(fd)
        self._step = 0
        self._seq = [0] * len(COMM_GROUPS)

    def rpc_enter(self, method: str) -> None:
        code = COMM_RPCS.index(method) if method in COMM_RPCS else COMM_RPCS.index("other")
        if code in (1, 2):  # a step
            self._step += 1
            _Q.pack_into(self._map, 0, self._step)
        # Every RPC counts its collectives from 1 again (only steps' counts are compared).
        self._seq = [0] * len(COMM_GROUPS)
        for g in range(len(COMM_GROUPS)):
            _QQQ.pack_into(self._map, 24 + 32 * g, 0, 0, 0)
        _QD.pack_into(self._map, 8, code, time.time())

    def rpc_exit(self) -> None:
        """The RPC returned (one that raised keeps its name: where it failed)."""
        _Q.pack_into(self._map, 8, 0)

    def enter(self, group: int, kind: int) -> None:
        """Entering a collective of ``group`` (index in ``COMM_GROUPS``) of ``kind`` (index in
        ``COMM_KINDS``)."""
        self._seq[group] += 1
        _QQQD.pack_into(self._map, 24 + 32 * group, self._seq[group], kind, 1, time.time())

    def leave(self, group: int) -> None:
        _Q.pack_into(self._map, 24 + 32 * group + 16, 0)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._map.close()


Record = TypeVar("Record", Manifest, ProcessStatus, CrashReport)


class RecordError(ValueError):
    """A run-directory file exists but is not valid JSON of its kind.

    Attributes:
        path: the file.
        reason: what is wrong with it (msgspec's message: ``Expected `int`, got `str` -
            at `$.pid```).
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


# --------------------------------------------------------------------------- paths


def manifest_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / MANIFEST


def status_path(run_dir: str | os.PathLike[str], role: str) -> Path:
    """Where process ``role`` (a role name) records its current stage."""
    return Path(run_dir) / f"{role}{STATUS_SUFFIX}"


def crash_path(run_dir: str | os.PathLike[str], role: str) -> Path:
    """Where process ``role`` (a role name) writes its crash report."""
    return Path(run_dir) / f"{role}{CRASH_SUFFIX}"


def status_paths(run_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Every status file in ``run_dir``, by role name, sorted (empty when the directory is gone)."""
    run_dir = Path(run_dir)
    try:
        names = sorted(p.name for p in run_dir.iterdir())
    except OSError:
        return {}
    return {n[: -len(STATUS_SUFFIX)]: run_dir / n for n in names if n.endswith(STATUS_SUFFIX)}


def role_from_title(title: str | None) -> str | None:
    """The role name in a ``glassbox::<role>`` process title (anything after a space is
    ignored), or None for any other title."""
    if not title or not title.startswith(TITLE_PREFIX):
        return None
    rest = title[len(TITLE_PREFIX) :].split()
    return rest[0] if rest else None


# --------------------------------------------------------------------------- writer and readers


def write_record(path: str | os.PathLike[str], record: msgspec.Struct, *, indent: int = 2) -> None:
    """Atomically (temp file + ``os.replace``) write ``record`` to ``path`` as JSON.

    ``indent``: spaces per level (0: one compact line, for files rewritten often). The temp
    file is named per process and thread, so concurrent writers never share one.

    Raises:
        OSError: the file cannot be written (e.g. the run directory is gone); no temp file
            is left behind.
    """
    data = msgspec.json.encode(record)
    if indent:
        data = msgspec.json.format(data, indent=indent)
    path = os.fspath(path)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_decoders: dict[type, msgspec.json.Decoder] = {}


def load_record(path: str | os.PathLike[str], kind: type[Record]) -> Record:
    """Read ``path`` as a ``kind`` (``Manifest``, ``ProcessStatus`` or ``CrashReport``).

    Raises:
        OSError: the file cannot be read (``FileNotFoundError`` when it is missing).
        RecordError: it is not valid JSON of that kind.
    """
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    with open(path, "rb") as f:
        data = f.read()
    try:
        return decoder.decode(data)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise RecordError(os.fspath(path), str(e)) from None


def _read(path: str | os.PathLike[str], kind: type[Record]) -> Record | None:
    try:
        return load_record(path, kind)
    except (OSError, RecordError):
        return None


def load_manifest(run_dir: str | os.PathLike[str]) -> Manifest:
    """The manifest of ``run_dir``.

    Raises:
        FileNotFoundError: no manifest yet (the instance is starting, or died first).
        OSError: it cannot be read.
        RecordError: it does not decode.
    """
    return load_record(manifest_path(run_dir), Manifest)


def read_manifest(run_dir: str | os.PathLike[str]) -> Manifest | None:
    """The manifest of ``run_dir``, or None when it is missing or unreadable."""
    return _read(manifest_path(run_dir), Manifest)


def read_status(path: str | os.PathLike[str]) -> ProcessStatus | None:
    """The status file at ``path`` (see ``status_path``), or None when missing or unreadable."""
    return _read(path, ProcessStatus)


def read_crash_report(run_dir: str | os.PathLike[str], role: str) -> CrashReport | None:
    """The crash report of process ``role``, or None when it wrote none (or it is unreadable)."""
    return _read(crash_path(run_dir, role), CrashReport)


def write_manifest(run_dir: str | os.PathLike[str], manifest: Manifest) -> None:
    """Atomically (re)write ``run_dir``'s manifest. Raises ``OSError`` as ``write_record``."""
    write_record(manifest_path(run_dir), manifest)


def write_status(path: str | os.PathLike[str], status: ProcessStatus) -> None:
    """Atomically rewrite a status file (one compact line). Raises ``OSError`` as ``write_record``."""
    write_record(path, status, indent=0)


def write_crash_report(run_dir: str | os.PathLike[str], report: CrashReport) -> None:
    """Atomically write ``report`` as its role's crash report. Raises ``OSError`` as ``write_record``."""
    write_record(crash_path(run_dir, report.role), report)


# --------------------------------------------------------------------------- run directories


def run_dir_base(base: str | os.PathLike[str] | None = None) -> Path:
    """Where run directories live: ``base`` when given, else ``$GLASSBOX_RUN_DIR_BASE``, else
    ``$XDG_RUNTIME_DIR``, else ``/dev/shm`` (when writable), else the temp dir.

    The one place that reads ``GLASSBOX_RUN_DIR_BASE`` without the engine: the engine passes
    its validated value (``engine/envs.py``) as ``base``; ``glassbox ps`` and engine-top
    let it be read here. Empty values count as unset.
    """
    chosen = os.fspath(base) if base else None
    chosen = chosen or os.environ.get(ENV_RUN_DIR_BASE)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if not chosen and xdg and len(xdg) <= TELEMETRY_BASE_LEN:  # a longer one would not fit the sockets
        chosen = xdg
    if not chosen and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        chosen = "/dev/shm"
    return Path(chosen or tempfile.gettempdir())


def make_run_dir(base: str | os.PathLike[str], post_mortems: str | os.PathLike[str] | None = None) -> Path:
    """Make a fresh run directory (mode 0700) under ``base`` and return its path.

    First sweeps away run directories that nothing owns any more (``sweep_stale_run_dirs``,
    keeping each one's post-mortem under ``post_mortems`` when given), so a tree that was
    killed all at once leaves no litter.

    Raises:
        OSError: ``base`` cannot be created or written.
    """
    base = Path(base)
    if not base.is_dir():
        base.mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o700)  # whatever the umask: run directories hold sockets and queues
    sweep_stale_run_dirs(base, post_mortems)
    return Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-", dir=base))


def list_run_dirs(base: str | os.PathLike[str] | None = None) -> list[Path]:
    """Every run directory under ``base`` (default: ``run_dir_base()``), sorted by name.

    Only directories named as ``make_run_dir`` names them are listed; a stale one (its
    creator gone) is listed too — telling live from stale is the caller's job.
    """
    base = run_dir_base() if base is None else Path(base)
    try:
        entries = list(base.iterdir())
    except OSError:  # no base yet: nothing ever ran here
        return []
    return sorted(p for p in entries if _RUN_DIR_NAME.match(p.name) and p.is_dir())


def creator_pid(run_dir: str | os.PathLike[str]) -> int | None:
    """The pid of the process that created ``run_dir`` (from its name), or None."""
    m = _RUN_DIR_NAME.match(Path(run_dir).name)
    return int(m.group(1)) if m else None


def pid_alive(pid: int | None) -> bool:
    """Whether a process ``pid`` exists (someone else's live process counts)."""
    if not pid or pid < 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def is_stale(run_dir: str | os.PathLike[str]) -> bool:
    """Whether ``run_dir``'s creator and every process with a status file are dead (nothing
    can still use or clean it)."""
    pids = [creator_pid(run_dir)]
    for path in status_paths(run_dir).values():
        status = read_status(path)
        if status is not None:
            pids.append(status.pid)
    return not any(pid_alive(pid) for pid in pids)


def stale_run_dirs(base: str | os.PathLike[str] | None = None) -> list[Path]:
    """The run directories under ``base`` (default ``run_dir_base()``) that ``is_stale``, by name."""
    return [d for d in list_run_dirs(base) if is_stale(d)]


def sweep_stale_run_dirs(
    base: str | os.PathLike[str], post_mortems: str | os.PathLike[str] | None = None
) -> list[Path]:
    """Remove run directories whose creator and every process with a status file are dead.

    A tree normally cleans up after itself (the last survivor removes the directory); this
    catches the rest — e.g. a whole process group SIGKILLed at once. A directory with any
    live pid is left alone. ``post_mortems``: the post-mortem directory
    (``post_mortem_root``); each removed directory's post-mortem is kept there first
    (``keep_post_mortem``), None keeps nothing. Returns the removed paths.
    """
    removed = []
    for run_dir in stale_run_dirs(base):
        if post_mortems is not None:
            keep_post_mortem(run_dir, post_mortems, reason=STALE_REASON, ended_at=last_written_at(run_dir))
        remove_run_dir(run_dir)
        removed.append(run_dir)
    return removed


def remove_run_dir(run_dir: str | os.PathLike[str]) -> None:
    """Remove ``run_dir`` and everything in it (no error when it is already gone)."""
    shutil.rmtree(run_dir, ignore_errors=True)


# --------------------------------------------------------------------------- post-mortems
#
# A run directory lives in memory (/dev/shm) and is removed when its tree ends; after a
# failure, what a post-mortem needs is first copied to a persistent directory,
# ``<cache root>/post_mortem/<run-dir name>/``: the manifest, status files, crash reports,
# flight recorders, the workers' ``.comm`` files (the step RPC and collective each was in:
# what the blame rule reads, ``tracing.blame``), the root-cause text the frontend printed
# (``root_cause.txt``: the verdict of the time, which ``glassbox doctor`` reads back), the
# telemetry recording when there is one, and ``post_mortem.json`` (a ``PostMortem``) saying
# where it lived, when and why it ended and what was kept or skipped. Bounded: the newest
# POST_MORTEMS_KEPT are kept, a file over POST_MORTEM_FILE_CAP is skipped (named in
# ``skipped``), and one post-mortem holds at most POST_MORTEM_TOTAL_CAP bytes.

ENV_CACHE_ROOT = "GLASSBOX_CACHE_ROOT"
DEFAULT_CACHE_ROOT = "~/.cache/glassbox"
POST_MORTEM_DIR = "post_mortem"
POST_MORTEM_META = "post_mortem.json"
ROOT_CAUSE = "root_cause.txt"
FLIGHT_SUFFIX = ".flight.json"
POST_MORTEMS_KEPT = 10
POST_MORTEM_FILE_CAP = 1 << 20  # bytes
POST_MORTEM_TOTAL_CAP = 8 << 20  # bytes, one post-mortem
STALE_REASON = (
    "stale: its creator and every process died without removing the run directory (killed all at once?)"
)
_KEPT_SUFFIXES = (STATUS_SUFFIX, CRASH_SUFFIX, FLIGHT_SUFFIX, COMM_SUFFIX)


class PostMortem(msgspec.Struct, omit_defaults=True):
    """``post_mortem.json``: what was kept of one run directory after its tree ended.

    Attributes:
        run_dir: where the run directory lived (it is gone).
        ended_at: Unix time (s) the tree ended (for a stale directory: its last file write).
        kept_at: Unix time (s) the post-mortem was written.
        reason: why it ended (``the engine died``, ``start-up timed out``, ``stale: ...``).
        files: the names kept, beside this file.
        skipped: ``"<name>: <why>"`` for each file not kept (over the size caps, unreadable).
        telemetry_record: the telemetry recording's path (``--telemetry-record``) when the
            tree had one; kept here too as ``telemetry_record_file`` when small enough.
        telemetry_record_file: its copy's name beside this file, when kept.
    """

    run_dir: str
    ended_at: float
    kept_at: float
    reason: str
    files: list[str] = msgspec.field(default_factory=list)
    skipped: list[str] = msgspec.field(default_factory=list)
    telemetry_record: str | None = None
    telemetry_record_file: str | None = None


def post_mortem_root(cache_root: str | os.PathLike[str] | None = None) -> Path:
    """Where post-mortems are kept: ``<cache_root>/post_mortem``; ``cache_root`` when given
    (the engine passes its validated ``GLASSBOX_CACHE_ROOT``), else ``$GLASSBOX_CACHE_ROOT``,
    else ``~/.cache/glassbox``."""
    root = os.fspath(cache_root) if cache_root else os.environ.get(ENV_CACHE_ROOT) or DEFAULT_CACHE_ROOT
    return Path(os.path.expanduser(root)) / POST_MORTEM_DIR


def write_root_cause(run_dir: str | os.PathLike[str], text: str) -> None:
    """Save the root-cause text the frontend prints as ``root_cause.txt`` in ``run_dir``
    (best effort: no error when the directory is gone)."""
    with contextlib.suppress(OSError):
        Path(run_dir, ROOT_CAUSE).write_text(text if text.endswith("\n") else text + "\n")


def last_written_at(run_dir: str | os.PathLike[str]) -> float | None:
    """The newest modification time (Unix s) of ``run_dir`` and its files: for a stale
    directory, about when its tree ended. None when it is gone."""
    try:
        times = [os.stat(run_dir).st_mtime]
        times += [p.stat().st_mtime for p in Path(run_dir).iterdir()]
    except OSError:
        return None
    return max(times)


def _kept_names(run_dir: Path) -> list[str]:
    try:
        names = sorted(p.name for p in run_dir.iterdir() if p.is_file())
    except OSError:
        return []
    # The root cause and the crash reports first: when the total cap bites, they are kept.
    order = {ROOT_CAUSE: 0, MANIFEST: 1}
    wanted = [n for n in names if n in order or n.endswith(_KEPT_SUFFIXES)]
    return sorted(wanted, key=lambda n: (order.get(n, 2 if n.endswith(CRASH_SUFFIX) else 3), n))


def keep_post_mortem(
    run_dir: str | os.PathLike[str],
    root: str | os.PathLike[str],
    *,
    reason: str,
    ended_at: float | None = None,
    telemetry_record: str | os.PathLike[str] | None = None,
    keep: int = POST_MORTEMS_KEPT,
) -> Path | None:
    """Copy what a post-mortem needs from ``run_dir`` to ``<root>/<run-dir name>/`` (see
    above), then prune ``root`` to the newest ``keep``. Returns the kept directory, or None
    when nothing could be kept (``run_dir`` gone or empty, ``root`` not writable: a
    post-mortem never stops a tree from ending). Written into a temp directory first and
    renamed, so a reader never sees half of one; an existing one for the same name stays.
    """
    run_dir, root = Path(run_dir), Path(root)
    names = _kept_names(run_dir)
    if not names:
        return None
    target = root / run_dir.name
    tmp = root / f".{run_dir.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(root, 0o700)  # crash reports hold tracebacks: as private as the run dir
        if target.exists():
            return target
        tmp.mkdir(mode=0o700)
        kept, skipped, total = [], [], 0
        sources = [(n, run_dir / n) for n in names]
        if telemetry_record:
            sources.append(("telemetry.rec", Path(telemetry_record)))
        for name, src in sources:
            try:
                size = src.stat().st_size
                if size > POST_MORTEM_FILE_CAP:
                    skipped.append(f"{name}: {size} bytes, over the {POST_MORTEM_FILE_CAP} byte cap")
                    continue
                if total + size > POST_MORTEM_TOTAL_CAP:
                    skipped.append(f"{name}: {size} bytes, over the {POST_MORTEM_TOTAL_CAP} byte total")
                    continue
                shutil.copy2(src, tmp / name)  # with its times: the blame rule orders failures by them
            except OSError as e:
                skipped.append(f"{name}: {e.strerror or e}")
                continue
            total += size
            kept.append(name)
        record = PostMortem(
            run_dir=str(run_dir), ended_at=ended_at or time.time(), kept_at=time.time(), reason=reason,
            files=[n for n in kept if n != "telemetry.rec"], skipped=skipped,
            telemetry_record=os.fspath(telemetry_record) if telemetry_record else None,
            telemetry_record_file="telemetry.rec" if "telemetry.rec" in kept else None,
        )  # fmt: skip
        write_record(tmp / POST_MORTEM_META, record)
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return target if (target / POST_MORTEM_META).is_file() else None
    prune_post_mortems(root, keep)
    return target


def read_post_mortem(path: str | os.PathLike[str]) -> PostMortem | None:
    """The ``PostMortem`` of a kept directory, or None when it is not one (or unreadable)."""
    try:
        return load_record(Path(path) / POST_MORTEM_META, PostMortem)
    except (OSError, RecordError):
        return None


def list_post_mortems(root: str | os.PathLike[str]) -> list[tuple[Path, PostMortem]]:
    """Every kept post-mortem under ``root``, newest ``ended_at`` first (empty when none)."""
    try:
        entries = [p for p in Path(root).iterdir() if _RUN_DIR_NAME.match(p.name)]
    except OSError:
        return []
    found = [(p, pm) for p in entries if (pm := read_post_mortem(p)) is not None]
    return sorted(found, key=lambda item: (item[1].ended_at, item[0].name), reverse=True)


def find_post_mortem(run_dir: str | os.PathLike[str], root: str | os.PathLike[str]) -> Path | None:
    """The kept post-mortem of ``run_dir`` (found by its name) under ``root``, or None."""
    kept = Path(root) / Path(run_dir).name
    return kept if _RUN_DIR_NAME.match(kept.name) and read_post_mortem(kept) is not None else None


def prune_post_mortems(root: str | os.PathLike[str], keep: int = POST_MORTEMS_KEPT) -> list[Path]:
    """Remove all but the newest ``keep`` post-mortems under ``root``. Returns the removed."""
    removed = [p for p, _ in list_post_mortems(root)[keep:]]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


__all__ = [
    "COMM_SUFFIX",
    "CRASH_SUFFIX",
    "CollectivePosition",
    "CommBoard",
    "CommPosition",
    "comm_path",
    "read_comm",
    "ENV_RUN_DIR_BASE",
    "MANIFEST",
    "RUN_DIR_PREFIX",
    "STATUS_SUFFIX",
    "TITLE_PREFIX",
    "CrashReport",
    "POST_MORTEMS_KEPT",
    "POST_MORTEM_FILE_CAP",
    "POST_MORTEM_TOTAL_CAP",
    "PostMortem",
    "ROOT_CAUSE",
    "find_post_mortem",
    "is_stale",
    "keep_post_mortem",
    "last_written_at",
    "list_post_mortems",
    "post_mortem_root",
    "prune_post_mortems",
    "read_post_mortem",
    "stale_run_dirs",
    "write_root_cause",
    "FinishedStage",
    "Manifest",
    "PlannedProcess",
    "ProcessStatus",
    "RecordError",
    "crash_path",
    "creator_pid",
    "list_run_dirs",
    "load_manifest",
    "load_record",
    "make_run_dir",
    "manifest_path",
    "pid_alive",
    "read_crash_report",
    "read_manifest",
    "read_status",
    "StruckFault",
    "remove_run_dir",
    "role_from_title",
    "run_dir_base",
    "status_path",
    "status_paths",
    "sweep_stale_run_dirs",
    "write_crash_report",
    "write_manifest",
    "write_record",
    "write_status",
]
