// Paged attention for single-token (decode) queries on the CPU, reading K/V straight from the
// block-structured cache through each sequence's block table: no gathered copy of the context.
//
// One task per (sequence, KV head); it serves the group of query heads that share that KV head
// (grouped-query attention), so each K/V vector is read once per group. The context is walked
// one KV block at a time with an online softmax (running max and sum per query head, the
// accumulator rescaled when the max grows), so K and V of a block are used while they are in
// cache and no score array of the whole context is kept. Scores, exponentials and sums are fp32.
// Optional: a sliding window (only the last `window` positions), and scores soft-capped as
// cap * tanh(score / cap) before the softmax (Gemma 2).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include "kernels.h"
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#include "vec_math.h"
#ifdef MB_VEC_AVX2
#define MB_ATTN_AVX2 1
#endif

namespace {



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
// One query head against one KV block, with the head's accumulator in registers (head_dim = 8 * V):
// scores of the block's n positions, the online-softmax update, then acc += p * v.
template <int V>
inline void block_head(const float* q, const float* kb, int64_t ks1, const float* vb, int64_t vs1, int64_t n,
                       float* sc, float* mx, float* sum, float* acc, float cap) {
  __m256 qv[V];
  for (int j = 0; j < V; ++j) qv[j] = _mm256_loadu_ps(q + 8 * j);
  for (int64_t i = 0; i < n; ++i) {
    const float* k = kb + i * ks1;
    __m256 a0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k)), a1 = _mm256_setzero_ps();
    for (int j = 1; j < V; ++j) {
      if (j % 2) a1 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k + 8 * j), a1);
      else a0 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k + 8 * j), a0);
    }
    sc[i] = hsum(_mm256_add_ps(a0, a1));
  }
  if (cap > 0.0f) soft_cap(sc, n, cap);
  const float bmax = *std::max_element(sc, sc + n);
  __m256 av[V];
  for (int j = 0; j < V; ++j) av[j] = _mm256_loadu_ps(acc + 8 * j);
  if (bmax > *mx) {
    const float corr = std::exp(*mx - bmax);  // 0 for the first block
    *sum *= corr;
    const __m256 c = _mm256_set1_ps(corr);
    for (int j = 0; j < V; ++j) av[j] = _mm256_mul_ps(av[j], c);
    *mx = bmax;
  }
  *sum += exp_shifted(sc, n, *mx);
  for (int64_t i = 0; i < n; ++i) {
    const __m256 p = _mm256_set1_ps(sc[i]);
    const float* v = vb + i * vs1;
    for (int j = 0; j < V; ++j) av[j] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * j), av[j]);
  }
  for (int j = 0; j < V; ++j) _mm256_storeu_ps(acc + 8 * j, av[j]);
}
#endif

}  // namespace

