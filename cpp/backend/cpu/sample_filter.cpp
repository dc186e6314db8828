// The host sampler's filters and draw (see sample_filter.h): O(vocab) passes over one row, selection instead of full
// sorts wherever the filters allow it.
#include "backend/cpu/sample_filter.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

#include "backend/cpu/sum_exp.h"

namespace exl2::cpu {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Reorders v so that v[0, keep) is the shortest prefix, in the strict total order `before`, whose mass (sum of
// weight(x)) reaches target, and returns keep (all of v when rounding leaves the full sum short). Quickselect by
// mass, O(n) expected, no full sort. Invariant: v[0, lo) precede everything in [lo, hi) and hold mass acc < target;
// the cut lies in [lo, hi). Each round partitions [lo, hi) around a median-of-3 pivot and keeps the side holding the
// cut; the last few elements are sorted and scanned. The kept prefix is in no particular order.
template <typename T, typename Before, typename Weight>
size_t select_prefix_by_mass(std::vector<T>& v, double target, Before before, Weight weight) {
  size_t lo = 0, hi = v.size();
  double acc = 0.0;
  while (hi - lo > 64) {
    const T& a = v[lo];
    const T& b = v[lo + (hi - lo) / 2];
    const T& c = v[hi - 1];
    const T pv =
        before(a, b) ? (before(b, c) ? b : (before(a, c) ? c : a)) : (before(a, c) ? a : (before(b, c) ? c : b));
    auto first = v.begin() + lo;
    auto last = v.begin() + hi;
    auto split = std::partition(first, last, [&](const T& x) { return before(x, pv); });
    // pv is unique under a strict total order: it is the first element not before itself and not after it
    std::iter_swap(split, std::find_if(split, last, [&](const T& x) { return !before(pv, x); }));
    double mass_before = 0.0;
    for (auto it = first; it != split; ++it) mass_before += weight(*it);
    const size_t p = static_cast<size_t>(split - v.begin());
    if (acc + mass_before >= target) {
      hi = p;  // the cut is strictly before the pivot
    } else if (acc + mass_before + weight(pv) >= target) {
      return p + 1;  // the pivot is the last element kept
    } else {
      acc += mass_before + weight(pv);
      lo = p + 1;
    }
  }
  std::sort(v.begin() + lo, v.begin() + hi, before);
  for (size_t i = lo; i < hi; ++i) {
    acc += weight(v[i]);
    if (acc >= target) return i + 1;
  }
  return hi;
}

// Keeps the candidates for which keep(c) holds, in their order (no branch on the predicate), and returns the new
// sum of their weights.
template <typename Keep>
double compact(std::vector<SampleCand>& cand, Keep keep) {
  size_t n = 0;
  for (size_t i = 0; i < cand.size(); ++i) {
    const SampleCand c = cand[i];
    cand[n] = c;
    n += static_cast<size_t>(keep(c));
  }
  cand.resize(n);
  double total = 0.0;
  for (const SampleCand& c : cand) total += c.w;
  return total;
}

// "a is more likely than b": higher z, then the lower id (a strict total order on distinct ids).
inline bool more_likely(const SampleCand& a, const SampleCand& b) {
  return a.z > b.z || (a.z == b.z && a.id < b.id);
}

// The candidates b or more likely than b, in their order: a prefix of the "more likely" order cut at b.
double keep_through(std::vector<SampleCand>& cand, const SampleCand b) {
  return compact(cand, [&](const SampleCand& c) { return (c.z > b.z) | ((c.z == b.z) & (c.id <= b.id)); });
}

// Step 3's logit transform: d = l - lmax, smoothed (quadratic / cubic sampling) when sf > 0, over the temperature.
inline float transform(float l, float lmax, const SampleFilter& s) {
  float d = l - lmax;
  if (s.smoothing_factor > 0.0f) {
    const float k = (3.0f - s.smoothing_curve) * 0.5f, c = (s.smoothing_curve - 1.0f) * 0.5f;
    const float d2 = d * d;
    d = -(k * s.smoothing_factor * d2) + c * s.smoothing_factor * d2 * d;
  }
  return d / s.temperature;
}

// Step 11: p <- p^(1/T'), T' the dynamic temperature (from the survivors' entropy) or the late temperature.
double late_temperature(std::vector<SampleCand>& cand, double total, const SampleFilter& s) {
  double t = s.late_t;
  if (s.max_temp > s.min_temp) {
    double h = 0.0;
    for (const SampleCand& c : cand) {
      const double p = c.w / total;
      if (p > 0.0) h -= p * std::log(p);
    }
    double h_max = std::log(static_cast<double>(cand.size()));
    if (h_max == 0.0) h_max = 1.0;
    t = s.min_temp + (static_cast<double>(s.max_temp) - s.min_temp) * std::pow(h / h_max, s.temp_exponent);
  }
  size_t best = 0;
  double w_max = 0.0;
  for (size_t i = 0; i < cand.size(); ++i) {
    w_max = std::max(w_max, cand[i].w);
    if (more_likely(cand[i], cand[best])) best = i;
  }
  double out = 0.0;
  for (size_t i = 0; i < cand.size(); ++i) {
    SampleCand& c = cand[i];
    c.w = t > 0.0 ? std::pow(c.w / w_max, 1.0 / t) : (i == best ? 1.0 : 0.0);
    out += c.w;
  }
  return out;
}

}  // namespace

double filter_candidates(const float* l, int64_t vocab, float lmax, const SampleFilter& s,
                         std::vector<SampleCand>& cand, std::vector<float>& vals, std::vector<SampleCand>& sel) {
  using Cand = SampleCand;
  cand.clear();

  // top-k: the k-th largest z is z(k-th largest l), z being non-decreasing in l, so select on l and keep every id
  // with z >= that threshold (ties at the threshold are kept, HF semantics). Selection: a size-k min-heap of values
  // (one comparison per logit for small k), else nth_element on a copy; both O(vocab).
  float zthr = -kInf;
  if (s.top_k > 0 && s.top_k < vocab) {
    const size_t k = static_cast<size_t>(s.top_k);
    auto& v = vals;
    float lthr;
    if (k <= 4096) {
      v.assign(l, l + k);
      std::make_heap(v.begin(), v.end(), std::greater<float>());
      for (int64_t i = static_cast<int64_t>(k); i < vocab; ++i) {
        if (l[i] > v.front()) {
          std::pop_heap(v.begin(), v.end(), std::greater<float>());
          v.back() = l[i];
          std::push_heap(v.begin(), v.end(), std::greater<float>());
        }
      }
      lthr = v.front();
    } else {
      v.assign(l, l + vocab);
      std::nth_element(v.begin(), v.begin() + (k - 1), v.end(), std::greater<float>());
      lthr = v[k - 1];
    }
    if (lthr > -kInf) zthr = transform(lthr, lmax, s);  // else fewer than k finite logits: top-k keeps them all
  }
  // Every id written, the survivors counted in: no branch on the (data-dependent) filter, no push_back.
  cand.resize(static_cast<size_t>(vocab));  // SampleCand's default constructor leaves it uninitialized
  Cand* out = cand.data();
  size_t n = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    const float z = transform(l[i], lmax, s);
    out[n].id = static_cast<int32_t>(i);
    out[n].z = z;
    n += static_cast<size_t>((l[i] != -kInf) & (z >= zthr));
  }
  cand.resize(n);

