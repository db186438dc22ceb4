// Paged attention on the CPU for every kind of query (a decode token, a whole prefill, a chunk of a chunked
// prefill over cached blocks, a speculative verify row), reading K/V straight from the block-structured cache
// through each sequence's block table: no gathered copy of the context.
//
// One rule makes a query's result independent of how it is computed: query i of a sequence whose forward
// adds qlen tokens to a context of len sits at position len - qlen + i and attends to the positions up to its
// own. It walks them one KV block at a time, oldest first, with an online softmax (running max and sum per
// query head, the accumulator rescaled when the max grows); every block's scores, exponentials and updates
// are the same float operations whether the query is a decode token alone or row 300 of a prefill beside
// other sequences. So a token gets the same bits in a prefill, in any chunking of it, in a decode step and in
// a verify row, whatever else is in the batch (docs/internals.md, "The same answer whatever the batch").
//
// One task per (sequence, KV head, tile of up to 16 queries): it serves the group of query heads that share
// the KV head (grouped-query attention), so each K/V vector is read once per group, and the tile's queries
// take each KV block in turn while it is in cache. Scores, exponentials and sums are fp32. Optional: a
// sliding window (only the last `window` positions), and scores soft-capped as cap * tanh(score / cap)
// before the softmax (Gemma 2).
//
// The cache holds K and V each in one of kernels/kv_types.py's types: f32, f16, bf16, or GGUF's blocks of 32
// values (q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl: llama.cpp's block layouts byte for byte). A new token's K and V
// are converted once, as they are stored; attention converts the rows of one KV block at a time into fp32 in a
// scratch buffer the size of one block, shared by the group's query heads and the tile's queries, so the
// scores and sums run on the same fp32 values, by the same operations, whatever the type (an f16/bf16 value
// is an fp32 one; q * d of a block's small integer and its fp16 scale is exact, + m rounds once).
// The 4- and 5-bit types keep K and V turned by a Walsh-Hadamard rotation (kv_types.py's rotation(), as
// llama.cpp's quantized caches): the store turns a row before quantizing it, attention turns the queries the
// same way (scores are unchanged by an orthonormal turn of both sides) and turns each output row back.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include "kernels.h"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include "gguf_blocks.h"
#include "vec_math.h"
#ifdef MB_VEC_AVX2
#define MB_ATTN_AVX2 1
#endif


