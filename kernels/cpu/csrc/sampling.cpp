// The sampler's kernels: each row's argmax, and one fused pass per row that applies a grammar's mask,
// temperature, top-k, top-p and min-p and draws the token, without sorting the vocabulary. The PyTorch twin
// (TorchOps.sample_tokens in engine/models/ops.py) states the same rule by sorting, in float64; the tests hold the
// two to the same candidate sets and the same draws.
//
// The rule (both sides). Order the row's tokens by logit, highest first, the lower id first among equal
// logits. top-k keeps the tokens whose logit is at least the k-th's (ties with the k-th are kept); top-p
// keeps, in that order, each token while the probability mass before it (at the row's temperature, over
// the top-k set) is below top_p; min-p keeps the tokens with (logit - max) / temperature >= ln(min_p).
// Each is a prefix of the order, so together they keep the shortest of the three. The draw inverts the
// kept tokens' distribution function, in token-id order, at the uniform that Philox gives for (key,
// position). Temperature 0, or a row whose largest logit is not finite, takes the argmax (the first of
// ties; a NaN counts as the largest), as a masked logit is never drawn.
//
// How the kernel avoids the sort. One pass finds the maximum; a second computes every token's weight
// exp((l - max) / T) in floats, and collects, in id order, the candidates above a threshold (8 nats below
// the top, or min-p's own when that is tighter), whose weights are then taken again in doubles: the cuts sum
// those, as the twin does, so a cut through a large group of tied tokens falls where the twin's does. The
// candidates go into 2,048 bins by logit (a bin's tokens all come before the next bin's in the order), each
// bin's count and mass summed; top-k's k-th and top-p's boundary are then each in one bin, and only that
// bin's tokens are selected among or sorted. When
// the candidates cannot decide (fewer than k of them, or their mass short of top_p), the threshold drops
// 8 nats and they are collected again, down to every finite token.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"
#include "philox.h"
#include "vec_math.h"

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == at::kFloat && t.dim() == 2 && t.stride(1) == 1, name, " must be fp32 [tokens, dim] with contiguous rows");
}

// The index of the row's largest value, the first of several that tie; a row holding a NaN gives its first
// NaN, as torch.argmax does. Two passes over the row (it stays in cache): its maximum and whether it holds
// a NaN, then the first place that matches.
inline int64_t argmax_row(const float* v, int64_t n) {
  float best;
  bool nan;
  max_and_nan(v, n, best, nan);
  int64_t i = 0;
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

// One row's settings, as the Python side packs them.
struct RowSettings {
  double temperature;  // 0: greedy
  double top_p;        // 1: off
  double min_p;        // 0: off
  int64_t top_k;       // <= 0 or >= the vocabulary: off
  uint64_t key;
  uint64_t counter;
};

struct Cand {
  float l;     // the logit: the order's key, with the id
  int32_t id;  // the token
  double w;    // exp((l - max) / T), in doubles (the twin's precision: top-p's cut sums these)
};

// a comes before b in the order: the higher logit, the lower id among equal ones
inline bool ahead(const Cand& a, const Cand& b) { return a.l > b.l || (a.l == b.l && a.id < b.id); }

// Per thread, grown to the largest vocabulary seen: a row's masked logits, weights, candidate ids and records.
struct Scratch {
  std::vector<float> x, w;
  std::vector<int32_t> ids;
  std::vector<double> wc;  // the candidates' weights in doubles, in id order
  std::vector<uint16_t> bins;  // each candidate's bin
  std::vector<Cand> cand;
  std::vector<float> sample;  // every 64th logit (top-k's first threshold)
  static constexpr int kBins = 2048;
  int32_t bin_count[kBins];
  double bin_mass[kBins];
  void fit(int64_t n) {
    if ((int64_t)w.size() < n) {
      x.resize(n);
      w.resize(n);
      ids.resize(n);
      wc.resize(n);
      bins.resize(n);
      cand.resize(n);
      sample.resize(n / 64 + 1);
    }
  }
};

// w[i] = exp((l[i] - m) * inv_t) in floats (0 for a -inf logit); returns their sum (floats within blocks
// of 256, doubles across). The ids whose logit is >= lt are written to ids, in order (*count says how many),
// and *below is the sum of the others' weights.
double weigh_and_collect(const float* l, int64_t n, float m, float inv_t, float lt, float* w, int32_t* ids, int64_t* count,
                         double* below) {
  constexpr int64_t kBlock = 256;
  double total = 0.0, tail = 0.0;
  int64_t c = 0;
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t i1 = std::min(n, i0 + kBlock);
    float part = 0.0f, part_below = 0.0f;
    int64_t i = i0;
#ifdef MB_VEC_AVX2
    const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t), ninf = _mm256_set1_ps(-INFINITY), vlt = _mm256_set1_ps(lt);
    __m256 acc = _mm256_setzero_ps(), acc_below = _mm256_setzero_ps();
    for (; i + 8 <= i1; i += 8) {
      const __m256 x = _mm256_loadu_ps(l + i);
      const __m256 e = _mm256_and_ps(exp256(_mm256_mul_ps(_mm256_sub_ps(x, vm), vt)), _mm256_cmp_ps(x, ninf, _CMP_GT_OQ));
      _mm256_storeu_ps(w + i, e);
      acc = _mm256_add_ps(acc, e);
      const __m256 in = _mm256_cmp_ps(x, vlt, _CMP_GE_OQ);
      acc_below = _mm256_add_ps(acc_below, _mm256_andnot_ps(in, e));
      int hit = _mm256_movemask_ps(in);
      while (hit) {
        ids[c++] = (int32_t)(i + __builtin_ctz(hit));
        hit &= hit - 1;
      }
    }
    part = hsum(acc);
    part_below = hsum(acc_below);
#endif
    for (; i < i1; ++i) {
      w[i] = l[i] > -INFINITY ? std::exp((l[i] - m) * inv_t) : 0.0f;
      part += w[i];
      if (l[i] >= lt)
        ids[c++] = (int32_t)i;
      else
        part_below += w[i];
    }
    total += part;
    tail += part_below;
  }
  *count = c;
  *below = tail;
  return total;
}

