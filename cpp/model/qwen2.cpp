// Qwen2ForCausalLM (Qwen2, Qwen2.5): biases on the q/k/v projections, none on o_proj or the MLP.
#include "model/graph.h"

namespace exl2 {

DecoderTraits qwen2_traits(const ModelConfig&) {
  DecoderTraits t;
  t.qkv_bias = true;
  return t;
}

}  // namespace exl2
