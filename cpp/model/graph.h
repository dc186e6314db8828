// The decoder graph shared by the Llama family: embedding -> N x (RMSNorm, attention with RoPE over the paged
// cache, RMSNorm, SwiGLU MLP) -> RMSNorm -> lm_head. Architectures differ only in DecoderTraits, which their
// own files (llama.cpp, qwen2.cpp, ...) derive from the config and register under architectures[0].
#pragma once

#include <functional>
#include <memory>
#include <mutex>
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

class Workspace;      // model/workspace.h
struct DecodeGraphs;  // graph.cpp: captured CUDA graphs per decode shape
struct StepIO;        // graph.cpp: one step's metadata views and logit buffers

// forward() on CUDA: activations and batch metadata live in a persistent Workspace (one async upload, one sync
// when the logits come back). Decode-only batches (each row one token of a distinct sequence, <= 64 rows) are
// padded to a bucket of 1, 2, 4, ..., 64 rows (padding rows: token 0 at position 0 of a sequence whose pages are
// all the cache's scratch page; their logits are dropped) with pages_per_seq bucketed to a power of two, and
// run as one CUDA graph per (rows, pages_per_seq) bucket and cache: the first step of a bucket runs eagerly
// (warm-up: scratch buffers grow), the second captures, later ones replay. Env EXL2CPP_CUDA_GRAPHS=0 runs the
// same padded steps eagerly (bitwise the same logits). Prefill and mixed batches run eagerly, unpadded.
// forward() is serialized by a mutex.
class ModelGraph {
 public:
  ModelGraph(const ModelConfig& config, const TensorMap& tensors, const LoadOptions& options, DecoderTraits traits,
             int64_t max_seq_len);
  ~ModelGraph();

  const ModelConfig& config() const { return config_; }
  Device device() const { return device_; }
  DType act_dtype() const { return act_; }
  Tensor forward(const Batch& batch, KVCache& cache);
  // (name, layer) for every linear, in file order; for info() and tests.
  std::vector<std::pair<std::string, const Linear*>> linears() const;
  const Tensor& embedding() const { return embed_; }
  size_t weight_bytes() const;

 private:
  Tensor forward_eager(const Batch& batch, KVCache& cache);
  Tensor forward_decode(const Batch& batch, KVCache& cache, int64_t bucket);
  // Embedding, the layers, the final norm over the picked rows and lm_head into io's logits.
  void run_step(const StepIO& io, KVCache& cache);

  ModelConfig config_;
  DecoderTraits traits_;
  Device device_;
  DType act_;
  Tensor embed_;       // [vocab, hidden]
  Tensor final_norm_;  // f32 [hidden]
  Tensor rope_;        // f32 [max_seq_len, head_dim] on device
  std::vector<DecoderLayer> layers_;
  std::unique_ptr<Linear> lm_head_;
  std::mutex mutex_;
  std::unique_ptr<Workspace> ws_;
  std::unique_ptr<DecodeGraphs> graphs_;
};

// Registry keyed by config.json architectures[0]. Each architecture file defines one builder and registry.cpp
// holds one line per architecture.
using ArchTraitsFn = DecoderTraits (*)(const ModelConfig& config);
void register_architecture(const std::string& name, ArchTraitsFn fn);
ArchTraitsFn find_architecture(const std::string& name);  // UnsupportedError listing the known names
std::vector<std::string> known_architectures();

}  // namespace exl2
