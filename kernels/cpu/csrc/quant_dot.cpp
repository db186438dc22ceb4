// Integer dot products against GGUF block-quantized weights (CPU): the default native path.
//
// Each activation row is quantized once per layer input to 8 bits with one float scale per weight
// block's worth of values (32, or 256 for the K-quants, as llama.cpp's Q8_0 / Q8_K), with the sum of
// every 16 quants beside it. Every weight block is then multiplied into it in integers: the weights stay
// in their 2- to 8-bit form, unpacked to bytes in registers, AVX2's maddubs/madd multiply-add 32 pairs at
// a time with the sub-block scales, a block's products add up in int32, and one float multiply per block
// and row applies the two scales. Minimums and offsets come from the 16-value sums. The result equals the
// exact product of the dequantised weights and the 8-bit activations up to fp32 rounding (the twin in
// kernels/cpu/quant.py computes exactly that).
//
// A portable path computes the same with plain loops (every CPU; tested here by building without
// AVX2). Threads split the output columns; up to 8 rows (4 without AVX-512's registers, except on the
// eight-column kernel) share every unpacked weight group, and more rows pass over cache-sized tiles of
// columns a group at a time. Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 take eight columns at a time
// instead, one per lane (dot_cols8), which makes the rows of a few-sequence decode step or of a verify
// step cheap: see there.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include "kernels.h"
#include "quant_dot_blocks.h"
#include "quant_pack.h"
#include <algorithm>
#include <cmath>
#include <cstring>
#include "vec_math.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

using namespace quant_dot;

// Quantized activation rows: q [M, K] int8, d [M, K/B] fp32 (one scale per B = 32 or 256 values, the weight
// block's size), bsums [M, K/16] int16 (the sum of every 16 quants).
struct Acts {
  const int8_t* q;
  const float* d;
  const int16_t* bs;
  int64_t k;
  const float* sa = nullptr;    // Q4_1, Q5_1: [M, K/32] d times the sum of the block's 32 quants (the minimum's factor)
  const int32_t* so = nullptr;  // Q4_0, Q5_0, Q8_0: [M, K/32] the sum of the block's 32 quants times the weights' offset
  const int16_t* b32 = nullptr;  // Q4_K, Q5_K on the eight-column kernel: [M, K/32] the sum of every 32 quants
};

#ifdef MBQ_AVX2
// ---- the integers of sub-block group j (32 values) of block b, straight into a register ----

inline __m256i nib32(const uint8_t* qs) {  // 16 bytes -> 32 bytes: low nibbles, then high
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m), _mm_and_si128(raw, m));
}

inline __m256i bits32(const uint8_t* qhp) {  // bit j of the 32-bit qh -> 0x10 in byte j
  uint32_t qh;
  std::memcpy(&qh, qhp, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), shuf);
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// acc + the sum of each 4 consecutive u8 x s8 products, in 8 int32 lanes: one VNNI instruction where the CPU
// has it (AVX-VNNI, or AVX-512 VNNI on 256-bit registers), else maddubs + madd (no overflow for |u| * 2 * 127
// within int16: the nibble types, or |u| <= 128)
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i x) {
#if defined(__AVXVNNI__) && !defined(MINIBATCH_NO_VNNI)
  return _mm256_dpbusd_avx_epi32(acc, u, x);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(MINIBATCH_NO_VNNI)
  return _mm256_dpbusd_epi32(acc, u, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}

inline __m256i dot4(__m256i u, __m256i x) { return dpbusd(_mm256_setzero_si256(), u, x); }

// acc + the int16 pairs p times the int16 scales sv, summed in pairs into int32: madd + add, or one VNNI word dot
inline __m256i word_dot(__m256i acc, __m256i p, __m256i sv) {
#if defined(__AVXVNNI__) && !defined(MINIBATCH_NO_VNNI)
  return _mm256_dpwssd_avx_epi32(acc, p, sv);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(MINIBATCH_NO_VNNI)
  return _mm256_dpwssd_epi32(acc, p, sv);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, sv));
#endif
}

// acc + the u8 x s8 pair sums times the int16 scales sv (per 16 values)
inline __m256i dot_scaled(__m256i acc, __m256i u, __m256i x, __m256i sv) {
  return word_dot(acc, _mm256_maddubs_epi16(u, x), sv);
}

inline int32_t reduce_add_epi32(__m256i v) {  // the sum of 8 int32 lanes
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

inline __m256i bits_at(__m256i v, int shift, int mask) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
}

template <int64_t T>
inline __m256i reg_u(const uint8_t* b, int j) {
  if constexpr (T == Q4_0) return _mm256_sub_epi8(nib32(b + 2), _mm256_set1_epi8(8));
  if constexpr (T == Q4_1) return nib32(b + 4);
  if constexpr (T == Q5_0) return _mm256_sub_epi8(_mm256_or_si256(nib32(b + 6), bits32(b + 2)), _mm256_set1_epi8(16));
  if constexpr (T == Q5_1) return _mm256_or_si256(nib32(b + 8), bits32(b + 4));
  if constexpr (T == Q8_0) return load256(b + 2);
  if constexpr (T == IQ4_NL || T == IQ4_XS) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
    return _mm256_shuffle_epi8(table, nib32(T == IQ4_NL ? b + 2 : b + 8 + 16 * j));
  }
  if constexpr (T == Q2_K) return bits_at(load256(b + 16 + 32 * (j / 4)), 2 * (j % 4), 3);
  if constexpr (T == Q3_K)
    return _mm256_or_si256(bits_at(load256(b + 32 + 32 * (j / 4)), 2 * (j % 4), 3), _mm256_slli_epi16(bits_at(load256(b), j, 1), 2));
  if constexpr (T == Q4_K || T == Q5_K) {
    __m256i u = bits_at(load256(b + (T == Q4_K ? 16 : 48) + 32 * (j / 2)), 4 * (j % 2), 0x0f);
    if constexpr (T == Q5_K) u = _mm256_or_si256(u, _mm256_slli_epi16(bits_at(load256(b + 16), j, 1), 4));
    return u;
  }
  if constexpr (T == Q6_K) {
    const int h = j / 4, t = j % 4;
    const __m256i lo = bits_at(load256(b + 64 * h + (t % 2) * 32), 4 * (t / 2), 0x0f);
    return _mm256_or_si256(lo, _mm256_slli_epi16(bits_at(load256(b + 128 + 32 * h), 2 * t, 3), 4));
  }
  return _mm256_setzero_si256();  // unreachable: every type above
}

// The last blocks of a 32-value row past the groups of four (one at a time, as blocks), then each row's
// four-lane accumulator summed into out[r * ldo].
template <int64_t T, int M>
inline void finish32(const Acts& a, const uint8_t* row, int64_t bi, int64_t nb, const __m128* acc, float* out,
                     int64_t ldo) {
  using Tr = Traits<T>;
  const int64_t n16 = a.k / 16;
  float tail[M];
  for (int r = 0; r < M; ++r) tail[r] = 0.0f;
  Block blk{};
  for (; bi < nb; ++bi) {
    const uint8_t* b = row + bi * Tr::BYTES;
    Tr::scales(b, blk);
    const __m256i u = reg_u<T>(b, 0);
    const __m256i au = Tr::SIGNED ? _mm256_sign_epi8(u, u) : u;
    for (int r = 0; r < M; ++r) {
      const __m256i x = load256(reinterpret_cast<const uint8_t*>(a.q + r * a.k + bi * 32));
      const __m256i s = dot4(au, Tr::SIGNED ? _mm256_sign_epi8(x, u) : x);
      const float da = a.d[r * nb + bi];
      tail[r] += blk.d * da * (float)reduce_add_epi32(s);
      if constexpr (Tr::FMIN) tail[r] += blk.m * da * (float)(a.bs[r * n16 + 2 * bi] + a.bs[r * n16 + 2 * bi + 1]);
    }
  }
  for (int r = 0; r < M; ++r) {
    __m128 h = _mm_add_ps(acc[r], _mm_movehl_ps(acc[r], acc[r]));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    out[r * ldo] = _mm_cvtss_f32(h) + tail[r];
  }
}

