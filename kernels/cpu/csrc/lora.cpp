// LoRA adapters' updates of a projection's rows, several adapters in one batch (Punica's BGMV on the CPU):
// y[i] += sum over the row's adapters k of scale_k * (x[i] A_k^T) B_k^T, on the kernels' pool, no PyTorch
// op between (torch's parallel regions leave OpenMP's threads spinning beside the pool).
//
// Each row is computed on its own in one fixed order whatever the batch: x[i]'s dot with each row of A
// (eight lanes, summed in a fixed order), then each adapter's update over its rank, eight outputs at a time,
// added to y once (a row of several adapters: their updates summed in the row's order first). Rows of one
// adapter are taken in tiles that share each read of its matrices; a row's arithmetic is the same in any tile. A request gets the same tokens
// alone as in any batch. The PyTorch twin is engine/models/ops.py's TorchOps.lora_update.
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <ATen/Parallel.h>
#include "kernels.h"
#include "vec_math.h"
#include <vector>

namespace {

#if defined(MB_VEC_AVX2) && defined(__F16C__)
#define MB_LORA_F16C 1
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#endif

// x . w, w in fp16 (converted exactly to fp32)
inline float dot(const float* x, const at::Half* w, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef MB_LORA_F16C
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load8(w + i), acc);
  s = hsum(acc);
#endif
  for (; i < n; ++i) s += x[i] * static_cast<float>(w[i]);
  return s;
}

constexpr int64_t kColumns = 256;  // outputs a chunk of the second pass computes
constexpr int64_t kTile = 8;  // rows of one adapter that share each read of its A and B

}  // namespace

// y: [n, out] fp32, updated in place. x: [n, in] fp32 (rows contiguous). a: [S, R, in], bt: [S, R, out] fp16
// contiguous (half the bytes a step reads; the adapters' weights are most of what LoRA adds to it): the served adapters' A and B^T, padded with zeros to the largest rank R. ranks: [S] int32 (each
// adapter's rank in this projection, 0 where it leaves it alone). slots: [n, K] int32 (each row's adapters,
// -1 for none), scales: [n, K] fp32.
void lora_update(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor bt, at::Tensor ranks, at::Tensor slots,
                 at::Tensor scales) {
  TORCH_CHECK(y.dtype() == at::kFloat && y.dim() == 2 && y.stride(1) == 1, "y must be fp32 [n, out], rows contiguous");
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(0) == y.size(0),
              "x must be fp32 [n, in] with y's rows");
  TORCH_CHECK(a.dtype() == at::kHalf && a.dim() == 3 && a.is_contiguous() && a.size(2) == x.size(1),
              "a must be contiguous fp16 [S, R, in]");
  TORCH_CHECK(bt.dtype() == at::kHalf && bt.dim() == 3 && bt.is_contiguous() && bt.size(0) == a.size(0) &&
                  bt.size(1) == a.size(1) && bt.size(2) == y.size(1),
              "bt must be contiguous fp16 [S, R, out]");
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
  const at::Half* ap = a.data_ptr<at::Half>();
  const at::Half* bp = bt.data_ptr<at::Half>();
  const float* scp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  // Each adapter's entries (row, k), rows ascending, in tiles of kTile: a tile reads its adapter's A and B
  // once for all its rows (they stay in L1 between the rows), where a row at a time read them once a row.
  struct Tile {
    int32_t slot, first, count;
  };
  std::vector<int64_t> entries;  // row * K + k, grouped by slot
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < S; ++s) {
    if (rp[s] == 0) continue;
    const int64_t begin = (int64_t)entries.size();
    for (int64_t i = 0; i < n * K; ++i)
      if (sp[i] == s) entries.push_back(i);
    for (int64_t e = begin; e < (int64_t)entries.size(); e += kTile)
      tiles.push_back({(int32_t)s, (int32_t)e, (int32_t)std::min<int64_t>(kTile, (int64_t)entries.size() - e)});
  }
  if (tiles.empty()) return;
  // first pass: x A^T of each entry, [n, K, R]
  auto t = mb::empty({n, K, R}, at::kFloat);
  float* tp = t.data_ptr<float>();
  const int64_t nt = (int64_t)tiles.size();
  parallel_chunks_for_rows(n, nt, 1, [&](int64_t b, int64_t e) {
    for (int64_t ti = b; ti < e; ++ti) {
      const Tile& tile = tiles[ti];
      for (int64_t r = 0; r < rp[tile.slot]; ++r) {
        const at::Half* arow = ap + (tile.slot * R + r) * in;
        for (int32_t q = 0; q < tile.count; ++q) {
          const int64_t entry = entries[tile.first + q];
          tp[entry * R + r] = dot(xp + (entry / K) * ldx, arow, in);
        }
      }
    }
  });
  // second pass: each entry's update, a chunk of outputs at a time, over its adapter's rank; added to y at
  // once where a row has one adapter, else kept apart and summed in the row's order below
  const int64_t chunks = (out + kColumns - 1) / kColumns;
  at::Tensor parts;
  float* dp = nullptr;
  if (K > 1) {
    parts = mb::empty({n, K, out}, at::kFloat);
    dp = parts.data_ptr<float>();
  }
  parallel_chunks_for_rows(n, nt * chunks, 1, [&](int64_t b, int64_t e) {
    float acc[kTile][kColumns];
    for (int64_t item = b; item < e; ++item) {
      const Tile& tile = tiles[item / chunks];
      const int64_t c0 = (item % chunks) * kColumns, width = std::min(kColumns, out - c0);
      for (int32_t q = 0; q < tile.count; ++q)
        for (int64_t j = 0; j < width; ++j) acc[q][j] = 0.0f;
      for (int64_t r = 0; r < rp[tile.slot]; ++r) {
        const at::Half* row = bp + (tile.slot * R + r) * out + c0;
        for (int32_t q = 0; q < tile.count; ++q) {
          const int64_t entry = entries[tile.first + q];
          const float w = tp[entry * R + r] * scp[entry];
          float* aq = acc[q];
          int64_t j = 0;
#ifdef MB_LORA_F16C
          const __m256 wv = _mm256_set1_ps(w);
          for (; j + 8 <= width; j += 8)
            _mm256_storeu_ps(aq + j, _mm256_fmadd_ps(wv, load8(row + j), _mm256_loadu_ps(aq + j)));
#endif
          for (; j < width; ++j) aq[j] = std::fma(w, static_cast<float>(row[j]), aq[j]);
        }
      }
      for (int32_t q = 0; q < tile.count; ++q) {
        const int64_t entry = entries[tile.first + q];
        float* dst = K == 1 ? yp + entry * ldy + c0 : dp + entry * out + c0;
        if (K == 1) {
          for (int64_t j = 0; j < width; ++j) dst[j] += acc[q][j];
        } else {
          for (int64_t j = 0; j < width; ++j) dst[j] = acc[q][j];
        }
      }
    }
  });
  if (K == 1) return;
  // rows of several adapters: their updates summed in the row's order, then added once
  parallel_for_rows(n, 0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float* dst = yp + i * ldy;
      bool any = false;
      for (int64_t k = 0; k < K; ++k) any |= sp[i * K + k] >= 0 && rp[sp[i * K + k]] > 0;
      if (!any) continue;
      for (int64_t j = 0; j < out; ++j) {
        float sum = 0.0f;
        for (int64_t k = 0; k < K; ++k) {
          const int32_t s = sp[i * K + k];
          if (s >= 0 && rp[s] > 0) sum += dp[(i * K + k) * out + j];
        }
        dst[j] += sum;
      }
    }
  });
}
