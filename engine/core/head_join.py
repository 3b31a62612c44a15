"""The head's side of the multi-node join: the socket headless engine cores join at.

``engine/core/head_link.py`` is a headless node's side; this is the head's (client 0 of the
head's API servers, ``MPClient``, holds one ``HeadJoin``). vLLM: the head binds a handshake
ROUTER at ``tcp://<data_parallel_address>:<data_parallel_rpc_port>``, a headless node's engine
core says HELLO there and gets the addresses of the head's engine sockets
(``vllm/v1/engine/utils.py`` ``wait_for_engine_startup``, ``EngineHandshakeMetadata``).

The protocol (typed messages, ``engine/core/messages.py``)::

    headless engine core                          head (HeadJoin.socket, ROUTER)
        HELLO (EngineHandshake: rank, DP size) ──►  refuse()? ── JoinRefused(reason) ──► exits 1
                                               ◄──  JoinAccepted (addresses, DP size)
        ... starts as a local engine core: HELLO, READY on the head's output socket ...
        connection ends (node died, SIGKILL,  ──►  monitor: EVENT_DISCONNECTED → serve() names
        silent network: ZMQ heartbeats)            the rank lost; the head's tree stops
                                               ◄──  HeadStopping(reason) as the head stops (exit 0)

A ROUTER cannot say which peer left (``ROUTER_NOTIFY`` is a draft API of libzmq), so the
head remembers the connection (file descriptor, ``zmq.SRCFD``) each HELLO came on, and the
monitor's ``EVENT_DISCONNECTED`` names that descriptor.

Not in vLLM: its handshake socket is used only at start-up; Glassbox keeps the connection as
the liveness link of each joined rank (vLLM's headless engines notice a dead head only
through their collectives, and the head a dead node only through its engines' outputs).
"""

from __future__ import annotations

import errno
import time
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.config import ConfigError, EngineConfig
from engine.core.head_link import set_heartbeats
from engine.core.messages import (
    EngineHandshake,
    HeadStopping,
    JoinAccepted,
    JoinRefused,
    decode_as,
    encode,
    tcp_address,
)
from engine.distributed import topology
from engine.logger import init_logger
from engine.utils import processes
from engine.utils.wire import ProtocolError

logger = init_logger(__name__)


def bind_socket(socket: zmq.Socket, address: str) -> None:
    """Bind ``address``; a TCP one (the head's, multi-node DP) that is taken or not this
    machine's is the flag's error.

    Raises:
        ConfigError: a ``tcp://`` address that cannot be bound (names ``--data-parallel-rpc-port``
            or ``--data-parallel-address``).
        zmq.ZMQError: an ``ipc://`` address that cannot be bound.
    """
    try:
        socket.bind(address)
    except zmq.ZMQError as e:
        if not address.startswith("tcp://"):
            raise
        flag = "--data-parallel-rpc-port" if e.errno == errno.EADDRINUSE else "--data-parallel-address"
        raise ConfigError.from_message(
            f"{flag}: the head cannot bind {address}: {e.strerror} (multi-node DP uses "
            "--data-parallel-rpc-port and the next 2 + 2 × API servers ports; docs/multi-node.md)",
            flag=flag,
        ) from None