namespace {

// What a cache tensor holds: a float dtype its own type; uint8 GGUF blocks of 32 values, told apart by their
// bytes (the row's width over head_dim / 32); int8 iq4_nl's blocks (q4_0's size).
enum class KVType { F32, F16, BF16, Q8_0, Q5_1, Q5_0, Q4_1, Q4_0, IQ4_NL };
constexpr int64_t kBlockValues = 32;

constexpr int64_t block_bytes(KVType type) {
  switch (type) {
    case KVType::Q8_0: return 34;    // fp16 d, 32 int8
    case KVType::Q5_1: return 24;    // fp16 d, fp16 m, 32 high bits, 16 bytes of low nibbles
    case KVType::Q5_0: return 22;    // fp16 d, 32 high bits, 16 bytes of low nibbles
    case KVType::Q4_1: return 20;    // fp16 d, fp16 m, 16 bytes of nibbles
    case KVType::Q4_0: return 18;    // fp16 d, 16 bytes of nibbles
    case KVType::IQ4_NL: return 18;  // fp16 d, 16 bytes of indices into the 16 levels
    default: return 0;
  }
}

KVType kv_type_of(const at::Tensor& cache, int64_t head_dim, const char* which) {
  const int64_t width = cache.size(-1);
  KVType type;
  switch (cache.scalar_type()) {
    case at::kFloat: TORCH_CHECK(width == head_dim, which, " cache rows are ", width, " values, the heads ", head_dim); return KVType::F32;
    case at::kHalf: TORCH_CHECK(width == head_dim, which, " cache rows are ", width, " values, the heads ", head_dim); return KVType::F16;
    case at::kBFloat16: TORCH_CHECK(width == head_dim, which, " cache rows are ", width, " values, the heads ", head_dim); return KVType::BF16;
    case at::kChar: type = KVType::IQ4_NL; break;
    case at::kByte: {
      TORCH_CHECK(head_dim % kBlockValues == 0, "a ", which, " cache of blocks needs head_dim a multiple of 32, got ", head_dim);
      const int64_t blocks = head_dim / kBlockValues;
      switch (width % blocks ? 0 : width / blocks) {
        case 34: type = KVType::Q8_0; break;
        case 24: type = KVType::Q5_1; break;
        case 22: type = KVType::Q5_0; break;
        case 20: type = KVType::Q4_1; break;
        case 18: type = KVType::Q4_0; break;
        default: TORCH_CHECK(false, which, " cache rows are ", width, " bytes: not q8_0, q5_1, q5_0, q4_1 or q4_0 blocks for heads of ", head_dim);
      }
      break;
    }
    default: TORCH_CHECK(false, which, " cache: f32, f16, bf16, uint8 (q8_0, q5_1, q5_0, q4_1, q4_0) or int8 (iq4_nl) only, got ", cache.scalar_type());
  }
  TORCH_CHECK(head_dim % kBlockValues == 0, "a ", which, " cache of blocks needs head_dim a multiple of 32, got ", head_dim);
  TORCH_CHECK(width == head_dim / kBlockValues * block_bytes(type), which, " cache rows are ", width, " bytes, heads of ", head_dim, " take ", head_dim / kBlockValues * block_bytes(type));
  return type;
}

// One cache's rows: the type, the base address and byte strides over (block, position, KV head).
struct KVRows {
  KVType type;
  const uint8_t* base;
  int64_t s0, s1, s2;
  KVRows(const at::Tensor& t, KVType type_) : type(type_), base(static_cast<const uint8_t*>(t.data_ptr())) {
    const int64_t e = t.element_size();
    s0 = t.stride(0) * e, s1 = t.stride(1) * e, s2 = t.stride(2) * e;
  }
};

// kernels/kv_types.py's rotation(): the 4- and 5-bit types keep K turned in pieces of the largest power of two
// from 64 that divides head_dim, V in pieces of 64 (a Walsh-Hadamard rotation, as llama.cpp's quantized caches);
// 0: kept as computed.
inline int64_t rotation_of(KVType type, int64_t head_dim, bool value) {
  if (type == KVType::F32 || type == KVType::F16 || type == KVType::BF16 || type == KVType::Q8_0 || head_dim % 64) return 0;
  int64_t n = 64;
  while (!value && head_dim % (2 * n) == 0) n *= 2;
  return n;
}

// len values turned in pieces of n (a power of two dividing len) by the orthonormal Walsh-Hadamard matrix, its
// own inverse: kernels/kv_types.py's hadamard_ref operation for operation (the butterfly at strides 1, 2, ..
// n / 2, then times 1 / sqrt(n) rounded to fp32), so the kernel stores and reads what the twin does.
inline void hadamard(float* x, int64_t len, int64_t n) {
  if (!n) return;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (float* y = x; y < x + len; y += n) {
    for (int64_t h = 1; h < n; h *= 2)
      for (int64_t i = 0; i < n; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) {
          const float a = y[j], b = y[j + h];
          y[j] = a + b, y[j + h] = a - b;
        }
    for (int64_t i = 0; i < n; ++i) y[i] *= scale;
  }
}

// The conversions below keep every multiply and add its own fp32 rounding (no fused multiply-add), so a value
// read is the PyTorch twin's bit for bit (kernels/kv_types.py) and a block quantizes as llama.cpp's reference.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// One block's 32 quants as small signed integers, value j in byte j: q8_0's int8, (q - 8), (q - 16), q or level[q].
#ifdef MB_ATTN_AVX2
inline __m256i block_quants(KVType type, const uint8_t* b) {
  if (type == KVType::Q8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  const bool with_min = type == KVType::Q4_1 || type == KVType::Q5_1;
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + block_bytes(type) - 16));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
  if (type == KVType::IQ4_NL) {
    const __m128i levels = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values));
    lo = _mm_shuffle_epi8(levels, lo), hi = _mm_shuffle_epi8(levels, hi);
  }
  __m256i all = _mm256_set_m128i(hi, lo);
  if (type == KVType::Q5_0 || type == KVType::Q5_1) {  // bit j of the 32 after the scale(s), as 16 in byte j
    uint32_t high;
    std::memcpy(&high, b + (with_min ? 4 : 2), 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int>(high)),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    all = _mm256_or_si256(all, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
  }
  if (type == KVType::Q4_0 || type == KVType::Q5_0) all = _mm256_sub_epi8(all, _mm256_set1_epi8(type == KVType::Q4_0 ? 8 : 16));
  return all;
}
#else
inline void block_quants(KVType type, const uint8_t* b, int8_t* q) {
  if (type == KVType::Q8_0) {
    std::memcpy(q, b + 2, kBlockValues);
    return;
  }
  const bool with_min = type == KVType::Q4_1 || type == KVType::Q5_1;
  const uint8_t* qs = b + block_bytes(type) - 16;
  for (int j = 0; j < 16; ++j) {
    q[j] = static_cast<int8_t>(qs[j] & 0x0F), q[j + 16] = static_cast<int8_t>(qs[j] >> 4);
    if (type == KVType::IQ4_NL) q[j] = kIQ4Values[q[j]], q[j + 16] = kIQ4Values[q[j + 16]];
    if (type == KVType::Q4_0) q[j] -= 8, q[j + 16] -= 8;
  }
  if (type == KVType::Q5_0 || type == KVType::Q5_1) {
    uint32_t high;
    std::memcpy(&high, b + (with_min ? 4 : 2), 4);
    for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>((q[j] | ((high >> j) & 1) << 4) - (with_min ? 0 : 16));
  }
}
#endif

