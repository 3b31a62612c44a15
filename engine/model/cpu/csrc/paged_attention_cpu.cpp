// Paged decode attention for CPUs: one query token per request, keys and values read in
// place from the paged KV cache. Glassbox's --attention-backend CPU_PAGED_CPP.
//
// vLLM counterpart: paged_attention_v1 (csrc/attention/attention_kernels.cu on GPUs,
// csrc/cpu/attention.cpp in its CPU build). Like those, this kernel never copies a
// request's pages into a dense tensor: it follows the block table and reads each key and
// value row where it lies in the cache.
//
// Plain C++ with C linkage and no torch headers, so g++ builds it in about a second;
// engine/model/paged_attention_cpu.py builds it on first use and calls it through ctypes.
//
// Layouts (all row-major, contiguous unless said otherwise):
//   q            (num_decodes, num_heads, head_dim)
//   k_cache      (num_blocks, block_size, num_kv_heads, head_dim)   same for v_cache
//   block_table  (num_decodes, block_table_stride) int32: block ids of each request's pages
//   seq_lens     (num_decodes,) int32: keys at positions < seq_len count
//   out          (num_decodes, num_heads, head_dim)
// Token p of request i lives in block block_table[i][p / block_size], at row
// p % block_size of that block.
//
// Arithmetic: every element is widened to float32 in a register; scores, the softmax and
// the weighted sum of values are float32; the output is written in the input's dtype
// (bfloat16 rounded to nearest, ties to even).

#ifdef __AVX512F__
#include <immintrin.h>  // AVX-512 intrinsics (x86 CPUs that have them; plain loops elsewhere)
#endif
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// The fewest keys a split of one request's keys takes (the AVX-512 path, below).
constexpr int kMinKeysPerSplit = 64;

// How many keys ahead of the one being read we ask for the next row (see prefetch_row).
constexpr int kPrefetchDistance = 8;

// ---- bfloat16 <-> float32 ---------------------------------------------------------------
// A bfloat16 is the top 16 bits of a float32 (same sign and exponent, 7 mantissa bits), so
// widening is a shift. We store it as uint16_t: C++ has no standard bfloat16 type.

inline float to_float(float x) { return x; }

inline float to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);  // the portable way to reinterpret bits
  return f;
}

inline void from_float(float x, float* dst) { *dst = x; }

inline void from_float(float x, uint16_t* dst) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if (std::isnan(x)) {
    *dst = 0x7FC0;  // a quiet NaN
    return;
  }
  // Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then truncate.
  bits += 0x7FFF + ((bits >> 16) & 1);
  *dst = static_cast<uint16_t>(bits >> 16);
}

// ---- the vector primitives ---------------------------------------------------------------
// Written as plain loops that g++ -O3 -march=native turns into AVX-512/AVX2 code. A float
// sum may only be reordered (split into 16 lanes) when we allow it: `omp simd reduction`
// says so without -ffast-math.

// sum_d a[d] * b[d]
inline float dot(const float* __restrict a, const float* __restrict b, int n) {
#ifdef __AVX512F__
  // The one place where intrinsics pay: g++ vectorizes the products below, but then adds
  // up the 16 lanes one after the other, a chain of 16 dependent additions per key. Here:
  // 16 products at a time into one register, then a tree of 4 additions across its lanes
  // (measured: the whole kernel ~20-30% faster).
  if (n % 16 == 0) {
    __m512 sum16 = _mm512_setzero_ps();
    for (int d = 0; d < n; d += 16)
      sum16 = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), sum16);
    return _mm512_reduce_add_ps(sum16);
  }
#endif
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int d = 0; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// acc[d] += w * x[d]   ("axpy")
inline void axpy(float w, const float* __restrict x, float* __restrict acc, int n) {
#pragma omp simd
  for (int d = 0; d < n; ++d) acc[d] += w * x[d];
}

