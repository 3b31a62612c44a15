"""Expert parallelism on CPU: the bundled mixture of experts at ``-dp 2 --enable-expert-parallel``
against one engine (1×1×1), and where a forward's time goes.

Runs an offline workload (random token ids, greedy, EOS ignored) on ``engine/assets/moe_model``
(a Qwen2-MoE of 4 experts, 2 per token; bfloat16 unless ``--dtype``) through the multiprocess
tree, once per configuration and ``--repeats`` times, the configurations interleaved so that
drift in the machine's load hits both alike, and prints medians of start-up seconds, generate
seconds and output tokens/s, and, from every worker's MoE counters (``get_worker_comm_stats``:
``MoETelemetry.times``), the share of its forward time spent in each phase of the MoE layers:
the router, the dispatch (to the experts' ranks), the experts, the combine (back) — and, of
dispatch and combine, the time inside the all-to-alls themselves. A worker's forwards are its
steps and, with expert parallelism, its dummy batches (they join the all-to-alls too).

Each worker gets ``cores / workers`` threads (``OMP_NUM_THREADS``), so both configurations
use the same cores: on a 2-core machine expert parallelism adds communication (gloo's
all-to-all between processes) and no compute, so expect it to be slower; what it buys — each
rank holding half the experts — pays where the experts do not fit one device.

    .venv/bin/python benchmarks/expert_parallel.py --num-prompts 16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from parallel_common import add_repeat_args, describe, interleaved, load_average, median_of, timed_run  # noqa: E402

from engine.config import MOE_MODEL  # noqa: E402

CONFIGS = {  # name → (workers, LLM keyword arguments)
    "1x1x1": (1, {}),
    "dp2 ep": (2, {"data_parallel_size": 2, "enable_expert_parallel": True}),
}
PHASES = ("router", "dispatch", "experts", "combine")


def workload(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[int], int]:
    """(prompt token ids below ``vocab_size``, output lengths, a max_model_len that fits)."""
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(*args.input_len))]
               for _ in range(args.num_prompts)]  # fmt: skip
    outputs = [rng.randint(*args.output_len) for _ in range(args.num_prompts)]
    return prompts, outputs, max(len(p) for p in prompts) + max(outputs) + 16


def worker_stats(llm) -> list[dict]:
    """Every worker's counters of every engine, reset as they are read (``timed_run``'s observe
    hook: right before ``generate``, they start from zero; right after, they are its own)."""
    return [w for engine in llm.engine_core.call_utility_each("get_worker_comm_stats", True) for w in engine]


def run_one(name: str, args: argparse.Namespace, prompts, outputs, max_model_len: int) -> dict:
    workers, parallel = CONFIGS[name]
    row = timed_run(Path(MOE_MODEL), workers, prompts, outputs, args.cores, max_model_len, observe=worker_stats,
                    dtype=args.dtype, **parallel)  # fmt: skip
    row.pop("stats")  # engine 0's only: the observe hook reads every engine's
    stats = row.pop("observed")[1]
    forward = sum(w["moe_forward_s"] for w in stats) or 1.0
    shares = {phase: sum(w[f"moe_{phase}_s"] for w in stats) / forward for phase in PHASES}
    shares["a2a"] = sum(w["moe_a2a_s"] for w in stats) / forward
    return {**row, "shares": shares}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument(
        "--dtype", default="auto", help="the model's dtype (auto: the checkpoint's, bfloat16)"
    )
    add_repeat_args(parser)
    args = parser.parse_args()

    vocab = json.loads((Path(MOE_MODEL) / "config.json").read_text())["vocab_size"]
    prompts, outputs, max_model_len = workload(args, vocab)
    print(f"start: {load_average()}", flush=True)
    rows = interleaved(
        CONFIGS, args.repeats, lambda name: run_one(name, args, prompts, outputs, max_model_len)
    )
    print(describe(args) + f"; {args.dtype} bundled MoE; median of {args.repeats} interleaved runs; end: "
          f"{load_average()}")  # fmt: skip
    print(f"{'config':<7} {'workers':>7} {'thr/wkr':>7} {'start-up s':>10} {'generate s':>10} {'out tok/s':>9} "
          f"{'router %':>8} {'dispatch %':>10} {'experts %':>9} {'combine %':>9} {'in all-to-all %':>15}")  # fmt: skip
    for name, runs in rows.items():
        shares = {k: statistics.median(r["shares"][k] for r in runs) for k in (*PHASES, "a2a")}
        print(f"{name:<7} {CONFIGS[name][0]:>7} {runs[0]['threads_per_worker']:>7} {median_of(runs, 'startup_s'):>10.1f} "
              f"{median_of(runs, 'generate_s'):>10.1f} {median_of(runs, 'output_tok_s'):>9.1f} "
              f"{100 * shares['router']:>8.1f} {100 * shares['dispatch']:>10.1f} {100 * shares['experts']:>9.1f} "
              f"{100 * shares['combine']:>9.1f} {100 * shares['a2a']:>15.1f}")  # fmt: skip
        tok_s = ", ".join(f"{r['output_tok_s']:.1f}" for r in runs)
        print(f"        per run: tok/s {tok_s}")
    first = next(iter(rows.values()))[0]["tokens"]
    same = all(r["tokens"] == first for runs in rows.values() for r in runs)
    print(f"greedy tokens identical across configurations and runs: {same}")


if __name__ == "__main__":
    main()
