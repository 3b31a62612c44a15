"""Glassbox's server against the real vLLM's: the same serving benchmark, on the same machine, interleaved.

Each engine serves the same checkpoint with its own OpenAI-compatible server (``glassbox
serve`` from this virtualenv; vLLM's, ``vllm serve``'s module, with ``--vllm-python``), and
the same client — ``glassbox bench serve``, run as its own process like a user would —
sends the same random prompts to each: by default 64 prompts of 128 token ids, 64 output
tokens each (EOS ignored), at most 16 in flight. Per start of
a server the client runs ``--bench-runs`` times (seeds 1, 2, ...); servers are started
``--runs`` times each, alternating (run 1: Glassbox, vLLM; run 2: vLLM, Glassbox; ...), and
each figure is the median over all of an engine's client runs. Also measured: process start
to the first served completion. vLLM gets ``VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>`` and
``VLLM_CPU_KVCACHE_SPACE=4`` unless they are set already.

Without ``--vllm-python`` only Glassbox runs and the last recorded vLLM serving figures
(``benchmarks/vllm_recorded.json``) are printed beside its own; ``--record`` (with
``--vllm-python``) writes this run's vLLM figures, date and CPU model there.

    .venv/bin/python benchmarks/serve_vs_vllm.py --vllm-python ~/vllm-cpu/.venv/bin/python
    .venv/bin/python benchmarks/serve_vs_vllm.py --vllm-python ~/vllm-cpu/.venv/bin/python --record
    .venv/bin/python benchmarks/serve_vs_vllm.py --runs 1 --bench-runs 1   # Glassbox only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_throughput import build_small_model  # noqa: E402
from vs_vllm import (  # noqa: E402
    _LIVE,
    RECORDED,
    VLLM_DEFAULT_ENV,
    _kill,
    _sigterm,
    check_vllm_python,
    cpu_model,
    cpu_ranges,
    load_average,
    positive_int,
    read_recorded,
    run_main,
)

METRICS = ("output_throughput", "p99_ttft_ms", "median_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One engine's server in a session of its own; ``start`` returns seconds to a served completion."""

    def __init__(self, name: str, argv: list[str], env: dict, log: Path) -> None:
        self.name, self.argv, self.env, self.log = name, argv, env, log
        self.proc: subprocess.Popen | None = None

    def start(self, port: int, timeout: float) -> float:
        self.url = f"http://127.0.0.1:{port}"
        t0 = time.perf_counter()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.argv + ["--host", "127.0.0.1", "--port", str(port)], stdout=log,
                                         stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                         start_new_session=True)  # fmt: skip
        _LIVE.add(self.proc)
        deadline = t0 + timeout
        with httpx.Client(timeout=10) as client:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    model = client.get(f"{self.url}/v1/models").json()["data"][0]["id"]
                    r = client.post(f"{self.url}/v1/completions",
                                    json={"model": model, "prompt": [5, 6, 7], "max_tokens": 1})  # fmt: skip
                    if r.status_code == 200:
                        return time.perf_counter() - t0
                except (httpx.HTTPError, KeyError, IndexError, ValueError):
                    pass
                time.sleep(0.25)
        code, waited = self.proc.poll(), time.perf_counter() - t0
        self.stop()
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
        what = (f"exited with code {code} after {waited:.1f} s" if code is not None
                else f"served no completion within {timeout:.0f} s")  # fmt: skip
        raise SystemExit(f"{self.name}'s server {what}; last lines of its log:\n{tail}")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGINT)  # Ctrl-C: each server's own shutdown
            self.proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        _kill(self.proc)  # and anything left in its process group
        self.proc = None


def bench(args, url: str, seed: int, work: Path) -> dict:
    """One ``glassbox bench serve`` run against ``url``; its result file's metrics."""
    out = work / f"bench-{time.monotonic_ns()}.json"
    cmd = [str(Path(sys.executable).parent / "glassbox"), "bench", "serve", "--base-url", url,
           "--num-prompts", str(args.num_prompts), "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--max-concurrency", str(args.max_concurrency),
           "--ignore-eos", "--seed", str(seed), "--result-json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(
            f"bench serve against {url} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
        )
    result = json.loads(out.read_text())
    if result["failed"]:
        raise SystemExit(f"bench serve against {url}: {result['failed']} request(s) failed:\n{done.stdout}")
    return {k: result[k] for k in METRICS}


