"""What live telemetry costs: throughput with it on vs off, and engine-top's own CPU.

Two offline engines on the "small" random Llama of ``offline_throughput.py`` (float32) run
side by side in this process — one started with ``GLASSBOX_TELEMETRY=0``, one with it on
and ``engine-top`` attached to it (in a pseudo-terminal, at its default refresh) — and take
turns generating the same workload (random token ids, greedy, EOS ignored): off, on, on,
off, ... (who goes first alternates). Each run's output tok/s is recorded; the medians and
their ratio are printed, with engine-top's CPU use (% of one core, psutil) over the runs
with telemetry on and the load average. Targets: throughput on / off ≥ 98 %, engine-top ≤ 10 % of one core.

    .venv/bin/python benchmarks/telemetry_overhead.py [--repeats 5] [--num-prompts 16]
"""

from __future__ import annotations

import argparse
import os
import pty
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from offline_throughput import build_small_model  # noqa: E402
from parallel_common import add_workload_args, load_average, workload  # noqa: E402


def start_engine_top(run_dir: Path) -> tuple[subprocess.Popen, int]:
    """engine-top on a pseudo-terminal (it draws a full screen), attached to ``run_dir``."""
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "160", "LINES": "48", "TERM": "xterm-256color"}
    proc = subprocess.Popen([sys.executable, "-m", "tui", "--run-dir", str(run_dir)], stdin=slave,
                            stdout=slave, stderr=slave, env=env, start_new_session=True)  # fmt: skip
    os.close(slave)
    return proc, master


def drain_forever(fd: int) -> threading.Thread:
    """Read what engine-top draws, all along, so its writes never block on a full terminal."""

    def run() -> None:
        while True:
            try:
                if not os.read(fd, 65536):
                    return
            except OSError:
                return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from engine import LLM, SamplingParams

    prompts, outs, max_len = workload(args)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in outs]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    os.environ["OMP_NUM_THREADS"] = "1"  # each worker one thread: two engines on two cores
    with tempfile.TemporaryDirectory() as tmp:
        path = build_small_model(Path(tmp) / "small")
        os.environ["GLASSBOX_TELEMETRY"] = "0"
        off = LLM(str(path), max_model_len=max_len)
        os.environ["GLASSBOX_TELEMETRY"] = "1"
        on = LLM(str(path), max_model_len=max_len)
        top, master = start_engine_top(on.run_dir)
        drain_forever(master)
        top_ps = psutil.Process(top.pid)
        rates: dict[str, list[float]] = {"off": [], "on": []}
        top_cpu_s = top_wall_s = 0.0
        try:
            for llm in (off, on):  # warm-up
                llm.generate(inputs[:2], params[:2], use_tqdm=False)
            for i in range(args.repeats):
                order = (("off", off), ("on", on))
                for name, llm in order if i % 2 == 0 else order[::-1]:  # alternate who goes first
                    cpu0 = sum(top_ps.cpu_times()[:2])
                    t0 = time.perf_counter()
                    results = llm.generate(inputs, params, use_tqdm=False)
                    elapsed = time.perf_counter() - t0
                    cpu = sum(top_ps.cpu_times()[:2]) - cpu0
                    if name == "on":
                        top_cpu_s, top_wall_s = top_cpu_s + cpu, top_wall_s + elapsed
                    tokens = sum(len(r.outputs[0].token_ids) for r in results)
                    rates[name].append(tokens / elapsed)
                    print(f"  run {i + 1}/{args.repeats} telemetry {name:>3}: {tokens / elapsed:7.1f} tok/s, "
                          f"engine-top {cpu / elapsed * 100:4.1f} % of a core ({load_average()})", flush=True)  # fmt: skip
            alive = top.poll() is None
        finally:
            top.terminate()
            top.wait(10)
            os.close(master)
            off.shutdown()
            on.shutdown()
    med_off, med_on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(f"\n{args.num_prompts} prompts, input {args.input_len[0]}-{args.input_len[1]}, output "
          f"{args.output_len[0]}-{args.output_len[1]} tokens, greedy, float32; medians of {args.repeats}")  # fmt: skip
    print(f"telemetry off: {med_off:.1f} tok/s   on (engine-top attached): {med_on:.1f} tok/s   "
          f"on / off: {med_on / med_off * 100:.1f} %")  # fmt: skip
    print(f"engine-top: {top_cpu_s / top_wall_s * 100:.1f} % of one core while the engine worked "
          f"(still running at the end: {alive})")  # fmt: skip
    print(load_average())


if __name__ == "__main__":
    main()
