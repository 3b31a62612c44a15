"""The one topology plan: every Glassbox process, its role, ranks, title, log prefix and status file.

With A API servers, DP engine cores, PP pipeline stages and TP tensor-parallel ranks the
multiprocess tree has A + DP + DP·PP·TP processes, plus one DP coordinator when DP > 1
(``-tp 2 -dp 4`` → 4 + 4 + 8 + 1 = 17). ``plan(config)`` lists them; a ``ProcessRole`` knows
its name and everything derived from it::

    kind            name                      title                               rank in engine
    api_server      APIServer_<i>             glassbox::APIServer_<i>             -
    engine_core     EngineCore_DP<k>          glassbox::EngineCore_DP<k>          -
    worker          Worker_DP<k>_PP<p>_TP<t>  glassbox::Worker_DP<k>_PP<p>_TP<t>  p · TP + t
    dp_coordinator  DPCoordinator             glassbox::DPCoordinator             -
    frontend        LLM                       (the user's own process)            -
    headless        HeadlessNode              glassbox::HeadlessNode              -

This module is the only place that formats a role name (``ProcessRole.name``) or parses one
(``ProcessRole.parse``), and the only place that turns (pp, tp) into a worker rank. The
manifest (``engine/utils/run_dir.py``), the executors, the engine-core client, ``glassbox ps``
and the start-up laggard search all read roles from here.

The ``frontend`` kind is the offline ``LLM``'s process: it owns the engine but is the user's
process, so it is not counted — except in ``inproc`` mode (``GLASSBOX_ENABLE_MULTIPROCESSING=0``),
where the engine core runs inside it: it is then the one process, or the one beside the ``mp``
executor's workers (tensor parallelism).

Multi-node data parallelism (``docs/multi-node.md``): a node's plan has only its own ranks.
The head (``glassbox serve --data-parallel-size-local K0 ...``) plans its API servers, engine
cores 0..K0-1 with their workers and the coordinator; a headless node (``glassbox serve
--headless --data-parallel-start-rank R --data-parallel-size-local K``) plans ``HeadlessNode``
(the launcher: its owner, shown but not counted, like an ``LLM``) and engine cores R..R+K-1
with their workers. ``TopologyPlan.engine_cores`` still lists every rank of the instance
(the ranks a client talks to); ``local_engine_cores`` those with a process on this node.

Torch-free and cheap to import (enum, re, msgspec). vLLM spreads the same knowledge over
``vllm/v1/engine/utils.py`` (``CoreEngineProcManager``: ``EngineCore_DP{k}``),
``vllm/v1/executor/multiproc_executor.py`` (worker names, ``rank = pp * tp_size + tp``) and
``vllm/entrypoints/cli/serve.py`` (``ApiServer_{i}``); Glassbox keeps it in one plan.
"""

from __future__ import annotations

import difflib
import enum
import re
from typing import Any

import msgspec

# The file-name and title conventions belong to the run-directory contract (tracing/).
from tracing.run_dir import STATUS_SUFFIX, TITLE_PREFIX

FRONTEND_NAME = "LLM"
COORDINATOR_NAME = "DPCoordinator"
HEADLESS_NAME = "HeadlessNode"

# Canonical decimal (no leading zeros), so that parse(name).name == name.
_N = r"(0|[1-9][0-9]*)"
_API_SERVER = re.compile(rf"APIServer_{_N}")
_ENGINE_CORE = re.compile(rf"EngineCore_DP{_N}")
_WORKER = re.compile(rf"Worker_DP{_N}_PP{_N}_TP{_N}")


class RoleKind(str, enum.Enum):
    """What a process does. The values are the manifest's ``kind`` strings."""

    API_SERVER = "api_server"
    ENGINE_CORE = "engine_core"
    WORKER = "worker"
    DP_COORDINATOR = "dp_coordinator"
    FRONTEND = "frontend"  # the offline LLM's (the user's) process
    HEADLESS = "headless"  # glassbox serve --headless: the launcher of a node's engine cores


