// Weights packed at load for the integer path's eight-column kernels (quant_dot.cpp's dot_cols8, dot_cols8k,
// dot_cols8q6): every eight rows' blocks laid down once in the order those kernels' registers hold them
// (quant_dot_blocks.h's Rows8 and Rows8K), and read back out a row at a time for an embedding that shares the
// matrix. The packed copy replaces the file's (QuantLinear keeps only it). It runs once per matrix, a byte at
// a time; kernels/cpu/quant.py's pack_rows8_ref and unpack_rows8_ref are its twins.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <cstring>
#include "kernels.h"
#include "quant_dot_blocks.h"
#include "quant_pack.h"

namespace {

using namespace quant_dot;

// Rows8's layout, written (pack) and read back (unpack) a byte at a time: it runs once per matrix at load.
template <int64_t T>
void pack8(const uint8_t* src, int64_t row_bytes, uint8_t* dst) {  // eight plain rows -> their packed run
  using L = Rows8<T>;
  constexpr int64_t B = Traits<T>::BYTES;
  for (int64_t bi = 0; bi < row_bytes / B; ++bi) {
    uint8_t* o = dst + bi * 8 * B;
    for (int l = 0; l < 8; ++l) {
      const uint8_t* b = src + L::lane(l) * row_bytes + bi * B;
      o[L::D + 2 * l] = b[0], o[L::D + 2 * l + 1] = b[1];
      if constexpr (L::FMIN) o[L::M + 2 * l] = b[2], o[L::M + 2 * l + 1] = b[3];
      if constexpr (L::FIFTH) {
        uint32_t qh;
        std::memcpy(&qh, b + L::QH, 4);
        for (int i = 0; i < 4; ++i) {
          uint8_t v = 0;
          for (int t = 0; t < 8; ++t) v = (uint8_t)(v | (((qh >> (4 * t + i)) & 1u) << t));
          o[L::F + 4 * l + i] = v;
        }
      }
      for (int t = 0; t < L::REGS; ++t)
        for (int i = 0; i < 4; ++i) o[L::Q + 32 * t + 4 * l + i] = b[L::QS + 4 * t + i];
    }
  }
}

template <int64_t T>
void unpack8(const uint8_t* run, int64_t row_bytes, int row, uint8_t* dst) {  // row `row` of a packed run, plain
  using L = Rows8<T>;
  constexpr int64_t B = Traits<T>::BYTES;
  const int l = L::lane_of(row);
  for (int64_t bi = 0; bi < row_bytes / B; ++bi) {
    const uint8_t* o = run + bi * 8 * B;
    uint8_t* b = dst + bi * B;
    b[0] = o[L::D + 2 * l], b[1] = o[L::D + 2 * l + 1];
    if constexpr (L::FMIN) b[2] = o[L::M + 2 * l], b[3] = o[L::M + 2 * l + 1];
    if constexpr (L::FIFTH) {
      uint32_t qh = 0;
      for (int i = 0; i < 4; ++i)
        for (int t = 0; t < 8; ++t) qh |= (uint32_t)((o[L::F + 4 * l + i] >> t) & 1) << (4 * t + i);
      std::memcpy(b + L::QH, &qh, 4);
    }
    for (int t = 0; t < L::REGS; ++t)
      for (int i = 0; i < 4; ++i) b[L::QS + 4 * t + i] = o[L::Q + 32 * t + 4 * l + i];
  }
}

// Rows8K's, a byte permutation: each row's field bytes to their places in the packed block, and back.
template <int64_t T>
void pack8k(const uint8_t* src, int64_t row_bytes, uint8_t* dst) {
  using L = Rows8K<T>;
  constexpr int64_t B = Traits<T>::BYTES;
  for (int64_t bi = 0; bi < row_bytes / B; ++bi)
    for (int f = 0; f < L::FIELDS; ++f)
      for (int lane = 0; lane < 8; ++lane)
        for (int64_t k = 0; k < L::fields[f].width; ++k)
          dst[bi * 8 * B + L::at(L::fields[f], lane, k)] = src[lane * row_bytes + bi * B + L::fields[f].src + k];
}

template <int64_t T>
void unpack8k(const uint8_t* run, int64_t row_bytes, int row, uint8_t* dst) {
  using L = Rows8K<T>;
  constexpr int64_t B = Traits<T>::BYTES;
  for (int64_t bi = 0; bi < row_bytes / B; ++bi)
    for (int f = 0; f < L::FIELDS; ++f)
      for (int64_t k = 0; k < L::fields[f].width; ++k)
        dst[bi * B + L::fields[f].src + k] = run[bi * 8 * B + L::at(L::fields[f], row, k)];
}

void check_weight(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.dtype() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous() && qweight.device().is_cpu(),
              "qweight must be a contiguous uint8 [N, row_bytes] CPU tensor");
}

}  // namespace

