"""A headless engine core's link to the head node (multi-node data parallelism).

vLLM: a headless node's engine core (``vllm serve --headless``) connects a DEALER to the
head's handshake ROUTER at ``tcp://<data_parallel_address>:<data_parallel_rpc_port>``, says
HELLO and receives the addresses of the head's engine sockets (``EngineHandshakeMetadata``,
``vllm/v1/engine/core.py`` ``startup_handshake``). Glassbox does the same with typed
messages (``engine/core/messages.py``: ``EngineHandshake`` HELLO → ``JoinAccepted`` /
``JoinRefused``), and keeps the connection for the engine core's life, so each side learns
when the other is gone:

- both sides set ZMQ heartbeats (``HEARTBEAT_IVL_MS``, ``HEARTBEAT_TIMEOUT_MS``), so a
  head whose host vanished is noticed in seconds, not at the next TCP timeout;
- a socket monitor reports the connection's end (``EVENT_DISCONNECTED``): the head died or
  stopped → the engine core exits 1; ``HeadStopping`` on the socket is the head's clean stop
  (exit 0). The ``head_link_watcher`` thread (``watch``) polls both from the join on, so an
  engine core still loading its model does not outlive its head either.

vLLM keeps no such link: a headless engine core notices a dead head only through its DP
collectives timing out. Ours never outlives its head by more than the heartbeat timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq

from engine import envs
from engine.config import ConfigError
from engine.core.messages import EngineHandshake, HeadToEngine, JoinAccepted, JoinRefused, decode_as, encode
from engine.logger import init_logger

logger = init_logger(__name__)

# ZMQ heartbeats on the join connection (both sides): a ping each second; no answer for
# five seconds ends the connection, which each side treats as the other's death.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000


class HeadLost(RuntimeError):
    """The headless engine core lost its head (the head died or the network is down)."""


class JoinError(ConfigError):
    """The head refused this engine core, or never answered; one line naming the flag."""


def set_heartbeats(socket: zmq.Socket) -> None:
    """ZMQ heartbeats on ``socket`` (the join ROUTER on the head, the DEALER here)."""
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    socket.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


class HeadLink:
    """The joined connection to the head: ``socket`` (DEALER; ZMQ's own identity, so a second
    node claiming the same rank is still heard, and refused) and
    ``monitor`` (its monitor's PAIR socket). Build with ``HeadLink.join``.

    Attributes:
        address: the head's join address (``tcp://HOST:PORT``).
        accepted: the head's ``JoinAccepted`` (its engine sockets' addresses).
    """

    def __init__(self, ctx: zmq.Context, socket: zmq.Socket, monitor: zmq.Socket, address: str,
                 accepted: JoinAccepted) -> None:  # fmt: skip
        self.ctx, self.socket, self.monitor = ctx, socket, monitor
        self.address, self.accepted = address, accepted
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None

    @classmethod
    def join(cls, address: str, role: str, pid: int, dp_rank: int, dp_size: int) -> HeadLink:
        """Say HELLO at ``address`` and wait for the head's answer (``GLASSBOX_DP_JOIN_TIMEOUT_S``;
        the head may start later: ZMQ connects when it binds).

        Raises:
            JoinError: the head refused (the reason names the flag to fix), answered with another
                ``--data-parallel-size``, or did not answer within the deadline.
        """
        from tracing import WaitTimeout, catalogue, stage, wait_for

        ctx = zmq.Context()
        socket = ctx.socket(zmq.DEALER)
        # No fixed identity: with the DP rank as identity, the head's ROUTER would silently
        # drop a second node claiming a rank that joined already (ZMQ ignores the clash).
        socket.setsockopt(zmq.LINGER, 1000)
        set_heartbeats(socket)
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        replies: list[bytes] = []
        try:
            with stage(catalogue.ENGINE_CORE_JOIN_HEAD):
                socket.connect(address)
                hello = EngineHandshake(kind="HELLO", role=role, pid=pid, data_parallel_rank=dp_rank,
                                        data_parallel_size=dp_size)  # fmt: skip
                socket.send(encode(hello))
                timeout = envs.GLASSBOX_DP_JOIN_TIMEOUT_S
                logger.info(
                    "Joining the head at %s as data-parallel rank %d of %d", address, dp_rank, dp_size
                )

                def answered() -> bool:
                    if socket.poll(100):
                        replies.append(socket.recv())
                    return bool(replies)

                try:
                    wait_for(
                        f"the head's answer at {address}", answered, timeout_s=timeout, poll_interval_s=0
                    )
                except WaitTimeout:
                    raise JoinError.from_message(
                        f"--data-parallel-address: no head answered at {address} within "
                        f"GLASSBOX_DP_JOIN_TIMEOUT_S={timeout:g} s (is `glassbox serve -dp {dp_size} "
                        "--data-parallel-address ... --data-parallel-rpc-port ...` running there, and the port open?)",
                        flag="--data-parallel-address",
                    ) from None
            reply = decode_as(HeadToEngine, replies[0])
            if isinstance(reply, JoinRefused):
                raise JoinError.from_message(f"the head at {address} refused rank {dp_rank}: {reply.reason}",
                                             flag="--data-parallel-start-rank")  # fmt: skip
            if not isinstance(reply, JoinAccepted):
                raise JoinError.from_message(f"the head at {address} stopped before rank {dp_rank} joined",
                                             flag="--data-parallel-address")  # fmt: skip
            if reply.data_parallel_size != dp_size:
                raise JoinError.from_message(
                    f"--data-parallel-size: {dp_size} here, {reply.data_parallel_size} on the head at {address}",
                    flag="--data-parallel-size",
                )
        except BaseException:
            monitor.close(linger=0)
            socket.close(linger=0)
            ctx.term()
            raise
        logger.info("Joined the head at %s (rank %d)", address, dp_rank)
        return cls(ctx, socket, monitor, address, reply)

    def watch(self, on_news: Callable[[BaseException], None]) -> None:
        """Start the ``head_link_watcher`` thread, the only user of ``socket`` and ``monitor``
        from now on: it calls ``on_news`` once, with ``SystemExit(0)`` when the head says it
        stops (``HeadStopping``) or ``HeadLost`` when the connection ends, then returns."""
        from zmq.utils.monitor import recv_monitor_message

        from engine.core.messages import HeadStopping

        def run() -> None:
            poller = zmq.Poller()
            poller.register(self.socket, zmq.POLLIN)
            poller.register(self.monitor, zmq.POLLIN)
            while not self._closing.is_set():
                try:
                    ready = dict(poller.poll(500))
                    disconnected = (
                        self.monitor in ready
                        and recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED
                    )
                    if disconnected:
                        error = self.lost()
                        logger.error("%s; stopping this engine core", error)
                        on_news(error)
                        return
                    if self.socket in ready:
                        news = decode_as(HeadToEngine, self.socket.recv())
                        if isinstance(news, HeadStopping):
                            logger.info("the head at %s stops (%s); stopping this engine core", self.address,
                                        news.reason)  # fmt: skip
                            on_news(SystemExit(0))
                            return
                except zmq.ZMQError:  # closed under us: shutting down
                    return

        self._watcher = threading.Thread(target=run, name="head_link_watcher", daemon=True)
        self._watcher.start()

    def lost(self) -> HeadLost:
        """The error for a closed connection."""
        return HeadLost(
            f"lost the connection to the head at {self.address} (the head stopped or died, or the "
            f"network is down; heartbeat timeout {HEARTBEAT_TIMEOUT_MS / 1000:g} s)"
        )

    def close(self) -> None:
        """Stop the watcher (at most its 0.5 s poll), then close both sockets."""
        self._closing.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2.0)
        try:
            self.socket.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
        self.socket.close(linger=0)
        self.ctx.term()
