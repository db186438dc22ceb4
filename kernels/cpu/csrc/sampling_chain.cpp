// The samplers the fused pass does not hold -- top-nσ, typical-p, XTC and Mirostat 2.0 -- as one chain per row
// over the row's likely tokens, in doubles. engine/runner/chain.py states the same chain in NumPy (its
// docstring gives the rule step by step); that is the twin these kernels are tested against, token for token.
//
// Per row: the tokens within kTail nats of the most likely one at the row's temperature are the candidates
// (one pass over the row, after the grammar's mask). The cuts run in llama.cpp's order (our temperature first)
// and take the candidates by logit (higher first, the lower id first among ties); the draw inverts the kept
// weights' distribution function in token-id order (as the fused pass's) at the row's Philox uniform, and
// XTC's coin is the second half of the same Philox block. So only typical-p orders its candidates, those in
// the bins by distance from the entropy that hold typical_p's mass (narrow_for_typical; by radix where they
// are many); without it every cut is a threshold but top-p, whose boundary bin alone is ordered
// (draw_unordered), and Mirostat's cut is a threshold. Rows run one after another on the calling thread.
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"
#include "philox.h"
#include "vec_math.h"

namespace {

constexpr double kTail = 20.0;   // nats below the top: the chain's candidates (chain.py's TAIL)
constexpr int kSettings = 12;    // per row: see ChainSettings

struct ChainSettings {
  double temperature, top_k, top_p, min_p, top_n_sigma, typical_p, xtc_probability, xtc_threshold, mirostat,
      mirostat_tau, mirostat_eta, mu;  // mu: NaN before the first Mirostat draw (or without Mirostat)
};

struct Token {
  double x;
  int32_t id;
  int32_t pos;  // where an ordered path found it in id order (the draw's order)
};

// The index where the weights' running sum first passes u x their total; the last weighted one where rounding
// leaves the target past every sum (chain.py's _draw).
int64_t draw(const std::vector<double>& w, double u) {
  double total = 0.0;
  for (double v : w) total += v;
  const double goal = u * total;
  double run = 0.0;
  for (size_t i = 0; i < w.size(); ++i) {
    run += w[i];
    if (run > goal) return (int64_t)i;
  }
  for (size_t i = w.size(); i-- > 0;)
    if (w[i] > 0.0) return (int64_t)i;
  return 0;
}

// The row's maximum and the first index holding it, over the allowed tokens; a NaN (NumPy's argmax gives the
// first) reports itself as the maximum. Without a mask the scan runs eight floats at a time.
void row_max(const float* row, const int32_t* mask, int64_t n, double& m, int64_t& top) {
  float best = -INFINITY;
  bool nan = false;
  int64_t i = 0;
  if (mask == nullptr) {
    max_and_nan(row, n, best, nan);
  } else {
    for (; i < n; ++i) {
      if (!((mask[i >> 5] >> (i & 31)) & 1)) continue;
      best = std::max(best, row[i]);
      nan = nan || row[i] != row[i];
    }
  }
  for (i = 0; i < n; ++i) {
    if (mask != nullptr && !((mask[i >> 5] >> (i & 31)) & 1)) continue;
    if (nan ? row[i] != row[i] : row[i] == best) break;
  }
  top = i < n && (nan || best > -INFINITY) ? i : 0;  // nothing above -inf: the first token, as NumPy's argmax
  m = nan ? std::nan("") : (double)best;
}

// The standard deviation of the row's finite allowed logits (NumPy's x[isfinite(x)].std()), in doubles.
double row_sigma(const float* row, const int32_t* mask, int64_t n) {
  double sum = 0.0, sq = 0.0;
  int64_t count = 0;
#ifdef MB_VEC_AVX2
  if (mask == nullptr) {  // four doubles at a time, the non-finite values left out
    const __m256d inf = _mm256_set1_pd(INFINITY);
    __m256d vs = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(row + i));
      const __m256d fin = _mm256_cmp_pd(_mm256_andnot_pd(_mm256_set1_pd(-0.0), v), inf, _CMP_LT_OQ);
      vs = _mm256_add_pd(vs, _mm256_and_pd(v, fin));
      count += __builtin_popcount(_mm256_movemask_pd(fin));
    }
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, vs);
    sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; i < n; ++i)
      if (std::isfinite(row[i])) sum += row[i], ++count;
    const double mean = sum / (double)count;
    const __m256d vm = _mm256_set1_pd(mean);
    __m256d vq = _mm256_setzero_pd();
    for (i = 0; i + 4 <= n; i += 4) {
      const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(row + i));
      const __m256d fin = _mm256_cmp_pd(_mm256_andnot_pd(_mm256_set1_pd(-0.0), v), inf, _CMP_LT_OQ);
      const __m256d d = _mm256_and_pd(_mm256_sub_pd(v, vm), fin);
      vq = _mm256_fmadd_pd(d, d, vq);
    }
    _mm256_store_pd(lanes, vq);
    sq = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; i < n; ++i)
      if (std::isfinite(row[i])) sq += ((double)row[i] - mean) * ((double)row[i] - mean);
    return std::sqrt(sq / (double)count);
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    if (mask != nullptr && !((mask[i >> 5] >> (i & 31)) & 1)) continue;
    if (std::isfinite(row[i])) sum += row[i], ++count;
  }
  const double mean = sum / (double)count;
  for (int64_t i = 0; i < n; ++i) {
    if (mask != nullptr && !((mask[i >> 5] >> (i & 31)) & 1)) continue;
    if (std::isfinite(row[i])) sq += ((double)row[i] - mean) * ((double)row[i] - mean);
  }
  return std::sqrt(sq / (double)count);
}

