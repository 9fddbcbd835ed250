// Weight-only quantized linears for batches of rows: dequantize a tile of output features into a
// cache-sized buffer, then one dense GEMM per tile (oneDNN behind at::mm). torch's own weight-only
// kernels (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm) run one GEMV per row and lose to dense
// bf16 from ~4 rows; this path keeps the packed bytes as the only copy of the weight.
//
// int4: torch's int4pack CPU layout, tiles of 64 output rows: byte j of (tile, k) holds row j in its low
// nibble and row j + 32 in its high one; scales_and_zeros [G, Npad, 2]: w = (q - 8) * scale + zero.
// int8: plain int8 [N, K] with one scale per row (torch's int8pack): w = q * scale.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <vector>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
#include <immintrin.h>
#define KVF_WOQ_AVX512 1
#endif

#include "ops.h"
#include "vec.h"

namespace kvf {

namespace {

constexpr int64_t kTileRows = 64;

// buf [K, tn] (k-major) = the dequantized rows n0 .. n0 + tn of an int4pack weight, for groups g0 .. g1.
template <typename T>
void dequant_int4(T* buf, const uint8_t* packed, const T* sz, int64_t n0, int64_t tn, int64_t K,
                  int64_t group, int64_t npad, int64_t g0, int64_t g1) {
  std::vector<float> s(tn), z(tn);
  [[maybe_unused]] alignas(64) float lo[32], hi[32];
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t i = 0; i < tn; ++i) {
      const T* p = sz + ((g * npad) + n0 + i) * 2;
      s[i] = static_cast<float>(p[0]);
      z[i] = static_cast<float>(p[1]) - 8.0f * s[i];  // (q - 8) * s + z == q * s + (z - 8 s)
    }
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      T* row = buf + k * tn;
      for (int64_t b = 0; b < tn / kTileRows; ++b) {
        const uint8_t* src = packed + ((n0 / kTileRows + b) * K + k) * 32;
        const float* sb = s.data() + b * kTileRows;
        const float* zb = z.data() + b * kTileRows;
        T* dst = row + b * kTileRows;
#ifdef KVF_WOQ_AVX512
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
        const __m256i nib = _mm256_set1_epi8(0x0F);
        const __m256i lo8 = _mm256_and_si256(bytes, nib), hi8 = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nib);
        const __m128i parts[4] = {_mm256_castsi256_si128(lo8), _mm256_extracti128_si256(lo8, 1),
                                  _mm256_castsi256_si128(hi8), _mm256_extracti128_si256(hi8, 1)};
        for (int p = 0; p < 4; ++p) {  // rows p*16 .. p*16+15 of the 64-row tile
          const Vec q(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(parts[p])));
          store_f(dst + p * 16, at::vec::fmadd(q, Vec::loadu(sb + p * 16), Vec::loadu(zb + p * 16)));
        }
#else
        for (int j = 0; j < 32; ++j) {
          lo[j] = static_cast<float>(src[j] & 0x0F);
          hi[j] = static_cast<float>(src[j] >> 4);
        }
        for (int j = 0; j < 32; j += W) {
          store_f(dst + j, at::vec::fmadd(Vec::loadu(lo + j), Vec::loadu(sb + j), Vec::loadu(zb + j)));
          store_f(dst + 32 + j,
                  at::vec::fmadd(Vec::loadu(hi + j), Vec::loadu(sb + 32 + j), Vec::loadu(zb + 32 + j)));
        }
#endif
      }
    }
  }
}

// buf [tn, K] (n-major) = rows n0 .. n0 + tn of an int8 weight times their scales, for rows r0 .. r1.
template <typename T>
void dequant_int8(T* buf, const int8_t* q, const T* scales, int64_t n0, int64_t K, int64_t r0, int64_t r1) {
  std::vector<float> tmp(K + W);
  for (int64_t i = r0; i < r1; ++i) {
    const int8_t* src = q + (n0 + i) * K;
    const Vec s(static_cast<float>(scales[n0 + i]));
    T* dst = buf + i * K;
    int64_t k = 0;
#ifdef KVF_WOQ_AVX512
    for (; k + 16 <= K; k += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
      store_f(dst + k, Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b))) * s);
    }
#endif
    for (int64_t j = k; j < K; ++j) tmp[j] = static_cast<float>(src[j]);
    for (; k + W <= K; k += W) store_f(dst + k, Vec::loadu(tmp.data() + k) * s);
    if (k < K) store_f(dst + k, Vec::loadu(tmp.data() + k, K - k) * s, K - k);
  }
}

// f(float{}) or f(c10::BFloat16{}) by x's dtype (the only two the callers allow).
template <typename F>
void by_dtype(at::ScalarType t, F&& f) {
  if (t == at::kFloat) {
    f(float{});
  } else {
    f(c10::BFloat16{});
  }
}

void check_rows(const at::Tensor& out, const at::Tensor& x, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == n && out.is_contiguous() &&
                  out.scalar_type() == x.scalar_type(),
              "out must be a contiguous [M, N] tensor of x's dtype");
}

}  // namespace

