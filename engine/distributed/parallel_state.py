"""Process groups for tensor and pipeline parallelism: who talks to whom, and how.

Mirrors vLLM's ``vllm/distributed/parallel_state.py`` (``init_distributed_environment``,
``initialize_model_parallel``, ``GroupCoordinator``, ``get_tp_group``) and
``communication_op.py`` (``tensor_model_parallel_all_reduce`` / ``_all_gather``), in plain
``torch.distributed``: gloo on CPU, NCCL on CUDA.

Start-up, inside ``Worker.init_device`` of every worker of one engine::

    engine core: picks a free TCP port → distributed_init_method = "tcp://127.0.0.1:<port>"
    rank 0:      hosts a TCPStore on that port          ┐
    every rank:  connects, writes "arrived/<rank>",     │ one deadline:
                 waits until every rank has arrived     ┘ GLASSBOX_DIST_INIT_TIMEOUT_S
    every rank:  init_process_group(backend, store=...) → the TP group

The rendezvous is ours (not ``init_method="tcp://..."``) only so that an expired deadline
can say *which* ranks never arrived instead of "timed out".

One engine has ``world_size = tp × pp`` workers, rank ``pp_rank * tp + tp_rank``. The
TP groups are runs of consecutive ranks (one per stage); the PP groups take every tp-th
rank (one per TP rank): with tp = 2, pp = 2, TP groups {0, 1} and {2, 3}, PP groups {0, 2}
and {1, 3}. Each step, TP rank t of stage p sends its hidden states to TP rank t of stage
p + 1 (``send_tensor_dict`` / ``recv_tensor_dict`` point to point in its PP group). Without
any group (world size 1, or the in-process ``uni`` executor) every helper below is the
identity, so layers need no special case and many engines can share one process.

**Expert parallelism** (``--enable-expert-parallel``) across DP engines makes one world of every
engine's workers (``dp × tp`` ranks, rank ``dp_rank * tp + tp_rank``, met at the port the first
process picked): each engine's TP group inside it, and one EP group of every rank, whose
``all_to_all`` carries the MoE layers' dispatch and combine (``engine/model/moe.py``). The
engine cores meet apart, in a stateless gloo group of their own (``stateless_init_dp_group``),
to decide together when a request wave ends (``has_unfinished_dp``).

Left out: a DP group among the workers, custom all-reduce kernels, the CPU/shared-memory
communicator, and vLLM's trick of sending only a 1/tp slice between stages and all-gathering it
on the other side.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from engine.logger import init_logger
from tracing import run_dir as run_dirs
from tracing.waits import WaitTimeout, wait_for

logger = init_logger(__name__)

_ARRIVED_KEY = "glassbox/arrived/{}"

# This worker's CommPosition writer (``set_comm_board``): every collective of the TP and PP
# groups is counted on it, so a rank waiting in all-reduce #k can be told from the rank that
# never reached #k (``tracing.blame``). Two ``struct.pack_into`` on an mmap per collective.
_board: run_dirs.CommBoard | None = None
_ALL_REDUCE, _ALL_GATHER, _SEND, _RECV, _BROADCAST, _BARRIER, _ALL_TO_ALL = (
    run_dirs.COMM_KINDS.index(k)
    for k in ("all_reduce", "all_gather", "send", "recv", "broadcast", "barrier", "all_to_all")
)


def set_comm_board(board: run_dirs.CommBoard | None) -> None:
    """Count this process's collectives on ``board`` (None: stop counting)."""
    global _board
    _board = board


def open_comm_board(run_dir: str | os.PathLike[str], role: str) -> run_dirs.CommBoard | None:
    """Create worker ``role``'s ``<role>.comm`` in ``run_dir`` and count this process's
    collectives on it from now on; None (with a warning) when the file cannot be made: the
    blame rule then sees stages, not collectives. vLLM has no counterpart."""
    try:
        board = run_dirs.CommBoard(run_dir, role)
    except OSError as e:
        logger.warning("no comm board for %s: %s", role, e)
        board = None
    set_comm_board(board)
    return board


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (the OS picks it; nothing is hard-coded)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def get_distributed_init_method(host: str = "127.0.0.1", port: int | None = None) -> str:
    """``tcp://host:port`` on a free port (vLLM: ``get_distributed_init_method``)."""
    return f"tcp://{host}:{port if port is not None else get_open_port(host)}"