// n rows of head_dim values, from src (rows `stride` bytes apart) into dst as fp32, row after row: a float
// type's values exactly; a block's q * d (exact: a small integer times an fp16), plus m where the type has one.
inline void rows_to_float(KVType type, const uint8_t* src, int64_t stride, int64_t n, int64_t head_dim, float* dst) {
  for (int64_t i = 0; i < n; ++i, src += stride, dst += head_dim) {
    int64_t d = 0;
    switch (type) {
      case KVType::F32:
        std::memcpy(dst, src, head_dim * sizeof(float));
        break;
      case KVType::F16:
#if defined(MB_ATTN_AVX2) && defined(__F16C__)
        for (; d + 8 <= head_dim; d += 8)
          _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * d))));
#endif
        for (; d < head_dim; ++d) dst[d] = half_to_float(src + 2 * d);
        break;
      case KVType::BF16:
#ifdef MB_ATTN_AVX2
        for (; d + 8 <= head_dim; d += 8) {
          const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * d)));
          _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
#endif
        for (; d < head_dim; ++d) {
          uint16_t b;
          std::memcpy(&b, src + 2 * d, 2);
          const uint32_t bits = static_cast<uint32_t>(b) << 16;
          std::memcpy(dst + d, &bits, 4);
        }
        break;
      default: {
        const int64_t bytes = block_bytes(type);
        const bool with_min = type == KVType::Q4_1 || type == KVType::Q5_1;
        for (int64_t blk = 0; blk < head_dim / kBlockValues; ++blk) {
          const uint8_t* b = src + blk * bytes;
          const float scale = half_to_float(b), min = with_min ? half_to_float(b + 2) : 0.0f;
          float* out = dst + blk * kBlockValues;
#ifdef MB_ATTN_AVX2
          const __m256i q = block_quants(type, b);  // converted from the register, eight at a time
          const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
          const __m256i parts[4] = {_mm256_cvtepi8_epi32(q0), _mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8)),
                                    _mm256_cvtepi8_epi32(q1), _mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))};
          const __m256 sv = _mm256_set1_ps(scale), mv = _mm256_set1_ps(min);
          for (int k = 0; k < 4; ++k) {
            const __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(parts[k]), sv);
            _mm256_storeu_ps(out + 8 * k, with_min ? _mm256_add_ps(x, mv) : x);
          }
#else
          int8_t qs[kBlockValues];
          block_quants(type, b, qs);
          for (int j = 0; j < kBlockValues; ++j) {
            const float x = static_cast<float>(qs[j]) * scale;
            out[j] = with_min ? x + min : x;
          }
#endif
        }
        break;
      }
    }
  }
}

// GGUF's nearest of IQ4_NL's levels (best_index_int8): the lower of a tie's two.
inline int iq4_index(float x) {
  if (x <= kIQ4Values[0]) return 0;
  if (x >= kIQ4Values[15]) return 15;
  int lo = 0, hi = 15;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    (x < kIQ4Values[mid] ? hi : lo) = mid;
  }
  return x - kIQ4Values[hi - 1] < kIQ4Values[hi] - x ? hi - 1 : hi;
}

inline void put_half(uint8_t* dst, float x) {
  const c10::Half h(x);
  std::memcpy(dst, &h.x, 2);
}

// 32 values into one block of a 4- or 5-bit type, as llama.cpp's reference quantizer of the type
// (quantize_row_<type>_ref): q4_0 / q5_0 scale by the value of the largest magnitude over -8 / -16 and truncate
// x / d + 8.5 / 16.5; q4_1 / q5_1 span min..max in 15 / 31 steps and truncate (x - min) / d + 0.5; iq4_nl picks
// each value's nearest level at d = max / -127, then refits d by least squares over the levels picked (a block
// of zeros: d = 0, every index 0).
inline void quantize_block(KVType type, const float* v, uint8_t* b) {
  int q[kBlockValues];
  float d = 0.0f;
  if (type == KVType::Q4_1 || type == KVType::Q5_1) {
    float lo = v[0], hi = v[0];
    for (int j = 1; j < kBlockValues; ++j) lo = std::min(lo, v[j]), hi = std::max(hi, v[j]);
    const int top = type == KVType::Q4_1 ? 15 : 31;
    d = (hi - lo) / top;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < kBlockValues; ++j) q[j] = std::min(top, static_cast<int>((v[j] - lo) * id + 0.5f));
    put_half(b + 2, lo);
  } else {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < kBlockValues; ++j)
      if (amax < std::fabs(v[j])) amax = std::fabs(v[j]), max = v[j];
    if (type == KVType::IQ4_NL) {
      if (amax < 1e-15f) {
        std::fill(q, q + kBlockValues, 0);
      } else {
        const float id = 1.0f / (max / kIQ4Values[0]);
        float sum_qx = 0.0f, sum_q2 = 0.0f;
        for (int j = 0; j < kBlockValues; ++j) {
          q[j] = iq4_index(id * v[j]);
          const float level = kIQ4Values[q[j]], w = v[j] * v[j];
          sum_qx += w * level * v[j];
          sum_q2 += w * level * level;
        }
        d = sum_q2 > 0.0f ? sum_qx / sum_q2 : 0.0f;
      }
    } else {
      const int half = type == KVType::Q4_0 ? 8 : 16;
      d = max / -half;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      for (int j = 0; j < kBlockValues; ++j)
        q[j] = std::min(2 * half - 1, static_cast<int>(static_cast<int8_t>(v[j] * id + (half + 0.5f))));
    }
  }
  put_half(b, d);
  uint8_t* qs = b + block_bytes(type) - 16;
  for (int j = 0; j < 16; ++j) qs[j] = static_cast<uint8_t>((q[j] & 0x0F) | (q[j + 16] & 0x0F) << 4);
  if (type == KVType::Q5_0 || type == KVType::Q5_1) {
    uint32_t high = 0;
    for (int j = 0; j < kBlockValues; ++j) high |= static_cast<uint32_t>((q[j] >> 4) & 1) << j;
    std::memcpy(b + (type == KVType::Q5_1 ? 4 : 2), &high, 4);
  }
}

