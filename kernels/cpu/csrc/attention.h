// Paged attention on the CPU: shared types of the planner (attention.cpp) and the two item kernels.
//
// A work item is (sequence, range of kv heads, query rows, kv range). All G = Hq / Hkv query heads of
// a kv head are computed together, so every K/V row is read from the paged cache once per item, and an
// item walks its positions across all its kv heads so it streams the token-major blocks. Decode items
// (one query row) take dot products over D; prefill items (a tile of query rows) run two small GEMMs
// per K/V tile on a transposed, prescaled Q tile. Both keep an online softmax (running max and sum) in
// fp32. A decode item that is one kv split of a long context writes (max, sum, unnormalized output) to
// partial slots that a reduce pass combines.
#pragma once

#include "vec.h"

namespace kvf {

template <typename T>
struct Attn {
  const T* q;  // query [T, Hq, D]
  int64_t q_st, q_sh;
  T* out;  // out [T, Hq, D]
  int64_t o_st, o_sh;
  const T* k;  // key cache [num_blocks, block_size, Hkv, D] (any block stride)
  int64_t k_sb, k_st, k_sh;
  const T* v;
  int64_t v_sb, v_st, v_sh;
  const int32_t* block_tables;  // [B, max_blocks]
  int64_t bt_stride;
  int group, head_dim, block_size;
  float scale;

  int dp() const { return static_cast<int>(round_up(head_dim, W)); }
  const int32_t* table(int seq) const { return block_tables + seq * bt_stride; }
  const T* key_row(const int32_t* table, int64_t pos, int head) const {
    return k + table[pos / block_size] * k_sb + (pos % block_size) * k_st + head * k_sh;
  }
  const T* value_row(const int32_t* table, int64_t pos, int head) const {
    return v + table[pos / block_size] * v_sb + (pos % block_size) * v_st + head * v_sh;
  }
  T* out_row(int64_t row, int head) const { return out + row * o_st + head * o_sh; }
  const T* q_row(int64_t row, int head) const { return q + row * q_st + head * q_sh; }
};

struct WorkItem {
  int64_t cost;
  int32_t seq;
  int32_t head, nh;   // kv heads [head, head + nh) (prefill items: nh == 1)
  int32_t row0, nq;   // first query row (in query/out) and number of query rows
  int32_t pos0;       // position of row0 in its sequence (rows are the sequence's last positions)
  int32_t kv0, kv1;   // kv positions to attend to (decode split), or [0, pos0 + nq) for a tile
  int32_t split;      // -1: write out directly; else which of nsplit kv ranges of a decode row this is
  int32_t nsplit, slot0;  // partial slot of (head + h, split s) = slot0 + h * nsplit + s
};

// Partial results of decode splits: per slot (one kv head of one split), G maxima, G sums and G
// unnormalized output rows of dp floats.
struct Partials {
  float* m;
  float* l;
  float* o;
  int group, dp;
};

constexpr int kDecodeChunk = 128;  // kv positions whose scores a decode item keeps at once
constexpr int kKvTile = 32;        // kv positions per prefill K/V tile
constexpr int kTileRows = 64;      // target query rows x heads in one prefill tile

template <typename T>
struct DecodeScratch {
  Scratch f;  // per query row (up to `rows` = heads * G): q, acc [dp] | scores [chunk] | m, l, alpha
  std::unique_ptr<const T*[]> rows;  // key rows then value rows of one chunk
  explicit DecodeScratch(int rows, int dp)
      : f(int64_t(rows) * (2 * dp + kDecodeChunk + 3)), rows(new const T*[2 * kDecodeChunk]) {}
};

template <typename T>
struct PrefillScratch {
  // Per head: qt [dp*mgp] | o [mgp*dp] | m, l [mgp]; then shared: s [tile*mgp] | kb, vb [tile*dp] |
  // zero [dp] | alpha, qpos [mgp].
  struct Head {
    float *qt, *o, *m, *l;
  };
  int mgp_max, dp, heads;
  Scratch f;
  std::unique_ptr<const float*[]> rows;  // key rows then value rows of one tile (fp32)
  PrefillScratch(int mgp, int dp_, int heads_)
      : mgp_max(mgp), dp(dp_), heads(heads_),
        f(int64_t(heads_) * per_head() + kKvTile * mgp + 2 * kKvTile * dp_ + dp_ + 2 * mgp),
        rows(new const float*[2 * kKvTile]) {}
  int64_t per_head() const { return 2 * int64_t(dp) * mgp_max + 2 * mgp_max; }
  Head head(int h) const {
    float* base = f.get() + h * per_head();
    float* o = base + int64_t(dp) * mgp_max;
    float* m = o + int64_t(mgp_max) * dp;
    return {base, o, m, m + mgp_max};
  }
  float* shared() const { return f.get() + heads * per_head(); }
};

template <typename T>
void decode_item(const Attn<T>& a, const WorkItem& it, DecodeScratch<T>& s, const Partials& parts);

template <typename T>
void prefill_item(const Attn<T>& a, const WorkItem& it, PrefillScratch<T>& s);

}  // namespace kvf
