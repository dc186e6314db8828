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

}  // namespace

double filter_candidates(const float* l, int64_t vocab, float lmax, const SampleFilter& s,
                         std::vector<SampleCand>& cand, std::vector<float>& vals, std::vector<SampleCand>& sel) {
  using Cand = SampleCand;
  cand.clear();
  const float t = s.temperature;

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
    if (lthr > -kInf) zthr = (lthr - lmax) / t;  // else fewer than k finite logits: top-k keeps them all
  }
  // Every id written, the survivors counted in: no branch on the (data-dependent) filter, no push_back.
  cand.resize(static_cast<size_t>(vocab));  // SampleCand's default constructor leaves it uninitialized
  Cand* out = cand.data();
  size_t n = 0;
  for (int64_t i = 0; i < vocab; ++i) {
    const float z = (l[i] - lmax) / t;
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

  auto more_likely = [](const Cand& a, const Cand& b) { return a.z > b.z || (a.z == b.z && a.id < b.id); };

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
      // b or more likely; the kept ids are scattered in id order, so compact without a branch on the predicate
      size_t n = 0;
      for (size_t i = 0; i < cand.size(); ++i) {
        const Cand c = cand[i];
        cand[n] = c;
        n += static_cast<size_t>((c.z > b.z) | ((c.z == b.z) & (c.id <= b.id)));
      }
      cand.resize(n);
    }
    total = 0.0;
    for (const Cand& c : cand) total += c.w;
  }

  // min-p: p / p_max = w (the max has w = exp(0) = 1).
  if (s.min_p > 0.0f) {
    const double mp = s.min_p;
    size_t n = 0;
    for (size_t i = 0; i < cand.size(); ++i) {  // remove_if without a branch on the predicate
      const Cand c = cand[i];
      cand[n] = c;
      n += static_cast<size_t>(c.w >= mp);
    }
    cand.resize(n);
    total = 0.0;
    for (const Cand& c : cand) total += c.w;
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
