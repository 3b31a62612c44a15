"""Every script in ``benchmarks/`` runs at its smallest settings and prints its table.

A smoke test, not a measurement: each script is started as a user would start it (its own
process, its own session), on the settings it is run with (the compiled step unless the
environment says otherwise), with a workload of a few tokens; the test checks that it exits
0 and that its table's header line is in its output. No figure is asserted. A benchmark
that no longer runs fails here instead of on the next person who reaches for it.
``vs_vllm.py``, ``serve_vs_vllm.py`` and ``embed_vs_vllm.py`` run without ``--vllm-python``:
Glassbox alone (the first two with the recorded vLLM figures beside it).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
TIMEOUT_S = 540  # one script, start to end: an engine start is 20-80 s on 2 busy cores, some start 3

# A workload of two prompts of 8-16 token ids, 2-4 output tokens each.
TINY = ["--num-prompts", "2", "--input-len", "8", "16", "--output-len", "2", "4"]

# script → (its smallest settings, a pattern of its table's header line)
CASES = {
    "batch_sweep": (["--batch-sizes", "1", "2", "--input-len", "8", "--output-len", "2", "--runs", "1", "--dtype",
                     "float32", "--repeats", "1"],
                    r"\| batch \| glassbox float32 \| share of the limit, glassbox float32 \|(.|\n)*"
                    r"\| dtype \| batch \| schedule \| ipc \| inputs \| forward \| sample \| update \| between \|"),
    "broadcast_latency": (["--iterations", "20", "--gap-ms", "0"], r"readers\s+measure\s+median µs\s+p99 µs"),
    "cpu_contention": (["--repeats", "1", "--only", "after", *TINY], r"variant\s+quiet tok/s\s+contended\s+ratio"),
    "cpu_fma_peak": ([], r"one core, best of 3"),
    "embed_vs_vllm": (["--num-prompts", "2", "--input-len", "8", "16", "--runs", "1"],
                      r"\| engine \| float32 embeddings/s \(prompt tok/s\) \|"),
    "data_parallel": (["--dp", "2", "--repeats", "1", *TINY], r"dp\s+thr/wkr\s+start-up s\s+generate s\s+out tok/s"),
    "expert_parallel": (["--repeats", "1", *TINY],
                        r"config\s+workers\s+thr/wkr\s+start-up s\s+generate s\s+out tok/s\s+router %"),
    "linear_kernels": (["--rows", "3", "65", "--repeats", "1"],
                       r"\| rows \| oneDNN first ms \| brgemm first ms \| oneDNN steady ms \|"),
    "offline_throughput": (["--dtype", "float32", "--runs", "1", "--hf-batch-size", "2", *TINY],
                           r"dtype\s+transformers tok/s\s+glassbox tok/s\s+ratio\s+forward share"),
    "paged_attention_kernel": (["--num-decodes", "2", "--min-len", "16", "--max-len", "32", "--repeats", "1",
                                "--inner", "1"], r"\| dtype \| timing \| TORCH_SDPA _decode \| CPU_PAGED_CPP \|"),
    "pipeline_parallel": (["--pp", "2", *TINY], r"pp\s+thr/wkr\s+start-up s\s+generate s\s+out tok/s\s+hand-off"),
    "process_tree_overhead": (["--runs", "1", *TINY], r"client\s+output tok/s\s+LLM\(\) to ready"),
    "roofline": (["--repeats", "1", "--matmul-size", "256", "--buffer-mib", "16", *TINY],
                 r"\| engine \| out tok/s \| ÷ instruction-peak bound \| ÷ matmul-peak bound \|"),
    "serve_vs_offline": (["--model", "default", *TINY], r"run\s+output tok/s\s+TTFT ms \(mean/p99\)"),
    "serve_vs_vllm": (["--runs", "1", "--bench-runs", "1", "--num-prompts", "2", "--input-len", "8",
                       "--output-len", "2", "--max-concurrency", "2"], r"\| engine \| output tok/s \| TTFT p99 \|"),
    "structured_outputs": (["--num-requests", "2", "--concurrency", "2", "--max-tokens", "8", "--repeats", "1"],
                           r"run\s+output tok/s \(each run\)\s+median\s+tokens/request"),
    "step_gaps": (["--tokens", "4"], r"median \(p90\) time between engine steps\n.*=1 .*alone .* ms"),
    "telemetry_overhead": (["--repeats", "1", *TINY], r"telemetry off: .* tok/s\s+on \(engine-top attached\)"),
    "tensor_parallel": (["--tp", "2", *TINY], r"tp\s+thr/wkr\s+start-up s\s+generate s\s+out tok/s"),
    "tracing_overhead": (["--repeats", "1", *TINY], r"off: .* tok/s .*\n.*default: .* % of off"),
    "vs_vllm": (["--dtype", "float32", "--runs", "1", *TINY], r"\| engine \| float32 out tok/s \|"),
}  # fmt: skip


def test_every_benchmark_script_has_a_smoke_case():
    scripts = {p.stem for p in BENCHMARKS.glob("*.py") if "__main__" in p.read_text()}
    assert scripts == set(CASES)


@pytest.mark.timeout(TIMEOUT_S + 20)
@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_runs_at_its_smallest_settings(script):
    args, header = CASES[script]
    if script == "cpu_fma_peak":
        if shutil.which("g++") is None:
            pytest.skip("cpu_fma_peak.py compiles its loop with g++, and there is none")
        if "avx512_bf16" not in Path("/proc/cpuinfo").read_text().split():
            pytest.skip("cpu_fma_peak.py compares vdpbf16ps with FMA; this CPU has no AVX-512 BF16")
    if script == "linear_kernels":
        import torch

        from engine.model.cpu.brgemm_linear_cpu import kernel_unavailable

        why = kernel_unavailable(torch.bfloat16)
        if why:
            pytest.skip(f"linear_kernels.py times torch's brgemm micro-kernel, which cannot run here: {why}")
    base = Path(tempfile.mkdtemp(prefix="gbb", dir="/tmp"))  # short: ipc paths ≤ 107 chars
    env = {**os.environ, "GLASSBOX_RUN_DIR_BASE": str(base)}
    env.pop("GLASSBOX_FAULT", None)
    proc = subprocess.Popen([sys.executable, str(BENCHMARKS / f"{script}.py"), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == 0, f"{script}.py exited {proc.returncode}:\n{out[-4000:]}"
        assert re.search(header, out), f"{script}.py printed no table header /{header}/:\n{out[-4000:]}"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
        shutil.rmtree(base, ignore_errors=True)