// The allowed tokens whose logit, in doubles, is at least `floor`, in id order: a float pre-test eight at a
// time (a float threshold just under the double one), then the exact test on those that pass.
void collect(const float* row, const int32_t* mask, int64_t n, double floor, std::vector<Token>& cand) {
  cand.clear();
  const float below = std::nextafter((float)floor, -INFINITY);
  int64_t i = 0;
#ifdef MB_VEC_AVX2
  const __m256 f = _mm256_set1_ps(below);
  for (; i + 8 <= n; i += 8) {
    int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), f, _CMP_GE_OQ));
    while (hit) {
      const int64_t j = i + __builtin_ctz(hit);
      hit &= hit - 1;
      if ((double)row[j] >= floor && (mask == nullptr || ((mask[j >> 5] >> (j & 31)) & 1))) cand.push_back({(double)row[j], (int32_t)j, 0});
    }
  }
#endif
  for (; i < n; ++i)
    if (row[i] >= below && (double)row[i] >= floor && (mask == nullptr || ((mask[i >> 5] >> (i & 31)) & 1)))
      cand.push_back({(double)row[i], (int32_t)i, 0});
}

// Each candidate's weight exp((x - m) / t), four at a time where AVX2 is built (a few ulp from the twin's).
void weigh(const std::vector<Token>& cand, double m, double t, std::vector<double>& w) {
  const size_t c = cand.size();
  w.resize(c);
  for (size_t i = 0; i < c; ++i) w[i] = (cand[i].x - m) / t;
  size_t i = 0;
#ifdef MB_VEC_AVX2
  for (; i + 4 <= c; i += 4) _mm256_storeu_pd(&w[i], exp256d(_mm256_loadu_pd(&w[i])));
#endif
  for (; i < c; ++i) w[i] = std::exp(w[i]);
}

