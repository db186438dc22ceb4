// The integer path's view of each GGUF block type (quant_dot.cpp): which integers it stores, their
// sub-block scales, offsets and minimums, unpacked the portable way; and the packed layouts its eight-column
// kernels read (Rows8, Rows8K; written by quant_pack.cpp). Included by those two files only.
#pragma once
#include <array>
#include <cstdint>
#include <cstring>
#include "gguf_blocks.h"
// The integer path's instruction classes: the AVX2 kernels (256-bit registers, on AVX2, AVX-VNNI and AVX-512
// builds), and the 512-bit multiply-adds for the 256-value types (AVX-512BW's maddubs and AVX-512 VNNI's word dot).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(MINIBATCH_PORTABLE)
#define MBQ_AVX2 1
#endif
#if defined(MBQ_AVX2) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(MINIBATCH_NO_VNNI)
#define MBQ_ZMM 1
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace quant_dot {

enum QType : int64_t {
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ4_NL = 20, IQ4_XS = 23
};

inline float f16(const uint8_t* p) { return half_to_float(p); }

// What one weight block contributes, in integers: for every 16 values i of sub-block k,
//   w_i = d * sc[k] * u_i + d * off[k]  (off: the offset that makes unsigned quants signed, per 16 values)
//                         - dmin * mn[k] (K-quant minimums)       + m (Q4_1 / Q5_1: the block's float minimum)
// with u the stored integers (signed for Q8_0, IQ4 and the offset 32-value types, else unsigned).
// Traits<T>::scales fills d, dmin, m, sc, off and mn; Traits<T>::unpack writes u for the portable path, and
// reg_u<T> the same integers straight into a register on the AVX2 path.
struct Block {
  float d = 0.0f, dmin = 0.0f, m = 0.0f;
  int16_t sc[16], off[16], mn[16];  // per 16 values (a 32-value block uses entries 0 and 1)
  alignas(32) int8_t u[256];
};

inline void nibbles(const uint8_t* qs, int8_t* u, int bias) {  // 16 bytes -> low nibbles, then high, less bias
  for (int j = 0; j < 16; ++j) u[j] = (int8_t)((qs[j] & 0x0f) - bias), u[j + 16] = (int8_t)((qs[j] >> 4) - bias);
}

inline void fifth_bits(const uint8_t* qhp, int8_t* u) {  // bit j of the 32-bit qh adds 16 to value j
  uint32_t qh;
  std::memcpy(&qh, qhp, 4);
  for (int j = 0; j < 32; ++j) u[j] = (int8_t)(u[j] + (((qh >> j) & 1) << 4));
}

// Eight byte-sized scales, each for 32 values: as int16 per 16 values.
inline void twice8(const uint32_t* bytes8, int16_t* out16) {
#ifdef __AVX2__
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes8));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out16), _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v)));
#else
  const uint8_t* p = reinterpret_cast<const uint8_t*>(bytes8);
  for (int j = 0; j < 8; ++j) out16[2 * j] = out16[2 * j + 1] = p[j];
#endif
}

inline void uniform(Block& b, int n16, int sc) {
  for (int k = 0; k < n16; ++k) b.sc[k] = (int16_t)sc, b.off[k] = 0, b.mn[k] = 0;
}

// MIN: the block has K-quant minimums (mn, times dmin); OFF: offsets (off, times d); FMIN: a float minimum m.
template <int64_t T> struct Traits;

template <> struct Traits<Q4_0> {
  static constexpr int ELEMS = 32, BYTES = 18;
  static constexpr bool SIGNED = true, MIN = false, OFF = false, FMIN = false;
  static void scales(const uint8_t* b, Block& o) { o.d = f16(b), uniform(o, 2, 1); }
  static void unpack(const uint8_t* b, Block& o) { nibbles(b + 2, o.u, 8); }
};

template <> struct Traits<Q4_1> {
  static constexpr int ELEMS = 32, BYTES = 20;
  static constexpr bool SIGNED = false, MIN = false, OFF = false, FMIN = true;
  static void scales(const uint8_t* b, Block& o) { o.d = f16(b), o.m = f16(b + 2), uniform(o, 2, 1); }
  static void unpack(const uint8_t* b, Block& o) { nibbles(b + 4, o.u, 0); }
};

template <> struct Traits<Q5_0> {
  static constexpr int ELEMS = 32, BYTES = 22;
  static constexpr bool SIGNED = true, MIN = false, OFF = false, FMIN = false;
  static void scales(const uint8_t* b, Block& o) { o.d = f16(b), uniform(o, 2, 1); }
  static void unpack(const uint8_t* b, Block& o) { nibbles(b + 6, o.u, 16), fifth_bits(b + 2, o.u); }
};

