// Gemma2ForCausalLM: the embedding scaled by sqrt(hidden_size); Gemma's RMSNorm (1 + w) before and after both
// attention and MLP; GeGLU (hidden_activation gelu_pytorch_tanh); softmax scale query_pre_attn_scalar^-1/2;
// attention and final logits soft-capped (attn_ / final_logit_softcapping); sliding_window on the layers
// layer_types names (default: every other layer, the first sliding).
#include <cmath>

#include "model/decoder.h"

namespace exl2 {

// What Gemma 2 and Gemma 3 share (arch/gemma3.cpp).
DecoderSpec gemma_like(ArchConfig& c, const std::string& prefix, int64_t full_every) {
  DecoderSpec s = llama_like(c);
  const ModelConfig& mc = c.config();
  const std::string act = c.string("hidden_activation", "gelu_pytorch_tanh");  // what Gemma's MLP reads
  if (act != "gelu_pytorch_tanh") c.unsupported("hidden_activation", "Gemma's MLP runs gelu_pytorch_tanh only");
  s.act = Activation::GeluTanh;
  s.norm.plus_one = true;
  s.embed_scale = std::sqrt(static_cast<double>(mc.hidden_size));
  s.attn_scale = 1.0 / std::sqrt(c.number("query_pre_attn_scalar", 256));
  s.attn_softcap = c.number("attn_logit_softcapping", 0);
  s.final_softcap = c.number("final_logit_softcapping", 0);
  if (s.attn_softcap < 0) c.unsupported("attn_logit_softcapping", "a cap must be positive (or null)");
  if (s.final_softcap < 0) c.unsupported("final_logit_softcapping", "a cap must be positive (or null)");
  s.qkv_bias = s.o_bias = c.flag("attention_bias", false);
  c.require_value("use_bidirectional_attention", Json::make_bool(false), "exl2cpp runs causal attention only");
  c.accept({"cache_implementation"});  // "hybrid": HF's cache class for the windowed layers
  const int64_t window = c.integer("sliding_window", 0);
  if (c.has("sliding_window_size") && c.integer("sliding_window_size", 0) != window)
    c.unsupported("sliding_window_size", "it must equal sliding_window (the window HF runs)");
  read_layer_windows(c, s, window, 0, full_every);
  TensorNames& n = s.names;
  n.embed = prefix + "embed_tokens.weight";
  n.layers = prefix + "layers.";
  n.final_norm = prefix + "norm.weight";
  n.attn_post_norm = "post_attention_layernorm.weight";
  n.mlp_norm = "pre_feedforward_layernorm.weight";
  n.mlp_post_norm = "post_feedforward_layernorm.weight";
  return s;
}

DecoderSpec gemma2_arch(ArchConfig& c) { return gemma_like(c, "model.", 2); }

}  // namespace exl2