// The candidates by logit, higher first, in the order they came among equals (std::stable_sort's order: they
// come in id order). Many are sorted by radix on their float's bits, three passes of 11 bits (a flat row's
// 150k candidates in about a millisecond, not ten); a logit is a float, so its bits order the doubles as
// their values do, once -0 is taken as +0.
void by_logit(std::vector<Token>& cand, std::vector<Token>& scratch) {
  const size_t c = cand.size();
  if (c < 512) {
    std::stable_sort(cand.begin(), cand.end(), [](const Token& a, const Token& b) { return a.x > b.x; });
    return;
  }
  auto key = [](double x) {  // larger logits give smaller keys
    const float f = x == 0.0 ? 0.0f : (float)x;
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return ~(u & 0x80000000u ? ~u : u | 0x80000000u);
  };
  scratch.resize(c);
  std::vector<uint32_t> keys(c), keys2(c);
  for (size_t i = 0; i < c; ++i) keys[i] = key(cand[i].x);
  Token* from = cand.data();
  Token* to = scratch.data();
  uint32_t* kf = keys.data();
  uint32_t* kt = keys2.data();
  for (int shift = 0; shift < 32; shift += 11) {
    size_t count[2049] = {};
    for (size_t i = 0; i < c; ++i) ++count[((kf[i] >> shift) & 2047) + 1];
    for (int b = 0; b < 2048; ++b) count[b + 1] += count[b];
    for (size_t i = 0; i < c; ++i) {
      const size_t at = count[(kf[i] >> shift) & 2047]++;
      to[at] = from[i];
      kt[at] = kf[i];
    }
    std::swap(from, to);
    std::swap(kf, kt);
  }
  if (from != cand.data()) std::memcpy(cand.data(), from, c * sizeof(Token));  // (three passes: it ends in scratch)
}

// The k-th largest logit among the candidates, ties kept (-inf when top-k keeps them all).
double kth_logit(const std::vector<Token>& cand, int64_t top_k) {
  const int64_t c = (int64_t)cand.size();
  if (top_k <= 0 || top_k >= c) return -INFINITY;
  std::vector<double> xs(c);
  for (int64_t i = 0; i < c; ++i) xs[i] = cand[i].x;
  std::nth_element(xs.begin(), xs.begin() + (c - top_k), xs.end());
  return xs[c - top_k];
}

// Top-nσ and top-k, both thresholds on the logit (the k-th's, ties kept): the candidates they drop leave, in
// order, and w holds the weights of those that stay.
void keep_top_sigma_and_k(std::vector<Token>& cand, std::vector<double>& w, double m, double t, const ChainSettings& s,
                          double sigma) {
  const double kth = kth_logit(cand, (int64_t)s.top_k), sigma_floor = m - s.top_n_sigma * sigma;
  weigh(cand, m, t, w);
  size_t c = 0;
  for (size_t i = 0; i < cand.size(); ++i)
    if ((s.top_n_sigma <= 0 || cand[i].x >= sigma_floor) && cand[i].x >= kth) cand[c] = cand[i], w[c++] = w[i];
  cand.resize(c);
  w.resize(c);
}

// Typical-p keeps the tokens nearest the entropy by |c0 - z| until typical_p of the mass (chain_row's walk).
// The candidates that top-nσ and top-k keep (the others leave) go into bins by that distance, each bin's mass
// summed, in one pass; where the bins up to some b hold typical_p of the mass (with a margin for the order of
// the sums), every token of a later bin comes after them in the walk and is past the cut, so only the tokens
// of bins up to b stay to be sorted. The mass and the centre are given to the walk.
void narrow_for_typical(std::vector<Token>& cand, std::vector<double>& w, double m, double t, const ChainSettings& s,
                        double sigma, double& total_out, double& c0_out) {
  constexpr int kBins = 256;
  keep_top_sigma_and_k(cand, w, m, t, s, sigma);
  size_t c = cand.size();
  double total = 0.0;
  for (size_t i = 0; i < c; ++i) total += w[i];
  const double log_total = std::log(total);
  std::vector<double> d(c);
  double entropy = 0.0, reach = 0.0;
  for (size_t i = 0; i < c; ++i) {
    d[i] = (cand[i].x - m) / t;  // z, as chain_row's zc
    entropy += w[i] / total * (log_total - d[i]);
  }
  const double c0 = log_total - entropy;
  total_out = total;
  c0_out = c0;
  for (size_t i = 0; i < c; ++i) reach = std::max(reach, d[i] = std::fabs(c0 - d[i]));
  if (!(reach > 0.0) || !std::isfinite(reach)) return;
  const double scale = (kBins - 0.5) / reach;
  std::vector<uint8_t> bins(c);
  double mass[kBins] = {};
  for (size_t i = 0; i < c; ++i) mass[bins[i] = (uint8_t)std::min((int)(d[i] * scale), kBins - 1)] += w[i];
  const double goal = s.typical_p * total * (1.0 + 1e-9);
  double run = 0.0;
  int last = 0;
  for (; last < kBins; ++last)
    if ((run += mass[last]) >= goal) break;
  if (last >= kBins - 1) return;  // (the last bin is everything: nothing to narrow)
  size_t left = 0;
  for (size_t i = 0; i < c; ++i)
    if (bins[i] <= last) cand[left++] = cand[i];
  cand.resize(left);
}

