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

// One query head against n positions of one KV block, with the head's accumulator in registers (head_dim =
// 8 * V): the positions' scores eight at a time (sc: room for n rounded up to 8), the online-softmax update
// (exponentials in eight lanes, summed in lanes, then across them), then acc += p * v position by position.
template <int V>
inline void block_head(const float* q, const float* kb, int64_t ks1, const float* vb, int64_t vs1, int64_t n,
                       float* sc, float* mx, float* sum, float* acc, float cap) {
  __m256 qv[V];
  for (int j = 0; j < V; ++j) qv[j] = _mm256_loadu_ps(q + 8 * j);
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(sc + i, scores8<V>(qv, kb + i * ks1, ks1, n - i));
  if (cap > 0.0f) soft_cap(sc, n, cap);
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 8)
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(vmax, _mm256_loadu_ps(sc + i), first_lanes(n - i)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  const float bmax = *std::max_element(lanes, lanes + 8);  // a maximum is exact in any order
  __m256 av[V];
  for (int j = 0; j < V; ++j) av[j] = _mm256_loadu_ps(acc + 8 * j);
  if (bmax > *mx) {
    const float corr = std::exp(*mx - bmax);  // 0 for the first block
    *sum *= corr;
    const __m256 c = _mm256_set1_ps(corr);
    for (int j = 0; j < V; ++j) av[j] = _mm256_mul_ps(av[j], c);
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

// Fold positions [skip, skip + n) of one KV block into a query's `group` heads: the one operation every query
// is computed with, whatever its kind.
inline void fold_block(const QueryState& st, int64_t group, int64_t head_dim, const float* kb, int64_t ks1,
                       const float* vb, int64_t vs1, int64_t n, float* scores, int64_t block_size, float cap) {
#ifdef MB_ATTN_AVX2
  if (head_dim == 64 || head_dim == 128) {
    for (int64_t g = 0; g < group; ++g) {
      float* a = st.acc + g * head_dim;
      if (head_dim == 64) block_head<8>(st.q + g * head_dim, kb, ks1, vb, vs1, n, scores, &st.mx[g], &st.sum[g], a, cap);
      else block_head<16>(st.q + g * head_dim, kb, ks1, vb, vs1, n, scores, &st.mx[g], &st.sum[g], a, cap);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < group; ++g) scores[g * (block_size + 8) + i] = dot(st.q + g * head_dim, kb + i * ks1, head_dim);
  for (int64_t g = 0; g < group; ++g) {  // online softmax: fold this block into the running max and sum
    float* sg = scores + g * (block_size + 8);
    if (cap > 0.0f) soft_cap(sg, n, cap);
    const float bmax = *std::max_element(sg, sg + n);
    if (bmax > st.mx[g]) {
      const float corr = std::exp(st.mx[g] - bmax);  // 0 for the first block
      st.sum[g] *= corr;
      float* a = st.acc + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) a[d] *= corr;
      st.mx[g] = bmax;
    }
    st.sum[g] += exp_shifted(sg, n, st.mx[g]);
  }
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < group; ++g) axpy(scores[g * (block_size + 8) + i], vb + i * vs1, st.acc + g * head_dim, head_dim);
}

}  // namespace