// Widen one cache row (head_dim elements) to float32 into `dst`.
// Ask the memory system to start fetching a row we will read soon. Pages lie anywhere in
// the cache, so the hardware prefetcher cannot guess the next one; without this the kernel
// spends most of its time waiting for rows to arrive from DRAM.
template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int n) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int byte = 0; byte < n * static_cast<int>(sizeof(scalar_t)); byte += 64)  // 64-byte lines
    __builtin_prefetch(p + byte);
}

template <typename scalar_t>
inline void load_row(const scalar_t* __restrict src, float* __restrict dst, int n) {
#pragma omp simd
  for (int d = 0; d < n; ++d) dst[d] = to_float(src[d]);
}

// HEAD_DIM: the head size when known at compile time (64, 128, ...), or 0 for any size
// (read from `runtime_head_dim`). As in vLLM, where the head size is a template parameter: the loops
// below are short (64 floats = 4 AVX-512 registers) and run ~100,000 times per call, so a
// known length lets the compiler unroll them completely instead of paying the set-up of a
// loop of unknown length every time (measured: 15-25% faster at head_dim 64).
template <typename scalar_t, int HEAD_DIM>
void paged_decode_attention(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                            const int32_t* block_table, int64_t block_table_stride,
                            const int32_t* seq_lens, int num_decodes, int num_heads,
                            int num_kv_heads, int runtime_head_dim, int block_size,
                            int sliding_window, float scale, scalar_t* out, int num_threads) {
  const int head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
  // Grouped-query attention: query heads [kv_head * group, (kv_head + 1) * group) all read
  // KV head kv_head. We handle one (request, KV head) pair at a time, with all `group`
  // query heads together, so every K and V row is loaded from memory once.
  const int group = num_heads / num_kv_heads;
  // Distance between consecutive tokens of one KV head in the cache, and between blocks.
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * head_dim;
  const int64_t block_stride = block_size * token_stride;

  int max_len = 0;
  for (int i = 0; i < num_decodes; ++i) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;

#pragma omp parallel num_threads(num_threads)
  {
    // Each thread's scratch memory, allocated once and reused for every pair it takes:
    std::vector<float> q_f(static_cast<size_t>(group) * head_dim);    // queries, float32, scaled
    std::vector<float> row(head_dim);                                 // one K or V row, float32
    std::vector<float> logits(static_cast<size_t>(group) * (max_len > 0 ? max_len : 1));
    std::vector<float> acc(static_cast<size_t>(group) * head_dim);    // weighted sum of values

    // The (request, KV head) pairs are independent: share them among the threads. Requests
    // differ in length, so a thread that finishes early takes the next pair (dynamic).
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int i = 0; i < num_decodes; ++i) {
      for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head) {
        const int seq_len = seq_lens[i];
        // The query sits at position seq_len - 1; with a window W it sees keys
        // seq_len - W .. seq_len - 1.
        int start = 0;
        if (sliding_window > 0 && seq_len > sliding_window) start = seq_len - sliding_window;
        const int len = seq_len - start;  // keys this query sees
        const int32_t* blocks = block_table + i * block_table_stride;
        const int64_t head_offset = static_cast<int64_t>(kv_head) * head_dim;
        // Where the row of position p (this request, this KV head) lies in a cache: page
        // blocks[p / block_size], row p % block_size of that page.
        auto row_at = [&](const scalar_t* cache, int p) {
          return cache + blocks[p / block_size] * block_stride + (p % block_size) * token_stride + head_offset;
        };

        // 1. This group's queries, widened to float32 and multiplied by `scale` once.
        for (int g = 0; g < group; ++g) {
          const scalar_t* q_row = q + (static_cast<int64_t>(i) * num_heads + kv_head * group + g) * head_dim;
          for (int d = 0; d < head_dim; ++d) q_f[g * head_dim + d] = to_float(q_row[d]) * scale;
        }

        // 2. Scores: logits[g][t] = q_g · k_t for every visible key t, walking the request's
        //    pages through its block table. Track each head's maximum for a stable softmax.
        //    (Two passes over the pages, scores then values, as vLLM's paged_attention_v1:
        //    each K row and each V row is still read once, and the scores — a few KB — stay
        //    in the core's cache. An "online" softmax would fold both into one pass at the
        //    price of rescaling the output every time the maximum grows.)
        float* L = logits.data();  // (group, len): row g holds head g's scores
        float max_logit[64];  // one per query head of the group (group <= 64, checked by the caller)
        for (int g = 0; g < group; ++g) max_logit[g] = -std::numeric_limits<float>::infinity();
        for (int p = start; p < seq_len; ++p) {
          if (p + kPrefetchDistance < seq_len) prefetch_row(row_at(k_cache, p + kPrefetchDistance), head_dim);
          load_row(row_at(k_cache, p), row.data(), head_dim);  // read the key once for the whole group
          for (int g = 0; g < group; ++g) {
            const float s = dot(&q_f[g * head_dim], row.data(), head_dim);
            L[static_cast<size_t>(g) * len + (p - start)] = s;
            if (s > max_logit[g]) max_logit[g] = s;
          }
        }

        // 3. Softmax over the keys of each head: exp(s - max), then divide by the sum.
        float inv_sum[64];
        for (int g = 0; g < group; ++g) {
          float* lg = &L[static_cast<size_t>(g) * len];
          float sum = 0.0f;
          for (int t = 0; t < len; ++t) {
            lg[t] = std::exp(lg[t] - max_logit[g]);
            sum += lg[t];
          }
          inv_sum[g] = len > 0 ? 1.0f / sum : 0.0f;
        }

        // 4. Output: acc[g] = sum_t prob[g][t] * v_t, again reading each value row once.
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int p = start; p < seq_len; ++p) {
          if (p + kPrefetchDistance < seq_len) prefetch_row(row_at(v_cache, p + kPrefetchDistance), head_dim);
          load_row(row_at(v_cache, p), row.data(), head_dim);
          for (int g = 0; g < group; ++g) {
            axpy(L[static_cast<size_t>(g) * len + (p - start)], row.data(), &acc[g * head_dim], head_dim);
          }
        }

        // 5. Normalise by the softmax's sum and write in the input's dtype.
        for (int g = 0; g < group; ++g) {
          scalar_t* o = out + (static_cast<int64_t>(i) * num_heads + kv_head * group + g) * head_dim;
          for (int d = 0; d < head_dim; ++d) from_float(acc[g * head_dim + d] * inv_sum[g], &o[d]);
        }
      }
    }
  }
}

