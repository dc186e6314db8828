// LlamaForCausalLM: Llama 1/2/3/3.1/3.2, SmolLM, TinyLlama. Optional attention_bias (q/k/v/o) and mlp_bias.
#include "model/graph.h"

namespace exl2 {

DecoderTraits llama_traits(const ModelConfig& c) {
  DecoderTraits t;
  t.qkv_bias = c.attention_bias;
  t.o_bias = c.attention_bias;
  t.mlp_bias = c.mlp_bias;
  return t;
}

}  // namespace exl2
