// Matrix multiplies, embedding lookups and dequantisation straight from GGUF's block-quantized
// weights on the CPU. Activations and accumulation are fp32.
//
// A weight matrix [N, K] is stored as GGUF stores it: row n is K/block_elems blocks of
// block_bytes each, back to back ([N, row_bytes] uint8). Every block is dequantised with the
// same operations, in the same order, as gguf.quants' numpy reference, so the dequantised values
// are bit-identical to it (compiled with -ffp-contract=off; the products that are fused below
// are exact in fp32, so fusing cannot change a bit).
//
// Two paths for y = x W^T:
//   few rows  - each weight block is dequantised into registers once and multiplied into every
//               row's accumulator: the weights are streamed exactly once per call;
//   many rows - a cache-sized tile of output columns is dequantised into a thread-local fp32
//               buffer once, then torch's fp32 GEMM multiplies every row by it (one thread per
//               tile: the call runs inside the parallel region).
// Threads split the output columns in both paths.
#include <ATen/core/Tensor.h>
#include <ATen/ops/mm_ops.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include "gguf_blocks.h"
#include "kernels.h"
#include <algorithm>
#include <cstring>
#include <vector>
#include "vec_math.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define MB_AVX2 1
#endif

namespace {

// GGML's type numbers, as GGUF files store them.
enum QType : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
  Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30
};

struct Layout {
  int64_t elems;  // values per block
  int64_t bytes;  // bytes per block
};

Layout layout_of(int64_t type) {
  switch (type) {
    case F32: return {1, 4};
    case F16: return {1, 2};
    case BF16: return {1, 2};
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case IQ4_NL: return {32, 18};
    case Q2_K: return {256, 84};
    case Q3_K: return {256, 110};
    case IQ4_XS: return {256, 136};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    default: TORCH_CHECK(false, "unsupported GGML type ", type);
  }
}

inline float bf16_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ---- one block -> fp32, portable (the exact operation order of gguf.quants) ----

void deq_q4_0(const uint8_t* b, float* y) {
  const float d = half_to_float(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (float)((int)(qs[j] & 0x0f) - 8);
    y[j + 16] = d * (float)((int)(qs[j] >> 4) - 8);
  }
}