// 32-value types: four blocks at a time, so their four integer sums share one conversion and one
// multiply-add with the four blocks' weight and activation scales (and, for Q4_1/Q5_1, one more with
// their minimums and activation sums).
template <int64_t T, int M>
void dot_rows32(const Acts& a, const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  using Tr = Traits<T>;
  const int64_t nb = a.k / 32, n16 = a.k / 16;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m128 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm_setzero_ps();
    int64_t bi = 0;
    for (; bi + 4 <= nb; bi += 4) {
      __m256i u[4], au[4];
      alignas(16) float dw[4], mw[4];
      for (int q = 0; q < 4; ++q) {
        const uint8_t* b = row + (bi + q) * Tr::BYTES;
        u[q] = reg_u<T>(b, 0);
        au[q] = Tr::SIGNED ? _mm256_sign_epi8(u[q], u[q]) : u[q];
        dw[q] = f16(b);
        if constexpr (Tr::FMIN) mw[q] = f16(b + 2);
      }
      const __m128 dwv = _mm_load_ps(dw);
      for (int r = 0; r < M; ++r) {
        const int8_t* xr = a.q + r * a.k + bi * 32;
        __m256i s[4];
        for (int q = 0; q < 4; ++q) {
          const __m256i x = load256(reinterpret_cast<const uint8_t*>(xr + 32 * q));
          s[q] = dot4(au[q], Tr::SIGNED ? _mm256_sign_epi8(x, u[q]) : x);
        }
        // lane q of the 128-bit sum: block q's 32 products
        const __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
        const __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        const __m128 da = _mm_loadu_ps(a.d + r * nb + bi);
        acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(t4), _mm_mul_ps(dwv, da), acc[r]);
        if constexpr (Tr::FMIN) {  // + m * d_a * (the block's 32 activation quants summed)
          const __m128i bs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.bs + r * n16 + 2 * bi));
          const __m128 sums = _mm_cvtepi32_ps(_mm_madd_epi16(bs, _mm_set1_epi16(1)));
          acc[r] = _mm_fmadd_ps(_mm_mul_ps(sums, da), _mm_load_ps(mw), acc[r]);
        }
      }
    }
    finish32<T, M>(a, row, bi, nb, acc, out + n, ldo);
  }
}

// A 256-value block's integer sum s for one row, into the row's accumulator: its 16 sub-blocks' offsets
// (scale d) or minimums (scale dmin) from the activations' 16-value sums bs, then the block's two scales.
template <int64_t T>
inline __m256 block_done(__m256 acc, __m256i s, const Block& blk, float da, const int16_t* bs) {
  using Tr = Traits<T>;
  if constexpr (Tr::OFF || Tr::MIN) {
    const __m256i t = _mm256_madd_epi16(load256(reinterpret_cast<const uint8_t*>(Tr::OFF ? blk.off : blk.mn)),
                                        load256(reinterpret_cast<const uint8_t*>(bs)));
    if constexpr (Tr::OFF) s = _mm256_add_epi32(s, t);
    else acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(-blk.dmin * da), acc);
  }
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(blk.d * da), acc);
}

#ifdef MBQ_ZMM
// The 256-value types with unsigned integers on 512-bit registers: two 32-value groups (64 values, 4
// sub-block scales) per multiply-add, so a block takes half the instructions of the 256-bit loop below.
// The weights are unpacked as there (reg_u), two groups joined into one register; the scales of the four
// 16-value quarters are spread over it with one permute.
template <int64_t T, int M>
void dot_rows_zmm(const Acts& a, const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo, int64_t n0,
                  int64_t n1) {
  using Tr = Traits<T>;
  constexpr int P = Tr::ELEMS / 64;
  const int64_t nb = a.k / Tr::ELEMS, n16 = a.k / 16;
  alignas(64) static const int16_t quarter[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                  2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
  const __m512i base = _mm512_load_si512(quarter);
  Block blk{};
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t bi = 0; bi < nb; ++bi) {
      const uint8_t* b = row + bi * Tr::BYTES;
      Tr::scales(b, blk);
      const __m512i scv = _mm512_castsi256_si512(load256(reinterpret_cast<const uint8_t*>(blk.sc)));
      __m512i sumi[M];
      for (int r = 0; r < M; ++r) sumi[r] = _mm512_setzero_si512();
      for (int p = 0; p < P; ++p) {
        const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(reg_u<T>(b, 2 * p)), reg_u<T>(b, 2 * p + 1), 1);
        const __m512i sv = _mm512_permutexvar_epi16(_mm512_add_epi16(base, _mm512_set1_epi16((short)(4 * p))), scv);
        for (int r = 0; r < M; ++r) {
          const __m512i x = _mm512_loadu_si512(a.q + r * a.k + bi * Tr::ELEMS + 64 * p);
          sumi[r] = _mm512_dpwssd_epi32(sumi[r], _mm512_maddubs_epi16(u, x), sv);
        }
      }
      for (int r = 0; r < M; ++r) {
        const float da = a.d[r * nb + bi];
        const __m256i s = _mm256_add_epi32(_mm512_castsi512_si256(sumi[r]), _mm512_extracti64x4_epi64(sumi[r], 1));
        acc[r] = block_done<T>(acc[r], s, blk, da, a.bs + r * n16 + bi * (Tr::ELEMS / 16));
      }
    }
    for (int r = 0; r < M; ++r) out[r * ldo + n] = hsum(acc[r]);
  }
}
#endif

#ifdef MBQ_ZMM
// A signed 32-value type's integers as unsigned bytes, and the offset they carry: value = u - offset.
// Q4_0 and Q5_0 store them so (offset 8, 16); Q8_0's and IQ4_NL's signed values move up by 128. The offset times the
// block's activation sum comes off afterwards, in integers, so no instruction fixes signs per row.
template <int64_t T>
constexpr int kOffset32 = T == Q4_0 ? 8 : T == Q5_0 ? 16 : 128;  // Q8_0, IQ4_NL: 128

template <int64_t T>
inline __m256i reg_u32(const uint8_t* b) {
  if constexpr (T == Q4_0) return nib32(b + 2);
  if constexpr (T == Q5_0) return _mm256_or_si256(nib32(b + 6), bits32(b + 2));
  if constexpr (T == Q8_0) return _mm256_xor_si256(load256(b + 2), _mm256_set1_epi8((char)0x80));
  if constexpr (T == IQ4_NL) {
    const __m128i t = _mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4Values)), _mm_set1_epi8((char)0x80));
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(t), nib32(b + 2));
  }
  return _mm256_setzero_si256();  // unreachable: every signed 32-value type above
}

