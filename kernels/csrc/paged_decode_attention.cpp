// Paged attention for single-token (decode) queries on the CPU, reading K/V straight from the
// block-structured cache through each sequence's block table: no gathered copy of the context.
//
// One task per (sequence, KV head); it serves the group of query heads that share that KV head
// (grouped-query attention), so each K/V vector is read once per group. Scores are exact fp32
// with a max-subtracted softmax, as the PyTorch reference computes them.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <vector>

torch::Tensor paged_decode_attention(
    torch::Tensor q,             // [num_seqs, num_heads, head_dim] fp32
    torch::Tensor k_cache,       // [num_blocks, block_size, num_kv_heads, head_dim] fp32
    torch::Tensor v_cache,       // [num_blocks, block_size, num_kv_heads, head_dim] fp32
    torch::Tensor block_tables,  // [num_seqs, max_blocks] int32
    torch::Tensor seq_lens,      // [num_seqs] int32
    double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 && v_cache.dtype() == torch::kFloat32,
              "paged_decode_attention: fp32 only");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && seq_lens.dtype() == torch::kInt32, "int32 tables");
  TORCH_CHECK(q.is_contiguous() && block_tables.is_contiguous() && seq_lens.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "head_dim must be contiguous in the cache");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(group * head_dim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, kvh = task % num_kv_heads;
      const int64_t len = lens[s];
      scores.assign(group * len, 0.0f);
      const float* qs = qp + (s * num_heads + kvh * group) * head_dim;
      // scores[g, t] = q_g . k_t * scale; one block of positions at a time
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t block = bt[s * max_blocks + t0 / block_size];
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t i = 0; i < n; ++i) {
          const float* __restrict__ k = kp + block * ks0 + i * ks1 + kvh * ks2;
          for (int64_t g = 0; g < group; ++g) {
            const float* __restrict__ qg = qs + g * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * k[d];
            scores[g * len + t0 + i] = dot * fscale;
          }
        }
      }
      // softmax over t for each head of the group
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        float mx = -INFINITY;
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.0f;
        for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      // out_g = sum_t p[g, t] v_t
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t0 = 0; t0 < len; t0 += block_size) {
        const int64_t block = bt[s * max_blocks + t0 / block_size];
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t i = 0; i < n; ++i) {
          const float* __restrict__ v = vp + block * vs0 + i * vs1 + kvh * vs2;
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * len + t0 + i];
            float* __restrict__ a = acc.data() + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
          }
        }
      }
      float* os = op + (s * num_heads + kvh * group) * head_dim;
      std::copy(acc.begin(), acc.end(), os);
    }
  });
  return out;
}

void register_attention(pybind11::module& m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, fp32)");
}