void deq_q4_1(const uint8_t* b, float* y) {
  const float d = half_to_float(b), m = half_to_float(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (float)(qs[j] & 0x0f) + m;
    y[j + 16] = d * (float)(qs[j] >> 4) + m;
  }
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q5_0 / Q5_1: the fifth bit of value j is bit j of the 32-bit qh.
void deq_q5_0(const uint8_t* b, float* y) {
  const float d = half_to_float(b);
  const uint32_t qh = load_u32(b + 2);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (float)((int)((qs[j] & 0x0f) | (((qh >> j) & 1) << 4)) - 16);
    y[j + 16] = d * (float)((int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
  }
}

void deq_q5_1(const uint8_t* b, float* y) {
  const float d = half_to_float(b), m = half_to_float(b + 2);
  const uint32_t qh = load_u32(b + 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (float)((qs[j] & 0x0f) | (((qh >> j) & 1) << 4)) + m;
    y[j + 16] = d * (float)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
  }
}


void deq_iq4_nl(const uint8_t* b, float* y) {
  const float d = half_to_float(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * (float)kIQ4Values[qs[j] & 0x0f];
    y[j + 16] = d * (float)kIQ4Values[qs[j] >> 4];
  }
}

// IQ4_XS: 8 sub-blocks of 32, each with a 6-bit scale (low 4 bits in scales_l, high 2 in scales_h).
void deq_iq4_xs(const uint8_t* b, float* y) {
  const float d = half_to_float(b);
  const uint16_t sh = (uint16_t)(b[2] | (b[3] << 8));
  const uint8_t* sl = b + 4;
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 8; ++j) {
    const int sc = (int)(((sl[j / 2] >> (4 * (j % 2))) & 0x0f) | (((sh >> (2 * j)) & 3) << 4)) - 32;
    const float dl = d * (float)sc;
    const uint8_t* q = qs + 16 * j;
    for (int l = 0; l < 16; ++l) {
      y[32 * j + l] = dl * (float)kIQ4Values[q[l] & 0x0f];
      y[32 * j + l + 16] = dl * (float)kIQ4Values[q[l] >> 4];
    }
  }
}

// Q2_K: 16 sub-blocks of 16 with a 4-bit scale and a 4-bit min each; value i = 128c + 32s + l holds
// bits 2s..2s+1 of qs[32c + l].
void deq_q2_k(const uint8_t* b, float* y) {
  const uint8_t* sc = b;
  const uint8_t* qs = b + 16;
  const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
  for (int g = 0; g < 16; ++g) {
    const float dl = d * (float)(sc[g] & 0x0f), ml = dmin * (float)(sc[g] >> 4);
    for (int e = 0; e < 16; ++e) {
      const int i = 16 * g + e, c = i / 128, s = (i / 32) % 4, l = i % 32;
      y[i] = dl * (float)((qs[32 * c + l] >> (2 * s)) & 3) - ml;
    }
  }
}

// Q3_K: 16 sub-blocks of 16 with a signed 6-bit scale; value i = 128c + 32s + l is bits 2s..2s+1 of
// qs[32c + l], less 4 unless bit (i / 32) of hmask[l] is set.
inline int q3_k_scale(const uint8_t* sc, int k) {
  const int lo = (sc[k % 8] >> (4 * (k / 8))) & 0x0f, hi = (sc[8 + k % 4] >> (2 * (k / 4))) & 3;
  return (lo | (hi << 4)) - 32;
}

void deq_q3_k(const uint8_t* b, float* y) {
  const uint8_t* hmask = b;
  const uint8_t* qs = b + 32;
  const uint8_t* sc = b + 96;
  const float d = half_to_float(b + 108);
  for (int k = 0; k < 16; ++k) {
    const float dl = d * (float)q3_k_scale(sc, k);
    for (int e = 0; e < 16; ++e) {
      const int i = 16 * k + e, c = i / 128, s = (i / 32) % 4, l = i % 32;
      const int q = ((qs[32 * c + l] >> (2 * s)) & 3) - (((hmask[l] >> (i / 32)) & 1) ? 0 : 4);
      y[i] = dl * (float)q;
    }
  }
}

void deq_q8_0(const uint8_t* b, float* y) {
  const float d = half_to_float(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = (float)qs[j] * d;
}

inline void k_scale_min(int j, const uint8_t* s, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// K-quants: 256 values in 8 sub-blocks of 32 (Q4_K, Q5_K) or 16 of 16 (Q6_K), written as
// straight loops over 32 lanes so the compiler vectorises them.
// Scales and mins of sub-blocks j and j+1 of a Q4_K/Q5_K block, as gguf.quants computes them.
inline void k_pair(int j, const uint8_t* b, float* d0, float* min0, float* d1, float* min1) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  uint8_t sc0, m0, sc1, m1;
  k_scale_min(j, b + 4, &sc0, &m0);
  k_scale_min(j + 1, b + 4, &sc1, &m1);
  *d0 = d * (float)sc0, *min0 = dmin * (float)m0, *d1 = d * (float)sc1, *min1 = dmin * (float)m1;
}

void deq_q4_k(const uint8_t* b, float* y) {
  const uint8_t* qs = b + 16;
  for (int j = 0; j < 8; j += 2) {  // sub-blocks j (low nibbles) and j+1 (high) share 32 bytes
    float d0, min0, d1, min1;
    k_pair(j, b, &d0, &min0, &d1, &min1);
    const uint8_t* q = qs + 16 * j;
    float* y0 = y + 32 * j;
    for (int l = 0; l < 32; ++l) {
      y0[l] = d0 * (float)(q[l] & 0x0f) - min0;
      y0[l + 32] = d1 * (float)(q[l] >> 4) - min1;
    }
  }
}

void deq_q5_k(const uint8_t* b, float* y) {
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int j = 0; j < 8; j += 2) {
    float d0, min0, d1, min1;
    k_pair(j, b, &d0, &min0, &d1, &min1);
    const uint8_t* q = qs + 16 * j;
    float* y0 = y + 32 * j;
    for (int l = 0; l < 32; ++l) {
      const int lo = (q[l] & 0x0f) | (((qh[l] >> j) & 1) << 4);
      const int hi = (q[l] >> 4) | (((qh[l] >> (j + 1)) & 1) << 4);
      y0[l] = d0 * (float)lo - min0;
      y0[l + 32] = d1 * (float)hi - min1;
    }
  }
}

void deq_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_to_float(b + 208);
  for (int h = 0; h < 2; ++h) {  // two halves of 128 values: 64 bytes of ql, 32 of qh, 8 scales each
    const uint8_t* l4 = ql + 64 * h;
    const uint8_t* h2 = qh + 32 * h;
    const int8_t* s = sc + 8 * h;
    float* yh = y + 128 * h;
    float dl[8];
    for (int i = 0; i < 8; ++i) dl[i] = d * (float)s[i];
    for (int l = 0; l < 32; ++l) {
      const int q1 = ((l4[l] & 0x0f) | ((h2[l] & 3) << 4)) - 32;
      const int q2 = ((l4[l + 32] & 0x0f) | (((h2[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4)) - 32;
      const int is = l / 16;
      yh[l] = dl[is] * (float)q1;
      yh[l + 32] = dl[is + 2] * (float)q2;
      yh[l + 64] = dl[is + 4] * (float)q3;
      yh[l + 96] = dl[is + 6] * (float)q4;
    }
  }
}

void deq_f16(const uint8_t* b, float* y) { *y = half_to_float(b); }
void deq_bf16(const uint8_t* b, float* y) { *y = bf16_to_float(b); }
void deq_f32(const uint8_t* b, float* y) { std::memcpy(y, b, 4); }

using DeqFn = void (*)(const uint8_t*, float*);

DeqFn deq_fn(int64_t type) {
  switch (type) {
    case F32: return deq_f32;
    case F16: return deq_f16;
    case BF16: return deq_bf16;
    case Q4_0: return deq_q4_0;
    case Q4_1: return deq_q4_1;
    case Q5_0: return deq_q5_0;
    case Q5_1: return deq_q5_1;
    case Q8_0: return deq_q8_0;
    case IQ4_NL: return deq_iq4_nl;
    case Q2_K: return deq_q2_k;
    case Q3_K: return deq_q3_k;
    case IQ4_XS: return deq_iq4_xs;
    case Q4_K: return deq_q4_k;
    case Q5_K: return deq_q5_k;
    case Q6_K: return deq_q6_k;
    default: TORCH_CHECK(false, "unsupported GGML type ", type);
  }
}

// One row of K values: dequantise every block into y.
void dequant_row(int64_t type, const uint8_t* row, int64_t k, float* y) {
  const Layout L = layout_of(type);
  const DeqFn fn = deq_fn(type);
  for (int64_t b = 0; b < k / L.elems; ++b) fn(row + b * L.bytes, y + b * L.elems);
}

#ifdef MB_AVX2
// ---- 32-value blocks straight into four registers (same values as the portable versions) ----

inline __m256 bcast_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm256_cvtph_ps(_mm_set1_epi16((short)h));  // exact, subnormals included
}

inline void nibbles(const uint8_t* qs, __m256i* q) {  // 16 bytes -> 32 ints: low nibbles, then high
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  q[0] = _mm256_cvtepu8_epi32(lo);
  q[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
  q[2] = _mm256_cvtepu8_epi32(hi);
  q[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
}

// d * q + m: d*q is exact in fp32 (11-bit by 4-bit), so the fused form rounds exactly as numpy does.
inline void reg_q4_1(const uint8_t* b, __m256* w) {
  const __m256 d = bcast_half(b), m = bcast_half(b + 2);
  __m256i q[4];
  nibbles(b + 4, q);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[i]), m);
}

inline void reg_q4_0(const uint8_t* b, __m256* w) {
  const __m256 d = bcast_half(b);
  const __m256i eight = _mm256_set1_epi32(8);
  __m256i q[4];
  nibbles(b + 2, q);
  for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[i], eight)));
}

