"""``glassbox serve --headless``: a node of engine cores with no API server (multi-node DP).

Mirrors vLLM's ``run_headless`` (``vllm/entrypoints/cli/serve.py``): ``vllm serve --headless
-dp D --data-parallel-size-local K --data-parallel-start-rank R --data-parallel-address HOST
--data-parallel-rpc-port P`` starts engine cores R..R+K-1 (each with its workers) under a
``CoreEngineProcManager`` and no API server; they join the head's API servers and DP
coordinator over TCP. Here:

1. this process is ``glassbox::HeadlessNode`` (the topology plan's owner of a headless node:
   shown by ``glassbox ps``, not counted); it creates its own run directory, with the plan of
   this node's ranks only as the manifest, so ``glassbox ps`` and engine-top on this node
   show this node's tree;
2. it spawns ``EngineCore_DP<k>`` for each local rank, with ``head_address`` =
   ``tcp://HOST:P`` in the spawn payload: each joins the head (``engine/core/head_link.py``),
   then starts its workers and serves the head's requests;
3. it waits. Its engine cores end when the head stops (``HeadStopping``: exit 0) or is lost
   (its connection closed: exit 1, root cause "lost the connection to the head"); the first
   to end stops the others, and this process exits 0 or 1 with the root cause printed last.
   SIGTERM or Ctrl-C stop the node (exit 0); the head then reports these ranks lost.

Its children have lifelines to it (``engine/utils/processes.py``), so killing this process
(SIGKILL too) takes the node's whole tree down within seconds.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.logger import init_logger, set_process_role
from engine.utils import processes, supervisor
from engine.utils import run_dir as run_dirs
from engine.utils.process_harness import Observability, ProcessSpec, install_stop_signals, start_observability

logger = init_logger(__name__)

EXIT_OK = 0  # stopped by SIGTERM / Ctrl-C, or the head stopped (its engine cores exited 0)
EXIT_FAILED = 1  # an engine core died or lost its head (the root cause is printed last)


class _Stop(BaseException):
    """SIGTERM or SIGINT: stop the node (a ``BaseException``, so nothing swallows it)."""


def run_headless(config: EngineConfig) -> int:
    """Run this node's engine cores until they end or the node is told to stop.

    Returns:
        The exit status: ``EXIT_OK`` or ``EXIT_FAILED``.

    Raises:
        ConfigError: the run directory cannot be made (``GLASSBOX_RUN_DIR_BASE``).
    """
    from engine.core.messages import EngineCoreSpawnPayload, encode, tcp_address
    from engine.distributed import topology
    from tracing.propagation import inject_trace_headers

    def on_signal(signum: int, frame: object) -> None:
        raise _Stop(signum)

    install_stop_signals(on_signal)
    pc = config.parallel_config
    plan = topology.plan(config, frontend="headless")
    role = plan.owner
    processes.set_process_title(role.name)
    set_process_role(role.name)
    head = tcp_address(pc.data_parallel_address, pc.data_parallel_rpc_port)
    children: list[processes.ChildProcess] = []
    run_dir: Path | None = None
    root: str | None = None
    try:
        run_dir = run_dirs.create_run_dir()
        run_dirs.write_manifest(
            run_dir, model=config.model_config.served_model_name, **run_dirs.plan_tree(plan)
        )
        start_observability(
            ProcessSpec(role.name, run_dir, observability=Observability.of(config.observability_config))
        )
        ranks = list(plan.local_dp_ranks)
        logger.info("Headless node: engine cores for data-parallel rank(s) %s of %d join the head at %s "
                    "(run directory %s)", ", ".join(map(str, ranks)), pc.data_parallel_size, head, run_dir)  # fmt: skip
        import pickle

        config_pickle = pickle.dumps(config, protocol=5)
        trace_headers = inject_trace_headers() or None
        for core in plan.local_engine_cores:
            payload = EngineCoreSpawnPayload(config_pickle=config_pickle, input_addresses=[], output_addresses=[],
                                             data_parallel_rank=core.dp_rank, trace_headers=trace_headers,
                                             head_address=head)  # fmt: skip
            children.append(processes.spawn_process(
                core.name, "engine.core.engine_core_proc:EngineCoreProc.run_engine_core", encode(payload), run_dir
            ))  # fmt: skip
        code, root = _watch(children, run_dir)
    except _Stop as stop:
        logger.info("%s: stopping this node's engine cores", signal.Signals(stop.args[0]).name)
        code = EXIT_OK
    except BaseException as e:
        root = root or f"{role.name} failed: {type(e).__name__}: {e}"
        raise
    finally:
        install_stop_signals(signal.SIG_IGN)
        for child in children:
            child.request_stop()
        deadline = time.monotonic() + 4.0
        for child in children:
            child.stop(timeout=max(deadline - time.monotonic(), 0.1))
        if run_dir is not None:
            run_dirs.close_run_dir(run_dir, failure="an engine core of this node died" if root else None,
                                   root_cause=root)  # fmt: skip
    if root:  # last, after the node's own stop lines
        print(root, file=sys.stderr, flush=True)
    return code


def _watch(children: list[processes.ChildProcess], run_dir: Path) -> tuple[int, str | None]:
    """Wait (on the children's pidfds: ``supervisor.wait_for_exit``) until an engine core
    ends; then the node ends: ``(EXIT_OK, None)`` when it ended cleanly (the head stopped),
    else ``(EXIT_FAILED, its root-cause block)`` (the blame rule, told every exit status)."""
    from tracing import run_dir as contract

    child = supervisor.wait_for_exit(children, None, first=True)[0]
    code = child.poll()
    if code == 0:
        logger.info("%s exited: the head stopped; stopping this node", child.role)
        return EXIT_OK, None
    crash = contract.read_crash_report(run_dir, child.role)
    if crash is not None:
        logger.error("%s failed: %s", child.role, crash.exception)
    exits = {c.role: c.poll() for c in children if c.poll() is not None}
    return EXIT_FAILED, processes.format_root_cause(run_dir, child.role, child.pid, code, exits=exits)


__all__ = ["run_headless", "EXIT_OK", "EXIT_FAILED"]