class HeadJoin:
    """The join ROUTER at ``--data-parallel-rpc-port`` (heartbeats on, a socket monitor for
    connections that end), and the ranks joined there.

    Args:
        ctx: the client's ZMQ context.
        config: the engine config (its ``parallel_config`` gives the address, port and DP size).
        layout: what a joining rank is told (``head_engine_addresses``; the coordinator's
            addresses already in it, or None without a coordinator); its
            ``data_parallel_size`` is set here.
        remote_roles: the engine cores the headless nodes run (the ranks the head waits for).

    Raises:
        ConfigError: the join address cannot be bound.

    Attributes:
        joined: rank → its HELLO; ``joined_at``: rank → when it joined (``time.monotonic``).
    """

    def __init__(self, ctx: zmq.Context, config: EngineConfig, layout: JoinAccepted,
                 remote_roles: list[topology.ProcessRole]) -> None:  # fmt: skip
        pc = config.parallel_config
        self.data_parallel_size = pc.data_parallel_size
        self.layout = layout
        self.layout.data_parallel_size = pc.data_parallel_size
        self.remote_roles = remote_roles
        self.address = tcp_address(pc.data_parallel_address, pc.data_parallel_rpc_port)
        self.joined: dict[int, EngineHandshake] = {}
        self.joined_identities: dict[int, bytes] = {}  # rank → its join connection's ZMQ identity
        self.joined_at: dict[int, float] = {}
        self.joined_fds: dict[int, int] = {}  # connection fd → the rank that joined on it
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 1000)
        set_heartbeats(self.socket)
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            bind_socket(self.socket, self.address)
        except BaseException:
            self.close()
            raise
        logger.info("Waiting for data-parallel rank(s) %s to join at %s (headless nodes: glassbox serve "
                    "--headless -dp %d --data-parallel-start-rank ... --data-parallel-address %s "
                    "--data-parallel-rpc-port %d)", ", ".join(str(r.dp_rank) for r in remote_roles),
                    self.address, pc.data_parallel_size, pc.data_parallel_address,
                    pc.data_parallel_rpc_port)  # fmt: skip

    def serve(self) -> list[int]:
        """Answer every HELLO waiting on the join socket (non-blocking).

        Returns:
            the joined ranks whose connection ended since the last call (empty while all hold).

        Raises:
            ProtocolError: a message that is not ``[identity, HELLO]``.
        """
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(frames) != 2:
                raise ProtocolError(f"{len(frames)} frames on the join socket; [identity, HELLO] was due")
            identity, body = frames[0].bytes, frames[1].bytes
            hello: EngineHandshake = decode_as(EngineHandshake, body)
            refusal = self.refuse(hello)
            if refusal is not None:
                logger.error("refused %s (pid %d) from a headless node: %s", hello.role, hello.pid, refusal)
                self.socket.send_multipart([identity, encode(JoinRefused(reason=refusal))])
                continue
            self.joined[hello.data_parallel_rank] = hello
            self.joined_identities[hello.data_parallel_rank] = identity
            self.joined_at[hello.data_parallel_rank] = time.monotonic()
            self.joined_fds[frames[1].get(zmq.SRCFD)] = hello.data_parallel_rank
            self.socket.send_multipart([identity, encode(self.layout)])
            logger.info("Data-parallel rank %d joined: %s (pid %d on its node)", hello.data_parallel_rank,
                        hello.role, hello.pid)  # fmt: skip
        lost: list[int] = []
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            rank = self.joined_fds.pop(int(event["value"]), None)
            if event["event"] == zmq.EVENT_DISCONNECTED and rank is not None:
                lost.append(rank)
        return lost

    def refuse(self, hello: EngineHandshake) -> str | None:
        """Why ``hello`` cannot join (one line naming the flag to fix), or None."""
        rank = hello.data_parallel_rank
        remote = [r.dp_rank for r in self.remote_roles]
        if hello.kind != "HELLO":
            return f"{hello.kind} on the join socket; HELLO with its DP rank was due"
        if hello.data_parallel_size != self.data_parallel_size:
            return (f"--data-parallel-size {hello.data_parallel_size} there, {self.data_parallel_size} on the "
                    "head")  # fmt: skip
        if rank not in remote:
            return (f"--data-parallel-start-rank: rank {rank} is not one the head waits for (it waits for "
                    f"{', '.join(map(str, remote))}; it runs 0..{remote[0] - 1} itself)")  # fmt: skip
        if rank in self.joined:
            return f"--data-parallel-start-rank: rank {rank} joined already (pid {self.joined[rank].pid})"
        return None

    def timeout_message(self, timeout: float, missing: list[topology.ProcessRole]) -> str:
        """The start-up error when ``missing`` did not join within ``timeout`` s
        (``GLASSBOX_DP_JOIN_TIMEOUT_S``): how to start them."""
        ranks = ", ".join(str(r.dp_rank) for r in missing)
        return (
            f"Data-parallel rank(s) {ranks} ({', '.join(r.name for r in missing)}) never joined the head at "
            f"{self.address} within GLASSBOX_DP_JOIN_TIMEOUT_S={timeout:g} s: start them with `glassbox "
            f"serve --headless -dp {self.data_parallel_size} --data-parallel-start-rank {missing[0].dp_rank} "
            f"--data-parallel-address ... --data-parallel-rpc-port ...` on their node, and open the ports "
            "(docs/multi-node.md)"
        )

    def lost_root_cause(self, run_dir: Path, ranks: list[int]) -> str:
        """Joined rank(s) ``ranks`` lost their connection: log it; the root-cause block naming them."""
        names = [topology.ProcessRole.engine_core(k).name for k in ranks]
        first = self.joined[ranks[0]]
        logger.error("Lost data-parallel rank(s) %s (%s): the connection from the headless node closed "
                     "(the node or its engine core died, or the network is down); requests they held fail "
                     "and the head stops: vLLM's data-parallel engines are all or nothing",
                     ", ".join(map(str, ranks)), ", ".join(names))  # fmt: skip
        return processes.format_root_cause(
            run_dir, names[0], first.pid, None, rank=ranks[0],
            note=f"lost data-parallel rank(s) {', '.join(map(str, ranks))} ({', '.join(names)}); pid "
                 f"{first.pid} is on the headless node, which joined at {self.address}",
            exit_detail="lost: its connection to the head closed (its node died, it was killed, or the network is down)",
        )  # fmt: skip

    def tell_stopping(self, reason: str) -> None:
        """The head is stopping: each joined rank gets ``HeadStopping`` (it exits 0)."""
        body = encode(HeadStopping(reason=reason))
        for identity in self.joined_identities.values():
            try:
                self.socket.send_multipart([identity, body], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def close(self) -> None:
        """Close the monitor and the socket (up to 1 s for ``HeadStopping`` on its way out)."""
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=1000)
