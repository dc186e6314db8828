// Qwen3MoeForCausalLM (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (q/k norms, optional attention_bias) and on
// the layers read_sparse_layers picks a mixture of SwiGLU experts (read_qwen_moe), no shared expert; the other
// layers have the dense MLP (intermediate_size).
#include "model/decoder.h"

namespace exl2 {

DecoderSpec qwen3_moe_arch(ArchConfig& c) {
  DecoderSpec s = llama_like(c);
  s.names.q_norm = "self_attn.q_norm.weight";
  s.names.k_norm = "self_attn.k_norm.weight";
  s.qkv_bias = s.o_bias = c.flag("attention_bias", false);
  read_qwen_moe(c, s);
  return s;
}

}  // namespace exl2
