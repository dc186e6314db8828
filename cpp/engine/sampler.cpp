// The token sampler (see sampler.h for the contract): O(vocab) passes over one row of logits, selection instead of
// full sorts wherever the filters allow it, thread-local scratch so per-job samplers stay small.
#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "backend/cpu/sample_filter.h"
#include "backend/cpu/sum_exp.h"
#include "exl2/errors.h"

namespace exl2 {

namespace {

using cpu::SampleCand;
using cpu::sum_exp;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Vocab-sized working memory, reused across calls on one thread.
struct Scratch {
  std::vector<float> l;         // [vocab] processed logits
  std::vector<uint32_t> stamp;  // [vocab] "seen in this call" marks for the repetition penalty
  uint32_t epoch = 0;
  std::vector<int32_t> count;  // [vocab] occurrence counts, all zero between calls
  std::vector<SampleCand> cand;  // surviving candidates
  std::vector<SampleCand> sel;   // top-p selection buffer
  std::vector<float> vals;       // top-k selection buffer

  void reserve(int64_t vocab) {
    if (static_cast<int64_t>(l.size()) < vocab) {
      l.resize(vocab);
      stamp.assign(vocab, 0);
      epoch = 0;
      count.assign(vocab, 0);
    }
  }
  uint32_t next_epoch() {
    if (++epoch == 0) {  // wrapped: old marks could alias the new epoch
      std::fill(stamp.begin(), stamp.end(), 0u);
      epoch = 1;
    }
    return epoch;
  }
};

thread_local Scratch tls_scratch;

// splitmix64 finalizer (Steele, Lea, Flood 2014, "Fast splittable pseudorandom number generators").
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

bool is_finite_or_neg_inf(float x) {
  return !std::isnan(x) && x != kInf;
}

void check_ids(const std::vector<int32_t>& ids, size_t start, int64_t vocab, const char* what) {
  for (size_t i = start; i < ids.size(); ++i) {
    EXL2_CHECK(ids[i] >= 0 && ids[i] < vocab, "sampler: ", what, "[", i, "] = ", ids[i], " is not a token id in [0, ",
               vocab, "); pass the token ids of this model's vocabulary");
  }
}

size_t window_start(size_t n, int32_t window) {
  if (window < 0 || static_cast<size_t>(window) >= n) return 0;
  return n - static_cast<size_t>(window);
}

[[noreturn]] void fail_bad_logit(int64_t i, float x, float input) {
  EXL2_FAIL(InvalidArgument, "sampler: logits[", i, "] is ", x, " after bias/penalties (input value ", input,
            "); logits must be finite or -inf: the model produced NaN/inf, check its weights and dtype");
}

[[noreturn]] void fail_all_neg_inf(int64_t vocab) {
  EXL2_FAIL(InvalidArgument, "sampler: every token is banned or has logit -inf (vocab ", vocab,
            "), nothing can be sampled; relax banned_tokens / logit_bias");
}

// DRY (sampler.h step 2) on l: the longest match of the context's tail before each earlier occurrence of its last
// token, per following token; sc.count holds those lengths for the tokens touched and is all zero again after.
void apply_dry(const SamplerSettings& s, const std::vector<int32_t>& context, int64_t vocab, float* l, Scratch& sc) {
  const size_t start = s.dry_range > 0 ? window_start(context.size(), s.dry_range) : 0;
  const int64_t n = static_cast<int64_t>(context.size() - start);
  if (n < 2) return;
  check_ids(context, start, vocab, "context_tokens");
  const int32_t* c = context.data() + start;
  const uint32_t ep = sc.next_epoch();
  for (int32_t id : s.dry_sequence_breakers) sc.stamp[id] = ep;
  auto breaker = [&](int32_t id) { return sc.stamp[id] == ep; };
  const int32_t last = c[n - 1];
  if (breaker(last)) return;
  thread_local std::vector<int32_t> touched;
  touched.clear();
  for (int64_t i = 0; i + 1 < n; ++i) {
    if (c[i] != last) continue;
    const int32_t next = c[i + 1];
    if (breaker(next)) continue;
    int32_t m = 1;  // c[i] == c[n-1]: a match of length 1
    while (m < SamplerSettings::kDryMaxMatch) {
      const int64_t j = i - m;
      if (j < 0) break;
      const int32_t prev = c[n - 1 - m];
      if (c[j] != prev || breaker(prev)) break;
      m++;
    }
    if (sc.count[next] == 0) touched.push_back(next);
    sc.count[next] = std::max(sc.count[next], m);
  }
  for (int32_t id : touched) {
    const int32_t m = sc.count[id];
    sc.count[id] = 0;
    if (m < s.dry_allowed_length) continue;
    l[id] -= static_cast<float>(static_cast<double>(s.dry_multiplier) *
                                std::pow(static_cast<double>(s.dry_base), m - s.dry_allowed_length));
  }
}

// Steps 1-2: bias, bans, penalties into sc.l. Then checks every logit (NaN / +inf throw) and finds the argmax
// (ties to the lowest id). Returns the argmax, or -1 when every logit is -inf.
int32_t process_logits(const SamplerSettings& s, const float* logits, int64_t vocab,
                       const std::vector<int32_t>& context, const std::vector<int32_t>& generated, Scratch& sc) {
  EXL2_CHECK(logits != nullptr && vocab > 0, "sampler: expected a non-empty row of logits, got vocab = ", vocab);
  s.validate(vocab);
  sc.reserve(vocab);
  float* l = sc.l.data();
  std::memcpy(l, logits, sizeof(float) * vocab);

  for (const auto& [id, bias] : s.logit_bias) l[id] += bias;
  if (!s.allowed_tokens.empty()) {
    const uint32_t ep = sc.next_epoch();
    for (int32_t id : s.allowed_tokens) sc.stamp[id] = ep;
    for (int64_t i = 0; i < vocab; ++i)
      if (sc.stamp[i] != ep) l[i] = -kInf;
  }
  for (int32_t id : s.banned_tokens) l[id] = -kInf;
  if (static_cast<int64_t>(generated.size()) < s.min_tokens)
    for (int32_t id : s.stop_tokens) l[id] = -kInf;

  if (s.repetition_penalty != 1.0f && !context.empty()) {
    const size_t start = window_start(context.size(), s.penalty_window);
    check_ids(context, start, vocab, "context_tokens");
    const uint32_t ep = sc.next_epoch();
    const float r = s.repetition_penalty;
    for (size_t i = start; i < context.size(); ++i) {
      const int32_t id = context[i];
      if (sc.stamp[id] == ep) continue;  // each distinct id is penalized once
      sc.stamp[id] = ep;
      l[id] = l[id] < 0.0f ? l[id] * r : l[id] / r;
    }
  }
  if ((s.frequency_penalty != 0.0f || s.presence_penalty != 0.0f) && !generated.empty()) {
    const size_t start = window_start(generated.size(), s.penalty_window);
    check_ids(generated, start, vocab, "generated");
    for (size_t i = start; i < generated.size(); ++i) sc.count[generated[i]]++;
    for (size_t i = start; i < generated.size(); ++i) {
      const int32_t id = generated[i];
      const int32_t c = sc.count[id];
      if (c == 0) continue;  // already applied
      l[id] -= static_cast<float>(c) * s.frequency_penalty + s.presence_penalty;
      sc.count[id] = 0;
    }
  }

  if (s.dry_multiplier > 0.0f) apply_dry(s, context, vocab, l, sc);

  int32_t best = -1;
  float best_v = -kInf;
  for (int64_t i = 0; i < vocab; ++i) {
    const float x = l[i];
    if (!(x < kInf)) fail_bad_logit(i, x, logits[i]);
    if (x > best_v) {
      best_v = x;
      best = static_cast<int32_t>(i);
    }
  }
  if (best < 0) fail_all_neg_inf(vocab);
  return best;
}

// log(sum(exp(l))) over the processed logits; lmax is their (finite) maximum.
double log_sum_exp(const float* l, int64_t vocab, float lmax) {
  return static_cast<double>(lmax) + std::log(sum_exp(l, vocab, lmax));
}

// The top n (id, logprob) by processed logit, desc, ties to the lower id; -inf excluded. Heap of size n: O(V log n).
std::vector<std::pair<int32_t, float>> top_logprobs(const float* l, int64_t vocab, int32_t n, double lse) {
  std::vector<std::pair<int32_t, float>> out;
  if (n <= 0) return out;
  // "a before b" = a is more likely (higher logit, then lower id). The heap keeps the least likely on top.
  auto better = [](const std::pair<int32_t, float>& a, const std::pair<int32_t, float>& b) {
    return a.second > b.second || (a.second == b.second && a.first < b.first);
  };
  out.reserve(n + 1);
  for (int64_t i = 0; i < vocab; ++i) {
    const float x = l[i];
    if (x == -kInf) continue;
    std::pair<int32_t, float> e{static_cast<int32_t>(i), x};
    if (static_cast<int32_t>(out.size()) < n) {
      out.push_back(e);
      std::push_heap(out.begin(), out.end(), better);
    } else if (better(e, out.front())) {
      std::pop_heap(out.begin(), out.end(), better);
      out.back() = e;
      std::push_heap(out.begin(), out.end(), better);
    }
  }
  std::sort(out.begin(), out.end(), better);
  for (auto& e : out) e.second = static_cast<float>(e.second - lse);
  return out;
}

// Steps 3-12's settings at one step: mu is this step's, xtc whether XTC's coin came up.
cpu::SampleFilter filter_of(const SamplerSettings& s, float mu, bool xtc) {
  cpu::SampleFilter f;
  f.temperature = s.temperature_last ? 1.0f : s.temperature;
  f.top_k = s.top_k;
  f.top_p = s.top_p;
  f.min_p = s.min_p;
  f.typical = s.typical;
  f.smoothing_factor = s.smoothing_factor;
  f.smoothing_curve = s.smoothing_curve;
  f.top_a = s.top_a;
  f.tfs = s.tfs;
  f.mirostat = s.mirostat();
  f.mirostat_mu = mu;
  f.late_temperature = s.dynamic_temperature() || (s.temperature_last && s.temperature != 1.0f);
  f.late_t = s.temperature_last ? s.temperature : 1.0f;
  f.min_temp = s.min_temp;
  f.max_temp = s.max_temp;
  f.temp_exponent = s.temp_exponent;
  f.xtc = xtc;
  f.xtc_threshold = s.xtc_threshold;
  return f;
}

}  // namespace

void SamplerSettings::validate(int64_t vocab) const {
  auto bad = [](const char* field, const auto& value, const char* range) {
    EXL2_FAIL(InvalidArgument, "SamplerSettings.", field, " = ", value, " is out of range: expected ", range);
  };
  if (!(temperature >= 0.0f) || !std::isfinite(temperature))
    bad("temperature", temperature, "a finite value >= 0 (0 = greedy)");
  if (top_k < 0) bad("top_k", top_k, "an integer >= 0 (0 = off)");
  if (!(top_p > 0.0f && top_p <= 1.0f)) bad("top_p", top_p, "(0, 1] (1 = off)");
  if (!(min_p >= 0.0f && min_p < 1.0f)) bad("min_p", min_p, "[0, 1) (0 = off)");
  if (!(typical > 0.0f && typical <= 1.0f)) bad("typical", typical, "(0, 1] (1 = off)");
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty))
    bad("repetition_penalty", repetition_penalty, "a finite value > 0 (1 = off)");
  if (!std::isfinite(frequency_penalty)) bad("frequency_penalty", frequency_penalty, "a finite value (0 = off)");
  if (!std::isfinite(presence_penalty)) bad("presence_penalty", presence_penalty, "a finite value (0 = off)");
  if (penalty_window < -1) bad("penalty_window", penalty_window, "an integer >= -1 (-1 = all tokens, 0 = none)");
  auto finite_at_least = [&](const char* field, float v, float lo, const char* range) {
    if (!(v >= lo) || !std::isfinite(v)) bad(field, v, range);
  };
  auto unit = [&](const char* field, float v, const char* range) {
    if (!(v >= 0.0f && v <= 1.0f)) bad(field, v, range);
  };
  if (min_tokens < 0) bad("min_tokens", min_tokens, "an integer >= 0 (0 = off)");
  finite_at_least("smoothing_factor", smoothing_factor, 0.0f, "a finite value >= 0 (0 = off)");
  if (!(smoothing_curve >= 1.0f && smoothing_curve <= 3.0f))
    bad("smoothing_curve", smoothing_curve, "[1, 3] (1 = quadratic; the range where the logits keep their order)");
  finite_at_least("min_temp", min_temp, 0.0f, "a finite value >= 0");
  finite_at_least("max_temp", max_temp, 0.0f, "a finite value >= 0");
  if (min_temp > max_temp)
    EXL2_FAIL(InvalidArgument, "SamplerSettings.min_temp = ", min_temp, " is above max_temp = ", max_temp,
              ": expected min_temp <= max_temp (dynamic temperature is on when max_temp > min_temp)");
  finite_at_least("temp_exponent", temp_exponent, 0.0f, "a finite value >= 0");
  unit("top_a", top_a, "[0, 1] (0 = off)");
  if (!(tfs > 0.0f && tfs <= 1.0f)) bad("tfs", tfs, "(0, 1] (1 = off)");
  if (mirostat_mode == 1)
    EXL2_FAIL(Unsupported, "SamplerSettings.mirostat_mode = 1: mirostat v1 is not implemented; use 2 (mirostat v2) "
              "or 0 (off)");
  if (mirostat_mode != 0 && mirostat_mode != 2) bad("mirostat_mode", mirostat_mode, "0 (off) or 2 (mirostat v2)");
  finite_at_least("mirostat_tau", mirostat_tau, 0.0f, "a finite value >= 0 (target surprise in bits)");
  finite_at_least("mirostat_eta", mirostat_eta, 0.0f, "a finite value >= 0 (learning rate)");
  unit("xtc_probability", xtc_probability, "[0, 1] (0 = off)");
  unit("xtc_threshold", xtc_threshold, "[0, 1]");
  finite_at_least("dry_multiplier", dry_multiplier, 0.0f, "a finite value >= 0 (0 = off)");
  finite_at_least("dry_base", dry_base, 1.0f, "a finite value >= 1");
  if (dry_allowed_length < 1) bad("dry_allowed_length", dry_allowed_length, "an integer >= 1");
  if (dry_range < 0) bad("dry_range", dry_range, "an integer >= 0 (0 = the whole context)");
  if (top_logprobs < 0) bad("top_logprobs", top_logprobs, "an integer >= 0");
  if (vocab >= 0 && top_logprobs > vocab)
    bad("top_logprobs", top_logprobs, str_cat("[0, vocab = ", vocab, "]").c_str());
  for (size_t i = 0; i < logit_bias.size(); ++i) {
    const auto& [id, b] = logit_bias[i];
    if (!is_finite_or_neg_inf(b))
      EXL2_FAIL(InvalidArgument, "SamplerSettings.logit_bias[", i, "] = (", id, ", ", b,
                "): the bias must be finite or -inf (-inf bans the token)");
    if (id < 0 || (vocab >= 0 && id >= vocab))
      EXL2_FAIL(InvalidArgument, "SamplerSettings.logit_bias[", i, "] has token id ", id, ", expected an id in [0, ",
                vocab >= 0 ? str_cat(vocab) : std::string("vocab"), ")");
  }
  auto check_list = [&](const char* field, const std::vector<int32_t>& ids) {
    for (size_t i = 0; i < ids.size(); ++i) {
      const int32_t id = ids[i];
      if (id < 0 || (vocab >= 0 && id >= vocab))
        EXL2_FAIL(InvalidArgument, "SamplerSettings.", field, "[", i, "] = ", id, ", expected a token id in [0, ",
                  vocab >= 0 ? str_cat(vocab) : std::string("vocab"), ")");
    }
  };
  check_list("banned_tokens", banned_tokens);
  check_list("allowed_tokens", allowed_tokens);
  check_list("stop_tokens", stop_tokens);
  check_list("dry_sequence_breakers", dry_sequence_breakers);
}

