"""``RayDistributedExecutor``: one Ray actor per worker (``--distributed-executor-backend ray``).

Mirrors vLLM's ``vllm/v1/executor/ray_distributed_executor.py`` (actors built from
``vllm/executor/ray_utils.py``'s ``RayWorkerWrapper``)::

    engine core ──execute_method.remote(WorkerRPC)──▶ RayWorkerWrapper actor, rank 0..N-1
                ◀──ObjectRef → WorkerReply ─────────┘ (one per actor, Ray's object store)
    engine core ──lifeline.remote()──▶ every actor: a call that returns only at shutdown, so
                                       Ray fails its ObjectRef when the actor dies

Where ``MultiprocExecutor`` spawns the worker processes itself and feeds them through a
shared-memory broadcast queue, here Ray does the placing, the starting and the transport;
the worker side is the same: a ``WorkerWrapperBase`` that builds the ``Worker`` on
``init_worker``, driven by the same ``WorkerRPC`` / ``WorkerReply`` messages
(``engine/executor/messages.py``) and the same ``run_worker_rpc``, so the lifecycle RPCs
(``_start_workers``), the stage spans and the status files are those of the mp workers, and
each call carries its caller's W3C trace context into the actor.

Ray: the engine core joins the Ray instance already running in its process
(``ray.is_initialized()``) or the cluster named by ``RAY_ADDRESS``; otherwise it starts a
private one (``ray.init``: one logical CPU per worker, no dashboard UI, a short temporary
directory under /tmp for Ray's Unix sockets) and stops it at shutdown. The workers get a
placement group with one bundle per worker (one CPU each, or one GPU each on CUDA), packed
onto as few nodes as fit, as vLLM does.

Failure: Ray tells us. A dead actor fails its lifeline ``ObjectRef`` (and any call in flight)
with ``ActorDiedError``, whose message is Ray's death cause; a monitor thread waits on the
lifelines, so a death is noticed within ``DEATH_CHECK_S`` also when the engine is idle, and
becomes an ``EngineDeadError`` whose root-cause block names the worker and quotes Ray. An
actor's process is the raylet's child, with no pidfd here: the ``Supervisor``
(``engine/utils/supervisor.py``) watches nothing, it only keeps the first failure, by the
blame rule, and hands it to the engine core's failure callback, as for the other executors.

Each actor holds its ``glassbox::Worker_DP<k>_PP<p>_TP<t>`` title (Ray would retitle it
``ray::<class>.<method>`` on every call), writes its status file and crash report in the run
directory like any worker process, and answers ``placement()`` with its node, pid and
actor id.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine import envs
from engine.distributed import topology
from engine.distributed.topology import ProcessRole
from engine.executor import messages
from engine.executor.abstract import Executor
from engine.executor.messages import WorkerReady, WorkerReply, WorkerRPC
from engine.executor.multiproc_executor import run_worker_rpc
from engine.logger import init_logger
from engine.utils import processes
from engine.utils.process_harness import Observability, ProcessSpec, report_crash, start_observability
from engine.utils.processes import EngineDeadError
from engine.utils.supervisor import Supervisor
from engine.utils.wire import ProtocolError
from tracing import catalogue, stage
from tracing.propagation import attached_trace_context, inject_trace_headers
from tracing.stage import set_placement

logger = init_logger(__name__)

# How often waits look up to check the actors are alive (seconds), as the mp executor does.
DEATH_CHECK_S = 0.5
# Seconds shutdown gives the actors to leave their process group before they are killed.
ACTOR_SHUTDOWN_GRACE_S = 2.0
# Seconds a worker that reported a failure waits for a peer's death to be reported: under
# tensor parallelism a killed peer makes the survivors' collective fail first.
PEER_DEATH_GRACE_S = 1.0
# The environment an actor gets from the engine core (Ray starts actor processes from the
# raylet's environment, not ours: vLLM copies its VLLM_* variables the same way).
FORWARDED_ENV_PREFIXES = ("GLASSBOX_", "OMP_", "GOMP_", "KMP_", "OTEL_")
# Concurrency group of the lifeline call, so it waits beside the worker's own calls.
LIFELINE_GROUP = "lifeline"


def ray_death_cause(error: BaseException) -> str:
    """Ray's death cause out of an ``ActorDiedError`` (``RayActorError``): the sentences
    after the header lines (class name, actor id, pid, namespace, ip), on one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    header = ("class_name:", "actor_id:", "pid:", "namespace:", "ip:", "name:")
    cause = [line for line in lines[1:] if not line.startswith(header)]
    return " ".join(cause) or (lines[0] if lines else type(error).__name__)


