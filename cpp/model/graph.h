// The model graph on one device or a layer split: embedding -> the layers of model/decoder.h's DecoderBody (the
// composition an architecture file chose) over the paged cache -> final norm -> lm_head; the step's buffers, CUDA
// graphs of decode steps, and the load-size estimates. Tensor parallel models run in model/tensor_parallel.h.
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
#include "model/decoder.h"

namespace exl2 {

namespace ops {
struct AttentionSpan;  // ops/ops.h: which rows of a step's attention go to which kernel
}
class Workspace;      // model/workspace.h
struct DecodeGraphs;  // graph.cpp: captured CUDA graphs per decode shape
struct StepIO;        // graph.cpp: one step's metadata views and logit buffers

// forward() on CUDA: activations and batch metadata live in a persistent Workspace (one async upload, one sync
// when the logits come back). Decode-shaped batches (<= 64 rows, at most 16 of one sequence: decode rows,
// speculative verify rows, short prefill chunks) are padded to a bucket of 1, 2, 4, ..., 64 rows (padding rows: token 0 at position 0 of a sequence whose pages are
// all the cache's scratch page; their logits are dropped) with pages_per_seq bucketed to a power of two, and
// run as one CUDA graph per (rows, pages_per_seq) bucket and cache: the first step of a bucket runs eagerly
// (warm-up: scratch buffers grow), the second captures, later ones replay. Option cuda_graphs false runs the
// same padded steps eagerly (bitwise the same logits). Other batches (longer prefill chunks) run eagerly, unpadded.
// forward() is serialized by a mutex.
// Layer split (LoadOptions::layer_devices): each layer's weights on its GPU, one Workspace (activations and a copy
// of the step's metadata) per GPU, the hidden state moved by cuda::copy_peer_async where consecutive layers change
// GPU (stream-ordered, no host sync; the one sync is the logits download on the head's GPU). Split models run
// every step eagerly and unpadded: no CUDA graphs (a capture spanning devices, or one graph per device segment,
// is future work).
struct StepActs;  // graph.cpp: one device's activation views for a step
class TensorParallel;  // model/tensor_parallel.h: LoadOptions::tp_devices models run there instead

// Load-size estimates (the loaders' OOM checks and WeightArenaScope reserves), each tensor 256-byte aligned as the
// weight arena places it. One file tensor on a CUDA device: norms and biases f32, other float tensors f16; an EXL2
// linear counted whole at its q_weight (exl2_linear_cuda_bytes: exact; in a build without the CUDA EXL2 kernels,
// q_weight + q_scale + bias), its other tensors 0.
size_t device_weight_bytes(const TensorMap& tensors, const std::string& name);
// Single device or layer split: bytes per CUDA index (vector sized to the highest index used + 1): the weights placed
// there, the tied lm_head's f16 copy on the head's device, the RoPE tables (f32 [max_seq_len, head_dim] each) on each.
std::vector<size_t> weight_bytes_per_device(const ModelConfig& config, const TensorMap& tensors,
                                            const LoadOptions& options, int64_t max_seq_len);
// Tensor parallel over T ranks: per rank, its share of the layers (1/T), the replicated embedding and RoPE table;
// *head: what rank 0 holds besides (final norm, lm_head or the tied copy).
std::vector<size_t> tp_weight_bytes(const ModelConfig& config, const TensorMap& tensors, int64_t T,
                                    int64_t max_seq_len, size_t* head);
// Walks over the tensor names made by the two functions above since the process started (each sizes every tensor,
// building each EXL2 layer's tables on a CUDA build): a CUDA load makes exactly one. For tests.
int64_t weight_sizing_walks();

// The sizes Model::load computed once for its out-of-memory check, handed to the graph as its weight-arena reserves
// (the same numbers; sizing again would rebuild every EXL2 layer's tables once more). per_device: single device or
// layer split, weight_bytes_per_device by CUDA index; tensor parallel, tp_weight_bytes by rank with head its *head.
// Empty (CPU loads): no reserve. The EXL2 tables built for the sizes are not kept for exl2_upload: holding every
// layer's tables on the host for the whole load costs more than rebuilding them (and a TP shard's tables differ
// from the full layer's the sizes are built from).
struct WeightSizes {
  std::vector<size_t> per_device;
  size_t head = 0;
};

class ModelGraph {
 public:
  // sizes: the weight-arena reserves (see WeightSizes; Model::load's OOM-check numbers).
  ModelGraph(const ModelConfig& config, const TensorMap& tensors, const LoadOptions& options, const DecoderSpec& spec,
             int64_t max_seq_len, const WeightSizes& sizes);
  ~ModelGraph();

  const ModelConfig& config() const { return config_; }
  const DecoderSpec& spec() const { return spec_; }
  Device device() const { return device_; }  // the embedding's device
  const std::vector<Device>& layer_devices() const { return layer_dev_; }
  Device head_device() const { return head_dev_; }
  bool split() const { return split_; }
  std::vector<Device> tp_devices() const;  // empty unless tensor parallel
  DType act_dtype() const { return act_; }
  Tensor forward(const Batch& batch, KVCache& cache, DeviceArgmax* argmax = nullptr);  // Model::forward
  // (name, layer) for every linear, in file order; for info() and tests.
  std::vector<std::pair<std::string, const Linear*>> linears() const;
  const Tensor& embedding() const { return embed_; }
  size_t weight_bytes() const;

 private:
  Tensor forward_eager(const Batch& batch, KVCache& cache, DeviceArgmax* argmax);
  Tensor forward_decode(const Batch& batch, KVCache& cache, int64_t bucket, DeviceArgmax* argmax);
  // Embedding, the layers (DecoderBody), the final norm over the picked rows and lm_head into io's logits.
  void run_step(const StepIO& io, KVCache& cache);
  void run_step_split(const StepIO& io, KVCache& cache);  // the same across GPUs (split models)
  void run_head(const Tensor& h, const Tensor& logit_idx, const Workspace& ws, const StepIO& io);
  Workspace& ws_on(Device d);  // the workspace of one of the model's devices

  ModelConfig config_;
  DecoderSpec spec_;
  Device device_;
  DType act_;
  int64_t max_seq_len_ = 0;
  Tensor embed_;               // [vocab, hidden]
  Tensor final_norm_;          // f32 [hidden]
  std::vector<Tensor> ropes_;  // f32 [max_seq_len, head_dim] on device_, by spec_.ropes index
  std::vector<DecoderLayer> layers_;
  std::unique_ptr<Linear> lm_head_;
  std::mutex mutex_;
  std::unique_ptr<Workspace> ws_;  // on device_
  std::unique_ptr<DecodeGraphs> graphs_;
  // Layer split: per-layer devices (all device_ unless split), the head's device, and per CUDA index of the other
  // devices in use their workspace and RoPE tables.
  std::vector<Device> layer_dev_;
  Device head_dev_;
  bool split_ = false;
  std::vector<Device> used_devs_;  // distinct devices in use, device_ first
  std::vector<std::unique_ptr<Workspace>> ws_on_;
  std::vector<std::vector<Tensor>> ropes_on_;
  std::unique_ptr<TensorParallel> tp_;  // tensor parallel: everything above but config_/device_ unused
};

}  // namespace exl2
