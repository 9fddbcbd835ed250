// Greedy sampling's argmax over each row of the logits, read in their own dtype (fp32, bf16, fp16).
//
// torch.max(dim=-1) rules: the first index of the row's maximum, where NaN counts as the maximum (the
// first NaN wins). One vector pass finds the maximum (at::vec::maximum propagates NaN), a second scans
// for its first occurrence; rows run in parallel. Replaces fp32 conversion + torch.max of the whole
// [B, vocab] logits (~1.7 ms for 64 x 32k on one core) with ~2 reads of each row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "ops.h"
#include "vec.h"

namespace kvf {
namespace {

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  Vec mv(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + W <= n; i += W) mv = at::vec::maximum(mv, load_f(x + i));
  alignas(64) float lanes[W];
  mv.store(lanes);
  float m = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < W; ++j)
    if (std::isnan(lanes[j]) || lanes[j] > m) m = std::isnan(m) ? m : lanes[j];
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v) || v > m) m = std::isnan(m) ? m : v;
  }
  const bool nan = std::isnan(m);
  const Vec target(m);
  const int all = (1 << W) - 1;
  int64_t k = 0;
  for (; k + W <= n; k += W) {  // skip whole vectors without the maximum
    const Vec v = load_f(x + k);
    const Vec hit = nan ? (v != v) : (v == target);
    if (hit.zero_mask() != all) break;
  }
  for (; k < n; ++k) {
    const float v = static_cast<float>(x[k]);
    if (nan ? std::isnan(v) : v == m) return k;
  }
  return 0;  // n == 0
}

template <typename T>
void argmax_rows(const at::Tensor& logits, at::Tensor& out) {
  const T* x = logits.data_ptr<T>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t n = logits.size(1), stride = logits.stride(0);
  at::parallel_for(0, logits.size(0), 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) o[r] = argmax_row(x + r * stride, n);
  });
}

}  // namespace

at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.stride(1) == 1,
              "greedy_argmax: logits must be a CPU [B, V] tensor with a contiguous last dim");
  TORCH_CHECK(logits.size(1) > 0, "greedy_argmax: empty vocabulary");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  switch (logits.scalar_type()) {
    case at::kFloat: argmax_rows<float>(logits, out); break;
    case at::kBFloat16: argmax_rows<c10::BFloat16>(logits, out); break;
    case at::kHalf: argmax_rows<c10::Half>(logits, out); break;
    default: TORCH_CHECK(false, "greedy_argmax: unsupported dtype ", logits.scalar_type());
  }
  return out;
}

}  // namespace kvf