// The ids whose logit is >= lt, in order; *below: the others' weights summed.
int64_t collect(const float* l, const float* w, int64_t n, float lt, int32_t* ids, double* below) {
  int64_t c = 0, i = 0;
  double tail = 0.0;
#ifdef MB_VEC_AVX2
  const __m256 vlt = _mm256_set1_ps(lt);
  for (; i + 8 <= n; i += 8) {
    const __m256 in = _mm256_cmp_ps(_mm256_loadu_ps(l + i), vlt, _CMP_GE_OQ);
    tail += hsum(_mm256_andnot_ps(in, _mm256_loadu_ps(w + i)));
    int hit = _mm256_movemask_ps(in);
    while (hit) {
      ids[c++] = (int32_t)(i + __builtin_ctz(hit));
      hit &= hit - 1;
    }
  }
#endif
  for (; i < n; ++i)
    if (l[i] >= lt)
      ids[c++] = (int32_t)i;
    else
      tail += w[i];
  *below = tail;
  return c;
}


// The candidates' weights in doubles, as the twin computes them: exp((l - m) / T).
void weigh_candidates(const float* l, const int32_t* ids, int64_t count, double m, double t, double* wc) {
  for (int64_t j = 0; j < count; ++j) wc[j] = ((double)l[ids[j]] - m) / t;
  int64_t j = 0;
#ifdef MB_VEC_AVX2
  for (; j + 4 <= count; j += 4) _mm256_storeu_pd(wc + j, exp256d(_mm256_loadu_pd(wc + j)));
#endif
  for (; j < count; ++j) wc[j] = std::exp(wc[j]);
}

// One draw from all of the row's weights (no cut): the first index whose running sum passes u * total;
// the last index with weight where rounding leaves the target past every sum.
int64_t draw_all(const float* w, int64_t n, double total, double u, int64_t top) {
  const double target = u * total;
  double run = 0.0;
  int64_t last = top;
  constexpr int64_t kBlock = 256;
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t i1 = std::min(n, i0 + kBlock);
    float part = 0.0f;
#pragma omp simd reduction(+ : part)
    for (int64_t i = i0; i < i1; ++i) part += w[i];
    if (run + part <= target) {  // the block's float sum may round: the walk below falls through when so
      run += part;
      continue;
    }
    for (int64_t i = i0; i < i1; ++i) {
      if (w[i] <= 0.0f) continue;
      run += w[i];
      last = i;
      if (run > target) return i;
    }
  }
  return last;
}

