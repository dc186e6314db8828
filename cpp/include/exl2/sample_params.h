// One logit row's settings for picking its token on the logits' device (ops::sample_logprob, the engine's device
// argmax and device sampling): a plain POD shared by the public DeviceArgmax (model.h) and the backend kernels.
#pragma once

#include <cstdint>

namespace exl2 {

// The sampler's steps 3-6 and 8 (engine/sampler.h) for a row read as its processed logits (no bias, bans or
// penalties), without typical sampling. temperature 0: the argmax (the other fields ignored).
struct SampleParams {
  double u = 0.0;             // the uniform draw in [0, 1): Sampler::uniform(seed, step), computed on the host
  float temperature = 0.0f;   // >= 0, finite; 0 = greedy
  int32_t top_k = 0;          // >= 0; 0 = off
  float top_p = 1.0f;         // (0, 1]; 1 = off
  float min_p = 0.0f;         // [0, 1); 0 = off
};
static_assert(sizeof(SampleParams) == 24, "SampleParams crosses to the device as 24 bytes per row");

}  // namespace exl2