std::string SamplerSettings::to_string() const {
  return str_cat("SamplerSettings(temperature=", temperature, ", top_k=", top_k, ", top_p=", top_p, ", min_p=", min_p,
                 ", typical=", typical, ", repetition_penalty=", repetition_penalty,
                 ", frequency_penalty=", frequency_penalty, ", presence_penalty=", presence_penalty,
                 ", penalty_window=", penalty_window, ", logit_bias=<", logit_bias.size(), " entries>, banned_tokens=<",
                 banned_tokens.size(), " ids>, allowed_tokens=<", allowed_tokens.size(), " ids>, min_tokens=", min_tokens,
                 ", stop_tokens=<", stop_tokens.size(), " ids>, smoothing_factor=", smoothing_factor,
                 ", smoothing_curve=", smoothing_curve, ", temperature_last=", temperature_last ? "True" : "False",
                 ", min_temp=", min_temp, ", max_temp=", max_temp, ", temp_exponent=", temp_exponent,
                 ", top_a=", top_a, ", tfs=", tfs, ", mirostat_mode=", mirostat_mode, ", mirostat_tau=", mirostat_tau,
                 ", mirostat_eta=", mirostat_eta, ", xtc_probability=", xtc_probability,
                 ", xtc_threshold=", xtc_threshold, ", dry_multiplier=", dry_multiplier, ", dry_base=", dry_base,
                 ", dry_allowed_length=", dry_allowed_length, ", dry_range=", dry_range, ", dry_sequence_breakers=<",
                 dry_sequence_breakers.size(), " ids>, seed=", seed, ", top_logprobs=", top_logprobs, ")");
}