// One row of head_dim fp32 values into its cache form at dst. f16 and bf16 round to nearest even, as
// torch's conversions do; q8_0 is GGUF's reference quantizer (gguf.quants, llama.cpp's quantize_row_q8_0_ref):
// d = max |x| / 127, q = round(x / d) (halves away from zero, x times 1 / d), d kept as fp16; the 4- and 5-bit
// types as quantize_block says.
inline void float_to_row(KVType type, const float* x, int64_t head_dim, uint8_t* dst) {
  switch (type) {
    case KVType::F32:
      std::memcpy(dst, x, head_dim * sizeof(float));
      break;
    case KVType::F16:
      for (int64_t d = 0; d < head_dim; ++d) put_half(dst + 2 * d, x[d]);
      break;
    case KVType::BF16:
      for (int64_t d = 0; d < head_dim; ++d) {
        const c10::BFloat16 h(x[d]);
        std::memcpy(dst + 2 * d, &h.x, 2);
      }
      break;
    case KVType::Q8_0:
      for (int64_t blk = 0; blk < head_dim / kBlockValues; ++blk) {
        const float* v = x + blk * kBlockValues;
        uint8_t* b = dst + blk * 34;
        float amax = 0.0f;
        for (int j = 0; j < kBlockValues; ++j) amax = std::max(amax, std::fabs(v[j]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        put_half(b, d);
        for (int j = 0; j < kBlockValues; ++j) b[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::round(v[j] * id)));
      }
      break;
    default:
      for (int64_t blk = 0; blk < head_dim / kBlockValues; ++blk)
        quantize_block(type, x + blk * kBlockValues, dst + blk * block_bytes(type));
      break;
  }
}

#pragma GCC pop_options

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  float s = 0.0f;
#ifdef MB_ATTN_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; d + 16 <= n; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), a1);
  }
  for (; d + 8 <= n; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), a0);
  s = hsum(_mm256_add_ps(a0, a1));
#endif
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

inline void axpy(float p, const float* v, float* acc, int64_t n) {  // acc += p * v
  int64_t d = 0;
#ifdef MB_ATTN_AVX2
  const __m256 pv = _mm256_set1_ps(p);
  for (; d + 8 <= n; d += 8) _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc + d)));
#endif
  for (; d < n; ++d) acc[d] += p * v[d];
}

// p[i] = exp(s[i] - m) for i < n; returns their sum
inline float exp_shifted(float* s, int64_t n, float m) {
  int64_t i = 0;
  float sum = 0.0f;
#ifdef MB_ATTN_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, p);
    acc = _mm256_add_ps(acc, p);
  }
  sum = hsum(acc);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}

// s[i] = cap * tanh(s[i] / cap) for i < n (cap > 0)
inline void soft_cap(float* s, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] * inv);
}

#ifdef MB_ATTN_AVX2
// The scores of up to 8 keys (count of them, from kb with stride ks1) against q in registers (head_dim = 8 * V),
// lane i for key i and 0 past count. Each key's products run in two chains over the head dimension, the
// chains are added, and the 8 lanes are summed by one tree for every key, ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)):
// eight keys share the reduction's shuffles, and a key's score never depends on its neighbours.
template <int V>
inline __m256 scores8(const __m256* qv, const float* kb, int64_t ks1, int64_t count) {
  __m256 s[8];
  for (int i = 0; i < 8; ++i) {
    if (i >= count) {
      s[i] = _mm256_setzero_ps();
      continue;
    }
    const float* k = kb + i * ks1;
    __m256 a0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k)), a1 = _mm256_setzero_ps();
    for (int j = 1; j < V; ++j) {
      if (j % 2) a1 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k + 8 * j), a1);
      else a0 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k + 8 * j), a0);
    }
    s[i] = _mm256_add_ps(a0, a1);
  }
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Lanes i < count of an 8-lane mask.
inline __m256 first_lanes(int64_t count) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), idx));
}

