// paged_attention: checks, the parallel run of the work plan (attention_plan.cpp) and the split reduce.
//
// Every decode and prefill item runs on torch's intra-op pool with dynamic scheduling, longest first
// (the plan's order); each worker claims its next item before it runs one, so that a decode item fetches
// the next one's K/V into L2 while it computes. Decode items that are one kv range of a row write (max,
// sum, unnormalized output) partials, which reduce_splits combines per (sequence, kv head) after all items
// are done.
#include "ops.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "attention.h"

namespace kvf {
namespace {

// out rows of one (sequence, kv head) = softmax-weighted combination of its split partials.
template <typename T>
void reduce_splits(const Attn<T>& a, const Plan::Reduce& r, const Partials& parts) {
  const int G = a.group, D = a.head_dim, dp = parts.dp;
  for (int g = 0; g < G; ++g) {
    float m = kNegInf;
    for (int s = 0; s < r.count; ++s) m = std::max(m, parts.m[(r.first + s) * G + g]);
    float l = 0.f;
    for (int s = 0; s < r.count; ++s) l += std::exp(parts.m[(r.first + s) * G + g] - m) * parts.l[(r.first + s) * G + g];
    const float inv = a.norm(m, l, r.head * G + g);  // with a sink: its exp(s - m) joins l
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
    std::unique_ptr<DecodeScratch<T>> decode, cascade;
    std::unique_ptr<PrefillScratch<T>> prefill;
  };
  dynamic_for_ahead(
      static_cast<int64_t>(plan.items.size()), [] { return State{}; },
      [&](State& st, int64_t i, int64_t j) {
        const WorkItem& it = plan.items[i];
        if (it.run_n > 0) {
          if (!st.cascade)
            st.cascade = std::make_unique<DecodeScratch<T>>(plan.cascade_rows, kCascadeGroup, a.head_dim,
                                                            cascade_work(plan.cascade_rows, a.head_dim));
          cascade_item(a, it, plan.cascade.data() + it.run0, *st.cascade, parts);
        } else if (it.nq == 1) {
          if (!st.decode) st.decode = std::make_unique<DecodeScratch<T>>(plan.heads * G, G, a.head_dim);
          const bool ahead = j >= 0 && plan.items[j].nq == 1 && plan.items[j].run_n == 0;
          decode_item(a, it, *st.decode, parts, ahead ? &plan.items[j] : nullptr);
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
                  const at::Tensor& bt, double scale, int window, const float* sinks) {
  return Attn<T>{q.data_ptr<T>(), q.stride(0), q.stride(1), out.data_ptr<T>(), out.stride(0), out.stride(1),
                 kc.data_ptr<T>(), kc.stride(0), kc.stride(1), kc.stride(2), vc.data_ptr<T>(), vc.stride(0),
                 vc.stride(1), vc.stride(2), bt.data_ptr<int32_t>(), bt.stride(0), int(q.size(1) / kc.size(2)),
                 int(q.size(2)), int(kc.size(1)), static_cast<float>(scale), window, sinks};
}

}  // namespace

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                     int64_t split_tokens, int64_t window, bool cascade,
                     const c10::optional<at::Tensor>& sinks) {
  TORCH_CHECK(window >= 0 && window < (int64_t(1) << 30), "window must be in [0, 2^30)");
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
  const Plan plan = make_plan(qsl.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), bt.data_ptr<int32_t>(),
                              bt.stride(0), batch, query.size(0), int(key_cache.size(2)), group,
                              int(query.size(2)), int(key_cache.size(1)), key_cache.element_size(),
                              split_tokens, window, cascade);
  const int win = static_cast<int>(window);
  const float* sk = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == query.size(1) &&
                    sinks->is_contiguous() && sinks->device().is_cpu(),
                "sinks must be a contiguous fp32 CPU tensor [Hq]");
    sk = sinks->data_ptr<float>();
  }
  for (const auto& [r0, r1] : plan.zero_rows) out.narrow(0, r0, r1 - r0).zero_();
  switch (dtype) {
    case at::kFloat: run(make_attn<float>(out, query, key_cache, value_cache, bt, scale, win, sk), plan); break;
    case at::kBFloat16:
      run(make_attn<c10::BFloat16>(out, query, key_cache, value_cache, bt, scale, win, sk), plan);
      break;
    case at::kHalf: run(make_attn<c10::Half>(out, query, key_cache, value_cache, bt, scale, win, sk), plan); break;
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", dtype);
  }
}

}  // namespace kvf