@dataclass
class CommStats:
    """Time spent in collectives since the last reset (the benchmark's all-reduce share)."""

    all_reduce_s: float = 0.0
    all_reduce_calls: int = 0
    all_gather_s: float = 0.0
    all_gather_calls: int = 0
    pp_send_s: float = 0.0  # handing hidden states to the next stage
    pp_recv_s: float = 0.0  # waiting for (and receiving) them from the previous one
    pp_send_calls: int = 0
    pp_recv_calls: int = 0
    all_to_all_s: float = 0.0  # expert parallelism: MoE dispatch and combine
    all_to_all_calls: int = 0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class GroupCoordinator:
    """One process group and this process's place in it (vLLM: ``GroupCoordinator``).

    ``ranks`` are global ranks; ``rank_in_group`` is this process's index among them.
    """

    name: str
    ranks: list[int]
    rank: int
    device_group: dist.ProcessGroup
    stats: CommStats = field(default_factory=CommStats)

    def _enter(self, kind: int) -> int | None:
        """Count one collective of ``kind`` on the comm board; the group's index there (None:
        not counted: no board, or the world group)."""
        board = _board
        if board is None or self.name not in run_dirs.COMM_GROUPS:
            return None
        index = run_dirs.COMM_GROUPS.index(self.name)
        board.enter(index, kind)
        return index

    @staticmethod
    def _leave(index: int | None) -> None:
        board = _board
        if index is not None and board is not None:
            board.leave(index)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place; returns ``x``."""
        if self.world_size == 1:
            return x
        start = time.perf_counter()
        counted = self._enter(_ALL_REDUCE)
        dist.all_reduce(x, group=self.device_group)
        self._leave(counted)
        self.stats.all_reduce_s += time.perf_counter() - start
        self.stats.all_reduce_calls += 1
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` (same shape on all ranks) along ``dim``, rank order."""
        if self.world_size == 1:
            return x
        start = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        counted = self._enter(_ALL_GATHER)
        dist.all_gather(parts, x, group=self.device_group)
        self._leave(counted)
        out = torch.cat(parts, dim=dim)
        self.stats.all_gather_s += time.perf_counter() - start
        self.stats.all_gather_calls += 1
        return out

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """The global rank after this one in the group (wrapping around)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        """The global rank before this one in the group (wrapping around)."""
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def send_tensor_dict(self, tensors: dict[str, torch.Tensor], dst: int | None = None) -> None:
        """Send named tensors to global rank ``dst`` (default: the next rank) of this group.

        Two messages, then one per tensor: the metadata's byte length, the metadata (names,
        shapes, dtypes; pickled), then each tensor. The receiver learns the shapes from the
        metadata, so stages need not agree on them in advance. vLLM: ``send_tensor_dict``.
        """
        dst = self.next_rank if dst is None else dst
        start = time.perf_counter()
        meta = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors.items()]
        device = next(iter(tensors.values())).device  # NCCL sends device tensors only
        blob = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8).to(device)
        size = torch.tensor([blob.numel()], dtype=torch.int64, device=device)
        counted = self._enter(_SEND)  # one hand-off, one count (its messages go together)
        dist.send(size, dst=dst, group=self.device_group)
        dist.send(blob, dst=dst, group=self.device_group)
        for t in tensors.values():
            dist.send(t.contiguous(), dst=dst, group=self.device_group)
        self._leave(counted)
        self.stats.pp_send_s += time.perf_counter() - start
        self.stats.pp_send_calls += 1

    def recv_tensor_dict(
        self, src: int | None = None, device: torch.device | None = None
    ) -> dict[str, torch.Tensor]:
        """Receive what ``send_tensor_dict`` sent from global rank ``src`` (default: the previous rank)."""
        src = self.prev_rank if src is None else src
        start = time.perf_counter()
        size = torch.empty(1, dtype=torch.int64, device=device)
        counted = self._enter(_RECV)
        dist.recv(size, src=src, group=self.device_group)
        blob = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        dist.recv(blob, src=src, group=self.device_group)
        out = {}
        for name, shape, dtype in pickle.loads(blob.cpu().numpy().tobytes()):
            out[name] = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            dist.recv(out[name], src=src, group=self.device_group)
        self._leave(counted)
        self.stats.pp_recv_s += time.perf_counter() - start
        self.stats.pp_recv_calls += 1
        return out

    def all_to_all(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Rows ``x[sum(send_splits[:r]) : sum(send_splits[:r + 1])]`` to group rank ``r``; the
        rows every rank sent here, in rank order: ``(sum(recv_splits), *x.shape[1:])``.

        Every rank calls it (a rank with nothing to send passes zeros). gloo and NCCL both
        take ``all_to_all_single`` with uneven splits (torch 2.13's gloo included: measured).
        vLLM: ``All2AllManagerBase`` (its naive all-to-all)."""
        start = time.perf_counter()
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        counted = self._enter(_ALL_TO_ALL)
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=self.device_group)
        self._leave(counted)
        self.stats.all_to_all_s += time.perf_counter() - start
        self.stats.all_to_all_calls += 1
        return out

    def all_to_all_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``counts`` ``(world_size · n,)`` int64, block ``r`` to rank ``r``: the blocks every
        rank sent here, in rank order ``(world_size · n,)`` (how many rows of each kind will come)."""
        n = counts.numel() // self.world_size
        return self.all_to_all(counts, [n] * self.world_size, [n] * self.world_size)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` of group rank ``src`` copied into ``x`` on every rank, in place."""
        if self.world_size > 1:
            counted = self._enter(_BROADCAST)
            dist.broadcast(x, src=self.ranks[src], group=self.device_group)
            self._leave(counted)
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            counted = self._enter(_BARRIER)
            dist.barrier(group=self.device_group)
            self._leave(counted)