// The 32-value types on 512-bit registers: two blocks per register and one VNNI multiply-add (u8 x s8,
// four products into each int32 lane) per two blocks and row; four blocks' sums then share one conversion
// and multiply-add with their scales, as in the 256-bit loop; finish32 runs the last blocks.
template <int64_t T, int M>
void dot_rows32_zmm(const Acts& a, const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo, int64_t n0,
                    int64_t n1) {
  using Tr = Traits<T>;
  static_assert(Tr::SIGNED && !Tr::FMIN, "the unsigned 32-value types stay on the 256-bit loop");
  constexpr int kShift = kOffset32<T> == 8 ? 3 : kOffset32<T> == 16 ? 4 : 7;  // the offset is 2^kShift
  const int64_t nb = a.k / 32, n16 = a.k / 16;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m128 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm_setzero_ps();
    int64_t bi = 0;
    for (; bi + 4 <= nb; bi += 4) {
      const uint8_t* b = row + bi * Tr::BYTES;
      const __m512i u01 = _mm512_inserti64x4(_mm512_castsi256_si512(reg_u32<T>(b)), reg_u32<T>(b + Tr::BYTES), 1);
      const __m512i u23 =
          _mm512_inserti64x4(_mm512_castsi256_si512(reg_u32<T>(b + 2 * Tr::BYTES)), reg_u32<T>(b + 3 * Tr::BYTES), 1);
      alignas(16) float dw[4];
      for (int q = 0; q < 4; ++q) dw[q] = f16(b + q * Tr::BYTES);
      const __m128 dwv = _mm_load_ps(dw);
      for (int r = 0; r < M; ++r) {
        const int8_t* xr = a.q + r * a.k + bi * 32;
        const __m512i s01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u01, _mm512_loadu_si512(xr));
        const __m512i s23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u23, _mm512_loadu_si512(xr + 64));
        // lane q of the 128-bit sum: block q's 32 products
        const __m256i t = _mm256_hadd_epi32(
            _mm256_hadd_epi32(_mm512_castsi512_si256(s01), _mm512_extracti64x4_epi64(s01, 1)),
            _mm256_hadd_epi32(_mm512_castsi512_si256(s23), _mm512_extracti64x4_epi64(s23, 1)));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        const __m128 da = _mm_loadu_ps(a.d + r * nb + bi);
        // minus the offset times each block's 32 activation quants summed (from the 16-value sums)
        const __m128i bs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.bs + r * n16 + 2 * bi));
        t4 = _mm_sub_epi32(t4, _mm_slli_epi32(_mm_madd_epi16(bs, _mm_set1_epi16(1)), kShift));
        acc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(t4), _mm_mul_ps(dwv, da), acc[r]);
      }
    }
    finish32<T, M>(a, row, bi, nb, acc, out + n, ldo);
  }
}
#endif

// Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 eight columns at a time: the lanes of a register are eight weight rows
// (output columns), not eight stretches of one row, so no row's block sum needs a horizontal reduction. The
// eight rows were packed at load (Rows8, pack_rows8): a block's registers of four weights per row and lane
// are loaded whole (a nibble type's four give eight, the 5-bit types' fifth bits ORed in with a shift each,
// Q8_0's eight), and one VNNI multiply-add per register takes four activations of a row broadcast to every
// lane: 8 per row and block for 256 products, where the 32-value loop above spends 4 and a three-step
// reduction for 32 products of one column. Without VNNI the nibble types' maddubs sums add in int16 before
// one madd (pair_sums16) and Q8_0 multiplies magnitudes by signed activations (signed_sums). The eight
// columns' scales are one load, so a row's block then costs a conversion and two or three multiply-adds.
// The signed types' weights go in as unsigned bytes (Q4_0's and Q5_0's values as they are, offsets 8 and
// 16; Q8_0's, with VNNI, moved up by 128) and their offset times the activations' block sum comes off in
// integers, as on the 512-bit loop. Integer sums are exact whatever their order, and a row is computed alike
// whatever M is, so its result does not depend on the rows beside it; the float epilogue is the same on
// every build. The nibble types' lanes hold the columns in the order 0 2 4 6 1 3 5 7; the store puts them
// back.
inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline int16_t load_i16(const void* p) {
  int16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

#if !defined(MINIBATCH_NO_VNNI) && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif
template <int64_t T>
constexpr bool kColumns8 = T == Q4_0 || T == Q4_1 || T == Q5_0 || T == Q5_1 || T == Q8_0;

// Without VNNI a multiply-add of bytes is maddubs (pairs into int16) and madd (pairs of those into int32),
// both on the multiplier ports. The nibble types' products are small enough to add G maddubs results in
// int16 first, exactly: |u| <= 15 (Q4_0, Q4_1) gives pair sums within 2 * 15 * 127 = 3,810, eight of them
// 30,480; the 5-bit types' |u| <= 31 gives 7,874, four of them 31,496 (activations are within +-127). So a
// block's eight multiply-adds per row take 9 or 10 multiplier instructions instead of 16, and the sums are
// the same integers as VNNI's.
template <int64_t T>
constexpr int kSums16 = (T == Q5_0 || T == Q5_1) ? 4 : 8;

template <int G>
inline __m256i pair_sums16(const __m256i* u, const int8_t* x) {
  __m256i s = _mm256_setzero_si256();
  for (int g = 0; g < 8; g += G) {
    __m256i p = _mm256_maddubs_epi16(u[g], _mm256_set1_epi32(load_i32(x + 4 * g)));
    for (int t = g + 1; t < g + G; ++t)
      p = _mm256_add_epi16(p, _mm256_maddubs_epi16(u[t], _mm256_set1_epi32(load_i32(x + 4 * t))));
    s = _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  }
  return s;
}

// Q8_0 without VNNI: its bytes reach -128..127, past what maddubs takes unsigned, so each multiply-add
// is of the weights' magnitudes u and the activations with the weights' signs (sign_epi8 with the weights
// from memory): pair sums within 2 * 128 * 127 = 32,512, one madd each. 5 instructions per 32 products
// and row, against the 7-8 of the 32-value loop's sign fixes and horizontal sums.
inline __m256i signed_sums(const __m256i* u, const int8_t* signs, const int8_t* x) {
  __m256i s = _mm256_setzero_si256();
  for (int t = 0; t < 8; ++t) {
    const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(load_i32(x + 4 * t)),
                                        load256(reinterpret_cast<const uint8_t*>(signs + 32 * t)));
    s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(u[t], xs), _mm256_set1_epi16(1)));
  }
  return s;
}

