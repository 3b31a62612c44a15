"""Process groups for tensor parallelism: who talks to whom, and the two collectives TP needs.

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

One engine has ``world_size = tp × pp`` workers; with pp = 1 (this version) the TP group
is the whole world. Without any group (world size 1, or the in-process ``uni`` executor)
every helper below is the identity, so layers need no special case and many engines can
share one process.

Left out: PP and DP groups, custom all-reduce kernels, the CPU/shared-memory communicator,
expert parallelism.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from engine.logger import init_logger

logger = init_logger(__name__)

_ARRIVED_KEY = "glassbox/arrived/{}"


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
        dist.all_reduce(x, group=self.device_group)
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
        dist.all_gather(parts, x, group=self.device_group)
        out = torch.cat(parts, dim=dim)
        self.stats.all_gather_s += time.perf_counter() - start
        self.stats.all_gather_calls += 1
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` of group rank ``src`` copied into ``x`` on every rank, in place."""
        if self.world_size > 1:
            dist.broadcast(x, src=self.ranks[src], group=self.device_group)
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.device_group)


_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None


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
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not store.check([_ARRIVED_KEY.format(r)])]
            raise RendezvousTimeout(
                f"torch.distributed rendezvous at {init_method}: rank(s) {named(missing)} of {world_size} "
                f"never arrived within {timeout_s:g} s ({hint}); this is rank {named([rank])}",
                missing,
            )
        time.sleep(0.02)
    return store


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


def initialize_model_parallel(tensor_model_parallel_size: int = 1) -> None:
    """Split the world into TP groups of consecutive ranks (with pp = 1: one group, the world)."""
    global _TP
    if _WORLD is None:
        raise RuntimeError("init_distributed_environment() first")
    tp = tensor_model_parallel_size
    if _WORLD.world_size % tp:
        raise ValueError(f"world size {_WORLD.world_size} is not divisible by tensor_parallel_size {tp}")
    for start in range(0, _WORLD.world_size, tp):
        ranks = list(range(start, start + tp))
        # new_group is collective over the world: every rank creates every group.
        group = dist.group.WORLD if tp == _WORLD.world_size else dist.new_group(ranks)
        if _WORLD.rank in ranks:
            _TP = GroupCoordinator("tp", ranks, _WORLD.rank, group)


def ensure_model_parallel_initialized(tensor_model_parallel_size: int) -> None:
    """Build the TP group unless it exists; refuse a different size."""
    if _TP is None:
        initialize_model_parallel(tensor_model_parallel_size)
    elif _TP.world_size != tensor_model_parallel_size:
        raise RuntimeError(
            f"the TP group has size {_TP.world_size}, tensor_parallel_size {tensor_model_parallel_size}"
        )


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def get_tp_group() -> GroupCoordinator | None:
    """The TP group, or None when this process has none (world size 1)."""
    return _TP


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size if _TP is not None else 1


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group if _TP is not None else 0


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group (identity without one)."""
    return _TP.all_reduce(x) if _TP is not None else x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate the TP ranks' ``x`` along ``dim`` (identity without a group)."""
    return _TP.all_gather(x, dim) if _TP is not None else x


def get_comm_stats(reset: bool = False) -> dict[str, float]:
    """Seconds and calls spent in TP collectives by this process (zeros without a group)."""
    if _TP is None:
        return CommStats().as_dict()
    out = _TP.stats.as_dict()
    if reset:
        _TP.stats = CommStats()
    return out


def destroy_model_parallel() -> None:
    global _TP
    if _TP is not None and _TP.device_group is not dist.group.WORLD and dist.is_initialized():
        dist.destroy_process_group(_TP.device_group)
    _TP = None


def destroy_distributed_environment() -> None:
    """Leave every group and the world (safe to call twice, or without any group)."""
    global _WORLD
    destroy_model_parallel()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _WORLD = None
