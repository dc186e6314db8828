// The token sampler: turns one row of host f32 logits into one token id (plus its log-probability and the top-N
// alternatives) under per-job settings, with a counter-based RNG so a job's samples never depend on its batch
// neighbours. Used by Model.generate and by the batching engine (the GPU path copies the row back and calls this).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "exl2/sample_params.h"

namespace exl2 {

namespace cpu {
struct SampleFilter;
}

// Per-job sampling settings. Defaults sample from the plain softmax (temperature 1, no filters, no penalties).
//
// Pipeline, in this order, on a copy of the logits `l` [vocab] (docs/engine.md "Sampling" has the same list):
//   1. logit_bias: l[id] += bias for each (id, bias), in list order (duplicates add up; bias -inf bans).
//      allowed_tokens (when not empty): every id not listed gets -inf. banned_tokens: l[id] = -inf. min_tokens:
//      while fewer than min_tokens tokens are generated, l[id] = -inf for each id of stop_tokens (the engine adds
//      the job's JobSpec::stop_tokens). The bans come after the bias, so a ban always wins.
//   2. repetition_penalty r (HF style, CTRL paper): for each DISTINCT id among the last `penalty_window` tokens of
//      context_tokens: l[id] = l[id] < 0 ? l[id] * r : l[id] / r.
//      frequency_penalty f, presence_penalty p (OpenAI style): with c[id] = occurrences of id among the last
//      `penalty_window` tokens of `generated`: l[id] -= c[id] * f + (c[id] > 0 ? p : 0).
//      DRY (dry_multiplier m > 0; "Don't Repeat Yourself", p-e-w, as text-generation-webui / llama.cpp): over the
//      last dry_range tokens c[0, n) of context_tokens (0 = all), when c[n-1] is not a sequence breaker: for each
//      i < n-1 with c[i] == c[n-1] and c[i+1] not a breaker, the match length L(i) is the largest L (capped at
//      kDryMaxMatch) with c[i-L+1, i] == c[n-L, n-1] containing no breaker; token c[i+1] gets the largest such L,
//      and l[t] -= m * dry_base^(L - dry_allowed_length) for each t whose L >= dry_allowed_length.
//      -> `l` is now the "processed logits"; the reported log-probabilities are log_softmax(l) (see SampleResult).
//   3. temperature T: T == 0 is greedy: the argmax of `l`, ties to the lowest id (steps 4-14 skipped).
//      Otherwise d = l - max(l), smoothed when smoothing_factor sf > 0 (quadratic sampling, text-generation-webui;
//      ExLlamaV2's for smoothing_curve 1): d = -(k sf d^2) + (s sf d^3) with k = (3 - curve) / 2,
//      s = (curve - 1) / 2; then z = d / T in f32 (T = 1 here with temperature_last; the shift comes first so a
//      tiny T cannot overflow). Weights w = exp(z - max z).
//   4. top_k k > 0: keep ids whose z >= the k-th largest z (ties at the boundary are all kept, as HF does).
//   5. top_p < 1: sort the survivors by probability (desc, ties to the lower id) and keep the shortest prefix whose
//      cumulative probability reaches top_p (at least one token). The kept ids stay in id order.
//   6. top_a a > 0: keep ids with prob >= a * (max prob)^2.
//   7. min_p > 0: keep ids with prob >= min_p * max prob (over the survivors).
//   8. tfs < 1 (tail-free sampling, Bricken 2019, as HF's former TailFreeLogitsWarper and ExLlamaV2) with >= 3
//      survivors: p sorted desc (ties to the lower id), g_i = |p_i - 2 p_{i+1} + p_{i+2}| for i < n-2; keep the
//      first 1 + #{i : sum(g_0..g_i) / sum(g) <= tfs} (all when sum(g) == 0). Kept ids stay in their order.
//   9. typical < 1 (locally typical sampling, Meister et al. 2022, HF's TypicalLogitsWarper): with H the entropy of
//      the survivors' distribution, sort by |-log p - H| (asc, ties to the lower id) and keep the shortest prefix whose
//      cumulative probability reaches `typical`.
//  10. mirostat_mode 2 (mirostat v2, Basu et al. 2021, as ExLlamaV2): keep ids with prob >= 2^-mu, and the most
//      likely one always; mu is the job's state (below).
//  11. late temperature T' when dynamic temperature is on (max_temp > min_temp, ExLlamaV2's "DynaTemp"):
//      T' = min_temp + (max_temp - min_temp) * (H / log n)^temp_exponent, H the entropy of the n survivors
//      (log n = 0 counts as 1); else T' = T with temperature_last, else no step. p <- p^(1/T') (T' == 0: one-hot
//      at the most likely). With temperature_last and dynamic temperature, T is not used at all.
//  12. XTC ("exclude top choices", p-e-w, as text-generation-webui / llama.cpp): with probability
//      xtc_probability (a second draw of the job's RNG, stream 1 at this step), when two or more survivors have
//      prob >= xtc_threshold, all of them but the least likely (last in "z desc, id asc") are removed.
//   Each of 4-12 renormalizes over the survivors of the previous step. Tokens whose processed logit is -inf never
//   survive. 13. Draw u = uniform(seed, step) in [0, 1) and invert the CDF of the final distribution: the first id,
//   in candidate order (id order, but typical's selection order after typical), whose running f64 sum of weights
//   exceeds u * total. 14. mirostat: mu <- mu + eta * (tau - (-log2 p(token))), p the final distribution's
//   probability of the drawn token. mu starts at 2 tau; greedy steps leave it.
struct SamplerSettings {
  float temperature = 1.0f;         // >= 0, finite; 0 = greedy
  int32_t top_k = 0;                // >= 0; 0 = off
  float top_p = 1.0f;               // (0, 1]; 1 = off
  float min_p = 0.0f;               // [0, 1); 0 = off
  float typical = 1.0f;             // (0, 1]; 1 = off
  float repetition_penalty = 1.0f;  // > 0, finite; 1 = off
  float frequency_penalty = 0.0f;   // finite; 0 = off
  float presence_penalty = 0.0f;    // finite; 0 = off
  int32_t penalty_window = -1;      // >= -1: how many most recent tokens the penalties look at; -1 = all, 0 = none
  std::vector<std::pair<int32_t, float>> logit_bias;  // (id in [0, vocab), bias finite or -inf)
  std::vector<int32_t> banned_tokens;                 // ids in [0, vocab)
  std::vector<int32_t> allowed_tokens;                // ids in [0, vocab); empty = all allowed
  int32_t min_tokens = 0;                             // >= 0: stop_tokens banned until this many are generated
  std::vector<int32_t> stop_tokens;                   // ids in [0, vocab): what min_tokens bans
  float smoothing_factor = 0.0f;  // >= 0, finite; 0 = off
  float smoothing_curve = 1.0f;   // [1, 3] (where the smoothed logits keep their order); 1 = quadratic
  bool temperature_last = false;  // temperature after the filters (step 11) instead of before them (step 3)
  float min_temp = 1.0f;          // >= 0, finite, <= max_temp
  float max_temp = 1.0f;          // >= 0, finite; dynamic temperature on when max_temp > min_temp
  float temp_exponent = 1.0f;     // >= 0, finite
  float top_a = 0.0f;             // [0, 1]; 0 = off
  float tfs = 1.0f;               // (0, 1]; 1 = off
  int32_t mirostat_mode = 0;      // 0 = off, 2 = mirostat v2 (v1 is not implemented)
  float mirostat_tau = 1.5f;      // >= 0, finite: target surprise in bits
  float mirostat_eta = 0.3f;      // >= 0, finite: learning rate of mu
  float xtc_probability = 0.0f;   // [0, 1]; 0 = off
  float xtc_threshold = 0.1f;     // [0, 1]
  float dry_multiplier = 0.0f;    // >= 0, finite; 0 = off
  float dry_base = 1.75f;         // >= 1, finite
  int32_t dry_allowed_length = 2;              // >= 1
  int32_t dry_range = 0;                       // >= 0: most recent context tokens DRY looks at; 0 = all
  std::vector<int32_t> dry_sequence_breakers;  // ids in [0, vocab): matches never extend across them
  uint64_t seed = 0;         // 0 = draw one from std::random_device (Sampler::seed() reports it)
  int32_t top_logprobs = 0;  // [0, vocab]: how many (id, logprob) alternatives SampleResult::top carries

