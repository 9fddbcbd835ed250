// Decode items: one query row, kv heads [head, head + nh) of it, over a kv range of the paged cache.
//
// An item walks its kv range in chunks of kDecodeChunk (64) positions. Per chunk: a K pass, tile by
// tile of 16 keys for all of its heads (the kernel's qk: scores of every query row, one lane per key),
// one online-softmax step per query row over the chunk (max, rescale of the accumulator only when the
// max grows, vector exp), then a V pass (the kernel's pv: acc += P V, register-blocked), head by head
// over the chunk or, for rows of 512 B and more, tile by tile. The kernels (decode_kernels.h): for bf16
// caches the AVX512-BF16 ones (AMX scores with GQA) where the build has them, else the generic at::vec
// ones (fp32 FMAs, bf16/fp16 widened on load).
//
// Memory: the cache is token-major inside a block ([block_size, Hkv, D]), so one head's rows are D-long
// pieces Hkv*D apart, which the hardware prefetchers do not follow. The K pass reads each tile's token
// rows while the same tile's V rows are prefetched (into L2), and the V pass runs while the next chunk's
// K rows are prefetched, so a cold sequence streams each block once for K and once for V. Positions
// the plan marks hot (a shared prefix reused from L2, attention_plan.cpp) are not prefetched. Row
// pointers of a chunk are resolved once (block table lookups) for all heads. Across items: the worker's
// next decode item (up to 256 KB of its K/V) is fetched into L2 a slice per K tile and per V head of the
// current one, so an item's first chunk is not read cold (in the engine, 12-layer h768 model, 64 rows of
// 128-256 positions: 754-837 -> 664-697 us per call, alternating calls in one run).
#include <atomic>
#include <cstdlib>
#include <cmath>
#include <string>

#include "attention.h"
#include "ops.h"

namespace kvf {
namespace {

std::atomic<int> g_decode_mode{0};

// Mode 0: AMX, else AVX512-BF16, else generic; 2: AVX512-BF16, else generic; 1: generic.
template <typename T>
const DecodeKernel<T>& pick_kernel(int head_dim, int group) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const int mode = g_decode_mode.load(std::memory_order_relaxed);
    if (mode == 0)
      if (const auto* k = amx_decode_kernel(head_dim, group)) return *k;
    if (mode != 1)
      if (const auto* k = bf16_dot_decode_kernel(head_dim)) return *k;
  }
  return generic_decode_kernel<T>();
}

// Software prefetch of rows[j0, j1), `bytes` each, into L2 (l1: into L1): the token-major cache puts one
// head's rows Hkv * D apart, a pattern the hardware prefetchers do not follow.
template <typename T>
inline void prefetch_rows(const T* const* rows, int j0, int j1, int64_t off, int64_t bytes, bool l1) {
  for (int j = j0; j < j1; ++j) {
    const char* p = reinterpret_cast<const char*>(rows[j] + off);
    for (int64_t b = 0; b < bytes; b += 64) {
      if (l1) {
        __builtin_prefetch(p + b, 0, 3);
      } else {
        __builtin_prefetch(p + b, 0, 2);
      }
    }
  }
}

// Online-softmax step of one query row over a chunk's scores s[0, round_up(n, kDecodeTile)) (lanes past
// n are -inf): s becomes the probabilities.
inline void softmax_step(float* s, int n, float& m, float& l, float* acc, int dpa) {
  const int np = static_cast<int>(round_up(n, kDecodeTile));
  Vec mx(kNegInf);
  for (int j = 0; j < np; j += W) mx = vmax(mx, Vec::loadu(s + j));
  const float m_new = std::max(m, hmax(mx));
  if (m_new > m) {
    if (l > 0.f) {  // acc and l hold earlier chunks: rescale them to the new max
      const float alpha = std::exp(m - m_new);
      l *= alpha;
      const Vec al(alpha);
      for (int x = 0; x < dpa; x += W) (Vec::loadu(acc + x) * al).store(acc + x);
    }
    m = m_new;
  }
  const Vec mv(m);
  Vec sum(0.f);
  for (int j = 0; j < np; j += W) {
    const Vec e = (Vec::loadu(s + j) - mv).exp_u20();
    e.store(s + j);
    sum = sum + e;
  }
  l += hsum(sum);
}