  float zmax = -kInf;
  for (const Cand& c : cand) zmax = std::max(zmax, c.z);
  double total = 0.0;
  for (size_t i = 0; i < cand.size(); i += 64) {  // gather, exp in vector lanes, scatter
    const size_t m = std::min<size_t>(64, cand.size() - i);
    float buf[64];
    for (size_t k = 0; k < m; ++k) buf[k] = cand[i + k].z - zmax;
    for (size_t k = 0; k < m; ++k) buf[k] = fast_exp(buf[k]);
    for (size_t k = 0; k < m; ++k) {
      cand[i + k].w = buf[k];
      total += buf[k];
    }
  }

  // top-p: the shortest most-likely prefix holding top_p of the mass (quickselect on a copy, no sort of the vocab).
  // The kept set is then taken from cand in id order (the boundary b is the least likely kept; the order is strict,
  // so "b or more likely" is exactly the kept set): the draw's inversion order stays the id order, which a device
  // kernel can follow (ops::sample_logprob), and the new total is summed in that order.
  if (s.top_p < 1.0f && cand.size() > 1) {
    sel.assign(cand.begin(), cand.end());
    const size_t keep = select_prefix_by_mass(sel, static_cast<double>(s.top_p) * total, more_likely,
                                              [](const Cand& c) { return c.w; });
    if (keep < sel.size()) {
      Cand b = sel[0];
      for (size_t i = 1; i < keep; ++i)
        if (more_likely(b, sel[i])) b = sel[i];
      total = keep_through(cand, b);  // the kept ids are scattered in id order
    } else {
      total = 0.0;
      for (const Cand& c : cand) total += c.w;
    }
  }

