// paged_attention: checks, the work plan (items, decode splits), the parallel run and the split reduce.
//
// Work items: a prefill item is (sequence, tile of query rows, range of kv heads); a decode item is
// (sequence, range of kv heads, kv range). All kv heads by default, so an item streams whole token rows
// of its blocks. Split rule, when the batch gives fewer than 2 items per thread: first each decode row
// of at least 2 * kMinSplit positions is cut into up to ceil(2 * threads / items) block-aligned kv
// ranges (none shorter than kMinSplit), then, if still short, the kv heads of every item are dealt
// into groups. split_tokens > 0 forces kv ranges of that many positions (tests, tuning). Items run
// longest first (dynamic scheduling over torch's thread pool).
#include "ops.h"

#include <ATen/core/Tensor.h>

#include <cmath>
#include <vector>

#include "attention.h"

namespace kvf {
namespace {

constexpr int64_t kMinSplit = 256;
constexpr int64_t kPrefillStateBytes = 1 << 20;  // per-head qt + O of a prefill item stay in L2

struct Plan {
  std::vector<WorkItem> items;
  struct Reduce {
    int32_t seq, head, row, first, count;
  };
  std::vector<Reduce> reduces;
  std::vector<std::pair<int64_t, int64_t>> zero_rows;  // [begin, end) rows no sequence writes
  int32_t num_partials = 0;
  int tile_rows = 1;  // query rows per prefill tile
  int heads = 1;          // most kv heads in one decode item
  int prefill_heads = 1;  // most kv heads in one prefill item
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

Plan make_plan(const int32_t* qsl, const int32_t* lens, int64_t batch, int64_t num_tokens, int hkv, int group,
               int head_dim, int block_size, int64_t split_tokens) {
  Plan p;
  p.tile_rows = std::max(1, kTileRows / group);
  int64_t covered = 0, prefill_items = 0, decode_rows = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q0 = qsl[b], q1 = qsl[b + 1], len = lens[b];
    TORCH_CHECK(q0 >= covered && q1 >= q0 && q1 <= num_tokens, "query_start_loc must be non-decreasing in [0, T]");
    TORCH_CHECK(len >= q1 - q0, "seq_lens[", b, "] = ", len, " is shorter than its ", q1 - q0, " queries");
    if (q0 > covered) p.zero_rows.emplace_back(covered, q0);
    covered = q1;
    if (q1 == q0) continue;
    if (len == 0) {
      p.zero_rows.emplace_back(q0, q1);
      continue;
    }
    if (q1 - q0 == 1) {
      ++decode_rows;
    } else {
      prefill_items += ceil_div(q1 - q0, p.tile_rows);
    }
  }
  if (covered < num_tokens) p.zero_rows.emplace_back(covered, num_tokens);
  const int64_t target = 2 * at::get_num_threads();
  const int64_t base = std::max<int64_t>(1, prefill_items + decode_rows);
  const int64_t auto_splits = base < target ? ceil_div(target, base) : 1;
  auto splits_of = [&](int64_t len) -> std::pair<int64_t, int64_t> {  // (splits, span)
    int64_t splits = 1;
    if (split_tokens > 0) {
      splits = ceil_div(len, split_tokens);
    } else if (auto_splits > 1 && len >= 2 * kMinSplit) {
      splits = std::min<int64_t>(auto_splits, len / kMinSplit);
    }
    const int64_t span = round_up(ceil_div(len, splits), split_tokens > 0 ? 1 : block_size);
    return {ceil_div(len, span), span};
  };
  int64_t total = prefill_items;
  for (int64_t b = 0; b < batch; ++b)
    if (qsl[b + 1] - qsl[b] == 1 && lens[b] > 0) total += splits_of(lens[b]).first;
  const int64_t groups = total < target ? std::min<int64_t>(hkv, ceil_div(target, std::max<int64_t>(total, 1))) : 1;
  p.heads = static_cast<int>(ceil_div(hkv, groups));
  const int64_t state = 8 * round_up(head_dim, W) * round_up(int64_t(p.tile_rows) * group, W);
  p.prefill_heads = static_cast<int>(std::clamp<int64_t>(kPrefillStateBytes / state, 1, p.heads));

