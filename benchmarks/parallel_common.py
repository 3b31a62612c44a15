"""What ``tensor_parallel.py`` and ``pipeline_parallel.py`` share: the workload flags, one
timed offline run of the multiprocess tree at a given parallel size, and its comm counters.

Both benchmarks run the same workload (random token ids, greedy, EOS ignored) on the "small"
random Llama of ``offline_throughput.py``, give each worker ``cores / size`` threads, and
read each worker's communication counters (``get_worker_comm_stats``) after generating.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

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


def timed_run(model: Path, size: int, prompts, outputs, cores: int, max_model_len: int, **parallel) -> dict:
    """One ``LLM(**parallel)`` start-up and ``generate``; ``size`` workers share ``cores``.

    Returns start-up and generate seconds, output tok/s, the greedy tokens, and each
    worker's comm stats (counted from after warm-up).
    """
    from engine import LLM, SamplingParams

    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // size))  # read by each freshly spawned worker
    start = time.perf_counter()
    llm = LLM(str(model), max_model_len=max_model_len, distributed_executor_backend="mp", **parallel)
    startup = time.perf_counter() - start
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
        llm.engine_core.call_utility("get_worker_comm_stats", True)  # reset after warm-up
        start = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
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
    }