#ifdef __AVX512F__
// ---- the AVX-512 path: head sizes that are a multiple of 16 -----------------------------
// The loop above is written for clarity; on a CPU with AVX-512 (where g++ -march=native
// defines __AVX512F__) this version does the same arithmetic faster, for the head sizes
// models use (benchmarks/paged_attention_kernel.py; figures in docs/performance.md). What
// it changes:
//   - One task may take all the KV heads of a request (when there are requests enough to
//     keep every thread busy), and walks its pages one at a time, every KV head of a page
//     before the next page: a page's rows of all KV heads lie side by side in the cache, so
//     memory is read in long contiguous runs, and the next page is prefetched whole while
//     this one is used. One division per page, not per key.
//   - Rows are widened to float32 in registers (no round trip through a scratch row).
//   - The weighted sum of values lives in registers while a page is read (up to 16 of the
//     32 AVX-512 registers), not in memory: acc += p * v does not wait, key after key, on
//     its own last store.
//   - The softmax's exp is a 16-lane polynomial (below), not one libm call per score.
//   - With fewer requests than threads, a request's keys are split between tasks, each with
//     every KV head (contiguous reads again), and the splits' partial softmaxes combined.
// One register holds 16 float32 lanes; a row of HEAD_DIM elements is HEAD_DIM / 16 of them.

// 16 elements from memory as float32 lanes (bfloat16: zero-extend to 32 bits, shift up 16).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

