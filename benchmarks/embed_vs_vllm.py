"""Embeddings per second: Glassbox's pooling runner against vLLM's, offline, interleaved.

The workload: ``--num-prompts`` (256) prompts of random token ids, lengths uniform in
``--input-len`` (32–256), embedded in one ``LLM.embed`` call, on the "small" random Llama of
``offline_throughput.py`` (hidden 512, 8 layers; built once with transformers in a temporary
directory, nothing downloaded) converted to an embedding model: last-token pooling,
normalised — both engines' defaults for ``runner="pooling"``, ``max_model_len`` 512.

Every run of every engine is a fresh Python process (``vs_vllm.py``'s way: a child script, a
JSON job, one result line):

- Glassbox with this virtualenv's python: ``LLM(model, runner="pooling", dtype=...,
  max_model_len=512)`` on its defaults (the process tree, the compiled step);
- vLLM with ``--vllm-python`` (its CPU build): ``LLM(model=..., runner="pooling", dtype=...,
  max_model_len=512, seed=0)`` with ``VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>`` and
  ``VLLM_CPU_KVCACHE_SPACE=4`` unless set.

Each child builds its ``LLM`` (timed), embeds 2 prompts to warm up, then the whole workload
(``embed([{"prompt_token_ids": ids}, ...])``), checks one unit-length vector per prompt, and
prints embeddings/s and prompt tokens/s. Runs are interleaved (run 1: Glassbox, vLLM; run 2:
vLLM, Glassbox; ...) and each figure is the median of ``--runs``. The script prints the table,
the ratio, the CPU model, the core count and the load average before and after every run, and
how close the two engines' vectors are (the smallest cosine over the prompts). On a shared,
loaded machine the figures are indicative only.

    .venv/bin/python benchmarks/embed_vs_vllm.py --vllm-python ~/vllm-cpu/.venv/bin/python
    .venv/bin/python benchmarks/embed_vs_vllm.py --vllm-python ~/vllm-cpu/.venv/bin/python --dtype both --runs 5
    .venv/bin/python benchmarks/embed_vs_vllm.py --num-prompts 8 --runs 1     # Glassbox only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)]

from offline_throughput import MODEL_SIZES, SMALL, build_small_model, describe_model  # noqa: E402
from vs_vllm import (  # noqa: E402
    REPO,
    VLLM_DEFAULT_ENV,
    _sigterm,
    check_vllm_python,
    cpu_model,
    cpu_ranges,
    fmt_range,
    load_average,
    positive_int,
    run_child_script,
    run_main,
)

RESULT = "EMBED_VS_VLLM_RESULT "

# The child: one engine, one run; standard library only at the top (it must not import
# Glassbox under vLLM's python).
CHILD = r"""
import json, math, sys, time


def main():
    job = json.load(open(sys.argv[1]))
    t0 = time.perf_counter()
    if job["engine"] == "vllm":
        import vllm
        from vllm import LLM

        version = vllm.__version__
        kwargs = dict(model=job["model"], runner="pooling", dtype=job["dtype"],
                      max_model_len=job["max_model_len"], seed=0)
    else:
        import engine
        from engine import LLM

        version = engine.__version__
        kwargs = dict(model=job["model"], runner="pooling", dtype=job["dtype"], max_model_len=job["max_model_len"])
    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    ready_s = time.perf_counter() - t0

    def embed(prompts):
        t = time.perf_counter()
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        seconds = time.perf_counter() - t
        vectors = [list(o.outputs.embedding) for o in outs]
        bad = [i for i, v in enumerate(vectors) if abs(math.sqrt(sum(x * x for x in v)) - 1) > 1e-2]
        if len(vectors) != len(prompts) or bad:
            sys.exit(f"{len(vectors)} vectors for {len(prompts)} prompts; not of unit length: {bad[:5]}")
        return seconds, vectors

    warmup_s, _ = embed(job["prompts"][:2])
    embed_s, vectors = embed(job["prompts"])
    with open(job["vectors_path"], "w") as f:
        json.dump(vectors, f)
    tokens = sum(map(len, job["prompts"]))
    result = dict(engine=job["engine"], version=version, dtype=job["dtype"], import_s=import_s, ready_s=ready_s,
                  warmup_s=warmup_s, embed_s=embed_s, embeddings_s=len(vectors) / embed_s, tok_s=tokens / embed_s)
    print("@RESULT@" + json.dumps(result), flush=True)
    if job["engine"] != "vllm":
        llm.shutdown()


if __name__ == "__main__":  # vLLM's engine core is spawned: it imports this script again
    main()
""".replace("@RESULT@", RESULT)


def make_prompts(n: int, seed: int, in_range: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, SMALL["vocab_size"]) for _ in range(rng.randint(*in_range))] for _ in range(n)]


def run_child(engine: str, python: str, env: dict, dtype: str, tag: str, work: Path, common: dict,
              timeout: float) -> dict:  # fmt: skip
    """One fresh process of ``engine``; its JSON result plus its vectors."""
    vectors_path = work / f"{tag}.vectors.json"
    job = {**common, "engine": engine, "dtype": dtype, "vectors_path": str(vectors_path)}
    result = run_child_script(python, job, tag, work, env, timeout, RESULT, f"{engine} ({dtype})")[0]
    result["vectors"] = json.loads(vectors_path.read_text())
    vectors_path.unlink()
    return result


def min_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    """The smallest cosine similarity between the two engines' vectors of the same prompt."""

    def cos(x: list[float], y: list[float]) -> float:
        dot = sum(p * q for p, q in zip(x, y))
        return dot / (sum(p * p for p in x) ** 0.5 * sum(q * q for q in y) ** 0.5)

    return min(cos(x, y) for x, y in zip(a, b))


