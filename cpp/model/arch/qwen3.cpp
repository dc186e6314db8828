// Qwen3ForCausalLM: per-head RMSNorm of q and k (q_norm, k_norm over head_dim) before RoPE; attention_bias
// optional; sliding windows as Qwen2 (use_sliding_window, max_window_layers, layer_types).
#include "model/decoder.h"

namespace exl2 {

DecoderSpec qwen3_arch(ArchConfig& c) {
  DecoderSpec s = llama_like(c);
  s.names.q_norm = "self_attn.q_norm.weight";
  s.names.k_norm = "self_attn.k_norm.weight";
  s.qkv_bias = s.o_bias = c.flag("attention_bias", false);
  const bool windows = c.flag("use_sliding_window", false);
  const int64_t window = c.integer("sliding_window", 0), first = c.integer("max_window_layers", 28);
  read_layer_windows(c, s, windows ? window : 0, first);
  return s;
}

}  // namespace exl2
