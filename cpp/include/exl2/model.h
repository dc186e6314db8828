// Model: a loaded decoder-only language model (any registered architecture; fp16/bf16/fp32 or EXL2
// weights) on one device, and the batch description its forward pass takes.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "exl2/config.h"
#include "exl2/kv_cache.h"
#include "exl2/sample_params.h"
#include "exl2/tensor.h"

namespace exl2 {

struct LoadOptions {
  Device device = Device::cpu();
  int64_t max_seq_len = 0;  // 0: config.max_position_embeddings
  // Layer split across GPUs (CUDA only): decoder layer i and its KV cache pages on GPU layer_devices[i] (empty:
  // every layer on `device`). The embedding stays on `device`; the final norm and lm_head go on head_device
  // (-1: the last layer's GPU). Hidden states cross GPUs by stream-ordered peer copies. Split models run every
  // step eagerly (no CUDA graphs). The placement itself is planned in Python (exl2cpp/multigpu.py).
  std::vector<int> layer_devices;
  int head_device = -1;
  // Tensor parallel (model/tensor_parallel.h): every layer's heads and MLP columns split evenly over these devices
  // (all CUDA: one GPU each, collectives through NCCL; or all CPU: virtual ranks, for testing the sharded graph).
  // Empty: no tensor parallelism. Excludes layer_devices. `device` is then tp_devices[0] (the logits' device).
  std::vector<Device> tp_devices;
  // Called on the loading thread as the weights are placed: progress(done, total) after the embedding, after each
  // decoder layer and after the head (total = num_hidden_layers + 2; a tensor-parallel load reports (total, total)
  // once its shards are placed). An exception it throws ends the load.
  std::function<void(int64_t done, int64_t total)> progress;
};

// One forward step over rows of several sequences (prefill chunks and decode rows mixed).
// Row t is token tokens[t] at position positions[t] of sequence seq_of_token[t]; that sequence's pages are
// page_table[seq * pages_per_seq ... + pages_per_seq). Its K/V are written to the cache, then it attends to
// positions 0..positions[t] of its sequence (earlier positions must already be in the cache or in this batch).
struct Batch {
  std::vector<int32_t> tokens;
  std::vector<int32_t> positions;
  std::vector<int32_t> seq_of_token;
  std::vector<int32_t> page_table;  // [n_seqs, pages_per_seq]
  int32_t pages_per_seq = 0;
  std::vector<int32_t> logit_rows;  // rows whose logits are returned; empty: every row
  void validate(const KVCache& cache, int64_t vocab_size, int64_t max_seq_len) const;  // InvalidArgument
};

// Rows whose token Model::forward picks on the logits' device (the engine's device argmax, option device_argmax,
// and device sampling, option device_sample): a flagged row crosses to the host as its token and that token's
// log-probability (ops::sample_logprob; ops::argmax_logprob when params is empty), not as vocab floats.
struct DeviceArgmax {
  std::vector<uint8_t> rows;   // in: one flag per logit row (Batch::logit_rows order; every batch row when empty)
  std::vector<SampleParams> params;  // in: empty (every flagged row greedy) or one per logit row (unflagged: unread)
  std::vector<int32_t> index;  // out, per logit row: the op's index for a flagged row, -1 otherwise
  std::vector<float> logprob;  // out, per logit row: the op's logprob for a flagged row, 0 otherwise
};

class ModelGraph;  // model/graph.h
class TensorMap;   // exl2/safetensors.h
struct DecoderSpec;  // model/decoder.h

class Model {
 public:
  static std::unique_ptr<Model> load(const std::string& model_dir, const LoadOptions& options = {});
  ~Model();

  const ModelConfig& config() const;
  Device device() const;  // the embedding's device (the only one unless split)
  // Per decoder layer, the device holding its weights and KV pages; and the final norm + lm_head's device.
  std::vector<Device> layer_devices() const;
  Device head_device() const;
  bool split() const;  // more than one device in use
  // Tensor-parallel ranks' devices (empty unless loaded with LoadOptions::tp_devices).
  std::vector<Device> tp_devices() const;
  int64_t max_seq_len() const;
  DType activation_dtype() const;  // f32 on CPU, f16 on CUDA
  // A cache for this model: `n_tokens` rounded up to whole pages.
  std::unique_ptr<KVCache> make_cache(int64_t n_tokens, int page_size = 256) const;  // fp32 on CPU, fp16 on CUDA
  // Any cache type (fp16, fp32, q8, q6, q4; see kv_cache.h). OutOfMemory when it does not fit on the GPU.
  std::unique_ptr<KVCache> make_cache(int64_t n_tokens, int page_size, CacheType type) const;
  // With windowed = true and sliding-window layers (window_layout() has a windowed group), a cache of layer groups
  // (kv_cache.h CacheLayout) of the same memory: n_groups() times the pages, each of n_slots() layers, so pages
  // behind a window can be given back (the engine's cache; tensor parallel too, every rank the same groups). Layer
  // split models: the plain cache.
  std::unique_ptr<KVCache> make_cache(int64_t n_tokens, int page_size, CacheType type, bool windowed) const;
  // The layer groups of the cache make_cache(.., windowed = true) makes: by sliding window (one group of every layer
  // without windows, and for layer split models).
  CacheLayout window_layout() const;
  // The positions behind a row that every layer may read: the largest sliding window when every layer has one, else
  // 0 (some layer reads every position). One page table may give back the pages before them (the engine's draft
  // cache).
  int64_t kv_window() const;
  // Returns f32 logits on the host, [logit_rows.size() or n_tokens, vocab].
  Tensor forward(const Batch& batch, KVCache& cache);
  // forward() with the rows flagged in argmax->rows (one flag per logit row, else InvalidArgument) reduced on the
  // logits' device instead of copied: their rows of the returned tensor are unspecified (the CPU backend leaves
  // the logits there); every row flagged: no logits copy at all. Null or no flag set: forward(batch, cache).
  Tensor forward(const Batch& batch, KVCache& cache, DeviceArgmax* argmax);
  // Weight statistics: per-linear kind, bits, bytes (JSON text, for info()).
  std::string info_json() const;
  ModelGraph& graph();

 private:
  Model() = default;
  static std::unique_ptr<Model> load_checked(const std::string& model_dir, const LoadOptions& options);
  static std::unique_ptr<Model> load_tensor_parallel(const std::string& model_dir, const ModelConfig& config,
                                                     const TensorMap& tensors, const LoadOptions& options,
                                                     int64_t max_seq_len, const DecoderSpec& spec);
  std::unique_ptr<ModelGraph> graph_;
  int64_t max_seq_len_ = 0;
};

}  // namespace exl2