Sampler::Sampler(SamplerSettings settings) : settings_(std::move(settings)) {
  settings_.validate();
  if (settings_.seed == 0) {
    std::random_device rd;
    uint64_t s = (static_cast<uint64_t>(rd()) << 32) ^ static_cast<uint64_t>(rd());
    settings_.seed = s != 0 ? s : 0x9E3779B97F4A7C15ULL;
  }
  if (settings_.mirostat()) mu_.assign(1, 2.0f * settings_.mirostat_tau);
}

void Sampler::set_step(int64_t step) {
  EXL2_CHECK(step >= 0, "Sampler.step must be >= 0, got ", step);
  if (!mu_.empty()) {
    EXL2_CHECK(step <= step_, "Sampler.step: with mirostat the step can only go back (mu is known for steps 0 .. ",
               step_, "), got ", step);
    mu_.resize(static_cast<size_t>(step) + 1);
  }
  step_ = step;
}

double Sampler::uniform(uint64_t seed, int64_t step, uint64_t stream) {
  // splitmix64: the state after step+1 increments of the golden gamma from a start derived from the seed (and the
  // stream: 0 leaves the start as it is). Distinct seeds or streams start at (pseudo)random points of the 2^64
  // cycle, so their sequences do not overlap in practice.
  const uint64_t start = mix64(seed) ^ mix64(stream * 0xD1B54A32D192ED03ULL);  // mix64(0) == 0
  const uint64_t h = mix64(start + 0x9E3779B97F4A7C15ULL * (static_cast<uint64_t>(step) + 1));
  return static_cast<double>(h >> 11) * 0x1.0p-53;
}

