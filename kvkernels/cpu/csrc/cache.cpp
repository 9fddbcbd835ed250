// reshape_and_cache: scatter this step's K/V rows into their paged cache slots (strided cache views).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstring>

#include "ops.h"

namespace kvf {
namespace {

void scatter(const at::Tensor& src, at::Tensor& cache, const int64_t* slots) {
  const int64_t T = src.size(0), H = src.size(1), D = src.size(2), bs = cache.size(1);
  const int64_t item = src.element_size();
  const auto* s = static_cast<const char*>(src.data_ptr());
  auto* c = static_cast<char*>(cache.data_ptr());
  const int64_t s_t = src.stride(0) * item, s_h = src.stride(1) * item;
  const int64_t c_b = cache.stride(0) * item, c_t = cache.stride(1) * item, c_h = cache.stride(2) * item;
  const int64_t num_blocks = cache.size(0);
  const bool rows_packed = s_h == D * item && c_h == D * item;  // all heads of a token in one copy
  at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      const int64_t blk = slot / bs, off = slot % bs;
      TORCH_CHECK(blk < num_blocks, "slot ", slot, " is past the cache's ", num_blocks, " blocks");
      char* dst = c + blk * c_b + off * c_t;
      const char* from = s + t * s_t;
      if (rows_packed) {
        std::memcpy(dst, from, H * D * item);
      } else {
        for (int64_t h = 0; h < H; ++h) std::memcpy(dst + h * c_h, from + h * s_h, D * item);
      }
    }
  });
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key and value must be [T, Hkv, D]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "caches must be [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(key_cache.size(2) == key.size(1) && key_cache.size(3) == key.size(2), "cache/key shapes differ");
  TORCH_CHECK(slot_mapping.numel() == key.size(0), "one slot per token");
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1, "cache rows must be contiguous");
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  // Rows are copied as bytes, so convert first (as the reference's .to(cache.dtype)) when dtypes differ.
  auto prep = [](const at::Tensor& t, const at::Tensor& cache) {
    auto r = t.scalar_type() == cache.scalar_type() ? t : t.to(cache.scalar_type());
    return r.stride(2) == 1 ? r : r.contiguous();
  };
  scatter(prep(key, key_cache), key_cache, slots.data_ptr<int64_t>());
  scatter(prep(value, value_cache), value_cache, slots.data_ptr<int64_t>());
}

}  // namespace kvf
