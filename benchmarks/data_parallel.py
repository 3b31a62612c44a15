"""Data parallelism on CPU: ``-dp 2`` against ``-dp 1``, and what the second engine costs.

Runs the same offline workload as ``tensor_parallel.py`` (random token ids, greedy, EOS
ignored, the "small" random Llama of ``offline_throughput.py``) through the multiprocess
tree, once per DP size and ``--repeats`` times, the sizes interleaved (1, 2, 1, 2, ...) so
that drift in the machine's load hits both alike, and prints medians of:

- start-up: ``LLM(...)`` until it is ready. DP = 2 starts two engine cores, each with its
  own worker (its own copy of the weights, its own KV cache), plus the ``DPCoordinator``;
- output tokens/s of ``generate``;
- how the client spread the work: requests sent to each engine (``requests_sent``) and the
  scheduler steps each engine ran (``step_counter`` of its latest ``SchedulerStats``);
- what the coordinator costs: the load tables it published while generating (the client's
  ``loads_seq``: at most one per 100 ms) and the CPU time of the ``DPCoordinator`` process
  over the same span, and the CPU time of the engine cores (their busy loops, with the
  pushes of (waiting, running) to the coordinator);
- the tree's resident memory (the planned processes, read from the run directory), at the
  end of ``generate``.

Each worker gets ``cores / DP`` threads (``OMP_NUM_THREADS``), so both sizes use the same
cores. DP adds no communication between the engines' forward passes — only the routing and
the load table — but on a machine with fewer cores than workers it adds no compute either:
expect little or no speed-up on 2 cores, and twice the weights in memory.

    .venv/bin/python benchmarks/data_parallel.py --num-prompts 8 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import psutil

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from offline_throughput import build_small_model  # noqa: E402
from parallel_common import (  # noqa: E402
    add_repeat_args,
    add_workload_args,
    describe,
    interleaved,
    load_average,
    median_of,
    timed_run,
    workload,
)

from engine.distributed.topology import RoleKind  # noqa: E402
from engine.utils.run_dir import planned_roles, status_file  # noqa: E402
from tracing.run_dir import read_status  # noqa: E402


def _tree(llm) -> dict:
    """``{role: psutil.Process}`` for the planned processes of ``llm``'s tree (run directory)."""
    procs = {}
    for role in planned_roles(llm.run_dir):
        status = read_status(status_file(llm.run_dir, role))
        if role.kind is not RoleKind.FRONTEND and status is not None and status.pid:
            try:
                procs[role] = psutil.Process(status.pid)
            except psutil.NoSuchProcess:
                pass
    return procs


def observe(llm) -> dict:
    """The DP client's counters and the tree's CPU seconds and memory, right now."""
    client = llm.engine_core
    client.load_balancer.engine_scores()  # drains the coordinator's published load tables: loads_seq is current
    cpu, rss = {}, 0
    for role, proc in _tree(llm).items():
        try:
            times = proc.cpu_times()
            rss += proc.memory_info().rss
        except psutil.Error:
            continue
        cpu[role.kind] = cpu.get(role.kind, 0.0) + times.user + times.system
    return {
        "requests": list(client.load_balancer.requests_sent),
        "steps": [s.step_counter for s in client.stats_table.snapshot().values()],
        "publishes": client.load_balancer.loads_seq,
        "cpu": cpu,
        "rss_mib": rss / (1 << 20),
    }


def run_one(model: Path, dp: int, prompts, outputs, cores: int, max_model_len: int) -> dict:
    row = timed_run(model, dp, prompts, outputs, cores, max_model_len, observe=observe, data_parallel_size=dp)
    before, after = row.pop("observed")
    row.pop("stats")  # engine 0's workers only; DP adds no collectives to count
    cpu = {kind: after["cpu"].get(kind, 0.0) - before["cpu"].get(kind, 0.0) for kind in after["cpu"]}
    return {
        "dp": dp,
        **row,
        "requests": [a - b for a, b in zip(after["requests"], before["requests"])],
        "steps": [a - b for a, b in zip(after["steps"], before["steps"])],
        "publishes": after["publishes"] - before["publishes"],
        "coordinator_cpu_s": cpu.get(RoleKind.DP_COORDINATOR, 0.0),
        "engine_core_cpu_s": cpu.get(RoleKind.ENGINE_CORE, 0.0),
        "worker_cpu_s": cpu.get(RoleKind.WORKER, 0.0),
        "rss_mib": after["rss_mib"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[1, 2])
    add_workload_args(parser)
    add_repeat_args(parser)
    args = parser.parse_args()

    prompts, outputs, max_model_len = workload(args)
    print(f"start: {load_average()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_small_model(Path(tmp) / "small")
        rows = interleaved(
            args.dp, args.repeats, lambda dp: run_one(model, dp, prompts, outputs, args.cores, max_model_len)
        )
    print(describe(args) + f"; median of {args.repeats} interleaved runs; end: {load_average()}")
    print(
        f"{'dp':>3} {'thr/wkr':>7} {'start-up s':>10} {'generate s':>10} {'out tok/s':>9} {'requests':>9} "
        f"{'steps':>11} {'publishes':>9} {'coord cpu s':>11} {'core cpu s':>10} {'wkr cpu s':>9} {'RSS MiB':>8}"
    )
    for dp, runs in rows.items():
        requests = "/".join(str(statistics.median(r["requests"][k] for r in runs)).removesuffix(".0")
                            for k in range(dp))  # fmt: skip
        steps = "/".join(
            str(statistics.median(r["steps"][k] for r in runs)).removesuffix(".0") for k in range(dp)
        )
        print(
            f"{dp:>3} {runs[0]['threads_per_worker']:>7} {median_of(runs, 'startup_s'):>10.1f} "
            f"{median_of(runs, 'generate_s'):>10.1f} {median_of(runs, 'output_tok_s'):>9.1f} {requests:>9} "
            f"{steps:>11} {median_of(runs, 'publishes'):>9.0f} {median_of(runs, 'coordinator_cpu_s'):>11.3f} "
            f"{median_of(runs, 'engine_core_cpu_s'):>10.2f} {median_of(runs, 'worker_cpu_s'):>9.1f} "
            f"{median_of(runs, 'rss_mib'):>8.0f}"
        )
        tok_s = ", ".join(f"{r['output_tok_s']:.1f}" for r in runs)
        startup = ", ".join(f"{r['startup_s']:.1f}" for r in runs)
        print(f"      per run: tok/s {tok_s}; start-up s {startup}")
    first = next(iter(rows.values()))[0]["tokens"]
    same = all(r["tokens"] == first for runs in rows.values() for r in runs)
    print(f"greedy tokens identical across DP sizes and runs: {same}")


if __name__ == "__main__":
    main()
