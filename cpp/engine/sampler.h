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

// Per-job sampling settings. Defaults sample from the plain softmax (temperature 1, no filters, no penalties).
//
// Pipeline, in this order (HF / llama.cpp order), on a copy of the logits `l` [vocab]:
//   1. logit_bias: l[id] += bias for each (id, bias), in list order (duplicates add up; bias -inf bans).
//      banned_tokens: l[id] = -inf (applied after the bias, so a ban always wins).
//   2. repetition_penalty r (HF style, CTRL paper): for each DISTINCT id among the last `penalty_window` tokens of
//      context_tokens: l[id] = l[id] < 0 ? l[id] * r : l[id] / r.
//      frequency_penalty f, presence_penalty p (OpenAI style): with c[id] = occurrences of id among the last
//      `penalty_window` tokens of `generated`: l[id] -= c[id] * f + (c[id] > 0 ? p : 0).
//      -> `l` is now the "processed logits"; the reported log-probabilities are log_softmax(l) (see SampleResult).
//   3. temperature T: T == 0 is greedy: the argmax of `l`, ties to the lowest id (steps 4-7 skipped).
//      Otherwise z = (l - max(l)) / T in f32 (the softmax-invariant shift comes first so a tiny T cannot overflow).
//   4. top_k k > 0: keep ids whose z >= the k-th largest z (ties at the boundary are all kept, as HF does).
//   5. top_p < 1: sort the survivors by probability (desc, ties to the lower id) and keep the shortest prefix whose
//      cumulative probability reaches top_p (at least one token). The kept ids stay in id order.
//   6. min_p > 0: keep ids with prob >= min_p * max prob (over the survivors).
//   7. typical < 1 (locally typical sampling, Meister et al. 2022, HF's TypicalLogitsWarper): with H the entropy of
//      the survivors' distribution, sort by |-log p - H| (asc, ties to the lower id) and keep the shortest prefix whose
//      cumulative probability reaches `typical`.
//   Each of 4-7 renormalizes over the survivors of the previous step. Tokens whose processed logit is -inf never
//   survive. 8. Draw u in [0, 1) from the job's RNG and invert the CDF of the final distribution: the first id, in
//   id order (in typical's selection order after typical), whose running f64 sum of weights exceeds u * total.
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
  uint64_t seed = 0;         // 0 = draw one from std::random_device (Sampler::seed() reports it)
  int32_t top_logprobs = 0;  // [0, vocab]: how many (id, logprob) alternatives SampleResult::top carries

  // Throws InvalidArgument naming the bad field, its value and its allowed range. vocab < 0 skips the checks that
  // need the vocabulary size (token ids in logit_bias / banned_tokens, top_logprobs <= vocab).
  void validate(int64_t vocab = -1) const;
  std::string to_string() const;
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
// indexed by s). sample() uses step() and then increments it, greedy steps included, so the n-th token of a job
// depends only on its seed, its own logits and n.
class Sampler {
 public:
  explicit Sampler(SamplerSettings settings);  // validates the vocab-independent fields; resolves seed 0

  // logits: [vocab] f32 on the host, finite or -inf (NaN / +inf throw InvalidArgument naming the id).
  // context_tokens: prompt + generated so far (repetition penalty); generated: generated so far (frequency and
  // presence penalties). All ids must be in [0, vocab). Throws InvalidArgument when every token is banned / -inf.
  SampleResult sample(const float* logits, int64_t vocab, const std::vector<int32_t>& context_tokens,
                      const std::vector<int32_t>& generated);

  // True when sample() reads nothing from a row but its argmax and that token's log-probability: temperature 0
  // and no logit_bias, banned_tokens, penalties (repetition 1, frequency and presence 0) or top_logprobs. Such a
  // row can be reduced on the logits' device (ops::argmax_logprob) instead of copied to the host: the engine's
  // device argmax (engine.cpp, device_argmax_enabled). Token masks and rewind bans are the engine's, not seen here.
  bool greedy_plain() const;
  // sample()'s result for a greedy_plain() row from ops::argmax_logprob's (index, logprob) of that row: the same
  // token, logprob (bit-identical from the CPU backend), empty top, step advance, and the same InvalidArgument for
  // a NaN / +inf logit (index <= -2; logprob carries the value) or a row of -inf (index -1).
  SampleResult take_argmax(int32_t index, float logprob, int64_t vocab);

  // True when sample() reads nothing from a row but what ops::sample_logprob computes on the logits' device:
  // temperature > 0 with any of top_k / top_p / min_p, and no typical, logit_bias, banned_tokens, penalties or
  // top_logprobs (the engine's device sampling, engine.cpp device_sample_enabled; masks and rewind bans are the
  // engine's). greedy_plain() and sampled_plain() never both hold.
  bool sampled_plain() const;
  // The row's SampleParams for ops::sample_logprob at the current step: temperature 0 for greedy settings, else
  // the filters and u = uniform(seed, step()) (the draw sample() would make now; the RNG stays on the host).
  SampleParams device_params() const;
  // sample()'s result for a greedy_plain() or sampled_plain() row from ops::sample_logprob's (index, logprob) of
  // that row (device_params() taken at this step): the token, its logprob, empty top, the step advance, and
  // the same InvalidArgument as sample() for the op's error codes (index <= -2: NaN / +inf, -1: all -inf).
  // The CPU backend gives sample()'s token and logprob bit for bit; CUDA see ops.h sample_logprob.
  SampleResult take_device(int32_t index, float logprob, int64_t vocab);

  // The final distribution that sample() would draw from (steps 1-7): probs[vocab] summing to 1, zero outside the
  // support; greedy gives a one-hot at the argmax. Does not advance the step. For tests and debugging.
  std::vector<double> final_probs(const float* logits, int64_t vocab, const std::vector<int32_t>& context_tokens,
                                  const std::vector<int32_t>& generated) const;

  const SamplerSettings& settings() const { return settings_; }
  uint64_t seed() const { return settings_.seed; }  // the resolved seed (never 0)
  int64_t step() const { return step_; }
  void set_step(int64_t step);  // >= 0; e.g. to resume a job

  // The counter-based generator: a uniform double in [0, 1) with 53 random bits.
  static double uniform(uint64_t seed, int64_t step);

 private:
  SamplerSettings settings_;
  int64_t step_ = 0;
};

}  // namespace exl2
