"""How fast one core of this CPU multiplies and adds: float32 FMA against bfloat16 dot products.

A matmul on a CPU without AMX runs on one of two AVX-512 instructions: ``vfmadd231ps``
(16 float32 multiply-adds) or, for bfloat16 operands, ``vdpbf16ps`` (32 bfloat16 products
summed in pairs into 16 float32 lanes). Which one a bfloat16 model should use depends on how
many of each the core can start per second — the instruction tables differ between CPUs
(on AMD Zen 4 ``vdpbf16ps`` does twice the work of an FMA in the same time; on the Intel
Xeon these notes were measured on it does half as much per second). This script compiles a
loop of 12 independent chains of each (g++, ``-march=native``), times it on one core and
prints instructions and multiply-adds per second — and, on a CPU with AMX (Intel Xeon from
Sapphire Rapids on), the tile instruction ``tdpbf16ps`` (8,192 bfloat16 multiply-adds into a
16×16 float32 tile), which is what oneDNN's bfloat16 matmul runs there:

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
#include <cstring>
#ifdef __AMX_BF16__
#include <sys/syscall.h>
#include <unistd.h>

// AMX tile multiply-adds per second: tdpbf16ps multiplies a 16x32 bfloat16 tile by a 32x16 one
// into a 16x16 float32 tile (8,192 multiply-adds). Linux hands out the tile state on request.
static double amx_instructions_per_s(long n) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return 0;
    struct { unsigned char palette, start; unsigned char pad[14]; unsigned short colsb[16]; unsigned char rows[16]; }
        cfg;
    std::memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
    alignas(64) static unsigned short a[16 * 32];
    alignas(64) static float c[16 * 16];
    for (int i = 0; i < 16 * 32; i++) a[i] = 0x3f80;  // bfloat16 1.0
    _tile_loadd(4, a, 64); _tile_loadd(5, a, 64); _tile_loadd(6, a, 64); _tile_loadd(7, a, 64);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    auto t0 = std::chrono::steady_clock::now();
    for (long k = 0; k < n / 4; k++) {  // four independent accumulators
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    auto t1 = std::chrono::steady_clock::now();
    _tile_stored(0, c, 64);
    _tile_release();
    return c[0] >= 0 ? n / std::chrono::duration<double>(t1 - t0).count() : 0;
}
#endif

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
#ifdef __AMX_BF16__
    const double amx = amx_instructions_per_s(n / 64);
#else
    const double amx = 0;
#endif
    std::printf("%.4f %.4f %.6f %g\n", n / fma / 1e9, bf16 ? n / dp / 1e9 : 0.0, amx / 1e9, sink);
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


def read_peak(proc: subprocess.Popen) -> tuple[float, float, float]:
    """(vfmadd231ps, vdpbf16ps, tdpbf16ps) G instructions/s that a ``start_peak`` run printed
    (0 for an instruction the CPU, the compiler or the kernel does not offer)."""
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, out)
    fma, dp, amx, _sink = out.split()
    return float(fma), float(dp), float(amx)


# Multiply-adds of one instruction: vfmadd231ps zmm, vdpbf16ps zmm, tdpbf16ps on 16x16 tiles.
MULTIPLY_ADDS = {"fma": 16, "dp": 32, "amx": 16 * 16 * 32}


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
    amx = max(r[2] for r in runs)
    print("one core, best of 3 (12 independent chains each):")
    print(
        f"  vfmadd231ps zmm (float32 FMA):      {fma:5.2f} G instructions/s = {fma * 16:6.1f} G multiply-adds/s"
    )
    print(
        f"  vdpbf16ps zmm (bfloat16 dot pairs):  {dp:5.2f} G instructions/s = {dp * 32:6.1f} G multiply-adds/s"
    )
    print(f"  bfloat16 ÷ float32 multiply-add rate: {dp * 32 / (fma * 16):.2f}×")
    if amx:
        print(f"  tdpbf16ps (AMX, 16x16 tiles):       {amx:7.4f} G instructions/s = "
              f"{amx * MULTIPLY_ADDS['amx']:6.1f} G multiply-adds/s ({amx * MULTIPLY_ADDS['amx'] / (fma * 16):.1f}× float32)")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
