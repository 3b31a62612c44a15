"""Launching the engine cores, and the start-up handshake (the client's side).

Mirrors vLLM's ``vllm/v1/engine/utils.py``: ``launch_core_engines`` starts the DP coordinator
(DP > 1) and this node's engine cores (``CoreEngineProcManager`` holds their processes);
``wait_for_engine_startup`` waits until every engine is ready. Client 0 (``MPClient``) calls
both; a client that attaches to client 0's engines calls only
``wait_for_engine_registration``.

The handshake, each engine under one deadline (``GLASSBOX_ENGINE_READY_TIMEOUT_S``; a
headless node's rank from its join, itself bounded by ``GLASSBOX_DP_JOIN_TIMEOUT_S``)::

    engine core                                   client
        HELLO (EngineHandshake)        ── output socket (PULL) ──►  seen[rank]["HELLO"]
        ... loads the model, sizes its KV cache ...
        READY (KV blocks, device)      ── output socket ──────────►  seen[rank]["READY"]
        CONNECTED (DEALER id = rank)   ── input socket (ROUTER) ──►  routable from now on

On expiry the error names the engines not ready and the process holding start-up back, with
its stage (from the status files). Between bounded polls (``POLL_MS``) the wait checks that
every child is alive (``MPClient._check_alive``), so a death during start-up is one
``EngineDeadError`` naming it, not a timeout.

Deviations from vLLM: its engines say HELLO and READY on a handshake socket of their own and
get their addresses in the answer; Glassbox's get every address in their spawn payload, so
the handshake uses the client's own sockets (only headless nodes' engine cores ask for
addresses: ``engine/core/head_join.py``). Start-up is synchronous, as vLLM's: it runs in the
client's constructor, before the API server's event loop runs.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine import envs
from engine.config import ConfigError, EngineConfig
from engine.core.coordinator_messages import CoordinatorSpawnPayload, coordinator_addresses, wave_address
from engine.core.coordinator_messages import encode as encode_coordinator
from engine.core.messages import (
    ENGINE_CORE_DEAD,
    TAG_HANDSHAKE,
    EngineCoreSpawnPayload,
    EngineDead,
    EngineHandshake,
    JoinAccepted,
    decode_as,
    encode,
    head_engine_addresses,
)
from engine.distributed import topology
from engine.logger import init_logger
from engine.utils import processes
from engine.utils.supervisor import describe_laggard, find_laggard, os_state
from engine.utils.wire import ProtocolError
from tracing import WaitTimeout, wait_for
from tracing.propagation import inject_trace_headers

if TYPE_CHECKING:
    from engine.frontend.core_client import MPClient

logger = init_logger(__name__)

# One bounded wait on a socket (ms); between waits the client checks its children are alive.
POLL_MS = 100


def client_input_address(run_dir: Path, client_index: int) -> str:
    """Where client ``client_index`` sends requests from (its ROUTER: it binds, engines connect)."""
    return f"ipc://{run_dir}/in{client_index}.sock"


def client_output_address(run_dir: Path, client_index: int) -> str:
    """Where client ``client_index`` receives its engine outputs (it binds, engines connect)."""
    return f"ipc://{run_dir}/out{client_index}.sock"


def client_addresses(
    config: EngineConfig, run_dir: Path, num_clients: int
) -> tuple[JoinAccepted | None, list[str], list[str]]:
    """Every client's input and output address, by client index (vLLM's ``EngineZmqAddresses``):
    ``ipc://`` in the run directory, or, for a multi-node head, TCP on
    ``--data-parallel-address`` (then also the head's layout, which joining ranks are told).

    Raises:
        ConfigError: the ports from ``--data-parallel-rpc-port`` on run past 65535.
    """
    pc = config.parallel_config
    if not pc.multi_node:
        inputs = [client_input_address(run_dir, i) for i in range(num_clients)]
        return None, inputs, [client_output_address(run_dir, i) for i in range(num_clients)]
    try:
        layout = head_engine_addresses(pc.data_parallel_address, pc.data_parallel_rpc_port, num_clients)
    except ValueError as e:
        raise ConfigError.from_message(str(e), flag="--data-parallel-rpc-port") from None
    return layout, list(layout.input_addresses), list(layout.output_addresses)


class CoreEngineProcManager:
    """The engine-core processes this client started, one per local DP rank (vLLM's
    ``CoreEngineProcManager``).

    Args:
        config: the engine config (pickled into each spawn payload).
        run_dir: the run directory (status files, sockets).
        local_engines: the engine cores to start here (a headless node starts the others).
        input_addresses, output_addresses: every client's sockets, which each engine connects to.
        coordinator_address, coordinator_wave_address: the coordinator's sockets (None without one).

    Raises:
        OSError: a process could not be started (those already started are stopped).
    """

    def __init__(self, config: EngineConfig, run_dir: Path, local_engines: list[topology.ProcessRole], *,
                 input_addresses: list[str], output_addresses: list[str], coordinator_address: str | None,
                 coordinator_wave_address: str | None) -> None:  # fmt: skip
        self.processes: list[processes.ChildProcess] = []
        # Expert parallelism across engines: the ports where the engine cores' DP group and
        # their workers' one world meet, picked once here, before any engine starts.
        config.parallel_config.assign_dp_ports()
        config_pickle = pickle.dumps(config, protocol=5)
        trace_headers = inject_trace_headers()
        try:
            for role in local_engines:
                payload = EngineCoreSpawnPayload(
                    config_pickle=config_pickle,
                    input_addresses=input_addresses,
                    output_addresses=output_addresses,
                    data_parallel_rank=role.dp_rank,
                    trace_headers=trace_headers,
                    coordinator_address=coordinator_address,
                    coordinator_wave_address=coordinator_wave_address,
                )
                self.processes.append(
                    processes.spawn_process(
                        role.name,
                        "engine.core.engine_core_proc:EngineCoreProc.run_engine_core",
                        encode(payload),
                        run_dir,
                    )  # fmt: skip
                )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop every engine core it started (a half-done start; the client stops its whole
        tree at once otherwise)."""
        for proc in self.processes:
            proc.stop()


def coordinator_payload(
    config: EngineConfig, run_dir: Path, head_layout: JoinAccepted | None
) -> CoordinatorSpawnPayload:
    """The DP coordinator's addresses and settings: ``ipc://`` in the run directory, its input
    and wave publisher on TCP for a multi-node head (``head_layout``), where engines on other
    nodes reach them."""
    input_address, publish = coordinator_addresses(run_dir)
    waves = wave_address(run_dir)
    if head_layout is not None:
        input_address, waves = head_layout.coordinator_address, head_layout.coordinator_wave_address
    return CoordinatorSpawnPayload(
        input_address=input_address,
        publish_address=publish,
        data_parallel_size=config.parallel_config.data_parallel_size,
        wave_address=waves,
        engines_end_waves=config.parallel_config.expert_parallel_across_dp,
        trace_file=config.observability_config.trace_file,
        otlp_traces_endpoint=config.observability_config.otlp_traces_endpoint,
        trace_headers=inject_trace_headers() or None,  # the handshake's: one start-up trace
    )


def launch_core_engines(
    config: EngineConfig,
    run_dir: Path,
    local_engines: list[topology.ProcessRole],
    *,
    input_addresses: list[str],
    output_addresses: list[str],
    coordinator: tuple[topology.ProcessRole, CoordinatorSpawnPayload] | None,
) -> tuple[CoreEngineProcManager, processes.ChildProcess | None]:
    """Start the DP coordinator (``coordinator``: its role and payload; None for one engine),
    then this node's engine cores; returns their manager and the coordinator's process.

    Raises:
        OSError: a process could not be started (the ones started are stopped).
    """
    coordinator_proc = None
    if coordinator is not None:
        role, payload = coordinator
        coordinator_proc = processes.spawn_process(
            role.name,
            "engine.core.coordinator:DPCoordinator.run_coordinator",
            encode_coordinator(payload),
            run_dir,
        )
    try:
        manager = CoreEngineProcManager(
            config, run_dir, local_engines, input_addresses=input_addresses, output_addresses=output_addresses,
            coordinator_address=coordinator[1].input_address if coordinator else None,
            coordinator_wave_address=coordinator[1].wave_address if coordinator else None,
        )  # fmt: skip
    except BaseException:
        if coordinator_proc is not None:
            coordinator_proc.stop()
        raise
    return manager, coordinator_proc


class _ReadyLate(Exception):
    """An engine (multi-node DP) is past its own READY deadline (``GLASSBOX_ENGINE_READY_TIMEOUT_S``
    from its start or join) while the overall wait still runs."""


def wait_for_engine_startup(client: MPClient) -> list[EngineHandshake]:
    """HELLO then READY from each of ``client``'s engines, then CONNECTED on its input socket,
    under one deadline; the head's join socket is served meanwhile (multi-node DP).

    Returns:
        each engine's READY handshake, in DP rank order.

    Raises:
        EngineStartupTimeout: an engine was not ready in time (the message names it, the
            root cause the process holding start-up back and its stage); a headless node's
            rank never joined.
        TimeoutError: an engine core never connected its input socket.
        EngineDeadError: a child died meanwhile; ``ConfigError``: an engine refused a setting.
    """
    head_join = client.head_join
    ready_timeout = envs.GLASSBOX_ENGINE_READY_TIMEOUT_S
    join_timeout = envs.GLASSBOX_DP_JOIN_TIMEOUT_S
    started = time.monotonic()
    # Each engine has GLASSBOX_ENGINE_READY_TIMEOUT_S from its start: a local one from
    # now, a headless node's from its join (itself bounded by GLASSBOX_DP_JOIN_TIMEOUT_S).
    timeout = ready_timeout + (join_timeout if head_join is not None else 0.0)
    deadline = started + timeout
    # Per engine: the handshakes seen so far (HELLO, READY).
    seen: dict[int, dict[str, EngineHandshake]] = {r.dp_rank: {} for r in client.engine_roles}

    def handshake_step() -> bool:
        """One short poll: record HELLO / READY; True once every engine is READY."""
        if head_join is not None:
            client._serve_joins()
            missing = [r for r in head_join.remote_roles if r.dp_rank not in head_join.joined]
            if missing and time.monotonic() - started > join_timeout:
                message = head_join.timeout_message(join_timeout, missing)
                root = processes.format_root_cause(
                    client.run_dir, missing[0].name, None, None, rank=missing[0].dp_rank, note=message,
                    exit_detail="never joined (no HELLO on the head's join socket)",
                )  # fmt: skip
                raise processes.EngineStartupTimeout(message, root)
            now = time.monotonic()
            if any(
                "READY" not in seen[r.dp_rank]
                and now - head_join.joined_at.get(r.dp_rank, started) > ready_timeout
                for r in client.engine_roles
                if r.dp_rank in head_join.joined_at or r not in head_join.remote_roles
            ):
                raise _ReadyLate
        msg = _poll_output(client)
        if msg is not None and msg[0] == TAG_HANDSHAKE:
            hs = decode_as(EngineHandshake, msg[1][0])
            if hs.kind not in ("HELLO", "READY") or hs.data_parallel_rank not in seen:
                raise ProtocolError(
                    f"{hs.role} sent {hs.kind} (DP rank {hs.data_parallel_rank}) on its output "
                    "socket; HELLO or READY from a planned engine was due"
                )
            seen[hs.data_parallel_rank][hs.kind] = hs
            logger.debug("engine core %s (pid %d) said %s", hs.role, hs.pid, hs.kind)
        return all("READY" in kinds for kinds in seen.values())

    try:
        # The bounded-wait helper: a deadline, a name, and wait events for telemetry.
        awaited = f"READY from {', '.join(r.name for r in client.engine_roles)}"
        wait_for(awaited, handshake_step, timeout_s=timeout, poll_interval_s=0)
    except (WaitTimeout, _ReadyLate):
        late = [r for r in client.engine_roles if "READY" not in seen[r.dp_rank]]
        if late and head_join is not None and all(r in head_join.remote_roles for r in late):
            # Their status files are on their node.
            message = (
                f"Not every engine became ready within GLASSBOX_ENGINE_READY_TIMEOUT_S={ready_timeout:g} s "
                f"of joining; not ready: {', '.join(r.name for r in late)}, on headless node(s): `glassbox ps` "
                "or engine-top there shows the stage."
            )
            hello = head_join.joined.get(late[0].dp_rank)
            root = processes.format_root_cause(
                client.run_dir, late[0].name, hello.pid if hello else None, None, rank=late[0].dp_rank,
                note=message, exit_detail="not READY in time (it runs on a headless node)",
            )  # fmt: skip
            raise processes.EngineStartupTimeout(message, root) from None
        message = _startup_timeout_message(client, ready_timeout, seen)
        raise processes.EngineStartupTimeout(message, _startup_root_cause(client, message)) from None
    # Each engine's DEALER announces itself once connected; wait for all so the
    # first request cannot be dropped by the ROUTER.
    wait_for_engine_registration(client, deadline)
    return [seen[r.dp_rank]["READY"] for r in client.engine_roles]


def _poll_output(client: MPClient) -> tuple[bytes, list[bytes]] | None:
    """One bounded poll (``POLL_MS``) of the output socket at start-up: a message, or None
    after checking that every child is alive. Raises ``EngineDeadError`` (an engine's
    ``ENGINE_CORE_DEAD``, or a child gone)."""
    if client.output_socket.poll(POLL_MS):
        tag, *frames = client.output_socket.recv_multipart()
        if tag == ENGINE_CORE_DEAD:
            client._mark_dead(decode_as(EngineDead, frames[0]) if frames else None)
        client._check_alive()
        return tag, frames
    client._check_alive()
    return None


def wait_for_engine_registration(client: MPClient, deadline: float) -> None:
    """Every engine's CONNECTED on ``client``'s input socket (``tracing.wait_for``).

    Raises:
        TimeoutError: an engine core never connected by ``deadline`` (named).
        EngineDeadError: an engine process died meanwhile.
    """
    waiting = set(client.engine_identities)

    def all_connected() -> bool:
        if client.input_socket.poll(POLL_MS):
            frames = client.input_socket.recv_multipart()
            hs = decode_as(EngineHandshake, frames[-1])
            if hs.kind != "CONNECTED" or frames[0] not in waiting:
                raise ProtocolError(
                    f"{hs.role} sent {hs.kind} as {frames[0]!r} on its input socket; CONNECTED "
                    f"from one of {sorted(waiting)!r} was due"
                )
            waiting.discard(frames[0])
        else:
            client._check_alive()
        return not waiting

    try:
        wait_for("CONNECTED from every engine core", all_connected,
                 timeout_s=max(deadline - time.monotonic(), 0.0), poll_interval_s=0)  # fmt: skip
        return
    except WaitTimeout:
        pass
    names = [r.name for r, i in zip(client.engine_roles, client.engine_identities) if i in waiting]
    raise TimeoutError(f"the engine core(s) {', '.join(names)} never connected their input socket")


def _startup_root_cause(client: MPClient, message: str) -> str:
    """The root-cause block of a start-up deadline: the process holding start-up back (the
    deepest one in a stage, else the first that never started), with its state."""
    laggard = find_laggard(client.run_dir)
    role, pid = laggard if laggard is not None else (client.engine_role.name, None)
    if pid is None:  # no status file yet (still importing, say): this client spawned it
        pid = _spawned_pids(client).get(role)
    state = os_state(pid) if pid else None
    if state == "stopped":
        state = "stopped by a signal (SIGSTOP?)"
    return processes.format_root_cause(client.run_dir, role, pid, None, note=message, state=state)


def _spawned_pids(client: MPClient) -> dict[str, int]:
    """Role name → pid of each child ``client`` spawned (engine cores, coordinator)."""
    return {p.role: p.pid for p in client._children()}


def _startup_timeout_message(
    client: MPClient, timeout: float, seen: dict[int, dict[str, EngineHandshake]]
) -> str:
    late = describe_laggard(client.run_dir, spawned=_spawned_pids(client))
    if len(seen) == 1:
        said = "it said HELLO" if "HELLO" in seen[client.engine_role.dp_rank] else "it never said HELLO"
        return f"The engine did not become ready within GLASSBOX_ENGINE_READY_TIMEOUT_S={timeout:g} s ({said}). {late}"
    laggards = [
        f"{r.name} ({'said HELLO' if 'HELLO' in seen[r.dp_rank] else 'never said HELLO'})"
        for r in client.engine_roles
        if "READY" not in seen[r.dp_rank]
    ]
    return (
        f"Not every engine became ready within GLASSBOX_ENGINE_READY_TIMEOUT_S={timeout:g} s; "
        f"not ready: {', '.join(laggards)}. {late}"
    )
