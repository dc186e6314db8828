// The host sampler's steps 3-12 for temperature > 0 (engine/sampler.h: temperature and smoothing, top-k, top-p,
// top-a, min-p, tfs, typical, mirostat's cut, the late temperature, XTC; and the CDF inversion) in one compiled
// copy, shared by engine/sampler.cpp and cpu::sample_logprob so that a token sampled by the CPU backend is the host
// sampler's token for the same draw, bit for bit.
#pragma once

#include <cstdint>
#include <vector>

namespace exl2::cpu {

struct SampleCand {
  int32_t id;
  float z;   // logit after temperature: (l - lmax) / T in f32
  double w;  // exp(z - zmax) in f32 (fast_exp), held as f64: the unnormalized probability
  SampleCand() {}  // uninitialized: resizing the vocab-sized buffer costs no memset
  SampleCand(int32_t id_, float z_, double w_) : id(id_), z(z_), w(w_) {}
};

struct SampleFilter {
  float temperature = 1.0f;  // > 0: the early temperature (step 3; 1 with temperature_last)
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float typical = 1.0f;
  // The rest are off by default (the device sampling path uses none of them).
  float smoothing_factor = 0.0f;
  float smoothing_curve = 1.0f;
  float top_a = 0.0f;
  float tfs = 1.0f;
  bool mirostat = false;
  float mirostat_mu = 0.0f;  // this step's mu
  bool late_temperature = false;  // step 11 runs: dynamic (max_temp > min_temp) or with late_t
  float late_t = 1.0f;
  float min_temp = 1.0f, max_temp = 1.0f, temp_exponent = 1.0f;
  bool xtc = false;  // XTC's coin came up at this step
  float xtc_threshold = 0.1f;
};

// Steps 3-12 over the processed logits l[vocab] (finite or -inf, at least one finite; lmax their maximum): fills
// cand with the final support and returns the sum of its weights (f64, in cand's order). cand is in id order
// except after typical sampling (which leaves its selection order); vals is scratch for the top-k selection.
double filter_candidates(const float* l, int64_t vocab, float lmax, const SampleFilter& f,
                         std::vector<SampleCand>& cand, std::vector<float>& vals, std::vector<SampleCand>& sel);

// Step 8: the first candidate, in cand's order, whose running f64 sum of weights exceeds u * total (u in [0, 1));
// when rounding leaves the sum at or below that, the last candidate with a positive weight. -1 when none has one.
int32_t draw_candidate(const std::vector<SampleCand>& cand, double total, double u);

}  // namespace exl2::cpu
