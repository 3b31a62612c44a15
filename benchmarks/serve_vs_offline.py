"""Serving against offline: what the API server adds on top of the engine.

For a model (``--model small``: the benchmark's random Llama from ``offline_throughput.py``;
``--model default``: the bundled tiny model) this script, in one run:

1. starts ``glassbox serve --port 0`` and measures the time to the first answered request,
   and the API server's resident memory once warm;
2. runs ``glassbox bench serve``'s library on the offline workload (random token-id prompts,
   input 32–512, output 32–256, greedy, EOS ignored) at concurrency 16, and a shorter one
   at concurrency 1;
3. stops the server and runs the same prompts through the offline ``LLM`` (the same process
   tree, no HTTP): all at once (throughput), and one at a time (per-request latency).

It prints serving tok/s against offline tok/s (target: ≥ 70 % at concurrency 16) and the
latency HTTP adds per request at concurrency 1.

    .venv/bin/python benchmarks/serve_vs_offline.py --model small
    .venv/bin/python benchmarks/serve_vs_offline.py --model default --num-prompts 2 --input-len 8 16 --output-len 2 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import build_small_model, make_workload  # noqa: E402

from engine.bench.serve import BenchmarkConfig, SampleRequest, benchmark  # noqa: E402


def start_server(model: Path, base: Path) -> tuple[subprocess.Popen, str, float]:
    """(process, base URL, seconds from launch to the first answered completion)."""
    env = {**os.environ, "GLASSBOX_RUN_DIR_BASE": str(base)}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli.main", "serve", str(model), "--port", "0",
                             "--max-model-len", "1024", "--uvicorn-log-level", "warning"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    while True:
        if proc.poll() is not None:
            raise SystemExit("server exited during start-up")
        manifests = [json.loads(p.read_text()) for p in base.glob("glassbox-*/manifest.json")]
        if manifests and "port" in manifests[0]:
            url = f"http://127.0.0.1:{manifests[0]['port']}"
            try:
                name = httpx.get(url + "/v1/models", timeout=1).json()["data"][0]["id"]
                r = httpx.post(
                    url + "/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 1}, timeout=5
                )
                if r.status_code == 200:
                    return proc, url, time.perf_counter() - start
            except (httpx.HTTPError, ValueError, KeyError):
                pass
        time.sleep(0.05)


def serve_run(url: str, prompts, out_lens, concurrency: int):
    requests = [
        SampleRequest(prompt=p, prompt_len=len(p), expected_output_len=n) for p, n in zip(prompts, out_lens)
    ]
    config = BenchmarkConfig(base_url=url, num_prompts=len(requests), max_concurrency=concurrency)
    result = asyncio.run(benchmark(config, requests))
    assert result.metrics.failed == 0, [o.error for o in result.outputs if not o.success][:3]
    return result.metrics


def offline_run(model: Path, prompts, out_lens) -> tuple[float, float]:
    """(output tok/s with all prompts at once, mean seconds per request one at a time)."""
    from engine import LLM, SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    with LLM(str(model), max_model_len=1024) as llm:
        llm.generate([{"prompt_token_ids": prompts[0]}], params[0], use_tqdm=False)
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        throughput = sum(out_lens) / (time.perf_counter() - t)
        singles = []
        for p, sp in zip(prompts[:8], params[:8]):
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
            singles.append(time.perf_counter() - t)
    return throughput, statistics.mean(singles)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("small", "default"), default="small")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=(32, 512))
    ap.add_argument("--output-len", type=int, nargs=2, default=(32, 256))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from engine.config import DEFAULT_MODEL

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model = build_small_model(tmp_path / "small") if args.model == "small" else Path(DEFAULT_MODEL)
        vocab = 8192 if args.model == "small" else 4096
        prompts, out_lens = make_workload(
            args.num_prompts, args.seed, tuple(args.input_len), tuple(args.output_len)
        )
        prompts = [[t % vocab for t in p] for p in prompts]
        proc, url, ready_s = start_server(model, tmp_path / "run")
        try:
            rss_mib = psutil.Process(proc.pid).memory_info().rss / (1 << 20)
            c16 = serve_run(url, prompts, out_lens, 16)
            c1 = serve_run(url, prompts[:8], out_lens[:8], 1)
        finally:
            proc.terminate()
            proc.wait(10)
        offline_tps, offline_single_s = offline_run(model, prompts, out_lens)

    print(f"\nmodel: {args.model}; workload: {args.num_prompts} prompts, input {args.input_len[0]}-"
          f"{args.input_len[1]}, output {args.output_len[0]}-{args.output_len[1]}, greedy")  # fmt: skip
    print(f"start-up to first answered request: {ready_s:.2f} s; API server RSS: {rss_mib:.0f} MiB")
    print(f"{'run':<34}{'output tok/s':>13}{'TTFT ms (mean/p99)':>22}{'TPOT ms (mean/p99)':>22}")
    c1_name = f"bench serve, concurrency 1 ({min(8, len(prompts))} req)"
    for name, m in (("bench serve, concurrency 16", c16), (c1_name, c1)):
        print(f"{name:<34}{m.output_throughput:>13.1f}{m.ttft.mean_ms:>12.0f} / {m.ttft.p99_ms:<8.0f}"
              f"{m.tpot.mean_ms:>12.1f} / {m.tpot.p99_ms:<8.1f}")  # fmt: skip
    print(f"{'offline LLM.generate, all at once':<34}{offline_tps:>13.1f}")
    print(f"serving / offline throughput: {c16.output_throughput / offline_tps * 100:.1f} %")
    added_ms = c1.e2el.mean_ms - offline_single_s * 1000
    print(f"latency per request at concurrency 1: HTTP {c1.e2el.mean_ms:.0f} ms vs offline "
          f"{offline_single_s * 1000:.0f} ms (added {added_ms:+.0f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
