// AMX decode kernel for bf16 caches (see decode_kernels.h): the scores come from tile matrix products,
// everything else is the AVX512-BF16 kernel (decode_bf16.cpp). Compiled only when the build targets a
// CPU with amx_tile, amx_bf16 and avx512_bf16 (-march=native), and used only when Linux grants this
// process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM).
//
// A tile of 16 keys of one block is a 16-row matrix at the cache's token stride, so one tile load per
// 32-element slice reads it in place (A, 16 keys x 32 elements). The query rows of the item are packed
// once into the VNNI layout (B, 16 element pairs x N columns: the G rows of up to 16 / G heads).
// C[16 keys][N] += A . B is one _tile_dpbf16ps per slice, ~4.3 ns whatever N is, against ~1.5 ns per
// key and query row for the AVX-512 dot products + transpose-reduce (vdpbf16ps issues every ~2 cycles
// on these machines), so GQA rows get their scores up to G-fold cheaper (used for G >= 2 only, see
// amx_decode_kernel). Products are exact and summed in fp32, as with vdpbf16ps. Tiles that are not 16
// evenly spaced rows (a chunk's tail, a block boundary of blocks smaller than 16, unaligned forced
// splits) go to the AVX-512 scores.
//
// Cascade items (attention_decode.cpp) also get their P V products from tiles (cascade_pv below).
//
// Tile state: prepare() loads the tile configuration for the item and end() releases it, so the
// thread's tile state is back to INIT between items (oneDNN reconfigures its own on use: its lazy
// configure compares against the loaded configuration).
#include "decode_kernels.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KVF_HAVE_AMX 1
#endif

namespace kvf {

#if defined(KVF_HAVE_AMX)
namespace {

using BF = c10::BFloat16;

bool tiles_granted() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: B slices 0..NV-1 (the q pairs of a head group, N = 16 / G heads x G columns: a tile product
// costs the same for any N, so one resident B serves every head of the group and the product with head
// h's keys is read from its own columns); per head C (16 keys x N) and A (16 keys x 32 elements) tiles.
// Two (C, A) sets for D <= 64 (tiles 2-4 and 5-7) let one head's products run while the next head's
// keys load; D > 64 has one set (tiles 4-6). (GCC's tile intrinsics take literal tile numbers.)
template <int NV>
constexpr int kSets = NV <= 2 ? 2 : 1;

template <int NV>
constexpr bool is_a_tile(int t) {
  return NV <= 2 ? (t == 3 || t == 4 || t == 6 || t == 7) : (t == 5 || t == 6);
}

inline int heads_per_b(int nh, int G) { return std::min(nh, 16 / G); }

template <int NV>
inline void load_b(const uint32_t* b, int N) {
  _tile_loadd(0, b, 4 * N);
  if constexpr (NV > 1) _tile_loadd(1, b + 16 * N, 4 * N);
  if constexpr (NV > 2) _tile_loadd(2, b + 32 * N, 4 * N);
  if constexpr (NV > 3) _tile_loadd(3, b + 48 * N, 4 * N);
}

// B tiles per head group: b[((grp * NV + c) * 16 + r) * N + (h % hg) * G + g] = the element pair
// (32c + 2r, 32c + 2r + 1) of query row h * G + g (bf16 rows as pack_q wrote them), zero-padded columns.
template <int NV>
void prepare(const float* q, int qstride, int rows, int G, int, float* extra) {
  const int nh = rows / G, hg = heads_per_b(nh, G), N = hg * G, groups = (nh + hg - 1) / hg;
  uint32_t* b = reinterpret_cast<uint32_t*>(extra);
  std::fill(b, b + groups * NV * 16 * N, 0u);
  for (int h = 0; h < nh; ++h)
    for (int g = 0; g < G; ++g) {
      const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q + (h * G + g) * qstride);
      for (int c = 0; c < NV; ++c)
        for (int r = 0; r < 16; ++r) b[(((h / hg) * NV + c) * 16 + r) * N + (h % hg) * G + g] = pairs[16 * c + r];
    }
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = static_cast<uint16_t>(4 * N);  // B and C tiles
  }
  for (int t = 0; t < 8; ++t)
    if (is_a_tile<NV>(t)) cfg.colsb[t] = 64;
  // Not _tile_loadconfig: GCC 12 does not see that it reads the whole 64 bytes and drops the stores.
  asm volatile("ldtilecfg %0" : : "m"(cfg));
  if (groups == 1) load_b<NV>(b, N);  // resident for the whole item
}

void end() { _tile_release(); }

// C (16 keys x N) of one head into buf [16][16]: sum over the NV slices of its keys (A, 16 rows
// `stride` bytes apart) times B slice c (tile c).
#define KVF_HEAD_SCORES(NAME, C, A0, A1)                       \
  template <int NV>                                            \
  inline void NAME(const BF* k, int64_t stride, float* buf) {  \
    _tile_zero(C);                                             \
    _tile_loadd(A0, k, stride);                                \
    _tile_dpbf16ps(C, A0, 0);                                  \
    if constexpr (NV > 1) {                                    \
      _tile_loadd(A1, k + 32, stride);                         \
      _tile_dpbf16ps(C, A1, 1);                                \
    }                                                          \
    if constexpr (NV > 2) {                                    \
      _tile_loadd(A0, k + 64, stride);                         \
      _tile_dpbf16ps(C, A0, 2);                                \
    }                                                          \
    if constexpr (NV > 3) {                                    \
      _tile_loadd(A1, k + 96, stride);                         \
      _tile_dpbf16ps(C, A1, 3);                                \
    }                                                          \
    _tile_stored(C, buf, 64);                                  \
  }
KVF_HEAD_SCORES(scores_set0, 2, 3, 4)
KVF_HEAD_SCORES(scores_set1, 5, 6, 7)
KVF_HEAD_SCORES(scores_wide, 4, 5, 6)
#undef KVF_HEAD_SCORES

// s rows of head columns [col, col + G) of buf, times scale.
inline void extract(const float* buf, int col, int G, __m512 sc, float* s) {
  if (G == 1) {
    const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176,
                                                           192, 208, 224, 240), _mm512_set1_epi32(col));
    _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_i32gather_ps(idx, buf, 4), sc));
    return;
  }
  at::vec::transpose_mxn<float>(buf + col, 16, s, kDecodeChunk, 16, G);
  for (int g = 0; g < G; ++g)
    _mm512_storeu_ps(s + g * kDecodeChunk, _mm512_mul_ps(_mm512_loadu_ps(s + g * kDecodeChunk), sc));
}