def vllm_env(cores: list[int]) -> dict[str, str]:
    """vLLM's settings here unless the environment has them: threads on every usable core, 4 GiB of KV cache."""
    return {**VLLM_DEFAULT_ENV, "VLLM_CPU_OMP_THREADS_BIND": cpu_ranges(cores)}


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def span(values: list[float], fmt: str = "{:.0f}") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", help="python of a virtualenv with vLLM's CPU build")
    p.add_argument("--model", help="checkpoint to serve (default: the 'small' random Llama, built once)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--runs", type=positive_int, default=2, help="server starts per engine (default 2)")
    p.add_argument(
        "--bench-runs", type=positive_int, default=3, help="client runs per server start (default 3)"
    )
    p.add_argument("--num-prompts", type=positive_int, default=64)
    p.add_argument("--input-len", type=positive_int, default=128)
    p.add_argument("--output-len", type=positive_int, default=64)
    p.add_argument("--max-concurrency", type=positive_int, default=16)
    p.add_argument(
        "--start-timeout", type=float, default=300, help="seconds for a server to serve (default 300)"
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per client run (default 600)")
    p.add_argument("--record", action="store_true", help="write vLLM's figures into vllm_recorded.json")
    args = p.parse_args()
    if args.record and not args.vllm_python:
        p.error("--record needs --vllm-python")
    if args.model and not Path(args.model).is_dir():
        p.error(f"--model {args.model}: no such directory")
    if args.vllm_python:
        args.vllm_python = check_vllm_python(p, args.vllm_python)
    signal.signal(signal.SIGTERM, _sigterm)

    cores = sorted(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = args.model or str(build_small_model(work / "small"))
        common = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
        servers = [Server("glassbox", [str(Path(sys.executable).parent / "glassbox"), "serve", "--model", model,
                                       *common], {}, work / "glassbox.log")]  # fmt: skip
        if args.vllm_python:
            env = {k: os.environ.get(k, v) for k, v in vllm_env(cores).items()}
            # `vllm serve` is this module behind vLLM's CLI (whose version look-up fails when the
            # package is installed as `vllm-cpu`).
            argv = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *common]
            servers.append(Server("vllm", argv, env, work / "vllm.log"))
        print(f"workload: {args.num_prompts} prompts of {args.input_len} random token ids, {args.output_len} "
              f"output tokens (EOS ignored), max concurrency {args.max_concurrency}, {args.dtype}, client "
              f"`glassbox bench serve`; model {model}")  # fmt: skip
        print(f"machine: {cpu_model()}, {len(cores)} usable cores; load average {load_average()}", flush=True)

        results: dict[str, list[dict]] = {s.name: [] for s in servers}
        starts: dict[str, list[float]] = {s.name: [] for s in servers}
        for run in range(args.runs):
            for server in servers[run % len(servers) :] + servers[: run % len(servers)]:
                started = server.start(free_port(), args.start_timeout)
                starts[server.name].append(started)
                try:
                    for b in range(args.bench_runs):
                        before = load_average()
                        r = bench(args, server.url, b + 1, work)
                        results[server.name].append(r)
                        print(f"run {run + 1}/{args.runs} {server.name:<8} client run {b + 1}: "
                              f"{r['output_throughput']:6.1f} out tok/s, TTFT p99 {r['p99_ttft_ms']:6.1f} ms, "
                              f"TPOT median {r['median_tpot_ms']:5.1f} ms (started in {started:.1f} s; load "
                              f"{before} -> {load_average()})", flush=True)  # fmt: skip
                finally:
                    server.stop()

    print(f"\nmedians of {args.runs} × {args.bench_runs} client runs per engine, servers alternated; "
          f"load average now {load_average()}")  # fmt: skip
    print("| engine | output tok/s | TTFT p99 | TTFT median | TPOT median | start to a served completion |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        print(f"| {name} | **{median(runs, 'output_throughput'):.0f}** ({span([r['output_throughput'] for r in runs])}) "
              f"| {median(runs, 'p99_ttft_ms'):.0f} ms | {median(runs, 'median_ttft_ms'):.0f} ms "
              f"| {median(runs, 'median_tpot_ms'):.1f} ms | {span(starts[name], '{:.1f}')} s |")  # fmt: skip
    gb = results["glassbox"]
    if "vllm" in results:
        v = results["vllm"]
        print(f"| ratio glassbox ÷ vLLM | **{median(gb, 'output_throughput') / median(v, 'output_throughput'):.2f}×** "
              f"| {median(gb, 'p99_ttft_ms') / median(v, 'p99_ttft_ms'):.2f}× | "
              f"{median(gb, 'median_ttft_ms') / median(v, 'median_ttft_ms'):.2f}× | "
              f"{median(gb, 'median_tpot_ms') / median(v, 'median_tpot_ms'):.2f}× | |")  # fmt: skip
        if args.record:
            record(args, results, starts, len(cores))
    else:
        rec = read_recorded().get("serving")
        if rec and all(rec.get(k) == v for k, v in workload_key(args).items()):
            print(f"| vLLM, RECORDED {rec['date_text']} on {rec['cpu_model']} | {rec['output_tok_s_median']} "
                  f"({span(rec['output_tok_s'])}) | {rec['ttft_p99_ms_median']} ms | | | |")  # fmt: skip
            print(f"\nNOTE: vLLM did not run here (no --vllm-python); its figures are from {rec['date_text']}, "
                  f"{rec['cpu_model']}, {rec['cores']} cores: a ratio to them is only indicative.")  # fmt: skip
        elif rec:
            print(f"\n(no recorded vLLM serving figures for this workload; those recorded are for: "
                  f"{rec['workload']})")  # fmt: skip


def workload_key(args) -> dict:
    """What a recorded serving figure must share with this run to be shown beside it."""
    return {"dtype": args.dtype, "num_prompts": args.num_prompts, "input_len": args.input_len,
            "output_len": args.output_len, "max_concurrency": args.max_concurrency}  # fmt: skip


def lohi(values: list[float], digits: int = 0) -> list[float]:
    return [round(min(values), digits or None), round(max(values), digits or None)]


def record(args, results: dict, starts: dict, ncores: int) -> None:
    """``--record``: this run's vLLM serving figures replace the recorded ones."""
    recorded = read_recorded()
    now = datetime.datetime.now(datetime.timezone.utc)
    version = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True).stdout.strip() or "?"  # fmt: skip
    v, gb = results["vllm"], results["glassbox"]
    cores = sorted(os.sched_getaffinity(0))
    recorded["serving"] = {
        "date": now.strftime("%Y-%m-%d"),
        "date_text": f"{now:%Y-%m-%d} (benchmarks/serve_vs_vllm.py --record)",
        "engine": f"vLLM {version} CPU build",
        "vllm_version": version,
        "cpu_model": cpu_model(),
        "cores": ncores,
        "env": {k: os.environ.get(k, val) for k, val in vllm_env(cores).items() if k.startswith("VLLM_CPU")},
        "workload": f"{args.dtype}, {args.num_prompts} prompts, input {args.input_len} / output "
        f"{args.output_len}, concurrency {args.max_concurrency}, `glassbox bench serve` against each engine's "
        f"own server; {args.runs} server starts × {args.bench_runs} client runs, alternated",
        **workload_key(args),
        "output_tok_s_median": round(median(v, "output_throughput")),
        "output_tok_s": lohi([r["output_throughput"] for r in v]),
        "ttft_p99_ms_median": round(median(v, "p99_ttft_ms")),
        "ttft_p99_ms": lohi([r["p99_ttft_ms"] for r in v]),
        "startup_to_served_s": lohi(starts["vllm"], 1),
        "glassbox_same_run": {
            "output_tok_s_median": round(median(gb, "output_throughput")),
            "output_tok_s": lohi([r["output_throughput"] for r in gb]),
            "ttft_p99_ms_median": round(median(gb, "p99_ttft_ms")),
            "ttft_p99_ms": lohi([r["p99_ttft_ms"] for r in gb]),
            "startup_to_served_s": lohi(starts["glassbox"], 1),
        },
    }
    RECORDED.write_text(json.dumps(recorded, indent=2, ensure_ascii=False) + "\n")
    print(f"\nrecorded the vLLM serving figures in {RECORDED}")


if __name__ == "__main__":
    run_main(main, "servers")
