"""Throughput with one core taken: the offline ``LLM`` quiet, then with a busy-loop process running.

On a small machine another busy process (a build, a test run, a second engine) takes a core
the worker's torch threads were counting on. With every small op an OpenMP parallel region,
the threads then wait for each other — by spinning, on the libgomp default — and throughput
collapses. This script measures how much survives, for two sets of thread settings in the
same run:

- ``before``: ``GLASSBOX_CPU_OMP_THREADS_BIND=nobind`` and no ``OMP_*`` / ``GOMP_*``
  variables: Glassbox leaves torch's threads alone, as every version before this one did
  (torch's default count — one per core — and libgomp's default wait policy).
- ``after``: the defaults (``GLASSBOX_CPU_OMP_THREADS_BIND`` unset, i.e. ``auto``).

``--variant NAME:VAR=VALUE,VAR=VALUE`` adds more (e.g. ``omp1:OMP_NUM_THREADS=1``). Each
variant starts its own ``LLM`` (the multiprocess tree: engine core and worker in their own
processes, the worker spawned with the variant's settings) on the "small" random Llama of
``offline_throughput.py``, and all of them stay up side by side. Each round, every engine
generates the same prompts (random token ids, greedy, EOS ignored) once quiet, and once while
a ``while True: pass`` Python process that the script starts and stops itself takes a core;
quiet and taken swap order each round, and so does which engine goes first. Each figure is
the median of ``--repeats`` rounds. Besides tok/s it reports the CPU seconds the engine core
process used per second of generation (it should sleep while the worker computes), and the
load average at each run.

    .venv/bin/python benchmarks/cpu_contention.py --repeats 3
    .venv/bin/python benchmarks/cpu_contention.py --repeats 3 --variant omp1:OMP_NUM_THREADS=1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from offline_throughput import build_small_model, make_workload  # noqa: E402

# What a variant may set; everything in this list is removed from the environment first, so
# a variant runs with exactly its own settings.
THREAD_VARS = ("GLASSBOX_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
               "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "MKL_NUM_THREADS", "KMP_BLOCKTIME",
               "GLASSBOX_CPU_ADAPTIVE_THREADS")  # fmt: skip

VARIANTS = {
    "before": {"GLASSBOX_CPU_OMP_THREADS_BIND": "nobind"},
    "after": {},
}


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, settings = text.partition(":")
    env = dict(item.split("=", 1) for item in settings.split(",") if item)
    unknown = set(env) - set(THREAD_VARS)
    if not name or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:VAR=VALUE,... with VAR in {THREAD_VARS}")
    return name, env


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


class BusyCore:
    """A ``while True: pass`` Python process: it takes one core for as long as it runs."""

    def __enter__(self) -> BusyCore:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)  # let the scheduler place it
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


def _cpus(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))


def generate_once(llm, prompts, out_lens, core_proc, worker_procs) -> dict:
    """One timed ``generate``: output tok/s and CPU seconds per wall second of each process."""
    import psutil

    from engine import SamplingParams

    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in out_lens
    ]
    me = psutil.Process()

    def cpu(p) -> float:
        t = p.cpu_times()
        return t.user + t.system

    procs = {"frontend": me, "engine core": core_proc, "worker": worker_procs[0]}
    before = {k: cpu(p) for k, p in procs.items()}
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    used = {k: (cpu(p) - before[k]) / elapsed for k, p in procs.items()}
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": tokens / elapsed, "cpu": used, "load": load_average(),
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}  # fmt: skip


class Engine:
    """One variant's ``LLM`` (started with its thread settings), its engine core and worker."""

    def __init__(self, model: Path, env: dict[str, str], max_model_len: int) -> None:
        import psutil

        from engine import LLM

        saved = {k: os.environ.pop(k) for k in THREAD_VARS if k in os.environ}
        os.environ.update(env)
        try:  # the worker, spawned now, inherits exactly these settings
            self.llm = LLM(str(model), max_model_len=max_model_len)
        finally:
            for k in THREAD_VARS:
                os.environ.pop(k, None)
            os.environ.update(saved)
        self.core = psutil.Process(self.llm.engine_core.engine_proc.pid)
        self.workers = self.core.children()
        self.threads = [f"{w.num_threads()} threads on CPUs {_cpus(w.cpu_affinity())}" for w in self.workers]

    def generate(self, prompts, out_lens) -> dict:
        return generate_once(self.llm, prompts, out_lens, self.core, self.workers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 256))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="rounds; each figure is the median")
    ap.add_argument("--variant", type=parse_variant, action="append", default=[],
                    help="NAME:VAR=VALUE,... an extra set of thread settings to measure")  # fmt: skip
    ap.add_argument("--only", nargs="*", help="measure only these variants (names)")
    args = ap.parse_args()

    variants = {**VARIANTS, **dict(args.variant)}
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only}
    prompts, out_lens = make_workload(
        args.num_prompts, args.seed, tuple(args.input_len), tuple(args.output_len)
    )
    max_model_len = max(len(p) for p in prompts) + max(out_lens) + 16
    print(f"{args.num_prompts} prompts, input {args.input_len[0]}-{args.input_len[1]}, output "
          f"{args.output_len[0]}-{args.output_len[1]} tokens ({sum(out_lens)}), greedy; "
          f"{len(os.sched_getaffinity(0))} usable cores; load average {load_average()}", flush=True)  # fmt: skip
    rows: dict[str, list[dict]] = {name: [] for name in variants}
    reference = None
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model = build_small_model(Path(tmp) / "small")
        engines = {}
        for name, env in variants.items():
            engines[name] = Engine(model, env, max_model_len)
            stack.callback(engines[name].llm.shutdown)
            engines[name].generate(prompts[:2], [4, 4])  # warm-up
            print(f"  {name}: worker {engines[name].threads}", flush=True)
        names = list(variants)
        for i in range(args.repeats):
            order = names[i % len(names) :] + names[: i % len(names)]  # who goes first rotates
            result: dict[str, dict] = {name: {} for name in names}
            for condition in ("contended", "quiet") if i % 2 else ("quiet", "contended"):
                with BusyCore() if condition == "contended" else contextlib.nullcontext():
                    for name in order:
                        result[name][condition] = engines[name].generate(prompts, out_lens)
            for name in names:
                r = result[name]
                rows[name].append(r)
                for cond in ("quiet", "contended"):
                    if reference is None:
                        reference = r[cond]["tokens"]
                    elif r[cond]["tokens"] != reference:
                        print(
                            f"  WARNING: {name} {cond}: greedy tokens differ from the first run", flush=True
                        )
                q, c = r["quiet"], r["contended"]
                print(f"  round {i + 1}/{args.repeats} {name:<10} quiet {q['tok_s']:6.1f} tok/s (load {q['load']}), "
                      f"contended {c['tok_s']:6.1f} tok/s (load {c['load']}): {c['tok_s'] / q['tok_s']:.2f}x",
                      flush=True)  # fmt: skip

    print(f"\nmedians of {args.repeats}; CPU = CPU seconds per second of generate (1.0 = one core)")
    print(f"{'variant':<10}{'quiet tok/s':>12}{'contended':>11}{'ratio':>7}"
          f"{'  engine-core CPU q/c':>22}{'  worker CPU q/c':>17}{'  frontend CPU q/c':>19}")  # fmt: skip
    for name, rs in rows.items():
        q = statistics.median(r["quiet"]["tok_s"] for r in rs)
        c = statistics.median(r["contended"]["tok_s"] for r in rs)
        ratio = statistics.median(r["contended"]["tok_s"] / r["quiet"]["tok_s"] for r in rs)

        def cpu(cond: str, proc: str, rs=rs) -> float:
            return statistics.median(r[cond]["cpu"][proc] for r in rs)

        print(f"{name:<10}{q:>12.1f}{c:>11.1f}{ratio:>6.2f}x"
              f"{cpu('quiet', 'engine core'):>12.2f} / {cpu('contended', 'engine core'):.2f}"
              f"{cpu('quiet', 'worker'):>10.2f} / {cpu('contended', 'worker'):.2f}"
              f"{cpu('quiet', 'frontend'):>12.2f} / {cpu('contended', 'frontend'):.2f}")  # fmt: skip
    print(f"load average at the end {load_average()}")


if __name__ == "__main__":
    main()