  // top-a: p >= a * p_max^2, i.e. w >= a * w_max^2 / total.
  if (s.top_a > 0.0f && cand.size() > 1) {
    double w_max = 0.0;
    for (const Cand& c : cand) w_max = std::max(w_max, c.w);
    const double thr = static_cast<double>(s.top_a) * w_max * w_max / total;
    total = compact(cand, [&](const Cand& c) { return c.w >= thr; });
  }

  // min-p: p / p_max = w (the max has w = exp(0) = 1).
  if (s.min_p > 0.0f) {
    const double mp = s.min_p;
    total = compact(cand, [&](const Cand& c) { return c.w >= mp; });
  }

  // tfs: the second differences of the sorted probabilities; the kept set is a most-likely prefix (kept in order).
  if (s.tfs < 1.0f && cand.size() >= 3) {
    sel.assign(cand.begin(), cand.end());
    std::sort(sel.begin(), sel.end(), more_likely);
    const size_t n = sel.size();
    std::vector<double> g(n - 2);
    double g_sum = 0.0;
    for (size_t i = 0; i + 2 < n; ++i) {
      g[i] = std::fabs(sel[i].w - 2.0 * sel[i + 1].w + sel[i + 2].w) / total;
      g_sum += g[i];
    }
    if (g_sum > 0.0) {
      size_t keep = 1;
      double cum = 0.0;
      for (size_t i = 0; i + 2 < n; ++i) {
        cum += g[i] / g_sum;
        if (cum > s.tfs) break;
        keep++;
      }
      total = keep_through(cand, sel[keep - 1]);
    }
  }

  // typical: the entropy, then the shortest prefix in the order of |-log p - H| holding `typical` of the mass.
  if (s.typical < 1.0f && cand.size() > 1) {
    const double log_total = std::log(total);
    double h = 0.0;
    for (const Cand& c : cand) {
      if (c.w == 0.0) continue;  // p log p -> 0 (z may be -inf after underflow)
      const double logp = static_cast<double>(c.z) - zmax - log_total;
      h -= (c.w / total) * logp;
    }
    struct Typ {
      double shift;  // |-log p - H|
      size_t idx;    // into cand
    };
    std::vector<Typ> order(cand.size());
    for (size_t i = 0; i < cand.size(); ++i) {
      const double logp = static_cast<double>(cand[i].z) - zmax - log_total;
      order[i] = {std::fabs(-logp - h), i};
    }
    const size_t keep = select_prefix_by_mass(
        order, static_cast<double>(s.typical) * total,
        [&](const Typ& a, const Typ& b) {
          return a.shift < b.shift || (a.shift == b.shift && cand[a.idx].id < cand[b.idx].id);
        },
        [&](const Typ& t) { return cand[t.idx].w; });
    std::vector<Cand> kept(keep);
    total = 0.0;
    for (size_t i = 0; i < keep; ++i) {
      kept[i] = cand[order[i].idx];
      total += kept[i].w;
    }
    cand.swap(kept);
  }

  // mirostat v2's cut: p >= 2^-mu, the most likely always kept.
  if (s.mirostat && cand.size() > 1) {
    Cand best = cand[0];
    for (const Cand& c : cand)
      if (more_likely(c, best)) best = c;
    const double thr = std::exp2(-static_cast<double>(s.mirostat_mu)) * total;
    total = compact(cand, [&](const Cand& c) { return (c.w >= thr) | (c.id == best.id); });
  }

  if (s.late_temperature && cand.size() > 1) total = late_temperature(cand, total, s);

  // XTC (its coin came up): of the survivors with p >= threshold (two or more), all but the least likely go.
  if (s.xtc && cand.size() > 1) {
    const double thr = static_cast<double>(s.xtc_threshold) * total;
    size_t above = 0;
    Cand least = cand[0];
    for (const Cand& c : cand) {
      if (!(c.w >= thr && c.w > 0.0)) continue;
      if (above++ == 0 || more_likely(least, c)) least = c;
    }
    if (above >= 2)
      total = compact(cand, [&](const Cand& c) { return !(c.w >= thr && c.w > 0.0) | (c.id == least.id); });
  }
  return total;
}

int32_t draw_candidate(const std::vector<SampleCand>& cand, double total, double u) {
  const double target = u * total;
  double acc = 0.0;
  int32_t token = -1;
  for (const SampleCand& c : cand) {
    acc += c.w;
    if (c.w > 0.0) token = c.id;  // fallback when rounding leaves acc <= target at the end
    if (acc > target) break;
  }
  return token;
}

}  // namespace exl2::cpu