SampleResult Sampler::sample(const float* logits, int64_t vocab, const std::vector<int32_t>& context_tokens,
                             const std::vector<int32_t>& generated) {
  Scratch& sc = tls_scratch;
  const int32_t argmax = process_logits(settings_, logits, vocab, context_tokens, generated, sc);
  const float* l = sc.l.data();
  const double lse = log_sum_exp(l, vocab, l[argmax]);

  SampleResult r;
  const int64_t step = step_;
  float mu = mirostat_mu();
  if (settings_.temperature == 0.0f) {
    r.token = argmax;
  } else {
    const double total =
        cpu::filter_candidates(l, vocab, l[argmax], filter_at(step), sc.cand, sc.vals, sc.sel);
    r.token = cpu::draw_candidate(sc.cand, total, uniform(settings_.seed, step));
    EXL2_CHECK_KIND(Internal, r.token >= 0, "sampler: empty final distribution (", sc.cand.size(), " candidates)");
    if (settings_.mirostat()) {  // the observed surprise of the drawn token under the final distribution
      double w = 0.0;
      for (const cpu::SampleCand& c : sc.cand)
        if (c.id == r.token) w = c.w;
      mu += settings_.mirostat_eta * static_cast<float>(settings_.mirostat_tau + std::log2(w / total));
    }
  }
  advance(mu);
  r.logprob = static_cast<float>(l[r.token] - lse);
  r.top = top_logprobs(l, vocab, settings_.top_logprobs, lse);
  return r;
}

