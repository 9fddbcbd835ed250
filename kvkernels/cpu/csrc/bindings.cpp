// Python bindings of the kvferry CPU ops (the GIL is released while a kernel runs).
#include <torch/extension.h>

#include "lora.h"
#include "ops.h"
#include "vec.h"

#define KVF_STR2(x) #x
#define KVF_STR(x) KVF_STR2(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using py::arg;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.doc() = "kvferry CPU kernels: paged attention, KV cache writes, RMSNorm, rotary, SiLU-and-mul";
  m.attr("capability") = KVF_STR(CPU_CAPABILITY);
  m.attr("fp32_lanes") = kvf::W;
  m.def("paged_attention", &kvf::paged_attention, arg("out"), arg("query"), arg("key_cache"),
        arg("value_cache"), arg("block_tables"), arg("query_start_loc"), arg("seq_lens"), arg("scale"),
        arg("split_tokens") = 0, arg("window") = 0, arg("cascade") = true, arg("sinks") = py::none(), nogil);
  m.attr("has_bf16_dot_decode") = kvf::has_bf16_dot_decode();
  m.attr("has_amx_decode") = kvf::has_amx_decode();
  m.def("_set_decode_kernel", &kvf::set_decode_kernel, arg("name"));
  m.def("reshape_and_cache", &kvf::reshape_and_cache, arg("key"), arg("value"), arg("key_cache"),
        arg("value_cache"), arg("slot_mapping"), nogil);
  m.def("rms_norm", &kvf::rms_norm, arg("out"), arg("x"), arg("weight"), arg("eps"), arg("lanes"),
        arg("residual") = py::none(), arg("res_out") = py::none(), nogil);
  m.def("rotary_embedding", &kvf::rotary_embedding, arg("positions"), arg("query"), arg("key"),
        arg("cos_sin_cache"), arg("is_neox"), nogil);
  m.def("silu_and_mul", &kvf::silu_and_mul, arg("out"), arg("x"), arg("lanes"), nogil);
  m.def("woq_int4_linear", &kvf::woq_int4_linear, arg("out"), arg("x"), arg("packed"), arg("scales_and_zeros"),
        arg("group"), arg("tile_n"), nogil);
  m.def("woq_int8_linear", &kvf::woq_int8_linear, arg("out"), arg("x"), arg("qweight"), arg("scales"),
        arg("tile_n"), nogil);
  m.def("woq_int8_gemv", &kvf::woq_int8_gemv, arg("out"), arg("x"), arg("qweight"), arg("scales"), nogil);
  m.attr("has_bf16_int4_gemv") = kvf::has_bf16_int4_gemv();
  m.def("woq_int4_gemv", &kvf::woq_int4_gemv, arg("out"), arg("x"), arg("packed"), arg("scales_and_zeros"),
        arg("group"), nogil);
  m.attr("has_bf16_gemv") = kvf::has_bf16_gemv();
  m.def("bf16_gemv", &kvf::bf16_gemv, arg("out"), arg("x"), arg("tiles"), arg("bias") = py::none(), nogil);
  m.def("greedy_argmax", &kvf::greedy_argmax, arg("logits"), nogil);
  m.def("apply_token_bitmask", &kvf::apply_token_bitmask, arg("logits"), arg("bitmask"), arg("rows"),
        arg("mask_rows"), nogil);
  m.def("lora_shrink", &kvf::lora_shrink, arg("s"), arg("x"), arg("a"), arg("rows"), arg("seg_start"),
        arg("seg_slot"), arg("scale"), nogil);
  m.def("lora_expand", &kvf::lora_expand, arg("y"), arg("s"), arg("b"), arg("rows"), arg("seg_start"),
        arg("seg_slot"), arg("shard_cols"), nogil);
}
