"""How fast one core of this CPU multiplies and adds: float32 FMA against bfloat16 dot products.

A matmul on a CPU without AMX runs on one of two AVX-512 instructions: ``vfmadd231ps``
(16 float32 multiply-adds) or, for bfloat16 operands, ``vdpbf16ps`` (32 bfloat16 products
summed in pairs into 16 float32 lanes). Which one a bfloat16 model should use depends on how
many of each the core can start per second — the instruction tables differ between CPUs
(on AMD Zen 4 ``vdpbf16ps`` does twice the work of an FMA in the same time; on the Intel
Xeon these notes were measured on it does half as much per second). This script compiles a
loop of 12 independent chains of each (g++, ``-march=native``), times it on one core and
prints instructions and multiply-adds per second:

    .venv/bin/python benchmarks/cpu_fma_peak.py

Raises SystemExit when there is no g++ or the CPU lacks AVX-512 BF16.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>

int main() {
    const long n = 240000000;  // instructions of each kind
    __m512 acc[12];
    for (int i = 0; i < 12; i++) acc[i] = _mm512_set1_ps(i * 1e-9f);
    const __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
    const __m512bh one = (__m512bh)_mm512_set1_epi16(0x3f80);  // bfloat16 1.0
    auto t0 = std::chrono::steady_clock::now();
    for (long k = 0; k < n / 12; k++)
#pragma GCC unroll 12  // unrolled, the 12 sums stay in registers
        for (int i = 0; i < 12; i++) acc[i] = _mm512_fmadd_ps(x, y, acc[i]);
    auto t1 = std::chrono::steady_clock::now();
    for (long k = 0; k < n / 12; k++)
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbf16_ps(acc[i], one, one);
    auto t2 = std::chrono::steady_clock::now();
    float sink = 0;
    for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_ps(acc[i]);
    double fma = std::chrono::duration<double>(t1 - t0).count();
    double dp = std::chrono::duration<double>(t2 - t1).count();
    std::printf("%.4f %.4f %g\n", n / fma / 1e9, n / dp / 1e9, sink);
}
"""


def main() -> None:
    if shutil.which("g++") is None:
        raise SystemExit("cpu_fma_peak.py needs g++")
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if "avx512_bf16" not in flags:
        raise SystemExit("this CPU has no AVX-512 BF16 (vdpbf16ps): nothing to compare")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.cpp", Path(tmp) / "peak"
        src.write_text(SOURCE)
        subprocess.run(["g++", "-O2", "-march=native", str(src), "-o", str(exe)], check=True)
        runs = [subprocess.run(["taskset", "-c", "0", str(exe)] if shutil.which("taskset") else [str(exe)],
                               capture_output=True, text=True, check=True).stdout.split() for _ in range(3)]  # fmt: skip
    fma = max(float(r[0]) for r in runs)
    dp = max(float(r[1]) for r in runs)
    print("one core, best of 3 (12 independent chains each):")
    print(
        f"  vfmadd231ps zmm (float32 FMA):      {fma:5.2f} G instructions/s = {fma * 16:6.1f} G multiply-adds/s"
    )
    print(
        f"  vdpbf16ps zmm (bfloat16 dot pairs):  {dp:5.2f} G instructions/s = {dp * 32:6.1f} G multiply-adds/s"
    )
    print(f"  bfloat16 ÷ float32 multiply-add rate: {dp * 32 / (fma * 16):.2f}×")


if __name__ == "__main__":
    sys.exit(main())