// How far ahead in a packed run its lines are asked for: 1-4 KB measured 10-20% faster than none at 1-16 rows
// on an AVX2-only EPYC (a block's turn is too short for the hardware prefetcher to keep ahead of it).
constexpr int64_t kAhead = 2048;
// w: the matrix with its whole groups of eight rows packed (Rows8); n0 and n1 - n0 are multiples of 8.
template <int64_t T, int M>
void dot_cols8(const Acts& a, const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  using Tr = Traits<T>;
  using L = Rows8<T>;
  constexpr int CH = M <= 4 ? 2 : 1;  // integer chains per row: a lone row's eight multiply-adds in two
  const int64_t nb = a.k / 32;
  const __m256i lo = _mm256_set1_epi8(0x0f), sixteen = _mm256_set1_epi8(0x10);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the nibble types' lanes back in row order
  for (int64_t n = n0; n < n1; n += 8) {
    const uint8_t* g = w + n * row_bytes;  // the eight rows' packed run
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t bi = 0; bi < nb; ++bi) {
      const uint8_t* p = g + bi * 8 * Tr::BYTES;
      for (int64_t l = 0; l < 8 * Tr::BYTES; l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kAhead + l), _MM_HINT_T0);
      __m256i u[8];  // u[t]: weights 4t..4t+3 of the block, one row a lane
      if constexpr (L::NIB) {
        for (int t = 0; t < 4; ++t) {
          const __m256i z = load256(p + L::Q + 32 * t);
          u[t] = _mm256_and_si256(z, lo);
          u[t + 4] = _mm256_and_si256(_mm256_srli_epi16(z, 4), lo);
        }
        if constexpr (L::FIFTH) {  // bit t of each byte to bit 4 (16-bit shifts: no other bit reaches it)
          const __m256i f = load256(p + L::F);
          for (int t = 0; t < 8; ++t) {
            const __m256i at4 = t <= 4 ? _mm256_slli_epi16(f, 4 - t) : _mm256_srli_epi16(f, t - 4);
            u[t] = _mm256_or_si256(u[t], _mm256_and_si256(at4, sixteen));
          }
        }
      } else {
        for (int t = 0; t < 8; ++t) u[t] = load256(p + L::Q + 32 * t);
        if constexpr (kVnni) {  // moved up by 128 (its block sum times 128 comes off below)
          for (int t = 0; t < 8; ++t) u[t] = _mm256_xor_si256(u[t], _mm256_set1_epi8((char)0x80));
        } else {  // the magnitudes multiplied, the signs (the stored bytes) given to each row's activations
          for (int t = 0; t < 8; ++t) u[t] = _mm256_abs_epi8(u[t]);
        }
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + L::D)));
      __m256 mw = _mm256_setzero_ps();
      if constexpr (Tr::FMIN) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + L::M)));
      for (int r = 0; r < M; ++r) {
        const int8_t* x = a.q + r * a.k + bi * 32;
        __m256i sum[CH];
        if constexpr (kVnni) {
          for (int q = 0; q < CH; ++q) sum[q] = _mm256_setzero_si256();
          for (int t = 0; t < 8; ++t) sum[t % CH] = dpbusd(sum[t % CH], u[t], _mm256_set1_epi32(load_i32(x + 4 * t)));
          if constexpr (CH == 2) sum[0] = _mm256_add_epi32(sum[0], sum[1]);
        } else if constexpr (L::NIB) {
          sum[0] = pair_sums16<kSums16<T>>(u, x);
        } else {
          sum[0] = signed_sums(u, reinterpret_cast<const int8_t*>(p + L::Q), x);
        }
        if constexpr (!Tr::FMIN && (L::NIB || kVnni))
          sum[0] = _mm256_sub_epi32(sum[0], _mm256_set1_epi32(a.so[r * nb + bi]));
        const float da = a.d[r * nb + bi];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[0]), _mm256_mul_ps(dw, _mm256_set1_ps(da)), acc[r]);
        if constexpr (Tr::FMIN) acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.sa[r * nb + bi]), acc[r]);
      }
    }
    for (int r = 0; r < M; ++r)
      _mm256_storeu_ps(out + r * ldo + n, L::NIB ? _mm256_permutevar8x32_ps(acc[r], order) : acc[r]);
  }
}

#ifdef MBQ_ZMM
// Sixteen columns at a time on 512-bit registers: two packed groups of eight (Rows8, as dot_cols8 reads them)
// joined into one register, lanes 0-7 the first group's and 8-15 the second's, so each VNNI multiply-add
// takes 64 products of a row where dot_cols8's takes 32, and a row's epilogue (offset, conversion, scales)
// serves sixteen columns. Nothing is repacked: the two halves are loaded where the eight-column kernel loads
// them. Every lane runs the very operations of dot_cols8 in the same order (exact integer sums, then the
// same float multiply and multiply-adds), so a column's bits are the same whichever of the two computes it.
// n0 and n1 - n0 are multiples of 16.
template <int64_t T, int M>
void dot_cols16(const Acts& a, const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  using Tr = Traits<T>;
  using L = Rows8<T>;
  constexpr int CH = M <= 4 ? 2 : 1;  // integer chains per row, as in dot_cols8
  const int64_t nb = a.k / 32, half = 8 * row_bytes;
  const __m512i lo = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(0x10);
  // the nibble types' lanes back in row order, in each half
  const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
  auto join = [](const uint8_t* p0, const uint8_t* p1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(load256(p0)), load256(p1), 1);
  };
  auto halves = [](const uint8_t* p0, const uint8_t* p1) {  // sixteen fp16 values, eight from each group
    return _mm512_cvtph_ps(_mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)),
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))));
  };
  for (int64_t n = n0; n < n1; n += 16) {
    const uint8_t* g = w + n * row_bytes;  // the first group's packed run; the second's is `half` bytes on
    __m512 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t bi = 0; bi < nb; ++bi) {
      const uint8_t* p = g + bi * 8 * Tr::BYTES;
      const uint8_t* q = p + half;
      for (int64_t l = 0; l < 8 * Tr::BYTES; l += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(p + kAhead + l), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(q + kAhead + l), _MM_HINT_T0);
      }
      __m512i u[8];  // u[t]: weights 4t..4t+3 of the block, one column a lane
      if constexpr (L::NIB) {
        for (int t = 0; t < 4; ++t) {
          const __m512i z = join(p + L::Q + 32 * t, q + L::Q + 32 * t);
          u[t] = _mm512_and_si512(z, lo);
          u[t + 4] = _mm512_and_si512(_mm512_srli_epi16(z, 4), lo);
        }
        if constexpr (L::FIFTH) {
          const __m512i f = join(p + L::F, q + L::F);
          for (int t = 0; t < 8; ++t) {
            const __m512i at4 = t <= 4 ? _mm512_slli_epi16(f, 4 - t) : _mm512_srli_epi16(f, t - 4);
            u[t] = _mm512_or_si512(u[t], _mm512_and_si512(at4, sixteen));
          }
        }
      } else {  // Q8_0 moved up by 128 (its block sum times 128 comes off below)
        for (int t = 0; t < 8; ++t)
          u[t] = _mm512_xor_si512(join(p + L::Q + 32 * t, q + L::Q + 32 * t), _mm512_set1_epi8((char)0x80));
      }
      const __m512 dw = halves(p + L::D, q + L::D);
      __m512 mw = _mm512_setzero_ps();
      if constexpr (Tr::FMIN) mw = halves(p + L::M, q + L::M);
#pragma GCC unroll 16  // the rows' accumulators in registers, not in memory (1.1-1.25x at 8-512 rows)
      for (int r = 0; r < M; ++r) {
        const int8_t* x = a.q + r * a.k + bi * 32;
        __m512i sum[CH];
        for (int c = 0; c < CH; ++c) sum[c] = _mm512_setzero_si512();
        for (int t = 0; t < 8; ++t) sum[t % CH] = _mm512_dpbusd_epi32(sum[t % CH], u[t], _mm512_set1_epi32(load_i32(x + 4 * t)));
        if constexpr (CH == 2) sum[0] = _mm512_add_epi32(sum[0], sum[1]);
        if constexpr (!Tr::FMIN) sum[0] = _mm512_sub_epi32(sum[0], _mm512_set1_epi32(a.so[r * nb + bi]));
        const float da = a.d[r * nb + bi];
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[0]), _mm512_mul_ps(dw, _mm512_set1_ps(da)), acc[r]);
        if constexpr (Tr::FMIN) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.sa[r * nb + bi]), acc[r]);
      }
    }
    for (int r = 0; r < M; ++r)
      _mm512_storeu_ps(out + r * ldo + n, L::NIB ? _mm512_permutexvar_ps(order, acc[r]) : acc[r]);
  }
}
#endif