  static constexpr int32_t kDryMaxMatch = 256;  // DRY match lengths are counted up to this (O(n * 256) per token)

  // Throws InvalidArgument naming the bad field, its value and its allowed range. vocab < 0 skips the checks that
  // need the vocabulary size (token ids in logit_bias / banned_tokens / allowed_tokens / stop_tokens /
  // dry_sequence_breakers, top_logprobs <= vocab).
  void validate(int64_t vocab = -1) const;
  std::string to_string() const;
  bool mirostat() const { return mirostat_mode == 2; }
  bool dynamic_temperature() const { return max_temp > min_temp; }
};

// One sampled token. logprob and top are under the model's distribution AFTER bias, bans and penalties but BEFORE
// temperature and the top-k/top-p/min-p/typical filters: log_softmax(processed logits), as OpenAI reports them.
struct SampleResult {
  int32_t token = -1;
  float logprob = 0.0f;                        // log p(token) under that distribution (<= 0)
  std::vector<std::pair<int32_t, float>> top;  // the top_logprobs most likely ids, logprob desc, ties to the lower
                                               // id; ids with logprob -inf (banned) are never listed
};

// One sampler per job. Not thread-safe per instance; distinct instances may run on distinct threads at once
// (working memory is thread-local, so a sampler itself holds no vocab-sized buffers).
//
// RNG: the uniform draw of step s is uniform(seed, s), a pure function (splitmix64 stream keyed by the seed,
// indexed by s); XTC's coin is uniform(seed, s, 1). sample() uses step() and then increments it, greedy steps
// included, so the n-th token of a job depends only on its seed, its own logits and n.
// Mirostat: the sampler keeps mu for every step it has sampled (mu before step s, s = 0 .. step()), so set_step()
// back to s (a rewind) restores the mu that step s had; the DRY and penalty inputs are the caller's tokens.
class Sampler {
 public:
  explicit Sampler(SamplerSettings settings);  // validates the vocab-independent fields; resolves seed 0