def main() -> None:
    signal.signal(signal.SIGTERM, _sigterm)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=positive_int, default=256)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 256))
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "both"), default="float32")
    ap.add_argument(
        "--runs", type=positive_int, default=3, help="runs per engine and dtype; figures are medians"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--vllm-python", help="python of a virtualenv with vLLM's CPU build (omit: Glassbox only)"
    )
    ap.add_argument("--timeout", type=float, default=1200, help="seconds one child may take")
    ap.add_argument("--log-dir", help="keep every child's job, stdout and stderr here (default: deleted)")
    args = ap.parse_args()
    if args.input_len[1] > args.max_model_len:
        ap.error(f"--input-len up to {args.input_len[1]} exceeds --max-model-len {args.max_model_len}")
    if args.vllm_python:
        args.vllm_python = check_vllm_python(ap, args.vllm_python)

    cores = sorted(os.sched_getaffinity(0))
    engines = {"glassbox": (sys.executable, {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                                         os.environ.get("PYTHONPATH")]))})}  # fmt: skip
    if args.vllm_python:
        env = {k: os.environ.get(k, v) for k, v in VLLM_DEFAULT_ENV.items()}
        env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cpu_ranges(cores))
        engines["vllm"] = (args.vllm_python, env)
    dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
    prompts = make_prompts(args.num_prompts, args.seed, tuple(args.input_len))
    workload = (f"{args.num_prompts} prompts of random token ids (seed {args.seed}), {args.input_len[0]}–"
                f"{args.input_len[1]} tokens ({sum(map(len, prompts))} in all), one LLM.embed call, LAST pooling, "
                f"normalised, max_model_len {args.max_model_len}; model: {describe_model(MODEL_SIZES['small'])}, "
                f"runner='pooling'")  # fmt: skip
    machine = f"{cpu_model()}, {len(cores)} usable cores (CPUs {cpu_ranges(cores)})"
    print(f"workload: {workload}\nmachine: {machine}; load average {load_average()}\n", flush=True)

    results: dict[tuple[str, str], list[dict]] = {}
    names = list(engines)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.log_dir) if args.log_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = build_small_model(Path(tmp) / "small", MODEL_SIZES["small"])
        (work / "child.py").write_text(CHILD)
        common = {"model": str(model), "max_model_len": args.max_model_len, "prompts": prompts}
        for run in range(args.runs):
            for dtype in dtypes:
                for name in names[run % len(names) :] + names[: run % len(names)]:
                    python, env = engines[name]
                    before = load_average()
                    r = run_child(
                        name, python, env, dtype, f"run{run + 1}-{dtype}-{name}", work, common, args.timeout
                    )
                    r["load"] = (before, load_average())
                    results.setdefault((name, dtype), []).append(r)
                    print(f"run {run + 1}/{args.runs} {dtype:<8} {name:<9} {r['embeddings_s']:8.1f} embeddings/s "
                          f"({r['tok_s']:8.0f} prompt tok/s), embed {r['embed_s']:6.2f} s, LLM(...) to ready "
                          f"{r['ready_s']:5.1f} s, load average {r['load'][0]} -> {r['load'][1]}", flush=True)  # fmt: skip

    def median(name: str, dtype: str, key: str) -> float:
        return statistics.median(r[key] for r in results[(name, dtype)])

    print(f"\nworkload: {workload}")
    print(f"machine: {machine}; medians of {args.runs} runs, each engine in a fresh process per run, "
          f"interleaved; load average now {load_average()}. A shared, loaded machine: the figures are "
          f"indicative.\n")  # fmt: skip
    print(
        "| engine | "
        + " | ".join(f"{d} embeddings/s (prompt tok/s)" for d in dtypes)
        + " | `LLM(...)` to ready |"
    )
    print("|---" * (len(dtypes) + 2) + "|")
    for name in names:
        version = results[(name, dtypes[0])][0]["version"]
        label = f"Glassbox {version} (process tree, defaults)" if name == "glassbox" else (
            f"vLLM {version} CPU build (VLLM_CPU_OMP_THREADS_BIND={engines[name][1]['VLLM_CPU_OMP_THREADS_BIND']}, "
            f"VLLM_CPU_KVCACHE_SPACE={engines[name][1]['VLLM_CPU_KVCACHE_SPACE']})"
        )  # fmt: skip
        cells = " | ".join(
            f"{median(name, d, 'embeddings_s'):,.1f} ({median(name, d, 'tok_s'):,.0f})" for d in dtypes
        )
        ready = [r["ready_s"] for d in dtypes for r in results[(name, d)]]
        print(f"| {label} | {cells} | {fmt_range(ready)} |")
    if "vllm" in engines:
        ratios = " | ".join(f"**{median('glassbox', d, 'embeddings_s') / median('vllm', d, 'embeddings_s'):.2f}×**"
                            for d in dtypes)  # fmt: skip
        print(f"| ratio Glassbox ÷ vLLM | {ratios} | |")
        for d in dtypes:
            cosine = min_cosine(results[("glassbox", d)][0]["vectors"], results[("vllm", d)][0]["vectors"])
            print(f"\n{d}: smallest cosine between the two engines' vectors of the same prompt: {cosine:.6f}")
    else:
        print("\n(vLLM did not run: no --vllm-python; Glassbox alone)")


if __name__ == "__main__":
    run_main(main, "engines")
