// y = x W^T (+ b) for a few rows of x (a decode batch of 1 to 4): Glassbox's own
// matrix-vector kernel for CPUs with AVX-512 (float32) and AVX512-BF16 (bfloat16).
//
// At one row a linear reads every weight once and does two flops per weight read: memory
// bound. What decides its speed is streaming the weight at the memory's rate, with little
// per-call overhead. Whether this beats the library's matmul (tuned for big blocks) is
// measured on each CPU at start-up (linear.py's choose_linear_kernel; docs/performance.md). vLLM's
// CPU build has no such kernel: its linears go to oneDNN (onednn_mm) at every row count.
//
// Plain C++ with C linkage and no torch headers; engine/model/cpu/small_linear_cpu.py builds
// it on first use (kernel_build.py) and calls it through ctypes.
//
// Layouts (row-major, contiguous):
//   x     (M, K)   M in 1..4
//   w     (N, K)   the linear's weight as stored (out_features, in_features)
//   bias  (N,) or null
//   y     (M, N)
// Arithmetic: products and sums in float32 (bfloat16 pairs through vdpbf16ps, float32 through
// FMA), the bias added in float32, a bfloat16 output rounded to nearest, ties to even: the
// math of oneDNN's bfloat16 matmul, in another summation order.
//
// Work split: blocks of kRows output features, spread over the threads (OpenMP, static);
// each block streams its kRows weight rows once and multiplies every row of x with them.

#include <omp.h>

#include "bfloat16.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kRows = 4;  // output features per block: four weight rows streamed at once

#if defined(__AVX512BF16__)
// Output features n0 .. n0+nr-1 (nr <= kRows) of all M rows, bfloat16.
template <int M>
void block_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t n0,
                int64_t nr, int64_t N, int64_t K) {
  __m512 acc[M][kRows];  // 16 float32 partial sums per (row of x, output feature)
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_ps();
  const uint16_t* wr[kRows];  // a short last block repeats its first row (results unused)
  for (int r = 0; r < kRows; ++r) wr[r] = w + (n0 + (r < nr ? r : 0)) * K;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {  // 32 bfloat16 = one 512-bit register
    __m512i wv[kRows];
    for (int r = 0; r < kRows; ++r) wv[r] = _mm512_loadu_si512(wr[r] + k);
    for (int m = 0; m < M; ++m) {
      __m512i xv = _mm512_loadu_si512(x + m * K + k);
      for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)xv, (__m512bh)wv[r]);
    }
  }
  if (k < K) {  // the tail: masked loads read zeros past K
    __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m512i wv[kRows];
    for (int r = 0; r < kRows; ++r) wv[r] = _mm512_maskz_loadu_epi16(mask, wr[r] + k);
    for (int m = 0; m < M; ++m) {
      __m512i xv = _mm512_maskz_loadu_epi16(mask, x + m * K + k);
      for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], (__m512bh)xv, (__m512bh)wv[r]);
    }
  }
  // Every accumulator reduced with constant indices (a runtime index would keep them all in
  // memory rather than registers through the loop above), then the nr real ones written.
  float sums[M][kRows];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kRows; ++r) sums[m][r] = _mm512_reduce_add_ps(acc[m][r]);
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < nr; ++r) {
      float s = sums[m][r];
      if (bias) s += bf16_to_float(bias[n0 + r]);
      y[m * N + n0 + r] = float_to_bf16(s);
    }
}
#endif

