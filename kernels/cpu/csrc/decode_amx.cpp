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

template <int NV>
const DecodeKernel<BF>* kernel(int head_dim) {
  static const DecodeKernel<BF> k = [&] {
    const DecodeKernel<BF>& avx = *bf16_dot_decode_kernel(head_dim);
    return DecodeKernel<BF>{"amx", avx.pack_q, &prepare<NV>, &end, &qk<NV>, avx.pv, avx.finish};
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