// e^x in each lane, for x <= 0 (a score minus its maximum). Cody-Waite range reduction
// x = n ln2 + r with |r| <= ln2 / 2, then e^r by Cephes' degree-7 polynomial (relative error
// about 1e-7, float32's own), then scale by 2^n (scalef also makes tiny results 0 smoothly).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));  // e^-104 is 0 in float32: avoid a huge n
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2, split in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);      // so n ln2 is exact enough
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 e_r = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(e_r, n);
}

// One page of one request, as a task reads it: `rows` keys from `first_row` of page `page`
// (a pointer already offset to the task's first KV head), which are keys t0 .. t0 + rows - 1
// of the request's visible ones.
template <typename scalar_t>
struct PageRows {
  const scalar_t* page;
  int first_row;
  int rows;
  int64_t t0;
};

// Calls visit(page_rows, next) for the pages holding keys start .. seq_len - 1 of one
// request, in order; `next` is where the following page starts (nullptr after the last), for
// the visitor to prefetch while it reads this one (see Prefetcher).
template <typename scalar_t, typename Visit>
inline void for_each_page(const scalar_t* cache, const int32_t* blocks, int start, int seq_len,
                          int block_size, int64_t block_stride, int64_t head_offset, Visit visit) {
  int p = start;
  int b = start / block_size;
  int offset = start - b * block_size;
  if (p < seq_len) {  // the first page: asked for before its first row is read
    const char* first = reinterpret_cast<const char*>(cache + blocks[b] * block_stride + head_offset);
    for (int64_t byte = 0; byte < block_stride * static_cast<int64_t>(sizeof(scalar_t)); byte += 64)
      __builtin_prefetch(first + byte, 0, 2);
  }
  while (p < seq_len) {
    const int rows = std::min(block_size - offset, seq_len - p);
    visit(PageRows<scalar_t>{cache + blocks[b] * block_stride + head_offset, offset, rows, p - start},
          p + rows < seq_len ? cache + blocks[b + 1] * block_stride + head_offset : nullptr);
    p += rows;
    ++b;
    offset = 0;
  }
}

// Prefetches a page's rows — `rows` rows of `row_bytes` bytes, `row_stride` bytes apart
// (contiguous when a task has every KV head) — spread evenly over `steps` calls of step().
// Into L2, not L1: L2 tracks more misses at once, and a page (8 KiB for a small model's
// bfloat16 K) would crowd L1 (benchmarks/paged_attention_kernel.py --cold; the lines reach
// L1 when the row is read).
struct Prefetcher {
  const char* row;  // the row being prefetched
  int64_t row_lines, row_stride, lines_left, per_step;
  int64_t line = 0;  // next line of `row` to ask for
  Prefetcher(const void* next_page, int64_t row_bytes, int64_t row_stride_bytes, int rows, int64_t steps)
      : row(static_cast<const char*>(next_page)),
        row_lines((row_bytes + 63) / 64),
        row_stride(row_stride_bytes),
        lines_left(next_page ? row_lines * rows : 0),
        per_step(steps > 0 ? (lines_left + steps - 1) / steps : lines_left) {}
  inline void step() {
    for (int64_t i = 0; i < per_step && lines_left > 0; ++i, --lines_left) {
      __builtin_prefetch(row + 64 * line, 0, 2);  // into L2 (prefetcht1): measured 5-8 % faster than L1
      if (++line == row_lines) {
        line = 0;
        row += row_stride;
      }
    }
  }
};

// acc[g] += sum_r prob[g][t0 + r] * v_r over one page's rows, for G query heads (G a
// compile-time constant, so the G * NV sums stay in registers while the page is read).
template <typename scalar_t, int NV, int G>
inline void accumulate_page(const float* probs, int64_t len, const PageRows<scalar_t>& pg,
                            int64_t token_stride, float* acc_mem, Prefetcher& prefetch) {
  constexpr int D = 16 * NV;
  __m512 acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < NV; ++r) acc[g][r] = _mm512_loadu_ps(acc_mem + g * D + 16 * r);
  for (int row = 0; row < pg.rows; ++row) {
    prefetch.step();
    const scalar_t* v = pg.page + (pg.first_row + row) * token_stride;
    __m512 x[NV];
    for (int r = 0; r < NV; ++r) x[r] = load16(v + 16 * r);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(probs[g * len + pg.t0 + row]);
      for (int r = 0; r < NV; ++r) acc[g][r] = _mm512_fmadd_ps(w, x[r], acc[g][r]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < NV; ++r) _mm512_storeu_ps(acc_mem + g * D + 16 * r, acc[g][r]);
}

