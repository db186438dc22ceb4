// Every CPU kernel's entry point; module.cpp binds them to Python. The kernel files include only
// ATen's core headers (not torch/extension.h), which keeps the first-use build short.
#pragma once
#include <optional>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_ops.h>
#include <string>
#include <vector>

namespace mb {
// A new CPU tensor, as at::empty gives it, through ATen's operator declaration alone: at::empty's own header
// pulls in most of ATen, which took two thirds of each kernel file's compile time.
inline at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::_ops::empty_memory_format::call(c10::fromIntArrayRefSlow(sizes), dtype, std::nullopt, std::nullopt,
                                             std::nullopt, std::nullopt);
}
}  // namespace mb

// paged_attention.cpp
at::Tensor paged_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                           at::Tensor seq_lens, at::Tensor query_start, double scale, int64_t window, double softcap,
                           const std::optional<at::Tensor>& image_spans);
at::Tensor store_and_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache,
                               at::Tensor slot_mapping,
                               at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_start, double scale,
                               int64_t window, double softcap, const std::optional<at::Tensor>& image_spans);
// quant_matmul.cpp
at::Tensor quant_linear(at::Tensor x, at::Tensor qweight, int64_t type, int64_t gemv_max_rows);
at::Tensor dequantize(at::Tensor qweight, int64_t type, int64_t k);
at::Tensor embedding(at::Tensor qweight, int64_t type, int64_t k, at::Tensor ids);
bool has_avx2();
// quant_dot.cpp
std::vector<at::Tensor> quantize_activations(at::Tensor x, int64_t block);
at::Tensor quant_linear_q8(at::Tensor q, at::Tensor d, at::Tensor bs, at::Tensor qweight, int64_t type, bool packed);
bool int_path_has_avx2();
bool int_path_has_vnni();
std::string int_path_kind();  // the instructions the integer dot products run on: avx512-vnni, avx-vnni, avx2 or portable
// quant_pack.cpp
bool quant_reads_packed(int64_t type);  // the integer path reads the type's rows packed by eights (Rows8)
at::Tensor quant_pack_rows8(at::Tensor qweight, int64_t type);
at::Tensor quant_unpack_rows(at::Tensor packed, int64_t type, at::Tensor ids);
// cpu_ops.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_inplace(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin);
at::Tensor silu_mul(at::Tensor gate_up);
// lora.cpp
void lora_update(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor bt, at::Tensor ranks, at::Tensor slots,
                 at::Tensor scales);
// sampling.cpp
at::Tensor argmax_rows(at::Tensor x);
at::Tensor sample_tokens(at::Tensor logits, at::Tensor settings, at::Tensor streams, at::Tensor masks);
at::Tensor sample_cuts(at::Tensor logits, at::Tensor settings, at::Tensor streams, at::Tensor masks);
at::Tensor philox_uniforms(at::Tensor keys, at::Tensor counters);
// sampling_chain.cpp
at::Tensor sample_chain(at::Tensor logits, at::Tensor settings, at::Tensor streams, at::Tensor masks);