// One query head against n positions of one KV block, in three phases so that a tile's heads and queries,
// independent of each other, overlap in the core instead of each waiting on its own chain of latencies:
// scores_head (the positions' scores eight at a time into sc, room for n rounded up to 8), softmax_head (the
// online-softmax update: block max, the accumulator rescaled when it grows, exponentials in eight lanes,
// summed in lanes, then across them), values_head (acc += p * v position by position, in registers). A
// head's values go through the same operations in the same order whatever runs beside it.
template <int V>
inline void scores_head(const float* q, const float* kb, int64_t ks1, int64_t n, float* sc) {
  __m256 qv[V];
  for (int j = 0; j < V; ++j) qv[j] = _mm256_loadu_ps(q + 8 * j);
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(sc + i, scores8<V>(qv, kb + i * ks1, ks1, n - i));
}

template <int V>
inline void softmax_head(float* sc, int64_t n, float* mx, float* sum, float* acc, float cap) {
  if (cap > 0.0f) soft_cap(sc, n, cap);
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 8)
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(vmax, _mm256_loadu_ps(sc + i), first_lanes(n - i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));  // a maximum is exact
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));                                                 // in any order
  const float bmax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  if (bmax > *mx) {
    const float corr = std::exp(*mx - bmax);  // 0 for the first block
    *sum *= corr;
    const __m256 c = _mm256_set1_ps(corr);
    for (int j = 0; j < V; ++j) _mm256_storeu_ps(acc + 8 * j, _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * j), c));
    *mx = bmax;
  }
  const __m256 m = _mm256_set1_ps(*mx);
  __m256 psum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 p = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + i), m)), first_lanes(n - i));
    _mm256_storeu_ps(sc + i, p);
    psum = _mm256_add_ps(psum, p);
  }
  *sum += hsum(psum);
}

template <int V>
inline void values_head(const float* sc, const float* vb, int64_t vs1, int64_t n, float* acc) {
  __m256 av[V];
  for (int j = 0; j < V; ++j) av[j] = _mm256_loadu_ps(acc + 8 * j);
  for (int64_t i = 0; i < n; ++i) {
    const __m256 p = _mm256_set1_ps(sc[i]);
    const float* v = vb + i * vs1;
    for (int j = 0; j < V; ++j) av[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * j), av[j]);
  }
  for (int j = 0; j < V; ++j) _mm256_storeu_ps(acc + 8 * j, av[j]);
}
#endif


constexpr int64_t kQueryTile = 16;  // queries of one sequence that share a pass over its KV blocks

// The running state of one query's heads: scaled q, accumulators, running max and sum, per query head.
struct QueryState {
  float* q;
  float* acc;
  float* mx;
  float* sum;
};

// The part of one KV block a query attends: positions [skip, skip + n) of it.
struct Span {
  int64_t j, skip, n;  // the query's index in its tile
};

