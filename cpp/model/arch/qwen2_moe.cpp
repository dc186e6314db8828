// Qwen2MoeForCausalLM (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention (q/k/v biases) and on the layers
// read_sparse_layers picks a mixture of SwiGLU experts (read_qwen_moe) plus a shared expert (mlp.shared_expert.*,
// width shared_expert_intermediate_size) scaled by sigmoid(mlp.shared_expert_gate); the other layers have the dense
// MLP (intermediate_size).
#include "model/decoder.h"

namespace exl2 {

DecoderSpec qwen2_moe_arch(ArchConfig& c) {
  DecoderSpec s = llama_like(c);
  s.qkv_bias = c.flag("qkv_bias", true);
  read_qwen_moe(c, s);
  read_layer_windows(c, s, 0);  // layer_types: checked, all full attention without use_sliding_window
  s.moe.shared_inter = c.integer("shared_expert_intermediate_size", 0);
  if (s.moe.shared_inter < 1) c.unsupported("shared_expert_intermediate_size", "must be positive");
  s.names.shared_gate = "mlp.shared_expert.gate_proj";
  s.names.shared_up = "mlp.shared_expert.up_proj";
  s.names.shared_down = "mlp.shared_expert.down_proj";
  s.names.shared_scale = "mlp.shared_expert_gate";
  return s;
}

}  // namespace exl2
