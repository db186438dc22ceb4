// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a counter-based
// generator. The sampler's draw for a token is a pure function of (key, counter): the request's seed (or
// the daemon's own key mixed with the request id) and the token's position in the output. So a seeded
// request draws the same tokens alone or in any batch, with or without speculation, across restarts, and
// no per-request generator object exists. engine/runner/philox.py is the NumPy twin; both are checked
// against Random123's known-answer vectors.
#pragma once
#include <cstdint>

namespace mb {

struct Philox4x32 {
  uint32_t v[4];
};

inline void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = (uint64_t)a * (uint64_t)b;
  hi = (uint32_t)(p >> 32);
  lo = (uint32_t)p;
}

// Ten rounds over the counter (c0..c3) under the key (k0, k1), the key bumped between rounds.
inline Philox4x32 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    if (round) {
      k0 += kW0;
      k1 += kW1;
    }
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kM0, c0, hi0, lo0);
    philox_mulhilo(kM1, c2, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return {{c0, c1, c2, c3}};
}

// A uniform double in [0, 1) with 53 random bits: the first two words of the block at counter (position, 0,
// 0, 0) under the 64-bit key.
inline double philox_uniform(uint64_t key, uint64_t counter) {
  const Philox4x32 r = philox4x32_10((uint32_t)counter, (uint32_t)(counter >> 32), 0u, 0u, (uint32_t)key, (uint32_t)(key >> 32));
  const uint64_t bits = ((uint64_t)r.v[0] << 32 | r.v[1]) >> 11;
  return (double)bits * (1.0 / 9007199254740992.0);  // 2^-53
}

// The same block's two uniforms: the first from words 0-1 (philox_uniform's), the second from words 2-3 (the
// chain's XTC coin: independent of the draw at the same position).
inline void philox_uniform_pair(uint64_t key, uint64_t counter, double& first, double& second) {
  const Philox4x32 r = philox4x32_10((uint32_t)counter, (uint32_t)(counter >> 32), 0u, 0u, (uint32_t)key, (uint32_t)(key >> 32));
  first = (double)(((uint64_t)r.v[0] << 32 | r.v[1]) >> 11) * (1.0 / 9007199254740992.0);
  second = (double)(((uint64_t)r.v[2] << 32 | r.v[3]) >> 11) * (1.0 / 9007199254740992.0);
}

}  // namespace mb