at::Tensor paged_decode_attention(
    at::Tensor q,             // [num_seqs, num_heads, head_dim] fp32
    at::Tensor k_cache,       // [num_blocks, block_size, num_kv_heads, head_dim] fp32
    at::Tensor v_cache,       // [num_blocks, block_size, num_kv_heads, head_dim] fp32
    at::Tensor block_tables,  // [num_seqs, max_blocks] int32
    at::Tensor seq_lens,      // [num_seqs] int32
    double scale,
    int64_t window,           // > 0: attend to the last `window` positions only (sliding window)
    double softcap) {         // > 0: scores -> softcap * tanh(scores / softcap)
  TORCH_CHECK(window >= 0, "window must be >= 0");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0");
  TORCH_CHECK(q.dtype() == at::kFloat && k_cache.dtype() == at::kFloat && v_cache.dtype() == at::kFloat,
              "paged_decode_attention: fp32 only");
  TORCH_CHECK(block_tables.dtype() == at::kInt && seq_lens.dtype() == at::kInt, "int32 tables");
  TORCH_CHECK(q.is_contiguous() && block_tables.is_contiguous() && seq_lens.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "head_dim must be contiguous in the cache");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  auto out = mb::empty(q.sizes(), q.scalar_type());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);

  parallel_chunks_for_rows(num_seqs, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qsc(group * head_dim), acc(group * head_dim), scores(group * block_size), mx(group), sum(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, kvh = task % num_kv_heads;
      const int64_t len = lens[s];
      const float* qs = qp + (s * num_heads + kvh * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) qsc[i] = qs[i] * fscale;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.0f);
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;  // oldest position attended
      for (int64_t t0 = first / block_size * block_size; t0 < len; t0 += block_size) {
        const int64_t block = bt[s * max_blocks + t0 / block_size];
        const int64_t skip = std::max<int64_t>(0, first - t0);  // positions of this block before the window
        const int64_t n = std::min(block_size, len - t0) - skip;
        const float* kb = kp + block * ks0 + kvh * ks2 + skip * ks1;
        const float* vb = vp + block * vs0 + kvh * vs2 + skip * vs1;
#ifdef MB_ATTN_AVX2
        if (head_dim == 64 || head_dim == 128) {
          for (int64_t g = 0; g < group; ++g) {
            float* sg = scores.data() + g * block_size;
            float* a = acc.data() + g * head_dim;
            if (head_dim == 64) block_head<8>(qsc.data() + g * head_dim, kb, ks1, vb, vs1, n, sg, &mx[g], &sum[g], a, cap);
            else block_head<16>(qsc.data() + g * head_dim, kb, ks1, vb, vs1, n, sg, &mx[g], &sum[g], a, cap);
          }
          continue;
        }
#endif
        for (int64_t i = 0; i < n; ++i)
          for (int64_t g = 0; g < group; ++g) scores[g * block_size + i] = dot(qsc.data() + g * head_dim, kb + i * ks1, head_dim);
        for (int64_t g = 0; g < group; ++g) {  // online softmax: fold this block into the running max and sum
          float* sg = scores.data() + g * block_size;
          if (cap > 0.0f) soft_cap(sg, n, cap);
          const float bmax = *std::max_element(sg, sg + n);
          if (bmax > mx[g]) {
            const float corr = std::exp(mx[g] - bmax);  // 0 for the first block
            sum[g] *= corr;
            float* a = acc.data() + g * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] *= corr;
            mx[g] = bmax;
          }
          sum[g] += exp_shifted(sg, n, mx[g]);
        }
        for (int64_t i = 0; i < n; ++i)
          for (int64_t g = 0; g < group; ++g) axpy(scores[g * block_size + i], vb + i * vs1, acc.data() + g * head_dim, head_dim);
      }
      float* os = op + (s * num_heads + kvh * group) * head_dim;
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.0f / sum[g];
        for (int64_t d = 0; d < head_dim; ++d) os[g * head_dim + d] = acc[g * head_dim + d] * inv;
      }
    }
  });
  return out;
}

// The new tokens' K and V written into their cache slots, then decode attention: one call per layer.
at::Tensor store_and_decode_attention(
    at::Tensor q,             // [num_seqs, num_heads, head_dim] fp32, one new token per sequence
    at::Tensor k,             // [num_seqs, num_kv_heads, head_dim] fp32
    at::Tensor v,             // [num_seqs, num_kv_heads, head_dim] fp32
    at::Tensor kv_cache,      // [2, num_blocks, block_size, num_kv_heads, head_dim] fp32, contiguous
    at::Tensor slot_mapping,  // [num_seqs] int64: block * block_size + offset of each new token
    at::Tensor block_tables,  // [num_seqs, max_blocks] int32
    at::Tensor seq_lens,      // [num_seqs] int32
    double scale,
    int64_t window,
    double softcap) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dtype() == at::kFloat && kv_cache.dim() == 5, "kv_cache must be contiguous fp32 [2, blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(slot_mapping.dtype() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping must be contiguous int64");
  const int64_t n = q.size(0), row = kv_cache.size(3) * kv_cache.size(4);
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2);
  TORCH_CHECK(k.size(0) == n && v.size(0) == n && slot_mapping.numel() == n && k.size(1) * k.size(2) == row, "k, v, slots: one row per sequence");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(1) == v.size(2), "k and v rows must be contiguous");
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  float* cache = kv_cache.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < slots, "slot ", sp[i], " outside the cache");
    std::memcpy(cache + sp[i] * row, kp + i * k.stride(0), row * sizeof(float));
    std::memcpy(cache + (slots + sp[i]) * row, vp + i * v.stride(0), row * sizeof(float));
  }
  return paged_decode_attention(q.contiguous(), kv_cache[0], kv_cache[1], block_tables, seq_lens, scale, window, softcap);
}

