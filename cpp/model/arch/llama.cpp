// LlamaForCausalLM: Llama 1/2/3/3.1/3.2, SmolLM, TinyLlama. Optional attention_bias (q/k/v/o) and mlp_bias.
#include "model/decoder.h"

namespace exl2 {

DecoderSpec llama_arch(ArchConfig& c) {
  DecoderSpec s = llama_like(c);
  s.qkv_bias = s.o_bias = c.flag("attention_bias", false);
  s.mlp_bias = c.flag("mlp_bias", false);
  return s;
}

}  // namespace exl2