template <typename scalar_t, int HEAD_DIM>
void paged_decode_attention_avx512(const scalar_t* q, const scalar_t* k_cache,
                                   const scalar_t* v_cache, const int32_t* block_table,
                                   int64_t block_table_stride, const int32_t* seq_lens,
                                   int num_decodes, int num_heads, int num_kv_heads,
                                   int block_size, int sliding_window, float scale,
                                   scalar_t* out, int num_threads, int all_heads_from) {
  static_assert(HEAD_DIM % 16 == 0, "the AVX-512 path takes whole registers");
  constexpr int NV = HEAD_DIM / 16;               // registers per row
  constexpr int GC = NV >= 8 ? 16 / NV : 4;       // query heads per value pass (<= 16 registers)
  const int group = num_heads / num_kv_heads;
  const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * HEAD_DIM;
  const int64_t block_stride = block_size * token_stride;
  // A task: one request and `kv_per_task` of its KV heads — all of them when there are at
  // least `all_heads_from` requests per thread (contiguous reads, enough tasks to share),
  // else one (so a few long requests still spread over every thread). Where the break-even
  // lies depends on the CPU and the model's heads: the caller measures it (2 when not given).
  // Fewer requests than threads (a decode batch of one on two cores): a task per KV head
  // would read 1 / num_kv_heads of every key row, strided, from memory. Instead each task
  // takes all the KV heads of a share of the request's keys (a "split", vLLM's
  // paged_attention_v2, flash-decoding), reads it in contiguous runs, and keeps its partial
  // softmax (its max score, its sum of exponentials, its unnormalised weighted sum); the
  // splits of a request are combined at the end (step 6).
  int max_len = 0;
  for (int i = 0; i < num_decodes; ++i) max_len = seq_lens[i] > max_len ? seq_lens[i] : max_len;
  const int from = all_heads_from > 0 ? all_heads_from : 2;
  const int splits = num_decodes < num_threads && max_len >= 2 * kMinKeysPerSplit
                         ? std::min((num_threads + num_decodes - 1) / num_decodes, max_len / kMinKeysPerSplit)
                         : 1;
  const int kv_per_task = splits > 1 || num_decodes >= from * num_threads ? num_kv_heads : 1;
  const int tasks_per_request = num_kv_heads / kv_per_task * splits;
  const int heads_per_task = kv_per_task * group;
  // Each split's partial results, (request, split, head) first: max score, sum, weighted sum.
  std::vector<float> part_max, part_sum, part_acc;
  if (splits > 1) {
    const size_t n = static_cast<size_t>(num_decodes) * splits * num_heads;
    part_max.assign(n, -std::numeric_limits<float>::infinity());
    part_sum.assign(n, 0.0f);
    part_acc.assign(n * HEAD_DIM, 0.0f);
  }

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> q_f(static_cast<size_t>(heads_per_task) * HEAD_DIM);
    std::vector<float> logits(static_cast<size_t>(heads_per_task) * (max_len > 0 ? max_len : 1));
    std::vector<float> acc(static_cast<size_t>(heads_per_task) * HEAD_DIM);
    std::vector<float> max_logit(heads_per_task);
    std::vector<float> inv_sum(heads_per_task);
    std::vector<float> sum(heads_per_task);

#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < num_decodes * tasks_per_request; ++task) {
      const int i = task / tasks_per_request;
      const int split = task % splits;
      const int kv0 = (task % tasks_per_request) / splits * kv_per_task;  // the task's first KV head
      int seq_len = seq_lens[i];
      int start = 0;
      if (sliding_window > 0 && seq_len > sliding_window) start = seq_len - sliding_window;
      if (splits > 1) {  // this split's share of the visible keys, whole pages where it can
        const int visible = seq_len - start;
        int share = (visible + splits - 1) / splits;
        share = (share + block_size - 1) / block_size * block_size;
        const int end = std::min(seq_len, start + (split + 1) * share);
        start = std::min(seq_len, start + split * share);
        seq_len = end;
        if (start >= seq_len) continue;  // a short request: fewer splits than tasks
      }
      const int64_t len = seq_len - start;
      const int32_t* blocks = block_table + i * block_table_stride;
      const int64_t head_offset = static_cast<int64_t>(kv0) * HEAD_DIM;
      const int64_t row_bytes = static_cast<int64_t>(kv_per_task) * HEAD_DIM * sizeof(scalar_t);
      const int64_t row_stride = token_stride * static_cast<int64_t>(sizeof(scalar_t));
      float* L = logits.data();  // (heads_per_task, len): row h holds head h's scores

      // 1. The task's queries (heads kv0 * group ..), float32, scaled.
      const scalar_t* q_task = q + (static_cast<int64_t>(i) * num_heads + kv0 * group) * HEAD_DIM;
      for (int e = 0; e < heads_per_task * HEAD_DIM; ++e) q_f[e] = to_float(q_task[e]) * scale;
      for (int h = 0; h < heads_per_task; ++h) max_logit[h] = -std::numeric_limits<float>::infinity();

      // 2. Scores, page by page; in a page, KV head by KV head, each key row read once for
      //    its group of query heads.
      for_each_page(k_cache, blocks, start, seq_len, block_size, block_stride, head_offset,
                    [&](const PageRows<scalar_t>& pg, const scalar_t* next) {
        Prefetcher prefetch(next, row_bytes, row_stride, block_size, static_cast<int64_t>(kv_per_task) * pg.rows);
        for (int kv = 0; kv < kv_per_task; ++kv) {
          for (int row = 0; row < pg.rows; ++row) {
            prefetch.step();
            const scalar_t* k = pg.page + (pg.first_row + row) * token_stride + kv * HEAD_DIM;
            __m512 x[NV];
            for (int r = 0; r < NV; ++r) x[r] = load16(k + 16 * r);
            for (int g = 0; g < group; ++g) {
              const int h = kv * group + g;
              const float* qh = &q_f[h * HEAD_DIM];
              __m512 sum16 = _mm512_mul_ps(_mm512_loadu_ps(qh), x[0]);
              for (int r = 1; r < NV; ++r) sum16 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * r), x[r], sum16);
              const float s = _mm512_reduce_add_ps(sum16);
              L[h * len + pg.t0 + row] = s;
              max_logit[h] = s > max_logit[h] ? s : max_logit[h];
            }
          }
        }
      });

      // 3. Softmax of each head's scores, 16 at a time (the last few under a mask).
      for (int h = 0; h < heads_per_task; ++h) {
        float* lg = &L[h * len];
        const __m512 m = _mm512_set1_ps(max_logit[h]);
        __m512 sum16 = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; t += 16) {
          const __mmask16 lanes = len - t >= 16 ? static_cast<__mmask16>(0xFFFF)
                                                : static_cast<__mmask16>((1u << (len - t)) - 1);
          const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, lg + t), m));
          _mm512_mask_storeu_ps(lg + t, lanes, e);
          sum16 = _mm512_mask_add_ps(sum16, lanes, sum16, e);
        }
        sum[h] = _mm512_reduce_add_ps(sum16);
        inv_sum[h] = len > 0 ? 1.0f / sum[h] : 0.0f;
      }

      // 4. Weighted sum of values, page by page; in a page, KV head by KV head and up to GC
      //    query heads per pass (a template argument, so each case keeps its sums in registers).
      std::fill(acc.begin(), acc.end(), 0.0f);
      for_each_page(v_cache, blocks, start, seq_len, block_size, block_stride, head_offset,
                    [&](const PageRows<scalar_t>& pg, const scalar_t* next) {
        Prefetcher prefetch(next, row_bytes, row_stride, block_size,
                            static_cast<int64_t>(kv_per_task) * ((group + GC - 1) / GC) * pg.rows);
        for (int kv = 0; kv < kv_per_task; ++kv) {
          PageRows<scalar_t> head_rows = pg;
          head_rows.page += kv * HEAD_DIM;
          for (int g0 = 0; g0 < group;) {
            const int n = std::min(GC, group - g0);
            const int h = kv * group + g0;
            const float* probs = &L[h * len];
            float* a = &acc[h * HEAD_DIM];
            switch (n) {
              case 1: accumulate_page<scalar_t, NV, 1>(probs, len, head_rows, token_stride, a, prefetch); break;
              case 2: accumulate_page<scalar_t, NV, 2 <= GC ? 2 : 1>(probs, len, head_rows, token_stride, a, prefetch); break;
              case 3: accumulate_page<scalar_t, NV, 3 <= GC ? 3 : 1>(probs, len, head_rows, token_stride, a, prefetch); break;
              default: accumulate_page<scalar_t, NV, 4 <= GC ? 4 : 1>(probs, len, head_rows, token_stride, a, prefetch); break;
            }
            g0 += n;
          }
        }
      });

      // 5. Normalise and write in the input's dtype — or, for a split, keep the partials.
      if (splits > 1) {
        const int64_t first = (static_cast<int64_t>(i) * splits + split) * num_heads + kv0 * group;
        for (int h = 0; h < heads_per_task; ++h) {
          part_max[first + h] = max_logit[h];
          part_sum[first + h] = sum[h];
          std::copy_n(&acc[h * HEAD_DIM], HEAD_DIM, &part_acc[(first + h) * HEAD_DIM]);
        }
        continue;
      }
      scalar_t* o = out + (static_cast<int64_t>(i) * num_heads + kv0 * group) * HEAD_DIM;
      for (int h = 0; h < heads_per_task; ++h)
        for (int d = 0; d < HEAD_DIM; ++d) from_float(acc[h * HEAD_DIM + d] * inv_sum[h], &o[h * HEAD_DIM + d]);
    }

    // 6. Splits: each head's softmax over all its keys from the splits' partials, rescaled to
    //    the largest max: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s. (The omp for
    //    above ends with a barrier: every partial is written.)
    if (splits > 1) {
#pragma omp for schedule(static)
      for (int ih = 0; ih < num_decodes * num_heads; ++ih) {
        const int i = ih / num_heads, h = ih % num_heads;
        float m = -std::numeric_limits<float>::infinity();
        for (int sp = 0; sp < splits; ++sp) m = std::max(m, part_max[(static_cast<int64_t>(i) * splits + sp) * num_heads + h]);
        float total = 0.0f;
        float* a = acc.data();  // this thread's scratch: the combined weighted sum
        std::fill_n(a, HEAD_DIM, 0.0f);
        for (int sp = 0; sp < splits; ++sp) {
          const int64_t at = (static_cast<int64_t>(i) * splits + sp) * num_heads + h;
          if (part_sum[at] == 0.0f) continue;  // an empty split
          const float w = std::exp(part_max[at] - m);
          total += w * part_sum[at];
          for (int d = 0; d < HEAD_DIM; ++d) a[d] += w * part_acc[at * HEAD_DIM + d];
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        scalar_t* o = out + (static_cast<int64_t>(i) * num_heads + h) * HEAD_DIM;
        for (int d = 0; d < HEAD_DIM; ++d) from_float(a[d] * inv, &o[d]);
      }
    }
  }
}
#endif  // __AVX512F__