void woq_int4_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                     int64_t group, int64_t tile_n) {
  const int64_t K = x.size(1), npad = packed.size(0);
  check_rows(out, x, npad);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(1) * 2 == K &&
                  npad % kTileRows == 0,
              "packed must be torch's int4pack layout uint8 [N (multiple of 64), K / 2]");
  TORCH_CHECK(group > 0 && K % group == 0, "group must divide K");
  TORCH_CHECK(sz.dim() == 3 && sz.size(0) == K / group && sz.size(1) == npad && sz.size(2) == 2 &&
                  sz.is_contiguous() && sz.scalar_type() == x.scalar_type(),
              "scales_and_zeros must be [K / group, N, 2] of x's dtype");
  const int64_t tn = std::max<int64_t>(kTileRows, tile_n / kTileRows * kTileRows);
  const int64_t tiles = (npad + tn - 1) / tn;
  by_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    // each thread dequantizes and multiplies its own tiles (its GEMMs run single-threaded); worker
    // threads do not inherit the caller's inference mode, which writing an inference-mode out needs
    const bool inference = c10::InferenceMode::is_enabled();
    at::parallel_for(0, tiles, 1, [&](int64_t i0, int64_t i1) {
      c10::InferenceMode guard(inference);
      auto buf = at::empty({K * std::min(tn, npad)}, x.options());
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t n0 = i * tn, t = std::min(tn, npad - n0);
        auto w = buf.narrow(0, 0, K * t).view({K, t});
        dequant_int4<scalar_t>(w.data_ptr<scalar_t>(), packed.data_ptr<uint8_t>(), sz.data_ptr<scalar_t>(), n0,
                               t, K, group, npad, 0, K / group);
        out.narrow(1, n0, t).copy_(at::mm(x, w));  // (oneDNN into a strided out is not safe for bf16)
      }
    });
  });
}

void woq_int8_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     int64_t tile_n) {
  const int64_t K = x.size(1), N = qweight.size(0);
  check_rows(out, x, N);
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous() && qweight.size(1) == K,
              "qweight must be a contiguous int8 [N, K] tensor");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N && scales.is_contiguous() &&
                  scales.scalar_type() == x.scalar_type(),
              "scales must be [N] of x's dtype");
  const int64_t tn = std::max<int64_t>(1, tile_n);
  const int64_t tiles = (N + tn - 1) / tn;
  by_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const bool inference = c10::InferenceMode::is_enabled();
    at::parallel_for(0, tiles, 1, [&](int64_t i0, int64_t i1) {
      c10::InferenceMode guard(inference);
      auto buf = at::empty({std::min(tn, N) * K}, x.options());
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t n0 = i * tn, t = std::min(tn, N - n0);
        auto w = buf.narrow(0, 0, t * K).view({t, K});
        dequant_int8<scalar_t>(w.data_ptr<scalar_t>(), qweight.data_ptr<int8_t>(), scales.data_ptr<scalar_t>(), n0,
                               K, 0, t);
        out.narrow(1, n0, t).copy_(at::mm(x, w.t()));
      }
    });
  });
}

// One output row n for rows m0 .. m0 + MB of x (fp32 [M, K]): acc[m] = sum_k x[m, k] * q[n, k].
template <int MB>
void int8_dot_rows(const float* x, int64_t K, const int8_t* q, float* acc) {
  Vec sum[MB];
  for (int m = 0; m < MB; ++m) sum[m] = Vec(0.0f);
  int64_t k = 0;
#ifdef KVF_WOQ_AVX512
  for (; k + 16 <= K; k += 16) {
    const Vec qf(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k)))));
    for (int m = 0; m < MB; ++m) sum[m] = at::vec::fmadd(Vec::loadu(x + m * K + k), qf, sum[m]);
  }
#endif
  for (int m = 0; m < MB; ++m) {
    float tail = 0.0f;
    for (int64_t j = k; j < K; ++j) tail += x[m * K + j] * static_cast<float>(q[j]);
    acc[m] = hsum(sum[m]) + tail;
  }
}

template <typename T, int MB>
void int8_gemv_block(T* out, const float* x, int64_t K, int64_t N, const int8_t* q, const T* scales, int64_t n0,
                     int64_t n1, int64_t m0) {
  float acc[MB];
  for (int64_t n = n0; n < n1; ++n) {
    int8_dot_rows<MB>(x + m0 * K, K, q + n * K, acc);
    const float s = static_cast<float>(scales[n]);
    for (int m = 0; m < MB; ++m) out[(m0 + m) * N + n] = static_cast<T>(acc[m] * s);
  }
}

void woq_int8_gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  check_rows(out, x, N);
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous() && qweight.size(1) == K,
              "qweight must be a contiguous int8 [N, K] tensor");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N && scales.scalar_type() == x.scalar_type() &&
                  scales.is_contiguous(),
              "scales must be [N] of x's dtype");
  // x in fp32: a batch-1 step calls this ~120 times, so no ATen op (and no allocation) for fp32 x
  std::vector<float> widened;
  const float* xf = x.scalar_type() == at::kFloat ? x.data_ptr<float>() : nullptr;
  if (xf == nullptr) {
    const auto* xb = x.data_ptr<c10::BFloat16>();
    widened.resize(x.numel());
    for (int64_t i = 0; i < x.numel(); ++i) widened[i] = static_cast<float>(xb[i]);
    xf = widened.data();
  }
  by_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const float* xp = xf;
    const int8_t* qp = qweight.data_ptr<int8_t>();
    const scalar_t* sp = scales.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) int8_gemv_block<scalar_t, 4>(op, xp, K, N, qp, sp, n0, n1, m);
      for (; m < M; ++m) int8_gemv_block<scalar_t, 1>(op, xp, K, N, qp, sp, n0, n1, m);
    });
  });
}

}  // namespace kvf
