"""What tracing costs: throughput with tracing off, at the default level, and most detailed.

Three offline engines on the "small" random Llama of ``offline_throughput.py`` (float32, one
thread per worker) are started side by side in this process:

- **off**: no exporter (spans are not recorded);
- **default**: every span to a JSON-lines file (``--trace-file``, on the run directory's
  filesystem): lifecycle stages, each step's phases, the output thread's sends, the
  broadcast, and each request's phases;
- **detailed**: the same plus ``--collect-detailed-traces all`` (each worker's
  ``worker.execute_model`` with ``model_runner.forward`` and ``model_runner.sample``).

They take turns generating the same workload (random token ids, greedy, EOS ignored), the
order rotating each round; medians of the output tok/s and the ratios to "off" are printed
with the load average. Target: default ≥ 97 % of off.

    .venv/bin/python benchmarks/tracing_overhead.py [--repeats 5] [--num-prompts 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from offline_throughput import build_small_model  # noqa: E402
from parallel_common import add_workload_args, load_average, workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--start-order", nargs=3, default=("off", "default", "detailed"),
                    choices=("off", "default", "detailed"), help="the order the three engines are started in")  # fmt: skip
    args = ap.parse_args()

    from engine import LLM, SamplingParams

    prompts, outs, max_len = workload(args)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in outs]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per worker: three engines on two cores
    os.environ["GLASSBOX_TELEMETRY"] = "0"  # measure tracing alone
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        path = build_small_model(Path(tmp) / "small")
        settings = {
            "off": {},
            "default": {"trace_file": str(Path(tmp) / "default.jsonl")},
            "detailed": {"trace_file": str(Path(tmp) / "detailed.jsonl"), "collect_detailed_traces": "all"},
        }
        # Started in --start-order (the first engine started ran a few % slower in our runs,
        # whatever its setting: swap the order to see that effect apart from tracing's).
        engines = {name: LLM(str(path), max_model_len=max_len, **settings[name]) for name in args.start_order}
        names = list(settings)
        rates: dict[str, list[float]] = {name: [] for name in names}
        try:
            for llm in engines.values():  # warm-up
                llm.generate(inputs[:2], params[:2], use_tqdm=False)
            for i in range(args.repeats):
                order = names[i % 3 :] + names[: i % 3]  # rotate who goes first
                for name in order:
                    t0 = time.perf_counter()
                    results = engines[name].generate(inputs, params, use_tqdm=False)
                    elapsed = time.perf_counter() - t0
                    tokens = sum(len(r.outputs[0].token_ids) for r in results)
                    rates[name].append(tokens / elapsed)
                    print(f"  run {i + 1}/{args.repeats} {name:>8}: {tokens / elapsed:7.1f} tok/s ({load_average()})",
                          flush=True)  # fmt: skip
            spans = {
                n: len((Path(tmp) / f"{n}.jsonl").read_text().splitlines()) for n in ("default", "detailed")
            }
        finally:
            for llm in engines.values():
                llm.shutdown()
    medians = {name: statistics.median(r) for name, r in rates.items()}
    print(f"\n{args.num_prompts} prompts, input {args.input_len[0]}-{args.input_len[1]}, output "
          f"{args.output_len[0]}-{args.output_len[1]} tokens, greedy, float32; medians of {args.repeats}")  # fmt: skip
    for name in names:
        extra = f", {spans[name]} spans written" if name in spans else ""
        print(
            f"  {name:>8}: {medians[name]:7.1f} tok/s  ({medians[name] / medians['off'] * 100:5.1f} % of off{extra})"
        )
    print(load_average())


if __name__ == "__main__":
    main()