// Whole groups of sixteen columns on dot_cols16 (AVX-512 builds), of eight on dot_cols8, the rest (a matrix's
// last few) on the loops above them.
// Tiles and chunks start at multiples of 16, so which columns take which loop does not depend on M.
template <int64_t T, int M>
void columns8(const Acts& a, const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo, int64_t n0,
              int64_t n1) {
  const int64_t n8 = n0 + (n1 - n0) / 8 * 8;
#ifdef MBQ_ZMM
  // from 8 rows: below, where the weights' reading bounds the loop, its two streams took 1.1-1.4x the time of
  // the eight-column loop's one at 4 rows (weights from memory, Ice Lake Xeon); the same bits either way
  const int64_t n16 = M >= 8 ? n0 + (n1 - n0) / 16 * 16 : n0;
  dot_cols16<T, M>(a, w, row_bytes, out, ldo, n0, n16);
  dot_cols8<T, M>(a, w, row_bytes, out, ldo, n16, n8);
#else
  dot_cols8<T, M>(a, w, row_bytes, out, ldo, n0, n8);
#endif
  if (n8 >= n1) return;
#ifdef MBQ_ZMM
  if constexpr (Traits<T>::SIGNED) return dot_rows32_zmm<T, M>(a, w, row_bytes, out, ldo, n8, n1);
#endif
  dot_rows32<T, M>(a, w, row_bytes, out, ldo, n8, n1);
}

// The 256-value types' columns [n0, n1) for M rows, one column at a time: each 32-value group is unpacked once
// and multiplied into every row; a block's products add up in int32 before its float scales.
template <int64_t T, int M>
void dot_rows256(const Acts& a, const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  using Tr = Traits<T>;
  constexpr int G = Tr::ELEMS / 32;
  const int64_t nb = a.k / Tr::ELEMS, nd = a.k / Tr::ELEMS, n16 = a.k / 16;
  Block blk{};  // sub-block fields a type does not use stay zero
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t bi = 0; bi < nb; ++bi) {
      const uint8_t* b = row + bi * Tr::BYTES;
      Tr::scales(b, blk);
      __m256i sumi[M];
      for (int r = 0; r < M; ++r) sumi[r] = _mm256_setzero_si256();
      for (int j = 0; j < G; ++j) {
        const __m256i u = reg_u<T>(b, j);
        const __m256i au = Tr::SIGNED ? _mm256_sign_epi8(u, u) : u;
        const __m256i sv = _mm256_set_m128i(_mm_set1_epi16(blk.sc[2 * j + 1]), _mm_set1_epi16(blk.sc[2 * j]));
        for (int r = 0; r < M; ++r) {
          const __m256i x = load256(reinterpret_cast<const uint8_t*>(a.q + r * a.k + bi * Tr::ELEMS + 32 * j));
          sumi[r] = dot_scaled(sumi[r], au, Tr::SIGNED ? _mm256_sign_epi8(x, u) : x, sv);
        }
      }
      for (int r = 0; r < M; ++r) {
        const float da = a.d[r * nd + bi];
        acc[r] = block_done<T>(acc[r], sumi[r], blk, da, a.bs + r * n16 + bi * (Tr::ELEMS / 16));
      }
    }
    for (int r = 0; r < M; ++r) out[r * ldo + n] = hsum(acc[r]);
  }
}

// Q4_K and Q5_K eight columns at a time, as the 32-value types above (their rows packed by Rows8K): for each of
// a block's eight 32-value groups, its eight registers of four weights per row and lane are unpacked once for
// every row, each row's eight maddubs add up in int16 (Q4_K's 15 * 127 * 2 * 8 = 30,480; Q5_K's four at a
// time) and one madd applies the eight columns' 6-bit group scales, spread from the three scale words with a
// shuffle a group. A row's groups add up in int32 in memory (the registers hold the weights); the minimums
// come off with four madds of the columns' 6-bit minimums and the row's 32-value sums, and the block's d and
// dmin then take two float multiply-adds. Exact integers in a fixed order: a row's bits do not depend on M.
// Which types take it: kColumns8K (quant_dot_blocks.h, the packing's owner too).