void Sampler::advance(float mu) {
  step_++;
  if (!mu_.empty()) mu_.push_back(mu);
}

cpu::SampleFilter Sampler::filter_at(int64_t step) const {
  const bool xtc = settings_.xtc_probability > 0.0f && uniform(settings_.seed, step, 1) < settings_.xtc_probability;
  return filter_of(settings_, mirostat_mu(), xtc);
}

namespace {

// Nothing of steps 1-2 (a row read as its processed logits) and no top_logprobs.
bool logits_plain(const SamplerSettings& s) {
  return s.top_logprobs == 0 && s.logit_bias.empty() && s.banned_tokens.empty() && s.allowed_tokens.empty() &&
         s.min_tokens == 0 && s.repetition_penalty == 1.0f && s.frequency_penalty == 0.0f &&
         s.presence_penalty == 0.0f && s.dry_multiplier == 0.0f;
}

}  // namespace

bool Sampler::greedy_plain() const {
  return settings_.temperature == 0.0f && logits_plain(settings_);
}

bool Sampler::sampled_plain() const {
  const SamplerSettings& s = settings_;
  return s.temperature > 0.0f && logits_plain(s) && s.typical == 1.0f && s.top_a == 0.0f && s.tfs == 1.0f &&
         s.smoothing_factor == 0.0f && !s.temperature_last && !s.dynamic_temperature() && !s.mirostat() &&
         s.xtc_probability == 0.0f;
}

