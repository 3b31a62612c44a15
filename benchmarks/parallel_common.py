"""What ``tensor_parallel.py``, ``pipeline_parallel.py`` and ``data_parallel.py`` share: the
workload flags, one timed offline run of the multiprocess tree at a given parallel size, and
its comm counters; for repeated runs, interleaving, medians and the load average.

The benchmarks run the same workload (random token ids, greedy, EOS ignored) on the "small"
random Llama of ``offline_throughput.py``, give each worker ``cores / size`` threads, and
read each worker's communication counters (``get_worker_comm_stats``) after generating.
``timed_run``'s ``observe`` hook lets a benchmark read more of the live tree (the DP client's
per-engine counts, a process's CPU time) right before and right after ``generate``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from offline_throughput import make_workload  # noqa: E402


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int], int]:
    """(prompt token ids, output lengths, a max_model_len that fits every request)."""
    prompts, outputs = make_workload(
        args.num_prompts, args.seed, tuple(args.input_len), tuple(args.output_len)
    )
    return prompts, outputs, max(len(p) for p in prompts) + max(outputs) + 16


def describe(args: argparse.Namespace) -> str:
    return (
        f"\n{args.num_prompts} prompts, input {args.input_len[0]}-{args.input_len[1]}, "
        f"output {args.output_len[0]}-{args.output_len[1]} tokens, greedy; {args.cores} cores"
    )


def add_repeat_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3, help="runs of each size, interleaved (median)")


def load_average() -> str:
    """The 1/5/15-minute load average, for the record next to the figures."""
    return "load average " + " / ".join(f"{x:.2f}" for x in os.getloadavg())


def interleaved(sizes: Iterable[int], repeats: int, run: Callable[[int], dict]) -> dict[int, list[dict]]:
    """``run(size)`` ``repeats`` times per size, interleaved (1, 2, 1, 2, ...), so drift in the
    machine's load hits every size alike. Prints each run as it ends, with the load average."""
    sizes = list(sizes)
    rows: dict[int, list[dict]] = {size: [] for size in sizes}
    for i in range(repeats):
        for size in sizes:
            row = run(size)
            rows[size].append(row)
            print(f"  run {i + 1}/{repeats}, size {size}: start-up {row['startup_s']:.1f} s, "
                  f"{row['output_tok_s']:.1f} tok/s ({load_average()})", flush=True)  # fmt: skip
    return rows


def median_of(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def timed_run(
    model: Path,
    size: int,
    prompts,
    outputs,
    cores: int,
    max_model_len: int,
    observe: Callable[[Any], dict] | None = None,
    **parallel,
) -> dict:
    """One ``LLM(**parallel)`` start-up and ``generate``; ``size`` workers share ``cores``.

    Returns start-up and generate seconds, output tok/s, the greedy tokens, and each
    worker's comm stats (counted from after warm-up). With ``observe``, also
    ``observed = (observe(llm) right before generate, observe(llm) right after)``.
    """
    from engine import LLM, SamplingParams

    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // size))  # read by each freshly spawned worker
    start = time.perf_counter()
    llm = LLM(str(model), max_model_len=max_model_len, distributed_executor_backend="mp", **parallel)
    startup = time.perf_counter() - start
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
        llm.engine_core.call_utility("get_worker_comm_stats", True)  # reset after warm-up
        before = observe(llm) if observe else None
        start = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        after = observe(llm) if observe else None
        stats = llm.engine_core.call_utility("get_worker_comm_stats", False)
    finally:
        llm.shutdown()
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    return {
        "threads_per_worker": max(1, cores // size),
        "startup_s": startup,
        "generate_s": elapsed,
        "output_tok_s": tokens / elapsed,
        "tokens": [list(r.outputs[0].token_ids) for r in results],
        "stats": stats,
        **({"observed": (before, after)} if observe else {}),
    }