  // logits: [vocab] f32 on the host, finite or -inf (NaN / +inf throw InvalidArgument naming the id).
  // context_tokens: prompt + generated so far (repetition penalty); generated: generated so far (frequency and
  // presence penalties). All ids must be in [0, vocab). Throws InvalidArgument when every token is banned / -inf.
  SampleResult sample(const float* logits, int64_t vocab, const std::vector<int32_t>& context_tokens,
                      const std::vector<int32_t>& generated);

  // True when sample() reads nothing from a row but its argmax and that token's log-probability: temperature 0
  // and no logit_bias, banned_tokens, allowed_tokens, min_tokens, penalties (repetition 1, frequency and
  // presence 0, DRY off) or top_logprobs. Such a
  // row can be reduced on the logits' device (ops::argmax_logprob) instead of copied to the host: the engine's
  // device argmax (engine.cpp, device_argmax_enabled). Token masks and rewind bans are the engine's, not seen here.
  bool greedy_plain() const;
  // sample()'s result for a greedy_plain() row from ops::argmax_logprob's (index, logprob) of that row: the same
  // token, logprob (bit-identical from the CPU backend), empty top, step advance, and the same InvalidArgument for
  // a NaN / +inf logit (index <= -2; logprob carries the value) or a row of -inf (index -1).
  SampleResult take_argmax(int32_t index, float logprob, int64_t vocab);

  // True when sample() reads nothing from a row but what ops::sample_logprob computes on the logits' device:
  // temperature > 0 with any of top_k / top_p / min_p, and nothing that greedy_plain() excludes nor any of
  // typical, top_a, tfs, smoothing, temperature_last, dynamic temperature, mirostat or XTC (the engine's device
  // sampling, engine.cpp device_sample_enabled; masks and rewind bans are the engine's). greedy_plain() and
  // sampled_plain() never both hold.
  bool sampled_plain() const;
  // The row's SampleParams for ops::sample_logprob at the current step: temperature 0 for greedy settings, else
  // the filters and u = uniform(seed, step()) (the draw sample() would make now; the RNG stays on the host).
  SampleParams device_params() const;
  // sample()'s result for a greedy_plain() or sampled_plain() row from ops::sample_logprob's (index, logprob) of
  // that row (device_params() taken at this step): the token, its logprob, empty top, the step advance, and
  // the same InvalidArgument as sample() for the op's error codes (index <= -2: NaN / +inf, -1: all -inf).
  // The CPU backend gives sample()'s token and logprob bit for bit; CUDA see ops.h sample_logprob.
  SampleResult take_device(int32_t index, float logprob, int64_t vocab);