SampleParams Sampler::device_params() const {
  SampleParams p;
  p.temperature = settings_.temperature;
  if (p.temperature > 0.0f) {
    p.u = uniform(settings_.seed, step_);
    p.top_k = settings_.top_k;
    p.top_p = settings_.top_p;
    p.min_p = settings_.min_p;
  }
  return p;
}

SampleParams Sampler::device_params_at(int64_t step) const {
  SampleParams p = device_params();
  if (p.temperature > 0.0f) p.u = uniform(settings_.seed, step);
  return p;
}

int32_t Sampler::propose(const float* logits, int64_t vocab, const std::vector<int32_t>& context_tokens,
                         const std::vector<int32_t>& generated, int64_t step, std::vector<double>* q) const {
  EXL2_CHECK(!settings_.mirostat() || settings_.temperature == 0.0f,
             "sampler.propose: mirostat's state cannot follow draft tokens; speculation is off for such jobs");
  Scratch& sc = tls_scratch;
  const int32_t argmax = process_logits(settings_, logits, vocab, context_tokens, generated, sc);
  if (argmax < 0) fail_all_neg_inf(vocab);
  if (settings_.temperature == 0.0f) return argmax;
  const bool xtc = settings_.xtc_probability > 0.0f && uniform(settings_.seed, step, 1) < settings_.xtc_probability;
  const double total = cpu::filter_candidates(sc.l.data(), vocab, sc.l[argmax], filter_of(settings_, 0.0f, xtc),
                                              sc.cand, sc.vals, sc.sel);
  const int32_t token = cpu::draw_candidate(sc.cand, total, uniform(settings_.seed, step, 3));
  EXL2_CHECK_KIND(Internal, token >= 0, "sampler.propose: empty final distribution");
  q->assign(static_cast<size_t>(vocab), 0.0);
  for (const SampleCand& c : sc.cand) (*q)[c.id] = c.w / total;
  return token;
}