template <int64_t T, int M>
void dot_cols8k(const Acts& a, const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  using L = Rows8K<T>;
  constexpr int64_t B = Traits<T>::BYTES;
  constexpr int G = L::FIFTH ? 4 : 8;  // maddubs results added in int16 before one madd
  const int64_t nb = a.k / 256;
  const __m256i lo = _mm256_set1_epi8(0x0f), sixteen = _mm256_set1_epi8(0x10);
  const __m256i low6 = _mm256_set1_epi32(0x3f3f3f3f), low4 = _mm256_set1_epi32(0x0f0f0f0f),
                two = _mm256_set1_epi32(0x03030303);
  // byte jj of every dword as both int16 of the dword (a group's scale for madd), and bytes 2i, 2i + 1 as its
  // two int16 (two groups' minimums)
  __m256i spread[4], pairs[2];
  for (int jj = 0; jj < 4; ++jj) spread[jj] = _mm256_set1_epi32((int)(0x80008000u | (uint32_t)jj | ((uint32_t)jj << 16)));
  for (int i = 0; i < 2; ++i) pairs[i] = _mm256_set1_epi32((int)(0x80008000u | (uint32_t)(2 * i) | ((uint32_t)(2 * i + 1) << 16)));
  const __m256i dword_base = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4,
                                              8, 8, 8, 8, 12, 12, 12, 12);
  for (int jj = 0; jj < 4; ++jj) spread[jj] = _mm256_or_si256(spread[jj], dword_base);  // 0x80 | base stays zeroing
  for (int i = 0; i < 2; ++i) pairs[i] = _mm256_or_si256(pairs[i], dword_base);
  for (int64_t n = n0; n < n1; n += 8) {
    const uint8_t* g = w + n * row_bytes;
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t bi = 0; bi < nb; ++bi) {
      const uint8_t* p = g + bi * 8 * B;
      for (int64_t l = 0; l < 8 * B; l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kAhead + l), _MM_HINT_T0);
      const __m256i w0 = load256(p + L::SC), w1 = load256(p + L::SC + 32), w2 = load256(p + L::SC + 64);
      const __m256i sc[2] = {_mm256_and_si256(w0, low6),
                             _mm256_or_si256(_mm256_and_si256(w2, low4),
                                             _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w0, 6), two), 4))};
      const __m256i mn[2] = {_mm256_and_si256(w1, low6),
                             _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2, 4), low4),
                                             _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w1, 6), two), 4))};
      alignas(32) int32_t sums[M][8];
      for (int r = 0; r < M; ++r) _mm256_store_si256(reinterpret_cast<__m256i*>(sums[r]), _mm256_setzero_si256());
      for (int j = 0; j < 8; ++j) {
        __m256i u[8];  // group j's weights 4t..4t+3 of each row, a lane each
        for (int t = 0; t < 8; ++t) {
          const __m256i z = load256(p + L::Q + 256 * (j / 2) + 32 * t);
          u[t] = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(z, 4) : z, lo);
          if constexpr (L::FIFTH) {  // bit j of qh bytes 4t.. to bit 4 (16-bit shifts: no other bit reaches it)
            const __m256i f = load256(p + L::QH + 32 * t);
            const __m256i at4 = j <= 4 ? _mm256_slli_epi16(f, 4 - j) : _mm256_srli_epi16(f, j - 4);
            u[t] = _mm256_or_si256(u[t], _mm256_and_si256(at4, sixteen));
          }
        }
        const __m256i sv = _mm256_shuffle_epi8(sc[j / 4], spread[j % 4]);
        for (int r = 0; r < M; ++r) {
          const int8_t* x = a.q + r * a.k + bi * 256 + 32 * j;
          __m256i s = _mm256_load_si256(reinterpret_cast<const __m256i*>(sums[r]));
          for (int t0 = 0; t0 < 8; t0 += G) {
            __m256i p16 = _mm256_maddubs_epi16(u[t0], _mm256_set1_epi32(load_i32(x + 4 * t0)));
            for (int t = t0 + 1; t < t0 + G; ++t)
              p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(u[t], _mm256_set1_epi32(load_i32(x + 4 * t))));
            s = word_dot(s, p16, sv);
          }
          _mm256_store_si256(reinterpret_cast<__m256i*>(sums[r]), s);
        }
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + L::D)));
      const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + L::DMIN)));
      const __m256i mp[4] = {_mm256_shuffle_epi8(mn[0], pairs[0]), _mm256_shuffle_epi8(mn[0], pairs[1]),
                             _mm256_shuffle_epi8(mn[1], pairs[0]), _mm256_shuffle_epi8(mn[1], pairs[1])};
      for (int r = 0; r < M; ++r) {
        const int16_t* b32 = a.b32 + (r * nb + bi) * 8;  // the row's eight 32-value sums
        __m256i mins = _mm256_madd_epi16(mp[0], _mm256_set1_epi32(load_i32(b32)));
        for (int i = 1; i < 4; ++i) mins = _mm256_add_epi32(mins, _mm256_madd_epi16(mp[i], _mm256_set1_epi32(load_i32(b32 + 2 * i))));
        const __m256 da = _mm256_set1_ps(a.d[r * nb + bi]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), dm), da), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(sums[r]))),
                                 _mm256_mul_ps(dw, da), acc[r]);
      }
    }
    for (int r = 0; r < M; ++r) _mm256_storeu_ps(out + r * ldo + n, acc[r]);
  }
}
// Q6_K eight columns at a time (rows packed by Rows8K): a group's eight registers of four 6-bit weights per row
// and lane from ql's nibbles and qh's bit pairs, unpacked once for every row; each row's maddubs add up two at a
// time in int16 (2 * 63 * 127 * 2 = 32,004) before a madd with the columns' signed 16-value scales (four a
// group). The offset 32 comes off in integers: eight madds of the scales and the row's 16-value sums, times 32.
template <int64_t T, int M>
void dot_cols8q6(const Acts& a, const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  using L = Rows8K<T>;
  constexpr int64_t B = Traits<T>::BYTES;
  const int64_t nb = a.k / 256, n16 = a.k / 16;
  const __m256i lo = _mm256_set1_epi8(0x0f), hi2 = _mm256_set1_epi8(0x30);
  const __m256i dword_base = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4,
                                              8, 8, 8, 8, 12, 12, 12, 12);
  // byte kk of every dword into the high byte of both its int16 (then shifted down with its sign): a scale for
  // madd; bytes 2i and 2i + 1 into the high bytes of its two int16: two scales
  __m256i spread[4], pairs[2];
  for (int kk = 0; kk < 4; ++kk)
    spread[kk] = _mm256_or_si256(_mm256_set1_epi32((int)(0x00800080u | ((uint32_t)kk << 8) | ((uint32_t)kk << 24))), dword_base);
  for (int i = 0; i < 2; ++i)
    pairs[i] = _mm256_or_si256(_mm256_set1_epi32((int)(0x00800080u | ((uint32_t)(2 * i) << 8) | ((uint32_t)(2 * i + 1) << 24))),
                               dword_base);
  for (int64_t n = n0; n < n1; n += 8) {
    const uint8_t* g = w + n * row_bytes;
    __m256 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t bi = 0; bi < nb; ++bi) {
      const uint8_t* p = g + bi * 8 * B;
      for (int64_t l = 0; l < 8 * B; l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kAhead + l), _MM_HINT_T0);
      alignas(32) int32_t sums[M][8];
      for (int r = 0; r < M; ++r) _mm256_store_si256(reinterpret_cast<__m256i*>(sums[r]), _mm256_setzero_si256());
      for (int j = 0; j < 8; ++j) {
        const int h = j / 4, t = j % 4;
        __m256i u[8];  // group j's weights 4s..4s+3 of each row, a lane each
        for (int s = 0; s < 8; ++s) {
          const __m256i zl = load256(p + L::Q + 32 * (16 * h + 8 * (t % 2) + s));
          const __m256i zh = load256(p + L::QH + 32 * (8 * h + s));
          const __m256i low = _mm256_and_si256(t < 2 ? zl : _mm256_srli_epi16(zl, 4), lo);
          // bits 2t, 2t + 1 to bits 4, 5 (16-bit shifts: no other bit reaches them)
          const __m256i high = t < 3 ? _mm256_slli_epi16(zh, 4 - 2 * t) : _mm256_srli_epi16(zh, 2);
          u[s] = _mm256_or_si256(low, _mm256_and_si256(high, hi2));
        }
        const __m256i sc = load256(p + L::SC + 32 * (j / 2));  // scales 4(j/2).. of each row: 2j and 2j + 1 here
        const __m256i sv0 = _mm256_srai_epi16(_mm256_shuffle_epi8(sc, spread[(2 * j) % 4]), 8);
        const __m256i sv1 = _mm256_srai_epi16(_mm256_shuffle_epi8(sc, spread[(2 * j + 1) % 4]), 8);
        for (int r = 0; r < M; ++r) {
          const int8_t* x = a.q + r * a.k + bi * 256 + 32 * j;
          __m256i s = _mm256_load_si256(reinterpret_cast<const __m256i*>(sums[r]));
          for (int q = 0; q < 8; q += 2) {
            const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(u[q], _mm256_set1_epi32(load_i32(x + 4 * q))),
                                                 _mm256_maddubs_epi16(u[q + 1], _mm256_set1_epi32(load_i32(x + 4 * q + 4))));
            s = word_dot(s, p16, q < 4 ? sv0 : sv1);
          }
          _mm256_store_si256(reinterpret_cast<__m256i*>(sums[r]), s);
        }
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + L::D)));
      __m256i sp[8];  // scales 2i and 2i + 1 of each row, as int16
      for (int i = 0; i < 8; ++i)
        sp[i] = _mm256_srai_epi16(_mm256_shuffle_epi8(load256(p + L::SC + 32 * (i / 2)), pairs[i % 2]), 8);
      for (int r = 0; r < M; ++r) {
        const int16_t* bs = a.bs + r * n16 + bi * 16;  // the row's sixteen 16-value sums
        __m256i off = _mm256_madd_epi16(sp[0], _mm256_set1_epi32(load_i32(bs)));
        for (int i = 1; i < 8; ++i) off = _mm256_add_epi32(off, _mm256_madd_epi16(sp[i], _mm256_set1_epi32(load_i32(bs + 2 * i))));
        const __m256i s = _mm256_sub_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(sums[r])), _mm256_slli_epi32(off, 5));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[r * nb + bi])), acc[r]);
      }
    }
    for (int r = 0; r < M; ++r) _mm256_storeu_ps(out + r * ldo + n, acc[r]);
  }
}

