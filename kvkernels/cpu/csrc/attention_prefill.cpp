// Prefill items: a tile of query rows x G query heads (mg rows, padded to mgp lanes) for each kv head of
// the item, over the causal kv range.
//
// Q is packed once per item, transposed and prescaled: qt[x][r]. Per K/V tile of kKvTile positions
// S^T[n][r] = k_n . q_r is a register-blocked GEMM (U positions x RV row vectors, k_n[x] broadcast,
// qt row loaded), so one K tile serves every row of the item and the softmax runs down columns with
// whole vectors. O[r] = alpha_r * O[r] + sum_n P^T[n][r] * v_n is the second register-blocked GEMM
// (R rows x CV output vectors). Row vectors whose positions all precede the tile are skipped. fp32
// caches are read in place; bf16/fp16 tiles are converted once per head. The next tile of all the
// item's heads is software-prefetched while the current one computes.
#include "attention.h"

#include <cmath>

namespace kvf {
namespace {

constexpr int kQkMaxRV = W == 16 ? 4 : 2;
constexpr int kPvMaxCV = W == 16 ? 4 : 2;
constexpr int kTokenPad = 8;  // tile positions are padded to this (zero rows) for the QK blocking

// s[u][rv0*W ..] = krow[u] . qt[:, rv0*W ..] for U positions and RV row vectors.
template <int U, int RV>
void qk_tile(const float* const* krow, const float* qt, int mgp, int d, float* s, int rv0) {
  Vec acc[U][RV];
  for (int u = 0; u < U; ++u)
    for (int j = 0; j < RV; ++j) acc[u][j] = Vec(0.f);
  const float* qcol = qt + rv0 * W;
  for (int x = 0; x < d; ++x) {
    Vec qv[RV];
    for (int j = 0; j < RV; ++j) qv[j] = Vec::loadu(qcol + x * mgp + j * W);
    for (int u = 0; u < U; ++u) {
      const Vec kx(krow[u][x]);
      for (int j = 0; j < RV; ++j) acc[u][j] = at::vec::fmadd(kx, qv[j], acc[u][j]);
    }
  }
  for (int u = 0; u < U; ++u)
    for (int j = 0; j < RV; ++j) acc[u][j].store(s + u * mgp + (rv0 + j) * W);
}

template <int RV>
void qk_rows(const float* const* krow, int npad, const float* qt, int mgp, int d, float* s, int rv0) {
  constexpr int U = (RV <= 2 && W == 16) || RV == 1 ? 8 : 4;
  for (int u0 = 0; u0 < npad; u0 += U) qk_tile<U, RV>(krow + u0, qt, mgp, d, s + u0 * mgp, rv0);
}

// o[r0..r0+R)[c0*W ..] = alpha_r * o + sum_n p[n][r] * vrow[n][c0*W ..] for CV output vectors.
template <int R, int CV>
void pv_tile(const float* p, int mgp, int r0, const float* const* vrow, int n, float* o, int dp, int c0,
             const float* alpha) {
  Vec acc[R][CV];
  for (int r = 0; r < R; ++r) {
    const Vec a(alpha[r0 + r]);
    for (int c = 0; c < CV; ++c) acc[r][c] = Vec::loadu(o + (r0 + r) * dp + (c0 + c) * W) * a;
  }
  for (int j = 0; j < n; ++j) {
    Vec vv[CV];
    for (int c = 0; c < CV; ++c) vv[c] = Vec::loadu(vrow[j] + (c0 + c) * W);
    for (int r = 0; r < R; ++r) {
      const Vec pj(p[j * mgp + r0 + r]);
      for (int c = 0; c < CV; ++c) acc[r][c] = at::vec::fmadd(pj, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CV; ++c) acc[r][c].store(o + (r0 + r) * dp + (c0 + c) * W);
}

template <int CV>
void pv_rows(const float* p, int mgp, int r_begin, const float* const* vrow, int n, float* o, int dp, int c0,
             const float* alpha) {
  constexpr int R = (CV <= 2 && W == 16) ? 8 : 4;
  for (int r0 = r_begin; r0 < mgp; r0 += R) pv_tile<R, CV>(p, mgp, r0, vrow, n, o, dp, c0, alpha);
}

using QkFn = void (*)(const float* const*, int, const float*, int, int, float*, int);
using PvFn = void (*)(const float*, int, int, const float* const*, int, float*, int, int, const float*);
#if defined(CPU_CAPABILITY_AVX512)
constexpr QkFn kQk[] = {&qk_rows<1>, &qk_rows<2>, &qk_rows<3>, &qk_rows<4>};
constexpr PvFn kPv[] = {&pv_rows<1>, &pv_rows<2>, &pv_rows<3>, &pv_rows<4>};
#else
constexpr QkFn kQk[] = {&qk_rows<1>, &qk_rows<2>};
constexpr PvFn kPv[] = {&pv_rows<1>, &pv_rows<2>};
#endif

// Convert one row of d values to fp32 at dst (the padding lanes of dst are left as they are).
template <typename T>
void to_fp32(const T* src, float* dst, int d) {
  int x = 0;
  for (; x + W <= d; x += W) load_f(src + x).store(dst + x);
  if (x < d) load_f(src + x, d - x).store(dst + x, d - x);
}

// Q of every head of the item, scaled, into that head's o ([mgp][dp], zero rows past mg) in memory
// order (position, head, g), then transposed into its qt [D][mgp].
template <typename T>
void pack_q(const Attn<T>& a, const WorkItem& it, const PrefillScratch<T>& s, int mg, int mgp) {
  const int G = a.group, D = a.head_dim, dp = a.dp();
  const Vec scale(a.scale);
  for (int i = 0; i < it.nq; ++i) {
    for (int h = 0; h < it.nh; ++h) {
      float* o = s.head(h).o;
      for (int g = 0; g < G; ++g) {
        const T* qr = a.q_row(it.row0 + i, (it.head + h) * G + g);
        float* dst = o + (i * G + g) * dp;
        int x = 0;
        for (; x + W <= D; x += W) (load_f(qr + x) * scale).store(dst + x);
        if (x < D) (load_f(qr + x, D - x) * scale).store(dst + x, D - x);
      }
    }
  }
  for (int h = 0; h < it.nh; ++h) {
    const auto st = s.head(h);
    for (int r = mg; r < mgp; ++r) std::fill(st.o + r * dp, st.o + r * dp + D, 0.f);
    at::vec::transpose_mxn<float>(st.o, dp, st.qt, mgp, mgp, D);
  }
}

// One kv tile [n0, n0 + nv) for one head: S^T = K Q^T, causal (and window) mask, online softmax,
// O += P V. Rows before r_begin see none of the tile (their positions are all smaller) and are left as
// they are. window > 0: position n is hidden from rows at n + window or later (last_pos: the item's last
// row position); such a row may see nothing of a tile, so the softmax max is guarded against -inf.
void tile_step(const float* const* krow, const float* const* vrow, int nv, int n0, int pos0, int group,
               const float* qt, float* o, float* m, float* l, float* sc, float* alpha, const float* qpos, int mgp,
               int d, int dp, int window, int last_pos) {
  const int npad = static_cast<int>(round_up(nv, kTokenPad)), rvn = mgp / W, cvn = dp / W;
  const int r_begin = std::max(0, n0 - pos0) * group / W * W;
  for (int rv0 = r_begin / W; rv0 < rvn; rv0 += kQkMaxRV)
    kQk[std::min(kQkMaxRV, rvn - rv0) - 1](krow, npad, qt, mgp, d, sc, rv0);
  // Causal mask: position n0 + j is hidden from rows whose position is smaller.
  for (int j = std::max(0, pos0 + 1 - n0); j < nv; ++j) {
    const Vec kp(static_cast<float>(n0 + j)), ninf(kNegInf);
    for (int r = r_begin; r < mgp; r += W) {
      float* sj = sc + j * mgp + r;
      Vec::blendv(Vec::loadu(sj), ninf, kp > Vec::loadu(qpos + r)).store(sj);
    }
  }
  // Window mask: position n0 + j is hidden from rows whose position is n0 + j + window or more.
  for (int j = 0; window > 0 && j < nv && n0 + j + window <= last_pos; ++j) {
    const Vec edge(static_cast<float>(n0 + j + window)), ninf(kNegInf);
    for (int r = r_begin; r < mgp; r += W) {
      float* sj = sc + j * mgp + r;
      Vec::blendv(Vec::loadu(sj), ninf, Vec::loadu(qpos + r) >= edge).store(sj);
    }
  }
  const Vec ninf(kNegInf), zero(0.f);
  for (int r = r_begin; r < mgp; r += W) {
    Vec mx = Vec::loadu(sc + r);
    for (int j = 1; j < nv; ++j) mx = vmax(mx, Vec::loadu(sc + j * mgp + r));
    const Vec m_old = Vec::loadu(m + r), m_new = vmax(m_old, mx);
    const Vec m_use = window > 0 ? Vec::blendv(m_new, zero, m_new == ninf) : m_new;  // all hidden: e = 0
    Vec sum(0.f);
    for (int j = 0; j < nv; ++j) {
      const Vec e = (Vec::loadu(sc + j * mgp + r) - m_use).exp_u20();
      e.store(sc + j * mgp + r);
      sum = sum + e;
    }
    const Vec al = (m_old - m_use).exp_u20();  // m_old == -inf: 0
    al.store(alpha + r);
    at::vec::fmadd(Vec::loadu(l + r), al, sum).store(l + r);
    m_new.store(m + r);
  }
  for (int c0 = 0; c0 < cvn; c0 += kPvMaxCV)
    kPv[std::min(kPvMaxCV, cvn - c0) - 1](sc, mgp, r_begin, vrow, nv, o, dp, c0, alpha);
}

template <typename T>
void prefetch_rows(const T* row, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

}  // namespace

template <typename T>
void prefill_item(const Attn<T>& a, const WorkItem& it, PrefillScratch<T>& s) {
  const int G = a.group, D = a.head_dim, dp = a.dp();
  const int mg = it.nq * G, mgp = static_cast<int>(round_up(mg, W));
  float* sc = s.shared();
  float* kb = sc + kKvTile * s.mgp_max;
  float* vb = kb + kKvTile * dp;
  float* zero = vb + kKvTile * dp;
  float* alpha = zero + dp;
  float* qpos = alpha + s.mgp_max;
  const float** krow = s.rows.get();
  const float** vrow = krow + kKvTile;

  for (int r = 0; r < mgp; ++r)
    qpos[r] = r < mg ? static_cast<float>(it.pos0 + r / G) : std::numeric_limits<float>::max();
  pack_q(a, it, s, mg, mgp);
  for (int h = 0; h < it.nh; ++h) {
    const auto st = s.head(h);
    std::fill(st.m, st.m + mgp, kNegInf);
    std::fill(st.l, st.l + mgp, 0.f);
    std::fill(st.o, st.o + mgp * dp, 0.f);
  }

  const int32_t* table = a.table(it.seq);
  const int kv_end = it.pos0 + it.nq;
  constexpr bool kFloat = std::is_same_v<T, float>;
  const bool v_in_place = kFloat && D % W == 0;
  // The item's heads of one position are one contiguous span of the token row.
  const int64_t k_span = ((it.nh - 1) * a.k_sh + D) * int64_t(sizeof(T));
  const int64_t v_span = ((it.nh - 1) * a.v_sh + D) * int64_t(sizeof(T));
  for (int n0 = it.kv0; n0 < kv_end; n0 += kKvTile) {
    const int nv = std::min(kKvTile, kv_end - n0);
    // Fetch the next tile (all heads) while this one computes: the rows of one head alone sit Hkv*D
    // apart, a pattern the hardware prefetchers do not follow.
    for (int j = n0 + kKvTile; j < std::min(kv_end, n0 + 2 * kKvTile); ++j) {
      prefetch_rows(a.key_row(table, j, it.head), k_span);
      prefetch_rows(a.value_row(table, j, it.head), v_span);
    }
    for (int h = 0; h < it.nh; ++h) {
      for (int j = 0; j < nv; ++j) {
        const T* kr = a.key_row(table, n0 + j, it.head + h);
        const T* vr = a.value_row(table, n0 + j, it.head + h);
        if constexpr (kFloat) {
          krow[j] = kr;
        } else {
          to_fp32(kr, kb + j * dp, D);
          krow[j] = kb + j * dp;
        }
        if (v_in_place) {
          vrow[j] = reinterpret_cast<const float*>(vr);
        } else {
          to_fp32(vr, vb + j * dp, D);
          vrow[j] = vb + j * dp;
        }
      }
      for (int j = nv; j < kKvTile; ++j) krow[j] = zero;
      const auto st = s.head(h);
      tile_step(krow, vrow, nv, n0, it.pos0, G, st.qt, st.o, st.m, st.l, sc, alpha, qpos, mgp, D, dp,
                a.window, kv_end - 1);
    }
  }
  for (int i = 0; i < it.nq; ++i) {  // in out's memory order: position, head, g
    for (int h = 0; h < it.nh; ++h) {
      const auto st = s.head(h);
      for (int g = 0; g < G; ++g) {
        const int r = i * G + g;
        const Vec inv(a.sinks == nullptr ? 1.f / st.l[r] : a.norm(st.m[r], st.l[r], (it.head + h) * G + g));
        T* out = a.out_row(it.row0 + i, (it.head + h) * G + g);
        for (int x = 0; x < D; x += W) store_f(out + x, Vec::loadu(st.o + r * dp + x) * inv, std::min(W, D - x));
      }
    }
  }
}

template void prefill_item<float>(const Attn<float>&, const WorkItem&, PrefillScratch<float>&);
template void prefill_item<c10::BFloat16>(const Attn<c10::BFloat16>&, const WorkItem&,
                                          PrefillScratch<c10::BFloat16>&);
template void prefill_item<c10::Half>(const Attn<c10::Half>&, const WorkItem&, PrefillScratch<c10::Half>&);

}  // namespace kvf
