"""``MultiprocExecutor``: one process per worker, fed through a shared-memory broadcast queue.

Mirrors vLLM's ``vllm/v1/executor/multiproc_executor.py``::

    engine core ──enqueue──▶ [rpc broadcast MessageQueue: 1 writer, N readers] ──▶ Worker_DP0_PP0_TP{0..N-1}
    engine core ◀─dequeue── [one response MessageQueue per worker: 1 writer, 1 reader] ◀──┘

``collective_rpc(method, args)`` encodes one ``WorkerRPC`` (with the caller's trace context)
and broadcasts it; every worker runs it and (if it is asked to answer) replies with a
``WorkerReply`` on its own response queue. The messages are in ``engine/executor/messages.py``. ``execute_model`` is the same call with only the output rank answering (TP rank 0 of the last pipeline stage).

Liveness is the ``Supervisor``'s (``engine/utils/supervisor.py``; vLLM's
``start_worker_monitor``, a thread waiting on the workers' sentinels): it waits on every
worker's pidfd, so a death is seen at once, also while the engine is idle, and a worker
stopped or frozen past its deadline too; the first failure becomes one ``EngineDeadError``
whose root cause the blame rule names (a peer killed first, not the survivors whose
collective then broke), handed to the engine core's failure callback. Every wait here is
bounded and is cancelled by that failure (the supervisor's ``failed`` event).

The queues are files in the run directory, so removing the run directory removes them.
"""

from __future__ import annotations

import functools
import os
import pickle
import time
from pathlib import Path
from typing import Any

from engine import envs
from engine.distributed import topology
from engine.distributed.topology import ProcessRole
from engine.executor import messages
from engine.executor.abstract import Executor
from engine.executor.messages import WorkerReady, WorkerReply, WorkerRPC, WorkerSpawnPayload
from engine.executor.shm_broadcast import MessageQueue, MessageQueueClosed, MessageQueueTimeout
from engine.logger import init_logger
from engine.utils import processes
from engine.utils import run_dir as run_dirs
from engine.utils.process_harness import Observability, ProcessContext, ProcessSpec, run_process
from engine.utils.processes import ChildProcess
from engine.utils.supervisor import Supervisor
from engine.utils.wire import ProtocolError
from engine.worker.step_telemetry import observed_rpc
from tracing import WaitCancelled, catalogue, current_stage, stacks, stage
from tracing import run_dir as contract
from tracing.propagation import attached_trace_context, inject_trace_headers
from tracing.telemetry import events

logger = init_logger(__name__)

WORKER_EXIT_GRACE_S = 2.0  # s a worker that reported a failure gets to exit before it is named
HUNG_STACK_TIMEOUT_S = 2.0  # s to wait for a stack dump of a worker that missed its deadline
# An idle worker waits for the next RPC this long (s) at a time: a short poll, which engine-top
# and doctor know not to show as a wait (shorter than tracing's IDLE_POLL_WAIT_S).
IDLE_POLL_S = 1.0


def worker_role(dp_rank: int, pp_rank: int, tp_rank: int) -> str:
    """A worker's role name; the names are made in ``engine/distributed/topology.py``."""
    return ProcessRole.worker(dp_rank, pp_rank, tp_rank).name


