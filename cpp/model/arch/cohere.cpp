// CohereForCausalLM (Command-R, Aya): LayerNorm without bias (layer_norm_eps) before a parallel attention + MLP
// block (h += attn(x) + mlp(x), x = norm(h)), RoPE on interleaved pairs, logits times logit_scale, tied embeddings
// by default; attention_bias on q/k/v/o; use_qk_norm (Command R+): LayerNorm over each head of q and k before RoPE,
// with a weight per head (self_attn.q_norm.weight [n_heads, head_dim], k_norm [n_kv_heads, head_dim]).
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
  if (c.flag("use_qk_norm", false)) {  // Command R+: LayerNorm of each head of q and k, a weight per head
    s.names.q_norm = "self_attn.q_norm.weight";
    s.names.k_norm = "self_attn.k_norm.weight";
    s.qk_norm_per_head = true;
  }
  return s;
}

}  // namespace exl2
