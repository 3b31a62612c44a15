// y = x W^T (+ b) in bfloat16 for any number of rows, through torch's batch-reduce GEMM
// micro-kernel (at::native::cpublas::brgemm: oneDNN's brgemm ukernel, AMX tiles on CPUs that
// have them), with the weight packed once into the micro-kernel's layout.
//
// Why not oneDNN's matmul primitive (torch.ops.mkldnn._linear_pointwise)? Torch keys that
// primitive on the exact row count, and oneDNN JIT-compiles a new one for every new count:
// one layer's four linears took 8-16 ms at a row count seen for the first time against
// 1.5-2 ms after (the AMX Xeon), and a serving engine meets hundreds of counts. Here the rows
// are cut into blocks of kBlockM; the micro-kernel is compiled once per (rows in a block,
// columns in a block, K) — at most kBlockM row counts per weight shape, all met within the
// first steps — and kept by torch. vLLM 0.32 gets the same from its own oneDNN build
// (onednn_mm: one primitive whose row count is left to run time); torch's packed call cannot.
//
// Plain C++ with C linkage and no torch headers: the three cpublas functions are declared
// below as torch 2.13 exports them from libtorch_cpu.so, which this file is linked against
// (engine/model/cpu/brgemm_linear_cpu.py builds it on first use through kernel_build.py and
// calls it through ctypes; torch has loaded the library before).
//
// Layouts (row-major, contiguous):
//   x       (M, K)            bfloat16, M >= 1, K even
//   w       (N, K)            the linear's weight as stored (out_features, in_features)
//   packed  ceil(N/kBlockN) blocks, each K x kBlockN in the micro-kernel's VNNI layout,
//           block j at offset j*kBlockN*K (the last block's columns past N are zeros, so
//           every call runs at one block width)
//   bias    (N,) bfloat16 or null
//   y       (M, N)            bfloat16
// Arithmetic: bfloat16 products summed in float32, the bias added in float32, the result
// rounded to bfloat16 to nearest, ties to even: oneDNN's bfloat16 matmul's math.
//
// Work split: (row block, column block) tasks over the threads (OpenMP, static), row blocks
// fastest, so a thread's consecutive tasks reuse one packed column block from its cache.

#include <omp.h>

#include "bfloat16.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace c10 {
struct BFloat16;
enum class ScalarType : int8_t;
}  // namespace c10

namespace at::native::cpublas {
void brgemm(int64_t M, int64_t N, int64_t K, int64_t ld_a, int64_t ld_b, int64_t ld_c, bool add_C,
            const c10::BFloat16* A, const c10::BFloat16* B, float* C, bool is_vnni);
void brgemm_release(bool is_vnni);
void pack(int64_t K, int64_t N, int64_t ld_in, int64_t ld_out, c10::ScalarType dt_in, c10::ScalarType dt_out,
          const void* in, void* out);
bool could_pack(c10::ScalarType dt_in);
}  // namespace at::native::cpublas

namespace {

namespace cpublas = at::native::cpublas;

const c10::ScalarType kBFloat16 = static_cast<c10::ScalarType>(15);  // c10::ScalarType::BFloat16

constexpr int64_t kBlockM = 64;  // rows of x per task (AMX tiles hold 16 rows)
constexpr int64_t kBlockN = 64;  // output features per micro-kernel call and per packed block
constexpr int64_t kGroupFromRowBlocks = 3;  // column blocks are grouped from this many row blocks
constexpr int64_t kGroupBytes = 512 * 1024;  // a group's packed weight at most this (the L2's share)

// One task's float32 block c (mb x nb of it, leading dimension ldc) plus bias, rounded into y.
void store_block(const float* c, const uint16_t* bias, uint16_t* y, int64_t mb, int64_t nb, int64_t ldc,
                 int64_t ldy) {
  for (int64_t i = 0; i < mb; ++i) {
    const float* row = c + i * ldc;
    uint16_t* out = y + i * ldy;
    int64_t j = 0;
#if defined(__AVX512BF16__)
    for (; j + 16 <= nb; j += 16) {
      __m512 v = _mm512_loadu_ps(row + j);
      if (bias) {
        __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + j));
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
      }
      __m256bh r = _mm512_cvtneps_pbh(v);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), reinterpret_cast<__m256i&>(r));
    }
#endif
    for (; j < nb; ++j) out[j] = float_to_bf16(row[j] + (bias ? bf16_to_float(bias[j]) : 0.0f));
  }
}

}  // namespace

