// CPU sample_logprob: each row's token and its log-probability, computed exactly as the host sampler computes them
// for a row without bias, bans or penalties (same scan, same cpu::sum_exp, the same filters and draw through
// cpu::filter_candidates / draw_candidate), rows in parallel.
#include <cmath>
#include <limits>
#include <vector>

#include "backend/cpu/sample_filter.h"
#include "backend/cpu/sum_exp.h"
#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {

void sample_logprob(const float* logits, const SampleParams* params, int64_t rows, int64_t vocab, int32_t* index,
                    float* logprob) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  parallel_for(rows, 1, [&](int64_t b, int64_t e) {
    thread_local std::vector<SampleCand> cand, sel;
    thread_local std::vector<float> vals;
    for (int64_t r = b; r < e; ++r) {
      const float* l = logits + r * vocab;
      int32_t best = -1;
      float best_v = -kInf;
      int64_t bad = -1;
      for (int64_t i = 0; i < vocab; ++i) {  // the sampler's scan: the first NaN / +inf stops it
        const float x = l[i];
        if (!(x < kInf)) {
          bad = i;
          break;
        }
        if (x > best_v) {
          best_v = x;
          best = static_cast<int32_t>(i);
        }
      }
      if (bad >= 0) {
        index[r] = static_cast<int32_t>(-2 - bad);
        logprob[r] = l[bad];
        continue;
      }
      if (best < 0) {
        index[r] = -1;
        logprob[r] = -kInf;
        continue;
      }
      const double lse = static_cast<double>(best_v) + std::log(sum_exp(l, vocab, best_v));
      int32_t token = best;
      if (params && params[r].temperature > 0.0f) {
        const SampleParams& p = params[r];
        SampleFilter f;  // the plain filters only (Sampler::sampled_plain)
        f.temperature = p.temperature;
        f.top_k = p.top_k;
        f.top_p = p.top_p;
        f.min_p = p.min_p;
        const double total = filter_candidates(l, vocab, best_v, f, cand, vals, sel);
        token = draw_candidate(cand, total, p.u);  // never -1: the argmax (weight 1) is always a candidate
      }
      index[r] = token;
      logprob[r] = static_cast<float>(l[token] - lse);
    }
  });
}

}  // namespace exl2::cpu
