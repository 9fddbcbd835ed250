// Decode items: one query row, kv heads [head, head + nh) of it, over a kv range of the paged cache.
//
// The cache is token-major inside a block ([block_size, Hkv, D]), so one head's rows are 256 B pieces
// at a Hkv*D stride: reading them head by head defeats the hardware prefetchers (about 5x slower than
// streaming here). So a decode item walks each chunk of kDecodeChunk positions token by token over all
// of its heads, streaming every block front to back once for K (scores of the G query heads of each kv
// head, K row loaded once for up to 4 of them) and once for V (o += p * v, V row loaded once for all G).
// Online softmax between the two passes, per query head.
#include "attention.h"

#include <cmath>

namespace kvf {
namespace {

// s[g * kDecodeChunk] = q_g . k for GR query rows q (prescaled, zero-padded to dp).
template <typename T, int GR>
inline void dot_rows(const T* k, const float* q, int dp, int d, float* s) {
  const int nfull = d / W, rem = d % W;
  Vec acc[GR];
  for (int g = 0; g < GR; ++g) acc[g] = Vec(0.f);
  for (int c = 0; c < nfull; ++c) {
    const Vec kv = load_f(k + c * W);
    for (int g = 0; g < GR; ++g) acc[g] = at::vec::fmadd(Vec::loadu(q + g * dp + c * W), kv, acc[g]);
  }
  if (rem) {
    const Vec kv = load_f(k + nfull * W, rem);
    for (int g = 0; g < GR; ++g) acc[g] = at::vec::fmadd(Vec::loadu(q + g * dp + nfull * W), kv, acc[g]);
  }
  for (int g = 0; g < GR; ++g) s[g * kDecodeChunk] = hsum(acc[g]);
}

// Scores of one chunk: rows[j] is position j's key row of the item's first head.
constexpr int kAhead = 4;  // positions ahead to software-prefetch (blocks are scattered in memory)

template <typename T>
inline void prefetch_span(const T* row, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < elems * int64_t(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

template <typename T, int GR>
void qk_chunk(const T* const* rows, int n, int nh, int64_t head_stride, int G, const float* q, int dp, int d,
              float* s) {
  const int64_t span = (nh - 1) * head_stride + d;
  for (int j = 0; j < n; ++j) {
    if (j + kAhead < n) prefetch_span(rows[j + kAhead], span);
    for (int h = 0; h < nh; ++h) {
      const T* k = rows[j] + h * head_stride;
      const int r0 = h * G;
      int g = 0;
      for (; g + GR <= G; g += GR) dot_rows<T, GR>(k, q + (r0 + g) * dp, dp, d, s + (r0 + g) * kDecodeChunk + j);
      for (; g < G; ++g) dot_rows<T, 1>(k, q + (r0 + g) * dp, dp, d, s + (r0 + g) * kDecodeChunk + j);
    }
  }
}

// acc[r][c0*W, (c0+NV)*W) += p[r][j] * v_j for every position j and query row r = h * G + g;
// `rem` lanes of the slice's last vector when that is the row's partial tail (0: full).
template <typename T, int NV>
void pv_chunk(const T* const* rows, int n, int nh, int64_t head_stride, int G, const float* p, float* acc,
              int dp, int c0, int rem) {
  const int64_t span = (nh - 1) * head_stride + dp;
  for (int j = 0; j < n; ++j) {
    if (c0 == 0 && j + kAhead < n) prefetch_span(rows[j + kAhead], span);
    for (int h = 0; h < nh; ++h) {
      const T* v = rows[j] + h * head_stride + c0 * W;
      Vec vv[NV];
      for (int c = 0; c < NV; ++c) vv[c] = (rem && c == NV - 1) ? load_f(v + c * W, rem) : load_f(v + c * W);
      for (int g = 0; g < G; ++g) {
        const int r = h * G + g;
        const Vec pj(p[r * kDecodeChunk + j]);
        float* o = acc + r * dp + c0 * W;
        for (int c = 0; c < NV; ++c) at::vec::fmadd(pj, vv[c], Vec::loadu(o + c * W)).store(o + c * W);
      }
    }
  }
}

constexpr int kMaxSliceVecs = W == 16 ? 8 : 4;  // output vectors per pv_chunk pass

template <typename T>
using QkFn = void (*)(const T* const*, int, int, int64_t, int, const float*, int, int, float*);
template <typename T>
using PvFn = void (*)(const T* const*, int, int, int64_t, int, const float*, float*, int, int, int);

template <typename T>
QkFn<T> qk_fn(int G) {
  switch (std::min(G, 4)) {
    case 1: return &qk_chunk<T, 1>;
    case 2: return &qk_chunk<T, 2>;
    case 3: return &qk_chunk<T, 3>;
    default: return &qk_chunk<T, 4>;
  }
}

template <typename T>
PvFn<T> pv_fn(int nv) {
  switch (nv) {
    case 1: return &pv_chunk<T, 1>;
    case 2: return &pv_chunk<T, 2>;
    case 3: return &pv_chunk<T, 3>;
    case 4: return &pv_chunk<T, 4>;
#if defined(CPU_CAPABILITY_AVX512)
    case 5: return &pv_chunk<T, 5>;
    case 6: return &pv_chunk<T, 6>;
    case 7: return &pv_chunk<T, 7>;
    default: return &pv_chunk<T, 8>;
#else
    default: return &pv_chunk<T, 4>;
#endif
  }
}

// Online-softmax update of one query row's chunk scores s[0, n): scores become probabilities.
inline void softmax_update(float* s, int n, float& m, float& l, float& alpha) {
  const int np = static_cast<int>(round_up(n, W));
  for (int j = n; j < np; ++j) s[j] = kNegInf;
  Vec mx(kNegInf);
  for (int j = 0; j < np; j += W) mx = vmax(mx, Vec::loadu(s + j));
  const float m_new = std::max(m, hmax(mx));
  alpha = std::exp(m - m_new);  // m == -inf: 0
  Vec sum(0.f);
  const Vec mv(m_new);
  for (int j = 0; j < np; j += W) {
    const Vec e = (Vec::loadu(s + j) - mv).exp_u20();
    e.store(s + j);
    sum = sum + e;
  }
  l = l * alpha + hsum(sum);
  m = m_new;
}

}  // namespace

template <typename T>
void decode_item(const Attn<T>& a, const WorkItem& it, DecodeScratch<T>& s, const Partials& parts) {
  const int G = a.group, D = a.head_dim, dp = a.dp(), rem = D % W, nvec = dp / W, rows_n = it.nh * G;
  float* q = s.f.get();
  float* acc = q + rows_n * dp;
  float* scores = acc + rows_n * dp;
  float* m = scores + rows_n * kDecodeChunk;
  float* l = m + rows_n;
  float* alpha = l + rows_n;
  const T** krows = s.rows.get();
  const T** vrows = krows + kDecodeChunk;
  for (int r = 0; r < rows_n; ++r) {
    const T* qr = a.q_row(it.row0, it.head * G + r);
    for (int x = 0; x < D; ++x) q[r * dp + x] = static_cast<float>(qr[x]) * a.scale;
    for (int x = D; x < dp; ++x) q[r * dp + x] = 0.f;
    m[r] = kNegInf;
    l[r] = 0.f;
  }
  std::fill(acc, acc + rows_n * dp, 0.f);
  const int32_t* table = a.table(it.seq);
  const QkFn<T> qk = qk_fn<T>(G);
  for (int c0 = it.kv0; c0 < it.kv1; c0 += kDecodeChunk) {
    const int n = std::min(kDecodeChunk, it.kv1 - c0);
    for (int j = 0; j < n; ++j) {
      krows[j] = a.key_row(table, c0 + j, it.head);
      vrows[j] = a.value_row(table, c0 + j, it.head);
    }
    qk(krows, n, it.nh, a.k_sh, G, q, dp, D, scores);
    for (int r = 0; r < rows_n; ++r) {
      softmax_update(scores + r * kDecodeChunk, n, m[r], l[r], alpha[r]);
      const Vec al(alpha[r]);
      for (int x = 0; x < dp; x += W) (Vec::loadu(acc + r * dp + x) * al).store(acc + r * dp + x);
    }
    for (int v0 = 0; v0 < nvec; v0 += kMaxSliceVecs) {
      const int nv = std::min(kMaxSliceVecs, nvec - v0);
      pv_fn<T>(nv)(vrows, n, it.nh, a.v_sh, G, scores, acc, dp, v0, v0 + nv == nvec ? rem : 0);
    }
  }
  if (it.split >= 0) {
    for (int h = 0; h < it.nh; ++h) {
      const int64_t slot = (int64_t(it.slot0) + int64_t(h) * it.nsplit + it.split) * G;
      std::copy(m + h * G, m + (h + 1) * G, parts.m + slot);
      std::copy(l + h * G, l + (h + 1) * G, parts.l + slot);
      std::copy(acc + h * G * dp, acc + (h + 1) * G * dp, parts.o + slot * dp);
    }
    return;
  }
  for (int r = 0; r < rows_n; ++r) {
    const Vec inv(l[r] > 0.f ? 1.f / l[r] : 0.f);
    T* o = a.out_row(it.row0, it.head * G + r);
    for (int x = 0; x < D; x += W) store_f(o + x, Vec::loadu(acc + r * dp + x) * inv, std::min(W, D - x));
  }
}

template void decode_item<float>(const Attn<float>&, const WorkItem&, DecodeScratch<float>&, const Partials&);
template void decode_item<c10::BFloat16>(const Attn<c10::BFloat16>&, const WorkItem&,
                                         DecodeScratch<c10::BFloat16>&, const Partials&);
template void decode_item<c10::Half>(const Attn<c10::Half>&, const WorkItem&, DecodeScratch<c10::Half>&,
                                     const Partials&);

}  // namespace kvf
