// Decode attention tile kernels: the interface between the decode driver (attention_decode.cpp) and its
// inner loops (decode_generic.cpp: at::vec on every ISA; decode_bf16.cpp: AVX512-BF16 dot products;
// decode_amx.cpp: AMX tile products for the scores of GQA rows).
//
// The driver walks a chunk of up to kDecodeChunk positions of one sequence, for all nh kv heads of its
// item at once, and calls
//   qk:  s[r][j] = scale * q_r . k_j for the query rows r = h * G + g of every head h, computed
//        kDecodeTile keys at a time so that each score is one lane of a vector (one "transpose-reduce"
//        per tile of keys instead of a horizontal sum per key); lanes past n are -inf;
//   pv:  acc_r += sum_j p[r][j] * v_j, register-blocked over (query rows x output vectors), each V row
//        loaded once per block of query rows.
// Every kernel owns the layout of its packed q rows (pack_q, and prepare for per-item data) and of its
// accumulators, which `finish` converts back. Rows of a chunk are given as pointers to the item's
// first kv head (head h: `off` + h * `hstride` elements further); a tile's keys past n read a zero row
// instead, so no kernel reads outside the sequence (blocks past seq_len may hold anything, NaN in the
// tests). qk also issues the driver's next prefetches (PrefetchJob) spread over its heads.
#pragma once

#include "vec.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace kvf {

constexpr int kDecodeTile = 16;    // keys per score vector (AVX-512 lanes; two 8-lane halves on AVX2)
constexpr int kDecodeChunk = 64;   // positions per softmax step (a multiple of kDecodeTile)
constexpr int kDecodeRowPad = 32;  // q / acc rows are padded to this many floats

// Rows another pass reads soon (the item's spans of them): a kernel spreads their software prefetches
// (into L2) over its heads, part h of nh being rows [h * n / nh, (h + 1) * n / nh) of [begin, end),
// rather than one burst that would fill the line-fill buffers while its own loads wait.
template <typename T>
struct PrefetchJob {
  const T* const* rows = nullptr;
  int begin = 0, end = 0;
  int64_t bytes = 0;
  void part(int h, int nh) const {
    const int n = end - begin;
    if (n <= 0) return;
    for (int j = begin + h * n / nh; j < begin + (h + 1) * n / nh; ++j) {
      const char* p = reinterpret_cast<const char*>(rows[j]);
      for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
    }
  }
};

template <typename T>
struct DecodeKernel {
  const char* name;
  // q row (d elements) into dst (kDecodeRowPad-padded floats, kernel layout, zero padding).
  void (*pack_q)(const T* q, int d, float* dst);
  // Optional (nullptr: none): once per item after pack_q, with all rows (nh * G) of packed q; may write
  // kernel data to extra (rows * qstride floats) and set up per-thread state, which `end` undoes.
  void (*prepare)(const float* q, int qstride, int rows, int G, int d, float* extra);
  void (*end)();
  // s[r * kDecodeChunk + j] for j < round_up(n, kDecodeTile), r < nh * G; q rows `qstride` floats apart
  // (extra: prepare's data of the same rows); zero: a row of d zeros; pf: prefetches to spread.
  void (*qk)(const T* const* rows, int64_t off, int n, int nh, int64_t hstride, const T* zero, const float* q,
             int qstride, const float* extra, int G, int d, float scale, float* s, const PrefetchJob<T>& pf);
  // acc rows r (`astride` floats apart) += sum_{j < n} p[r * kDecodeChunk + j] * v_j.
  void (*pv)(const T* const* rows, int64_t off, int n, int nh, int64_t hstride, const float* p, int G, int d,
             float* acc, int astride);
  // Natural-order fp32 row of d values from an accumulator row.
  void (*finish)(const float* acc, int d, float* dst);
  // Optional (nullptr: use pv): a cascade item's acc += P V for all its rows (nrows, a multiple of 16)
  // over one chunk of n keys, accumulators in natural fp32 order (so no finish); work: cascade_work
  // floats. Runs between qk calls of the same item, under the tile state prepare() set up for G = 16.
  void (*cascade_pv)(const T* const* rows, int n, const float* p, int nrows, int d, float* acc, int astride,
                     float* work) = nullptr;
};

// Floats of cascade_pv's work area for nrows query rows of head_dim d.
inline int64_t cascade_work(int nrows, int d) { return int64_t(nrows) * kDecodeChunk + 32 * int64_t(d); }

template <typename T>
const DecodeKernel<T>& generic_decode_kernel();

// The AVX512-BF16 kernel for bf16 caches of head_dim <= 128, or nullptr when not compiled in.
const DecodeKernel<c10::BFloat16>* bf16_dot_decode_kernel(int head_dim);
// The same with AMX tile products for the scores (head_dim a multiple of 32 up to 128, G <= 16), or
// nullptr when not compiled in or the OS does not grant the tile state.
const DecodeKernel<c10::BFloat16>* amx_decode_kernel(int head_dim, int group);

#if defined(CPU_CAPABILITY_AVX512)
// out lane j = sum of the 16 lanes of a[j]. Four levels; each pairs vectors (x, y) whose lanes hold
// partial sums of keys and halves the partials: a blend keeps x's lanes of one key set and y's of the
// other, a two-source permute brings the matching partner lanes, one add. One shuffle-port uop per pair
// (15 per 16 keys), where unpack/shuffle trees need two.
inline __m512 reduce16(const __m512* a) {
  __m512 x[8];
  for (int k = 0; k < 8; ++k) {  // lane i: key 2k + (i & 1)
    const __m512i idx = _mm512_setr_epi32(1, 16, 3, 18, 5, 20, 7, 22, 9, 24, 11, 26, 13, 28, 15, 30);
    x[k] = _mm512_add_ps(_mm512_mask_blend_ps(0xAAAA, a[2 * k], a[2 * k + 1]),
                         _mm512_permutex2var_ps(a[2 * k], idx, a[2 * k + 1]));
  }
  for (int k = 0; k < 4; ++k) {  // lane i: key 4k + (i & 3)
    const __m512i idx = _mm512_setr_epi32(2, 3, 16, 17, 6, 7, 20, 21, 10, 11, 24, 25, 14, 15, 28, 29);
    x[k] = _mm512_add_ps(_mm512_mask_blend_ps(0xCCCC, x[2 * k], x[2 * k + 1]),
                         _mm512_permutex2var_ps(x[2 * k], idx, x[2 * k + 1]));
  }
  for (int k = 0; k < 2; ++k) {  // lane i: key 8k + (i & 7)
    const __m512i idx = _mm512_setr_epi32(4, 5, 6, 7, 16, 17, 18, 19, 12, 13, 14, 15, 24, 25, 26, 27);
    x[k] = _mm512_add_ps(_mm512_mask_blend_ps(0xF0F0, x[2 * k], x[2 * k + 1]),
                         _mm512_permutex2var_ps(x[2 * k], idx, x[2 * k + 1]));
  }
  const __m512i idx = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23);
  return _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, x[0], x[1]), _mm512_permutex2var_ps(x[0], idx, x[1]));
}
#endif

}  // namespace kvf