inline void reg_q8_0(const uint8_t* b, __m256* w) {
  const __m256 d = bcast_half(b);
  for (int i = 0; i < 4; ++i) {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i));
    w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), d);
  }
}

using RegFn = void (*)(const uint8_t*, __m256*);

// Few rows: columns [n0, n1) of out[m, :] = x[m, :] . W[n, :]. Each block is dequantised once
// into registers and multiplied into every row. M is a compile-time row count so that every
// accumulator stays in a register; two per row (four for one row) break the FMA chain.
template <RegFn DEQ, int BYTES, int M>
void gemv_q32(const float* x, int64_t k, const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo,
              int64_t n0, int64_t n1) {
  constexpr int A = M == 1 ? 4 : 2;
  const int64_t nb = k / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[M][A];
    for (int r = 0; r < M; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 v[4];
      DEQ(row + b * BYTES, v);
      for (int r = 0; r < M; ++r) {
        const float* xb = x + r * k + b * 32;
        for (int i = 0; i < 4; ++i) acc[r][i % A] = _mm256_fmadd_ps(v[i], _mm256_loadu_ps(xb + 8 * i), acc[r][i % A]);
      }
    }
    for (int r = 0; r < M; ++r) {
      __m256 s = acc[r][0];
      for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[r][a]);
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      h = _mm_add_ss(h, _mm_movehdup_ps(h));
      out[r * ldo + n] = _mm_cvtss_f32(h);
    }
  }
}