// With neither typical-p nor Mirostat, every cut but top-p is a threshold and top-p keeps a prefix of the logit
// order, so nothing is ordered but the tokens of top-p's boundary: the candidates that top-nσ and top-k keep go
// into bins by (max - logit) / temperature, each bin's mass summed; those of the bins before the one where the
// mass reaches top_p of the total are kept, those after it are not, and only that bin's tokens are ordered and
// walked from the mass before it. Then min-p, XTC (its least likely token over the threshold: the lowest logit,
// the highest id among equals) and the draw, in id order. Returns the token.
int64_t draw_unordered(std::vector<Token>& cand, std::vector<double>& w, double m, double t, const ChainSettings& s,
                       double sigma, double u, double coin) {
  constexpr int kBins = 256;
  keep_top_sigma_and_k(cand, w, m, t, s, sigma);
  size_t c = cand.size();
  std::vector<char> keep(c, 1);
  if (s.top_p < 1) {
    const double scale = (kBins - 0.5) / kTail;
    std::vector<uint8_t> bins(c);
    double mass[kBins] = {}, total = 0.0;
    for (size_t i = 0; i < c; ++i) {
      mass[bins[i] = (uint8_t)std::min((int)((m - cand[i].x) / t * scale), kBins - 1)] += w[i];
      total += w[i];
    }
    const double goal = s.top_p * total;
    double before = 0.0;
    int last = 0;
    for (; last < kBins - 1 && before + mass[last] < goal; ++last) before += mass[last];
    std::vector<int32_t> edge;  // the boundary bin's tokens, by logit (the lower id first among equals)
    for (size_t i = 0; i < c; ++i) {
      keep[i] = bins[i] < last;
      if (bins[i] == last) edge.push_back((int32_t)i);
    }
    std::stable_sort(edge.begin(), edge.end(), [&](int32_t a, int32_t b) { return cand[a].x > cand[b].x; });
    for (int32_t i : edge) {
      keep[i] = before < goal;
      before += w[i];
    }
    size_t left = 0;  // what top-p dropped: out, in order (the steps after it see only what it kept)
    for (size_t i = 0; i < c; ++i)
      if (keep[i]) cand[left] = cand[i], w[left++] = w[i];
    cand.resize(c = left);
    w.resize(c);
    keep.assign(c, 1);
  }
  if (s.min_p > 0) {
    const double floor_z = std::log(s.min_p);
    for (size_t i = 0; i < c; ++i) keep[i] &= (cand[i].x - m) / t >= floor_z;
  }
  if (s.xtc_probability > 0 && s.xtc_threshold <= 0.5 && coin < s.xtc_probability) {
    double total = 0.0;
    for (size_t i = 0; i < c; ++i)
      if (keep[i]) total += w[i];
    int64_t over = 0, least = -1;
    for (size_t i = 0; i < c; ++i)
      if (keep[i] && w[i] / total >= s.xtc_threshold) {
        ++over;
        if (least < 0 || cand[i].x <= cand[least].x) least = (int64_t)i;
      }
    if (over >= 2)
      for (size_t i = 0; i < c; ++i)
        if (keep[i] && w[i] / total >= s.xtc_threshold && (int64_t)i != least) keep[i] = 0;
  }
  for (size_t i = 0; i < c; ++i)
    if (!keep[i]) w[i] = 0.0;
  return cand[draw(w, u)].id;
}