// Every finite logit kept (no cut): how many, and the last in the order. Only for sample_cuts (the tests).
void cut_of_all(const float* l, int64_t n, int64_t* cut) {
  Cand last{INFINITY, -1, 0.0};
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!(l[i] > -INFINITY)) continue;
    ++count;
    const Cand c{l[i], (int32_t)i, 0.0};
    if (last.id < 0 || ahead(last, c)) last = c;
  }
  cut[0] = count;
  cut[1] = last.id;
}

// One row's token. With `cut` (the tests' sample_cuts), also what the rule keeps: how many tokens, and the
// last of them in the order (a prefix of the order is known by its last token).
// Kept out of interprocedural optimization: specialised to its one caller, the compiler knew `sc` as that
// caller's thread_local and looked its address up again in the candidate loops (a __tls_get_addr call per
// token: a third of a flat row's time).
__attribute__((noipa)) int64_t sample_row(const float* logits, int64_t n, const int32_t* mask, const RowSettings& s,
                                             Scratch& sc, int64_t* cut) {
  const float* l = logits;
  if (mask != nullptr) {  // a grammar's allowed tokens, one bit each: the rest become -inf
    float* x = sc.x.data();
    for (int64_t i = 0; i < n; ++i) x[i] = (mask[i >> 5] >> (i & 31)) & 1 ? logits[i] : -INFINITY;
    l = x;
  }
  const int64_t top = argmax_row(l, n);
  const float m = l[top];
  if (!(m > -INFINITY && m < INFINITY) || !(s.temperature > 0.0)) {
    if (cut) cut[0] = 1, cut[1] = top;
    return top;
  }
  const double u = mb::philox_uniform(s.key, s.counter);
  const float inv_t = (float)(1.0 / s.temperature);
  const bool cut_k = s.top_k > 0 && s.top_k < n, cut_p = s.top_p < 1.0, cut_m = s.min_p > 0.0;
  float* w = sc.w.data();
  int32_t* ids = sc.ids.data();
  int64_t count = 0;
  double below = 0.0;  // the weight of the tokens below the candidates
  if (!cut_k && !cut_p && !cut_m) {
    const double total = weigh_and_collect(l, n, m, inv_t, INFINITY, w, ids, &count, &below);
    if (cut) cut_of_all(l, n, cut);
    return draw_all(w, n, total, u, top);
  }
  const double ln_min_p = cut_m ? std::log(s.min_p) : -INFINITY;
  // The first threshold: 8 nats below the top, or min-p's where that is tighter. A float just below it,
  // so that the candidates hold every token min-p keeps (its exact test comes last, in doubles).
  double z = std::max(-8.0, ln_min_p);
  if (cut_k && n >= 8192 && s.top_k <= n / 64) {
    // A flat row (a random-weight model's) has most of its tokens within 8 nats of the top. Top-k needs only
    // k: every 64th logit, the one at twice k's share of them (and a few more) gives a tighter threshold.
    float* sample = sc.sample.data();
    int64_t ns = 0;
    for (int64_t i = 0; i < n; i += 64)
      if (l[i] > -INFINITY) sample[ns++] = l[i];
    const int64_t r = 2 * s.top_k * ns / n + 4;
    if (r < ns) {
      std::nth_element(sample, sample + r, sample + ns, [](float a, float b) { return a > b; });
      z = std::max(z, ((double)sample[r] - (double)m) / s.temperature);
    }
  }
  auto threshold = [&](double zz) {
    const float t = (float)((double)m + zz * s.temperature);
    return t - std::max(1.0f, std::fabs(t)) * 1e-5f;
  };
  float lt = threshold(z);  // the candidates' least logit is at least this
  weigh_and_collect(l, n, m, inv_t, lt, w, ids, &count, &below);
  double* wc = sc.wc.data();
  uint16_t* bins = sc.bins.data();
  int32_t* bin_count = sc.bin_count;
  double* bin_mass = sc.bin_mass;
  Cand* e = sc.cand.data();
  // What the cuts decide: top-k's k-th logit (every token at or above it is in the top-k set), and top-p's
  // boundary in the order: the last token kept, or where none is before it in its bin, the first dropped.
  float kth = -INFINITY;
  bool bounded = false, inclusive = false;
  Cand bound{0.0f, 0, 0.0};
  double cut_mass = -1.0;  // the mass top-k and top-p keep, where they decided it (min-p may cut further)
  double scale = 0.0;      // bin = (max - logit) * scale
  int kbin = Scratch::kBins, pbin = Scratch::kBins;  // the bins top-k's k-th and top-p's boundary are in
  for (;;) {
    const bool all = std::isinf(z);  // every token with a finite logit is a candidate
    weigh_candidates(l, ids, count, (double)m, s.temperature, wc);
    // The candidates in kBins bins by logit, the top's first: a bin's tokens all come before the next bin's
    // in the order, ties in one bin. Each bin's count and mass.
    float lo = std::min(m, lt);
    if (all) {
      lo = m;
      for (int64_t j = 0; j < count; ++j) lo = std::min(lo, l[ids[j]]);
    }
    scale = m > lo ? (Scratch::kBins - 1) / ((double)m - (double)lo) : 0.0;
    std::fill(bin_count, bin_count + Scratch::kBins, 0);
    std::fill(bin_mass, bin_mass + Scratch::kBins, 0.0);
    double total = below;  // the row's mass: the candidates' in doubles, the rest's in floats
    {
      const float* __restrict lp = l;
      const int32_t* __restrict ip = ids;
      const double* __restrict wp = wc;
      uint16_t* __restrict bp = bins;
      int32_t* __restrict cp = bin_count;
      double* __restrict mp = bin_mass;
      const double top_d = (double)m;
      for (int64_t j = 0; j < count; ++j) {
        const int b = (int)((top_d - (double)lp[ip[j]]) * scale);
        bp[j] = (uint16_t)b;
        cp[b] += 1;
        mp[b] += wp[j];
        total += wp[j];
      }
    }
    // the tokens of bin b (those at or above the k-th when top-k cut inside it), into e
    auto gather = [&](int b) {
      int64_t k = 0;
      for (int64_t j = 0; j < count; ++j)
        if (bins[j] == b && l[ids[j]] >= kth) e[k++] = {l[ids[j]], ids[j], wc[j]};
      return k;
    };
    bool decided = true;
    kbin = pbin = Scratch::kBins;  // top-k's bin: those after it are out, its own tokens below the k-th too
    double kmass = 0.0;            // the top-k set's mass
    kth = -INFINITY;
    cut_mass = -1.0;
    if (cut_k) {
      if (count >= s.top_k) {
        int64_t before = 0;
        kbin = 0;
        while (before + bin_count[kbin] < s.top_k) before += bin_count[kbin], kmass += bin_mass[kbin], ++kbin;
        const int64_t nb = gather(kbin);
        std::nth_element(e, e + (s.top_k - before) - 1, e + nb, ahead);
        kth = e[s.top_k - before - 1].l;  // and every token tied with it
        for (int64_t j = 0; j < nb; ++j)
          if (e[j].l >= kth) kmass += e[j].w;
        cut_mass = kmass;
      } else {
        // Fewer candidates than k: top-k keeps them all; only min-p can still decide, and only without top-p
        // (whose mass is taken over the top-k set, which reaches below the candidates).
        decided = all || (!cut_p && z <= ln_min_p);
      }
    }
    bounded = false;
    if (decided && cut_p) {
      const double target = s.top_p * (kbin < Scratch::kBins ? kmass : total);
      double before = 0.0;
      int b = 0;
      for (; b < Scratch::kBins && b <= kbin; ++b) {
        double mb = bin_mass[b];
        if (b == kbin) {  // only the tokens at or above the k-th
          mb = 0.0;
          for (int64_t j = 0; j < count; ++j)
            if (bins[j] == b && l[ids[j]] >= kth) mb += wc[j];
        }
        if (before + mb >= target) break;
        before += mb;
      }
      if (b < Scratch::kBins && b <= kbin) {  // the first token dropped is in bin b, or right after it
        const int64_t nb = gather(b);
        std::sort(e, e + nb, ahead);
        int64_t i = 0;
        while (i < nb && before < target) before += e[i++].w;
        cut_mass = before;  // the kept tokens are exactly those summed
        bounded = true;
        pbin = b;
        inclusive = i > 0;  // the last kept, in this bin; else this bin's first is the first dropped
        bound = inclusive ? e[i - 1] : e[0];
      } else {
        // The candidates' mass is short of the target: decided only when nothing below them is kept anyway.
        decided = kbin < Scratch::kBins || all || z <= ln_min_p;
      }
    }
    if (decided) break;
    z = z - 8.0 < -40.0 ? -INFINITY : z - 8.0;
    lt = std::isinf(z) ? -std::numeric_limits<float>::max() : threshold(z);
    count = collect(l, w, n, lt, ids, &below);
  }
  // What is kept: in the top-k set, on the right side of top-p's boundary, and past min-p's test (exactly).
  // By bins first: those before every cut's bin are all kept, those after any cut's are not; only the tokens
  // of the bins between are tested one by one (min-p's bin with one bin of margin each side, for rounding).
  int full = std::min(kbin, pbin), last = std::min(std::min(kbin, pbin), Scratch::kBins - 1);
  if (cut_m) {
    const double at = ((double)m - ((double)m + ln_min_p * s.temperature)) * scale;
    if (at < Scratch::kBins + 1) {
      const int bm = (int)std::max(0.0, at);
      full = std::min(full, std::max(0, bm - 1));
      last = std::min(last, std::min(Scratch::kBins - 1, bm + 1));
    }
  }
  auto tested = [&](const Cand& c) {
    if (c.l < kth) return false;
    if (bounded && (inclusive ? ahead(bound, c) : !ahead(c, bound))) return false;
    return !(cut_m && ((double)c.l - (double)m) / s.temperature < ln_min_p);
  };
  auto kept = [&](int64_t j) {
    const int b = bins[j];
    return b < full || (b <= last && tested({l[ids[j]], ids[j], wc[j]}));
  };
  double mass = 0.0;
  if (cut) {
    Cand end{INFINITY, -1, 0.0};
    int64_t left = 0;
    for (int64_t j = 0; j < count; ++j) {
      const Cand c{l[ids[j]], ids[j], wc[j]};
      if (!kept(j)) continue;
      if (end.id < 0 || ahead(end, c)) end = c;
      ++left;
    }
    cut[0] = left, cut[1] = end.id;
  }
  if (cut_m || cut_mass < 0.0) {
    for (int64_t j = 0; j < count; ++j)
      if (kept(j)) mass += wc[j];
  } else {
    mass = cut_mass;
  }
  // The draw, over the kept candidates in id order.
  const double goal = u * mass;
  double run = 0.0;
  int64_t pick = top;
  for (int64_t j = 0; j < count; ++j) {
    if (wc[j] <= 0.0 || !kept(j)) continue;
    run += wc[j];
    pick = ids[j];
    if (run > goal) break;
  }
  return pick;
}

}  // namespace