// Row pointers of positions [c0, c0 + n) for the item's first head.
template <typename T>
int chunk_rows(const Attn<T>& a, const int32_t* table, int head, int c0, int c_end, const T** kr,
               const T** vr) {
  const int n = std::min(kDecodeChunk, c_end - c0);
  int blk = c0 / a.block_size, slot = c0 % a.block_size;
  const T* kb = a.k + head * a.k_sh + table[blk] * a.k_sb;
  const T* vb = a.v + head * a.v_sh + table[blk] * a.v_sb;
  for (int j = 0; j < n; ++j) {
    kr[j] = kb + slot * a.k_st;
    vr[j] = vb + slot * a.v_st;
    if (++slot == a.block_size && j + 1 < n) {
      slot = 0;
      ++blk;
      kb = a.k + head * a.k_sh + table[blk] * a.k_sb;
      vb = a.v + head * a.v_sh + table[blk] * a.v_sb;
    }
  }
  return n;
}

// The worker's next decode item, fetched into L2 while this one computes: its kv positions past the ones
// it expects in cache, up to kAheadBytes of K and V, one slice per fetch() call of this item. A block's
// token rows are contiguous ([block_size, Hkv, D]), so a slice is fetched block piece by block piece.
constexpr int64_t kAheadBytes = 256 << 10;

template <typename T>
struct Ahead {
  const Attn<T>* a = nullptr;
  const int32_t* table = nullptr;
  int p0 = 0, p1 = 0, parts = 1, done = 0;
  // calls: how many times the current item will call fetch().
  Ahead(const Attn<T>& at, const WorkItem* next, int calls) {
    if (next == nullptr) return;
    a = &at;
    table = at.table(next->seq);
    const int64_t row = at.k_st * int64_t(sizeof(T));
    const int64_t fit = std::max<int64_t>(1, kAheadBytes / (2 * row));
    p0 = std::max(next->kv0, next->hot);
    p1 = int(std::min<int64_t>(next->kv1, p0 + fit));
    parts = std::max(1, calls);
  }
  // The next slice (called once per K tile and per V head or tile of the current item).
  void fetch() {
    if (a == nullptr || done >= parts) return;
    const int n = p1 - p0;
    const int s0 = p0 + int(int64_t(n) * done / parts), s1 = p0 + int(int64_t(n) * (done + 1) / parts);
    ++done;
    const int bs = a->block_size;
    for (int pos = s0; pos < s1;) {
      const int blk = pos / bs, end = std::min(s1, (blk + 1) * bs);
      const int64_t rows = end - pos, slot = pos % bs;
      const char* k = reinterpret_cast<const char*>(a->k + table[blk] * a->k_sb + slot * a->k_st);
      const char* v = reinterpret_cast<const char*>(a->v + table[blk] * a->v_sb + slot * a->v_st);
      for (int64_t b = 0; b < rows * a->k_st * int64_t(sizeof(T)); b += 64) __builtin_prefetch(k + b, 0, 2);
      for (int64_t b = 0; b < rows * a->v_st * int64_t(sizeof(T)); b += 64) __builtin_prefetch(v + b, 0, 2);
      pos = end;
    }
  }
};

}  // namespace

