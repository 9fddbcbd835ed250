// Batched multi-LoRA ops (punica's shrink / expand pair) over tokens grouped by adapter slot.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace kvf {

// Tokens rows[seg_start[g] .. seg_start[g + 1]) use adapter slot seg_slot[g] (rows: int64 token indices,
// grouped by slot). s [P, R] (fp32, P = rows.size(0)) = (x[rows[p]] @ a[slot]^T) * scale[slot]:
// x [T, K] (unit stride along K), a [S, R, K] in x's dtype, scale fp32 [S].
void lora_shrink(at::Tensor& s, const at::Tensor& x, const at::Tensor& a, const at::Tensor& rows,
                 const at::Tensor& seg_start, const at::Tensor& seg_slot, const at::Tensor& scale);

// y[rows[p], c] += sum_i s[p, j * r + i] * b[slot, i, c] for c in shard j's columns
// [shard_cols[j], shard_cols[j + 1]), in fp32 and rounded once: y [T, N] contiguous, b [S, r, N] in y's
// dtype, s [P, shards * r] fp32 (lora_shrink's output).
void lora_expand(at::Tensor& y, const at::Tensor& s, const at::Tensor& b, const at::Tensor& rows,
                 const at::Tensor& seg_start, const at::Tensor& seg_slot, const std::vector<int64_t>& shard_cols);

}  // namespace kvf
