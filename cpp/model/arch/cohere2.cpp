// Cohere2ForCausalLM (Command R7B, Command A): Cohere's parallel block, LayerNorm and interleaved RoPE, with
// sliding-window layers (layer_types; without it, three of every four: sliding_window_pattern) that use RoPE and
// full-attention layers that use none.
#include <algorithm>

#include "model/decoder.h"

namespace exl2 {

DecoderSpec cohere_arch(ArchConfig& c);  // arch/cohere.cpp: the parallel block, norms, RoPE and logit scale

DecoderSpec cohere2_arch(ArchConfig& c) {
  DecoderSpec s = cohere_arch(c);
  const ModelConfig& m = c.config();
  if (m.head_dim * m.num_attention_heads != m.hidden_size)  // transformers sets head_dim = hidden / heads
    c.unsupported("head_dim", "Cohere2 heads are hidden_size / num_attention_heads wide");
  const bool absent = !m.raw.find("sliding_window");  // absent: the class default; null: no window
  const int64_t window = c.integer("sliding_window", absent ? 4096 : 0);
  const int64_t pattern = c.integer("sliding_window_pattern", 4);  // read (and unused) when layer_types is given
  const bool typed = c.has("layer_types");
  if (!typed && pattern <= 0) c.unsupported("sliding_window_pattern", "it must be a positive integer");
  read_layer_windows(c, s, window, 0, typed ? 0 : pattern);  // untyped: every pattern-th layer full
  if (window <= 0 && typed) {
    const std::vector<std::string> types = c.strings("layer_types");
    if (std::count(types.begin(), types.end(), "sliding_attention"))
      c.unsupported("sliding_window", "sliding_attention layers need a positive window");
  } else if (window <= 0 && pattern > 1) {
    c.unsupported("sliding_window", "sliding layers need a positive window");
  }
  s.ropes.push_back(RopeSpec{true, 0.0, RopeScaling{}});  // full-attention layers: no rotation
  for (LayerSpec& l : s.layers) l.rope = l.window > 0 ? 0 : 1;
  // Keys of the original checkpoints' configs that transformers ignores; accepted at the values we run.
  if (c.has("rotary_pct") && c.number("rotary_pct", 1.0) != 1.0)
    c.unsupported("rotary_pct", "RoPE over part of each head is not implemented");
  if (c.string("position_embedding_type", "rope_gptj") != "rope_gptj")
    c.unsupported("position_embedding_type", "Cohere2 runs interleaved (GPT-J) RoPE");
  if (!c.flag("use_gated_activation", true)) c.unsupported("use_gated_activation", "the MLP is gated (SwiGLU)");
  if (c.string("order_of_interleaved_layers", "local_attn_first") != "local_attn_first")
    c.unsupported("order_of_interleaved_layers", "transformers places the sliding layers first");
  c.accept({"use_embedding_sharing", "cache_implementation"});  // tying follows the checkpoint's lm_head
  return s;
}

}  // namespace exl2