template <int NV>
void qk(const BF* const* rows, int64_t off, int n, int nh, int64_t hstride, const BF* zero, const float* q,
        int qstride, const float* extra, int G, int d, float scale, float* s, const PrefetchJob<BF>& pf) {
  const DecodeKernel<BF>& avx = *bf16_dot_decode_kernel(d);
  const uint32_t* b = reinterpret_cast<const uint32_t*>(extra);
  const int hg = heads_per_b(nh, G), N = hg * G;
  const __m512 sc = _mm512_set1_ps(scale);
  alignas(64) float buf[2][16 * 16];
  for (int j0 = 0; j0 < n; j0 += 16) {
    const BF* const* r = rows + j0;
    bool even = j0 + 16 <= n && r[1] > r[0];
    const int64_t step = even ? r[1] - r[0] : 0;
    for (int j = 2; even && j < 16; ++j) even = r[j] - r[0] == j * step;
    if (!even) {
      avx.qk(r, off, std::min(16, n - j0), nh, hstride, zero, q, qstride, nullptr, G, d, scale, s + j0,
             j0 == 0 ? pf : PrefetchJob<BF>{});
      continue;
    }
    const int64_t stride = step * int64_t(sizeof(BF));
    for (int h0 = 0; h0 < nh; h0 += hg) {
      if (hg < nh) load_b<NV>(b + (h0 / hg) * NV * 16 * N, N);  // else resident since prepare()
      const int h1 = std::min(nh, h0 + hg);
      for (int h = h0; h < h1; h += kSets<NV>) {
        if (j0 == 0) {
          pf.part(h, nh);
          if (h + 1 < h1) pf.part(h + 1, nh);
        }
        const BF* k = r[0] + off + h * hstride;
        const bool pair = kSets<NV> == 2 && h + 1 < h1;
        if constexpr (kSets<NV> == 2) {
          scores_set0<NV>(k, stride, buf[0]);
          if (pair) scores_set1<NV>(k + hstride, stride, buf[1]);
        } else {
          scores_wide<NV>(k, stride, buf[0]);
        }
        extract(buf[0], (h - h0) * G, G, sc, s + h * G * kDecodeChunk + j0);
        if (pair) extract(buf[1], (h + 1 - h0) * G, G, sc, s + (h + 1) * G * kDecodeChunk + j0);
      }
    }
  }
}