// Fold one KV block into the `group` heads of each query of a tile that attends to part of it (spans): the
// one operation every query is computed with, whatever its kind. kb / vb: the block's first row.
inline void fold_block(const QueryState* st, const Span* spans, int64_t count, int64_t group, int64_t head_dim,
                       const float* kb, int64_t ks1, const float* vb, int64_t vs1, float* scores, int64_t block_size,
                       float cap) {
  const int64_t room = block_size + 8;  // each (query, head)'s scores, with room for the eight-lane stores
#ifdef MB_ATTN_AVX2
  if (head_dim == 64 || head_dim == 128) {
    for (int64_t c = 0; c < count; ++c) {
      const Span& sp = spans[c];
      for (int64_t g = 0; g < group; ++g) {
        float* sc = scores + (c * group + g) * room;
        const float* q = st[c].q + g * head_dim;
        if (head_dim == 64) scores_head<8>(q, kb + sp.skip * ks1, ks1, sp.n, sc);
        else scores_head<16>(q, kb + sp.skip * ks1, ks1, sp.n, sc);
      }
    }
    for (int64_t c = 0; c < count; ++c)
      for (int64_t g = 0; g < group; ++g) {
        float* sc = scores + (c * group + g) * room;
        float* a = st[c].acc + g * head_dim;
        if (head_dim == 64) softmax_head<8>(sc, spans[c].n, &st[c].mx[g], &st[c].sum[g], a, cap);
        else softmax_head<16>(sc, spans[c].n, &st[c].mx[g], &st[c].sum[g], a, cap);
      }
    for (int64_t c = 0; c < count; ++c) {
      const Span& sp = spans[c];
      for (int64_t g = 0; g < group; ++g) {
        const float* sc = scores + (c * group + g) * room;
        float* a = st[c].acc + g * head_dim;
        if (head_dim == 64) values_head<8>(sc, vb + sp.skip * vs1, vs1, sp.n, a);
        else values_head<16>(sc, vb + sp.skip * vs1, vs1, sp.n, a);
      }
    }
    return;
  }
#endif
  for (int64_t c = 0; c < count; ++c) {
    const QueryState& q = st[c];
    const int64_t n = spans[c].n;
    const float* k0 = kb + spans[c].skip * ks1;
    const float* v0 = vb + spans[c].skip * vs1;
    float* sq = scores + c * group * room;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t g = 0; g < group; ++g) sq[g * room + i] = dot(q.q + g * head_dim, k0 + i * ks1, head_dim);
    for (int64_t g = 0; g < group; ++g) {  // online softmax: fold this block into the running max and sum
      float* sg = sq + g * room;
      if (cap > 0.0f) soft_cap(sg, n, cap);
      const float bmax = *std::max_element(sg, sg + n);
      if (bmax > q.mx[g]) {
        const float corr = std::exp(q.mx[g] - bmax);  // 0 for the first block
        q.sum[g] *= corr;
        float* a = q.acc + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) a[d] *= corr;
        q.mx[g] = bmax;
      }
      q.sum[g] += exp_shifted(sg, n, q.mx[g]);
    }
    for (int64_t i = 0; i < n; ++i)
      for (int64_t g = 0; g < group; ++g) axpy(sq[g * room + i], v0 + i * vs1, q.acc + g * head_dim, head_dim);
  }
}

}  // namespace

