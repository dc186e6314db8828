// Qwen3MoeForCausalLM (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (q/k norms, optional attention_bias) and on
// the layers read_sparse_layers picks a mixture of num_experts SwiGLU experts (mlp.experts.N.gate_proj / up_proj /
// down_proj, width moe_intermediate_size; norm_topk_prob renormalises the top-k weights), no shared expert; the
// other layers have the dense MLP (intermediate_size).
#include "model/decoder.h"

namespace exl2 {

DecoderSpec qwen3_moe_arch(ArchConfig& c) {
  DecoderSpec s = llama_like(c);
  s.names.q_norm = "self_attn.q_norm.weight";
  s.names.k_norm = "self_attn.k_norm.weight";
  s.qkv_bias = s.o_bias = c.flag("attention_bias", false);
  if (c.flag("use_sliding_window", false))
    c.unsupported("use_sliding_window", "sliding windows of Qwen3-MoE are not supported");
  c.accept({"sliding_window", "max_window_layers"});  // only read with use_sliding_window
  // HF transformers 5 writes num_local_experts; the released checkpoints say num_experts.
  const char* experts = c.has("num_local_experts") ? "num_local_experts" : "num_experts";
  s.moe.n_experts = c.integer(experts, 128);
  s.moe.top_k = c.integer("num_experts_per_tok", 8);
  s.moe.inter = c.integer("moe_intermediate_size", 768);
  s.moe.renormalize = c.flag("norm_topk_prob", false);
  read_sparse_layers(c, s);
  s.names.router = "mlp.gate";
  s.names.experts = "mlp.experts.";
  s.names.expert_gate = "gate_proj";
  s.names.expert_up = "up_proj";
  s.names.expert_down = "down_proj";
  c.accept({"router_aux_loss_coef", "output_router_logits"});  // training only
  return s;
}

}  // namespace exl2