def _hold_process_title(role: str) -> None:
    """Title this actor's process ``glassbox::<role>`` and keep it so.

    Ray retitles a worker process ``ray::<class>.<method>`` around every call (with its own
    copy of setproctitle, which the ``setproctitle`` package cannot override in a Ray
    worker), so the title is set through Ray's function and Ray's later calls are made to
    set the same title. The title comes from the topology plan (``ProcessRole.title``).

    Raises:
        ValueError: ``role`` is not a role name.
    """
    import ray._raylet as raylet

    title = ProcessRole.parse(role).title
    set_title = getattr(raylet, "_glassbox_setproctitle", raylet.setproctitle)
    raylet._glassbox_setproctitle = set_title
    raylet.setproctitle = lambda _title: set_title(title)
    set_title(title)


class RayWorkerWrapper:
    """The Ray actor of one worker: a ``WorkerWrapperBase`` behind ``execute_method``.

    vLLM: ``RayWorkerWrapper`` (``vllm/executor/ray_utils.py``). Built by
    ``RayDistributedExecutor`` with ``ray.remote(...)`` and a placement-group bundle of its
    own. The constructor is cheap, like ``WorkerProc``'s: title, log role, tracing (with
    this role's status file), stack dumps and telemetry, then the wrapper; the ``Worker``
    itself is built by the ``init_worker`` RPC.

    Args:
        config_pickle: the pickled ``EngineConfig``.
        rank: the worker's rank in its engine (``pp · tp_size + tp``).
        role: its role name, from the topology plan (``Worker_DP0_PP0_TP1``).
        run_dir: the run directory (status file, crash report, stacks).
        trace_headers: the spawning span's W3C context: the wrapper's start-up stage is its child.
    """

    def __init__(
        self, config_pickle: bytes, rank: int, role: str, run_dir: str, trace_headers: dict[str, str] | None
    ) -> None:
        from engine.logger import set_process_role
        from engine.worker.worker_base import WorkerWrapperBase

        _hold_process_title(role)
        set_process_role(role)
        self.role, self.rank, self.run_dir = role, rank, Path(run_dir)
        self._released = threading.Event()
        self.wrapper: Any = None
        config = pickle.loads(config_pickle)
        self.config = config
        obs = config.observability_config
        # Ray starts and stops this process: the harness gives it tracing, stack dumps and
        # telemetry, and its crash report; SIGTERM and the exit status stay Ray's.
        spec = ProcessSpec(role, self.run_dir, rank=rank, observability=Observability.of(obs))
        _, publisher = start_observability(spec)
        # Node and actor id into the status file: glassbox ps, engine-top and doctor show them.
        where = self.placement()
        set_placement({k: where[k] for k in ("node_id", "node_ip", "actor_id")})
        # --collect-detailed-traces worker|all: a worker.execute_model span per step.
        self._worker_spans = obs.collect_worker_traces
        try:
            with attached_trace_context(trace_headers):
                self.wrapper = WorkerWrapperBase(config, rpc_rank=rank)
        except BaseException as e:
            report_crash(spec, e)
            raise
        if publisher is not None:  # the Worker itself is built later, by init_worker
            publisher.add_gauge_provider(
                lambda: self.wrapper.worker.telemetry_gauges() if self.wrapper.worker else {}
            )

    def __repr__(self) -> str:
        # Ray prefixes the actor's log lines with this: "(Worker_DP0_PP0_TP1 pid=123)".
        return self.role

    def ready(self) -> bytes:
        """A ``WorkerReady`` (encoded), as a worker process sends at start-up."""
        mc, dc = self.config.model_config, self.config.device_config
        return messages.encode(WorkerReady(role=self.role, rank=self.rank, pid=os.getpid(),
                                           device=str(dc.device), dtype=str(mc.dtype)))  # fmt: skip

    def placement(self) -> dict[str, Any]:
        """Where Ray placed this actor: ``node_id``, ``node_ip``, ``actor_id``, ``pid``,
        and ``gpu_ids`` (Ray's accelerator ids for it; empty on CPU)."""
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "actor_id": ctx.get_actor_id(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def distributed_init_method(self) -> str:
        """``tcp://<this node's ip>:<a port free on it now>``: where the TP/PP group meets
        (asked of rank 0, which hosts the store)."""
        from engine.distributed.parallel_state import get_distributed_init_method

        return get_distributed_init_method(ray.util.get_node_ip_address())

    def execute_method(self, message: bytes) -> bytes:
        """Run one encoded ``WorkerRPC``; the encoded ``WorkerReply`` (``b""`` when another
        rank answers it). A failed call has written this worker's crash report."""
        rpc_msg = messages.decode_rpc(message)
        reply = run_worker_rpc(self.wrapper, rpc_msg, self.rank, run_dir=self.run_dir, role=self.role,
                               worker_spans=self._worker_spans)  # fmt: skip
        if rpc_msg.output_rank is None or rpc_msg.output_rank == self.rank or not reply.ok:
            return messages.encode(reply)
        return b""

    @ray.method(concurrency_group=LIFELINE_GROUP)
    def lifeline(self) -> None:
        """Return only once ``release`` is called: until then the engine core's ObjectRef for
        this call is pending, and Ray fails it with ``ActorDiedError`` if the actor dies."""
        self._released.wait()

    def release(self) -> None:
        """Orderly shutdown: leave the TP/PP process group, then end the lifeline call."""
        try:
            worker = getattr(self.wrapper, "worker", None)
            if worker is not None:
                worker.shutdown()
        finally:
            self._released.set()


class RayDistributedExecutor(Executor):
    """Workers as Ray actors (``--distributed-executor-backend ray``).

    Raises:
        ConfigError: Ray is not installed (``pip install -e ".[ray]"`` in the checkout).
        EngineDeadError: an actor died (root cause names the worker and quotes Ray's death
            cause), or a worker failed in an RPC (its crash report).
        TimeoutError: the placement group was not placed, or a worker did not answer, within
            its deadline (``GLASSBOX_ENGINE_READY_TIMEOUT_S`` at start-up,
            ``GLASSBOX_EXECUTE_MODEL_TIMEOUT_S`` per call).
        RuntimeError: a worker raised a ``ValueError`` in an RPC (message names it).
    """

    def _init_executor(self) -> None:
        if self.run_dir is None:
            raise ValueError("RayDistributedExecutor needs the run directory")
        pc = self.config.parallel_config
        self.world_size = pc.world_size
        plan = topology.plan(self.config)
        engine_role = plan.engine_cores[pc.data_parallel_rank]
        self.roles = [w.name for w in plan.workers_of(engine_role.dp_rank)]
        self.supervisor = Supervisor(self.run_dir, self._on_failure)
        self._shutting_down = False
        self.actors: list[Any] = []
        self.placements: list[dict[str, Any]] = []
        self._lifelines: list[Any] = []
        self.placement_group: PlacementGroup | None = None
        self._started_ray = False
        self._ray_temp_dir: str | None = None
        with stage(catalogue.EXECUTOR_INIT):
            self._connect_ray()
            deadline = time.monotonic() + envs.GLASSBOX_ENGINE_READY_TIMEOUT_S
            use_gpu = self._uses_gpu()
            bundle = {"GPU": 1.0} if use_gpu else {"CPU": 1.0}
            self.placement_group = placement_group(
                [dict(bundle) for _ in range(self.world_size)], strategy="PACK",
                name=f"glassbox_{engine_role.name}_{os.getpid()}",
            )  # fmt: skip
            try:
                ray.get(self.placement_group.ready(), timeout=max(deadline - time.monotonic(), 0.001))
            except GetTimeoutError:
                raise TimeoutError(
                    f"Ray did not place {self.world_size} bundle(s) of {bundle} for {engine_role.name}'s workers "
                    f"within {envs.GLASSBOX_ENGINE_READY_TIMEOUT_S:g} s (GLASSBOX_ENGINE_READY_TIMEOUT_S); "
                    f"the cluster has {ray.available_resources()} available"
                ) from None
            actor_class = ray.remote(concurrency_groups={LIFELINE_GROUP: 1})(RayWorkerWrapper)
            config_pickle = pickle.dumps(self.config, protocol=5)
            trace_headers = inject_trace_headers() or None
            env = self._actor_env()
            for rank, role in enumerate(self.roles):
                with stage(catalogue.PROCESS_SPAWN, **{catalogue.ATTR_ROLE: role}):
                    self.actors.append(
                        actor_class.options(
                            num_cpus=0 if use_gpu else 1.0,
                            num_gpus=1.0 if use_gpu else 0,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(
                                self.placement_group, placement_group_bundle_index=rank
                            ),
                            runtime_env={"env_vars": env},
                        ).remote(config_pickle, rank, role, str(self.run_dir), trace_headers)
                    )
            self.placements = self._get([a.placement.remote() for a in self.actors], deadline, "start-up")
            for rank, data in enumerate(
                self._get([a.ready.remote() for a in self.actors], deadline, "start-up")
            ):
                ready = messages.decode_response(data)
                if not isinstance(ready, WorkerReady) or ready.rank != rank:
                    raise ProtocolError(
                        f"{self.roles[rank]} sent {ready!r} at start-up where WorkerReady for rank {rank} was due"
                    )
            for rank, where in enumerate(self.placements):
                logger.info("%s is Ray actor %s, pid %s on node %s (%s)", self.roles[rank], where["actor_id"],
                            where["pid"], where["node_ip"], where["node_id"][:12])  # fmt: skip
            self._lifelines = [a.lifeline.remote() for a in self.actors]
            self._monitor = threading.Thread(target=self._monitor_actors, name="RayActorMonitor", daemon=True)
            self._monitor.start()
            init_method = None
            if self.world_size > 1:
                # Rank 0 hosts the rendezvous store: a port free on its node (any node).
                (init_method,) = self._get(
                    [self.actors[0].distributed_init_method.remote()], deadline, "start-up"
                )
            self._start_workers(
                [
                    {
                        "local_rank": self._local_rank(rank),
                        "rank": rank,
                        "distributed_init_method": init_method,
                        "is_driver_worker": rank % pc.tensor_parallel_size == 0,  # TP rank 0 of its stage
                    }
                    for rank in range(self.world_size)
                ]
            )

    # ------------------------------------------------------------------ Ray itself

    def _connect_ray(self) -> None:
        """Join this process's Ray instance or ``RAY_ADDRESS``'s cluster, else start one.

        ``ray.init`` replaces the process's SIGTERM handler with its own (``sys.exit``); the
        engine core's is put back, so a stop asked by its parent stays a clean stop.
        """
        if ray.is_initialized():
            return
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGTERM) if in_main else None
        try:
            if os.environ.get("RAY_ADDRESS"):
                logger.info("joining the Ray cluster at RAY_ADDRESS=%s", os.environ["RAY_ADDRESS"])
                ray.init(configure_logging=False)
            else:
                # Unix socket paths inside it must stay under 108 characters: a short base.
                self._ray_temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
                os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
                ray.init(num_cpus=self.world_size, include_dashboard=False, _temp_dir=self._ray_temp_dir,
                         configure_logging=False)  # fmt: skip
                self._started_ray = True
                logger.info("started a local Ray instance (%d CPUs, temp dir %s)", self.world_size,
                            self._ray_temp_dir)  # fmt: skip
        finally:
            if in_main and previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _uses_gpu(self) -> bool:
        """GPU bundles for ``--device cuda``, and for ``auto`` when the cluster has GPUs."""
        device = self.config.device_config.device
        return device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)

    def _actor_env(self) -> dict[str, str]:
        """Environment for every actor: the engine core's GLASSBOX_* (and OpenMP, OTel)
        variables, the OpenMP wait defaults the mp workers get, the spawning span as
        TRACEPARENT, and this checkout on PYTHONPATH (a worker must import this ``engine``)."""
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
        env.update(processes.openmp_wait_env(dict(os.environ)))
        for name, value in inject_trace_headers().items():
            env[name.upper()] = value
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        return env

    def _local_rank(self, rank: int) -> int:
        """The worker's device index on its node. On GPU Ray shows each actor only its own
        GPU (``CUDA_VISIBLE_DEVICES``), so it is 0; on CPU, its index among the engine's
        workers on the same node."""
        if self.placements[rank]["gpu_ids"]:
            return 0
        node = self.placements[rank]["node_id"]
        return sum(1 for r in range(rank) if self.placements[r]["node_id"] == node)

    # ------------------------------------------------------------------ RPC

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        unique_reply_rank: int | None = None,
    ) -> list[Any]:
        """Run ``method(*args, **kwargs)`` on every actor; results in rank order (only
        ``unique_reply_rank``'s when given). Every actor's call is awaited, so a failure of
        a rank that does not answer is still seen."""
        self._raise_if_failed()
        deadline = time.monotonic() + (timeout or envs.GLASSBOX_EXECUTE_MODEL_TIMEOUT_S)
        # The RPC carries the caller's span: the worker's span for it is that span's child.
        rpc = WorkerRPC.make(method, args, kwargs, unique_reply_rank, inject_trace_headers() or None)
        message = messages.encode(rpc)
        with stage(catalogue.EXECUTOR_BROADCAST):
            message_ref = ray.put(message) if len(message) > 100_000 else message
            refs = [actor.execute_method.remote(message_ref) for actor in self.actors]
        answers = self._get(refs, deadline, method)
        ranks = range(self.world_size) if unique_reply_rank is None else [unique_reply_rank]
        replies: dict[int, WorkerReply] = {}
        for rank, data in enumerate(answers):
            if not data:
                continue
            reply = messages.decode_response(data)
            if not isinstance(reply, WorkerReply) or reply.rank != rank or reply.method != method:
                raise ProtocolError(
                    f"{self.roles[rank]} sent {type(reply).__name__} "
                    f"({getattr(reply, 'method', '?')!r} from rank {getattr(reply, 'rank', '?')}) where the "
                    f"reply to {method!r} from rank {rank} was due"
                )
            if not reply.ok:
                self._raise_worker_error(rank, method, reply)
            replies[rank] = reply
        results = []
        for rank in ranks:
            if rank not in replies:
                raise ProtocolError(f"{self.roles[rank]} sent no reply to {method!r}")
            results.append(replies[rank].result())
        return results

    def _get(self, refs: list[Any], deadline: float, what: str) -> list[Any]:
        """The values of ``refs`` (one per rank, in rank order), waiting until ``deadline``.

        Looks up every ``DEATH_CHECK_S`` for a death the monitor found; an actor that died
        during the call fails it with Ray's cause.

        Raises:
            EngineDeadError: an actor died.
            TimeoutError: ``deadline`` passed; names the first rank that did not answer.
        """
        pending = {ref: rank for rank, ref in enumerate(refs)}
        values: list[Any] = [None] * len(refs)
        while pending:
            self._raise_if_failed()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                rank = min(pending.values())
                raise TimeoutError(
                    f"{self.roles[rank]} (Ray actor {self._where(rank)}) did not answer {what} within its "
                    f"deadline; {self._describe_reader(rank)}"
                )
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(DEATH_CHECK_S, remaining))
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    values[rank] = ray.get(ref)
                except RayActorError as e:
                    self._fail(rank, e)
        return values

    def _raise_worker_error(self, rank: int, method: str, reply: WorkerReply) -> None:
        """A worker's error reply → the caller's error (``Executor._raise_for_worker_error``),
        else an ``EngineDeadError`` naming the worker (a peer's death first, if Ray reports one)."""
        self._raise_for_worker_error(rank, method, reply)
        self._fail(rank, None)

    # ------------------------------------------------------------------ liveness

    def _where(self, rank: int) -> str:
        where = self.placements[rank] if rank < len(self.placements) else {}
        if not where:
            return "not placed yet"
        return f"{where['actor_id']}, pid {where['pid']} on {where['node_ip']}"

    def _blame_dead_peer(self, rank: int) -> None:
        """Tensor parallelism: a killed peer makes the survivors' next collective fail, and
        their error may come back before Ray reports the death. Wait briefly for a death
        and, if there is one, fail with it as the root cause."""
        if self.world_size == 1 or not self._lifelines:
            return
        others = [ref for r, ref in enumerate(self._lifelines) if r != rank]
        ready, _ = ray.wait(others, num_returns=1, timeout=PEER_DEATH_GRACE_S)
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as e:
                self._fail(self._lifelines.index(ref), e)

    def _fail(self, rank: int, error: BaseException | None) -> None:
        """Fail the executor (once) with a root cause naming worker ``rank``: Ray's death
        cause when ``error`` is Ray's, else the worker's crash report. Calls the failure
        callback, then raises the ``EngineDeadError``."""
        if self.failure is None:  # else: raise the first failure
            role = self.roles[rank]
            where = self.placements[rank] if rank < len(self.placements) else {}
            if isinstance(error, RayActorError):
                cause = ray_death_cause(error)
                exit_detail = (
                    f"the Ray actor died (actor {getattr(error, 'actor_id', None) or where.get('actor_id')})"
                )
                note = f"Ray: {cause}"
            else:
                exit_detail = (
                    f"the Ray actor reported a failure (actor {where.get('actor_id')}; stopped at shutdown)"
                )
                note = ""
            # Logs it, tells engine-top how the actor ended (only the executor knows), and
            # calls the failure callback.
            self.supervisor.fail(role, where.get("pid"), None, rank=rank, note=note, exit_detail=exit_detail)
        self._raise_if_failed()

    def _monitor_actors(self) -> None:
        """Notice a dead actor while the engine is idle, within ``DEATH_CHECK_S``: Ray fails
        its pending lifeline call."""
        while not self._shutting_down and self.failure is None:
            ready, _ = ray.wait(self._lifelines, num_returns=1, timeout=DEATH_CHECK_S)
            if not ready or self._shutting_down:
                continue
            rank = self._lifelines.index(ready[0])
            try:
                ray.get(ready[0])
            except RayActorError as e:
                if not self._shutting_down:
                    try:
                        self._fail(rank, e)
                    except EngineDeadError:
                        return
            return  # a lifeline returned (release): the executor is shutting down

    def check_health(self) -> None:
        self._raise_if_failed()

    def shutdown(self) -> None:
        """Release every actor (it leaves its process group), kill it, remove the placement
        group, and stop Ray if this executor started it."""
        self._shutting_down = True
        if self.supervisor is not None:
            self.supervisor.close()
        actors = getattr(self, "actors", [])
        if actors and getattr(self, "failure", None) is None:
            try:
                ray.get([a.release.remote() for a in actors], timeout=ACTOR_SHUTDOWN_GRACE_S)
            except Exception as e:  # a stuck or dead actor: it is killed below
                logger.debug("not every Ray actor released in time: %s", e)
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        monitor = getattr(self, "_monitor", None)
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(DEATH_CHECK_S * 2)
        pg = getattr(self, "placement_group", None)
        if pg is not None:
            try:
                remove_placement_group(pg)
            except Exception:  # Ray already stopped
                pass
        if getattr(self, "_started_ray", False):
            ray.shutdown()
            self._started_ray = False
        temp = getattr(self, "_ray_temp_dir", None)
        if temp is not None and not ray.is_initialized():
            shutil.rmtree(temp, ignore_errors=True)
            self._ray_temp_dir = None