  // The final distribution that sample() would draw from now (steps 1-12, with this step's mu and XTC coin):
  // probs[vocab] summing to 1, zero outside the support; greedy gives a one-hot at the argmax. Does not advance
  // the step. For tests and debugging.
  std::vector<double> final_probs(const float* logits, int64_t vocab, const std::vector<int32_t>& context_tokens,
                                  const std::vector<int32_t>& generated) const;

  // Speculative decoding (engine.h "Speculative decoding").
  // propose(): a draft model's token for generated index `step` from the draft's row of logits under these
  // settings. Greedy (temperature 0): the argmax of the processed logits, q left as it is. Otherwise drawn from q =
  // the final distribution (steps 1-12 at `step`; filled into *q, [vocab]) with u = uniform(seed, step, 3), a
  // stream of its own so the draft's draw never correlates with the verifier's. Does not advance the step; not
  // for mirostat (its mu along draft tokens is not kept; InvalidArgument).
  int32_t propose(const float* logits, int64_t vocab, const std::vector<int32_t>& context_tokens,
                  const std::vector<int32_t>& generated, int64_t step, std::vector<double>* q) const;
  // verify(): the token at this step given the draft token `draft`, and whether it is the draft (*accepted).
  //   q null: the draft is a point mass (n-gram drafts, greedy draft models): sample() itself; the draft is
  //     accepted iff the drawn token equals it. That is speculative rejection sampling for q = delta(draft)
  //     (accept with probability p(draft), else a draw from p without it, renormalized) and the same token as
  //     plain decoding at this step, bit for bit.
  //   q [vocab] (a sampled draft model's distribution, q[draft] > 0): accept with probability min(1, p/q) of the
  //     draft (u = uniform(seed, step, 2)); on rejection draw from max(0, p - q) renormalized (u = uniform(seed,
  //     step, 0), in id order; from p itself when p <= q everywhere within rounding). p is the final distribution
  //     of this step (steps 1-12), so the token is distributed as sample()'s. Not for mirostat or greedy settings
  //     (InvalidArgument).
  // Either way logprob and top are sample()'s (processed logits of this row) and the step advances by one.
  SampleResult verify(const float* logits, int64_t vocab, const std::vector<int32_t>& context_tokens,
                      const std::vector<int32_t>& generated, int32_t draft, const std::vector<double>* q,
                      bool* accepted);
  // device_params() at another step (a speculative row `step - step()` positions ahead).
  SampleParams device_params_at(int64_t step) const;

  const SamplerSettings& settings() const { return settings_; }
  uint64_t seed() const { return settings_.seed; }  // the resolved seed (never 0)
  int64_t step() const { return step_; }
  // >= 0; e.g. to resume a job. With mirostat, only back to a step already taken (its mu is restored); forward
  // throws InvalidArgument (mu is unknown there).
  void set_step(int64_t step);
  // Mirostat's mu for the next sample (2 * tau before the first); 0 when mirostat is off.
  float mirostat_mu() const { return mu_.empty() ? 0.0f : mu_.back(); }

  // The counter-based generator: a uniform double in [0, 1) with 53 random bits. stream 0 is the token draw,
  // stream 1 XTC's coin; distinct streams of one seed are independent.
  static double uniform(uint64_t seed, int64_t step, uint64_t stream = 0);

 private:
  SamplerSettings settings_;
  int64_t step_ = 0;
  std::vector<float> mu_;  // mirostat: mu_[s] = mu before step s, size step_ + 1; empty when mirostat is off

  void advance(float mu);                           // one step taken; mu: mirostat's mu after it
  cpu::SampleFilter filter_at(int64_t step) const;  // steps 3-12's settings at `step` (mu, XTC's coin)
};

}  // namespace exl2