at::Tensor paged_attention(
    at::Tensor q,             // [num_tokens, num_heads, head_dim] fp32: every sequence's new tokens, back to back
    at::Tensor k_cache,       // [num_blocks, block_size, num_kv_heads, row]: any kernels/kv_types.py type
    at::Tensor v_cache,       // [num_blocks, block_size, num_kv_heads, row], its own type
    at::Tensor block_tables,  // [num_seqs, max_blocks] int32
    at::Tensor seq_lens,      // [num_seqs] int32: each sequence's context after this forward (cached + new)
    at::Tensor query_start,   // [num_seqs + 1] int32: sequence s's tokens are rows query_start[s] .. [s + 1] - 1
    double scale,
    int64_t window,           // > 0: attend to the last `window` positions only (sliding window)
    double softcap,           // > 0: scores -> softcap * tanh(scores / softcap)
    const std::optional<at::Tensor>& image_spans) {  // [num_tokens, 2] int32: a whole image's row's [first, stop)
  TORCH_CHECK(window >= 0, "window must be >= 0");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0");
  TORCH_CHECK(q.dtype() == at::kFloat, "paged_attention: fp32 queries only");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "caches must be [num_blocks, block_size, num_kv_heads, row]");
  TORCH_CHECK(block_tables.dtype() == at::kInt && seq_lens.dtype() == at::kInt && query_start.dtype() == at::kInt,
              "int32 tables");
  TORCH_CHECK(q.is_contiguous() && block_tables.is_contiguous() && seq_lens.is_contiguous() && query_start.is_contiguous(),
              "contiguous inputs");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "a cache row must be contiguous");
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const KVType k_type = kv_type_of(k_cache, head_dim, "K"), v_type = kv_type_of(v_cache, head_dim, "V");
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(v_cache.size(1) == block_size && v_cache.size(2) == num_kv_heads && v_cache.size(0) == k_cache.size(0),
              "K and V caches must have the same blocks");
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query_start.numel() == num_seqs + 1 && block_tables.size(0) == num_seqs, "one table and length per sequence");
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(qs[0] == 0 && qs[num_seqs] == num_tokens, "query_start must run from 0 to the number of query rows");
  const int32_t* spans = nullptr;
  if (image_spans.has_value()) {
    const at::Tensor& t = *image_spans;
    TORCH_CHECK(t.dtype() == at::kInt && t.is_contiguous() && t.dim() == 2 && t.size(0) == num_tokens && t.size(1) == 2,
                "image_spans must be contiguous int32 [num_tokens, 2]");
    spans = t.data_ptr<int32_t>();
  }
  // Tasks: (sequence, KV head, tile of queries), the tiles of each sequence in order.
  std::vector<int64_t> tile_seq, tile_q0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t qlen = qs[s + 1] - qs[s];
    TORCH_CHECK(qlen >= 1 && qlen <= lens[s], "sequence ", s, ": ", qlen, " queries over a context of ", lens[s]);
    TORCH_CHECK((lens[s] + block_size - 1) / block_size <= max_blocks, "sequence ", s, "'s block table is too short");
    for (int64_t q0 = qs[s]; q0 < qs[s + 1]; q0 += kQueryTile) tile_seq.push_back(s), tile_q0.push_back(q0);
  }
  auto out = mb::empty(q.sizes(), q.scalar_type());
  const float* qp = q.data_ptr<float>();
  const KVRows kr(k_cache, k_type), vr(v_cache, v_type);
  const int64_t k_row_bytes = k_cache.size(3) * k_cache.element_size(), v_row_bytes = v_cache.size(3) * v_cache.element_size();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const int64_t tiles = static_cast<int64_t>(tile_seq.size()), per_query = group * head_dim;
  // a turned K is scored against queries turned the same way; values read turned give an output turned back
  const int64_t k_rot = rotation_of(k_type, head_dim, false), v_rot = rotation_of(v_type, head_dim, true);

  parallel_chunks_for_rows(num_tokens, tiles * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    // scores: a block's per query head, with room for the eight-lane stores past its last position;
    // kbuf / vbuf: one block's K and V rows as fp32 when the cache holds another type
    std::vector<float> qsc(kQueryTile * per_query), acc(kQueryTile * per_query), scores(kQueryTile * group * (block_size + 8));
    std::vector<float> mx(kQueryTile * group), sum(kQueryTile * group);
    std::vector<float> kbuf(k_type == KVType::F32 ? 0 : block_size * head_dim);
    std::vector<float> vbuf(v_type == KVType::F32 ? 0 : block_size * head_dim);
    int64_t first[kQueryTile], stop[kQueryTile];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t tile = task / num_kv_heads, kvh = task % num_kv_heads, s = tile_seq[tile];
      const int64_t q0 = tile_q0[tile], nq = std::min<int64_t>(kQueryTile, qs[s + 1] - q0);
      const int64_t pos0 = lens[s] - (qs[s + 1] - qs[s]) + (q0 - qs[s]);  // the tile's first query's position
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
      for (int64_t j = 0; j < nq; ++j) {
        const float* src = qp + ((q0 + j) * num_heads + kvh * group) * head_dim;
        float* dst = qsc.data() + j * per_query;
        if (k_rot) {
          std::memcpy(dst, src, per_query * sizeof(float));
          hadamard(dst, per_query, k_rot);
          for (int64_t i = 0; i < per_query; ++i) dst[i] *= fscale;
        } else {
          for (int64_t i = 0; i < per_query; ++i) dst[i] = src[i] * fscale;
        }
        stop[j] = pos0 + j + 1;                                                  // positions attended: [first, stop)
        first[j] = window > 0 ? std::max<int64_t>(0, stop[j] - window) : 0;
        // a whole image's row: its image's later positions too (a window still starts where it did, as
        // Gemma 3's local layers have it)
        if (spans != nullptr && spans[2 * (q0 + j) + 1] > 0)
          stop[j] = std::max<int64_t>(stop[j], std::min<int64_t>(spans[2 * (q0 + j) + 1], lens[s]));
        lo = std::min(lo, first[j] / block_size * block_size), hi = std::max(hi, stop[j]);
      }
      std::fill(acc.begin(), acc.begin() + nq * per_query, 0.0f);
      std::fill(mx.begin(), mx.begin() + nq * group, -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.begin() + nq * group, 0.0f);
      for (int64_t t0 = lo; t0 < hi; t0 += block_size) {  // block by block; each query takes the part it attends
        const int64_t block = bt[s * max_blocks + t0 / block_size];
        const uint8_t* krow = kr.base + block * kr.s0 + kvh * kr.s2;
        const uint8_t* vrow = vr.base + block * vr.s0 + kvh * vr.s2;
        // This block's rows as fp32: in place for an f32 cache, else the positions the tile attends, converted
        const float *kb = reinterpret_cast<const float*>(krow), *vb = reinterpret_cast<const float*>(vrow);
        int64_t ks1 = kr.s1 / static_cast<int64_t>(sizeof(float)), vs1 = vr.s1 / static_cast<int64_t>(sizeof(float));
        if (k_type != KVType::F32 || v_type != KVType::F32) {
#ifdef MB_ATTN_AVX2
          if (t0 + block_size < hi) {  // the next block's rows on their way while this one is computed
            const int64_t next = bt[s * max_blocks + t0 / block_size + 1];
            for (const KVRows* c : {&kr, &vr}) {
              const uint8_t* r = c->base + next * c->s0 + kvh * c->s2;
              const int64_t bytes = c == &kr ? k_row_bytes : v_row_bytes;
              for (int64_t i = 0; i < block_size; ++i)
                for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(r + i * c->s1 + off), _MM_HINT_T0);
            }
          }
#endif
          int64_t a = block_size, b = 0;
          for (int64_t j = 0; j < nq; ++j) {
            if (t0 >= stop[j] || t0 + block_size <= first[j]) continue;
            a = std::min(a, std::max<int64_t>(0, first[j] - t0)), b = std::max(b, std::min(block_size, stop[j] - t0));
          }
          if (k_type != KVType::F32) {
            rows_to_float(k_type, krow + a * kr.s1, kr.s1, b - a, head_dim, kbuf.data() + a * head_dim);
            kb = kbuf.data(), ks1 = head_dim;
          }
          if (v_type != KVType::F32) {
            rows_to_float(v_type, vrow + a * vr.s1, vr.s1, b - a, head_dim, vbuf.data() + a * head_dim);
            vb = vbuf.data(), vs1 = head_dim;
          }
        }
        Span spans[kQueryTile];
        QueryState states[kQueryTile];
        int64_t count = 0;
        for (int64_t j = 0; j < nq; ++j) {
          if (t0 >= stop[j] || t0 + block_size <= first[j]) continue;
          const int64_t skip = std::max<int64_t>(0, first[j] - t0);  // positions of this block before the window
          spans[count] = Span{j, skip, std::min(block_size, stop[j] - t0) - skip};
          states[count++] = QueryState{qsc.data() + j * per_query, acc.data() + j * per_query, mx.data() + j * group,
                                       sum.data() + j * group};
        }
        fold_block(states, spans, count, group, head_dim, kb, ks1, vb, vs1, scores.data(), block_size, cap);
      }
      for (int64_t j = 0; j < nq; ++j) {
        float* os = op + ((q0 + j) * num_heads + kvh * group) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float inv = 1.0f / sum[j * group + g];
          const float* a = acc.data() + j * per_query + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) os[g * head_dim + d] = a[d] * inv;
        }
        hadamard(os, per_query, v_rot);
      }
    }
  });
  return out;
}

