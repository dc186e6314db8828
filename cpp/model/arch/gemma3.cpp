// Gemma3ForCausalLM (Gemma 3 text, 270M / 1B): Gemma 2's composition (arch/gemma2.cpp) plus per-head q_norm /
// k_norm, a RoPE per layer type (sliding layers: rope_local_base_freq, default RoPE; full layers: rope_theta with
// rope_scaling; or rope_parameters keyed by layer type as transformers >= 5 writes it) and five sliding layers per
// full one (layer_types, else sliding_window_pattern). No attention soft-cap.
#include "model/decoder.h"

namespace exl2 {

DecoderSpec gemma_like(ArchConfig& c, const std::string& prefix, int64_t full_every);  // arch/gemma2.cpp

DecoderSpec gemma3_text(ArchConfig& c, const std::string& prefix) {
  const int64_t pattern = c.integer("sliding_window_pattern", c.integer("_sliding_window_pattern", 6));
  if (pattern < 1) c.unsupported("sliding_window_pattern", "a pattern must be a positive layer count");
  DecoderSpec s = gemma_like(c, prefix, pattern);
  if (s.attn_softcap > 0)  // Gemma 3's attention (transformers' reference) does not soft-cap: which model is meant?
    c.unsupported("attn_logit_softcapping", "Gemma 3 attention has no soft-cap (HF transformers applies none)");
  s.names.q_norm = "self_attn.q_norm.weight";
  s.names.k_norm = "self_attn.k_norm.weight";

  // ropes[0] for full layers, ropes[1] for sliding ones.
  const ModelConfig& mc = c.config();
  c.accept({"rope_scaling", "rope_parameters"});
  if (mc.layer_type_ropes.empty()) {
    const double local = c.number("rope_local_base_freq", 10000.0);
    if (!(local > 1)) c.unsupported("rope_local_base_freq", "a RoPE base must be greater than 1");
    s.ropes = {RopeSpec{false, mc.rope_theta, mc.rope_scaling}, RopeSpec{false, local, RopeScaling{}}};
  } else {
    s.ropes.assign(2, RopeSpec{});
    bool found[2] = {false, false};
    for (const LayerTypeRope& r : mc.layer_type_ropes) {
      const int k = r.layer_type == "full_attention" ? 0 : r.layer_type == "sliding_attention" ? 1 : -1;
      if (k < 0)
        c.unsupported("rope_parameters", "layer type '" + r.layer_type + "' (full_attention, sliding_attention)");
      s.ropes[k] = RopeSpec{false, r.theta, r.scaling};
      found[k] = true;
    }
    if (c.has("rope_local_base_freq"))  // transformers moves it into rope_parameters: one of the two is the model's
      c.unsupported("rope_local_base_freq", "set with rope_parameters keyed by layer type; give one of them");
    for (int k = 0; k < 2; ++k)
      if (!found[k])
        c.unsupported("rope_parameters", std::string("no entry for ") + (k ? "sliding" : "full") + "_attention");
  }
  const std::vector<std::string> types = c.strings("layer_types");  // checked by read_layer_windows
  for (size_t i = 0; i < s.layers.size(); ++i) {
    const bool sliding = types.empty() ? (i + 1) % pattern != 0 : types[i] == "sliding_attention";
    s.layers[i].rope = sliding ? 1 : 0;
  }
  return s;
}

DecoderSpec gemma3_arch(ArchConfig& c) { return gemma3_text(c, "model."); }

}  // namespace exl2