  for (int64_t b = 0; b < batch; ++b) {
    const int32_t q0 = qsl[b], nq = qsl[b + 1] - q0, len = lens[b];
    if (nq == 0 || len == 0) continue;
    const int32_t pos0 = len - nq;
    if (nq > 1) {
      for (int32_t r = 0; r < nq; r += p.tile_rows) {
        const int32_t rows = std::min(p.tile_rows, nq - r);
        for (int32_t h0 = 0; h0 < hkv; h0 += p.prefill_heads) {
          const int32_t nh = std::min(p.prefill_heads, hkv - h0);
          const int64_t cost = int64_t(rows) * group * nh * (pos0 + r + rows / 2 + 1) + 64;
          p.items.push_back({cost, int32_t(b), h0, nh, q0 + r, rows, pos0 + r, 0, pos0 + r + rows, -1, 1, 0});
        }
      }
      continue;
    }
    const auto [splits, span] = splits_of(len);
    for (int32_t h0 = 0; h0 < hkv; h0 += p.heads) {
      const int32_t nh = std::min(p.heads, hkv - h0);
      if (splits == 1) {
        p.items.push_back({int64_t(len) * nh * group + 64, int32_t(b), h0, nh, q0, 1, pos0, 0, len, -1, 1, 0});
        continue;
      }
      const int32_t slot0 = p.num_partials;
      p.num_partials += nh * int32_t(splits);
      for (int32_t h = 0; h < nh; ++h) p.reduces.push_back({int32_t(b), h0 + h, q0, slot0 + h * int32_t(splits), int32_t(splits)});
      for (int64_t sp = 0; sp < splits; ++sp) {
        const int32_t kv0 = int32_t(sp * span), kv1 = int32_t(std::min<int64_t>(len, (sp + 1) * span));
        p.items.push_back({int64_t(kv1 - kv0) * nh * group + 64, int32_t(b), h0, nh, q0, 1, pos0, kv0, kv1,
                           int32_t(sp), int32_t(splits), slot0});
      }
    }
  }
  std::stable_sort(p.items.begin(), p.items.end(),
                   [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
  return p;
}

// out rows of one (sequence, kv head) = softmax-weighted combination of its split partials.
template <typename T>
void reduce_splits(const Attn<T>& a, const Plan::Reduce& r, const Partials& parts) {
  const int G = a.group, D = a.head_dim, dp = parts.dp;
  for (int g = 0; g < G; ++g) {
    float m = kNegInf;
    for (int s = 0; s < r.count; ++s) m = std::max(m, parts.m[(r.first + s) * G + g]);
    float l = 0.f;
    for (int s = 0; s < r.count; ++s) l += std::exp(parts.m[(r.first + s) * G + g] - m) * parts.l[(r.first + s) * G + g];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    T* out = a.out_row(r.row, r.head * G + g);
    for (int x = 0; x < D; x += W) {
      Vec acc(0.f);
      for (int s = 0; s < r.count; ++s) {
        const int64_t slot = int64_t(r.first + s) * G + g;
        const float wgt = parts.l[slot] > 0.f ? std::exp(parts.m[slot] - m) * inv : 0.f;
        acc = at::vec::fmadd(Vec(wgt), Vec::loadu(parts.o + slot * dp + x), acc);
      }
      store_f(out + x, acc, std::min(W, D - x));
    }
  }
}

template <typename T>
void run(const Attn<T>& a, const Plan& plan) {
  const int G = a.group, dp = a.dp();
  const int mgp_max = static_cast<int>(round_up(int64_t(plan.tile_rows) * G, W));
  Scratch pm(int64_t(plan.num_partials) * G), pl(int64_t(plan.num_partials) * G),
      po(int64_t(plan.num_partials) * G * dp);
  const Partials parts{pm.get(), pl.get(), po.get(), G, dp};
  struct State {
    std::unique_ptr<DecodeScratch<T>> decode;
    std::unique_ptr<PrefillScratch<T>> prefill;
  };
  dynamic_for(
      static_cast<int64_t>(plan.items.size()), [] { return State{}; },
      [&](State& st, int64_t i) {
        const WorkItem& it = plan.items[i];
        if (it.nq == 1) {
          if (!st.decode) st.decode = std::make_unique<DecodeScratch<T>>(plan.heads * G, dp);
          decode_item(a, it, *st.decode, parts);
        } else {
          if (!st.prefill) st.prefill = std::make_unique<PrefillScratch<T>>(mgp_max, dp, plan.prefill_heads);
          prefill_item(a, it, *st.prefill);
        }
      });
  dynamic_for(
      static_cast<int64_t>(plan.reduces.size()), [] { return 0; },
      [&](int, int64_t i) { reduce_splits(a, plan.reduces[i], parts); });
}

template <typename T>
Attn<T> make_attn(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                  const at::Tensor& bt, double scale) {
  return Attn<T>{q.data_ptr<T>(), q.stride(0), q.stride(1), out.data_ptr<T>(), out.stride(0), out.stride(1),
                 kc.data_ptr<T>(), kc.stride(0), kc.stride(1), kc.stride(2), vc.data_ptr<T>(), vc.stride(0),
                 vc.stride(1), vc.stride(2), bt.data_ptr<int32_t>(), bt.stride(0), int(q.size(1) / kc.size(2)),
                 int(q.size(2)), int(kc.size(1)), static_cast<float>(scale)};
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                     int64_t split_tokens) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [T, Hq, D]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "key/value cache must be [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(key_cache.size(3) == query.size(2), "head_dim of query and cache differ");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "Hq must be a multiple of Hkv");
  const auto dtype = query.scalar_type();
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &key_cache, &value_cache}) {
    TORCH_CHECK(t->scalar_type() == dtype, "query, out and caches must share one dtype");
    TORCH_CHECK(t->device().is_cpu() && t->stride(-1) == 1, "tensors must be CPU with a contiguous last dim");
  }
  TORCH_CHECK(query.stride(-1) == 1, "query needs a contiguous last dim");
  const auto bt = block_tables.to(at::kInt).contiguous();
  const auto qsl = query_start_loc.to(at::kInt).contiguous();
  const auto lens = seq_lens.to(at::kInt).contiguous();
  const int64_t batch = lens.size(0);
  TORCH_CHECK(qsl.numel() == batch + 1 && bt.dim() == 2 && bt.size(0) >= batch,
              "need query_start_loc [B+1] and block_tables [B, max_blocks]");
  const int group = int(query.size(1) / key_cache.size(2));
  const Plan plan = make_plan(qsl.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), batch, query.size(0),
                              int(key_cache.size(2)), group, int(query.size(2)), int(key_cache.size(1)),
                              split_tokens);
  for (const auto& [r0, r1] : plan.zero_rows) out.narrow(0, r0, r1 - r0).zero_();
  switch (dtype) {
    case at::kFloat: run(make_attn<float>(out, query, key_cache, value_cache, bt, scale), plan); break;
    case at::kBFloat16:
      run(make_attn<c10::BFloat16>(out, query, key_cache, value_cache, bt, scale), plan);
      break;
    case at::kHalf: run(make_attn<c10::Half>(out, query, key_cache, value_cache, bt, scale), plan); break;
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", dtype);
  }
}

}  // namespace kvf