template <> struct Traits<Q5_1> {
  static constexpr int ELEMS = 32, BYTES = 24;
  static constexpr bool SIGNED = false, MIN = false, OFF = false, FMIN = true;
  static void scales(const uint8_t* b, Block& o) { o.d = f16(b), o.m = f16(b + 2), uniform(o, 2, 1); }
  static void unpack(const uint8_t* b, Block& o) { nibbles(b + 8, o.u, 0), fifth_bits(b + 4, o.u); }
};

template <> struct Traits<Q8_0> {
  static constexpr int ELEMS = 32, BYTES = 34;
  static constexpr bool SIGNED = true, MIN = false, OFF = false, FMIN = false;
  static void scales(const uint8_t* b, Block& o) { o.d = f16(b), uniform(o, 2, 1); }
  static void unpack(const uint8_t* b, Block& o) { std::memcpy(o.u, b + 2, 32); }
};

template <> struct Traits<IQ4_NL> {
  static constexpr int ELEMS = 32, BYTES = 18;
  static constexpr bool SIGNED = true, MIN = false, OFF = false, FMIN = false;
  static void scales(const uint8_t* b, Block& o) { o.d = f16(b), uniform(o, 2, 1); }
  static void unpack(const uint8_t* b, Block& o) {
    for (int j = 0; j < 16; ++j) o.u[j] = kIQ4Values[b[2 + j] & 0x0f], o.u[j + 16] = kIQ4Values[b[2 + j] >> 4];
  }
};

template <> struct Traits<IQ4_XS> {  // 8 sub-blocks of 32 with a signed 6-bit scale each
  static constexpr int ELEMS = 256, BYTES = 136;
  static constexpr bool SIGNED = true, MIN = false, OFF = false, FMIN = false;
  static void scales(const uint8_t* b, Block& o) {
    o.d = f16(b);
    const uint16_t sh = (uint16_t)(b[2] | (b[3] << 8));
    for (int j = 0; j < 8; ++j) {
      const int sc = (int)(((b[4 + j / 2] >> (4 * (j % 2))) & 0x0f) | (((sh >> (2 * j)) & 3) << 4)) - 32;
      o.sc[2 * j] = o.sc[2 * j + 1] = (int16_t)sc, o.off[2 * j] = o.off[2 * j + 1] = 0, o.mn[2 * j] = o.mn[2 * j + 1] = 0;
    }
  }
  static void unpack(const uint8_t* b, Block& o) {
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 16; ++l) o.u[32 * j + l] = kIQ4Values[b[8 + 16 * j + l] & 0x0f], o.u[32 * j + l + 16] = kIQ4Values[b[8 + 16 * j + l] >> 4];
  }
};

template <> struct Traits<Q2_K> {  // 16 sub-blocks of 16: 4-bit scale and 4-bit min each; 2-bit quants
  static constexpr int ELEMS = 256, BYTES = 84;
  static constexpr bool SIGNED = false, MIN = true, OFF = false, FMIN = false;
  static void scales(const uint8_t* b, Block& o) {
    o.d = f16(b + 80), o.dmin = f16(b + 82);
    for (int k = 0; k < 16; ++k) o.sc[k] = b[k] & 0x0f, o.mn[k] = b[k] >> 4, o.off[k] = 0;
  }
  static void unpack(const uint8_t* b, Block& o) {  // values 32j.. are bits 2s.. of qs[32c + l], c = j / 4, s = j % 4
    for (int i = 0; i < 256; ++i) o.u[i] = (int8_t)((b[16 + 32 * (i / 128) + i % 32] >> (2 * ((i / 32) % 4))) & 3);
  }
};

template <> struct Traits<Q3_K> {  // 16 sub-blocks of 16, signed 6-bit scales; u = 2 bits + 4 * high bit, value u - 4
  static constexpr int ELEMS = 256, BYTES = 110;
  static constexpr bool SIGNED = false, MIN = false, OFF = true, FMIN = false;
  static void scales(const uint8_t* b, Block& o) {
    o.d = f16(b + 108);
    const uint8_t* s = b + 96;
    for (int k = 0; k < 16; ++k) {
      const int sc = (((s[k % 8] >> (4 * (k / 8))) & 0x0f) | (((s[8 + k % 4] >> (2 * (k / 4))) & 3) << 4)) - 32;
      o.sc[k] = (int16_t)sc, o.off[k] = (int16_t)(-4 * sc), o.mn[k] = 0;
    }
  }
  static void unpack(const uint8_t* b, Block& o) {
    for (int i = 0; i < 256; ++i)
      o.u[i] = (int8_t)(((b[32 + 32 * (i / 128) + i % 32] >> (2 * ((i / 32) % 4))) & 3) | (((b[i % 32] >> (i / 32)) & 1) << 2));
  }
};

