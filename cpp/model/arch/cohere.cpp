// CohereForCausalLM (Command-R, Aya): LayerNorm without bias (layer_norm_eps) before a parallel attention + MLP
// block (h += attn(x) + mlp(x), x = norm(h)), RoPE on interleaved pairs, logits times logit_scale, tied embeddings
// by default; attention_bias on q/k/v/o.
#include "model/decoder.h"

namespace exl2 {

DecoderSpec cohere_arch(ArchConfig& c) {
  DecoderSpec s = llama_like(c);
  s.norm.type = NormType::Layer;
  s.norm.eps = c.number("layer_norm_eps", 1e-5);
  s.residual = Residual::Parallel;
  s.names.mlp_norm.clear();
  s.rope_interleaved = true;
  s.logit_scale = c.number("logit_scale", 0.0625);
  s.qkv_bias = s.o_bias = c.flag("attention_bias", false);
  // Command R+: LayerNorm of q and k with a weight per head ([n_heads, head_dim]); the body's q/k norm shares one.
  if (c.flag("use_qk_norm", false)) c.unsupported("use_qk_norm", "per-head q/k LayerNorm is not implemented");
  return s;
}

}  // namespace exl2
