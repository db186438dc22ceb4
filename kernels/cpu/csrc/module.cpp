// The one CPU extension: binds every kernel declared in kernels.h.
// pybind11 with torch's Tensor casters alone: torch/extension.h would also parse the whole C++ frontend
// (nn, optim, data), three times as long to compile for nothing these bindings use.
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("paged_attention", &paged_attention, "paged causal attention for decode, prefill and verify rows over an f32/f16/bf16/q8_0 cache (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start"), py::arg("scale"), py::arg("window"), py::arg("softcap"), py::arg("image_spans") = py::none());
  m.def("store_and_attention", &store_and_attention, "KV store (converted to each cache's type), then paged attention (CPU)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
        py::arg("block_tables"), py::arg("seq_lens"), py::arg("query_start"), py::arg("scale"), py::arg("window"),
        py::arg("softcap"), py::arg("image_spans") = py::none());
  m.def("quant_linear", &quant_linear, "y = x W^T with W in GGUF blocks (CPU, fp32 activations)", pybind11::arg("x"),
        pybind11::arg("qweight"), pybind11::arg("type"), pybind11::arg("gemv_max_rows") = -1);
  m.def("dequantize", &dequantize, "GGUF blocks -> fp32 [N, K]");
  m.def("embedding", &embedding, "dequantise only the rows of the given token ids");
  m.def("has_avx2", &has_avx2, "compiled with the AVX2+FMA paths");
  m.def("quantize_activations", &quantize_activations, "fp32 rows -> 8-bit quants, a scale per block, sums of 16");
  m.def("quant_linear_q8", &quant_linear_q8, "y = x W^T in integers: quantized activations times GGUF blocks",
        py::arg("q"), py::arg("d"), py::arg("bs"), py::arg("qweight"), py::arg("type"), py::arg("packed") = false);
  m.def("quant_reads_packed", &quant_reads_packed, "the integer path reads this GGML type's rows packed by eights");
  m.def("quant_pack_rows8", &quant_pack_rows8, "GGUF blocks -> a copy with each eight rows packed for the integer path");
  m.def("quant_unpack_rows", &quant_unpack_rows, "rows `ids` of a packed matrix as GGUF stores them");
  m.def("int_path_has_avx2", &int_path_has_avx2, "the integer path was compiled with AVX2");
  m.def("int_path_has_vnni", &int_path_has_vnni, "the integer path's 32-value types use VNNI dot products");
  m.def("int_path_kind", &int_path_kind, "the instructions the integer dot products run on (avx512-vnni, avx-vnni, avx2, portable)");
  m.def("rms_norm", &rms_norm, "rms_norm(x) * weight (fp32)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x; rms_norm(residual) * weight (fp32)");
  m.def("rotary_inplace", &rotary_inplace, "rotate-half rotary embedding of q and k, in place");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("lora_update", &lora_update, "y += each row's LoRA adapters' scale * x A^T B^T, rows on their own (fp32)");
  m.def("argmax_rows", &argmax_rows, "each row's argmax, the first of ties (fp32 [rows, n] -> int64 [rows])");
  m.def("sample_tokens", &sample_tokens, "one token per row: grammar mask, temperature, top-k, top-p, min-p, Philox draw");
  m.def("sample_cuts", &sample_cuts, "what sample_tokens' rule keeps per row: (count, last token in the order)");
  m.def("sample_chain", &sample_chain, "top-nσ, typical-p, XTC or Mirostat 2.0 over each row's likely tokens, in doubles");
  m.def("philox_uniforms", &philox_uniforms, "Philox4x32-10's uniform in [0, 1) for each (key, counter)");
}
