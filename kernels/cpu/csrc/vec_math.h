// Small helpers shared by the CPU kernels: work sharing on the pool, AVX2 reductions and exp.
#pragma once
#include <ATen/Parallel.h>

#include "thread_pool.h"
#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>

// Run fn(begin, end) over [0, n) in chunks of `chunk` on the kernels' own pool (thread_pool.h). Each
// thread owns a contiguous run of chunks and walks it in order, so its weight reads are one stream the
// hardware prefetcher follows (chunks dealt out in turn broke every thread's stream at each chunk: a
// batch-1 step of the built-in model ran its matmuls 1.5x slower so). A thread done with its run then
// claims the chunks left in the others' runs, and a thread that is not there (preempted by another
// process, or asleep) is never waited for: only chunks it already claimed are.
template <typename F>
void parallel_chunks(int64_t n, int64_t chunk, const F& fn) {
  if (n <= 0) return;
  chunk = std::max(chunk, (n + mb::Pool::kMaxChunks - 1) / mb::Pool::kMaxChunks);
  const int64_t chunks = (n + chunk - 1) / chunk;
  mb::Pool::instance().run(chunks, [&](int64_t c) { fn(c * chunk, std::min(n, (c + 1) * chunk)); });
}
// The same on torch's OpenMP threads, for loops whose chunks call torch ops (a GEMM on a tile): inside an
// OpenMP region those run single-threaded, where on a pool thread they would start a team of their own.
// Its region ends at OpenMP's barrier, so it keeps that cost; it serves prefill-sized batches only.
template <typename F>
void parallel_chunks_omp(int64_t n, int64_t chunk, const F& fn) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), chunks);
  if (workers <= 1) {
    fn(0, n);
    return;
  }
  constexpr int64_t kMaxWorkers = 256;
  const int64_t runs = std::min(workers, kMaxWorkers);
  std::atomic<int64_t> next[kMaxWorkers];
  for (int64_t w = 0; w < runs; ++w) next[w].store(chunks * w / runs, std::memory_order_relaxed);
  at::parallel_for(0, runs, 1, [&](int64_t b, int64_t e) {
    for (int64_t own = b; own < e; ++own)
      for (int64_t i = 0; i < runs; ++i) {  // its own run first, then whatever the others have left
        const int64_t w = (own + i) % runs, end = chunks * (w + 1) / runs;
        for (int64_t c = next[w].fetch_add(1); c < end; c = next[w].fetch_add(1))
          fn(c * chunk, std::min(n, (c + 1) * chunk));
      }
  });
}
// Rows up to which a kernel's loop runs on the pool: decode steps of a few sequences, where a step is
// hundreds of short loops and one preempted thread would hold each of them. Larger batches (prefill
// chunks, many sequences) keep to torch's OpenMP threads, which torch's own ops in those steps use too:
// two pools spinning on the same cores would take turns with each other.
constexpr int64_t kPoolMaxRows = 16;

template <typename F>
void parallel_chunks_for_rows(int64_t rows, int64_t n, int64_t chunk, const F& fn) {
  if (rows <= kPoolMaxRows) {
    parallel_chunks(n, chunk, fn);
  } else {
    parallel_chunks_omp(n, chunk, fn);
  }
}

// at::parallel_for's shape, on the pool for a few rows (as above).
template <typename F>
void parallel_for_rows(int64_t rows, int64_t begin, int64_t end, int64_t grain, const F& fn) {
  if (rows <= kPoolMaxRows) {
    mb::parallel_for(begin, end, grain, fn);
  } else {
    at::parallel_for(begin, end, grain, fn);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MB_VEC_AVX2 1

inline float hsum(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// exp(x) for 8 lanes: range reduction by ln 2 and a degree-5 polynomial (Cephes' expf), about
// 1 ulp; inputs here are <= 0 (scores minus their running max).
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

#ifdef MB_VEC_AVX2
// exp(x) for 4 doubles, x <= 0: x = k ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts), e^r by its Taylor
// series to r^13 (a few ulp), times 2^k; 0 below -708, where 2^k would leave the normal range.
inline __m256d exp256d(__m256d x) {
  const __m256d floor = _mm256_set1_pd(-708.0);
  const __m256d under = _mm256_cmp_pd(x, floor, _CMP_LT_OQ);
  x = _mm256_max_pd(x, floor);
  const __m256d k = _mm256_round_pd(_mm256_mul_pd(x, _mm256_set1_pd(1.4426950408889634)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256d r = _mm256_fnmadd_pd(k, _mm256_set1_pd(6.93147180369123816490e-01), x);
  r = _mm256_fnmadd_pd(k, _mm256_set1_pd(1.90821492927058770002e-10), r);
  double inv_fact = 1.0;
  for (int i = 2; i <= 13; ++i) inv_fact /= i;  // 1 / 13!
  __m256d p = _mm256_set1_pd(inv_fact);
  for (int i = 13; i >= 2; --i) {
    inv_fact *= i;  // 1 / (i - 1)!
    p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(inv_fact));
  }
  p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(1.0));
  const __m256i bits = _mm256_slli_epi64(_mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_cvtpd_epi32(k)), _mm256_set1_epi64x(1023)), 52);
  return _mm256_andnot_pd(under, _mm256_mul_pd(p, _mm256_castsi256_pd(bits)));
}
#endif

// The largest of n floats and whether any is a NaN (a NaN never becomes the maximum), eight at a time where
// AVX2 is built: the argmax kernel's first pass and the chain's.
inline void max_and_nan(const float* v, int64_t n, float& best, bool& nan) {
  best = -INFINITY;
  nan = false;
  int64_t i = 0;
#ifdef MB_VEC_AVX2
  __m256 vmax = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    vmax = _mm256_max_ps(vmax, x);  // a NaN in x leaves vmax as it was: vnan keeps it
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float l : lanes) best = std::max(best, l);
  nan = _mm256_movemask_ps(vnan) != 0;
#endif
  for (; i < n; ++i) {
    best = std::max(best, v[i]);
    nan = nan || v[i] != v[i];
  }
}