// Cascade P V (decode_kernels.h: cascade_pv). P is split into bf16 high and low parts (p = hi + lo to
// ~2^-17), each multiplied with V by tile products summed in fp32, so the result is as exact as the
// fp32 FMAs of pv. Per 32 keys: P rows are A tiles (16 rows x 32 keys) and V is repacked into VNNI
// B tiles (16 key pairs x 16 dims, zero past n). C tiles (16 rows x 16 dims of acc) go through tiles
// FIRST..5, A is tile 6 and B tile 7, so the q tiles 0..NV-1 that qk keeps resident stay untouched;
// the tile configuration is prepare()'s for G = 16 (every tile 16 rows x 64 bytes).
inline void pack_p(const float* p, int n, int nrows, int nk, uint16_t* hi, uint16_t* lo) {
  for (int r = 0; r < nrows; ++r)
    for (int j = 0; j < nk * 32; j += 16) {
      const __mmask16 valid = j >= n ? 0 : n - j >= 16 ? 0xFFFF : __mmask16((1u << (n - j)) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(valid, p + r * kDecodeChunk + j);
      const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
      const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + r * 64 + j), h);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + r * 64 + j),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, back)));
    }
}

// vb[(ks * nct + ct) * 512 + r * 32 + 2x + e] = v[32 ks + 2r + e][16 ct + x]; keys past n are 0.
inline void pack_v(const BF* const* rows, int n, int nk, int d, uint16_t* vb) {
  const int nct = d / 16;
  __m512i idx_lo;
  {
    alignas(64) int16_t ix[32];
    for (int x = 0; x < 16; ++x) {
      ix[2 * x] = int16_t(x);
      ix[2 * x + 1] = int16_t(32 + x);
    }
    idx_lo = _mm512_load_si512(ix);
  }
  for (int ks = 0; ks < nk; ++ks)
    for (int r = 0; r < 16; ++r) {
      const int j0 = 32 * ks + 2 * r, j1 = j0 + 1;
      for (int ct = 0; ct < nct; ++ct) {
        const __m512i a = j0 < n ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                       reinterpret_cast<const __m256i*>(rows[j0] + 16 * ct)))
                                 : _mm512_setzero_si512();
        const __m512i b = j1 < n ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                       reinterpret_cast<const __m256i*>(rows[j1] + 16 * ct)))
                                 : _mm512_setzero_si512();
        _mm512_storeu_si512(vb + (ks * nct + ct) * 512 + r * 32, _mm512_permutex2var_epi16(a, idx_lo, b));
      }
    }
}

// One row tile x up to SLOTS column tiles (ct0...) of acc: C tiles C0.. (literal tile numbers: GCC's
// tile intrinsics take no variables).
#define KVF_CASCADE_GROUP(NAME, SLOTS, C0, C1, C2, C3)                                                  \
  inline void NAME(const uint16_t* hi, const uint16_t* lo, int nk, const uint16_t* vb, int nct, int ct0,  \
                   int cn, float* c, int64_t cstride) {                                                 \
    if (0 < cn) _tile_loadd(C0, c + 16 * (ct0 + 0), cstride);                                           \
    if (SLOTS > 1 && 1 < cn) _tile_loadd(C1, c + 16 * (ct0 + 1), cstride);                              \
    if (SLOTS > 2 && 2 < cn) _tile_loadd(C2, c + 16 * (ct0 + 2), cstride);                              \
    if (SLOTS > 3 && 3 < cn) _tile_loadd(C3, c + 16 * (ct0 + 3), cstride);                              \
    for (int ks = 0; ks < nk; ++ks)                                                                     \
      for (const uint16_t* a : {hi, lo}) {                                                              \
        _tile_loadd(6, a + 32 * ks, 128);                                                               \
        const uint16_t* b = vb + (ks * nct + ct0) * 512;                                                \
        if (0 < cn) { _tile_loadd(7, b, 64); _tile_dpbf16ps(C0, 6, 7); }                                \
        if (SLOTS > 1 && 1 < cn) { _tile_loadd(7, b + 512, 64); _tile_dpbf16ps(C1, 6, 7); }             \
        if (SLOTS > 2 && 2 < cn) { _tile_loadd(7, b + 1024, 64); _tile_dpbf16ps(C2, 6, 7); }            \
        if (SLOTS > 3 && 3 < cn) { _tile_loadd(7, b + 1536, 64); _tile_dpbf16ps(C3, 6, 7); }            \
      }                                                                                                 \
    if (0 < cn) _tile_stored(C0, c + 16 * (ct0 + 0), cstride);                                          \
    if (SLOTS > 1 && 1 < cn) _tile_stored(C1, c + 16 * (ct0 + 1), cstride);                             \
    if (SLOTS > 2 && 2 < cn) _tile_stored(C2, c + 16 * (ct0 + 2), cstride);                             \
    if (SLOTS > 3 && 3 < cn) _tile_stored(C3, c + 16 * (ct0 + 3), cstride);                             \
  }
