// CPU references of the MoE ops (ops/ops.h moe_route / moe_group / moe_combine): scalar, fp32, one row at a time.
#include <cmath>
#include <limits>
#include <vector>

#include "backend/cpu/cpu_common.h"
#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {

namespace {

// The router's order: larger logit first, NaN below -inf, ties to the lower id.
bool route_before(float a, int ia, float b, int ib) {
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na != nb) return nb;
  if (!na && a != b) return a > b;
  return ia < ib;
}

}  // namespace

void moe_route(const void* logits, DType act, int64_t rows, int64_t n_experts, int64_t k, bool renormalize,
               int32_t* ids, float* weights) {
  parallel_for(rows, 16, [&](int64_t b, int64_t e) {
    std::vector<float> l(static_cast<size_t>(n_experts));
    std::vector<char> taken(static_cast<size_t>(n_experts));
    for (int64_t r = b; r < e; ++r) {
      detail::row_to_f32(detail::at(logits, act, r * n_experts), act, n_experts, l.data());
      float mx = -std::numeric_limits<float>::infinity();
      for (float v : l)
        if (v > mx) mx = v;
      float z = 0.f;
      for (float v : l) z += std::exp(v - mx);
      std::fill(taken.begin(), taken.end(), 0);
      int32_t* id = ids + r * k;
      float* w = weights + r * k;
      float sel = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        int best = -1;
        for (int x = 0; x < n_experts; ++x)
          if (!taken[x] && (best < 0 || route_before(l[x], x, l[best], best))) best = x;
        taken[best] = 1;
        id[j] = best;
        w[j] = std::exp(l[best] - mx) / z;
        sel += w[j];
      }
      if (renormalize)
        for (int64_t j = 0; j < k; ++j) w[j] /= sel;
    }
  });
}

void moe_group(const int32_t* ids, int64_t n_pairs, int64_t n_experts, int32_t* offsets, int32_t* perm, int32_t* inv,
               int32_t* active) {
  auto expert = [&](int64_t i) {
    const int32_t e = ids[i];
    return e < 0 ? 0 : (e >= n_experts ? static_cast<int32_t>(n_experts - 1) : e);
  };
  std::vector<int32_t> next(static_cast<size_t>(n_experts) + 1, 0);
  for (int64_t i = 0; i < n_pairs; ++i) ++next[expert(i) + 1];
  for (int64_t e = 0; e < n_experts; ++e) next[e + 1] += next[e];
  for (int64_t e = 0; e <= n_experts; ++e) offsets[e] = next[e];
  for (int64_t i = 0; i < n_pairs; ++i) {  // ascending i: stable within an expert
    const int32_t p = next[expert(i)]++;
    perm[p] = static_cast<int32_t>(i);
    inv[i] = p;
  }
  int32_t n = 0;
  for (int64_t e = 0; e < n_experts; ++e)
    if (offsets[e + 1] > offsets[e]) active[n++] = static_cast<int32_t>(e);
  for (int64_t e = n; e < n_experts; ++e) active[e] = -1;
  active[n_experts] = n;
}

void moe_combine(const void* expert_out, const float* weights, const int32_t* inv, const void* shared,
                 const void* shared_gate, DType gate_dtype, int64_t rows, int64_t k, int64_t hidden, bool add,
                 void* out, DType act) {
  const int64_t n_pairs = rows * k;
  parallel_for(rows, 4, [&](int64_t b, int64_t e) {
    std::vector<float> acc(static_cast<size_t>(hidden)), sum(acc.size()), t(acc.size());
    for (int64_t r = b; r < e; ++r) {
      if (add)
        detail::row_to_f32(detail::at(out, act, r * hidden), act, hidden, acc.data());
      else
        std::fill(acc.begin(), acc.end(), 0.f);
      // The routed sum first (slots ascending), added into the residual once: fp32 throughout.
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {
        int64_t p = inv[r * k + j];
        p = p < 0 ? 0 : (p >= n_pairs ? n_pairs - 1 : p);
        detail::row_to_f32(detail::at(expert_out, act, p * hidden), act, hidden, t.data());
        const float w = weights[r * k + j];
        for (int64_t c = 0; c < hidden; ++c) sum[c] += w * t[c];
      }
      if (shared != nullptr) {
        const float g = detail::load_one(shared_gate, gate_dtype, r);
        const float s = 1.f / (1.f + std::exp(-g));
        detail::row_to_f32(detail::at(shared, act, r * hidden), act, hidden, t.data());
        for (int64_t c = 0; c < hidden; ++c) sum[c] += s * t[c];
      }
      for (int64_t c = 0; c < hidden; ++c) acc[c] += sum[c];
      detail::row_from_f32(acc.data(), hidden, detail::at(out, act, r * hidden), act);
    }
  });
}

}  // namespace exl2::cpu
