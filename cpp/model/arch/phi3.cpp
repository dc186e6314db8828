// Phi3ForCausalLM (Phi-3, Phi-3.5, Phi-4): the Llama graph with q/k/v in one fused qkv_proj and gate/up in one
// gate_up_proj as stored ([q; k; v] and [gate; up] rows, each module reading its rows); RoPE default or longrope
// (short/long factors and the attention factor, config.cpp / rope.cpp), over the first partial_rotary_factor of
// each head; sliding_window on every layer.
#include "model/decoder.h"

namespace exl2 {

DecoderSpec phi3_arch(ArchConfig& c) {
  DecoderSpec s = llama_like(c);
  s.names.qkv = "self_attn.qkv_proj";
  s.names.gate_up = "mlp.gate_up_proj";
  s.ropes[0].rotary_dim = c.config().rotary_dim();  // partial_rotary_factor (Phi-4-mini: 0.75)
  read_layer_windows(c, s, c.integer("sliding_window", 0));
  return s;
}

}  // namespace exl2
