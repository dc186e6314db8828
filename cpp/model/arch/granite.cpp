// GraniteForCausalLM (IBM Granite 3.x): the Llama graph with four multipliers: the embedding
// (embedding_multiplier), the softmax scale (attention_multiplier, in place of 1 / sqrt(head_dim)), each block's
// output before its residual add (residual_multiplier) and the logits (divided by logits_scaling).
#include "model/decoder.h"

namespace exl2 {

DecoderSpec granite_arch(ArchConfig& c) {
  DecoderSpec s = llama_like(c);
  s.qkv_bias = s.o_bias = c.flag("attention_bias", false);
  s.mlp_bias = c.flag("mlp_bias", false);
  s.embed_scale = c.number("embedding_multiplier", 1.0);
  s.attn_scale = c.number("attention_multiplier", 1.0);
  s.residual_scale = c.number("residual_multiplier", 1.0);
  const double logits_scaling = c.number("logits_scaling", 1.0);
  if (!(s.attn_scale > 0)) c.unsupported("attention_multiplier", "the softmax scale must be positive");
  if (logits_scaling == 0) c.unsupported("logits_scaling", "the logits are divided by it");
  s.logit_scale = 1.0 / logits_scaling;
  return s;
}

}  // namespace exl2
