// RMSNorm bit-identical to torch's HF Llama formula: the same fp32 roundings in the same order.
//
// The reference computes mean(x.float() ** 2) with torch's cascade sum: the row is summed as vectors
// of `lanes` fp32 values (8: torch does not dispatch its sum kernel to AVX-512), 4 interleaved accumulators, each a 4-level cascade that
// flushes every 16 steps, then the scalar tail and the lanes left to right. sum_squares replays that
// order exactly (lane-wise adds are the same IEEE adds whether the compiler vectorizes them or not),
// then mean = sum / H, inv = 1 / sqrt(mean + eps), normed = round(x * inv), out = round(w * normed).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cmath>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace kvf {
namespace {

int64_t ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(x - 1)); }

// torch's multi_row_sum<nrows = 4>: element (i, k) is the E floats at in + (i * 4 + k) * E.
template <int E>
void multi_row_sum(const float* in, int64_t size, float out[4][E]) {
  constexpr int kLevels = 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  float acc[kLevels][4][E] = {};
  auto add_row = [&](int64_t i) {
    for (int k = 0; k < 4; ++k)
      for (int e = 0; e < E; ++e) acc[0][k][e] += in[(i * 4 + k) * E + e];
  };
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i) add_row(i);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < 4; ++k)
        for (int e = 0; e < E; ++e) {
          acc[j][k][e] += acc[j - 1][k][e];
          acc[j - 1][k][e] = 0.f;
        }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i) add_row(i);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < 4; ++k)
      for (int e = 0; e < E; ++e) acc[0][k][e] += acc[j][k][e];
  std::copy(&acc[0][0][0], &acc[0][0][0] + 4 * E, &out[0][0]);
}

// torch's row_sum: `size` elements of E floats, 4-way interleaved, tail into accumulator 0.
template <int E>
void row_sum(const float* in, int64_t size, float out[E]) {
  float ps[4][E];
  multi_row_sum<E>(in, size / 4, ps);
  for (int64_t i = size / 4 * 4; i < size; ++i)
    for (int e = 0; e < E; ++e) ps[0][e] += in[i * E + e];
  for (int k = 1; k < 4; ++k)
    for (int e = 0; e < E; ++e) ps[0][e] += ps[k][e];
  std::copy(ps[0], ps[0] + E, out);
}

template <int L>
float sum_squares(const float* sq, int64_t n) {
  if (n < L) {  // scalar_inner_sum
    float r;
    row_sum<1>(sq, n, &r);
    return 0.f + r;
  }
  const int64_t nvec = n / L;  // vectorized_inner_sum
  float lanes[L];
  row_sum<L>(sq, nvec, lanes);
  float acc = 0.f;
  for (int64_t k = nvec * L; k < n; ++k) acc += sq[k];
  for (int k = 0; k < L; ++k) acc += lanes[k];
  return 0.f + acc;
}

template <typename T, typename Wt>
void norm_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, float eps, int64_t lanes,
               const at::Tensor* residual, at::Tensor* res_out) {
  const int64_t rows = x.size(0), H = x.size(1);
  const T* xp = x.data_ptr<T>();
  const Wt* wp = weight.data_ptr<Wt>();
  T* op = out.data_ptr<T>();
  const T* rp = residual ? residual->data_ptr<T>() : nullptr;
  T* rop = res_out ? res_out->data_ptr<T>() : nullptr;
  const int64_t xs = x.stride(0), os = out.stride(0), rs = residual ? residual->stride(0) : 0,
                ros = res_out ? res_out->stride(0) : 0;
  auto sum = lanes == 16 ? &sum_squares<16> : &sum_squares<8>;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(H, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(2 * H + W);
    float* v = buf.data();  // the row being normalized, fp32
    float* sq = v + H;
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = xp + r * xs;
      int64_t j = 0;
      if (rp) {  // r = x + residual, rounded to T: both the output residual and the norm input
        const T* rr = rp + r * rs;
        T* ro = rop + r * ros;
        for (; j + W <= H; j += W) {
          const Vec sum_v = load_f(xr + j) + load_f(rr + j);
          store_f(ro + j, sum_v);
          round_to<T>(sum_v).store(v + j);
        }
        for (; j < H; ++j) {
          const T sum_t = static_cast<T>(static_cast<float>(xr[j]) + static_cast<float>(rr[j]));
          ro[j] = sum_t;
          v[j] = static_cast<float>(sum_t);
        }
      } else {
        for (; j + W <= H; j += W) load_f(xr + j).store(v + j);
        for (; j < H; ++j) v[j] = static_cast<float>(xr[j]);
      }
      for (j = 0; j + W <= H; j += W) {
        const Vec x2 = Vec::loadu(v + j);
        (x2 * x2).store(sq + j);
      }
      for (; j < H; ++j) sq[j] = v[j] * v[j];
      const float mean = sum(sq, H) / static_cast<float>(H);
      const float inv = 1.f / std::sqrt(mean + eps);
      const Vec iv(inv);
      T* o = op + r * os;
      for (j = 0; j + W <= H; j += W) {
        const Vec normed = round_to<T>(Vec::loadu(v + j) * iv);
        store_f(o + j, load_f(wp + j) * normed);
      }
      for (; j < H; ++j) o[j] = static_cast<T>(static_cast<float>(wp[j]) * round_to<T>(v[j] * inv));
    }
  });
}

template <typename T>
void norm_dispatch_weight(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, float eps, int64_t lanes,
                          const at::Tensor* res, at::Tensor* res_out) {
  if (w.scalar_type() == at::kFloat) {
    norm_rows<T, float>(x, w, out, eps, lanes, res, res_out);
  } else {
    TORCH_CHECK(w.scalar_type() == x.scalar_type(), "rms_norm weight must be float32 or x's dtype");
    norm_rows<T, T>(x, w, out, eps, lanes, res, res_out);
  }
}

}  // namespace

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps, int64_t lanes,
              const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& res_out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [T, H] with contiguous rows");
  TORCH_CHECK(out.sizes() == x.sizes() && out.stride(1) == 1 && out.scalar_type() == x.scalar_type(),
              "rms_norm: out must match x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "rms_norm: weight must be [H]");
  TORCH_CHECK(lanes == 8 || lanes == 16, "rms_norm: lanes must be 8 or 16");
  const at::Tensor w = weight.contiguous();
  const at::Tensor* res = nullptr;
  at::Tensor* ro = nullptr;
  at::Tensor res_c, ro_t;
  if (residual.has_value()) {
    TORCH_CHECK(res_out.has_value(), "rms_norm: residual needs res_out");
    res_c = *residual;
    ro_t = *res_out;
    TORCH_CHECK(res_c.sizes() == x.sizes() && res_c.stride(1) == 1 && res_c.scalar_type() == x.scalar_type(),
                "rms_norm: residual must match x");
    TORCH_CHECK(ro_t.sizes() == x.sizes() && ro_t.stride(1) == 1 && ro_t.scalar_type() == x.scalar_type(),
                "rms_norm: res_out must match x");
    res = &res_c;
    ro = &ro_t;
  }
  const float e = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat: norm_dispatch_weight<float>(x, w, out, e, lanes, res, ro); break;
    case at::kBFloat16: norm_dispatch_weight<c10::BFloat16>(x, w, out, e, lanes, res, ro); break;
    case at::kHalf: norm_dispatch_weight<c10::Half>(x, w, out, e, lanes, res, ro); break;
    default: TORCH_CHECK(false, "rms_norm: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace kvf