template <RegFn DEQ, int BYTES>
bool gemv_q32_rows(int64_t m, const float* x, int64_t k, const uint8_t* w, int64_t row_bytes, float* out,
                   int64_t ldo, int64_t n0, int64_t n1) {
  switch (m) {
    case 1: gemv_q32<DEQ, BYTES, 1>(x, k, w, row_bytes, out, ldo, n0, n1); return true;
    case 2: gemv_q32<DEQ, BYTES, 2>(x, k, w, row_bytes, out, ldo, n0, n1); return true;
    case 3: gemv_q32<DEQ, BYTES, 3>(x, k, w, row_bytes, out, ldo, n0, n1); return true;
    case 4: gemv_q32<DEQ, BYTES, 4>(x, k, w, row_bytes, out, ldo, n0, n1); return true;
    case 5: gemv_q32<DEQ, BYTES, 5>(x, k, w, row_bytes, out, ldo, n0, n1); return true;
    case 6: gemv_q32<DEQ, BYTES, 6>(x, k, w, row_bytes, out, ldo, n0, n1); return true;
    case 7: gemv_q32<DEQ, BYTES, 7>(x, k, w, row_bytes, out, ldo, n0, n1); return true;
    case 8: gemv_q32<DEQ, BYTES, 8>(x, k, w, row_bytes, out, ldo, n0, n1); return true;
    default: return false;
  }
}
#endif

// One row of K values into y, through the register dequantisers where there are some.
void dequant_row_fast(int64_t type, const uint8_t* row, int64_t k, float* y) {
#ifdef MB_AVX2
  RegFn reg = type == Q4_1 ? reg_q4_1 : type == Q8_0 ? reg_q8_0 : type == Q4_0 ? reg_q4_0 : nullptr;
  if (reg != nullptr) {
    const int64_t bytes = layout_of(type).bytes;
    for (int64_t b = 0; b < k / 32; ++b) {
      __m256 v[4];
      reg(row + b * bytes, v);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(y + 32 * b + 8 * i, v[i]);
    }
    return;
  }
  if (type == F16) {
    int64_t e = 0;
    for (; e + 8 <= k; e += 8)
      _mm256_storeu_ps(y + e, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * e))));
    for (; e < k; ++e) y[e] = half_to_float(row + 2 * e);
    return;
  }