// One compiled copy per common head size, and a generic one for the rest.
template <typename scalar_t>
void dispatch_head_dim(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                       const int32_t* block_table, int64_t block_table_stride,
                       const int32_t* seq_lens, int num_decodes, int num_heads, int num_kv_heads,
                       int head_dim, int block_size, int sliding_window, float scale,
                       scalar_t* out, int num_threads, int all_heads_from) {
#ifdef __AVX512F__
#define GLASSBOX_CALL(D)                                                                        \
  paged_decode_attention_avx512<scalar_t, D>(q, k_cache, v_cache, block_table,                  \
                                             block_table_stride, seq_lens, num_decodes,         \
                                             num_heads, num_kv_heads, block_size,               \
                                             sliding_window, scale, out, num_threads,       \
                                             all_heads_from)
#else
#define GLASSBOX_CALL(D)                                                                      \
  paged_decode_attention<scalar_t, D>(q, k_cache, v_cache, block_table, block_table_stride,   \
                                      seq_lens, num_decodes, num_heads, num_kv_heads,         \
                                      head_dim, block_size, sliding_window, scale, out,       \
                                      num_threads)
#endif
  switch (head_dim) {  // the head sizes of common models (the bundled default's is 32)
    case 32: GLASSBOX_CALL(32); break;
    case 64: GLASSBOX_CALL(64); break;
    case 80: GLASSBOX_CALL(80); break;
    case 96: GLASSBOX_CALL(96); break;
    case 128: GLASSBOX_CALL(128); break;
    case 256: GLASSBOX_CALL(256); break;
    default:  // any other size: the plain loop
      paged_decode_attention<scalar_t, 0>(q, k_cache, v_cache, block_table, block_table_stride,
                                          seq_lens, num_decodes, num_heads, num_kv_heads,
                                          head_dim, block_size, sliding_window, scale, out,
                                          num_threads);
      break;
  }
#undef GLASSBOX_CALL
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16 (stored as uint16). sliding_window: 0 for none.
// num_blocks: blocks in each cache; block_table_width: entries in a block-table row.
// all_heads_from: decodes per thread from which one task takes all of a request's KV heads
// (the AVX-512 path; 0 for the default, 2).
// Returns 0; -1 when a size or the dtype is out of the kernel's range; -2 when a request
// would read past its block-table row or a block id is not in the cache (nothing is read).
int glassbox_paged_decode_attention(int dtype, const void* q, const void* k_cache,
                                    const void* v_cache, const int32_t* block_table,
                                    int64_t block_table_stride, int block_table_width,
                                    int num_blocks, const int32_t* seq_lens,
                                    int num_decodes, int num_heads, int num_kv_heads,
                                    int head_dim, int block_size, int sliding_window,
                                    float scale, void* out, int num_threads, int all_heads_from) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > 64 ||
      head_dim <= 0 || block_size <= 0 || num_threads <= 0)
    return -1;
  // Every page a request reads must exist: its block-table row must be long enough for
  // seq_len tokens, and each block id must be a block of the cache. (Cheap: one look per
  // page, before any thread starts.)
  for (int i = 0; i < num_decodes; ++i) {
    const int seq_len = seq_lens[i];
    if (seq_len < 0 || (seq_len + block_size - 1) / block_size > block_table_width) return -2;
    for (int b = 0; b < (seq_len + block_size - 1) / block_size; ++b) {
      const int32_t block = block_table[i * block_table_stride + b];
      if (block < 0 || block >= num_blocks) return -2;
    }
  }
  if (dtype == 0)
    dispatch_head_dim(static_cast<const float*>(q), static_cast<const float*>(k_cache),
                      static_cast<const float*>(v_cache), block_table, block_table_stride,
                      seq_lens, num_decodes, num_heads, num_kv_heads, head_dim, block_size,
                      sliding_window, scale, static_cast<float*>(out), num_threads, all_heads_from);
  else if (dtype == 1)
    dispatch_head_dim(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k_cache),
                      static_cast<const uint16_t*>(v_cache), block_table, block_table_stride,
                      seq_lens, num_decodes, num_heads, num_kv_heads, head_dim, block_size,
                      sliding_window, scale, static_cast<uint16_t*>(out), num_threads,
                      all_heads_from);
  else
    return -1;
  return 0;
}

}  // extern "C"
