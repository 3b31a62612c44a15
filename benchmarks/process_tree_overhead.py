"""What the process tree costs: the offline workload through ``SyncMPClient`` (engine core and
worker in their own processes) against ``InprocClient`` (everything in this process).

Same workload and model as ``offline_throughput.py`` (the "small" random Llama, 32 prompts,
input 32–512, output 32–256 tokens, greedy, EOS ignored), float32. Prints output tokens/s of
each, their ratio (target: the tree ≥ 90 % of in-process), and the time from ``LLM(...)``
to ready for each. The shared-memory broadcast latency is ``broadcast_latency.py``.

    .venv/bin/python benchmarks/process_tree_overhead.py [--runs 3] [--num-prompts 32]
    .venv/bin/python benchmarks/process_tree_overhead.py --runs 1 --num-prompts 2 --input-len 8 16 --output-len 2 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import build_small_model, make_workload  # noqa: E402


def measure(path: Path, multiprocess: bool, prompts, out_lens, runs: int, dtype: str) -> tuple[float, float]:
    """(median seconds for the workload, seconds from LLM(...) to ready)."""
    from engine import LLM, SamplingParams

    os.environ["GLASSBOX_ENABLE_MULTIPROCESSING"] = "1" if multiprocess else "0"
    start = time.perf_counter()
    llm = LLM(str(path), dtype=dtype, max_model_len=1024)
    ready = time.perf_counter() - start
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in out_lens
    ]
    with llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params[:2], use_tqdm=False)  # warm-up
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            times.append(time.perf_counter() - t)
    return statistics.median(times), ready


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    prompts, out_lens = make_workload(
        args.num_prompts, args.seed, tuple(args.input_len), tuple(args.output_len)
    )
    total = sum(out_lens)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_small_model(Path(tmp) / "small")
        inproc_s, inproc_ready = measure(path, False, prompts, out_lens, args.runs, args.dtype)
        tree_s, tree_ready = measure(path, True, prompts, out_lens, args.runs, args.dtype)
    print(
        f"\nworkload: {args.num_prompts} prompts, input {args.input_len[0]}-{args.input_len[1]}, "
        f"{total} output tokens, {args.dtype}, median of {args.runs} runs"
    )
    print(f"{'client':<28}{'output tok/s':>14}{'LLM() to ready':>17}")
    print(f"{'InprocClient (1 process)':<28}{total / inproc_s:>14.1f}{inproc_ready:>16.2f}s")
    print(f"{'SyncMPClient (3 processes)':<28}{total / tree_s:>14.1f}{tree_ready:>16.2f}s")
    print(f"tree / in-process throughput: {inproc_s / tree_s * 100:.1f} %")


if __name__ == "__main__":
    main()
