"""Tensor parallelism on CPU: ``-tp 2`` against ``-tp 1``, and what the all-reduces cost.

Runs the same offline workload (random token ids, greedy, EOS ignored) on the "small"
random Llama of ``offline_throughput.py`` (hidden 512, 8 layers, 8 heads, 4 KV heads,
vocab 8192) through the multiprocess tree, once per TP size, and prints for each:

- start-up: ``LLM(...)`` until it is ready (spawning the workers, the gloo rendezvous,
  loading each rank's slice, profiling, KV cache, warm-up);
- output tokens/s of ``generate``;
- rank 0's time in ``execute_model`` and, inside it, in the TP collectives: the
  all-reduces (after every row-parallel layer and the vocab-parallel embedding: 2 × layers
  + 1 per step) and the all-gather of the logits. "comm share" = collectives ÷
  execute_model.

The machine's cores are shared out between the workers (``OMP_NUM_THREADS`` = cores / TP
in each worker), so both runs use the same cores; on a small CPU expect TP to be slower,
since it adds communication without adding compute.

    .venv/bin/python benchmarks/tensor_parallel.py
    .venv/bin/python benchmarks/tensor_parallel.py --tp 1 2 --num-prompts 8
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from offline_throughput import build_small_model, make_workload  # noqa: E402


def run_one(model: Path, tp: int, prompts, outputs, cores: int, max_model_len: int) -> dict:
    from engine import LLM, SamplingParams

    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // tp))  # read by each freshly spawned worker
    start = time.perf_counter()
    llm = LLM(
        str(model), tensor_parallel_size=tp, max_model_len=max_model_len, distributed_executor_backend="mp"
    )
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
    rank0 = stats[0]
    comm = rank0["all_reduce_s"] + rank0["all_gather_s"]
    return {
        "tp": tp,
        "threads_per_worker": max(1, cores // tp),
        "startup_s": startup,
        "generate_s": elapsed,
        "output_tok_s": tokens / elapsed,
        "execute_model_s": rank0["execute_model_s"],
        "all_reduce_s": rank0["all_reduce_s"],
        "all_reduce_calls": int(rank0["all_reduce_calls"]),
        "all_gather_s": rank0["all_gather_s"],
        "comm_share": comm / rank0["execute_model_s"] if rank0["execute_model_s"] else 0.0,
        "tokens": [list(r.outputs[0].token_ids) for r in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()

    prompts, outputs = make_workload(
        args.num_prompts, args.seed, tuple(args.input_len), tuple(args.output_len)
    )
    max_model_len = max(len(p) for p in prompts) + max(outputs) + 16
    with tempfile.TemporaryDirectory() as tmp:
        model = build_small_model(Path(tmp) / "small")
        rows = [run_one(model, tp, prompts, outputs, args.cores, max_model_len) for tp in args.tp]
    print(
        f"\n{args.num_prompts} prompts, input {args.input_len[0]}-{args.input_len[1]}, "
        f"output {args.output_len[0]}-{args.output_len[1]} tokens, greedy; {args.cores} cores"
    )
    header = (
        f"{'tp':>3} {'thr/wkr':>7} {'start-up s':>10} {'generate s':>10} {'out tok/s':>9} "
        f"{'exec s':>7} {'all-red s':>9} {'calls':>6} {'gather s':>8} {'comm share':>10}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['tp']:>3} {r['threads_per_worker']:>7} {r['startup_s']:>10.1f} {r['generate_s']:>10.1f} "
            f"{r['output_tok_s']:>9.1f} {r['execute_model_s']:>7.1f} {r['all_reduce_s']:>9.2f} "
            f"{r['all_reduce_calls']:>6} {r['all_gather_s']:>8.2f} {r['comm_share']:>9.1%}"
        )
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    print(f"greedy tokens identical across TP sizes: {same}")


if __name__ == "__main__":
    main()