// Columns [n0, n1) of out[r, :] for M rows. Each weight group is unpacked once and multiplied into every
// row; the integer products of a whole block add up in int32 before one float scale per block and row.
template <int64_t T, int M>
void dot_rows(const Acts& a, const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  using Tr = Traits<T>;
  if constexpr (Tr::ELEMS == 32) {
#ifdef MBQ_ZMM
    // the eight-column kernel first; the other signed types (IQ4_NL) lose their per-row sign fixes on the
    // 512-bit loop (measured 4-12% faster at 1-512 rows)
    if constexpr (kColumns8<T>) columns8<T, M>(a, w, row_bytes, out, ldo, n0, n1);
    else if constexpr (Tr::SIGNED) dot_rows32_zmm<T, M>(a, w, row_bytes, out, ldo, n0, n1);
    else dot_rows32<T, M>(a, w, row_bytes, out, ldo, n0, n1);
#else
    if constexpr (kColumns8<T>) columns8<T, M>(a, w, row_bytes, out, ldo, n0, n1);
    else dot_rows32<T, M>(a, w, row_bytes, out, ldo, n0, n1);
#endif
  } else if constexpr (kColumns8K<T>) {  // whole groups of eight columns, then the last few one at a time
    const int64_t n8 = n0 + (n1 - n0) / 8 * 8;
    if constexpr (T == Q6_K) dot_cols8q6<T, M>(a, w, row_bytes, out, ldo, n0, n8);
    else dot_cols8k<T, M>(a, w, row_bytes, out, ldo, n0, n8);
    if (n8 < n1) dot_rows256<T, M>(a, w, row_bytes, out, ldo, n8, n1);
#ifdef MBQ_ZMM
  } else if constexpr (!Tr::SIGNED && T != Q3_K) {  // Q3_K measured 2.6x slower at 1 row on it: not used
    dot_rows_zmm<T, M>(a, w, row_bytes, out, ldo, n0, n1);
#endif
  } else {
    dot_rows256<T, M>(a, w, row_bytes, out, ldo, n0, n1);
  }
}
#else
template <int64_t T, int M>
void dot_rows(const Acts& a, const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo, int64_t n0, int64_t n1) {
  using Tr = Traits<T>;
  const int64_t nb = a.k / Tr::ELEMS, nd = a.k / Tr::ELEMS, n16 = a.k / 16;
  Block blk{};  // sub-block fields a type does not use stay zero
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float acc[M];
    for (int r = 0; r < M; ++r) acc[r] = 0.0f;
    for (int64_t bi = 0; bi < nb; ++bi) {
      const uint8_t* b = row + bi * Tr::BYTES;
      Tr::scales(b, blk);
      Tr::unpack(b, blk);
      for (int r = 0; r < M; ++r) {
        const int8_t* x = a.q + r * a.k + bi * Tr::ELEMS;
        const int16_t* bs = a.bs + r * n16 + bi * (Tr::ELEMS / 16);
        int64_t sumi = 0, mins = 0;
        for (int k = 0; k < Tr::ELEMS / 16; ++k) {
          int32_t dot = 0;
          for (int i = 16 * k; i < 16 * k + 16; ++i) dot += (int32_t)blk.u[i] * (int32_t)x[i];
          sumi += (int64_t)blk.sc[k] * dot + (int64_t)blk.off[k] * bs[k];
          mins += (int64_t)blk.mn[k] * bs[k];
        }
        const float da = a.d[r * nd + bi];
        acc[r] += blk.d * da * (float)sumi - blk.dmin * da * (float)mins;
        if (Tr::FMIN) acc[r] += blk.m * da * (float)(bs[0] + bs[1]);
      }
    }
    for (int r = 0; r < M; ++r) out[r * ldo + n] = acc[r];
  }
}
#endif

// Rows of the integer path computed together: each unpacked weight group serves all of them, their
// accumulators in registers as far as they go and in memory past that (a load and a store per block and
// row beside the ~30 instructions of its multiply-adds). More rows run in groups of nearly equal size over
// each tile of columns, so the tile's weights come from cache. 8 rows on AVX-512's 32 vector registers:
// measured 15-35% faster than 4 (scripts/bench_quant_matmul.py, 16 and 64 rows). On AVX2's 16, on an
// AVX2-only EPYC (2 cores, [4864 x 896] and [896 x 4864], 8-64 rows, interleaved with the 4-row build),
// 8 rows: 7-11% for Q8_0, 8-20% IQ4_NL, 25-50% Q3_K and IQ4_XS, 4-9% Q2_K. The eight-column kernels' types
// with their int16 sums take 16 (1.1-1.25x the 4-row build from 9 to 512 rows in a quiet run, 1.3-1.6x in a
// run beside other work; 16 rows against 8: Q5_0 40 against 47 us a row), Q4_K, Q5_K and Q6_K among them.
// On AVX-512 VNNI builds the column kernels' types take 16 too (Q8_0 6-21% faster than 8 at 17-512 rows on
// an Ice Lake Xeon, the others within that run's noise).
#if defined(MBQ_AVX2) && (defined(MBQ_ZMM) || !defined(__AVX512VL__))
template <int64_t T>
constexpr int64_t kRows = kColumns8<T> || kColumns8K<T> ? 16 : 8;
#else
template <int64_t T>
constexpr int64_t kRows = 8;
#endif
// m rows (at most kRows<T>) on the loop instantiated for exactly that many.
template <int64_t T, int M>
void dot_columns_upto(const Acts& a, int64_t m, const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo,
                      int64_t n0, int64_t n1) {
  if constexpr (M > 1) {
    if (m < M) return dot_columns_upto<T, M - 1>(a, m, w, row_bytes, out, ldo, n0, n1);
  }
  dot_rows<T, M>(a, w, row_bytes, out, ldo, n0, n1);
}

template <int64_t T>
void dot_columns(const Acts& a, int64_t m, const uint8_t* w, int64_t row_bytes, float* out, int64_t ldo, int64_t n0,
                 int64_t n1) {
  dot_columns_upto<T, kRows<T>>(a, m, w, row_bytes, out, ldo, n0, n1);
}

using ColumnsFn = void (*)(const Acts&, int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t, int64_t);

struct TypeInfo {
  ColumnsFn fn;
  int64_t elems, bytes;
  int64_t rows;  // rows computed together (kRows)
};

template <int64_t T>
constexpr TypeInfo info() { return {dot_columns<T>, Traits<T>::ELEMS, Traits<T>::BYTES, kRows<T>}; }

TypeInfo type_info(int64_t type) {
  switch (type) {
    case Q4_0: return info<Q4_0>();
    case Q4_1: return info<Q4_1>();
    case Q5_0: return info<Q5_0>();
    case Q5_1: return info<Q5_1>();
    case Q8_0: return info<Q8_0>();
    case IQ4_NL: return info<IQ4_NL>();
    case Q2_K: return info<Q2_K>();
    case Q3_K: return info<Q3_K>();
    case IQ4_XS: return info<IQ4_XS>();
    case Q4_K: return info<Q4_K>();
    case Q5_K: return info<Q5_K>();
    case Q6_K: return info<Q6_K>();
    default: TORCH_CHECK(false, "GGML type ", type, " has no integer dot product");
  }
}

}  // namespace