#endif
  dequant_row(type, row, k, y);
}

// Few rows, any type: dequantise a chunk of 256 values (a K-quant block, or 256 16/32-bit values)
// into an L1 buffer and multiply it into every row; M rows' accumulators stay in registers.
template <int M>
void gemv_buffered(int64_t type, const float* x, int64_t k, const uint8_t* w, int64_t row_bytes, float* out,
                   int64_t ldo, int64_t n0, int64_t n1) {
  const Layout L = layout_of(type);
  constexpr int64_t CH = 256;  // a multiple of every block size
  alignas(32) float buf[CH];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float sums[M];
    for (int r = 0; r < M; ++r) sums[r] = 0.0f;  // the values past the last multiple of 16
#ifdef MB_AVX2
    __m256 acc[M][2];
    for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
#endif
    for (int64_t e0 = 0; e0 < k; e0 += CH) {
      const int64_t len = std::min(CH, k - e0);
      dequant_row_fast(type, row + e0 / L.elems * L.bytes, len, buf);
      int64_t e = 0;
#ifdef MB_AVX2
      for (; e + 16 <= len; e += 16) {
        const __m256 w0 = _mm256_load_ps(buf + e), w1 = _mm256_load_ps(buf + e + 8);
        for (int r = 0; r < M; ++r) {
          const float* xr = x + r * k + e0 + e;
          acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc[r][1]);
        }
      }
#endif
      for (; e < len; ++e)
        for (int r = 0; r < M; ++r) sums[r] += buf[e] * x[r * k + e0 + e];
    }
    for (int r = 0; r < M; ++r) {
#ifdef MB_AVX2
      sums[r] += hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
#endif
      out[r * ldo + n] = sums[r];
    }
  }
}

void gemv_columns(int64_t type, const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t row_bytes,
                  float* out, int64_t ldo, int64_t n0, int64_t n1) {
#ifdef MB_AVX2
  if (type == Q4_1 && gemv_q32_rows<reg_q4_1, 20>(m, x, k, w, row_bytes, out, ldo, n0, n1)) return;
  if (type == Q8_0 && gemv_q32_rows<reg_q8_0, 34>(m, x, k, w, row_bytes, out, ldo, n0, n1)) return;
  if (type == Q4_0 && gemv_q32_rows<reg_q4_0, 18>(m, x, k, w, row_bytes, out, ldo, n0, n1)) return;
#endif
  switch (m) {
    case 1: return gemv_buffered<1>(type, x, k, w, row_bytes, out, ldo, n0, n1);
    case 2: return gemv_buffered<2>(type, x, k, w, row_bytes, out, ldo, n0, n1);
    case 3: return gemv_buffered<3>(type, x, k, w, row_bytes, out, ldo, n0, n1);
    case 4: return gemv_buffered<4>(type, x, k, w, row_bytes, out, ldo, n0, n1);
    case 5: return gemv_buffered<5>(type, x, k, w, row_bytes, out, ldo, n0, n1);
    case 6: return gemv_buffered<6>(type, x, k, w, row_bytes, out, ldo, n0, n1);
    case 7: return gemv_buffered<7>(type, x, k, w, row_bytes, out, ldo, n0, n1);
    default: return gemv_buffered<8>(type, x, k, w, row_bytes, out, ldo, n0, n1);
  }
}

void check_weight(const at::Tensor& qweight, int64_t type, int64_t k) {
  TORCH_CHECK(qweight.dtype() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "qweight must be a contiguous uint8 [N, row_bytes] tensor");
  const Layout L = layout_of(type);
  TORCH_CHECK(k % L.elems == 0, "in_features ", k, " is not a multiple of the block size ", L.elems);
  TORCH_CHECK(qweight.size(1) == k / L.elems * L.bytes, "qweight has ", qweight.size(1),
              " bytes per row; type ", type, " with in_features ", k, " needs ", k / L.elems * L.bytes);
}

}  // namespace

