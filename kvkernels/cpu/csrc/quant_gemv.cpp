// The int4 weight-only GEMV for a few rows of bf16 x (decode steps; AVX512_BF16): it streams the 4-bit
// codes once per 4 rows of x and never writes a dequantized copy; x stays bf16 (not quantized).
//
// It reads torch's int4pack CPU layout as it is (the tile-dequantizing GEMM in quant_linear.cpp and
// torch's own kernel read the same bytes). A code q becomes the bf16 number 128 + q by OR-ing in the
// exponent bits (exact), two k at a time, and one vdpbf16ps multiplies a pair of x values into 16 rows'
// fp32 sums (the products are exact). Per group: sum x w = s (A - 136 sum x) + z sum x, where
// A = sum x (128 + q) and w = (q - 8) s + z (int4pack's scales_and_zeros). Measured on SmolLM2's
// layers at batch 1 (one core, AMD Zen 4): 1.7x torch's _weight_int4pack_mm_for_cpu.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <vector>

#include "ops.h"
#include "vec.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
#include <immintrin.h>
#define KVF_GEMV_AVX512 1
#endif

namespace kvf {

namespace {

#if defined(KVF_GEMV_AVX512) && defined(__AVX512BF16__)
#define KVF_GEMV_BF16 1
constexpr int64_t kTile = 64;  // int4pack's CPU tile: byte j of (tile, k) = row j (low nibble), row j + 32 (high)

// The codes of one tile at k and k + 1 (64 bytes at p) as bf16 pairs (128 + q at k, 128 + q at k + 1) in the
// 32-bit lanes vdpbf16ps pairs up: v[0] rows 0-7, 16-23; v[1] rows 8-15, 24-31; v[2], v[3] those + 32.
inline void int4_pairs(const uint8_t* p, __m512i* v) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
  const __m512i lo = _mm512_cvtepu8_epi16(_mm256_unpacklo_epi8(a, b));  // words: byte of k, byte of k + 1
  const __m512i hi = _mm512_cvtepu8_epi16(_mm256_unpackhi_epi8(a, b));
  const __m512i nibble = _mm512_set1_epi16(0x000F), exponent = _mm512_set1_epi16(0x4300);  // bf16 128
  v[0] = _mm512_ternarylogic_epi32(lo, nibble, exponent, 0xEA);  // (lo & 0xF) | 0x4300
  v[1] = _mm512_ternarylogic_epi32(hi, nibble, exponent, 0xEA);
  v[2] = _mm512_or_si512(_mm512_srli_epi16(lo, 4), exponent);
  v[3] = _mm512_or_si512(_mm512_srli_epi16(hi, 4), exponent);
}

// The group sums A[m][0..3] (int4_pairs' row order) of MR rows of x folded into obuf[m][0..63] (row order):
// obuf += s (A - 136 xsum) + z xsum, with (s, z) the tile's bf16 pairs of this group at sz.
template <int MR>
inline void int4_fold(const __m512 (*acc)[4], const c10::BFloat16* sz, const float* xsum, int64_t groups,
                      float (*obuf)[kTile]) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int r = 0; r < 4; ++r) {  // rows 16 r .. 16 r + 15
    const __m512i pairs = _mm512_loadu_si512(sz + r * 32);
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
    const int src = (r / 2) * 2;  // rows 0-31 come from acc 0 and 1, rows 32-63 from acc 2 and 3
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_permutex2var_ps(acc[m][src], r % 2 ? second : first, acc[m][src + 1]);
      const __m512 xs = _mm512_set1_ps(xsum[m * groups]);
      const __m512 t = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), xs, a);
      __m512 o = _mm512_fmadd_ps(s, t, _mm512_loadu_ps(obuf[m] + r * 16));
      _mm512_storeu_ps(obuf[m] + r * 16, _mm512_fmadd_ps(z, xs, o));
    }
  }
}

// out[m0 .. m0 + MR, 64 t .. 64 t + 63] for one tile t; x pairs as uint32 [M, K / 2], xsum [M, groups].
template <int MR>
void int4_tile(c10::BFloat16* out, int64_t npad, const uint32_t* xp, const float* xsum, int64_t K, const uint8_t* packed,
               const c10::BFloat16* sz, int64_t group, int64_t t, int64_t m0) {
  const int64_t groups = K / group;
  float obuf[MR][kTile] = {};
  const uint8_t* tile = packed + t * K * (kTile / 2);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[MR][4];
    for (int m = 0; m < MR; ++m)
      for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += 2) {
      __m512i v[4];
      int4_pairs(tile + k * (kTile / 2), v);
      for (int m = 0; m < MR; ++m) {
        const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(xp[(m0 + m) * (K / 2) + k / 2])));
        for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_dpbf16_ps(acc[m][i], reinterpret_cast<__m512bh>(v[i]), xb);
      }
    }
    int4_fold<MR>(acc, sz + (g * npad + t * kTile) * 2, xsum + m0 * groups + g, groups, obuf);
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < kTile; r += 16) store_f(out + (m0 + m) * npad + t * kTile + r, Vec::loadu(obuf[m] + r));
}
#endif

}  // namespace

bool has_bf16_int4_gemv() {
#ifdef KVF_GEMV_BF16
  return true;
#else
  return false;
#endif
}

void woq_int4_gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                   int64_t group) {
#ifdef KVF_GEMV_BF16
  const int64_t M = x.size(0), K = x.size(1), npad = packed.size(0);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be a contiguous bfloat16 [M, K] tensor");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == npad && out.is_contiguous() &&
                  out.scalar_type() == at::kBFloat16,
              "out must be a contiguous bfloat16 [M, N] tensor");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(1) * 2 == K &&
                  npad % kTile == 0,
              "packed must be torch's int4pack layout uint8 [N (multiple of 64), K / 2]");
  TORCH_CHECK(group > 0 && group % 2 == 0 && K % group == 0, "group must be even and divide K");
  TORCH_CHECK(sz.dim() == 3 && sz.size(0) == K / group && sz.size(1) == npad && sz.size(2) == 2 &&
                  sz.is_contiguous() && sz.scalar_type() == at::kBFloat16,
              "scales_and_zeros must be bfloat16 [K / group, N, 2]");
  const int64_t groups = K / group;
  std::vector<float> xsum(M * groups, 0.0f);  // sum of x over each group
  const auto* xb = x.data_ptr<c10::BFloat16>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xsum[m * groups + k / group] += static_cast<float>(xb[m * K + k]);
  const auto* xp = reinterpret_cast<const uint32_t*>(xb);
  auto* op = out.data_ptr<c10::BFloat16>();
  const auto* pp = packed.data_ptr<uint8_t>();
  const auto* sp = sz.data_ptr<c10::BFloat16>();
  at::parallel_for(0, npad / kTile, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) int4_tile<4>(op, npad, xp, xsum.data(), K, pp, sp, group, t, m);
      switch (M - m) {
        case 3: int4_tile<3>(op, npad, xp, xsum.data(), K, pp, sp, group, t, m); break;
        case 2: int4_tile<2>(op, npad, xp, xsum.data(), K, pp, sp, group, t, m); break;
        case 1: int4_tile<1>(op, npad, xp, xsum.data(), K, pp, sp, group, t, m); break;
        default: break;
      }
    }
  });
#else
  TORCH_CHECK(false, "woq_int4_gemv needs AVX512_BF16 (has_bf16_int4_gemv() is false)");
#endif
}

}  // namespace kvf
