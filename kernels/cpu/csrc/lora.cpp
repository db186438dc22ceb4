// LoRA adapters' updates of a projection's rows, several adapters in one batch (Punica's BGMV on the CPU):
// y[i] += sum over the row's adapters k of scale_k * (x[i] A_k^T) B_k^T, on the kernels' pool, no PyTorch
// op between (torch's parallel regions leave OpenMP's threads spinning beside the pool).
//
// Each row is computed on its own in one fixed order whatever the batch: x[i]'s dot with each row of A
// (eight lanes, summed in a fixed order), then the row's update summed over its adapters in the order given
// and over each one's rank, eight outputs at a time, then added to y once. A request gets the same tokens
// alone as in any batch. The PyTorch twin is engine/models/ops.py's TorchOps.lora_update.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include "kernels.h"
#include "vec_math.h"

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef MB_VEC_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  s = hsum(acc);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

constexpr int64_t kColumns = 512;  // outputs a chunk of the second pass computes

}  // namespace

// y: [n, out] fp32, updated in place. x: [n, in] fp32 (rows contiguous). a: [S, R, in], bt: [S, R, out] fp32
// contiguous: the served adapters' A and B^T, padded with zeros to the largest rank R. ranks: [S] int32 (each
// adapter's rank in this projection, 0 where it leaves it alone). slots: [n, K] int32 (each row's adapters,
// -1 for none), scales: [n, K] fp32.
void lora_update(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor bt, at::Tensor ranks, at::Tensor slots,
                 at::Tensor scales) {
  TORCH_CHECK(y.dtype() == at::kFloat && y.dim() == 2 && y.stride(1) == 1, "y must be fp32 [n, out], rows contiguous");
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(0) == y.size(0),
              "x must be fp32 [n, in] with y's rows");
  TORCH_CHECK(a.dtype() == at::kFloat && a.dim() == 3 && a.is_contiguous() && a.size(2) == x.size(1),
              "a must be contiguous fp32 [S, R, in]");
  TORCH_CHECK(bt.dtype() == at::kFloat && bt.dim() == 3 && bt.is_contiguous() && bt.size(0) == a.size(0) &&
                  bt.size(1) == a.size(1) && bt.size(2) == y.size(1),
              "bt must be contiguous fp32 [S, R, out]");
  TORCH_CHECK(ranks.dtype() == at::kInt && ranks.is_contiguous() && ranks.numel() == a.size(0), "ranks must be int32 [S]");
  TORCH_CHECK(slots.dtype() == at::kInt && slots.dim() == 2 && slots.is_contiguous() && slots.size(0) == y.size(0),
              "slots must be contiguous int32 [n, K]");
  TORCH_CHECK(scales.dtype() == at::kFloat && scales.sizes() == slots.sizes() && scales.is_contiguous(),
              "scales must be fp32 with slots' shape");
  const int64_t n = y.size(0), out = y.size(1), in = x.size(1), S = a.size(0), R = a.size(1), K = slots.size(1);
  if (n == 0 || K == 0) return;
  const int32_t* sp = slots.data_ptr<int32_t>();
  const int32_t* rp = ranks.data_ptr<int32_t>();
  for (int64_t i = 0; i < n * K; ++i)
    TORCH_CHECK(sp[i] >= -1 && sp[i] < S, "slots must be -1 or an adapter's index");
  for (int64_t s = 0; s < S; ++s) TORCH_CHECK(rp[s] >= 0 && rp[s] <= R, "ranks must be in [0, R]");
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = bt.data_ptr<float>();
  const float* scp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  // first pass: each row's x A^T for each of its adapters, [n, K, R]
  auto t = mb::empty({n, K, R}, at::kFloat);
  float* tp = t.data_ptr<float>();
  parallel_for_rows(n, 0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      for (int64_t k = 0; k < K; ++k) {
        const int32_t s = sp[i * K + k];
        for (int64_t r = 0; s >= 0 && r < rp[s]; ++r)
          tp[(i * K + k) * R + r] = dot(xp + i * ldx, ap + (s * R + r) * in, in);
      }
  });
  // second pass: each row's update, a chunk of outputs at a time, summed over its adapters and ranks
  const int64_t chunks = (out + kColumns - 1) / kColumns;
  parallel_chunks_for_rows(n, n * chunks, 1, [&](int64_t b, int64_t e) {
    float acc[kColumns];
    for (int64_t item = b; item < e; ++item) {
      const int64_t i = item / chunks, c0 = (item % chunks) * kColumns, width = std::min(kColumns, out - c0);
      bool any = false;
      for (int64_t j = 0; j < width; ++j) acc[j] = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const int32_t s = sp[i * K + k];
        if (s < 0 || rp[s] == 0) continue;
        any = true;
        for (int64_t r = 0; r < rp[s]; ++r) {
          const float w = tp[(i * K + k) * R + r] * scp[i * K + k];
          const float* row = bp + (s * R + r) * out + c0;
          int64_t j = 0;
#ifdef MB_VEC_AVX2
          const __m256 wv = _mm256_set1_ps(w);
          for (; j + 8 <= width; j += 8)
            _mm256_storeu_ps(acc + j, _mm256_fmadd_ps(wv, _mm256_loadu_ps(row + j), _mm256_loadu_ps(acc + j)));
#endif
          for (; j < width; ++j) acc[j] = std::fma(w, row[j], acc[j]);
        }
      }
      if (!any) continue;
      float* dst = yp + i * ldy + c0;
      for (int64_t j = 0; j < width; ++j) dst[j] += acc[j];
    }
  });
}
