// Vector helpers shared by the kvferry CPU kernels: fp32 loads/stores of float, bfloat16 and half data.
//
// Everything computes in fp32 on at::vec::Vectorized<float> (16 lanes with AVX-512, 8 with AVX2 or the
// scalar DEFAULT build). The build passes -ffp-contract=off, so a*b+c is two roundings unless written
// as an explicit fmadd: the pointwise kernels rely on that to match torch bit for bit.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>

namespace kvf {

using Vec = at::vec::Vectorized<float>;
constexpr int W = Vec::size();  // fp32 lanes
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// fp32 view of W elements at p (n < W: only the first n, the rest 0).
template <typename T>
inline Vec load_f(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

template <typename T>
inline Vec load_f(const T* p, int n) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p, n);
  } else {
    auto wide = at::vec::Vectorized<T>::loadu(p, n);
    return std::get<0>(at::vec::convert_to_float<T>(wide));
  }
}

// Store the first n (default W) lanes of v at p, rounding to T (round to nearest even, like torch).
// A whole AVX-512 vector of bf16/fp16 is rounded by ATen's own conversion and written with a plain
// 32-byte store: the 16-of-32-lane masked store it would otherwise take stalled the pointwise kernels on
// Zen 4 (the hottest instruction of RMSNorm in a profile of the engine).
template <typename T>
inline void store_f(T* p, Vec v, int n = W) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p, n);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    if (n == W) {
      const __m256i r = std::is_same_v<T, c10::BFloat16> ? at::vec::cvtfp32_bf16(__m512(v))
                                                         : at::vec::cvtfp32_fp16(__m512(v));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), r);
      return;
    }
#endif
    at::vec::convert_from_float<T>(v, v).store(p, n);
  }
}

// The value torch gets when it rounds fp32 x to T and reads it back as fp32.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

template <typename T>
inline Vec round_to(Vec x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(x, x)));
  }
}

inline float hsum(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

inline Vec vmax(Vec a, Vec b) { return at::vec::maximum(a, b); }

inline float hmax(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return vmax(a, b); }, v);
}

// 64-byte aligned fp32 scratch, zero-filled (stale NaN bit patterns never reach the arithmetic).
struct Scratch {
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  std::unique_ptr<float, Free> buf;
  explicit Scratch(int64_t n) {
    size_t bytes = static_cast<size_t>(round_up(std::max<int64_t>(n, 1) * 4, 64));
    buf.reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    TORCH_CHECK(buf, "kvferry cpu: out of memory for ", bytes, " bytes of scratch");
    std::memset(buf.get(), 0, bytes);
  }
  float* get() const { return buf.get(); }
};

// Run fn(state, i) for i in [0, n) on torch's intra-op pool (at::parallel_for: respects
// torch.set_num_threads). Items are handed out one at a time in order (callers sort expensive items
// first), so uneven items still balance; each worker builds its own state = init() once.
template <typename Init, typename F>
inline void dynamic_for(int64_t n, const Init& init, const F& fn) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    auto state = init();
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(state, i);
  });
}

// dynamic_for whose workers claim their next item before running the current one: fn(state, i, j)
// with j the worker's next item (-1: none), so fn can prefetch j's data while it computes i. Only while
// at least one item per worker stays unclaimed: near the end (or with as few items as workers) a claim
// ahead would leave a worker idle beside one holding two items.
template <typename Init, typename F>
inline void dynamic_for_ahead(int64_t n, const Init& init, const F& fn) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  int64_t workers = std::min<int64_t>(n, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    auto state = init();
    for (int64_t i = next.fetch_add(1); i < n;) {
      int64_t j = -1;
      if (next.load(std::memory_order_relaxed) + workers < n) {
        j = next.fetch_add(1);
        if (j >= n) j = -1;
      }
      fn(state, i, j);
      i = j >= 0 ? j : next.fetch_add(1);
    }
  });
}

}  // namespace kvf
