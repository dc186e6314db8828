// MixtralForCausalLM (Mixtral 8x7B / 8x22B): the Mistral graph with every MLP a mixture of num_local_experts SwiGLU
// experts (block_sparse_moe.experts.N.w1 / w3 / w2), num_experts_per_tok chosen per token by the softmax of the
// router block_sparse_moe.gate, their weights renormalised to sum to 1.
#include "model/decoder.h"

namespace exl2 {

DecoderSpec mixtral_arch(ArchConfig& c) {
  DecoderSpec s = llama_like(c);
  read_layer_windows(c, s, c.integer("sliding_window", 0));
  s.moe.n_experts = c.integer("num_local_experts", 8);
  s.moe.top_k = c.integer("num_experts_per_tok", 2);
  s.moe.inter = c.config().intermediate_size;
  s.moe.renormalize = true;
  for (LayerSpec& l : s.layers) l.moe = true;
  c.accept({"router_jitter_noise", "router_aux_loss_coef", "output_router_logits"});  // training only
  return s;
}

}  // namespace exl2
