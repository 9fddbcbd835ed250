// Generic decode tile kernels (see decode_kernels.h), on at::vec::Vectorized<float> for every ISA: fp32
// caches are read in place, bf16/fp16 rows are widened to fp32 as they are loaded.
//
// qk: for a tile of W keys and one query row, W accumulators (one per key) sum q . k over D in W-lane
// pieces; one transpose-reduce (reduce16 on AVX-512, hadd tree on AVX2) then turns the W accumulators
// into one vector whose lane j is key j's score. Per key that is D/W loads + FMAs and ~3 shuffle/add
// ops, instead of a full horizontal sum per key.
// pv: acc[GR rows][CV vectors] stay in registers over the chunk; each V row slice is loaded (and widened)
// once per block of GR query rows and feeds GR * CV FMAs with broadcast probabilities; with few
// accumulators (G = 1), U interleaved sets hide the FMA latency.
#include "decode_kernels.h"

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace kvf {
namespace {

// out lane j = sum of the lanes of a[j], for W vectors a[0..W).
inline Vec reduce_lanes(const Vec* a) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 v[16];
  for (int j = 0; j < 16; ++j) v[j] = a[j];
  return reduce16(v);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // 128-bit half h: keys 0-3 / 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
  alignas(64) float out[W];
  for (int j = 0; j < W; ++j) out[j] = hsum(a[j]);
  return Vec::loadu(out);
#endif
}

template <typename T>
void pack_q(const T* q, int d, float* dst) {
  for (int x = 0; x < d; ++x) dst[x] = static_cast<float>(q[x]);
  std::fill(dst + d, dst + round_up(d, kDecodeRowPad), 0.f);
}

// Scores of W keys (rows r[j] + off) for one query row.
template <typename T>
inline Vec qk_tile(const T* const* r, int64_t off, const float* q, int d) {
  Vec acc[W];
  for (int j = 0; j < W; ++j) acc[j] = Vec(0.f);
  const int full = d / W * W;
  for (int x = 0; x < full; x += W) {
    const Vec qv = Vec::loadu(q + x);
    for (int j = 0; j < W; ++j) acc[j] = at::vec::fmadd(load_f(r[j] + off + x), qv, acc[j]);
  }
  if (full < d) {
    const Vec qv = Vec::loadu(q + full);
    for (int j = 0; j < W; ++j) acc[j] = at::vec::fmadd(load_f(r[j] + off + full, d - full), qv, acc[j]);
  }
  return reduce_lanes(acc);
}

template <typename T>
void qk(const T* const* rows, int64_t off, int n, int nh, int64_t hstride, const T* zero, const float* q,
        int qstride, const float*, int G, int d, float scale, float* s, const PrefetchJob<T>& pf) {
  const Vec sc(scale), ninf(kNegInf);
  const T* r[W];
  for (int j0 = 0; j0 < n; j0 += W) {
    const Vec valid = Vec::arange(static_cast<float>(j0), 1.f) < Vec(static_cast<float>(n));
    for (int h = 0; h < nh; ++h) {
      if (j0 == 0) pf.part(h, nh);
      int64_t roff = off + h * hstride;
      if (j0 + W <= n) {
        for (int j = 0; j < W; ++j) r[j] = rows[j0 + j];
      } else {  // past n: the zero row
        for (int j = 0; j < W; ++j) r[j] = j0 + j < n ? rows[j0 + j] + roff : zero;
        roff = 0;
      }

      for (int g = 0; g < G; ++g) {
        const int row = h * G + g;
        const Vec v = qk_tile(r, roff, q + row * qstride, d) * sc;
        Vec::blendv(ninf, v, valid).store(s + row * kDecodeChunk + j0);
      }
    }
  }
  for (int j0 = static_cast<int>(round_up(n, W)); j0 < round_up(n, kDecodeTile); j0 += W)
    for (int row = 0; row < nh * G; ++row) ninf.store(s + row * kDecodeChunk + j0);
}

constexpr int kMaxGR = W == 16 ? 4 : 2;  // query rows x output vectors of one register block
constexpr int kMaxCV = 4;

// o[g][c] += p[g][j] * v_j[x0 + c * W ..] for one key j; vectors past d read as 0.
template <typename T, int GR, int CV>
inline void pv_key(const T* v, const float* p, int left, Vec (*o)[CV]) {
  Vec vv[CV];
  for (int c = 0; c < CV; ++c) {
    const int l = left - c * W;
    vv[c] = l >= W ? load_f(v + c * W) : l > 0 ? load_f(v + c * W, l) : Vec(0.f);
  }
  for (int g = 0; g < GR; ++g) {
    const Vec pj(p[g * kDecodeChunk]);
    for (int c = 0; c < CV; ++c) o[g][c] = at::vec::fmadd(pj, vv[c], o[g][c]);
  }
}

// acc[g][c0 * W, (c0 + CV) * W) += sum_j p[g][j] v_j[...] for GR rows; vectors past d are left at 0.
template <typename T, int GR, int CV>
void pv_block(const T* const* rows, int64_t off, int n, const float* p, int d, float* acc, int astride, int c0) {
  constexpr int U = GR * CV <= 2 ? 4 : GR * CV <= 4 ? 2 : 1;
  Vec o[U][GR][CV];
  for (int u = 0; u < U; ++u)
    for (int g = 0; g < GR; ++g)
      for (int c = 0; c < CV; ++c) o[u][g][c] = u == 0 ? Vec::loadu(acc + g * astride + (c0 + c) * W) : Vec(0.f);
  const int x0 = c0 * W, left = d - x0;
  int j = 0;
  for (; j + U <= n; j += U)
    for (int u = 0; u < U; ++u) pv_key<T, GR, CV>(rows[j + u] + off + x0, p + j + u, left, o[u]);
  for (; j < n; ++j) pv_key<T, GR, CV>(rows[j] + off + x0, p + j, left, o[0]);
  for (int g = 0; g < GR; ++g)
    for (int c = 0; c < CV; ++c) {
      Vec sum = o[0][g][c];
      for (int u = 1; u < U; ++u) sum = sum + o[u][g][c];
      sum.store(acc + g * astride + (c0 + c) * W);
    }
}

template <typename T, int GR>
void pv_rows(const T* const* rows, int64_t off, int n, const float* p, int d, float* acc, int astride) {
  const int nvec = static_cast<int>(round_up(d, W) / W);
  for (int c0 = 0; c0 < nvec; c0 += kMaxCV) {
    switch (std::min(kMaxCV, nvec - c0)) {
      case 1: pv_block<T, GR, 1>(rows, off, n, p, d, acc, astride, c0); break;
      case 2: pv_block<T, GR, 2>(rows, off, n, p, d, acc, astride, c0); break;
      case 3: pv_block<T, GR, 3>(rows, off, n, p, d, acc, astride, c0); break;
      default: pv_block<T, GR, 4>(rows, off, n, p, d, acc, astride, c0); break;
    }
  }
}

template <typename T>
void pv(const T* const* rows, int64_t off, int n, int nh, int64_t hstride, const float* p, int G, int d,
        float* acc, int astride) {
  for (int h = 0; h < nh; ++h) {
    const int64_t hoff = off + h * hstride;
    const float* ph = p + h * G * kDecodeChunk;
    float* ah = acc + h * G * astride;
    int g = 0;
    for (; g + kMaxGR <= G; g += kMaxGR)
      pv_rows<T, kMaxGR>(rows, hoff, n, ph + g * kDecodeChunk, d, ah + g * astride, astride);
    switch (G - g) {
      case 1: pv_rows<T, 1>(rows, hoff, n, ph + g * kDecodeChunk, d, ah + g * astride, astride); break;
      case 2: pv_rows<T, 2>(rows, hoff, n, ph + g * kDecodeChunk, d, ah + g * astride, astride); break;
      case 3: pv_rows<T, 3>(rows, hoff, n, ph + g * kDecodeChunk, d, ah + g * astride, astride); break;
      default: break;
    }
  }
}

void finish(const float* acc, int d, float* dst) { std::copy(acc, acc + d, dst); }

// At namespace scope with internal linkage: a function-local static of the (external) template below
// would be a process-wide unique symbol, shared with any other build of this extension in the process.
template <typename T>
const DecodeKernel<T> kGeneric{"generic", &pack_q<T>, nullptr, nullptr, &qk<T>, &pv<T>, &finish};

}  // namespace

template <typename T>
const DecodeKernel<T>& generic_decode_kernel() {
  return kGeneric<T>;
}

template const DecodeKernel<float>& generic_decode_kernel<float>();
template const DecodeKernel<c10::BFloat16>& generic_decode_kernel<c10::BFloat16>();
template const DecodeKernel<c10::Half>& generic_decode_kernel<c10::Half>();

}  // namespace kvf