// [rows, n] -> int64 [rows]: each row's argmax (rows split over the kernels' threads)
at::Tensor argmax_rows(at::Tensor x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  TORCH_CHECK(n > 0, "argmax_rows needs at least one value per row");
  auto out = mb::empty({rows}, at::kLong);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  parallel_for_rows(rows, 0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) op[r] = argmax_row(xp + r * ld, n);
  });
  return out;
}

namespace {

void check_settings(const at::Tensor& logits, const at::Tensor& settings, const at::Tensor& streams, const at::Tensor& masks) {
  check_rows(logits, "logits");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n > 0 && n < (int64_t{1} << 31), "sampling needs 1 to 2^31 - 1 values per row");
  TORCH_CHECK(settings.dtype() == at::kDouble && settings.is_contiguous() && settings.dim() == 2 && settings.size(0) == rows &&
                  settings.size(1) == 4,
              "settings must be contiguous fp64 [rows, 4]");
  TORCH_CHECK(streams.dtype() == at::kLong && streams.is_contiguous() && streams.dim() == 2 && streams.size(0) == rows &&
                  streams.size(1) == 2,
              "streams must be contiguous int64 [rows, 2]");
  if (masks.numel() > 0)
    TORCH_CHECK(masks.dtype() == at::kInt && masks.is_contiguous() && masks.dim() == 2 && masks.size(0) == rows &&
                    masks.size(1) == (n + 31) / 32,
                "masks must be contiguous int32 [rows, ceil(n / 32)]");
}

