// The model's small per-token operations on the CPU, each one pass over its data: the C++ twins
// of the Triton kernels in kernels/ (rmsnorm.py, rotary.py, activation.py). At decode, PyTorch
// spends more time dispatching the dozen small ops these replace than computing them. And the sampler's
// argmax over the vocabulary: torch's own runs a parallel region of OpenMP for two rows or more, whose
// threads then spin beside the kernels' pool for the rest of the step (TorchOps.argmax_rows says more).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
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

// The index of the row's largest value, the first of several that tie; a row holding a NaN gives its first
// NaN, as torch.argmax does. Two passes over the row (it stays in cache): its maximum and whether it holds
// a NaN, then the first place that matches.
inline int64_t argmax_row(const float* v, int64_t n) {
  float best = -INFINITY;
  bool nan = false;
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
  i = 0;
#ifdef MB_VEC_AVX2
  if (!nan) {
    const __m256 b = _mm256_set1_ps(best);
    for (; i + 8 <= n; i += 8) {
      const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), b, _CMP_EQ_OQ));
      if (hit) return i + __builtin_ctz(hit);
    }
  }
#endif
  for (; i < n; ++i)
    if (nan ? v[i] != v[i] : v[i] == best) return i;
  return 0;  // unreachable: some value equals the maximum
}

// One draw from softmax(l * inv_t) by inverting its distribution function at u in [0, 1): weights
// w = exp((l - max) * inv_t) (a masked logit, -inf, weighs exactly 0), then the first index whose running sum
// of w passes u * sum(w). The sums run in blocks of 256 (floats within one, doubles across), the running
// sum in double inside the block found. A row whose largest logit is not finite (a NaN, or all -inf), or
// whose inv_t is infinite (temperature 0), gives its argmax, as the twin does.
inline int64_t sample_row(const float* l, int64_t n, float inv_t, float u, float* w, double* blocks) {
  const int64_t top = argmax_row(l, n);
  const float m = l[top];
  if (!(m > -INFINITY && m < INFINITY) || std::isinf(inv_t)) return top;  // inv_t = inf: temperature 0, greedy
  constexpr int64_t kBlock = 256;
  const int64_t nb = (n + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * kBlock, i1 = std::min(n, i0 + kBlock);
    float part = 0.0f;
    int64_t i = i0;
#ifdef MB_VEC_AVX2
    const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t), ninf = _mm256_set1_ps(-INFINITY);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= i1; i += 8) {
      const __m256 x = _mm256_loadu_ps(l + i);
      const __m256 e = _mm256_and_ps(exp256(_mm256_mul_ps(_mm256_sub_ps(x, vm), vt)), _mm256_cmp_ps(x, ninf, _CMP_GT_OQ));
      _mm256_storeu_ps(w + i, e);
      acc = _mm256_add_ps(acc, e);
    }
    part = hsum(acc);
#endif
    for (; i < i1; ++i) {
      w[i] = l[i] > -INFINITY ? std::exp((l[i] - m) * inv_t) : 0.0f;
      part += w[i];
    }
    blocks[b] = part;
    total += part;
  }
  const double target = (double)u * total;
  double run = 0.0;
  int64_t last = top;  // the last index with weight: where rounding leaves the target past every sum
  for (int64_t b = 0; b < nb; ++b) {
    if (run + blocks[b] <= target) {
      run += blocks[b];
      continue;
    }
    for (int64_t i = b * kBlock, i1 = std::min(n, (b + 1) * kBlock); i < i1; ++i) {
      if (w[i] <= 0.0f) continue;
      run += w[i];
      last = i;
      if (run > target) return i;
    }
  }
  return last;
}

}  // namespace

// [rows, n] -> int64 [rows]: each row's argmax (rows split over the kernels' threads)
at::Tensor argmax_rows(at::Tensor x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  TORCH_CHECK(n > 0, "argmax_rows needs at least one value per row");
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  parallel_for_rows(rows, 0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * ld, n);
  });
  return out;
}

// [rows, n] logits, inv_temps [rows], u [rows] uniforms in [0, 1) -> int64 [rows]: one draw per row from
// softmax(logits * inv_temp) (sample_row), rows split over the kernels' threads
at::Tensor sample_rows(at::Tensor x, at::Tensor inv_temps, at::Tensor u) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  TORCH_CHECK(n > 0, "sample_rows needs at least one value per row");
  TORCH_CHECK(inv_temps.dtype() == at::kFloat && inv_temps.is_contiguous() && inv_temps.numel() == rows,
              "inv_temps must be contiguous fp32 [rows]");
  TORCH_CHECK(u.dtype() == at::kFloat && u.is_contiguous() && u.numel() == rows, "u must be contiguous fp32 [rows]");
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  auto w = at::empty({rows, n}, x.options());
  auto blocks = at::empty({rows, (n + 255) / 256}, x.options().dtype(at::kDouble));
  const float* xp = x.data_ptr<float>();
  const float* tp = inv_temps.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  double* bp = blocks.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t nb = blocks.size(1);
  parallel_for_rows(rows, 0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) op[r] = sample_row(xp + r * ld, n, tp[r], up[r], wp + r * n, bp + r * nb);
  });
  return out;
}

// out = rms_norm(x) * weight
at::Tensor rms_norm(at::Tensor x,       // [tokens, dim] fp32
                       at::Tensor weight,  // [dim] fp32
                       double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must be [dim]");
  const int64_t n = x.size(0), d = x.size(1), ld = x.stride(0);
  auto out = at::empty({n, d}, x.options());
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
  auto out = at::empty({n, d}, x.options());
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
  auto out = at::empty({t, n}, gate_up.options());
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

