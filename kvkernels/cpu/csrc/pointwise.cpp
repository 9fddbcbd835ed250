// Rotary embedding (in place) and SiLU-and-mul, computed in fp32 with the reference's roundings.
//
// Rotary: out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin as separate fp32 roundings (the build turns
// off FMA contraction), then one rounding to the tensor's dtype: identical to the reference.
// SiLU: torch evaluates x / (1 + exp(-x)) with Sleef's vector exp on whole 2-vector chunks of a row
// and std::exp on the row's tail; this does the same split, so single-threaded results match it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace kvf {
namespace {

template <typename T>
void rotate_head(T* x, const float* cos, const float* sin, int half, bool neox) {
  if (neox) {
    for (int i = 0; i < half; i += W) {
      const int n = std::min(W, half - i);
      const Vec x1 = load_f(x + i, n), x2 = load_f(x + half + i, n);
      const Vec c = Vec::loadu(cos + i, n), s = Vec::loadu(sin + i, n);
      store_f(x + i, x1 * c - x2 * s, n);
      store_f(x + half + i, x2 * c + x1 * s, n);
    }
    return;
  }
  for (int i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[2 * i]), x2 = static_cast<float>(x[2 * i + 1]);
    const float a = x1 * cos[i] - x2 * sin[i];
    const float b = x2 * cos[i] + x1 * sin[i];
    x[2 * i] = static_cast<T>(a);
    x[2 * i + 1] = static_cast<T>(b);
  }
}

template <typename T, typename C>
void rotary_impl(const int64_t* pos, at::Tensor& q, at::Tensor* k, const at::Tensor& cache, bool neox) {
  const int64_t T_ = q.size(0), hq = q.size(1), hk = k ? k->size(1) : 0;
  const int rot = static_cast<int>(cache.size(1)), half = rot / 2;
  const int64_t max_pos = cache.size(0);
  const C* cp = cache.data_ptr<C>();
  const int64_t cs = cache.stride(0);
  T* qp = q.data_ptr<T>();
  T* kp = k ? k->data_ptr<T>() : nullptr;
  const int64_t per_token = std::max<int64_t>(1, (hq + hk) * q.size(2));
  at::parallel_for(0, T_, std::max<int64_t>(1, 16384 / per_token), [&](int64_t t0, int64_t t1) {
    std::vector<float> cs_buf(static_cast<size_t>(2 * half) + 1);
    float* cosv = cs_buf.data();
    float* sinv = cosv + half;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = pos[t];
      TORCH_CHECK(p >= 0 && p < max_pos, "position ", p, " outside the cos/sin cache");
      for (int i = 0; i < 2 * half; ++i) cosv[i] = static_cast<float>(cp[p * cs + i]);
      for (int64_t h = 0; h < hq; ++h) rotate_head(qp + t * q.stride(0) + h * q.stride(1), cosv, sinv, half, neox);
      for (int64_t h = 0; h < hk; ++h)
        rotate_head(kp + t * k->stride(0) + h * k->stride(1), cosv, sinv, half, neox);
    }
  });
}

template <typename T>
void rotary_dispatch_cache(const int64_t* pos, at::Tensor& q, at::Tensor* k, const at::Tensor& c, bool neox) {
  switch (c.scalar_type()) {
    case at::kFloat: rotary_impl<T, float>(pos, q, k, c, neox); break;
    case at::kBFloat16: rotary_impl<T, c10::BFloat16>(pos, q, k, c, neox); break;
    case at::kHalf: rotary_impl<T, c10::Half>(pos, q, k, c, neox); break;
    default: TORCH_CHECK(false, "rotary: unsupported cos_sin_cache dtype ", c.scalar_type());
  }
}

template <typename T>
void silu_rows(at::Tensor& out, const at::Tensor& x, int64_t lanes) {
  const int64_t rows = x.size(0), I = out.size(1);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  const int64_t vec_end = I / (2 * lanes) * (2 * lanes);  // torch's vectorized part of each row
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
    const Vec one(1.f);
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = xp + r * xs;
      const T* u = g + I;
      T* o = op + r * os;
      int64_t j = 0;
      for (; j + W <= vec_end; j += W) {
        const Vec gv = load_f(g + j);
        store_f(o + j, gv / (one + gv.neg().exp()) * load_f(u + j));
      }
      for (; j < I; ++j) {
        const float gv = static_cast<float>(g[j]);
        o[j] = static_cast<T>(gv / (1.f + std::exp(-gv)) * static_cast<float>(u[j]));
      }
    }
  });
}

}  // namespace

void rotary_embedding(const at::Tensor& positions, at::Tensor& query, const std::optional<at::Tensor>& key,
                      const at::Tensor& cos_sin_cache, bool is_neox) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "rotary: query must be [T, Hq, D], contiguous rows");
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) % 2 == 0 && cos_sin_cache.stride(1) == 1,
              "rotary: cos_sin_cache must be [max_pos, rot_dim] with an even rot_dim");
  TORCH_CHECK(cos_sin_cache.size(1) <= query.size(2), "rotary: rot_dim is larger than head_dim");
  TORCH_CHECK(positions.numel() == query.size(0), "rotary: one position per token");
  at::Tensor k;
  if (key.has_value()) {
    k = *key;
    TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && k.size(0) == query.size(0) && k.size(2) == query.size(2) &&
                    k.scalar_type() == query.scalar_type(),
                "rotary: key must be [T, Hkv, D] like query");
  }
  const auto pos = positions.to(at::kLong).contiguous();
  at::Tensor* kp = key.has_value() ? &k : nullptr;
  const int64_t* p = pos.data_ptr<int64_t>();
  switch (query.scalar_type()) {
    case at::kFloat: rotary_dispatch_cache<float>(p, query, kp, cos_sin_cache, is_neox); break;
    case at::kBFloat16: rotary_dispatch_cache<c10::BFloat16>(p, query, kp, cos_sin_cache, is_neox); break;
    case at::kHalf: rotary_dispatch_cache<c10::Half>(p, query, kp, cos_sin_cache, is_neox); break;
    default: TORCH_CHECK(false, "rotary: unsupported dtype ", query.scalar_type());
  }
}

void silu_and_mul(at::Tensor& out, const at::Tensor& x, int64_t lanes) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "silu_and_mul: x must be [T, 2I]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) * 2 == x.size(1) && out.stride(1) == 1 &&
                  out.scalar_type() == x.scalar_type(),
              "silu_and_mul: out must be [T, I] of x's dtype");
  switch (x.scalar_type()) {
    case at::kFloat: silu_rows<float>(out, x, lanes); break;
    case at::kBFloat16: silu_rows<c10::BFloat16>(out, x, lanes); break;
    case at::kHalf: silu_rows<c10::Half>(out, x, lanes); break;
    default: TORCH_CHECK(false, "silu_and_mul: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace kvf
