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
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from offline_throughput import build_small_model  # noqa: E402
from parallel_common import add_workload_args, describe, timed_run, workload  # noqa: E402


def run_one(model: Path, tp: int, prompts, outputs, cores: int, max_model_len: int) -> dict:
    row = timed_run(model, tp, prompts, outputs, cores, max_model_len, tensor_parallel_size=tp)
    rank0 = row.pop("stats")[0]
    comm = rank0["all_reduce_s"] + rank0["all_gather_s"]
    return {
        "tp": tp,
        **row,
        "execute_model_s": rank0["execute_model_s"],
        "all_reduce_s": rank0["all_reduce_s"],
        "all_reduce_calls": int(rank0["all_reduce_calls"]),
        "all_gather_s": rank0["all_gather_s"],
        "comm_share": comm / rank0["execute_model_s"] if rank0["execute_model_s"] else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    add_workload_args(parser)
    args = parser.parse_args()

    prompts, outputs, max_model_len = workload(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_small_model(Path(tmp) / "small")
        rows = [run_one(model, tp, prompts, outputs, args.cores, max_model_len) for tp in args.tp]
    print(describe(args))
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