// Rows of x that use the register path (in groups of 8 rows over 64 columns at a time, so a
// column's blocks are re-read from L1/L2 rather than memory); above this the tiled GEMM runs.
// Measured on a 2-core AVX2 machine: the register path wins up to about 24 rows.
constexpr int64_t kGemvMaxRows = 24;

at::Tensor quant_linear(at::Tensor x,        // [M, K] fp32
                           at::Tensor qweight,  // [N, row_bytes] uint8, GGUF blocks
                           int64_t type, int64_t gemv_max_rows) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2, "x must be fp32 [rows, in_features]");
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  check_weight(qweight, type, k);
  auto out = mb::empty({m, n}, x.scalar_type());
  if (m == 0 || n == 0) return out;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const int64_t row_bytes = qweight.size(1);
  float* op = out.data_ptr<float>();
  if (gemv_max_rows < 0) gemv_max_rows = kGemvMaxRows;
  if (m <= gemv_max_rows) {
    parallel_chunks_for_rows(m, n, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t c0 = n0; c0 < n1; c0 += 64)
        for (int64_t r0 = 0; r0 < m; r0 += 8)
          gemv_columns(type, xp + r0 * k, std::min<int64_t>(8, m - r0), k, wp, row_bytes, op + r0 * n, n, c0,
                       std::min<int64_t>(c0 + 64, n1));
    });
    return out;
  }
  // Tile of columns whose fp32 copy stays in L2 (~256 KB), a multiple of 8 columns; each tile is
  // multiplied by torch's own fp32 GEMM (single-threaded inside this parallel region).
  const int64_t tile = std::max<int64_t>(8, std::min<int64_t>(n, (65536 / k) / 8 * 8));
  const int64_t tiles = (n + tile - 1) / tile;
  parallel_chunks_omp(tiles, 1, [&](int64_t t0, int64_t t1) {
    c10::InferenceMode guard;  // worker threads do not inherit the caller's mode
    auto buf = mb::empty({tile, k}, x.scalar_type());
    auto part = mb::empty({m, tile}, x.scalar_type());
    float* bp = buf.data_ptr<float>();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t c0 = t * tile, cols = std::min(tile, n - c0);
      for (int64_t c = 0; c < cols; ++c) dequant_row_fast(type, wp + (c0 + c) * row_bytes, k, bp + c * k);
      auto p = part.narrow(1, 0, cols);
      at::_ops::mm_out::call(x, buf.narrow(0, 0, cols).t(), p);
      const float* pp = part.data_ptr<float>();
      for (int64_t r = 0; r < m; ++r) std::memcpy(op + r * n + c0, pp + r * tile, cols * sizeof(float));
    }
  });
  return out;
}

at::Tensor dequantize(at::Tensor qweight, int64_t type, int64_t k) {  // -> [N, K] fp32
  check_weight(qweight, type, k);
  const int64_t n = qweight.size(0), row_bytes = qweight.size(1);
  auto out = mb::empty({n, k}, at::kFloat);
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) dequant_row_fast(type, wp + r * row_bytes, k, op + r * k);
  });
  return out;
}

at::Tensor embedding(at::Tensor qweight, int64_t type, int64_t k, at::Tensor ids) {  // ids [T] int64
  check_weight(qweight, type, k);
  TORCH_CHECK(ids.dtype() == at::kLong && ids.dim() == 1, "ids must be int64 [num_tokens]");
  ids = ids.contiguous();
  const int64_t t = ids.size(0), n = qweight.size(0), row_bytes = qweight.size(1);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "token id ", ip[i], " out of range [0, ", n, ")");
  auto out = mb::empty({t, k}, at::kFloat);
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  parallel_for_rows(t, 0, t, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) dequant_row_fast(type, wp + ip[r] * row_bytes, k, op + r * k);
  });
  return out;
}

bool has_avx2() {
#ifdef MB_AVX2
  return true;
#else
  return false;
#endif
}