_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_PP: GroupCoordinator | None = None
_EP: GroupCoordinator | None = None


class RendezvousTimeout(TimeoutError):
    """Not every rank arrived in time; ``missing_ranks`` says which."""

    def __init__(self, message: str, missing_ranks: list[int]) -> None:
        super().__init__(message)
        self.missing_ranks = missing_ranks


def _rendezvous(
    init_method: str,
    rank: int,
    world_size: int,
    timeout_s: float,
    rank_name: Callable[[int], str] | None = None,
) -> dist.Store:
    """Meet every rank at ``init_method`` (``tcp://host:port``) within ``timeout_s``.

    Rank 0 hosts the store. Each rank writes ``arrived/<rank>`` and waits for all the others.
    ``rank_name(r)`` (e.g. the worker's role) is added to each rank named in an error.

    Raises:
        RendezvousTimeout: naming the ranks that never arrived (rank 0 itself, when a rank cannot
            reach its store).
        ValueError: ``init_method`` is not ``tcp://host:port``.
    """
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"distributed_init_method must be tcp://host:port, got {init_method!r}")
    deadline = time.monotonic() + timeout_s
    hint = "GLASSBOX_DIST_INIT_TIMEOUT_S"

    def named(ranks: list[int]) -> str:
        return ", ".join(f"{r} ({rank_name(r)})" if rank_name else str(r) for r in ranks)

    try:
        store = dist.TCPStore(
            url.hostname,
            url.port,
            world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except Exception as e:  # the client never reached rank 0's store (or rank 0 could not bind)
        if rank == 0:
            raise RuntimeError(f"rank 0 could not host the rendezvous store at {init_method}: {e}") from e
        raise RendezvousTimeout(
            f"torch.distributed rendezvous at {init_method}: rank {named([0])}, the store's host, never "
            f"arrived within {timeout_s:g} s ({hint}); this is rank {named([rank])} of {world_size}",
            [0],
        ) from None
    store.set(_ARRIVED_KEY.format(rank), str(rank))
    keys = [_ARRIVED_KEY.format(r) for r in range(world_size)]
    try:
        wait_for(f"every rank at the rendezvous {init_method}", lambda: store.check(keys),
                 timeout_s=max(deadline - time.monotonic(), 0.001), poll_interval_s=0.02)  # fmt: skip
    except WaitTimeout:
        missing = [r for r in range(world_size) if not store.check([_ARRIVED_KEY.format(r)])]
        raise RendezvousTimeout(
            f"torch.distributed rendezvous at {init_method}: rank(s) {named(missing)} of {world_size} "
            f"never arrived within {timeout_s:g} s ({hint}); this is rank {named([rank])}",
            missing,
        ) from None
    return store


def stateless_init_dp_group(
    init_method: str,
    dp_rank: int,
    dp_size: int,
    timeout_s: float | None = None,
    op_timeout_s: float | None = None,
    rank_name: Callable[[int], str] | None = None,
) -> dist.ProcessGroup:
    """The data-parallel engine cores' own gloo group, apart from any worker's world (vLLM:
    ``ParallelConfig.stateless_init_dp_group``): each ``EngineCore_DP<k>`` joins it once, so
    that the engines can decide together when a request wave ends (``has_unfinished_dp``).
    The rendezvous is ``_rendezvous``'s (absent ranks named); ``op_timeout_s`` bounds each
    all-reduce (default ``GLASSBOX_EXECUTE_MODEL_TIMEOUT_S``).

    Raises:
        RendezvousTimeout: some engine cores never arrived (named).
    """
    from engine import envs

    timeout_s = timeout_s if timeout_s is not None else envs.GLASSBOX_DIST_INIT_TIMEOUT_S
    op_timeout_s = op_timeout_s if op_timeout_s is not None else envs.GLASSBOX_EXECUTE_MODEL_TIMEOUT_S
    store = _rendezvous(init_method, dp_rank, dp_size, timeout_s, rank_name)
    return dist.ProcessGroupGloo(store, dp_rank, dp_size, timedelta(seconds=op_timeout_s))


def has_unfinished_dp(dp_group: dist.ProcessGroup, has_unfinished: bool) -> bool:
    """Whether any engine of ``dp_group`` has unfinished work (vLLM:
    ``ParallelConfig.has_unfinished_dp``): an all-reduce every engine core calls at the same
    step of a wave."""
    flag = torch.tensor([int(has_unfinished)], dtype=torch.int64)
    dp_group.allreduce([flag]).wait()
    return bool(flag.item())


def init_distributed_environment(
    world_size: int,
    rank: int,
    distributed_init_method: str,
    local_rank: int = 0,
    backend: str = "gloo",
    timeout_s: float | None = None,
    op_timeout_s: float | None = None,
    rank_name: Callable[[int], str] | None = None,
) -> None:
    """Join the engine's world process group (once per process).

    ``timeout_s`` bounds the rendezvous (default ``GLASSBOX_DIST_INIT_TIMEOUT_S``);
    ``op_timeout_s`` bounds each later collective (default
    ``GLASSBOX_EXECUTE_MODEL_TIMEOUT_S``): a peer that died makes the survivors' collectives
    fail instead of hanging forever. ``rank_name(r)`` names rank ``r`` in errors.

    Raises:
        RendezvousTimeout: some ranks never arrived (named).
    """
    global _WORLD
    from engine import envs

    if _WORLD is not None:
        if _WORLD.world_size != world_size or _WORLD.rank != rank:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {_WORLD.rank} of {_WORLD.world_size}"
            )
        return
    timeout_s = timeout_s if timeout_s is not None else envs.GLASSBOX_DIST_INIT_TIMEOUT_S
    op_timeout_s = op_timeout_s if op_timeout_s is not None else envs.GLASSBOX_EXECUTE_MODEL_TIMEOUT_S
    start = time.monotonic()
    store = _rendezvous(distributed_init_method, rank, world_size, timeout_s, rank_name)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=op_timeout_s),
    )
    _WORLD = GroupCoordinator("world", list(range(world_size)), rank, dist.group.WORLD)
    logger.info(
        "torch.distributed: rank %d of %d joined (%s, %s) in %.2f s",
        rank,
        world_size,
        backend,
        distributed_init_method,
        time.monotonic() - start,
    )


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    data_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
) -> None:
    """Split the world into TP groups of consecutive ranks, PP groups of every tp-th rank
    (within each DP engine) and, with expert parallelism, one EP group of every rank.

    The world spans ``data_parallel_size`` engines only with expert parallelism (rank
    ``dp_rank · tp · pp + pp_rank · tp + tp_rank``); it is then ``dp × tp`` ranks (no PP:
    refused by the config). A group that is the whole world reuses the world group.
    """
    global _TP, _PP, _EP
    if _WORLD is None:
        raise RuntimeError("init_distributed_environment() first")
    tp, pp, dp = tensor_model_parallel_size, pipeline_model_parallel_size, data_parallel_size
    if _WORLD.world_size != tp * pp * dp:
        raise ValueError(
            f"world size {_WORLD.world_size} is not tensor_parallel_size {tp} × pipeline_parallel_size {pp}"
            + (f" × data_parallel_size {dp}" if dp > 1 else "")
        )

    def group_of(ranks: list[int]) -> dist.ProcessGroup:
        return dist.group.WORLD if len(ranks) == _WORLD.world_size else dist.new_group(ranks)

    # new_group is collective over the world: every rank creates every group, in the same order.
    engine_size = tp * pp
    for engine_start in range(0, _WORLD.world_size, engine_size):
        for start in range(engine_start, engine_start + engine_size, tp):
            ranks = list(range(start, start + tp))
            group = group_of(ranks)
            if _WORLD.rank in ranks:
                _TP = GroupCoordinator("tp", ranks, _WORLD.rank, group)
        for tp_rank in range(tp):
            ranks = list(range(engine_start + tp_rank, engine_start + engine_size, tp))
            group = group_of(ranks)
            if _WORLD.rank in ranks:
                _PP = GroupCoordinator("pp", ranks, _WORLD.rank, group)
    if enable_expert_parallel and _WORLD.world_size > 1:
        ranks = list(range(_WORLD.world_size))
        _EP = GroupCoordinator("ep", ranks, _WORLD.rank, group_of(ranks))