// [M, K] fp32 -> (q int8 [M, K], d [M, K / block], bsums int16 [M, K / 16]): per `block` values (32, or
// 256 for the K-quants' blocks) d = max|x| / 127 and q = round(x / d), half to even as torch.round.
std::vector<at::Tensor> quantize_activations(at::Tensor x, int64_t block) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2, "x must be fp32 [rows, in_features]");
  TORCH_CHECK(block == 32 || block == 256, "block must be 32 or 256, got ", block);
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % block == 0, "in_features ", k, " is not a multiple of ", block);
  auto q = mb::empty({m, k}, at::kChar);
  auto d = mb::empty({m, k / block}, x.scalar_type());
  auto bs = mb::empty({m, k / 16}, at::kShort);
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  int16_t* sp = bs.data_ptr<int16_t>();
  parallel_for_rows(m, 0, m * (k / block), std::max<int64_t>(1, 4096 / block), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const float* v = xp + block * g;
      float amax = 0.0f;
      for (int64_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float dg = amax / 127.0f, id = dg != 0.0f ? 1.0f / dg : 0.0f;
      for (int64_t s16 = 0; s16 < block / 16; ++s16) {
        int32_t sum = 0;
        for (int64_t i = 16 * s16; i < 16 * s16 + 16; ++i) {
          const int qi = (int)std::max(-127.0f, std::min(127.0f, std::nearbyint(v[i] * id)));
          qp[block * g + i] = (int8_t)qi;
          sum += qi;
        }
        sp[(block / 16) * g + s16] = (int16_t)sum;
      }
      dp[g] = dg;
    }
  });
  return {q, d, bs};
}

at::Tensor quant_linear_q8(at::Tensor q, at::Tensor d, at::Tensor bs,  // quantize_activations(x, block of the type)
                           at::Tensor qweight, int64_t type,           // [N, row_bytes] uint8
                           bool packed) {                              // qweight is quant_pack_rows8's
  const TypeInfo t = type_info(type);
  const quant_pack::Packing packs = quant_pack::packing(type);
  TORCH_CHECK(!packed || packs.pack, "this build's integer path reads GGML type ", type, " as GGUF stores it, not packed");
  TORCH_CHECK(q.dtype() == at::kChar && q.dim() == 2 && q.is_contiguous(), "q must be contiguous int8 [rows, K]");
  const int64_t m = q.size(0), k = q.size(1), n = qweight.size(0);
  TORCH_CHECK(k % t.elems == 0, "in_features ", k, " is not a multiple of the block size ", t.elems);
  TORCH_CHECK(d.dtype() == at::kFloat && d.is_contiguous() && d.numel() == m * (k / t.elems),
              "the activations must be quantized per ", t.elems, " values for type ", type);
  TORCH_CHECK(bs.dtype() == at::kShort && bs.is_contiguous() && bs.numel() == m * (k / 16), "bsums do not match q");
  TORCH_CHECK(qweight.dtype() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "qweight must be a contiguous uint8 [N, row_bytes] tensor");
  TORCH_CHECK(qweight.size(1) == k / t.elems * t.bytes, "qweight has ", qweight.size(1), " bytes per row; type ", type,
              " with in_features ", k, " needs ", k / t.elems * t.bytes);
  auto out = mb::empty({m, n}, d.scalar_type());
  if (m == 0 || n == 0) return out;
  if (packs.pack && !packed) qweight = quant_pack::pack_copy(qweight, packs.pack);  // a matrix not packed at load
  Acts a{q.data_ptr<int8_t>(), d.data_ptr<float>(), bs.data_ptr<int16_t>(), k};
  at::Tensor sums;  // per row and block, once for every column: what the eight-column loop subtracts or adds
#ifdef MBQ_AVX2
  if (type == Q4_1 || type == Q5_1) {
    sums = mb::empty({m, k / 32}, d.scalar_type());
    float* sp = sums.data_ptr<float>();
    for (int64_t i = 0; i < m * (k / 32); ++i) sp[i] = a.d[i] * (float)(a.bs[2 * i] + a.bs[2 * i + 1]);
    a.sa = sp;
  } else if (type == Q4_0 || type == Q5_0 || (type == Q8_0 && kVnni)) {
    sums = mb::empty({m, k / 32}, at::kInt);
    int32_t* sp = sums.data_ptr<int32_t>();
    const int shift = type == Q4_0 ? 3 : type == Q5_0 ? 4 : 7;  // offsets 8, 16 and 128
    for (int64_t i = 0; i < m * (k / 32); ++i) sp[i] = ((int32_t)a.bs[2 * i] + a.bs[2 * i + 1]) * (1 << shift);
    a.so = sp;
  } else if (packs.pack && (type == Q4_K || type == Q5_K)) {
    sums = mb::empty({m, k / 32}, at::kShort);
    int16_t* sp = sums.data_ptr<int16_t>();
    for (int64_t i = 0; i < m * (k / 32); ++i) sp[i] = (int16_t)(a.bs[2 * i] + a.bs[2 * i + 1]);
    a.b32 = sp;
  }
#endif
  const uint8_t* wp = qweight.data_ptr<uint8_t>();
  const int64_t row_bytes = qweight.size(1), nd = k / t.elems;
  float* op = out.data_ptr<float>();
  // Tiles of columns whose blocks stay in L2 (~128 KB) while every group of rows passes over them.
  const int64_t tile = std::max<int64_t>(16, std::min<int64_t>(256, (131072 / std::max<int64_t>(row_bytes, 1)) / 16 * 16));
  // Rows in groups of nearly equal size (9 rows as 5 and 4, not 8 and a lone one that passes over the tile
  // for itself): a row's result does not depend on its group's size.
  const int64_t per = (m + (m + t.rows - 1) / t.rows - 1) / ((m + t.rows - 1) / t.rows);
  parallel_chunks_for_rows(m, n, m <= t.rows ? 64 : tile, [&](int64_t n0, int64_t n1) {
    for (int64_t c0 = n0; c0 < n1; c0 += tile)
      for (int64_t r0 = 0; r0 < m; r0 += per) {
        const Acts ar{a.q + r0 * k,
                      a.d + r0 * nd,
                      a.bs + r0 * (k / 16),
                      k,
                      a.sa ? a.sa + r0 * nd : nullptr,
                      a.so ? a.so + r0 * nd : nullptr,
                      a.b32 ? a.b32 + r0 * (k / 32) : nullptr};
        t.fn(ar, std::min<int64_t>(per, m - r0), wp, row_bytes, op + r0 * n, n, c0, std::min<int64_t>(c0 + tile, n1));
      }
  });
  return out;
}

bool int_path_has_avx2() {
#ifdef MBQ_AVX2
  return true;
#else
  return false;
#endif
}

bool int_path_has_vnni() {
#ifdef MBQ_AVX2
  return kVnni;
#else
  return false;
#endif
}

std::string int_path_kind() {
#if defined(MBQ_ZMM)
  return "avx512-vnni";
#elif defined(MBQ_AVX2)
  return kVnni ? "avx-vnni" : "avx2";
#else
  return "portable";
#endif
}
