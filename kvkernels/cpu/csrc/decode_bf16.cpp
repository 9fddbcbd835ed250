// AVX512-BF16 decode tile kernels for bf16 caches (see decode_kernels.h); compiled only when the build
// targets a CPU with avx512_bf16 (-march=native defines __AVX512BF16__), else bf16_dot_decode_kernel()
// returns nullptr and the generic kernel (widen to fp32, FMA) runs.
//
// qk: q stays bf16 (as given; the scale is applied to the fp32 scores). One _mm512_dpbf16_ps multiplies
// 32 bf16 pairs exactly and adds them into 16 fp32 lanes, so a D = 64 key is 2 loads + 2 dot products;
// 16 keys' accumulators are then transpose-reduced into one score vector (reduce16). Measured in L1:
// ~1.5 ns per key and query row (vdpbf16ps issues every ~2 cycles here, FMAs twice per cycle).
// pv: fp32 probabilities times V widened without a shuffle: a 32-bit word of a V row holds
// (v[2i + 1] << 16 | v[2i]), so a shift gives v[2i] and a mask gives v[2i + 1] as exact fp32; then one
// FMA per 16 lanes with the broadcast p_j (~1.3 ns per key for D = 64). Pair dot products were
// measured too: on bf16-rounded p they cost the whole 2e-3 bf16 tolerance, on p split into two bf16
// halves they ran at 2.8 ns per key. The accumulators hold the even and the odd elements of each
// 32-wide slice; `finish` interleaves them.
#include "decode_kernels.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#include <immintrin.h>
#define KVF_HAVE_BF16_DOT 1
#endif

namespace kvf {

#if defined(KVF_HAVE_BF16_DOT)
namespace {

using BF = c10::BFloat16;

// 32 elements of a row; FULL (d % 32 == 0): a plain load (masked 16-bit loads cost an extra ALU uop).
template <bool FULL>
inline __m512i load_row(const BF* p, __mmask32 mask) {
  if constexpr (FULL) {
    return _mm512_loadu_si512(p);
  } else {
    return _mm512_maskz_loadu_epi16(mask, p);
  }
}

inline __mmask32 slice_mask(int d, int c) {
  const int left = d - 32 * c;
  return left >= 32 ? ~__mmask32(0) : left <= 0 ? __mmask32(0) : __mmask32((1u << left) - 1);
}

void pack_q(const BF* q, int d, float* dst) {
  BF* out = reinterpret_cast<BF*>(dst);
  std::copy(q, q + d, out);
  std::fill(out + d, out + round_up(d, kDecodeRowPad), BF(0.f));
}

// Scores (unscaled) of 16 keys (rows r[j] + off) for one bf16 query row: NV 32-element slices.
template <int NV, bool FULL>
inline __m512 qk_tile(const BF* const* r, int64_t off, const BF* q, const __mmask32* mask) {
  __m512bh qv[NV];
  for (int c = 0; c < NV; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    const BF* k = r[j] + off;
    acc[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)load_row<FULL>(k, mask[0]), qv[0]);
    for (int c = 1; c < NV; ++c)
      acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)load_row<FULL>(k + 32 * c, mask[c]), qv[c]);
  }
  return reduce16(acc);
}

template <int NV, bool FULL>
void qk(const BF* const* rows, int64_t off, int n, int nh, int64_t hstride, const BF* zero, const float* q,
        int qstride, const float*, int G, int d, float scale, float* s, const PrefetchJob<BF>& pf) {
  __mmask32 mask[NV];
  for (int c = 0; c < NV; ++c) mask[c] = slice_mask(d, c);
  const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(kNegInf);
  const BF* r[16];
  for (int j0 = 0; j0 < n; j0 += 16) {
    const bool full_tile = j0 + 16 <= n;
    const __mmask16 valid = full_tile ? __mmask16(0xFFFF) : __mmask16((1u << (n - j0)) - 1);
    if (full_tile)
      for (int j = 0; j < 16; ++j) r[j] = rows[j0 + j];
    for (int h = 0; h < nh; ++h) {
      if (j0 == 0) pf.part(h, nh);
      int64_t roff = off + h * hstride;
      if (!full_tile) {  // past n: the zero row
        for (int j = 0; j < 16; ++j) r[j] = j0 + j < n ? rows[j0 + j] + roff : zero;
        roff = 0;
      }
      for (int g = 0; g < G; ++g) {
        const int row = h * G + g;
        const __m512 v = qk_tile<NV, FULL>(r, roff, reinterpret_cast<const BF*>(q + row * qstride), mask);
        _mm512_storeu_ps(s + row * kDecodeChunk + j0, _mm512_mask_mul_ps(ninf, valid, v, sc));
      }
    }
  }
}

