// Qwen2MoeForCausalLM (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (q/k/v biases) and on the layers
// read_sparse_layers picks a mixture of num_experts SwiGLU experts (mlp.experts.N.gate_proj / up_proj / down_proj,
// width moe_intermediate_size; norm_topk_prob renormalises the top-k weights) plus a shared expert
// (mlp.shared_expert.*, width shared_expert_intermediate_size) scaled by sigmoid(mlp.shared_expert_gate); the other
// layers have the dense MLP (intermediate_size).
#include "model/decoder.h"

namespace exl2 {

DecoderSpec qwen2_moe_arch(ArchConfig& c) {
  DecoderSpec s = llama_like(c);
  s.qkv_bias = c.flag("qkv_bias", true);
  if (c.flag("use_sliding_window", false))
    c.unsupported("use_sliding_window", "sliding windows of Qwen2-MoE are not supported");
  c.accept({"sliding_window", "max_window_layers"});  // only read with use_sliding_window
  read_layer_windows(c, s, 0);                        // layer_types: checked, all full attention
  s.moe.n_experts = c.integer("num_experts", 60);
  s.moe.top_k = c.integer("num_experts_per_tok", 4);
  s.moe.inter = c.integer("moe_intermediate_size", 1408);
  s.moe.shared_inter = c.integer("shared_expert_intermediate_size", 5632);
  if (s.moe.shared_inter < 1) c.unsupported("shared_expert_intermediate_size", "must be positive");
  s.moe.renormalize = c.flag("norm_topk_prob", false);
  read_sparse_layers(c, s);
  s.names.router = "mlp.gate";
  s.names.experts = "mlp.experts.";
  s.names.expert_gate = "gate_proj";
  s.names.expert_up = "up_proj";
  s.names.expert_down = "down_proj";
  s.names.shared_gate = "mlp.shared_expert.gate_proj";
  s.names.shared_up = "mlp.shared_expert.up_proj";
  s.names.shared_down = "mlp.shared_expert.down_proj";
  s.names.shared_scale = "mlp.shared_expert_gate";
  c.accept({"router_aux_loss_coef", "output_router_logits"});  // training only
  return s;
}

}  // namespace exl2
