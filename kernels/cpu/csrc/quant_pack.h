// The packed layouts' seam between quant_pack.cpp, which writes and reads them, and quant_dot.cpp, whose
// eight-column kernels stream them.
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>

namespace quant_pack {

using Pack8Fn = void (*)(const uint8_t* src, int64_t row_bytes, uint8_t* dst);            // eight plain rows -> a run
using Unpack8Fn = void (*)(const uint8_t* run, int64_t row_bytes, int row, uint8_t* dst);  // one row of a run

struct Packing {
  Pack8Fn pack = nullptr;  // null: this build's integer path reads the type as GGUF stores it
  Unpack8Fn unpack = nullptr;
  int64_t bytes = 0;  // one block's bytes
};

// How this build's integer path reads GGML type `type`.
Packing packing(int64_t type);

// Whole groups of eight rows of qweight [N, row_bytes] packed, the rest (N % 8 rows) copied as they are.
at::Tensor pack_copy(const at::Tensor& qweight, Pack8Fn pack);

}  // namespace quant_pack
