// The bf16 GEMV for a few rows of x (batch-1 decode steps; AVX512_BF16): out [M, N] = x [M, K] @ W^T + b.
//
// W is stored as pair tiles, [ceil(N / 64)][K / 2][64][2] (output features padded to 64 with zeros): a
// tile is one contiguous stream of 64 output features, each 32-bit pair holding the weights of two
// consecutive k. One vdpbf16ps multiplies a broadcast pair of x values into 16 features' fp32 sums, so
// no horizontal sums are needed and each weight byte is read once per 4 rows of x. Two accumulator sets
// (even and odd k pairs) keep 8 independent chains per row. Measured on the 12-layer model's and SmolLM2's
// layers, weights streamed from memory (2 cores, AMD Zen 4): 20-28 GB/s at 1-4 rows, 1.4-1.8x oneDNN's
// pre-packed bf16 kernel (python benchmarks/bf16_gemv.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "ops.h"
#include "vec.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define KVF_BF16_GEMV 1
#endif

namespace kvf {

namespace {

#ifdef KVF_BF16_GEMV
constexpr int64_t kTile = 64;  // output features per tile (4 vectors of 16 fp32 sums)
// k pairs prefetched ahead into L2 (16 KB): measured beside none and 4 / 8 KB into L1, streaming weights
// larger than the caches; L1 prefetches close ahead were 5-15% slower than none.
constexpr int64_t kAhead = 64;

inline __m512bh pair_of(const uint32_t* xp, int64_t p) {
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(xp[p])));
}

// out rows m0 .. m0 + MR, features 64 t .. 64 t + 63 (those below N) of one tile.
template <int MR>
void gemv_tile(c10::BFloat16* out, int64_t N, const uint32_t* xp, int64_t K, const uint16_t* tile,
               const c10::BFloat16* bias, int64_t t, int64_t m0) {
  const int64_t P = K / 2;
  __m512 even[MR][4], odd[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < 4; ++i) even[m][i] = odd[m][i] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + 2 <= P; p += 2) {
    const uint16_t* w = tile + p * 2 * kTile;
    const char* ahead = reinterpret_cast<const char*>(w + kAhead * 2 * kTile);  // past a tile's end: the next one
    for (int b = 0; b < 8; ++b) _mm_prefetch(ahead + b * 64, _MM_HINT_T1);
    __m512i v[8];
    for (int i = 0; i < 8; ++i) v[i] = _mm512_loadu_si512(w + i * 32);
    for (int m = 0; m < MR; ++m) {
      const __m512bh x0 = pair_of(xp, (m0 + m) * P + p), x1 = pair_of(xp, (m0 + m) * P + p + 1);
      for (int i = 0; i < 4; ++i) even[m][i] = _mm512_dpbf16_ps(even[m][i], reinterpret_cast<__m512bh>(v[i]), x0);
      for (int i = 0; i < 4; ++i) odd[m][i] = _mm512_dpbf16_ps(odd[m][i], reinterpret_cast<__m512bh>(v[4 + i]), x1);
    }
  }
  if (p < P) {
    const uint16_t* w = tile + p * 2 * kTile;
    for (int m = 0; m < MR; ++m) {
      const __m512bh x0 = pair_of(xp, (m0 + m) * P + p);
      for (int i = 0; i < 4; ++i)
        even[m][i] = _mm512_dpbf16_ps(even[m][i], reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + i * 32)), x0);
    }
  }
  for (int i = 0; i < 4; ++i) {
    const int64_t n0 = t * kTile + i * 16;
    if (n0 >= N) break;
    const int n = static_cast<int>(std::min<int64_t>(16, N - n0));
    const Vec b = bias ? load_f(bias + n0, n) : Vec(0.f);
    for (int m = 0; m < MR; ++m) store_f(out + (m0 + m) * N + n0, Vec(_mm512_add_ps(even[m][i], odd[m][i])) + b, n);
  }
}
#endif

}  // namespace

bool has_bf16_gemv() {
#ifdef KVF_BF16_GEMV
  return true;
#else
  return false;
#endif
}

void bf16_gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& tiles, const std::optional<at::Tensor>& bias) {
#ifdef KVF_BF16_GEMV
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && K % 2 == 0,
              "x must be a contiguous bfloat16 [M, K] tensor with K even");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.is_contiguous() && out.scalar_type() == at::kBFloat16,
              "out must be a contiguous bfloat16 [M, N] tensor");
  TORCH_CHECK(tiles.dim() == 4 && tiles.size(0) * kTile >= N && tiles.size(0) * kTile < N + kTile &&
                  tiles.size(1) * 2 == K && tiles.size(2) == kTile && tiles.size(3) == 2 && tiles.is_contiguous() &&
                  tiles.scalar_type() == at::kBFloat16,
              "tiles must be bfloat16 [ceil(N / 64), K / 2, 64, 2] (pack_bf16_gemv)");
  TORCH_CHECK(!bias || (bias->numel() == N && bias->is_contiguous() && bias->scalar_type() == at::kBFloat16),
              "bias must be a contiguous bfloat16 [N] tensor");
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  const auto* w = reinterpret_cast<const uint16_t*>(tiles.data_ptr<c10::BFloat16>());
  const c10::BFloat16* b = bias ? bias->data_ptr<c10::BFloat16>() : nullptr;
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, tiles.size(0), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* tile = w + t * K * kTile;
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) gemv_tile<4>(op, N, xp, K, tile, b, t, m);
      switch (M - m) {
        case 3: gemv_tile<3>(op, N, xp, K, tile, b, t, m); break;
        case 2: gemv_tile<2>(op, N, xp, K, tile, b, t, m); break;
        case 1: gemv_tile<1>(op, N, xp, K, tile, b, t, m); break;
        default: break;
      }
    }
  });
#else
  TORCH_CHECK(false, "bf16_gemv needs AVX512_BF16 (has_bf16_gemv() is false)");
#endif
}

}  // namespace kvf
