// MistralForCausalLM: the Llama graph without biases. sliding_window is not applied: contexts up to the window
// (4096 for Mistral 7B v0.1, none for v0.2+) compute exactly; longer ones attend to the whole past.
#include "model/graph.h"

namespace exl2 {

DecoderTraits mistral_traits(const ModelConfig& c) {
  DecoderTraits t;
  t.mlp_bias = c.mlp_bias;
  return t;
}

}  // namespace exl2