SampleResult Sampler::verify(const float* logits, int64_t vocab, const std::vector<int32_t>& context_tokens,
                             const std::vector<int32_t>& generated, int32_t draft, const std::vector<double>* q,
                             bool* accepted) {
  if (q == nullptr) {
    SampleResult r = sample(logits, vocab, context_tokens, generated);
    *accepted = r.token == draft;
    return r;
  }
  EXL2_CHECK(settings_.temperature > 0.0f && !settings_.mirostat(),
             "sampler.verify: a draft distribution needs sampled settings without mirostat");
  EXL2_CHECK(static_cast<int64_t>(q->size()) == vocab && draft >= 0 && draft < vocab && (*q)[draft] > 0.0,
             "sampler.verify: the draft token ", draft, " must have q > 0 in a [vocab] distribution");
  Scratch& sc = tls_scratch;
  const int32_t argmax = process_logits(settings_, logits, vocab, context_tokens, generated, sc);
  if (argmax < 0) fail_all_neg_inf(vocab);
  const float* l = sc.l.data();
  const double lse = log_sum_exp(l, vocab, l[argmax]);
  const int64_t step = step_;
  const double total = cpu::filter_candidates(l, vocab, l[argmax], filter_at(step), sc.cand, sc.vals, sc.sel);
  double p_draft = 0.0;
  for (const SampleCand& c : sc.cand)
    if (c.id == draft) p_draft = c.w / total;
  SampleResult r;
  *accepted = uniform(settings_.seed, step, 2) * (*q)[draft] < p_draft;
  if (*accepted) {
    r.token = draft;
  } else {
    // Residual max(0, p - q) over the support of p (q's mass elsewhere only lowers it), drawn in id order.
    std::sort(sc.cand.begin(), sc.cand.end(), [](const SampleCand& a, const SampleCand& b) { return a.id < b.id; });
    double res_total = 0.0;
    for (SampleCand& c : sc.cand) {
      c.w = std::max(0.0, c.w / total - (*q)[c.id]);
      res_total += c.w;
    }
    const double u = uniform(settings_.seed, step, 0);
    if (res_total > 0.0) {
      r.token = cpu::draw_candidate(sc.cand, res_total, u);
    } else {  // p == q within rounding: p itself
      const double t2 = cpu::filter_candidates(l, vocab, l[argmax], filter_at(step), sc.cand, sc.vals, sc.sel);
      r.token = cpu::draw_candidate(sc.cand, t2, u);
    }
    EXL2_CHECK_KIND(Internal, r.token >= 0, "sampler.verify: empty residual distribution");
  }
  advance(mirostat_mu());
  r.logprob = static_cast<float>(l[r.token] - lse);
  r.top = top_logprobs(l, vocab, settings_.top_logprobs, lse);
  return r;
}

SampleResult Sampler::take_device(int32_t index, float logprob, int64_t vocab) {
  EXL2_CHECK(vocab > 0, "sampler: expected a non-empty row of logits, got vocab = ", vocab);
  EXL2_CHECK_KIND(Internal, index < vocab, "sampler.take_device: index ", index, " outside the vocab ", vocab);
  if (index <= -2) fail_bad_logit(-2 - static_cast<int64_t>(index), logprob, logprob);
  if (index < 0) fail_all_neg_inf(vocab);
  advance(mirostat_mu());  // as sample(): one step per token, greedy or sampled
  SampleResult r;
  r.token = index;
  r.logprob = logprob;
  return r;
}

SampleResult Sampler::take_argmax(int32_t index, float logprob, int64_t vocab) {
  return take_device(index, logprob, vocab);
}

std::vector<double> Sampler::final_probs(const float* logits, int64_t vocab, const std::vector<int32_t>& context_tokens,
                                         const std::vector<int32_t>& generated) const {
  Scratch& sc = tls_scratch;
  const int32_t argmax = process_logits(settings_, logits, vocab, context_tokens, generated, sc);
  std::vector<double> p(vocab, 0.0);
  if (settings_.temperature == 0.0f) {
    p[argmax] = 1.0;
    return p;
  }
  const double total =
      cpu::filter_candidates(sc.l.data(), vocab, sc.l[argmax], filter_at(step_), sc.cand, sc.vals, sc.sel);
  for (const SampleCand& c : sc.cand) p[c.id] = c.w / total;
  return p;
}

}  // namespace exl2
