// The ops the Python module exposes (see bindings.cpp); every tensor is a CPU tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace kvf {

// Mixed decode + prefill attention of packed queries over a paged K/V cache (in place into out).
// window > 0: sliding-window attention, a query at position p sees positions (p - window, p].
// cascade: decode rows sharing a prefix attend it together (off: each row alone; tests, comparisons).
// sinks: fp32 [Hq] attention-sink logits (gpt-oss), each added to its head's softmax denominator only.
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
                     int64_t split_tokens, int64_t window, bool cascade,
                     const c10::optional<at::Tensor>& sinks);

// Which tile kernels decode attention uses for bf16 caches: "auto" (AMX tile products for the scores
// where built in and granted, else "avx512_bf16"), "avx512_bf16" (AVX512-BF16 dot products where built
// in, else generic) or "generic" (at::vec fp32; tests, comparisons). Returns the previous setting.
std::string set_decode_kernel(const std::string& name);
// Whether this build has the AVX512-BF16 decode kernel (the CPU and compiler have avx512_bf16), and
// the AMX one (amx_tile + amx_bf16, and the kernel granted the tile state to this process).
bool has_bf16_dot_decode();
bool has_amx_decode();

// key/value [T, Hkv, D] into cache slot slot_mapping[t] (block * block_size + offset); slot < 0 skipped.
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping);

// HF Llama RMSNorm of x [T, H] into out; with residual: res_out = x + residual is normalized instead.
// lanes: fp32 lanes of torch's own sum kernel (8, also on AVX-512 machines), to sum in torch's order.
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps, int64_t lanes,
              const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& res_out);

// RoPE in place on query [T, Hq, D] and key [T, Hkv, D]; cos_sin_cache [max_pos, rot_dim].
void rotary_embedding(const at::Tensor& positions, at::Tensor& query, const std::optional<at::Tensor>& key,
                      const at::Tensor& cos_sin_cache, bool is_neox);

// out [T, I] = silu(x[:, :I]) * x[:, I:] in fp32; lanes: torch's elementwise fp32 lanes (16 with AVX-512),
// which decide where its vector exp ends and std::exp takes the row's tail.
void silu_and_mul(at::Tensor& out, const at::Tensor& x, int64_t lanes);

// Structured outputs: logits[rows[i]] keeps only the tokens whose bit is set in bitmask[mask_rows[i]]
// (int32 words, bit t%32 of word t/32); the others (and tokens past the mask's width) become -inf.
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows,
                         const at::Tensor& mask_rows);

// Weight-only quantized linears for many rows (dequantize a tile of tile_n output features, then a dense
// GEMM): out [M, N] = x [M, K] @ W^T. int4: torch's int4pack layout and scales_and_zeros [K/group, N, 2];
// int8: int8 [N, K] with scales [N]. x, out and the scales share one dtype (float32 or bfloat16).
void woq_int4_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                     int64_t group, int64_t tile_n);
void woq_int8_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                     int64_t tile_n);
// The same int8 product for few rows, reading the int8 bytes once per output row (a GEMV per 4 rows).
void woq_int8_gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales);
// The int4 product for few rows of bf16 x, reading the int4pack bytes once per 4 rows (AVX512_BF16 only:
// has_bf16_int4_gemv() says whether this build has it). out [M, Npad] bf16.
bool has_bf16_int4_gemv();
void woq_int4_gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz,
                   int64_t group);

// The bf16 product for few rows: out [M, N] = x [M, K] @ W^T (+ bias), W as pair tiles
// [ceil(N / 64), K / 2, 64, 2] (kvkernels.cpu.pack_bf16_gemv), read once per 4 rows of x (AVX512_BF16
// only: has_bf16_gemv() says whether this build has it).
bool has_bf16_gemv();
void bf16_gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& tiles, const std::optional<at::Tensor>& bias);

// Greedy sampling: per row of logits [B, V] (fp32/bf16/fp16), the first index of its maximum, NaN counting
// as the maximum (torch.max(dim=-1)'s indices); int64 [B].
at::Tensor greedy_argmax(const at::Tensor& logits);
}  // namespace kvf
