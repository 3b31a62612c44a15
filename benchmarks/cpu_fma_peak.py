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
    auto t0 = std::chrono::steady_clock::now();
    for (long k = 0; k < n / 12; k++)
#pragma GCC unroll 12  // unrolled, the 12 sums stay in registers
        for (int i = 0; i < 12; i++) acc[i] = _mm512_fmadd_ps(x, y, acc[i]);
    auto t1 = std::chrono::steady_clock::now();
#ifdef __AVX512BF16__  // without it (g++ -march=native says) the second figure is 0
    const __m512bh one = (__m512bh)_mm512_set1_epi16(0x3f80);  // bfloat16 1.0
    for (long k = 0; k < n / 12; k++)
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbf16_ps(acc[i], one, one);
    const bool bf16 = true;
#else
    const bool bf16 = false;
#endif
    auto t2 = std::chrono::steady_clock::now();
    float sink = 0;
    for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_ps(acc[i]);
    double fma = std::chrono::duration<double>(t1 - t0).count();
    double dp = std::chrono::duration<double>(t2 - t1).count();
    std::printf("%.4f %.4f %g\n", n / fma / 1e9, bf16 ? n / dp / 1e9 : 0.0, sink);
}
"""


def cpu_flags() -> set[str]:
    """The feature flags of /proc/cpuinfo (empty where there is none)."""
    path = Path("/proc/cpuinfo")
    return set(path.read_text().split()) if path.exists() else set()


def compile_peak(directory: Path) -> Path:
    """``SOURCE`` compiled with g++ -O2 -march=native into ``directory``; the executable's path.
    It prints G instructions/s of vfmadd231ps and of vdpbf16ps (0 where the CPU has no BF16)."""
    src, exe = directory / "peak.cpp", directory / "peak"
    src.write_text(SOURCE)
    subprocess.run(["g++", "-O2", "-march=native", str(src), "-o", str(exe)], check=True)
    return exe


def start_peak(exe: Path, cpu: int | None) -> subprocess.Popen:
    """One run of the compiled loop, pinned to ``cpu`` (with taskset, where there is one)."""
    cmd = ["taskset", "-c", str(cpu), str(exe)] if cpu is not None and shutil.which("taskset") else [str(exe)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def read_peak(proc: subprocess.Popen) -> tuple[float, float]:
    """(vfmadd231ps, vdpbf16ps) G instructions/s that a ``start_peak`` run printed."""
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, out)
    fma, dp, _sink = out.split()
    return float(fma), float(dp)


def main() -> None:
    if shutil.which("g++") is None:
        raise SystemExit("cpu_fma_peak.py needs g++")
    if "avx512_bf16" not in cpu_flags():
        raise SystemExit("this CPU has no AVX-512 BF16 (vdpbf16ps): nothing to compare")
    with tempfile.TemporaryDirectory() as tmp:
        exe = compile_peak(Path(tmp))
        runs = [read_peak(start_peak(exe, 0)) for _ in range(3)]
    fma = max(r[0] for r in runs)
    dp = max(r[1] for r in runs)
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