class MultiprocExecutor(Executor):
    """Workers in their own processes (``--distributed-executor-backend mp``).

    Raises:
        EngineDeadError: a worker died (root cause names it).
        TimeoutError: a worker did not answer within ``GLASSBOX_EXECUTE_MODEL_TIMEOUT_S``.
        RuntimeError: a worker raised; the message carries its traceback.
    """

    def _init_executor(self) -> None:
        if self.run_dir is None:
            raise ValueError("MultiprocExecutor needs the run directory")
        run_dir = Path(self.run_dir)
        pc = self.config.parallel_config
        self.world_size = pc.world_size
        # The worker that returns each step's output: TP rank 0 of the last stage (rank 0 without PP).
        self.output_rank = self.world_size - pc.tensor_parallel_size
        # This engine and its workers in rank order (pp * tp_size + tp), from the topology
        # plan. Under data parallelism each EngineCore_DP<k> has its own workers and its own
        # queues in the shared run directory (names prefixed dp<k>_), and its TP/PP group
        # meets on a port of its own.
        plan = topology.plan(self.config)
        engine_role = plan.engine_cores[pc.data_parallel_rank]
        prefix = f"dp{engine_role.dp_rank}_"
        self.roles = [w.name for w in plan.workers_of(engine_role.dp_rank)]
        self.supervisor = Supervisor(run_dir, self._on_failure, name="MultiprocWorkerMonitor")
        self.workers: list[ChildProcess] = []
        with stage(catalogue.EXECUTOR_INIT):
            handle = MessageQueue.create(run_dir, f"{prefix}rpc", self.world_size, reader_names=self.roles,
                                         writer_name=engine_role.name)  # fmt: skip
            self.rpc_broadcast_mq = MessageQueue.open_writer(handle, describe_reader=self._describe_reader)
            response_handles = [
                MessageQueue.create(run_dir, f"{prefix}r{rank}", 1, reader_names=[engine_role.name])
                for rank in range(self.world_size)
            ]
            trace_headers = inject_trace_headers()
            config_pickle = pickle.dumps(self.config, protocol=5)
            for rank, role in enumerate(self.roles):
                payload = messages.encode(
                    WorkerSpawnPayload(
                        config_pickle=config_pickle,
                        rank=rank,
                        local_rank=rank,
                        rpc_handle=handle,
                        response_handle=response_handles[rank],
                        trace_headers=trace_headers,
                    )
                )
                self.workers.append(
                    processes.spawn_process(
                        role, "engine.executor.multiproc_executor:WorkerProc.worker_main", payload, run_dir
                    )
                )
                self.supervisor.watch(self.workers[-1], rank=rank)
            self.response_mqs = [MessageQueue.open_reader(h, 0) for h in response_handles]
            deadline = time.monotonic() + envs.GLASSBOX_ENGINE_READY_TIMEOUT_S
            for rank in range(self.world_size):
                ready = self._receive(rank, deadline, "start-up")
                if not isinstance(ready, WorkerReady) or ready.rank != rank:
                    raise ProtocolError(
                        f"{self.roles[rank]} sent {ready!r} at start-up where WorkerReady for rank {rank} was due"
                    )
            # Tensor parallelism: the workers meet on a TCP port free right now (none hard-coded).
            init_method = None
            if self.world_size > 1:
                from engine.distributed.parallel_state import get_distributed_init_method

                init_method = get_distributed_init_method("127.0.0.1")
            self._start_workers(
                [
                    {
                        "local_rank": r,
                        "rank": r,
                        "distributed_init_method": init_method,
                        "is_driver_worker": r % pc.tensor_parallel_size == 0,  # TP rank 0 of its stage
                    }
                    for r in range(self.world_size)
                ]
            )

    # ------------------------------------------------------------------ RPC

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        unique_reply_rank: int | None = None,
    ) -> list[Any]:
        """Broadcast ``method(*args, **kwargs)`` to every worker; results in rank order
        (only ``unique_reply_rank``'s when given)."""
        self.supervisor.raise_if_failed()
        deadline = time.monotonic() + (timeout or envs.GLASSBOX_EXECUTE_MODEL_TIMEOUT_S)
        # The RPC carries the caller's span: the worker's span for it is that span's child.
        rpc = WorkerRPC.make(method, args, kwargs, unique_reply_rank, inject_trace_headers() or None)
        message = messages.encode(rpc)
        try:
            with stage(catalogue.EXECUTOR_BROADCAST):
                self.rpc_broadcast_mq.enqueue(message, timeout=max(deadline - time.monotonic(), 0.001))
        except MessageQueueTimeout as e:
            self._broadcast_timed_out(method, e)
        ranks = range(self.world_size) if unique_reply_rank is None else [unique_reply_rank]
        return [self._result(rank, method, deadline) for rank in ranks]

    def _broadcast_timed_out(self, method: str, error: MessageQueueTimeout) -> None:
        """The broadcast of ``method`` found no free slot by its deadline: the workers' failure
        if there was one (``EngineDeadError``: a dead worker reads nothing), else a
        ``TimeoutError`` naming the readers that lag."""
        self.supervisor.raise_if_failed()
        raise TimeoutError(f"{method}: {error}") from None

    def _result(self, rank: int, method: str, deadline: float) -> Any:
        """Worker ``rank``'s result of ``method`` (its reply, received by ``deadline``).

        Raises:
            ProtocolError: the worker sent something else.
            ConfigError, ValueError, EngineDeadError: it answered with an error
                (``_fail_for_error_reply``).
        """
        reply = self._receive(rank, deadline, method)
        if not isinstance(reply, WorkerReply) or (reply.rank, reply.method) != (rank, method):
            raise self._unexpected_reply(rank, method, reply)
        if not reply.ok:
            self._fail_for_error_reply(rank, method, reply)
        return reply.result()

    def _unexpected_reply(self, rank: int, method: str, reply: WorkerReady | WorkerReply) -> ProtocolError:
        """The error for a message from worker ``rank`` that is not its reply to ``method``."""
        return ProtocolError(
            f"{self.roles[rank]} sent {type(reply).__name__} "
            f"({getattr(reply, 'method', '?')!r} from rank {getattr(reply, 'rank', '?')}) where the "
            f"reply to {method!r} from rank {rank} was due"
        )

    def _fail_for_error_reply(self, rank: int, method: str, reply: WorkerReply) -> None:
        """Worker ``rank`` answered ``method`` with an error: raise it as the caller's (a
        ``ConfigError``, a ``ValueError``), or fail the engine naming the worker.

        Raises:
            ConfigError, ValueError, ProtocolError: see ``_raise_for_worker_error``.
            EngineDeadError: otherwise.
        """
        self._raise_for_worker_error(rank, method, reply)
        # The worker wrote its crash report and exits: the root cause names it (its pid,
        # stage, exception), not this engine core that only relayed the failure.
        self._fail_once_exited(rank, WORKER_EXIT_GRACE_S, code_if_running=None)

    def execute_model(self, scheduler_output):
        # The last pipeline stage samples: its TP rank 0 answers (vLLM: output_rank).
        return self.collective_rpc(
            "execute_model", args=(scheduler_output,), unique_reply_rank=self.output_rank
        )[0]

    def _receive(self, rank: int, deadline: float, what: str) -> WorkerReady | WorkerReply:
        """One message from worker ``rank``: one bounded dequeue, named ``"<what> from
        <worker>"`` (engine-top's "waiting for"), cancelled by the supervisor's first failure.

        Raises:
            TimeoutError: nothing came by ``deadline``; the message names the worker and its stage.
            EngineDeadError: the worker (or a peer) died meanwhile, or closed its queue (it is exiting).
        """
        try:
            data = self.response_mqs[rank].dequeue(
                timeout=max(deadline - time.monotonic(), 0.001),
                cancel=self.supervisor.failed,
                what=f"{what} from {self.roles[rank]}",
            )
        except (WaitCancelled, MessageQueueTimeout, MessageQueueClosed) as e:
            self._receive_failed(rank, what, e)
        return messages.decode_response(data)

    def _receive_failed(self, rank: int, what: str, error: Exception) -> None:
        """``_receive``'s dequeue from worker ``rank`` ended with ``error``; raise what it means.

        Raises:
            EngineDeadError: cancelled by the supervisor's failure, or the worker closed its
                queue (it is exiting: blamed with its exit status).
            TimeoutError: the deadline passed (``_hung_error``).
        """
        if isinstance(error, WaitCancelled):
            raise self.failure from None
        if isinstance(error, MessageQueueTimeout):
            raise self._hung_error(rank, what) from None
        self._fail_once_exited(rank, 2.0, code_if_running=0)

    # ------------------------------------------------------------------ liveness

    def _hung_error(self, rank: int, what: str) -> TimeoutError:
        """The error for worker ``rank`` not answering ``what`` by its deadline, with why it may
        not: its stage, an injected fault that struck it, and the line its main thread waits
        at (a stack dump on SIGUSR1, ``tracing.stacks``)."""
        role = self.roles[rank]
        parts = [self._describe_reader(rank)]
        status = contract.read_status(run_dirs.status_file(Path(self.run_dir), role))
        for fault in status.faults if status is not None else ():
            parts.append(f"an injected fault struck it: {fault.spec} in {fault.stage}")
        proc = self.workers[rank]
        if proc.poll() is None:
            dump = stacks.request_dump(self.run_dir, role, proc.pid, timeout_s=HUNG_STACK_TIMEOUT_S)
            main = next((t for t in dump.threads if t.main), None)
            where = stacks.where_waits(main.frames) if main is not None else None
            if where:
                parts.append(f"its main thread waits at {where}")
        return TimeoutError(
            f"{role} (pid {self.workers[rank].pid}) did not answer {what} within its deadline; "
            + "; ".join(parts)
        )

    def _blame_dead_peer(self, rank: int, grace_s: float = 1.0) -> None:
        """Tensor parallelism: when a worker dies or fails, its peers' next collective fails
        and they report an error (then exit). Wait briefly for a peer of ``rank`` to exit; if
        one did, fail with the supervisor's failure, whose root cause the blame rule names
        (the peer that failed first, not the survivors)."""
        if self.world_size == 1:
            return
        peers = [role for r, role in enumerate(self.roles) if r != rank]
        peer = self.supervisor.exited_within(peers, grace_s)
        if peer is not None:
            self._fail(self.roles.index(peer), self.workers[self.roles.index(peer)].poll())

    def _fail_once_exited(self, rank: int, grace_s: float, code_if_running: int | None) -> None:
        """Worker ``rank`` is exiting (it reported a failure, or closed its queue): give it
        ``grace_s`` s to exit, then ``_fail`` naming it with its exit status
        (``code_if_running`` if it still runs); raises ``EngineDeadError``."""
        proc = self.workers[rank]
        try:
            proc.popen.wait(grace_s)
        except Exception:  # still running: named as it is
            pass
        code = proc.poll()
        self._fail(rank, code_if_running if code is None else code)

    def _fail(self, rank: int, code: int | None) -> None:
        """Fail the executor (once) naming worker ``rank`` (``code``: its exit status, None
        while it exits) — or whom the blame rule names instead; raises ``EngineDeadError``."""
        proc = self.workers[rank]
        raise self.supervisor.fail(proc.role, proc.pid, code, rank=rank, child=proc)

    def check_health(self) -> None:
        self._raise_if_failed()

    def telemetry_gauges(self) -> dict[str, float]:
        """The broadcast queue's positions: chunks written, and read by each worker (rank)."""
        mq = getattr(self, "rpc_broadcast_mq", None)
        positions = mq.positions() if mq is not None else None
        if positions is None:  # no queue yet, or closed by shutdown
            return {}
        written, read = positions
        return {events.GAUGE_MQ_WRITTEN: written,
                **{f"{events.GAUGE_MQ_READER_PREFIX}{rank}": n for rank, n in enumerate(read)}}  # fmt: skip

    def shutdown(self) -> None:
        """Stop every worker (lifeline closed, SIGTERM, then SIGKILL) and remove the queues."""
        if self.supervisor is not None:
            self.supervisor.close()  # what follows is stopping them: no failure
        for proc in getattr(self, "workers", []):
            proc.request_stop()  # all at once (and a SIGSTOPped one continued), then wait for each
        deadline = time.monotonic() + 1.5
        for proc in getattr(self, "workers", []):
            # One deadline for all, shorter than the frontend's patience with us, so we always
            # get to SIGKILL a stuck (or SIGSTOPped) worker ourselves before we are killed.
            proc.stop(timeout=max(deadline - time.monotonic(), 0.05))
        for mq in [getattr(self, "rpc_broadcast_mq", None), *getattr(self, "response_mqs", [])]:
            if mq is not None:
                mq.close()
                mq.unlink()