// o[g] += p[g][j] * v_j for one key j (even / odd elements of each 32-wide slice of the row).
template <int NV, bool FULL, int GR>
inline void pv_key(const BF* v, const float* p, const __mmask32* mask, __m512 (*o)[2 * NV]) {
  const __m512i high = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  __m512 even[NV], odd[NV];
  for (int c = 0; c < NV; ++c) {
    const __m512i w = load_row<FULL>(v + 32 * c, mask[c]);  // 16 words (v[2i + 1] << 16 | v[2i])
    even[c] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    odd[c] = _mm512_castsi512_ps(_mm512_and_si512(w, high));
  }
  for (int g = 0; g < GR; ++g) {
    const __m512 pj = _mm512_set1_ps(p[g * kDecodeChunk]);
    for (int c = 0; c < NV; ++c) {
      o[g][2 * c] = _mm512_fmadd_ps(pj, even[c], o[g][2 * c]);
      o[g][2 * c + 1] = _mm512_fmadd_ps(pj, odd[c], o[g][2 * c + 1]);
    }
  }
}

// acc rows g0..g0+GR: 2 * NV vectors of 16 lanes each (even / odd elements of each 32-wide slice). With
// few accumulators, U independent sets (keys j, j+1, ... round robin) hide the FMA latency.
template <int NV, bool FULL, int GR>
void pv_block(const BF* const* rows, int64_t off, int n, const float* p, int d, float* acc, int astride) {
  constexpr int kAcc = 2 * NV * GR, U = kAcc <= 4 ? 4 : kAcc <= 8 ? 2 : 1;
  __mmask32 mask[NV];
  for (int c = 0; c < NV; ++c) mask[c] = slice_mask(d, c);
  __m512 o[U][GR][2 * NV];
  for (int u = 0; u < U; ++u)
    for (int g = 0; g < GR; ++g)
      for (int c = 0; c < 2 * NV; ++c)
        o[u][g][c] = u == 0 ? _mm512_loadu_ps(acc + g * astride + 16 * c) : _mm512_setzero_ps();
  int j = 0;
  for (; j + U <= n; j += U)
    for (int u = 0; u < U; ++u) pv_key<NV, FULL, GR>(rows[j + u] + off, p + j + u, mask, o[u]);
  for (; j < n; ++j) pv_key<NV, FULL, GR>(rows[j] + off, p + j, mask, o[0]);
  for (int g = 0; g < GR; ++g)
    for (int c = 0; c < 2 * NV; ++c) {
      __m512 sum = o[0][g][c];
      for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, o[u][g][c]);
      _mm512_storeu_ps(acc + g * astride + 16 * c, sum);
    }
}

template <int NV, bool FULL>
void pv(const BF* const* rows, int64_t off, int n, int nh, int64_t hstride, const float* p, int G, int d,
        float* acc, int astride) {
  constexpr int GR = NV <= 2 ? 4 : 2;  // 2 * NV * GR accumulators + 2 * NV operands in 32 registers
  for (int h = 0; h < nh; ++h) {
    const int64_t hoff = off + h * hstride;
    const float* ph = p + h * G * kDecodeChunk;
    float* ah = acc + h * G * astride;
    int g = 0;
    for (; g + GR <= G; g += GR)
      pv_block<NV, FULL, GR>(rows, hoff, n, ph + g * kDecodeChunk, d, ah + g * astride, astride);
    for (; g < G; ++g) pv_block<NV, FULL, 1>(rows, hoff, n, ph + g * kDecodeChunk, d, ah + g * astride, astride);
  }
}

void finish(const float* acc, int d, float* dst) {
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  alignas(64) float buf[32];
  for (int x = 0; x < d; x += 32) {
    const __m512 even = _mm512_loadu_ps(acc + x), odd = _mm512_loadu_ps(acc + x + 16);
    _mm512_store_ps(buf, _mm512_permutex2var_ps(even, first, odd));
    _mm512_store_ps(buf + 16, _mm512_permutex2var_ps(even, second, odd));
    std::copy(buf, buf + std::min(32, d - x), dst + x);
  }
}

template <int NV, bool FULL>
const DecodeKernel<BF>* kernel() {
  static const DecodeKernel<BF> k{"avx512_bf16", &pack_q, nullptr, nullptr, &qk<NV, FULL>, &pv<NV, FULL>,
                                  &finish};
  return &k;
}

}  // namespace

const DecodeKernel<c10::BFloat16>* bf16_dot_decode_kernel(int head_dim) {
  const bool full = head_dim % 32 == 0;
  switch ((head_dim + 31) / 32) {
    case 1: return full ? kernel<1, true>() : kernel<1, false>();
    case 2: return full ? kernel<2, true>() : kernel<2, false>();
    case 3: return full ? kernel<3, true>() : kernel<3, false>();
    case 4: return full ? kernel<4, true>() : kernel<4, false>();
    default: return nullptr;
  }
}

#else

const DecodeKernel<c10::BFloat16>* bf16_dot_decode_kernel(int) { return nullptr; }

#endif

}  // namespace kvf
