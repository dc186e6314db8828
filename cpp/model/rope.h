// RoPE tables for every rope_scaling type (default, linear, dynamic, llama3, yarn, longrope), computed as HF
// transformers' modeling_rope_utils does, in double precision, stored f32.
#pragma once

#include <vector>

#include "exl2/config.h"
#include "exl2/tensor.h"

namespace exl2 {

// inv_freq [head_dim/2] and the attention factor that scales cos/sin (yarn; 1 otherwise), for a RoPE of base
// theta and scaling rs over head_dim channels; max_position_embeddings: the config's (rs's original context when it
// gives none).
// Dynamic NTK: HF recomputes the base from the current sequence length once it passes the original context;
// a paged cache cannot re-rotate stored keys, so we use the base for `max_pos` when max_pos exceeds the
// original context (the length the cache is built for) and the plain base otherwise. Longrope likewise: HF takes
// the long factors when the sequence passes the original context; we take them when max_pos does.
std::vector<double> rope_inv_freq(int64_t head_dim, int64_t max_position_embeddings, double theta,
                                  const RopeScaling& rs, int64_t max_pos, double* attention_factor);

// f32 [max_pos, head_dim]: cos(p * inv_freq[i]) * factor in columns [0, head_dim/2), sin(...) * factor after.
// rotary_dim > 0 (partial RoPE): inv_freq over rotary_dim channels for columns [0, rotary_dim/2), the columns after
// them cos 1, sin 0 (the kernels' pairs (i, head_dim/2 + i) that the q/k rows reordered at load leave unrotated).
Tensor build_rope_table(int64_t head_dim, int64_t max_position_embeddings, double theta, const RopeScaling& rs,
                        int64_t max_pos, int64_t rotary_dim = 0);

// The same for the config's own RoPE (rope_theta, rope_scaling).
std::vector<double> rope_inv_freq(const ModelConfig& config, int64_t max_pos, double* attention_factor);
Tensor build_rope_table(const ModelConfig& config, int64_t max_pos);

}  // namespace exl2
