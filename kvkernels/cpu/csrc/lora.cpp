// Multi-LoRA shrink and expand on CPU: one call per layer for every adapter of a step.
//
// Tokens come grouped by adapter slot (segments), so each block of up to kTokens tokens of one segment
// reads its adapter's weights once: shrink streams the slot's A rows (R x K) against the block's x rows
// (widened to fp32 once), expand streams the slot's B rows (r x N) into kCols-wide fp32 accumulators of
// the block's output rows, then adds them into y with one rounding. Work items (token blocks, and for
// expand x column chunks) are handed out dynamically over torch's intra-op threads.
#include "lora.h"

#include "vec.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#include <immintrin.h>
#define KVF_LORA_BF16_DOT 1
#endif

namespace kvf {
namespace {

constexpr int kTokens = 4;          // tokens sharing each weight load
constexpr int kVecs = 4;            // expand: fp32 vectors of output columns per accumulator row
constexpr int kCols = kVecs * W;    // expand: output columns per inner tile
constexpr int64_t kChunk = 4 * kCols;  // expand: output columns per work item

// fn(T{}) with T the C++ type of dtype (float32, bfloat16 or float16).
template <typename F>
void dispatch(at::ScalarType dtype, const char* what, const F& fn) {
  switch (dtype) {
    case at::kFloat: return fn(float{});
    case at::kBFloat16: return fn(c10::BFloat16{});
    case at::kHalf: return fn(c10::Half{});
    default: TORCH_CHECK(false, what, ": dtype must be float32, bfloat16 or float16, not ", dtype);
  }
}

struct Block {
  int64_t slot, p0, p1;  // rows[p0 .. p1) of one segment
};

std::vector<Block> token_blocks(const at::Tensor& seg_start, const at::Tensor& seg_slot) {
  const int64_t* start = seg_start.data_ptr<int64_t>();
  const int64_t* slot = seg_slot.data_ptr<int64_t>();
  std::vector<Block> blocks;
  for (int64_t g = 0; g < seg_slot.size(0); ++g)
    for (int64_t p = start[g]; p < start[g + 1]; p += kTokens)
      blocks.push_back({slot[g], p, std::min(p + kTokens, start[g + 1])});
  return blocks;
}

void check_plan(const at::Tensor& rows, const at::Tensor& seg_start, const at::Tensor& seg_slot, int64_t slots) {
  for (const at::Tensor* t : {&rows, &seg_start, &seg_slot})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                "rows, seg_start and seg_slot must be contiguous int64 vectors");
  TORCH_CHECK(seg_start.size(0) == seg_slot.size(0) + 1, "seg_start must have one more entry than seg_slot");
  const int64_t* start = seg_start.data_ptr<int64_t>();
  const int64_t* slot = seg_slot.data_ptr<int64_t>();
  TORCH_CHECK(start[0] == 0 && start[seg_slot.size(0)] == rows.size(0), "segments must cover rows exactly");
  for (int64_t g = 0; g < seg_slot.size(0); ++g)
    TORCH_CHECK(start[g] <= start[g + 1] && slot[g] >= 0 && slot[g] < slots, "bad segment ", g);
}

template <typename T>
void shrink_block(float* s, int64_t R, const T* x, int64_t x_stride, const int64_t* rows, const Block& blk,
                  const T* a, int64_t K, float scale, float* xf) {
  const int nt = static_cast<int>(blk.p1 - blk.p0);
  const int64_t kp = round_up(K, W);
  for (int t = 0; t < nt; ++t) {
    const T* xr = x + rows[blk.p0 + t] * x_stride;
    for (int64_t k = 0; k < K; k += W) {
      const int n = static_cast<int>(std::min<int64_t>(W, K - k));
      load_f(xr + k, n).store(xf + t * kp + k);  // tail lanes are 0
    }
  }
  const T* ar = a + blk.slot * R * K;
  for (int64_t i = 0; i < R; ++i, ar += K) {
    Vec acc[kTokens] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
    for (int64_t k = 0; k < K; k += W) {
      const int n = static_cast<int>(std::min<int64_t>(W, K - k));
      const Vec av = n == W ? load_f(ar + k) : load_f(ar + k, n);
      for (int t = 0; t < nt; ++t) acc[t] = at::vec::fmadd(av, Vec::loadu(xf + t * kp + k), acc[t]);
    }
    for (int t = 0; t < nt; ++t) s[(blk.p0 + t) * R + i] = hsum(acc[t]) * scale;
  }
}

#if defined(KVF_LORA_BF16_DOT)
// bf16 shrink with AVX512-BF16: each _mm512_dpbf16_ps multiplies 32 bf16 pairs exactly into 16 fp32 lanes.
void shrink_block_bf16(float* s, int64_t R, const c10::BFloat16* x, int64_t x_stride, const int64_t* rows,
                       const Block& blk, const c10::BFloat16* a, int64_t K, float scale) {
  const int nt = static_cast<int>(blk.p1 - blk.p0);
  const c10::BFloat16* xr[kTokens];
  for (int t = 0; t < nt; ++t) xr[t] = x + rows[blk.p0 + t] * x_stride;
  const c10::BFloat16* ar = a + blk.slot * R * K;
  for (int64_t i = 0; i < R; ++i, ar += K) {
    __m512 acc[kTokens] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = 0; k < K; k += 32) {
      const int64_t left = K - k;
      const __mmask32 m = left >= 32 ? ~__mmask32(0) : __mmask32((1u << left) - 1);
      const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(m, ar + k);
      for (int t = 0; t < nt; ++t)
        acc[t] = _mm512_dpbf16_ps(acc[t], av, (__m512bh)_mm512_maskz_loadu_epi16(m, xr[t] + k));
    }
    for (int t = 0; t < nt; ++t) s[(blk.p0 + t) * R + i] = _mm512_reduce_add_ps(acc[t]) * scale;
  }
}
#endif

