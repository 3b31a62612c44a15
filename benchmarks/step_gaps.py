"""Why the engine core has a process of its own: step gaps with and without multiprocessing.

One offline ``LLM`` generates one greedy request of ``--tokens`` tokens (one engine step
per token), twice: alone, then while a thread of the same process tokenizes prompts in a
loop — the work an API server does for every request that arrives. It does so with the
engine core in its own process (``GLASSBOX_ENABLE_MULTIPROCESSING=1``, the default) and in
the caller's process (``=0``, vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). The step gap is
the time from one ``engine_core.step`` span's start to the next (``--trace-file``): the
time per output token. In one process, the tokenizing thread and the busy loop share one
GIL, so every step waits for its turn; in two processes they do not.

    python benchmarks/step_gaps.py             # 128 tokens per run
    python benchmarks/step_gaps.py --tokens 16 --json

Each mode runs in a fresh interpreter (the variable is read as the engine starts). Prints
one line per mode, or with ``--json`` one object: for each mode, the median and 90th-percentile
step gap (ms) alone and loaded, how many prompts the thread tokenized meanwhile, and the
processes whose spans the trace file holds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Return the value for the given object, or None if the target object is not found. " * 8
MODES = {"1": "engine core in its own process", "0": "engine core in this process"}


def _gaps_ms(trace_file: Path, since_ns: int, until_ns: int) -> list[float]:
    starts = []
    for line in trace_file.read_text().splitlines():
        try:
            span = json.loads(line)
        except ValueError:
            continue
        if span.get("name") == "engine_core.step" and since_ns <= span["start_ns"] <= until_ns:
            starts.append(span["start_ns"])
    starts.sort()
    return [(b - a) / 1e6 for a, b in zip(starts, starts[1:])]


def _summary(gaps: list[float]) -> dict[str, float | int]:
    gaps = sorted(gaps)
    p90 = gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))] if gaps else float("nan")
    return {"median_ms": round(statistics.median(gaps), 3) if gaps else float("nan"),
            "p90_ms": round(p90, 3), "steps": len(gaps) + 1 if gaps else 0}  # fmt: skip


def child(tokens: int) -> dict:
    """One mode, in this interpreter (GLASSBOX_ENABLE_MULTIPROCESSING is set by the parent)."""
    from engine.entrypoints.llm import LLM
    from engine.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        trace_file = Path(tmp) / "spans.jsonl"
        llm = LLM(trace_file=str(trace_file))
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        llm.generate(["Return the"], SamplingParams(max_tokens=2, temperature=0))  # warm
        result = {}
        for load in (False, True):
            stop, tokenized = threading.Event(), [0]

            def tokenize(stop: threading.Event = stop, tokenized: list[int] = tokenized) -> None:
                while not stop.is_set():
                    llm.tokenizer.encode(PROMPT)
                    tokenized[0] += 1

            thread = threading.Thread(target=tokenize, daemon=True) if load else None
            if thread is not None:
                thread.start()
                time.sleep(0.2)  # the thread is busy before the request starts
            t0 = time.time_ns()
            llm.generate(["Return the"], params)
            t1 = time.time_ns()
            stop.set()
            if thread is not None:
                thread.join()
            time.sleep(0.3)  # the engine core's last spans reach the file
            result["loaded" if load else "alone"] = {**_summary(_gaps_ms(trace_file, t0, t1)),
                                                     "prompts_tokenized": tokenized[0]}  # fmt: skip
        llm.shutdown()
        # The processes whose spans are in the file: the engine core's own, or the LLM's.
        roles: dict[str, None] = {}
        for line in trace_file.read_text().splitlines():
            try:
                roles.setdefault(json.loads(line)["resource"]["glassbox.role"], None)
            except (ValueError, KeyError, TypeError):
                continue
        result["processes_with_spans"] = list(roles)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens (engine steps) per run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.tokens)))
        return 0
    report: dict = {"tokens": args.tokens, "cpu": _cpu(), "modes": {}}
    for value in MODES:
        env = {**os.environ, "GLASSBOX_ENABLE_MULTIPROCESSING": value, "GLASSBOX_LOGGING_LEVEL": "WARNING",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
        done = subprocess.run([sys.executable, __file__, "--child", "--tokens", str(args.tokens)], env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-3000:])
            return 1
        report["modes"][f"GLASSBOX_ENABLE_MULTIPROCESSING={value}"] = json.loads(done.stdout.splitlines()[-1])
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{report['cpu']}; {args.tokens} tokens per run; median (p90) time between engine steps")
    for value, label in MODES.items():
        m = report["modes"][f"GLASSBOX_ENABLE_MULTIPROCESSING={value}"]
        print(f"GLASSBOX_ENABLE_MULTIPROCESSING={value} ({label}): alone {m['alone']['median_ms']:.1f} ms "
              f"({m['alone']['p90_ms']:.1f}), while this process tokenizes {m['loaded']['median_ms']:.1f} ms "
              f"({m['loaded']['p90_ms']:.1f})")  # fmt: skip
    return 0


def _cpu() -> str:
    name = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{name}, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} CPUs"
    )


if __name__ == "__main__":
    sys.exit(main())