def ensure_model_parallel_initialized(
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int = 1,
    data_parallel_size: int = 1,
    enable_expert_parallel: bool = False,
) -> None:
    """Build the TP, PP (and EP) groups unless they exist; refuse different sizes."""
    if _TP is None:
        initialize_model_parallel(
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            data_parallel_size,
            enable_expert_parallel,
        )
    elif _TP.world_size != tensor_model_parallel_size or (
        _PP is not None and _PP.world_size != pipeline_model_parallel_size
    ):
        raise RuntimeError(
            f"the TP/PP groups have sizes {_TP.world_size}/{_PP.world_size if _PP else 1}, asked "
            f"{tensor_model_parallel_size}/{pipeline_model_parallel_size}"
        )


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def get_tp_group() -> GroupCoordinator | None:
    """The TP group, or None when this process has none (world size 1)."""
    return _TP


def get_pp_group() -> GroupCoordinator | None:
    """The PP group (this worker's stage and its neighbours), or None without one."""
    return _PP


def get_ep_group() -> GroupCoordinator | None:
    """The expert-parallel group (every worker of every DP engine, one pipeline stage), or None
    without expert parallelism (vLLM: ``get_ep_group``)."""
    return _EP


def get_pipeline_model_parallel_world_size() -> int:
    return _PP.world_size if _PP is not None else 1