KVF_CASCADE_GROUP(cascade_group4, 4, 2, 3, 4, 5)
KVF_CASCADE_GROUP(cascade_group3, 3, 3, 4, 5, 5)
KVF_CASCADE_GROUP(cascade_group2, 2, 4, 5, 5, 5)
#undef KVF_CASCADE_GROUP

template <int NV>
void cascade_pv(const BF* const* rows, int n, const float* p, int nrows, int d, float* acc, int astride,
                float* work) {
  constexpr int kSlots = NV <= 2 ? 4 : NV == 3 ? 3 : 2;  // C tiles NV.. below the A / B tiles 6, 7
  const int nk = (n + 31) / 32, nct = d / 16;
  uint16_t* hi = reinterpret_cast<uint16_t*>(work);
  uint16_t* lo = hi + int64_t(nrows) * kDecodeChunk;
  uint16_t* vb = lo + int64_t(nrows) * kDecodeChunk;  // cascade_work: 2 * nrows * 64 + 64 * d halves
  pack_p(p, n, nrows, nk, hi, lo);
  pack_v(rows, n, nk, d, vb);
  const int64_t cstride = int64_t(astride) * sizeof(float);
  for (int r0 = 0; r0 < nrows; r0 += 16) {
    const int64_t a0 = int64_t(r0) * kDecodeChunk;
    for (int ct0 = 0; ct0 < nct; ct0 += kSlots) {
      const int cn = std::min(kSlots, nct - ct0);
      float* c = acc + int64_t(r0) * astride;
      if constexpr (kSlots == 4) {
        cascade_group4(hi + a0, lo + a0, nk, vb, nct, ct0, cn, c, cstride);
      } else if constexpr (kSlots == 3) {
        cascade_group3(hi + a0, lo + a0, nk, vb, nct, ct0, cn, c, cstride);
      } else {
        cascade_group2(hi + a0, lo + a0, nk, vb, nct, ct0, cn, c, cstride);
      }
    }
  }
}

template <int NV>
const DecodeKernel<BF>* kernel(int head_dim) {
  static const DecodeKernel<BF> k = [&] {
    const DecodeKernel<BF>& avx = *bf16_dot_decode_kernel(head_dim);
    return DecodeKernel<BF>{"amx", avx.pack_q, &prepare<NV>, &end, &qk<NV>, avx.pv, avx.finish, &cascade_pv<NV>};
  }();
  return &k;
}

}  // namespace

const DecodeKernel<c10::BFloat16>* amx_decode_kernel(int head_dim, int group) {
  // G = 1: the AVX-512 scores keep up with the products (their L2 loads limit both) and stream cold
  // blocks better than tile loads (measured: 3.4 vs 2.95 ms on 64 x 544 distinct blocks), so AMX is
  // for GQA only.
  if (group < 2 || head_dim % 32 != 0 || group > 16 || bf16_dot_decode_kernel(head_dim) == nullptr ||
      !tiles_granted())
    return nullptr;
  switch (head_dim / 32) {
    case 1: return kernel<1>(head_dim);
    case 2: return kernel<2>(head_dim);
    case 3: return kernel<3>(head_dim);
    case 4: return kernel<4>(head_dim);
    default: return nullptr;
  }
}

#else

const DecodeKernel<c10::BFloat16>* amx_decode_kernel(int, int) { return nullptr; }

#endif

}  // namespace kvf