def run_worker_rpc(
    wrapper: Any,
    rpc_msg: WorkerRPC,
    rank: int,
    *,
    run_dir: Path,
    role: str,
    worker_spans: bool,
    board: contract.CommBoard | None = None,
) -> WorkerReply:
    """Run one ``WorkerRPC`` on a worker's ``WorkerWrapperBase``; the reply says how it went.

    The worker side of ``collective_rpc``, shared by every executor with workers in their
    own processes (``WorkerProc`` here, ``RayWorkerWrapper`` in ``ray_executor.py``): the
    call runs inside ``observed_rpc`` (``engine/worker/step_telemetry.py``: under its
    caller's span, not the spawn-time one; ``execute_model`` in a ``worker.execute_model``
    stage when ``--collect-detailed-traces`` asks for worker spans, or a fault is armed
    there; told to ``board``, this worker's ``CommPosition`` writer), and an exception is
    written to this process's crash report (``<role>.crash.json``) before it becomes a
    failure reply. Never raises for an error of the called method (``Exception``).
    """
    try:
        args, kwargs = rpc_msg.call_args()
        with observed_rpc(rpc_msg, rank, worker_spans, board):
            value = wrapper.execute_method(rpc_msg.method, *args, **kwargs)
        return WorkerReply.success(rank, rpc_msg.method, value)
    except Exception as e:
        processes.write_crash_report(run_dir, role, e, current_stage() or _rpc_stage(rpc_msg.method), rank)
        return WorkerReply.failure(rank, rpc_msg.method, e)