// One row: (token, Mirostat's new mu or NaN).
std::pair<int64_t, double> chain_row(const float* row, const int32_t* mask, int64_t n, const ChainSettings& s, double u,
                                     double coin, std::vector<Token>& cand, std::vector<Token>& scratch, std::vector<double>& w) {
  double m;
  int64_t top;
  row_max(row, mask, n, m, top);
  if (!std::isfinite(m)) return {top, s.mu};
  const double t = s.temperature;
  const double sigma = s.top_n_sigma > 0 ? row_sigma(row, mask, n) : 0.0;
  collect(row, mask, n, m - kTail * t, cand);
  if (s.mirostat == 2) {
    // Mirostat keeps the tokens whose surprise in the candidates' distribution is at most mu (the top always),
    // a threshold: nothing is ordered.
    const double mu = std::isnan(s.mu) ? 2.0 * s.mirostat_tau : s.mu;
    weigh(cand, m, t, w);
    double total = 0.0;
    for (double v : w) total += v;
    double kept_total = 0.0;
    size_t left = 0;  // those kept, in id order
    for (size_t i = 0; i < cand.size(); ++i)
      if (cand[i].id == top || -std::log2(w[i] / total) <= mu) cand[left] = cand[i], kept_total += w[left++] = w[i];
    cand.resize(left);
    w.resize(left);
    const int64_t at = draw(w, u);
    const double observed = -std::log2(w[at] / kept_total);
    return {cand[at].id, mu - s.mirostat_eta * (observed - s.mirostat_tau)};
  }
  if (s.typical_p >= 1) return {draw_unordered(cand, w, m, t, s, sigma, u, coin), std::nan("")};
  // Typical-p (only it orders the candidates): those top-nσ and top-k keep, narrowed to the ones it can keep
  double total, c0;
  narrow_for_typical(cand, w, m, t, s, sigma, total, c0);
  for (size_t i = 0; i < cand.size(); ++i) cand[i].pos = (int32_t)i;
  by_logit(cand, scratch);
  const size_t c = cand.size();
  std::vector<double> zc(c);
  for (size_t i = 0; i < c; ++i) zc[i] = (cand[i].x - m) / t;
  weigh(cand, m, t, w);
  std::vector<char> keep(c, 1);
  auto kept_mass = [&]() {
    double mass = 0.0;
    for (size_t i = 0; i < c; ++i)
      if (keep[i]) mass += w[i];
    return mass;
  };
  {
    // By how far each token's surprise, ln(total) - z, is from the entropy, the nearest first (the order among
    // equals): that distance is |c0 - z| with c0 = ln(total) - entropy, which falls along the order down to the
    // first token below c0 and rises after it, so the tokens are taken outwards from there, two runs merged,
    // with no sort.
    const size_t kept_n = c;
    std::vector<double> prob(c);
    for (size_t i = 0; i < c; ++i) prob[i] = w[i] / total;
    auto dist = [&](size_t i) { return std::fabs(c0 - zc[i]); };
    size_t right = 0;  // the first of the rising run
    while (right < kept_n && zc[right] >= c0) ++right;
    std::vector<char> inside(c, 0);
    double run = 0.0;  // the mass before each, as the twin's cumsum(ps) - ps gives it
    auto take = [&](size_t i) {
      run += prob[i];
      inside[i] = run - prob[i] < s.typical_p;
    };
    size_t left = right;  // the falling run, walked backwards: [0, left) still to take
    while (left > 0 || right < kept_n) {
      if (left > 0 && (right >= kept_n || dist(left - 1) <= dist(right))) {
        // a run of equal distances (equal logits) goes lowest index first, as the stable sort has it
        size_t from = left - 1;
        while (from > 0 && dist(from - 1) == dist(left - 1)) --from;
        for (size_t i = from; i < left; ++i) take(i);
        left = from;
      } else {
        take(right++);
      }
    }
    for (size_t i = 0; i < c; ++i) keep[i] &= inside[i];
  }
  if (s.top_p < 1) {
    const double goal = s.top_p * kept_mass();
    double run = 0.0;
    for (size_t i = 0; i < c; ++i) {
      const double wk = keep[i] ? w[i] : 0.0;
      run += wk;
      keep[i] &= run - wk < goal;
    }
  }
  if (s.min_p > 0) {
    const double floor_z = std::log(s.min_p);
    for (size_t i = 0; i < c; ++i) keep[i] &= zc[i] >= floor_z;
  }
  if (s.xtc_probability > 0 && s.xtc_threshold <= 0.5 && coin < s.xtc_probability) {
    const double total = kept_mass();
    int64_t over = 0, least = -1;
    for (size_t i = 0; i < c; ++i)
      if (keep[i] && w[i] / total >= s.xtc_threshold) ++over, least = (int64_t)i;
    if (over >= 2)
      for (size_t i = 0; i < c; ++i)
        if (keep[i] && w[i] / total >= s.xtc_threshold && (int64_t)i != least) keep[i] = 0;
  }
  // the draw in id order: each kept weight back at its place in it
  std::vector<double> kept(c, 0.0);
  std::vector<int32_t> ids(c);
  for (size_t i = 0; i < c; ++i) {
    kept[cand[i].pos] = keep[i] ? w[i] : 0.0;
    ids[cand[i].pos] = cand[i].id;
  }
  return {ids[draw(kept, u)], std::nan("")};
}

}  // namespace