// One kCols-wide tile (n <= kCols columns from c) of a token block: y rows += s rows (r values) @ b rows.
template <typename T>
void expand_tile(T* y, int64_t N, const float* s, int64_t R, const int64_t* rows, const Block& blk,
                 const T* b, int64_t r, int64_t s_off, int64_t c, int64_t n) {
  const int nt = static_cast<int>(blk.p1 - blk.p0);
  const int nv = static_cast<int>((n + W - 1) / W);
  Vec acc[kTokens][kVecs];
  for (int t = 0; t < kTokens; ++t)
    for (int v = 0; v < kVecs; ++v) acc[t][v] = Vec(0.f);
  for (int64_t i = 0; i < r; ++i) {
    const T* br = b + (blk.slot * r + i) * N + c;
    Vec bv[kVecs];
    for (int v = 0; v < nv; ++v) {
      const int m = static_cast<int>(std::min<int64_t>(W, n - v * W));
      bv[v] = m == W ? load_f(br + v * W) : load_f(br + v * W, m);
    }
    for (int t = 0; t < nt; ++t) {
      const Vec sv(s[(blk.p0 + t) * R + s_off + i]);
      for (int v = 0; v < nv; ++v) acc[t][v] = at::vec::fmadd(bv[v], sv, acc[t][v]);
    }
  }
  for (int t = 0; t < nt; ++t) {
    T* yr = y + rows[blk.p0 + t] * N + c;
    for (int v = 0; v < nv; ++v) {
      const int m = static_cast<int>(std::min<int64_t>(W, n - v * W));
      store_f(yr + v * W, load_f(yr + v * W, m) + acc[t][v], m);
    }
  }
}

}  // namespace

void lora_shrink(at::Tensor& s, const at::Tensor& x, const at::Tensor& a, const at::Tensor& rows,
                 const at::Tensor& seg_start, const at::Tensor& seg_slot, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, K] with unit stride along K");
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && a.size(2) == x.size(1) && a.scalar_type() == x.scalar_type(),
              "a must be a contiguous [S, R, K] tensor in x's dtype");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == a.size(0),
              "scale must be fp32 [S]");
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 2 && s.size(0) == rows.size(0) &&
                  s.size(1) == a.size(1),
              "s must be a contiguous fp32 [P, R] tensor");
  check_plan(rows, seg_start, seg_slot, a.size(0));
  const auto blocks = token_blocks(seg_start, seg_slot);
  const int64_t K = x.size(1), R = a.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const float* sc = scale.data_ptr<float>();
  float* sp = s.data_ptr<float>();
  dispatch(x.scalar_type(), "lora_shrink", [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* ap = a.data_ptr<scalar_t>();
    dynamic_for(
        static_cast<int64_t>(blocks.size()), [&] { return Scratch(kTokens * round_up(K, W)); },
        [&](Scratch& xf, int64_t i) {
          const Block& blk = blocks[i];
#if defined(KVF_LORA_BF16_DOT)
          if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
            shrink_block_bf16(sp, R, xp, x.stride(0), rp, blk, ap, K, sc[blk.slot]);
            return;
          }
#endif
          shrink_block(sp, R, xp, x.stride(0), rp, blk, ap, K, sc[blk.slot], xf.get());
        });
  });
}

void lora_expand(at::Tensor& y, const at::Tensor& s, const at::Tensor& b, const at::Tensor& rows,
                 const at::Tensor& seg_start, const at::Tensor& seg_slot, const std::vector<int64_t>& shard_cols) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous(), "y must be a contiguous [T, N] tensor");
  TORCH_CHECK(b.dim() == 3 && b.is_contiguous() && b.size(2) == y.size(1) && b.scalar_type() == y.scalar_type(),
              "b must be a contiguous [S, r, N] tensor in y's dtype");
  const int64_t shards = static_cast<int64_t>(shard_cols.size()) - 1, r = b.size(1), N = y.size(1);
  TORCH_CHECK(shards >= 1 && shard_cols.front() == 0 && shard_cols.back() == N, "shard_cols must span [0, N]");
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 2 && s.size(0) == rows.size(0) &&
                  s.size(1) == shards * r,
              "s must be a contiguous fp32 [P, shards * r] tensor");
  check_plan(rows, seg_start, seg_slot, b.size(0));
  const auto blocks = token_blocks(seg_start, seg_slot);
  struct Item {
    int64_t block, shard, c0, c1;
  };
  std::vector<Item> items;
  for (int64_t i = 0; i < static_cast<int64_t>(blocks.size()); ++i)
    for (int64_t j = 0; j < shards; ++j)
      for (int64_t c = shard_cols[j]; c < shard_cols[j + 1]; c += kChunk)
        items.push_back({i, j, c, std::min(c + kChunk, shard_cols[j + 1])});
  const int64_t* rp = rows.data_ptr<int64_t>();
  const float* sp = s.data_ptr<float>();
  dispatch(y.scalar_type(), "lora_expand", [&](auto zero) {
    using scalar_t = decltype(zero);
    scalar_t* yp = y.data_ptr<scalar_t>();
    const scalar_t* bp = b.data_ptr<scalar_t>();
    dynamic_for(
        static_cast<int64_t>(items.size()), [] { return 0; },
        [&](int, int64_t i) {
          const Item& it = items[i];
          for (int64_t c = it.c0; c < it.c1; c += kCols)
            expand_tile(yp, N, sp, shards * r, rp, blocks[it.block], bp, r, it.shard * r, c,
                        std::min<int64_t>(kCols, it.c1 - c));
        });
  });
}

}  // namespace kvf