template <> struct Traits<Q4_K> {  // 8 sub-blocks of 32: 6-bit scale and min each
  static constexpr int ELEMS = 256, BYTES = 144;
  static constexpr bool SIGNED = false, MIN = true, OFF = false, FMIN = false;
  static void scales(const uint8_t* b, Block& o) {
    // 12 bytes as three words: scales 0-3 and mins 0-3 are the low 6 bits of words 0 and 1; scales and
    // mins 4-7 take their low 4 bits from word 2's nibbles and their top 2 from the top of words 0 and 1.
    o.d = f16(b), o.dmin = f16(b + 2);
    uint32_t w[3];
    std::memcpy(w, b + 4, 12);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, two = 0x03030303u;
    const uint32_t sc[2] = {w[0] & low6, (w[2] & low4) | (((w[0] >> 6) & two) << 4)};
    const uint32_t mn[2] = {w[1] & low6, ((w[2] >> 4) & low4) | (((w[1] >> 6) & two) << 4)};
    twice8(sc, o.sc), twice8(mn, o.mn);
  }
  static void unpack(const uint8_t* b, Block& o) {  // group 2p: low nibbles of qs[32p..], 2p + 1: high
    for (int i = 0; i < 256; ++i) {
      const uint8_t q = b[16 + 32 * (i / 64) + i % 32];
      o.u[i] = (int8_t)((i / 32) % 2 ? q >> 4 : q & 0x0f);
    }
  }
};

template <> struct Traits<Q5_K> {  // as Q4_K, with bit j of qh[l] as group j's fifth bit
  static constexpr int ELEMS = 256, BYTES = 176;
  static constexpr bool SIGNED = false, MIN = true, OFF = false, FMIN = false;
  static void scales(const uint8_t* b, Block& o) { Traits<Q4_K>::scales(b, o); }
  static void unpack(const uint8_t* b, Block& o) {
    for (int i = 0; i < 256; ++i) {
      const uint8_t q = b[48 + 32 * (i / 64) + i % 32];
      o.u[i] = (int8_t)(((i / 32) % 2 ? q >> 4 : q & 0x0f) | (((b[16 + i % 32] >> (i / 32)) & 1) << 4));
    }
  }
};

template <> struct Traits<Q6_K> {  // 16 sub-blocks of 16 with int8 scales; u = 6 bits, value u - 32
  static constexpr int ELEMS = 256, BYTES = 210;
  static constexpr bool SIGNED = false, MIN = false, OFF = true, FMIN = false;
  static void scales(const uint8_t* b, Block& o) {
    o.d = f16(b + 208);
#ifdef __AVX2__
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.sc), sc);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.off), _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sc, 5)));
#else
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int k = 0; k < 16; ++k) o.sc[k] = sc[k], o.off[k] = (int16_t)(-32 * sc[k]);
#endif
  }
  static void unpack(const uint8_t* b, Block& o) {  // value 128h + 32t + l
    for (int i = 0; i < 256; ++i) {
      const int h = i / 128, t = (i / 32) % 4, l = i % 32;
      const uint8_t q = b[64 * h + (t % 2) * 32 + l], hi = b[128 + 32 * h + l];
      o.u[i] = (int8_t)((t < 2 ? q & 0x0f : q >> 4) | (((hi >> (2 * t)) & 3) << 4));
    }
  }
};

}  // namespace quant_dot

