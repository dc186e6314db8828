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
// The same for any list of output features: output i is feature rows[i] of the file's linear (dense: those weight
// rows and bias entries in the file's dtype; EXL2: make_exl2_linear_rows, a multiple of 32). Exact.
std::unique_ptr<Linear> load_linear_rows(const TensorMap& tensors, const std::string& prefix, int64_t in_features,
                                         int64_t out_features, bool with_bias, Device device,
                                         const std::vector<int64_t>& rows);

// *ys[i] = linears[i] applied to x, for linears that share x (q/k/v, gate/up); same contract as forward() for each.
// EXL2 layers on one CUDA device with 1..16 rows of x run as ONE kernel launch (ops::exl2_matmul_group: the
// planner says what qualifies; option gemv_group false turns it off); anything else calls
// forward() on each in order. Returns whether the single launch ran.
bool forward_group(const std::vector<Linear*>& linears, const Tensor& x, const std::vector<Tensor*>& ys);

// What forward_fused computes from its src before the product (the decode step's small kernels folded into the
// GEMV's staging of x).
struct LinearPrologue {
  enum class Kind { none, rms_norm, silu_mul };
  Kind kind = Kind::none;
  Tensor w;         // rms_norm: the norm weight [in] (f32, f16 or bf16, as ops::rms_norm reads it)
  float eps = 0.f;  // rms_norm
  Tensor up;        // silu_mul: up [n, in] (src is gate), src's dtype and device
  static LinearPrologue none() { return {}; }
  static LinearPrologue rms_norm(const Tensor& w, float eps) { return {Kind::rms_norm, w, eps, Tensor()}; }
  static LinearPrologue silu_mul(const Tensor& up) { return {Kind::silu_mul, Tensor(), 0.f, up}; }
};

// a = prologue(src), then for each linear i (all sharing a):
//   add_into false: *ys[i] = a @ W_i + b_i;   add_into true (exactly one linear, ys[0] act [n, out] of src's dtype,
//   not overlapping src / up): *ys[0] += a @ W_0 + b_0.
// Prologues: none: a = src; rms_norm: a = rms_norm(src, w, eps) (src is the residual h and stays unchanged);
// silu_mul: a = silu(src) * up, elementwise as ops::silu_mul.
// The fused single launch (ops::exl2_matmul_fused, which lists what qualifies: EXL2 layers on one CUDA device, f16
// src of 1..16 rows, ...) computes a while it stages x and adds in its epilogue with ONE rounding
// (y = f16(f32(y) + fp32 product)); anything else runs forward_composed. Returns whether the fused launch ran.
// ys must not overlap src, up or w. After a silu_mul prologue src's contents are unspecified (the composition
// writes a into it); scratch's always are.
bool forward_fused(const std::vector<Linear*>& linears, const Tensor& src, const LinearPrologue& pro,
                   const std::vector<Tensor*>& ys, bool add_into, Tensor& scratch);
// The same semantics as a composition of the existing ops (any backend, any linear): rms_norm(src) -> scratch
// [n, in] (src's dtype), or silu_mul(src, up) -> src in place; forward_group; with add_into the product goes to
// scratch [n, out] (after the normed x when both: scratch then holds n * (in + out) elements) and
// ops::add(y, scratch, y) (two roundings, as the unfused graph). scratch may be undefined when neither is needed.
void forward_composed(const std::vector<Linear*>& linears, const Tensor& src, const LinearPrologue& pro,
                      const std::vector<Tensor*>& ys, bool add_into, Tensor& scratch);
// Whether the decode step fuses (cpp/model/graph.cpp run_layer): option gemv_fuse (exl2/options.h), read at every
// call; on by default since it measured +4% batch-1 decode on the H200 (docs/performance.md).
bool gemv_fuse_enabled();

std::unique_ptr<Linear> make_dense_linear(Tensor weight /* [out, in] */, Tensor bias, Device device);
// The [out, in] weight of a linear made by make_dense_linear / load_linear from dense tensors; nullptr otherwise.
const Tensor* dense_linear_weight(const Linear& linear);

}  // namespace exl2