template <typename T>
void decode_item(const Attn<T>& a, const WorkItem& it, DecodeScratch<T>& s, const Partials& parts,
                 const WorkItem* next) {
  const DecodeKernel<T>& kern = pick_kernel<T>(a.head_dim, a.group);
  const int G = a.group, D = a.head_dim, dpa = s.dpa, rows_n = it.nh * G;
  float *q = s.q(), *acc = s.acc(), *m = s.m(), *l = s.l(), *sc = s.scores();
  for (int r = 0; r < rows_n; ++r) {
    kern.pack_q(a.q_row(it.row0, it.head * G + r), D, q + r * dpa);
    m[r] = kNegInf;
    l[r] = 0.f;
  }
  std::fill(acc, acc + int64_t(rows_n) * dpa, 0.f);
  if (kern.prepare) kern.prepare(q, dpa, rows_n, G, D, s.qx());
  const int32_t* table = a.table(it.seq);
  const T** kc = s.row_ptrs(0);
  const T** vc = s.row_ptrs(1);
  const T** kn = s.row_ptrs(2);
  const T** vn = s.row_ptrs(3);
  const int64_t bytes = int64_t(D) * sizeof(T);
  const int64_t kspan = (it.nh - 1) * a.k_sh * int64_t(sizeof(T)) + bytes;  // all heads of a K row
  const int64_t vspan = (it.nh - 1) * a.v_sh * int64_t(sizeof(T)) + bytes;
  // Prefetch policy (measured here): token rows (all heads of the item) under 2 KB are fetched in bursts
  // per tile / per head; larger ones in pieces spread over the heads of a kernel call, so the line-fill
  // buffers never fill up (16 rows x 3 KB at once cost h768 fp32 ~10%, spreading 768 B rows cost SmolLM2
  // fp32 at 2048 tokens ~30%).
  const bool spread = kspan >= 2048, v_tiles = bytes >= 512;
  const int tiles = (it.kv1 - it.kv0 + kDecodeTile - 1) / kDecodeTile;
  const int chunks = (it.kv1 - it.kv0 + kDecodeChunk - 1) / kDecodeChunk;
  Ahead<T> ahead(a, next, tiles + (v_tiles ? tiles * it.nh : chunks * it.nh));
  int n = chunk_rows(a, table, it.head, it.kv0, it.kv1, kc, vc);
  for (int c0 = it.kv0; c0 < it.kv1; c0 += kDecodeChunk) {
    const int c1 = c0 + kDecodeChunk;
    const int n_next = c1 < it.kv1 ? chunk_rows(a, table, it.head, c1, it.kv1, kn, vn) : 0;
    const int cold = std::max(0, it.hot - c0), cold_next = std::max(0, it.hot - c1);  // first rows to fetch
    // Scores, tile by tile for all heads (a K tile is streamed once, token row after token row), while
    // the V rows of the tile are fetched for the V pass.
    for (int j0 = 0; j0 < n; j0 += kDecodeTile) {
      const int j1 = std::min(n, j0 + kDecodeTile);
      if (c0 == it.kv0) prefetch_rows(kc, std::max(j1, cold), std::min(n, j1 + kDecodeTile), 0, kspan, true);
      ahead.fetch();
      PrefetchJob<T> pf;
      if (spread) {
        pf = {vc, std::max(j0, cold), j1, vspan};
      } else {
        prefetch_rows(vc, std::max(j0, cold), j1, 0, vspan, false);
      }
      kern.qk(kc + j0, 0, j1 - j0, it.nh, a.k_sh, s.zero(), q, dpa, s.qx(), G, D, a.scale, sc + j0, pf);
    }
    for (int r = 0; r < rows_n; ++r) softmax_step(sc + r * kDecodeChunk, n, m[r], l[r], acc + r * dpa, dpa);
    // acc += P V (its rows are in cache now) while the next chunk's K rows are fetched: head by head over
    // the chunk, or for rows of 512 B and more tile by tile (token-major: a head's rows of a whole chunk
    // would be 64 pages and, at 4 KB apart, 64 rows in the same L1 sets).
    if (v_tiles) {
      for (int j0 = 0; j0 < n; j0 += kDecodeTile) {
        const int j1 = std::min(n, j0 + kDecodeTile);
        const PrefetchJob<T> pf{kn, std::max(j0, cold_next), std::min(n_next, j0 + kDecodeTile), kspan};
        for (int h = 0; h < it.nh; ++h) {
          pf.part(h, it.nh);
          ahead.fetch();
          kern.pv(vc + j0, h * a.v_sh, j1 - j0, 1, 0, sc + h * G * kDecodeChunk + j0, G, D, acc + h * G * dpa,
                  dpa);
        }
      }
    } else {
      for (int h = 0; h < it.nh; ++h) {
        ahead.fetch();
        if (spread) {
          PrefetchJob<T>{kn, cold_next, n_next, kspan}.part(h, it.nh);
        } else {
          prefetch_rows(kn, cold_next, n_next, h * a.k_sh, bytes, false);
        }
        kern.pv(vc, h * a.v_sh, n, 1, 0, sc + h * G * kDecodeChunk, G, D, acc + h * G * dpa, dpa);
      }
    }
    std::swap(kc, kn);
    std::swap(vc, vn);
    n = n_next;
  }
  if (kern.end) kern.end();
  float* row = s.row_buf();
  for (int r = 0; r < rows_n; ++r) {
    kern.finish(acc + r * dpa, D, row);
    if (it.split >= 0) {
      const int h = r / G, g = r % G;
      const int64_t slot = (int64_t(it.slot0) + int64_t(h) * it.nsplit + it.split) * G + g;
      parts.m[slot] = m[r];
      parts.l[slot] = l[r];
      std::copy(row, row + D, parts.o + slot * parts.dp);
      continue;
    }
    const Vec inv(a.norm(m[r], l[r], it.head * G + r));
    T* o = a.out_row(it.row0, it.head * G + r);
    for (int x = 0; x < D; x += W) store_f(o + x, Vec::loadu(row + x) * inv, std::min(W, D - x));
  }
}