def get_pipeline_model_parallel_rank() -> int:
    return _PP.rank_in_group if _PP is not None else 0


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size if _TP is not None else 1


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group if _TP is not None else 0


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group (identity without one). Inside a compiled graph it is
    one opaque op, ``glassbox::tp_all_reduce`` (vLLM: ``torch.ops.vllm.all_reduce``)."""
    if _TP is None or _TP.world_size == 1:
        return x
    if torch.compiler.is_compiling():
        return torch.ops.glassbox.tp_all_reduce(x)
    return _TP.all_reduce(x)


@torch.library.custom_op("glassbox::tp_all_reduce", mutates_args=())
def _tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The TP all-reduce as an op of a compiled graph: a new tensor (ops may not return
    their input), summed over the group in place."""
    assert _TP is not None
    return _TP.all_reduce(x.clone())


@_tp_all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate the TP ranks' ``x`` along ``dim`` (identity without a group)."""
    return _TP.all_gather(x, dim) if _TP is not None else x


def get_comm_stats(reset: bool = False) -> dict[str, float]:
    """Seconds and calls spent in TP collectives, PP hand-offs and EP all-to-alls by this
    process (zeros without a group)."""
    out = CommStats().as_dict()
    for group in (_TP, _PP, _EP):
        if group is None:
            continue
        for key, value in group.stats.as_dict().items():
            out[key] += value
        if reset:
            group.stats = CommStats()
    return out


def destroy_model_parallel() -> None:
    global _TP, _PP, _EP
    for group in (_TP, _PP, _EP):
        if group is not None and group.device_group is not dist.group.WORLD and dist.is_initialized():
            dist.destroy_process_group(group.device_group)
    _TP = _PP = _EP = None


def destroy_distributed_environment() -> None:
    """Leave every group and the world (safe to call twice, or without any group)."""
    global _WORLD
    destroy_model_parallel()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _WORLD = None