extern "C" {

// 1 where torch's micro-kernel can pack and run bfloat16 here (oneDNN's ukernel: a CPU with
// AMX or AVX512-BF16 support in it), else 0.
int glassbox_brgemm_supported() { return cpublas::could_pack(kBFloat16) ? 1 : 0; }

// The block size of the packed layout: a packed weight takes ceil(N/kBlockN)*kBlockN*K
// elements (the last block padded).
int64_t glassbox_brgemm_block_n() { return kBlockN; }

// Pack w (N, K) into out (see the layout above; the last block's missing columns are zeros).
// Returns 0, -1 for an odd or empty K, -2 where the micro-kernel refused (a C++ exception
// must not cross into Python).
int glassbox_brgemm_pack(const uint16_t* w, uint16_t* out, int64_t N, int64_t K, int nthreads) {
  if (K <= 0 || K % 2 != 0 || N <= 0) return -1;
  const int64_t blocks = (N + kBlockN - 1) / kBlockN;
  int failed = 0;
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<uint16_t> wt(static_cast<size_t>(K * kBlockN));  // one block transposed: (K, kBlockN)
#pragma omp for schedule(static)
    for (int64_t j = 0; j < blocks; ++j) {
      const int64_t n0 = j * kBlockN, nb = N - n0 < kBlockN ? N - n0 : kBlockN;
      std::fill(wt.begin(), wt.end(), uint16_t{0});
      for (int64_t n = 0; n < nb; ++n)
        for (int64_t k = 0; k < K; ++k) wt[k * kBlockN + n] = w[(n0 + n) * K + k];
      try {
        cpublas::pack(K, kBlockN, kBlockN, kBlockN, kBFloat16, kBFloat16, wt.data(), out + n0 * K);
      } catch (...) {
#pragma omp atomic write
        failed = 1;
      }
    }
  }
  return failed ? -2 : 0;
}

// y = x W^T (+ bias) from the packed weight. Returns 0, -1 for bad sizes, -2 where the
// micro-kernel refused.
int glassbox_brgemm_linear(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                           int64_t M, int64_t N, int64_t K, int nthreads) {
  if (M <= 0 || N <= 0 || K <= 0 || K % 2 != 0) return -1;
  const int64_t row_blocks = (M + kBlockM - 1) / kBlockM, col_blocks = (N + kBlockN - 1) / kBlockN;
  // A task: one row block times a group of column blocks, so the row block of x is read from
  // memory once per group and stays in the cache across it. One column block per group while
  // there are few row blocks (a decode batch: the tasks must feed every thread); else as many
  // as keep the group's packed weight within kGroupBytes.
  int64_t group = 1;
  if (row_blocks >= kGroupFromRowBlocks) {
    group = kGroupBytes / (K * kBlockN * 2);
    group = group < 1 ? 1 : (group > col_blocks ? col_blocks : group);
  }
  const int64_t col_groups = (col_blocks + group - 1) / group;
  const int64_t tasks = row_blocks * col_groups;
  if (nthreads > tasks) nthreads = static_cast<int>(tasks);
  int failed = 0;
#pragma omp parallel num_threads(nthreads)
  {
    alignas(64) float c[kBlockM * kBlockN];
    try {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < tasks; ++t) {
        const int64_t im = t % row_blocks, ig = t / row_blocks;  // row blocks fastest
        const int64_t m0 = im * kBlockM, mb = M - m0 < kBlockM ? M - m0 : kBlockM;
        const int64_t last = (ig + 1) * group < col_blocks ? (ig + 1) * group : col_blocks;
        for (int64_t in = ig * group; in < last; ++in) {
          const int64_t n0 = in * kBlockN, nb = N - n0 < kBlockN ? N - n0 : kBlockN;
          cpublas::brgemm(mb, kBlockN, K, K, kBlockN, kBlockN, false,
                          reinterpret_cast<const c10::BFloat16*>(x + m0 * K),
                          reinterpret_cast<const c10::BFloat16*>(packed + n0 * K), c, true);
          store_block(c, bias ? bias + n0 : nullptr, y + m0 * N + n0, mb, nb, kBlockN, N);
        }
      }
      cpublas::brgemm_release(true);  // hand the AMX tiles back before the thread does other work
    } catch (...) {
#pragma omp atomic write
      failed = 1;
    }
  }
  return failed ? -2 : 0;
}

}  // extern "C"