// Every row through sample_row, rows split over the kernels' threads; cuts: [rows, 2] or null.
void sample_all(const at::Tensor& logits, const at::Tensor& settings, const at::Tensor& streams, const at::Tensor& masks,
                int64_t* out, int64_t* cuts) {
  const int64_t rows = logits.size(0), n = logits.size(1), ld = logits.stride(0), words = (n + 31) / 32;
  const float* lp = logits.data_ptr<float>();
  const double* sp = settings.data_ptr<double>();
  const int64_t* kp = streams.data_ptr<int64_t>();
  const int32_t* mp = masks.numel() > 0 ? masks.data_ptr<int32_t>() : nullptr;
  parallel_for_rows(rows, 0, rows, 1, [&](int64_t b, int64_t e) {
    thread_local Scratch scratch;
    scratch.fit(n);
    for (int64_t r = b; r < e; ++r) {
      const double* q = sp + r * 4;
      const int64_t k = q[3] >= (double)n ? n : (int64_t)q[3];
      const RowSettings s{q[0], q[1], q[2], k, (uint64_t)kp[r * 2], (uint64_t)kp[r * 2 + 1]};
      out[r] = sample_row(lp + r * ld, n, mp ? mp + r * words : nullptr, s, scratch, cuts ? cuts + r * 2 : nullptr);
    }
  });
}

}  // namespace