at::Tensor paged_attention(
    at::Tensor q,             // [num_tokens, num_heads, head_dim] fp32: every sequence's new tokens, back to back
    at::Tensor k_cache,       // [num_blocks, block_size, num_kv_heads, head_dim] fp32
    at::Tensor v_cache,       // [num_blocks, block_size, num_kv_heads, head_dim] fp32
    at::Tensor block_tables,  // [num_seqs, max_blocks] int32
    at::Tensor seq_lens,      // [num_seqs] int32: each sequence's context after this forward (cached + new)
    at::Tensor query_start,   // [num_seqs + 1] int32: sequence s's tokens are rows query_start[s] .. [s + 1] - 1
    double scale,
    int64_t window,           // > 0: attend to the last `window` positions only (sliding window)
    double softcap) {         // > 0: scores -> softcap * tanh(scores / softcap)
  TORCH_CHECK(window >= 0, "window must be >= 0");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0");
  TORCH_CHECK(q.dtype() == at::kFloat && k_cache.dtype() == at::kFloat && v_cache.dtype() == at::kFloat,
              "paged_attention: fp32 only");
  TORCH_CHECK(block_tables.dtype() == at::kInt && seq_lens.dtype() == at::kInt && query_start.dtype() == at::kInt,
              "int32 tables");
  TORCH_CHECK(q.is_contiguous() && block_tables.is_contiguous() && seq_lens.is_contiguous() && query_start.is_contiguous(),
              "contiguous inputs");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "head_dim must be contiguous in the cache");
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query_start.numel() == num_seqs + 1 && block_tables.size(0) == num_seqs, "one table and length per sequence");
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(qs[0] == 0 && qs[num_seqs] == num_tokens, "query_start must run from 0 to the number of query rows");
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
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const int64_t tiles = static_cast<int64_t>(tile_seq.size()), per_query = group * head_dim;

  parallel_chunks_for_rows(num_tokens, tiles * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    // scores: a block's per query head, with room for the eight-lane stores past its last position
    std::vector<float> qsc(kQueryTile * per_query), acc(kQueryTile * per_query), scores(group * (block_size + 8));
    std::vector<float> mx(kQueryTile * group), sum(kQueryTile * group);
    int64_t first[kQueryTile], stop[kQueryTile];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t tile = task / num_kv_heads, kvh = task % num_kv_heads, s = tile_seq[tile];
      const int64_t q0 = tile_q0[tile], nq = std::min<int64_t>(kQueryTile, qs[s + 1] - q0);
      const int64_t pos0 = lens[s] - (qs[s + 1] - qs[s]) + (q0 - qs[s]);  // the tile's first query's position
      int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
      for (int64_t j = 0; j < nq; ++j) {
        const float* src = qp + ((q0 + j) * num_heads + kvh * group) * head_dim;
        for (int64_t i = 0; i < per_query; ++i) qsc[j * per_query + i] = src[i] * fscale;
        stop[j] = pos0 + j + 1;                                                  // positions attended: [first, stop)
        first[j] = window > 0 ? std::max<int64_t>(0, stop[j] - window) : 0;
        lo = std::min(lo, first[j] / block_size * block_size), hi = std::max(hi, stop[j]);
      }
      std::fill(acc.begin(), acc.begin() + nq * per_query, 0.0f);
      std::fill(mx.begin(), mx.begin() + nq * group, -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.begin() + nq * group, 0.0f);
      for (int64_t t0 = lo; t0 < hi; t0 += block_size) {  // block by block; each query takes the part it attends
        const int64_t block = bt[s * max_blocks + t0 / block_size];
        for (int64_t j = 0; j < nq; ++j) {
          if (t0 >= stop[j] || t0 + block_size <= first[j]) continue;
          const int64_t skip = std::max<int64_t>(0, first[j] - t0);  // positions of this block before the window
          const int64_t n = std::min(block_size, stop[j] - t0) - skip;
          const QueryState st{qsc.data() + j * per_query, acc.data() + j * per_query, mx.data() + j * group,
                              sum.data() + j * group};
          fold_block(st, group, head_dim, kp + block * ks0 + kvh * ks2 + skip * ks1, ks1,
                     vp + block * vs0 + kvh * vs2 + skip * vs1, vs1, n, scores.data(), block_size, cap);
        }
      }
      for (int64_t j = 0; j < nq; ++j) {
        float* os = op + ((q0 + j) * num_heads + kvh * group) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float inv = 1.0f / sum[j * group + g];
          const float* a = acc.data() + j * per_query + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) os[g * head_dim + d] = a[d] * inv;
        }
      }
    }
  });
  return out;
}

// The new tokens' K and V written into their cache slots, then attention: one call per layer.
at::Tensor store_and_attention(
    at::Tensor q,             // [num_tokens, num_heads, head_dim] fp32
    at::Tensor k,             // [num_tokens, num_kv_heads, head_dim] fp32
    at::Tensor v,             // [num_tokens, num_kv_heads, head_dim] fp32
    at::Tensor kv_cache,      // [2, num_blocks, block_size, num_kv_heads, head_dim] fp32, contiguous
    at::Tensor slot_mapping,  // [num_tokens] int64: block * block_size + offset of each new token
    at::Tensor block_tables,  // [num_seqs, max_blocks] int32
    at::Tensor seq_lens,      // [num_seqs] int32
    at::Tensor query_start,   // [num_seqs + 1] int32
    double scale,
    int64_t window,
    double softcap) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dtype() == at::kFloat && kv_cache.dim() == 5, "kv_cache must be contiguous fp32 [2, blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(slot_mapping.dtype() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping must be contiguous int64");
  TORCH_CHECK(k.dtype() == at::kFloat && v.dtype() == at::kFloat, "k and v must be fp32");
  const int64_t n = q.size(0), row = kv_cache.size(3) * kv_cache.size(4);
  const int64_t slots = kv_cache.size(1) * kv_cache.size(2);
  TORCH_CHECK(k.size(0) == n && v.size(0) == n && slot_mapping.numel() == n && k.size(1) * k.size(2) == row, "k, v, slots: one row per token");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(1) == v.size(2), "k and v rows must be contiguous");
  const int64_t* sp = slot_mapping.data_ptr<int64_t>();
  float* cache = kv_cache.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < slots, "slot ", sp[i], " outside the cache");
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(cache + sp[i] * row, kp + i * k.stride(0), row * sizeof(float));
    std::memcpy(cache + (slots + sp[i]) * row, vp + i * v.stride(0), row * sizeof(float));
  }
  return paged_attention(q.contiguous(), kv_cache[0], kv_cache[1], block_tables, seq_lens, query_start, scale, window,
                         softcap);
}
