// Qwen2ForCausalLM (Qwen2, Qwen2.5): biases on the q/k/v projections, none on o_proj or the MLP; sliding windows
// only with use_sliding_window (on the layers from max_window_layers on, or as layer_types says).
#include "model/decoder.h"

namespace exl2 {

DecoderSpec qwen2_arch(ArchConfig& c) {
  DecoderSpec s = llama_like(c);
  s.qkv_bias = true;
  const bool windows = c.flag("use_sliding_window", false);
  const int64_t window = c.integer("sliding_window", 0), first = c.integer("max_window_layers", 28);
  read_layer_windows(c, s, windows ? window : 0, first);
  return s;
}

}  // namespace exl2
