// The experts of one MoE projection (e.g. w1 of every expert of a Mixtral layer): n_experts linears of one shape
// applied to the (row, slot) pairs grouped by ops::moe_group, so that a step computes (and reads the weights of)
// only the experts its router chose.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "exl2/safetensors.h"
#include "exl2/tensor.h"
#include "linear/linear.h"

namespace exl2 {

// ops::moe_group's outputs for one step (i32, on the experts' device).
struct MoeGrouping {
  Tensor offsets;  // [n_experts + 1]
  Tensor perm;     // [P]
  Tensor inv;      // [P]
  Tensor active;   // [n_experts + 1]
};

// The widths of a MoE layer's step buffers on one rank (tensor parallel: each expert's and the shared expert's
// intermediate columns split over the ranks, the output columns of their down projections too).
struct MoeDims {
  int64_t experts = 0, top_k = 0;                   // 0: no MoE layers (no buffers)
  int64_t expert_cols = 0, expert_full = 0;         // an expert's intermediate: this rank's, all
  int64_t shared_cols = 0, shared_full = 0;         // the shared expert's (0: none)
  int64_t hidden_cols = 0;                          // the down projections' output columns on this rank
};

// A MoE layer's step buffers for n rows (P = n * top_k positions), views of the workspace's.
struct MoeBuffers {
  Tensor logits;            // act [n, experts]: the router's
  Tensor ids, weights;      // i32 / f32 [n, top_k]: ops::moe_route's
  MoeGrouping g;            // ops::moe_group's
  Tensor eg, eu, eg_full;   // act [P, expert_cols], [P, expert_cols], [P, expert_full]
  Tensor eo;                // act [P, hidden_cols]: the experts' down outputs, position order
  Tensor sg, su, sg_full;   // act [n, shared_cols], [n, shared_cols], [n, shared_full] (shared expert)
  Tensor so;                // act [n, hidden_cols]: the shared expert's down output
  Tensor sgate;             // act [n, 1]: the shared expert gate's logit
};

class MoeExperts {
 public:
  // How forward() computes (plan()): one launch over the active experts (EXL2 v4 layers, or dense f16, on CUDA,
  // f16 x; no host sync, capturable into a CUDA graph after one call of the step's shape), or expert by expert through
  // each expert's linear over its gathered rows (the CPU reference, and CUDA above kGroupedMaxRows rows or for
  // layers the grouped kernels do not take: a host read of the grouping, so not capturable).
  enum class Path { grouped_exl2, grouped_dense, per_expert };

  // Loads `<prefixes[e]>` (EXL2 when `<prefix>.q_weight` exists, else `<prefix>.weight` f32/f16/bf16 [out, in];
  // no bias) for every expert onto `device`. ModelFormatError naming the tensor as load_linear. col_begin / col_end
  // (col_end < 0: out_features): only those output columns of every expert (a tensor-parallel shard, as
  // load_linear_cols; out_features() is then col_end - col_begin).
  static std::unique_ptr<MoeExperts> load(const TensorMap& tensors, const std::vector<std::string>& prefixes,
                                          int64_t in_features, int64_t out_features, Device device,
                                          int64_t col_begin = 0, int64_t col_end = -1);

  // Experts given as linears of one shape on `device` (the converter's fp32 capture linears, model/calibration.h):
  // forward takes the expert-by-expert path, through each linear's forward over its rows (an expert without rows
  // is not called).
  static std::unique_ptr<MoeExperts> from_linears(std::vector<std::unique_ptr<Linear>> linears, Device device);

  int64_t n_experts() const { return static_cast<int64_t>(experts_.size()); }
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  Device device() const { return device_; }
  // Expert e's linear (for listings and weight sizes: info(), weight_bytes).
  const Linear& expert(int64_t e) const;
  // The weight bytes one pass over expert e's rows reads: the v4 q_weight on CUDA (EXL2), the [out, in] weight (dense
  // and the CPU's dequantized EXL2 weight).
  int64_t weight_bytes(int64_t e) const;

  // The path forward() takes for a step of `rows` tokens (pure: the layers' kinds, the device and rows).
  Path plan(int64_t rows) const;

  // For every position p of the grouping g (P = rows * k positions; expert e owns [offsets[e], offsets[e + 1])):
  //   y[p] = x[src(p)] @ W_e^T (+ bias_e), fp32 accumulation, one rounding into y's dtype;
  //   gather: x act [rows, in] (the layer's input) and src(p) = perm[p] / k;  else x act [P, in] in position
  //   order (the experts' own intermediate, e.g. the down projection's input) and src(p) = p.
  // y: act [P, out], x's dtype, must not overlap x. g from ops::moe_group on this device with n_experts experts.
  // bytes_read: undefined, or i32 [2] on the device holding a little-endian u64 that forward adds the weight bytes it
  // streamed to (grouped: counted by the kernel's blocks; per_expert: weight_bytes of each expert run). Returns the
  // path taken.
  Path forward(const Tensor& x, int64_t k, bool gather, const MoeGrouping& g, Tensor& y,
               const Tensor& bytes_read = Tensor());

  ~MoeExperts();
  MoeExperts(const MoeExperts&) = delete;
  MoeExperts& operator=(const MoeExperts&) = delete;

  // Rows up to which a step on CUDA takes the grouped kernels (cuda/moe_exl2.h kMoeGroupedMaxRows).
  static constexpr int64_t kGroupedMaxRows = 64;

 private:
  struct Expert {
    std::unique_ptr<Linear> lin;  // EXL2 or dense (CPU: the file's dtype; CUDA: f16)
    bool exl2 = false;
  };
  struct CudaState;
  MoeExperts() = default;
  void forward_per_expert(const Tensor& x, int64_t k, bool gather, const MoeGrouping& g, Tensor& y,
                          const Tensor& bytes_read);

  int64_t in_ = 0, out_ = 0;
  Device device_;
  std::vector<Expert> experts_;
  std::unique_ptr<CudaState> cuda_;  // the grouped kernels' tables and workspace (CUDA only)
};

}  // namespace exl2