namespace quant_dot {

// Eight weight rows as the eight-column kernel reads them (quant_dot.cpp's dot_cols8), packed once at load by
// pack_rows8: rows 8g..8g+7 of a matrix become one run of 8 * row_bytes bytes, block by block, and block bi of
// the eight is 8 * BYTES bytes: the eight fp16 scales d (one a lane), the eight fp16 minimums m (Q4_1, Q5_1),
// the fifth bits (Q5_0, Q5_1: bit t of byte i is the fifth bit of quant register t's byte i), then the quants
// as the kernel's registers hold them. Lane L of every register is row lane(L) of the eight (the nibble types
// take the even rows, then the odd); byte 4L + b of quant register t is the row's qs byte 4t + b (the nibble
// types: weights 4t + b and 16 + 4t + b, registers t and t + 4 once split) or Q8_0's weight 4t + b. The same
// bytes, moved: the kernel loads whole registers where it would gather and transpose eight rows' blocks.
template <int64_t T>
struct Rows8 {
  static constexpr bool NIB = T != Q8_0, FIFTH = T == Q5_0 || T == Q5_1, FMIN = T == Q4_1 || T == Q5_1;
  static constexpr int64_t QH = T == Q5_0 ? 2 : 4;                                  // a plain block's qh
  static constexpr int64_t QS = T == Q4_1 ? 4 : T == Q5_0 ? 6 : T == Q5_1 ? 8 : 2;  // and its quants
  static constexpr int64_t D = 0, M = 16, F = FMIN ? 32 : 16, Q = F + (FIFTH ? 32 : 0);
  static constexpr int REGS = NIB ? 4 : 8;  // quant registers of 32 bytes
  static_assert(Q + 32 * REGS == 8 * Traits<T>::BYTES, "a packed block is the eight plain ones' bytes");
  static constexpr int lane(int l) { return NIB ? (l % 4) * 2 + l / 4 : l; }   // the row in lane l
  static constexpr int lane_of(int row) { return NIB ? (row % 2) * 4 + row / 2 : row; }
};

}  // namespace quant_dot

namespace quant_dot {

// The 256-value types on the eight-column K-quant kernels (quant_dot.cpp), so packed at load (quant_pack.cpp).
// On AVX-512 builds Q6_K stays on the 512-bit one-column loop, which reads it as stored: there the eight-column
// kernel was 1.3x faster from 16 rows but 1.5x slower at one row, a lone user's decode (Ice Lake Xeon, weights
// from memory); Q4_K and Q5_K took 1.2-2x less time at every row count.
template <int64_t T>
#ifdef MBQ_ZMM
constexpr bool kColumns8K = T == Q4_K || T == Q5_K;
#else
constexpr bool kColumns8K = T == Q4_K || T == Q5_K || T == Q6_K;
#endif

// Q4_K's, Q5_K's and Q6_K's eight rows for their eight-column kernels (dot_cols8k, dot_cols8q6), packed at load
// as Rows8's types are: block bi of the eight is 8 * BYTES bytes of fields, each one stretch of every row's
// block laid lane by lane — fp16 scales a lane (width 2), or registers of four bytes a lane (register r's lane L
// is bytes src + 4r .. src + 4r + 3 of row L's block). Q4_K and Q5_K: d, dmin, the 12 scale bytes as three
// words, Q5_K's qh as eight registers, the quants as 32 (register 8p + t: bytes 32p + 4t.. of qs, whose low
// nibbles are weights 4t.. of group 2p and high ones of group 2p + 1). Q6_K: d, the 16 int8 scales as four
// registers, ql as 32 (register 16h + 8c + s: bytes 64h + 32c + 4s..) and qh as 16 (8h + s: bytes 32h + 4s..).
// A byte permutation; rows stay in lane order.
template <int64_t T>
struct Rows8K {
  struct Field {
    int64_t dst, src, width;  // width 2: an fp16 a lane; else bytes a lane, as width / 4 registers
  };
  static constexpr bool FIFTH = T == Q5_K, SIX = T == Q6_K;
  static constexpr int64_t D = 0, DMIN = 16, SC = SIX ? 16 : 32, QH = SIX ? 1168 : 128, Q = SIX ? 144 : FIFTH ? 384 : 128;
  static constexpr int FIELDS = FIFTH ? 5 : 4;
  static constexpr std::array<Field, 5> fields =
      SIX     ? std::array<Field, 5>{{{D, 208, 2}, {SC, 192, 16}, {Q, 0, 128}, {QH, 128, 64}, {0, 0, 0}}}
      : FIFTH ? std::array<Field, 5>{{{D, 0, 2}, {DMIN, 2, 2}, {SC, 4, 12}, {QH, 16, 32}, {Q, 48, 128}}}
              : std::array<Field, 5>{{{D, 0, 2}, {DMIN, 2, 2}, {SC, 4, 12}, {Q, 16, 128}, {0, 0, 0}}};
  static_assert(fields[FIELDS - 1].dst + 8 * fields[FIELDS - 1].width == 8 * Traits<T>::BYTES,
                "a packed block is the eight plain ones' bytes");
  // where byte k of a row's field f lies in the packed block, the row in lane `lane`
  static constexpr int64_t at(const Field& f, int lane, int64_t k) {
    return f.width == 2 ? f.dst + 2 * lane + k : f.dst + 32 * (k / 4) + 4 * lane + k % 4;
  }
};

}  // namespace quant_dot
