// Workspace: the model step's persistent buffers, reused across forward calls so a step allocates nothing on
// the device once warm: the activations for up to `rows` rows, the batch metadata (one i32 device buffer filled
// from a host staging buffer, page-locked on CUDA, by one async copy), and on CUDA the logits of up to
// kKeptLogitRows rows (f16 and f32 on the device, f32 in page-locked host memory for one async copy back).
// Buffers only grow; every growth bumps generation() (CUDA graphs captured before point at freed memory).
// Never grow while a CUDA graph is being captured. Not thread-safe (ModelGraph::forward holds a lock).
#pragma once

#include <cstdint>

#include "exl2/model.h"
#include "exl2/tensor.h"
#include "linear/moe_linear.h"

namespace exl2 {

struct WorkspaceDims {
  int64_t hidden = 0, q_width = 0, kv_width = 0, intermediate = 0, vocab = 0;
  MoeDims moe;  // experts == 0: no MoE buffers
};

// The step's f32 logits [>= m, vocab] (on the head's device) to the host: f32 CPU [m, vocab]. argmax (may be null;
// model.h DeviceArgmax, argmax->rows.size() must be m): flagged rows go through ops::sample_logprob with
// argmax->params (ops::argmax_logprob when empty) on the device, its results fill argmax->index / logprob, and those
// rows are not copied (unspecified in the result); no row is copied when all are flagged. CPU: logits32's first m rows are returned as they are (a view, no copy). CUDA:
// per-call buffers and synchronous copies (the kept-rows path is Workspace::download_logits).
Tensor logits_to_host(const Tensor& logits32, int64_t m, DeviceArgmax* argmax);

class Workspace {
 public:
  static constexpr int64_t kKeptLogitRows = 64;  // larger logit counts use per-call buffers

  Workspace(Device device, DType act, const WorkspaceDims& dims);
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  // Room for `rows` activation rows and `meta_ints` i32 of metadata (and, on CUDA, min(rows, kKeptLogitRows)
  // logit rows). May allocate; bumps generation() when anything moved.
  void reserve(int64_t rows, int64_t meta_ints);
  uint64_t generation() const { return generation_; }

  // Views of the first n rows: act [n, width].
  Tensor h(int64_t n) const { return h_.slice(0, n); }
  Tensor x(int64_t n) const { return x_.slice(0, n); }
  Tensor q(int64_t n) const { return q_.slice(0, n); }
  Tensor k(int64_t n) const { return k_.slice(0, n); }
  Tensor v(int64_t n) const { return v_.slice(0, n); }
  Tensor attn(int64_t n) const { return attn_.slice(0, n); }
  Tensor gate(int64_t n) const { return gate_.slice(0, n); }
  Tensor up(int64_t n) const { return up_.slice(0, n); }
  Tensor picked(int64_t n) const { return picked_.slice(0, n); }  // rows gathered for the final norm
  Tensor normed(int64_t n) const { return normed_.slice(0, n); }
  // MoE layers' buffers for n rows (dims.moe; undefined views without MoE layers).
  MoeBuffers moe(int64_t n) const;
  // CUDA only, n <= kKeptLogitRows: act and f32 logits [n, vocab] on the device.
  Tensor logits(int64_t n) const { return logits_.slice(0, n); }
  Tensor logits32(int64_t n) const { return logits32_.slice(0, n); }

  // Host staging for the metadata (capacity from reserve), then upload() sends [0, ints) to the device buffer
  // (CUDA: one cudaMemcpyAsync on the current stream, no sync; CPU: the staging is the buffer). A step that
  // uploaded must call finish_step() (or the next begin_step() synchronizes before reusing the staging).
  int32_t* staging() const { return staging_.data_as<int32_t>(); }
  void begin_step();
  void upload(int64_t ints);
  // i32 view [count] of the metadata buffer at `offset` ints (on the device for CUDA).
  Tensor meta(int64_t offset, int64_t count) const { return meta_.slice(offset, offset + count); }

  // CUDA: copies logits32(m) into a new f32 CPU tensor (one async copy into page-locked memory, one stream sync,
  // one memcpy). Ends the step. argmax (may be null): the rows it flags are reduced on the device into this
  // workspace's pick buffers instead and only those numbers come back (logits_to_host's contract).
  Tensor download_logits(int64_t m, DeviceArgmax* argmax = nullptr);
  void finish_step();  // synchronizes the stream if a step is in flight

 private:
  Device device_;
  DType act_;
  WorkspaceDims dims_;
  int64_t rows_ = 0, meta_ints_ = 0, logit_rows_ = 0;
  uint64_t generation_ = 0;
  bool in_flight_ = false;
  Tensor h_, x_, q_, k_, v_, attn_, gate_, up_, picked_, normed_;
  MoeBuffers moe_;  // [rows, ...] and [rows * top_k, ...]; the grouping sized for rows * top_k positions
  Tensor logits_, logits32_, host_logits_;  // CUDA
  Tensor pick_index_, pick_logprob_;        // CUDA: i32 / f32 [kKeptLogitRows], sample_logprob's outputs
  Tensor pick_params_, pick_params_host_;   // CUDA: u8 [kKeptLogitRows, sizeof(SampleParams)], device / pinned
  Tensor staging_, meta_;                   // i32; on CPU meta_ is staging_
};

}  // namespace exl2