#if defined(__AVX512F__)
// Output features n0 .. n0+nr-1 (nr <= kRows) of all M rows, float32.
template <int M>
void block_f32(const float* x, const float* w, const float* bias, float* y, int64_t n0, int64_t nr, int64_t N,
               int64_t K) {
  __m512 acc[M][kRows];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_setzero_ps();
  const float* wr[kRows];
  for (int r = 0; r < kRows; ++r) wr[r] = w + (n0 + (r < nr ? r : 0)) * K;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {  // 16 float32 = one 512-bit register
    __m512 wv[kRows];
    for (int r = 0; r < kRows; ++r) wv[r] = _mm512_loadu_ps(wr[r] + k);
    for (int m = 0; m < M; ++m) {
      __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  if (k < K) {
    __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[kRows];
    for (int r = 0; r < kRows; ++r) wv[r] = _mm512_maskz_loadu_ps(mask, wr[r] + k);
    for (int m = 0; m < M; ++m) {
      __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      for (int r = 0; r < kRows; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  float sums[M][kRows];  // as in block_bf16
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kRows; ++r) sums[m][r] = _mm512_reduce_add_ps(acc[m][r]);
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < nr; ++r) {
      float s = sums[m][r];
      if (bias) s += bias[n0 + r];
      y[m * N + n0 + r] = s;
    }
}
#endif

template <typename Block>
void over_blocks(Block block, int64_t N, int num_threads) {
  const int64_t blocks = (N + kRows - 1) / kRows;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n0 = b * kRows;
    block(n0, N - n0 < kRows ? N - n0 : kRows);
  }
}

}  // namespace

// Whether this build has a kernel for dtype (0 float32: AVX-512; 1 bfloat16: AVX512-BF16).
extern "C" int glassbox_small_linear_supports(int dtype) {
#if defined(__AVX512BF16__)
  if (dtype == 1) return 1;
#endif
#if defined(__AVX512F__)
  if (dtype == 0) return 1;
#endif
  return 0;
}

// y = x w^T (+ bias). Returns 0; -1 for sizes out of range (M not in 1..4, N or K < 1); -3
// for a dtype this build has no kernel for (see glassbox_small_linear_supports).
extern "C" int glassbox_small_linear(int dtype, const void* x, const void* w, const void* bias, void* y, int64_t M,
                                     int64_t N, int64_t K, int num_threads) {
  if (M < 1 || M > 4 || N < 1 || K < 1) return -1;
  if (num_threads < 1) num_threads = 1;
#if defined(__AVX512BF16__)
  if (dtype == 1) {
    auto xs = static_cast<const uint16_t*>(x);
    auto ws = static_cast<const uint16_t*>(w);
    auto bs = static_cast<const uint16_t*>(bias);
    auto ys = static_cast<uint16_t*>(y);
    switch (M) {
      case 1: over_blocks([&](int64_t n0, int64_t nr) { block_bf16<1>(xs, ws, bs, ys, n0, nr, N, K); }, N, num_threads); break;
      case 2: over_blocks([&](int64_t n0, int64_t nr) { block_bf16<2>(xs, ws, bs, ys, n0, nr, N, K); }, N, num_threads); break;
      case 3: over_blocks([&](int64_t n0, int64_t nr) { block_bf16<3>(xs, ws, bs, ys, n0, nr, N, K); }, N, num_threads); break;
      default: over_blocks([&](int64_t n0, int64_t nr) { block_bf16<4>(xs, ws, bs, ys, n0, nr, N, K); }, N, num_threads); break;
    }
    return 0;
  }
#endif
#if defined(__AVX512F__)
  if (dtype == 0) {
    auto xs = static_cast<const float*>(x);
    auto ws = static_cast<const float*>(w);
    auto bs = static_cast<const float*>(bias);
    auto ys = static_cast<float*>(y);
    switch (M) {
      case 1: over_blocks([&](int64_t n0, int64_t nr) { block_f32<1>(xs, ws, bs, ys, n0, nr, N, K); }, N, num_threads); break;
      case 2: over_blocks([&](int64_t n0, int64_t nr) { block_f32<2>(xs, ws, bs, ys, n0, nr, N, K); }, N, num_threads); break;
      case 3: over_blocks([&](int64_t n0, int64_t nr) { block_f32<3>(xs, ws, bs, ys, n0, nr, N, K); }, N, num_threads); break;
      default: over_blocks([&](int64_t n0, int64_t nr) { block_f32<4>(xs, ws, bs, ys, n0, nr, N, K); }, N, num_threads); break;
    }
    return 0;
  }
#endif
  (void)x; (void)w; (void)bias; (void)y; (void)num_threads;
  return -3;
}
