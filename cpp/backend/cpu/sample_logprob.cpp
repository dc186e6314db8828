// CPU argmax_logprob: the greedy token of each row and its log-probability, computed exactly as the host sampler
// computes them for temperature 0 without bias or penalties (same scan, same cpu::sum_exp), rows in parallel.
#include <cmath>
#include <limits>

#include "backend/cpu/sum_exp.h"
#include "backend/cpu/thread_pool.h"
#include "backend/kernels.h"

namespace exl2::cpu {

void argmax_logprob(const float* logits, int64_t rows, int64_t vocab, int32_t* index, float* logprob) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  parallel_for(rows, 1, [&](int64_t b, int64_t e) {
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
      } else if (best < 0) {
        index[r] = -1;
        logprob[r] = -kInf;
      } else {
        const double lse = static_cast<double>(best_v) + std::log(sum_exp(l, vocab, best_v));
        index[r] = best;
        logprob[r] = static_cast<float>(l[best] - lse);
      }
    }
  });
}

}  // namespace exl2::cpu
