"""Pipeline parallelism on CPU: ``-pp 2`` against ``-pp 1``, and what the stage hand-off costs.

Runs the same offline workload as ``tensor_parallel.py`` (random token ids, greedy, EOS
ignored, the "small" random Llama of ``offline_throughput.py``: 8 layers, so 4 per stage)
through the multiprocess tree, once per PP size, and prints for each:

- start-up: ``LLM(...)`` until it is ready;
- output tokens/s of ``generate``;
- per stage, its time in ``execute_model``, in sending its hidden states on (``send s``,
  stages before the last) and in waiting for / receiving the previous stage's (``recv s``,
  stages after the first; this includes the time the previous stage computes, since one
  batch is in the pipeline at a time). "hand-off share" = stage 0's send ÷ its
  execute_model: the communication itself.

Each worker gets ``cores / PP`` threads. Without micro-batching (left out: vLLM keeps up to
PP batches in flight) the stages take turns, so on one machine expect PP to be slower than
PP = 1: the same compute, fewer threads per layer, plus the hand-off.

    .venv/bin/python benchmarks/pipeline_parallel.py --num-prompts 8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from offline_throughput import build_small_model  # noqa: E402
from parallel_common import add_workload_args, describe, timed_run, workload  # noqa: E402


def run_one(model: Path, pp: int, prompts, outputs, cores: int, max_model_len: int) -> dict:
    row = timed_run(model, pp, prompts, outputs, cores, max_model_len, pipeline_parallel_size=pp)
    stats = row.pop("stats")  # one per stage (tp = 1)
    first = stats[0]
    return {
        "pp": pp,
        **row,
        "stages": [(s["execute_model_s"], s["pp_send_s"], s["pp_recv_s"]) for s in stats],
        "handoff_share": first["pp_send_s"] / first["execute_model_s"] if first["execute_model_s"] else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2])
    add_workload_args(parser)
    args = parser.parse_args()

    prompts, outputs, max_model_len = workload(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_small_model(Path(tmp) / "small")
        rows = [run_one(model, pp, prompts, outputs, args.cores, max_model_len) for pp in args.pp]
    print(describe(args))
    print(
        f"{'pp':>3} {'thr/wkr':>7} {'start-up s':>10} {'generate s':>10} {'out tok/s':>9} {'hand-off share':>14}"
    )
    for r in rows:
        print(
            f"{r['pp']:>3} {r['threads_per_worker']:>7} {r['startup_s']:>10.1f} {r['generate_s']:>10.1f} "
            f"{r['output_tok_s']:>9.1f} {r['handoff_share']:>13.1%}"
        )
        for stage, (exec_s, send_s, recv_s) in enumerate(r["stages"]):
            print(
                f"      stage {stage}: execute_model {exec_s:.2f} s, send {send_s:.2f} s, recv {recv_s:.2f} s"
            )
    same = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    print(f"greedy tokens identical across PP sizes: {same}")


if __name__ == "__main__":
    main()