class ProcessRole(msgspec.Struct, frozen=True):
    """One process of the tree: its kind and ranks. Build with the class methods.

    Attributes:
        kind: what the process does.
        dp_rank: the engine (data-parallel rank) of an engine core or worker; else None.
        pp_rank, tp_rank: a worker's pipeline stage and tensor-parallel rank; else None.
        api_index: an API server's index; else None.
    """

    kind: RoleKind
    dp_rank: int | None = None
    pp_rank: int | None = None
    tp_rank: int | None = None
    api_index: int | None = None

    def __post_init__(self) -> None:
        needs = {
            RoleKind.API_SERVER: ("api_index",),
            RoleKind.ENGINE_CORE: ("dp_rank",),
            RoleKind.WORKER: ("dp_rank", "pp_rank", "tp_rank"),
            RoleKind.DP_COORDINATOR: (),
            RoleKind.FRONTEND: (),
            RoleKind.HEADLESS: (),
        }[self.kind]
        for field in ("dp_rank", "pp_rank", "tp_rank", "api_index"):
            value = getattr(self, field)
            if field in needs:
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"a {self.kind.value} role needs {field} >= 0, got {value!r}")
            elif value is not None:
                raise ValueError(f"a {self.kind.value} role has no {field} (got {value!r})")

    # ------------------------------------------------------------------ constructors

    @classmethod
    def api_server(cls, index: int) -> ProcessRole:
        return cls(RoleKind.API_SERVER, api_index=index)

    @classmethod
    def engine_core(cls, dp_rank: int) -> ProcessRole:
        return cls(RoleKind.ENGINE_CORE, dp_rank=dp_rank)

    @classmethod
    def worker(cls, dp_rank: int, pp_rank: int, tp_rank: int) -> ProcessRole:
        return cls(RoleKind.WORKER, dp_rank=dp_rank, pp_rank=pp_rank, tp_rank=tp_rank)

    @classmethod
    def worker_of_rank(cls, dp_rank: int, rank: int, tensor_parallel_size: int) -> ProcessRole:
        """The worker with rank ``rank`` inside engine ``dp_rank`` (inverse of ``worker_rank``)."""
        if tensor_parallel_size < 1 or rank < 0:
            raise ValueError(f"no worker rank {rank} with tensor_parallel_size={tensor_parallel_size}")
        return cls.worker(dp_rank, rank // tensor_parallel_size, rank % tensor_parallel_size)

    @classmethod
    def dp_coordinator(cls) -> ProcessRole:
        return cls(RoleKind.DP_COORDINATOR)

    @classmethod
    def frontend(cls) -> ProcessRole:
        return cls(RoleKind.FRONTEND)

    @classmethod
    def headless(cls) -> ProcessRole:
        """``glassbox serve --headless``'s own process (vLLM: the headless ``vllm serve`` that
        runs ``CoreEngineProcManager``)."""
        return cls(RoleKind.HEADLESS)

    @classmethod
    def parse(cls, name: str) -> ProcessRole:
        """The role named ``name`` (``Worker_DP1_PP0_TP1`` → worker, dp 1, pp 0, tp 1).

        Raises:
            ValueError: ``name`` is not a role name; the message quotes it.
        """
        if isinstance(name, str):
            if m := _WORKER.fullmatch(name):
                return cls.worker(int(m[1]), int(m[2]), int(m[3]))
            if m := _ENGINE_CORE.fullmatch(name):
                return cls.engine_core(int(m[1]))
            if m := _API_SERVER.fullmatch(name):
                return cls.api_server(int(m[1]))
            if name == COORDINATOR_NAME:
                return cls.dp_coordinator()
            if name == FRONTEND_NAME:
                return cls.frontend()
            if name == HEADLESS_NAME:
                return cls.headless()
        raise ValueError(
            f"not a Glassbox process role: {name!r} (expected APIServer_<i>, EngineCore_DP<k>, "
            f"Worker_DP<k>_PP<p>_TP<t>, {COORDINATOR_NAME}, {FRONTEND_NAME} or {HEADLESS_NAME})"
        )

    @classmethod
    def from_title(cls, title: str) -> ProcessRole:
        """The role of a process titled ``glassbox::<name>`` (anything after a space is ignored).

        Raises:
            ValueError: not a Glassbox title, or not a role name.
        """
        name = name_from_title(title)
        if name is None:
            raise ValueError(f"not a Glassbox process title: {title!r}")
        return cls.parse(name)

    # ------------------------------------------------------------------ derived names

    @property
    def name(self) -> str:
        """The role name: ``APIServer_<i>``, ``EngineCore_DP<k>``, ``Worker_DP<k>_PP<p>_TP<t>``, ..."""
        if self.kind is RoleKind.API_SERVER:
            return f"APIServer_{self.api_index}"
        if self.kind is RoleKind.ENGINE_CORE:
            return f"EngineCore_DP{self.dp_rank}"
        if self.kind is RoleKind.WORKER:
            return f"Worker_DP{self.dp_rank}_PP{self.pp_rank}_TP{self.tp_rank}"
        if self.kind is RoleKind.DP_COORDINATOR:
            return COORDINATOR_NAME
        if self.kind is RoleKind.HEADLESS:
            return HEADLESS_NAME
        return FRONTEND_NAME

    @property
    def title(self) -> str:
        """The process title set with setproctitle (``glassbox::EngineCore_DP0``)."""
        return f"{TITLE_PREFIX}{self.name}"

    def log_prefix(self, pid: int) -> str:
        """How each log line of this process starts (``engine/logger.py``): ``(EngineCore_DP0 pid=42)``."""
        return f"({self.name} pid={pid})"

    @property
    def status_file_name(self) -> str:
        """The file in the run directory where this process records its stage."""
        return f"{self.name}{STATUS_SUFFIX}"

    def worker_rank(self, tensor_parallel_size: int) -> int:
        """A worker's rank inside its engine: ``pp_rank * tensor_parallel_size + tp_rank``."""
        if self.kind is not RoleKind.WORKER:
            raise ValueError(f"{self.name} is not a worker, so it has no worker rank")
        if not 0 <= self.tp_rank < tensor_parallel_size:
            raise ValueError(
                f"{self.name}: tp_rank out of range for tensor_parallel_size={tensor_parallel_size}"
            )
        return self.pp_rank * tensor_parallel_size + self.tp_rank

    @property
    def in_engine(self) -> bool:
        """An engine core or one of its workers (the processes start-up waits for)."""
        return self.kind in (RoleKind.ENGINE_CORE, RoleKind.WORKER)

    def __str__(self) -> str:
        return self.name


def name_from_title(title: str | None) -> str | None:
    """The role name in a ``glassbox::<name>`` process title, or None for any other title."""
    if not title or not title.startswith(TITLE_PREFIX):
        return None
    rest = title[len(TITLE_PREFIX) :].split()
    return rest[0] if rest else None


def kind_of(name: str) -> str:
    """The kind string (``worker``) of a role name; ``unknown`` when it is not one."""
    try:
        return ProcessRole.parse(name).kind.value
    except ValueError:
        return "unknown"


class TopologyPlan(msgspec.Struct, frozen=True):
    """Every process of one Glassbox instance, in start-up order.

    Attributes:
        mode: ``serve`` (API servers own the engines), ``mp`` (an offline ``LLM`` owns engine
            processes), ``inproc`` (the engine core in the ``LLM``'s process; workers too, unless
            the executor is ``mp``) or ``headless`` (a node's engine cores under ``HeadlessNode``,
            serving a head's API servers).
        roles: the owner first (the ``LLM``, or the API servers), then each engine core
            followed by its workers (rank order), then the coordinator.
        tensor_parallel_size, pipeline_parallel_size, data_parallel_size: the shape.
        api_server_count: A (0 unless ``serve``).
        workers_in_processes: the ``mp`` or ``ray`` executor (``uni`` runs the worker inside the engine core).
        data_parallel_start_rank, data_parallel_size_local: this node's ranks (multi-node DP;
            0 and ``data_parallel_size`` on one node).
    """

    mode: str
    roles: tuple[ProcessRole, ...]
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    api_server_count: int
    workers_in_processes: bool
    data_parallel_start_rank: int = 0
    data_parallel_size_local: int | None = None

    def kinds_run_by(self, role: ProcessRole) -> frozenset[str]:
        """The process kinds whose code runs in ``role``'s process: its own kind, plus the
        worker's under the ``uni`` executor (in the engine core) and the engine core's (and
        then a ``uni`` worker's) in an ``LLM``'s process in ``inproc`` mode."""
        kinds = {role.kind.value}
        if role.kind is RoleKind.ENGINE_CORE and not self.workers_in_processes:
            kinds.add(RoleKind.WORKER.value)
        if role.kind is RoleKind.FRONTEND and self.mode == "inproc":
            kinds.add(RoleKind.ENGINE_CORE.value)
            if not self.workers_in_processes:
                kinds.add(RoleKind.WORKER.value)
        return frozenset(kinds)

    def roles_entering(self, stage: str) -> tuple[ProcessRole, ...]:
        """The processes of this plan that can enter span ``stage`` (the span catalogue's
        ``entered_by`` kinds, ``tracing/catalogue.py``), in plan order.

        Raises:
            KeyError: ``stage`` is not in the catalogue.
        """
        from tracing import catalogue

        entered_by = set(catalogue.span_def(stage).entered_by)
        return tuple(r for r in self.roles if entered_by & self.kinds_run_by(r))

    def check_fault_targets(self, spec: str | None) -> None:
        """Refuse a fault (``tracing.faults`` spec) whose ``@ROLE`` would never strike, silently:
        no process of this plan (a typo, or a rank the tree does not have), or a process that
        never enters the fault's stage (``engine_core.init:hang@DPCoordinator``).

        Raises:
            ValueError: one line naming the fault, the role, and this plan's processes (with
                the closest name when there is one) or those that do enter the stage.
        """
        from tracing import catalogue
        from tracing.faults import parse_faults

        names = [r.name for r in self.roles]
        for fault in parse_faults(spec or ""):
            if fault.role is None:
                continue
            if fault.role not in names:
                close = difflib.get_close_matches(fault.role, names, n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ValueError(
                    f"fault {fault}: this tree has no process {fault.role} (it has {', '.join(names)}){hint}"
                )
            entering = [r.name for r in self.roles_entering(fault.stage)]
            if fault.role not in entering:
                kinds = catalogue.span_def(fault.stage).entered_by
                who = (
                    f"in this tree only {', '.join(entering)} {'enters' if len(entering) == 1 else 'enter'} it"
                    if entering
                    else f"no process of this tree enters it (only {' or '.join(kinds)} processes do)"
                )
                raise ValueError(
                    f"fault {fault}: {fault.role} never enters {fault.stage}, so it would never strike; {who}"
                )

    @property
    def world_size(self) -> int:
        """Workers per engine: PP × TP."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def is_counted(self, role: ProcessRole) -> bool:
        """Whether ``role`` counts toward the expected process count (the owner ``LLM`` does not,
        except in ``inproc`` mode where it is the whole engine)."""
        if role.kind is RoleKind.HEADLESS:
            return False
        return role.kind is not RoleKind.FRONTEND or self.mode == "inproc"

    @property
    def counted_roles(self) -> tuple[ProcessRole, ...]:
        return tuple(r for r in self.roles if self.is_counted(r))

    @property
    def expected_process_count(self) -> int:
        """A + DP + DP·PP·TP (+1 when DP > 1) in ``serve``; DP + DP·PP·TP (+1) under an ``LLM``;
        DP only with the ``uni`` executor's workers; 1 (+ PP·TP with ``mp``) in ``inproc`` mode."""
        return len(self.counted_roles)

    def of_kind(self, kind: RoleKind) -> tuple[ProcessRole, ...]:
        return tuple(r for r in self.roles if r.kind is kind)

    @property
    def owner(self) -> ProcessRole:
        """The process that creates the run directory: the ``LLM``, ``APIServer_0`` or ``HeadlessNode``."""
        return self.roles[0]

    @property
    def api_servers(self) -> tuple[ProcessRole, ...]:
        return self.of_kind(RoleKind.API_SERVER)

    @property
    def engine_cores(self) -> tuple[ProcessRole, ...]:
        """One per DP rank of the instance, even in ``inproc`` mode (where it runs in the owner's
        process) and with multi-node DP (where some run on other nodes)."""
        return tuple(ProcessRole.engine_core(k) for k in range(self.data_parallel_size))

    @property
    def local_dp_ranks(self) -> range:
        """The DP ranks whose engine cores run on this node."""
        local = self.data_parallel_size_local or self.data_parallel_size
        return range(self.data_parallel_start_rank, self.data_parallel_start_rank + local)

    @property
    def local_engine_cores(self) -> tuple[ProcessRole, ...]:
        """The engine cores with a process on this node (all of them on one node)."""
        return tuple(ProcessRole.engine_core(k) for k in self.local_dp_ranks)

    @property
    def remote_engine_cores(self) -> tuple[ProcessRole, ...]:
        """The engine cores that join from headless nodes (the head's view; none on one node)."""
        if self.mode == "headless":
            return ()
        return tuple(r for r in self.engine_cores if r.dp_rank not in self.local_dp_ranks)

    @property
    def workers(self) -> tuple[ProcessRole, ...]:
        """Every worker process (none with the ``uni`` executor)."""
        return self.of_kind(RoleKind.WORKER)

    def workers_of(self, dp_rank: int) -> tuple[ProcessRole, ...]:
        """Engine ``dp_rank``'s workers in rank order (``pp * tp_size + tp``), whether or not
        they run in their own processes."""
        self._check_dp(dp_rank)
        return tuple(
            ProcessRole.worker_of_rank(dp_rank, r, self.tensor_parallel_size) for r in range(self.world_size)
        )

    def worker(self, dp_rank: int, rank: int) -> ProcessRole:
        """Worker ``rank`` (``pp * tp_size + tp``) of engine ``dp_rank``."""
        self._check_dp(dp_rank)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"no worker rank {rank}: world size is {self.world_size}")
        return ProcessRole.worker_of_rank(dp_rank, rank, self.tensor_parallel_size)

    def worker_rank(self, role: ProcessRole) -> int:
        return role.worker_rank(self.tensor_parallel_size)

    @property
    def coordinator(self) -> ProcessRole | None:
        found = self.of_kind(RoleKind.DP_COORDINATOR)
        return found[0] if found else None

    def engine_processes(self) -> tuple[ProcessRole, ...]:
        """Engine cores and worker processes in plan order (each engine core, then its workers)."""
        return tuple(r for r in self.roles if r.in_engine)

    def role(self, name: str) -> ProcessRole:
        """The planned role named ``name``.

        Raises:
            ValueError: not a role name, or not in this plan.
        """
        role = ProcessRole.parse(name)
        if role not in self.roles:
            raise ValueError(f"{name!r} is not a process of this plan ({self.describe()})")
        return role

    def _check_dp(self, dp_rank: int) -> None:
        if not 0 <= dp_rank < self.data_parallel_size:
            raise ValueError(f"no engine DP{dp_rank}: data_parallel_size is {self.data_parallel_size}")

    def describe(self) -> str:
        """The count as a formula: ``4 API servers + 4 engine cores + 8 workers + 1 coordinator = 17``."""
        parts = []
        for kind, label in ((RoleKind.API_SERVER, "API server"), (RoleKind.ENGINE_CORE, "engine core"),
                            (RoleKind.WORKER, "worker"), (RoleKind.DP_COORDINATOR, "coordinator"),
                            (RoleKind.FRONTEND, "in-process engine"),
                            (RoleKind.HEADLESS, "headless launcher")):  # fmt: skip
            n = sum(1 for r in self.counted_roles if r.kind is kind)
            if n:
                parts.append(f"{n} {label}{'' if n == 1 else 's'}")
        return f"{' + '.join(parts)} = {self.expected_process_count}"

    def manifest_roles(self) -> list[dict[str, Any]]:
        """The manifest's ``roles`` entries: ``role`` (name), ``kind``, and ``rank`` (an engine
        core's DP rank, a worker's rank in its engine)."""
        out: list[dict[str, Any]] = []
        for r in self.roles:
            entry: dict[str, Any] = {"role": r.name}
            if r.kind is RoleKind.ENGINE_CORE:
                entry["rank"] = r.dp_rank
            elif r.kind is RoleKind.WORKER:
                entry["rank"] = self.worker_rank(r)
            entry["kind"] = r.kind.value
            out.append(entry)
        return out


def plan(
    config: Any,
    *,
    frontend: str = "llm",
    multiprocess: bool = True,
    api_server_count: int | None = None,
) -> TopologyPlan:
    """Every process of the instance that ``config`` describes.

    Args:
        config: an ``EngineConfig`` (or anything with a ``parallel_config``), or a
            ``ParallelConfig``-like object: ``tensor_parallel_size``, ``pipeline_parallel_size``,
            ``data_parallel_size``, ``distributed_executor_backend``.
        frontend: ``"serve"`` (API servers), ``"llm"`` (an offline ``LLM`` owns the engine) or
            ``"headless"`` (``glassbox serve --headless``: this node's engine cores only).
            With multi-node DP (``data_parallel_size_local`` below ``data_parallel_size``) only
            this node's ranks (``data_parallel_start_rank`` ..) get engine-core and worker
            processes, and the coordinator runs on the head only.
        multiprocess: False for ``GLASSBOX_ENABLE_MULTIPROCESSING=0`` (an ``LLM`` only): the
            engine core runs inside the ``LLM``'s process; with the ``mp`` executor (tensor
            parallelism) its workers still get processes of their own, as in vLLM.
        api_server_count: A under ``serve``; default: the DP size on this node
            (``data_parallel_size_local``, as vLLM 0.32).

    Raises:
        ValueError: an impossible shape (a size below 1, API servers under an ``LLM``, more
            than one worker without worker processes).
    """
    pc = getattr(config, "parallel_config", config)
    tp, pp, dp = pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.data_parallel_size
    for label, value in (
        ("tensor_parallel_size", tp),
        ("pipeline_parallel_size", pp),
        ("data_parallel_size", dp),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be an integer >= 1, got {value!r}")
    start = getattr(pc, "data_parallel_start_rank", 0) or 0
    local = getattr(pc, "data_parallel_size_local", None) or dp - start
    if not 0 <= start < start + local <= dp:
        raise ValueError(f"ranks {start}..{start + local - 1} are not DP ranks of data_parallel_size {dp}")
    if frontend not in ("serve", "llm", "headless"):
        raise ValueError(f"frontend must be 'serve', 'llm' or 'headless', got {frontend!r}")
    if frontend == "headless":
        if api_server_count:
            raise ValueError("a headless node has no API servers (api_server_count must be 0)")
        api_servers = 0
        owners: tuple[ProcessRole, ...] = (ProcessRole.headless(),)
        mode = "headless"
    elif frontend == "serve":
        if not multiprocess:
            raise ValueError("the API server always runs the engine in its own processes")
        api_servers = local if api_server_count is None else api_server_count
        if not isinstance(api_servers, int) or api_servers < 1:
            raise ValueError(f"api_server_count must be an integer >= 1, got {api_servers!r}")
        owners = tuple(ProcessRole.api_server(i) for i in range(api_servers))
        mode = "serve"
    else:
        if api_server_count:
            raise ValueError("an offline LLM has no API servers (api_server_count must be 0)")
        api_servers = 0
        owners = (ProcessRole.frontend(),)
        mode = "mp" if multiprocess else "inproc"
    backend = getattr(pc, "distributed_executor_backend", None) or ("mp" if multiprocess else "uni")
    # The mp executor spawns its workers; the ray executor's are Ray actors (the raylet's
    # children, on any node of the cluster): processes of their own either way.
    workers_in_processes = backend in ("mp", "ray")
    if not workers_in_processes and tp * pp > 1:
        raise ValueError(
            f"the executor backend 'uni' runs one worker; tensor_parallel_size × "
            f"pipeline_parallel_size = {tp * pp}"
        )
    if not multiprocess and dp > 1:
        raise ValueError(f"GLASSBOX_ENABLE_MULTIPROCESSING=0 runs one engine; data_parallel_size = {dp}")
    roles: list[ProcessRole] = list(owners)
    for k in range(start, start + local):
        if multiprocess:  # else the engine core is the LLM's own process (InprocClient)
            roles.append(ProcessRole.engine_core(k))
        if workers_in_processes:  # mp's or ray's workers, also under an in-process engine
            roles.extend(ProcessRole.worker_of_rank(k, r, tp) for r in range(tp * pp))
    if dp > 1 and mode != "headless":  # the coordinator runs on the head only
        roles.append(ProcessRole.dp_coordinator())
    return TopologyPlan(
        mode=mode,
        roles=tuple(roles),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        data_parallel_size=dp,
        api_server_count=api_servers,
        workers_in_processes=workers_in_processes,
        data_parallel_start_rank=start,
        data_parallel_size_local=local,
    )


__all__ = [
    "COORDINATOR_NAME",
    "FRONTEND_NAME",
    "HEADLESS_NAME",
    "STATUS_SUFFIX",
    "TITLE_PREFIX",
    "ProcessRole",
    "RoleKind",
    "TopologyPlan",
    "kind_of",
    "name_from_title",
    "plan",
]
