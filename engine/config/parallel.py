"""``ParallelConfig``: how the model is split across workers (TP, PP) and engine cores (DP).

vLLM's counterpart is ``vllm/config/parallel.py``. The executor backends and the multi-node
data-parallel flags carry vLLM's names; Ray is checked here, in the first process, without
being imported.

Expert parallelism (``--enable-expert-parallel``) splits a mixture of experts' experts over the
DP × TP ranks; across DP engines it joins every engine's workers in one world and keeps the
engines in lockstep (``engine/core/engine_core_proc.py``). Left out with it: pipeline
parallelism, other nodes, the uni and Ray executors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.config.utils import ConfigError, check_positive_int

EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# What `--distributed-executor-backend ray` needs and is not installed by default.
# Glassbox is not on PyPI: the extra is installed from the checkout.
RAY_INSTALL_HINT = 'pip install -e ".[ray]" in the Glassbox checkout'
# vLLM's default --data-parallel-rpc-port.
DEFAULT_DP_RPC_PORT = 29550


def ray_is_installed() -> bool:
    """Whether ``import ray`` would find Ray (without importing it: this runs in the first
    process, which never needs Ray itself). A ``None`` in ``sys.modules`` counts as absent,
    as it makes ``import ray`` fail."""
    import importlib.util
    import sys

    if "ray" in sys.modules:
        return sys.modules["ray"] is not None
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        return False


def check_ray_address(address: str, timeout_s: float = 5.0) -> None:
    """Refuse a ``RAY_ADDRESS`` (``HOST:PORT``, optionally ``ray://``) where nothing listens.

    ``ray.init`` would retry it for minutes, printing its own errors, while the engine waits;
    here one TCP connection with a ``timeout_s`` deadline answers first. ``auto``, ``local``
    and an empty value are left to Ray.

    Raises:
        ConfigError: nothing accepts a connection at the address (named with the reason).
    """
    import socket

    target = address.strip().removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", "local", "" or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(
            "RAY_ADDRESS",
            address,
            f"no Ray cluster answers there ({e.strerror or e}): start one with `ray start --head` "
            "or unset RAY_ADDRESS to let Glassbox start its own",
        ) from None


@dataclass
class ParallelConfig:
    """How the model is split across workers (``world_size = tp × pp``) and engines (dp).

    ``distributed_executor_backend``: "mp" runs each worker in its own process (the default,
    so the whole tree can be watched — vLLM defaults to "uni" at world size 1); "uni" keeps
    the single worker inside the engine core; "ray" runs each worker as a Ray actor
    (``engine/executor/ray_executor.py``; needs the ``ray`` extra, checked here). With ``GLASSBOX_ENABLE_MULTIPROCESSING=0`` the
    default is "uni": everything in the caller's process — except with tensor parallelism,
    which always needs one process per worker ("mp"; the engine core then stays in the
    caller's process, as vLLM does), and refuses an explicit "uni".
    Tensor, pipeline and data parallelism are supported (TP and PP need "mp" or "ray"; DP needs the
    engine cores in processes of their own, so not ``GLASSBOX_ENABLE_MULTIPROCESSING=0``).
    ``data_parallel_rank`` is not a flag: each ``EngineCore_DP<k>`` sets it to ``k`` in its own
    copy of the config, so its executor knows which workers (and queues) are its own. Multi-node
    data parallelism (``--headless``, ``--data-parallel-size-local``, ``--data-parallel-start-rank``,
    ``--data-parallel-address``, ``--data-parallel-rpc-port``; vLLM's fields of the same names, with
    ``data_parallel_master_ip`` spelled ``data_parallel_address``) is checked by ``_check_multi_node``. Whether ``tensor_parallel_size`` fits the model's heads, and
    ``pipeline_parallel_size`` its layers (and ``GLASSBOX_PP_LAYER_PARTITION``), is checked by
    ``EngineConfig``, which knows the model.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    data_parallel_rank: int = 0
    # Multi-node data parallelism (docs/multi-node.md): the engine cores of this node are
    # ranks start_rank .. start_rank + size_local - 1 of data_parallel_size; the others join
    # (or are joined) over TCP at data_parallel_address:data_parallel_rpc_port.
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int = DEFAULT_DP_RPC_PORT
    headless: bool = False
    # Mixture-of-experts models: split the experts over the DP × TP ranks (each rank holds
    # whole experts, tokens go to them by all-to-all) instead of splitting each expert over TP.
    enable_expert_parallel: bool = False
    # Not flags: with expert parallelism across DP engines, the first process picks two free
    # ports on 127.0.0.1 before it starts the engines (``assign_dp_ports``): where the engine
    # cores' DP group meets (vLLM's name) and where every engine's workers meet as one world.
    data_parallel_master_port: int | None = None
    data_parallel_worker_port: int | None = None

    def __post_init__(self) -> None:
        check_positive_int("--tensor-parallel-size", self.tensor_parallel_size, allow_none=False)
        check_positive_int("--pipeline-parallel-size", self.pipeline_parallel_size, allow_none=False)
        check_positive_int("--data-parallel-size", self.data_parallel_size, allow_none=False)
        self._check_multi_node()
        if self.distributed_executor_backend is None:
            from engine import envs

            multiprocess = envs.GLASSBOX_ENABLE_MULTIPROCESSING or self.world_size > 1
            self.distributed_executor_backend = "mp" if multiprocess else "uni"
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ConfigError(
                "--distributed-executor-backend",
                self.distributed_executor_backend,
                f"allowed: {', '.join(EXECUTOR_BACKENDS)}",
            )
        if self.distributed_executor_backend == "ray" and not ray_is_installed():
            raise ConfigError(
                "--distributed-executor-backend",
                "ray",
                f"runs each worker as a Ray actor, and Ray is not installed: {RAY_INSTALL_HINT}",
            )
        if self.distributed_executor_backend == "ray":
            check_ray_address(os.environ.get("RAY_ADDRESS", ""))
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            sizes = [
                f"{flag} {value}"
                for flag, value in (
                    ("--tensor-parallel-size", self.tensor_parallel_size),
                    ("--pipeline-parallel-size", self.pipeline_parallel_size),
                )
                if value > 1
            ]
            raise ConfigError(
                "--distributed-executor-backend",
                "uni",
                f"runs one worker inside the engine core; {' × '.join(sizes)} needs one process "
                "per worker: use mp",
            )
        if self.enable_expert_parallel:
            self._check_expert_parallel()
        if self.data_parallel_size > 1:
            from engine import envs

            if not envs.GLASSBOX_ENABLE_MULTIPROCESSING:
                raise ConfigError(
                    "--data-parallel-size",
                    self.data_parallel_size,
                    "runs one engine core process per rank: it needs GLASSBOX_ENABLE_MULTIPROCESSING=1",
                )

    def _check_expert_parallel(self) -> None:
        """What expert parallelism here runs with (each error names its flag; whether the
        model has experts, and how many, ``EngineConfig`` checks).

        Raises:
            ConfigError: pipeline parallelism, nodes other than this one, or (across DP
                engines) an executor other than ``mp``.
        """
        flag = "--enable-expert-parallel"
        if self.pipeline_parallel_size > 1:
            raise ConfigError("--pipeline-parallel-size", self.pipeline_parallel_size,
                              f"{flag} runs without pipeline parallelism here (left out)")  # fmt: skip
        if self.multi_node:
            raise ConfigError(flag, True, "expert parallelism across nodes is left out: run every DP engine "
                              "on this node (no --headless, no --data-parallel-size-local)")  # fmt: skip
        if self.data_parallel_size > 1 and self.distributed_executor_backend not in (None, "mp"):
            raise ConfigError("--distributed-executor-backend", self.distributed_executor_backend,
                              f"{flag} with --data-parallel-size > 1 joins every engine's workers in one "
                              "torch.distributed world, which the mp executor builds: use mp")  # fmt: skip

    def _check_multi_node(self) -> None:
        """Multi-node data parallelism's flags (vLLM's meaning; each error names its flag).

        Raises:
            ConfigError: a local size outside 1..D, a start rank with no room for the local
                ranks, a head (start rank 0) that runs every rank yet names nothing remote, a
                node with remote ranks but no ``--data-parallel-address``, a headless node
                that would run rank 0 (the head's), or a port outside 1..65535.
        """
        dp = self.data_parallel_size
        if self.data_parallel_size_local is None:
            self.data_parallel_size_local = dp if not self.headless else dp - self.data_parallel_start_rank
        local, start = self.data_parallel_size_local, self.data_parallel_start_rank
        if not isinstance(local, int) or isinstance(local, bool) or not 1 <= local <= dp:
            raise ConfigError("--data-parallel-size-local", local,
                              f"engine cores on this node: an integer in 1..--data-parallel-size ({dp})")  # fmt: skip
        if not isinstance(start, int) or isinstance(start, bool) or start < 0 or start + local > dp:
            raise ConfigError("--data-parallel-start-rank", start,
                              f"this node runs ranks start .. start + --data-parallel-size-local ({local}) - 1, "
                              f"all below --data-parallel-size ({dp}): at most {dp - local}")  # fmt: skip
        port = self.data_parallel_rpc_port
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535 - 16:
            raise ConfigError(
                "--data-parallel-rpc-port", port, "a TCP port in 1..65519 (it and the next few are used)"
            )
        if self.headless:
            if self.data_parallel_address is None:
                raise ConfigError("--data-parallel-address", None,
                                  "--headless needs the head node's address (the host that runs the API "
                                  "server), e.g. --data-parallel-address 10.0.0.1")  # fmt: skip
            if start == 0:
                raise ConfigError("--data-parallel-start-rank", start,
                                  "a --headless node runs ranks the head does not: 1 or more (the head "
                                  "runs ranks 0 .. its --data-parallel-size-local - 1)")  # fmt: skip
        else:
            if start != 0:
                raise ConfigError("--data-parallel-start-rank", start,
                                  "only a --headless node starts above rank 0 (the head runs ranks from 0)")  # fmt: skip
            if local < dp and self.data_parallel_address is None:
                raise ConfigError("--data-parallel-address", None,
                                  f"ranks {local}..{dp - 1} run on headless nodes, which join this head over "
                                  "TCP: give the address they reach it at, e.g. --data-parallel-address 10.0.0.1")  # fmt: skip

    @property
    def multi_node(self) -> bool:
        """Some engine cores of the instance run on another node (head or headless): the
        engine sockets are TCP on ``data_parallel_address``, not ipc."""
        return (
            self.headless
            or (self.data_parallel_size_local or self.data_parallel_size) < self.data_parallel_size
        )

    @property
    def local_dp_ranks(self) -> range:
        """The DP ranks whose engine cores run on this node."""
        start = self.data_parallel_start_rank
        return range(start, start + (self.data_parallel_size_local or self.data_parallel_size))

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def expert_parallel_across_dp(self) -> bool:
        """Expert parallelism over more than one DP engine: the engines' workers form one
        world, and every engine steps while any has work (the engine cores' DP group)."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def world_size_across_dp(self) -> int:
        """Workers in the torch.distributed world: every engine's (DP × TP) with expert
        parallelism across engines, else one engine's (TP × PP) (vLLM: ``world_size_across_dp``,
        where DP always shares one world)."""
        return self.world_size * (self.data_parallel_size if self.expert_parallel_across_dp else 1)

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the experts are split over: DP × TP with ``--enable-expert-parallel``, else 1."""
        return self.data_parallel_size * self.tensor_parallel_size if self.enable_expert_parallel else 1

    def assign_dp_ports(self) -> None:
        """Pick the two free ports of expert parallelism across DP engines (first process,
        before the engines start; a no-op otherwise or when already picked)."""
        if not self.expert_parallel_across_dp or self.data_parallel_master_port is not None:
            return
        import socket

        ports = []
        for _ in range(2):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                ports.append(int(s.getsockname()[1]))
        self.data_parallel_master_port, self.data_parallel_worker_port = ports
