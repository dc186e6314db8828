// The decoder graph shared by the Llama family: embedding -> N x (RMSNorm, attention with RoPE over the paged
// cache, RMSNorm, SwiGLU MLP) -> RMSNorm -> lm_head. Architectures differ only in DecoderTraits, which their
// own files (llama.cpp, qwen2.cpp, ...) derive from the config and register under architectures[0].
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "exl2/model.h"
#include "exl2/safetensors.h"
#include "linear/linear.h"

namespace exl2 {

struct DecoderTraits {
  bool qkv_bias = false;  // Qwen2: q/k/v projections carry biases
  bool o_bias = false;    // Llama with attention_bias: o_proj too
  bool mlp_bias = false;  // gate/up/down biases (config mlp_bias)
  bool qk_norm = false;   // Qwen3: RMSNorm over each head of q and k before RoPE
};

struct DecoderLayer {
  Tensor attn_norm, mlp_norm;  // f32 [hidden]
  Tensor q_norm, k_norm;       // f32 [head_dim] (qk_norm only)
  std::unique_ptr<Linear> q, k, v, o, gate, up, down;
};

class ModelGraph {
 public:
  ModelGraph(const ModelConfig& config, const TensorMap& tensors, const LoadOptions& options, DecoderTraits traits,
             int64_t max_seq_len);

  const ModelConfig& config() const { return config_; }
  Device device() const { return device_; }
  DType act_dtype() const { return act_; }
  Tensor forward(const Batch& batch, KVCache& cache);
  // (name, layer) for every linear, in file order; for info() and tests.
  std::vector<std::pair<std::string, const Linear*>> linears() const;
  const Tensor& embedding() const { return embed_; }
  size_t weight_bytes() const;

 private:
  ModelConfig config_;
  DecoderTraits traits_;
  Device device_;
  DType act_;
  Tensor embed_;       // [vocab, hidden]
  Tensor final_norm_;  // f32 [hidden]
  Tensor rope_;        // f32 [max_seq_len, head_dim] on device
  std::vector<DecoderLayer> layers_;
  std::unique_ptr<Linear> lm_head_;
};

// Registry keyed by config.json architectures[0]. Each architecture file defines one builder and registry.cpp
// holds one line per architecture.
using ArchTraitsFn = DecoderTraits (*)(const ModelConfig& config);
void register_architecture(const std::string& name, ArchTraitsFn fn);
ArchTraitsFn find_architecture(const std::string& name);  // UnsupportedError listing the known names
std::vector<std::string> known_architectures();

}  // namespace exl2
