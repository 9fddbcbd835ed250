// Paged attention on the CPU: shared types of the run (attention.cpp), the planner (attention_plan.cpp)
// and the two item kernels (attention_decode.cpp, attention_prefill.cpp).
//
// A work item is (sequence, range of kv heads, query rows, kv range). All G = Hq / Hkv query heads of
// a kv head are computed together, so every K/V row is read from the paged cache once per item, and an
// item walks its positions across all its kv heads so it streams the token-major blocks. Decode items
// (one query row) score tiles of 16 keys per vector (decode_kernels.h); prefill items (a tile of query
// rows) run two small GEMMs per K/V tile on a transposed, prescaled Q tile. Both keep an online softmax
// (running max and sum) in fp32. A decode item that is one kv range of a row (a split of a long
// context, or the shared prefix / tail of a prefix-cached row) writes (max, sum, unnormalized output)
// to partial slots that a reduce pass combines. A cascade item (decode rows of many sequences whose
// tables start with the same blocks) scores the shared prefix for all their query rows at once, so each
// shared K/V row is read once per item instead of once per sequence; its partials join each row's reduce.
#pragma once

#include "decode_kernels.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <vector>

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
  int window;  // > 0: a query at position p sees only positions (p - window, p]
  const float* sinks;  // [Hq] or nullptr: a per-head logit added to each softmax's denominator only

  // Normalizer of a row's online softmax (max m, sum l) for query head qh: out = acc * returned value.
  // With a sink s the denominator gains exp(s) (gpt-oss: softmax over [scores, s], the s column dropped),
  // taken at the larger of m and s so that neither exp overflows.
  float norm(float m, float l, int qh) const {
    if (sinks == nullptr) return l > 0.f ? 1.f / l : 0.f;
    if (!(l > 0.f)) return 0.f;
    const float s = sinks[qh], mf = std::max(m, s), keep = std::exp(m - mf);
    return keep / (l * keep + std::exp(s - mf));
  }

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
  int32_t kv0, kv1;   // kv positions to attend to (decode split), or [window start of pos0, pos0 + nq)
  int32_t split;      // -1: write out directly; else which of nsplit kv ranges of a decode row this is
  int32_t nsplit, slot0;  // partial slot of (head + h, split s) = slot0 + h * nsplit + s
  int32_t hot = 0;        // decode: positions below this are expected in cache (a shared prefix)
  int32_t run0 = 0, run_n = 0;  // cascade: Plan::cascade[run0, run0 + run_n) share kv [kv0, kv1) of `seq`
};

// One sequence of a cascade item: its decode query row and its partial slots (as WorkItem's).
struct CascadeSeq {
  int32_t row, slot0, nsplit;
};

constexpr int kCascadeGroup = 16;  // a cascade item's query rows, as "heads" of this many rows over one K

// Partial results of decode splits: per slot (one kv head of one split), G maxima, G sums and G
// unnormalized output rows of dp floats.
struct Partials {
  float* m;
  float* l;
  float* o;
  int group, dp;
};

constexpr int kKvTile = 32;        // kv positions per prefill K/V tile
constexpr int kTileRows = 64;      // target query rows x heads in one prefill tile

// Per worker, for decode items of up to `rows` query rows (heads * G): packed q, the kernel's q data,
// accumulators (all kDecodeRowPad-padded rows), m, l per row; scores / probabilities
// [rows][kDecodeChunk]; an output row; a zero row; row pointers of the current and the next chunk.
template <typename T>
struct DecodeScratch {
  static constexpr int kRowPtrs = kDecodeChunk;
  int rows, group, dpa;
  Scratch f, extra;  // extra: a cascade kernel's work area (cascade_work)
  std::unique_ptr<const T*[]> ptrs;
  DecodeScratch(int rows_, int group_, int head_dim, int64_t extra_floats = 0)
      : rows(rows_), group(group_), dpa(static_cast<int>(round_up(head_dim, kDecodeRowPad))),
        f(3 * int64_t(rows_) * dpa + 2 * rows_ + int64_t(rows_) * kDecodeChunk + 2 * dpa), extra(extra_floats),
        ptrs(new const T*[4 * kRowPtrs]) {}
  float* q() const { return f.get(); }
  float* qx() const { return q() + int64_t(rows) * dpa; }  // the kernel's prepared q data
  float* acc() const { return qx() + int64_t(rows) * dpa; }
  float* m() const { return acc() + int64_t(rows) * dpa; }
  float* l() const { return m() + rows; }
  float* scores() const { return l() + rows; }
  float* row_buf() const { return scores() + int64_t(rows) * kDecodeChunk; }  // dpa floats
  const T* zero() const { return reinterpret_cast<const T*>(row_buf() + dpa); }  // dpa floats, never written
  const T** row_ptrs(int i) const { return ptrs.get() + i * kRowPtrs; }  // 0/1: K/V now, 2/3: next chunk
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

// The work of one paged_attention call (attention_plan.cpp).
struct Plan {
  std::vector<WorkItem> items;
  struct Reduce {
    int32_t seq, head, row, first, count;
  };
  std::vector<Reduce> reduces;
  std::vector<std::pair<int64_t, int64_t>> zero_rows;  // [begin, end) rows no sequence writes
  int32_t num_partials = 0;  // partial slots (one per kv head of a decode kv range)
  int tile_rows = 1;  // query rows per prefill tile
  int heads = 1;          // most kv heads in one item (for the threads)
  int decode_heads = 1;   // most kv heads in one item of a shared prefix (fewer, to share an L2)
  bool l2_groups = false; // shared prefixes: their decode items run head group by head group
  int prefill_heads = 1;  // most kv heads in one prefill item
  std::vector<CascadeSeq> cascade;  // the sequences of the cascade items, item by item
  int cascade_rows = 0;             // most query rows of one cascade item (padded to kCascadeGroup)
};

// qsl [B+1], lens [B], block tables bt (row stride bt_stride); elem_size: bytes of a cache element.
// window > 0: sliding-window attention (decode ranges and prefill tiles start at the window).
Plan make_plan(const int32_t* qsl, const int32_t* lens, const int32_t* bt, int64_t bt_stride, int64_t batch,
               int64_t num_tokens, int hkv, int group, int head_dim, int block_size, int64_t elem_size,
               int64_t split_tokens, int64_t window, bool cascade);

template <typename T>
void decode_item(const Attn<T>& a, const WorkItem& it, DecodeScratch<T>& s, const Partials& parts,
                 const WorkItem* next);

template <typename T>
void cascade_item(const Attn<T>& a, const WorkItem& it, const CascadeSeq* seqs, DecodeScratch<T>& s,
                  const Partials& parts);

template <typename T>
void prefill_item(const Attn<T>& a, const WorkItem& it, PrefillScratch<T>& s);

}  // namespace kvf
