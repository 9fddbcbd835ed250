// Grammar token bitmasks on the logits (structured outputs): for every constrained row, tokens whose
// bit is 0 in the row's packed int32 words (bit t%32 of word t/32) become -inf. A whole-zero word fills
// 32 logits with one vector store pair; a whole-one word is skipped; only mixed words go bit by bit.
// Tokens past the bitmask's width (vocabulary padding) are forbidden too. Rows run in parallel.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>

#include "ops.h"

namespace kvf {

namespace {

void mask_row(float* logits, int64_t vocab, const int32_t* words, int64_t num_words) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t full_words = std::min<int64_t>(num_words, vocab / 32);
  for (int64_t w = 0; w < full_words; ++w) {
    const uint32_t bits = static_cast<uint32_t>(words[w]);
    float* dst = logits + w * 32;
    if (bits == 0xFFFFFFFFu) continue;
    if (bits == 0) {
      for (int i = 0; i < 32; ++i) dst[i] = kNegInf;
      continue;
    }
    for (int i = 0; i < 32; ++i) {
      if (!((bits >> i) & 1u)) dst[i] = kNegInf;
    }
  }
  for (int64_t t = full_words * 32; t < vocab; ++t) {
    const int64_t w = t / 32;
    const bool allowed = w < num_words && ((static_cast<uint32_t>(words[w]) >> (t % 32)) & 1u);
    if (!allowed) logits[t] = kNegInf;
  }
}

}  // namespace

void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows,
                         const at::Tensor& mask_rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be a contiguous float32 [B, V] tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask must be a contiguous int32 [R, W] tensor");
  const auto r = rows.to(at::kLong).contiguous();
  const auto m = mask_rows.to(at::kLong).contiguous();
  TORCH_CHECK(r.numel() == m.numel(), "rows and mask_rows must have the same length");
  const int64_t n = r.numel(), vocab = logits.size(1), num_words = bitmask.size(1);
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t* mp = m.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < logits.size(0), "rows[", i, "] is out of range");
    TORCH_CHECK(mp[i] >= 0 && mp[i] < bitmask.size(0), "mask_rows[", i, "] is out of range");
  }
  float* base = logits.data_ptr<float>();
  const int32_t* words = bitmask.data_ptr<int32_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      mask_row(base + rp[i] * vocab, vocab, words + mp[i] * num_words, num_words);
    }
  });
}

}  // namespace kvf
