// Linear layers: y[n, out] = x[n, in] @ W + bias, for dense (fp32/fp16/bf16 HF [out, in] weights) and EXL2
// quantized weights. load_linear picks the kind from the tensors present (`<prefix>.q_weight` -> EXL2).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "exl2/safetensors.h"
#include "exl2/tensor.h"

namespace exl2 {

class Linear {
 public:
  virtual ~Linear() = default;
  virtual int64_t in_features() const = 0;
  virtual int64_t out_features() const = 0;
  // x: act [n, in]; y: act [n, out] (preallocated, must not alias x).
  virtual void forward(const Tensor& x, Tensor& y) = 0;
  // The effective weight as f32 [out, in] on the CPU (dequantized for EXL2). For tests and tools.
  virtual Tensor weight_f32() const = 0;
  virtual std::string kind() const = 0;  // "f16", "bf16", "f32", "exl2"
  virtual size_t nbytes() const = 0;     // bytes of weights (and quant metadata) on the device
  // Bytes the layer actually holds on its device (EXL2 on CUDA: the load-time layout and tables; else nbytes()).
  virtual size_t device_nbytes() const { return nbytes(); }
  virtual double bits_per_weight() const { return 8.0 * double(nbytes()) / double(in_features() * out_features()); }
  virtual std::string bits_desc() const { return kind(); }  // e.g. "8:5% 4:95%" for EXL2
};

// `prefix` e.g. "model.layers.0.self_attn.q_proj". Checks shapes against in/out; `bias` says whether a bias
// is required (true), forbidden (false); biases present in the file are used either way when allow_bias.
std::unique_ptr<Linear> load_linear(const TensorMap& tensors, const std::string& prefix, int64_t in_features,
                                    int64_t out_features, bool with_bias, Device device);

// Tensor-parallel shard of the same linear: only output columns [col_begin, col_end) (dense: those rows of the
// [out, in] weight and bias entries; EXL2: make_exl2_linear_cols, multiples of 32). Exact: its weight_f32() is
// rows [col_begin, col_end) of the full layer's.
std::unique_ptr<Linear> load_linear_cols(const TensorMap& tensors, const std::string& prefix, int64_t in_features,
                                         int64_t out_features, bool with_bias, Device device, int64_t col_begin,
                                         int64_t col_end);

// *ys[i] = linears[i] applied to x, for linears that share x (q/k/v, gate/up); same contract as forward() for each.
// EXL2 layers on one CUDA device in the v4 layout with 1..16 rows of x run as ONE kernel launch
// (cuda::exl2_gemm_group, which lists what qualifies; env EXL2CPP_GEMV_GROUP=0 turns it off); anything else calls
// forward() on each in order. Returns whether the single launch ran.
bool forward_group(const std::vector<Linear*>& linears, const Tensor& x, const std::vector<Tensor*>& ys);

std::unique_ptr<Linear> make_dense_linear(Tensor weight /* [out, in] */, Tensor bias, Device device);

}  // namespace exl2