// logits fp32 [rows, n]; settings fp64 [rows, 4] (temperature, top_p, min_p, top_k); streams int64 [rows, 2]
// (Philox key, counter); masks int32 [rows, ceil(n / 32)] of allowed-token bits, or an empty tensor for none
// -> int64 [rows]: one token per row by the rule above.
at::Tensor sample_tokens(at::Tensor logits, at::Tensor settings, at::Tensor streams, at::Tensor masks) {
  check_settings(logits, settings, streams, masks);
  auto out = mb::empty({logits.size(0)}, at::kLong);
  sample_all(logits, settings, streams, masks, out.data_ptr<int64_t>(), nullptr);
  return out;
}

// The same, returning what the rule keeps instead: int64 [rows, 2], how many tokens and the last of them in
// the order (the tests hold it to the twin's set).
at::Tensor sample_cuts(at::Tensor logits, at::Tensor settings, at::Tensor streams, at::Tensor masks) {
  check_settings(logits, settings, streams, masks);
  const int64_t rows = logits.size(0);
  auto out = mb::empty({rows}, at::kLong);
  auto cuts = mb::empty({rows, 2}, at::kLong);
  sample_all(logits, settings, streams, masks, out.data_ptr<int64_t>(), cuts.data_ptr<int64_t>());
  return cuts;
}

// keys, counters int64 [n] -> fp64 [n]: Philox's uniform for each pair (the sampler's draws; for the tests)
at::Tensor philox_uniforms(at::Tensor keys, at::Tensor counters) {
  TORCH_CHECK(keys.dtype() == at::kLong && counters.dtype() == at::kLong && keys.is_contiguous() && counters.is_contiguous() &&
                  keys.numel() == counters.numel(),
              "keys and counters must be contiguous int64 of one length");
  auto out = mb::empty({keys.numel()}, at::kDouble);
  const int64_t* k = keys.data_ptr<int64_t>();
  const int64_t* c = counters.data_ptr<int64_t>();
  double* o = out.data_ptr<double>();
  for (int64_t i = 0; i < keys.numel(); ++i) o[i] = mb::philox_uniform((uint64_t)k[i], (uint64_t)c[i]);
  return out;
}