// logits fp32 [rows, n]; settings fp64 [rows, 12] (temperature, top_k, top_p, min_p, top_n_sigma, typical_p,
// xtc_probability, xtc_threshold, mirostat, mirostat_tau, mirostat_eta, mu or NaN); streams int64 [rows, 2]
// (Philox key, counter); masks int32 [rows, ceil(n / 32)] of allowed-token bits, or an empty tensor for none
// -> fp64 [rows, 2]: each row's token and its Mirostat mu after the draw (NaN for a row without Mirostat).
at::Tensor sample_chain(at::Tensor logits, at::Tensor settings, at::Tensor streams, at::Tensor masks) {
  TORCH_CHECK(logits.dtype() == at::kFloat && logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be fp32 [rows, n] with contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1), ld = logits.stride(0), words = (n + 31) / 32;
  TORCH_CHECK(n > 0 && n < (int64_t{1} << 31), "sampling needs 1 to 2^31 - 1 values per row");
  TORCH_CHECK(settings.dtype() == at::kDouble && settings.is_contiguous() && settings.dim() == 2 &&
                  settings.size(0) == rows && settings.size(1) == kSettings,
              "settings must be contiguous fp64 [rows, 12]");
  TORCH_CHECK(streams.dtype() == at::kLong && streams.is_contiguous() && streams.dim() == 2 && streams.size(0) == rows &&
                  streams.size(1) == 2,
              "streams must be contiguous int64 [rows, 2]");
  if (masks.numel() > 0)
    TORCH_CHECK(masks.dtype() == at::kInt && masks.is_contiguous() && masks.dim() == 2 && masks.size(0) == rows &&
                    masks.size(1) == words,
                "masks must be contiguous int32 [rows, ceil(n / 32)]");
  auto out = mb::empty({rows, 2}, at::kDouble);
  const float* lp = logits.data_ptr<float>();
  const double* sp = settings.data_ptr<double>();
  const int64_t* kp = streams.data_ptr<int64_t>();
  const int32_t* mp = masks.numel() > 0 ? masks.data_ptr<int32_t>() : nullptr;
  double* op = out.data_ptr<double>();
  std::vector<Token> cand, scratch;
  std::vector<double> w;
  for (int64_t r = 0; r < rows; ++r) {
    const double* q = sp + r * kSettings;
    const ChainSettings s{q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7], q[8], q[9], q[10], q[11]};
    double u, coin;
    mb::philox_uniform_pair((uint64_t)kp[r * 2], (uint64_t)kp[r * 2 + 1], u, coin);
    const auto [token, mu] = chain_row(lp + r * ld, mp ? mp + r * words : nullptr, n, s, u, coin, cand, scratch, w);
    op[r * 2] = (double)token;
    op[r * 2 + 1] = mu;
  }
  return out;
}