// A cascade item: the decode rows of run_n sequences (G query rows each, padded to virtual heads of
// kCascadeGroup rows) against one kv range of the prefix they share, for kv head it.head. The kernels see
// one "head" per kCascadeGroup rows, all reading the same K/V rows (head stride 0), so every K tile is
// loaded once for all the rows and AMX products fill their 16 columns; each row's (max, sum, output)
// goes to its sequence's partial slot of split it.split.
template <typename T>
void cascade_item(const Attn<T>& a, const WorkItem& it, const CascadeSeq* seqs, DecodeScratch<T>& s,
                  const Partials& parts) {
  const DecodeKernel<T>& kern = pick_kernel<T>(a.head_dim, kCascadeGroup);
  const int G = a.group, D = a.head_dim, dpa = s.dpa, rows = it.run_n * G;
  const int nv = static_cast<int>(round_up(rows, kCascadeGroup)) / kCascadeGroup, padded = nv * kCascadeGroup;
  float *q = s.q(), *acc = s.acc(), *m = s.m(), *l = s.l(), *sc = s.scores();
  for (int r = 0; r < padded; ++r) {
    if (r < rows) {
      kern.pack_q(a.q_row(seqs[r / G].row, it.head * G + r % G), D, q + r * dpa);
    } else {
      std::fill(q + r * dpa, q + (r + 1) * dpa, 0.f);  // zero bits: a zero query in every kernel's layout
    }
    m[r] = kNegInf;
    l[r] = 0.f;
  }
  std::fill(acc, acc + int64_t(padded) * dpa, 0.f);
  if (kern.prepare) kern.prepare(q, dpa, padded, kCascadeGroup, D, s.qx());
  const int32_t* table = a.table(it.seq);
  const T** kc = s.row_ptrs(0);
  const T** vc = s.row_ptrs(1);
  const T** kn = s.row_ptrs(2);
  const T** vn = s.row_ptrs(3);
  const int64_t bytes = int64_t(D) * sizeof(T);
  int n = chunk_rows(a, table, it.head, it.kv0, it.kv1, kc, vc);
  for (int c0 = it.kv0; c0 < it.kv1; c0 += kDecodeChunk) {
    const int c1 = c0 + kDecodeChunk;
    const int n_next = c1 < it.kv1 ? chunk_rows(a, table, it.head, c1, it.kv1, kn, vn) : 0;
    prefetch_rows(kn, 0, n_next, 0, bytes, false);
    prefetch_rows(vn, 0, n_next, 0, bytes, false);
    for (int j0 = 0; j0 < n; j0 += kDecodeTile) {
      const int j1 = std::min(n, j0 + kDecodeTile);
      kern.qk(kc + j0, 0, j1 - j0, nv, 0, s.zero(), q, dpa, s.qx(), kCascadeGroup, D, a.scale, sc + j0,
              PrefetchJob<T>{});
    }
    for (int r = 0; r < padded; ++r) softmax_step(sc + r * kDecodeChunk, n, m[r], l[r], acc + r * dpa, dpa);
    if (kern.cascade_pv) {
      kern.cascade_pv(vc, n, sc, padded, D, acc, dpa, s.extra.get());
    } else {
      kern.pv(vc, 0, n, nv, 0, sc, kCascadeGroup, D, acc, dpa);  // rows already point at it.head
    }
    std::swap(kc, kn);
    std::swap(vc, vn);
    n = n_next;
  }
  if (kern.end) kern.end();
  float* row = s.row_buf();
  for (int r = 0; r < rows; ++r) {
    if (kern.cascade_pv) {
      std::copy(acc + r * dpa, acc + r * dpa + D, row);
    } else {
      kern.finish(acc + r * dpa, D, row);
    }
    const CascadeSeq& sq = seqs[r / G];
    const int64_t slot = (int64_t(sq.slot0) + int64_t(it.head) * sq.nsplit + it.split) * G + r % G;
    parts.m[slot] = m[r];
    parts.l[slot] = l[r];
    std::copy(row, row + D, parts.o + slot * parts.dp);
  }
}

