// The model's small per-token operations on the CPU, each one pass over its data: the C++ twins
// of the Triton kernels in kernels/ (rmsnorm.py, rotary.py, activation.py). At decode, PyTorch
// spends more time dispatching the dozen small ops these replace than computing them. (The sampler's
// kernels are in sampling.cpp.)
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include "kernels.h"
#include <cmath>
#include "vec_math.h"

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == at::kFloat && t.dim() == 2 && t.stride(1) == 1, name, " must be fp32 [tokens, dim] with contiguous rows");
}

inline void norm_row(const float* h, const float* w, float* out, int64_t d, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < d; ++i) ss += h[i] * h[i];
  const float inv = 1.0f / std::sqrt(ss / (float)d + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = w[i] * (h[i] * inv);
}

}  // namespace

// out = rms_norm(x) * weight
at::Tensor rms_norm(at::Tensor x,       // [tokens, dim] fp32
                       at::Tensor weight,  // [dim] fp32
                       double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [dim]");
  const int64_t n = x.size(0), d = x.size(1), ld = x.stride(0);
  auto out = mb::empty({n, d}, x.scalar_type());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for_rows(n, 0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) norm_row(xp + r * ld, wp, op + r * d, d, (float)eps);
  });
  return out;
}

// residual += x (in place); returns rms_norm(residual) * weight
at::Tensor add_rms_norm(at::Tensor x,         // [tokens, dim] fp32
                           at::Tensor residual,  // [tokens, dim] fp32, contiguous; updated
                           at::Tensor weight,    // [dim] fp32
                           double eps) {
  check_rows(x, "x");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.dtype() == at::kFloat,
              "residual must be contiguous fp32 with x's shape");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [dim]");
  const int64_t n = x.size(0), d = x.size(1), ld = x.stride(0);
  auto out = mb::empty({n, d}, x.scalar_type());
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for_rows(n, 0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* h = rp + r * d;
      const float* xr = xp + r * ld;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) h[i] += xr[i];
      norm_row(h, wp, op + r * d, d, (float)eps);
    }
  });
  return out;
}

// Rotate-half rotary embedding of q and k in place: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.
void rotary_inplace(at::Tensor positions,  // [tokens] int64
                    at::Tensor q,          // [tokens, heads, head_dim] fp32, head_dim contiguous
                    at::Tensor k,          // [tokens, kv_heads, head_dim] fp32
                    at::Tensor cos,        // [max_position, head_dim / 2] fp32
                    at::Tensor sin) {
  TORCH_CHECK(positions.dtype() == at::kLong && positions.is_contiguous(), "positions must be contiguous int64");
  TORCH_CHECK(q.dtype() == at::kFloat && k.dtype() == at::kFloat && q.stride(2) == 1 && k.stride(2) == 1,
              "q and k must be fp32 with contiguous head_dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "cos/sin tables must be contiguous");
  const int64_t n = q.size(0), half = q.size(2) / 2, max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the rotary table");
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  auto rotate = [&](at::Tensor x) {
    const int64_t heads = x.size(1), s0 = x.stride(0), s1 = x.stride(1);
    float* xp = x.data_ptr<float>();
    parallel_for_rows(n, 0, n, 8, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const float* c = cp + pos[t] * half;
        const float* s = sp + pos[t] * half;
        for (int64_t h = 0; h < heads; ++h) {
          float* x1 = xp + t * s0 + h * s1;
          float* x2 = x1 + half;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float a = x1[i], b2 = x2[i];
            x1[i] = a * c[i] - b2 * s[i];
            x2[i] = b2 * c[i] + a * s[i];
          }
        }
      }
    });
  };
  rotate(q);
  rotate(k);
}

// [tokens, 2n] (gate, up) -> silu(gate) * up, [tokens, n]
at::Tensor silu_mul(at::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t t = gate_up.size(0), n = gate_up.size(1) / 2, ld = gate_up.stride(0);
  auto out = mb::empty({t, n}, gate_up.scalar_type());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  parallel_for_rows(t, 0, t, 4, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* g = gp + r * ld;
      const float* u = g + n;
      float* o = op + r * n;
      int64_t i = 0;
#ifdef MB_VEC_AVX2
      const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
      for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, x))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