namespace quant_pack {

Packing packing(int64_t type) {
#ifdef MBQ_AVX2
  switch (type) {
    case Q4_0: return {pack8<Q4_0>, unpack8<Q4_0>, Traits<Q4_0>::BYTES};
    case Q4_1: return {pack8<Q4_1>, unpack8<Q4_1>, Traits<Q4_1>::BYTES};
    case Q5_0: return {pack8<Q5_0>, unpack8<Q5_0>, Traits<Q5_0>::BYTES};
    case Q5_1: return {pack8<Q5_1>, unpack8<Q5_1>, Traits<Q5_1>::BYTES};
    case Q8_0: return {pack8<Q8_0>, unpack8<Q8_0>, Traits<Q8_0>::BYTES};
    case Q4_K: return {pack8k<Q4_K>, unpack8k<Q4_K>, Traits<Q4_K>::BYTES};
    case Q5_K: return {pack8k<Q5_K>, unpack8k<Q5_K>, Traits<Q5_K>::BYTES};
    case Q6_K:
      if constexpr (kColumns8K<Q6_K>) return {pack8k<Q6_K>, unpack8k<Q6_K>, Traits<Q6_K>::BYTES};
      break;
    default: break;
  }
#endif
  (void)type;
  return {};
}

at::Tensor pack_copy(const at::Tensor& qweight, Pack8Fn pack) {  // whole groups of eight rows packed, the rest copied
  const int64_t n = qweight.size(0), row_bytes = qweight.size(1), groups = n / 8;
  auto out = mb::empty({n, row_bytes}, at::kByte);
  const uint8_t* src = qweight.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) pack(src + 8 * g * row_bytes, row_bytes, dst + 8 * g * row_bytes);
  });
  std::memcpy(dst + 8 * groups * row_bytes, src + 8 * groups * row_bytes, (n - 8 * groups) * row_bytes);
  return out;
}

}  // namespace quant_pack

bool quant_reads_packed(int64_t type) { return quant_pack::packing(type).pack != nullptr; }

at::Tensor quant_pack_rows8(at::Tensor qweight, int64_t type) {
  check_weight(qweight);
  const quant_pack::Packing p = quant_pack::packing(type);
  TORCH_CHECK(p.pack, "this build's integer path reads GGML type ", type, " as GGUF stores it: nothing to pack");
  TORCH_CHECK(qweight.size(1) % p.bytes == 0, "qweight has ", qweight.size(1), " bytes per row, not whole blocks of ",
              p.bytes);
  return quant_pack::pack_copy(qweight, p.pack);
}

at::Tensor quant_unpack_rows(at::Tensor packed, int64_t type, at::Tensor ids) {
  check_weight(packed);
  const quant_pack::Packing p = quant_pack::packing(type);
  TORCH_CHECK(p.unpack, "this build packs no rows of GGML type ", type);
  TORCH_CHECK(ids.dtype() == at::kLong && ids.dim() == 1, "ids must be int64 [T]");
  ids = ids.contiguous();
  const int64_t n = packed.size(0), row_bytes = packed.size(1), t = ids.size(0), whole = n / 8 * 8;
  auto out = mb::empty({t, row_bytes}, at::kByte);
  const int64_t* ip = ids.data_ptr<int64_t>();
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t i = 0; i < t; ++i) {
    const int64_t r = ip[i];
    TORCH_CHECK(r >= 0 && r < n, "row ", r, " is out of range for ", n, " rows");
    if (r < whole) p.unpack(src + (r / 8) * 8 * row_bytes, row_bytes, (int)(r % 8), dst + i * row_bytes);
    else std::memcpy(dst + i * row_bytes, src + r * row_bytes, row_bytes);
  }
  return out;
}

