// MistralForCausalLM: the Llama graph without biases; sliding_window (Mistral 7B v0.1: 4096; null from v0.2 on)
// on every layer.
#include "model/decoder.h"

namespace exl2 {

DecoderSpec mistral_arch(ArchConfig& c) {
  DecoderSpec s = llama_like(c);
  read_layer_windows(c, s, c.integer("sliding_window", 0));
  return s;
}

}  // namespace exl2