// The new tokens' K and V converted into their caches' types and written into their slots, then attention:
// one call per layer.
at::Tensor store_and_attention(
    at::Tensor q,             // [num_tokens, num_heads, head_dim] fp32
    at::Tensor k,             // [num_tokens, num_kv_heads, head_dim] fp32
    at::Tensor v,             // [num_tokens, num_kv_heads, head_dim] fp32
    at::Tensor k_cache,       // [num_blocks, block_size, num_kv_heads, row], contiguous, any cache type
    at::Tensor v_cache,       // [num_blocks, block_size, num_kv_heads, row], contiguous, any cache type
    at::Tensor slot_mapping,  // [num_tokens] int64: block * block_size + offset of each new token
    at::Tensor block_tables,  // [num_seqs, max_blocks] int32
    at::Tensor seq_lens,      // [num_seqs] int32
    at::Tensor query_start,   // [num_seqs + 1] int32
    double scale,
    int64_t window,
    double softcap,
    const std::optional<at::Tensor>& image_spans) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 && v_cache.dim() == 4,
              "caches must be contiguous [blocks, block_size, kv_heads, row]");
  TORCH_CHECK(slot_mapping.dtype() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping must be contiguous int64");
  TORCH_CHECK(k.dtype() == at::kFloat && v.dtype() == at::kFloat, "k and v must be fp32");
  const int64_t n = q.size(0), kv_heads = k_cache.size(2), head_dim = k.size(2);
  const KVType k_type = kv_type_of(k_cache, head_dim, "K"), v_type = kv_type_of(v_cache, head_dim, "V");
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(k.size(0) == n && v.size(0) == n && slot_mapping.numel() == n && k.size(1) == kv_heads &&
              v.size(1) == kv_heads && v.size(2) == head_dim && v_cache.size(0) * v_cache.size(1) == slots,
              "k, v, slots: one row per token");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == head_dim && v.stride(1) == head_dim, "k and v rows must be contiguous");
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  uint8_t* kc = static_cast<uint8_t*>(k_cache.data_ptr());
  uint8_t* vc = static_cast<uint8_t*>(v_cache.data_ptr());
  const int64_t k_row = k_cache.size(3) * k_cache.element_size(), v_row = v_cache.size(3) * v_cache.element_size();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < slots, "slot ", sp[i], " outside the cache");
  const int64_t k_rot = rotation_of(k_type, head_dim, false), v_rot = rotation_of(v_type, head_dim, true);
  std::vector<float> turned(head_dim);
  auto store = [&](KVType type, int64_t rot, const float* x, uint8_t* dst) {
    if (rot) {
      std::memcpy(turned.data(), x, head_dim * sizeof(float));
      hadamard(turned.data(), head_dim, rot);
      x = turned.data();
    }
    float_to_row(type, x, head_dim, dst);
  };
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < kv_heads; ++h) {
      store(k_type, k_rot, kp + i * k.stride(0) + h * head_dim, kc + (sp[i] * kv_heads + h) * k_row);
      store(v_type, v_rot, vp + i * v.stride(0) + h * head_dim, vc + (sp[i] * kv_heads + h) * v_row);
    }
  return paged_attention(q.contiguous(), k_cache, v_cache, block_tables, seq_lens, query_start, scale, window, softcap,
                         image_spans);
}