def _rpc_stage(method: str) -> str:
    """The stage an RPC's failure is named by when no stage of it was open: ``worker.<method>``
    where the catalogue has one, else ``rpc <method>``."""
    name = f"worker.{method}"
    return name if name in catalogue.SPANS else f"rpc {method}"


class WorkerProc:
    """The worker process: a ``WorkerWrapperBase`` behind the broadcast queue (vLLM's ``WorkerProc``).

    Built inside the harness, it opens the queues, builds the wrapper and says READY; its
    busy loop then dequeues one RPC at a time (bounded waits, repeated while idle), runs it
    on the wrapper, and answers on its response queue when asked to.
    """

    def __init__(self, payload: WorkerSpawnPayload, ctx: ProcessContext) -> None:
        from engine.distributed import parallel_state  # torch: workers only
        from engine.worker.worker_base import WorkerWrapperBase

        self.run_dir, self.role, self.rank = ctx.spec.run_dir, ctx.spec.role, payload.rank
        config = payload.config
        self.rpc_broadcast_mq = MessageQueue.open_reader(payload.rpc_handle, self.rank)
        self.worker_response_mq = MessageQueue.open_writer(payload.response_handle)
        self.wrapper: WorkerWrapperBase | None = None
        ctx.at_exit(self.close)
        # --collect-detailed-traces worker|all: a worker.execute_model span per step.
        self.worker_spans = config.observability_config.collect_worker_traces
        self.board = parallel_state.open_comm_board(
            self.run_dir, self.role
        )  # <role>.comm: its step and collective
        with attached_trace_context(payload.trace_headers):
            self.wrapper = WorkerWrapperBase(config, rpc_rank=self.rank)
        ready = WorkerReady(role=self.role, rank=self.rank, pid=os.getpid(), device=str(config.device_config.device),
                            dtype=str(config.model_config.dtype))  # fmt: skip
        self.worker_response_mq.enqueue(messages.encode(ready))
        if ctx.telemetry is not None:  # the Worker itself is built later, by init_worker
            ctx.telemetry.add_gauge_provider(
                lambda: self.wrapper.worker.telemetry_gauges() if self.wrapper.worker else {}
            )

    @staticmethod
    def worker_main(payload_bytes: bytes, *, run_dir: Path, role: str) -> int:
        """Process target: the payload is an encoded ``WorkerSpawnPayload``; returns the exit
        status (``engine.utils.process_harness.run_process``)."""
        payload = messages.decode_spawn_payload(payload_bytes)
        spec = ProcessSpec(role, run_dir, rank=payload.rank,
                           observability=Observability.of(payload.config.observability_config),
                           target=functools.partial(WorkerProc._serve, payload))  # fmt: skip
        return run_process(spec)

    @staticmethod
    def _serve(payload: WorkerSpawnPayload, ctx: ProcessContext) -> None:
        """The worker's life inside the harness: start up, then run RPCs until the engine
        core closes the queue."""
        WorkerProc(payload, ctx).worker_busy_loop()

    def close(self) -> None:
        """Leave the torch.distributed group (TP) and close both queues (at exit)."""
        worker = getattr(self.wrapper, "worker", None)
        if worker is not None:
            worker.shutdown()
        self.rpc_broadcast_mq.close()
        self.worker_response_mq.close()

    def worker_busy_loop(self) -> None:
        """Run RPCs until the engine core closes the queue (an orderly shutdown).

        Raises:
            SystemExit: 1, after replying with a failure (the crash report is written).
        """
        while True:
            try:
                rpc_msg = messages.decode_rpc(self.rpc_broadcast_mq.dequeue(timeout=IDLE_POLL_S))
            except MessageQueueTimeout:
                continue  # idle: wait again (the lifeline watcher handles a dead parent)
            except MessageQueueClosed:
                return  # the engine core closed the queue: an orderly shutdown
            reply = run_worker_rpc(self.wrapper, rpc_msg, self.rank, run_dir=self.run_dir, role=self.role,
                                   worker_spans=self.worker_spans, board=self.board)  # fmt: skip
            if rpc_msg.output_rank is None or rpc_msg.output_rank == self.rank:
                self.worker_response_mq.enqueue(messages.encode(reply))
            if not reply.ok:
                raise SystemExit(1)