std::string set_decode_kernel(const std::string& name) {
  static const char* const kNames[] = {"auto", "generic", "avx512_bf16"};
  int mode = -1;
  for (int i = 0; i < 3; ++i)
    if (name == kNames[i]) mode = i;
  TORCH_CHECK(mode >= 0, "decode kernel must be 'auto', 'avx512_bf16' or 'generic', not '", name, "'");
  return kNames[g_decode_mode.exchange(mode)];
}

bool has_bf16_dot_decode() { return bf16_dot_decode_kernel(64) != nullptr; }
bool has_amx_decode() { return amx_decode_kernel(64, 2) != nullptr; }

template void decode_item<float>(const Attn<float>&, const WorkItem&, DecodeScratch<float>&, const Partials&,
                                 const WorkItem*);
template void decode_item<c10::BFloat16>(const Attn<c10::BFloat16>&, const WorkItem&,
                                         DecodeScratch<c10::BFloat16>&, const Partials&, const WorkItem*);
template void decode_item<c10::Half>(const Attn<c10::Half>&, const WorkItem&, DecodeScratch<c10::Half>&,
                                     const Partials&, const WorkItem*);
template void cascade_item<float>(const Attn<float>&, const WorkItem&, const CascadeSeq*, DecodeScratch<float>&,
                                  const Partials&);
template void cascade_item<c10::BFloat16>(const Attn<c10::BFloat16>&, const WorkItem&, const CascadeSeq*,
                                          DecodeScratch<c10::BFloat16>&, const Partials&);
template void cascade_item<c10::Half>(const Attn<c10::Half>&, const WorkItem&, const CascadeSeq*,
                                      DecodeScratch<c10::Half>&, const Partials&);

}  // namespace kvf
