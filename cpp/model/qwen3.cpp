// Qwen3ForCausalLM: per-head RMSNorm of q and k (q_norm, k_norm over head_dim) before RoPE; attention_bias optional.
#include "model/graph.h"

namespace exl2 {

DecoderTraits qwen3_traits(const ModelConfig& c) {
  DecoderTraits t;
  t.qk_norm = true;
  t.qkv_bias = c.attention_bias;
  t.o_bias = c.attention_bias;
  return t;
}

}  // namespace exl2
