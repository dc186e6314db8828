// Dense linear layers and the loader that picks dense or EXL2 from the tensors present.
#include "linear/linear.h"

#include "linear/exl2_linear.h"
#include "ops/ops.h"

namespace exl2 {

namespace {

class DenseLinear : public Linear {
 public:
  DenseLinear(Tensor w, Tensor b) : w_(std::move(w)), b_(std::move(b)) {}
  int64_t in_features() const override { return w_.size(1); }
  int64_t out_features() const override { return w_.size(0); }
  void forward(const Tensor& x, Tensor& y) override { ops::matmul_nt(x, w_, b_, y); }
  Tensor weight_f32() const override { return w_.to(Device::cpu()).to_dtype(DType::F32); }
  std::string kind() const override { return dtype_name(w_.dtype()); }
  size_t nbytes() const override { return w_.nbytes() + (b_.defined() ? b_.nbytes() : 0); }

 private:
  Tensor w_;  // [out, in]
  Tensor b_;  // [out] f32, or undefined
};

}  // namespace

std::unique_ptr<Linear> make_dense_linear(Tensor weight, Tensor bias, Device device) {
  // CPU keeps the file's dtype (zero-copy from the mapping; the matmul converts panels). CUDA computes in f16.
  if (!device.is_cpu()) weight = weight.to_dtype(DType::F16).to(device);
  if (bias.defined()) bias = bias.to_dtype(DType::F32).to(device);
  return std::make_unique<DenseLinear>(std::move(weight), std::move(bias));
}

std::unique_ptr<Linear> load_linear(const TensorMap& tm, const std::string& prefix, int64_t in, int64_t out,
                                    bool with_bias, Device device) {
  if (tm.contains(prefix + ".q_weight")) return make_exl2_linear(tm, prefix, in, out, device);
  Tensor w = tm.get_checked(prefix + ".weight", {out, in}, {DType::F16, DType::BF16, DType::F32});
  Tensor b;
  if (with_bias) b = tm.get_checked(prefix + ".bias", {out}, {DType::F16, DType::BF16, DType::F32});
  return make_dense_linear(std::move(w), std::move(b), device);
}

std::unique_ptr<Linear> load_linear_cols(const TensorMap& tm, const std::string& prefix, int64_t in, int64_t out,
                                         bool with_bias, Device device, int64_t c0, int64_t c1) {
  if (c0 == 0 && c1 == out) return load_linear(tm, prefix, in, out, with_bias, device);
  EXL2_CHECK(c0 >= 0 && c0 < c1 && c1 <= out, "linear '", prefix, "': column slice [", c0, ", ", c1,
             ") is not inside its ", out, " outputs");
  if (tm.contains(prefix + ".q_weight")) return make_exl2_linear_cols(tm, prefix, in, out, device, c0, c1);
  Tensor w = tm.get_checked(prefix + ".weight", {out, in}, {DType::F16, DType::BF16, DType::F32});
  Tensor b;
  if (with_bias) b = tm.get_checked(prefix + ".bias", {out}, {DType::F16, DType::BF16, DType::F32}).slice(c0, c1);
  return make_dense_linear(w.slice(c0, c1), std::move(b), device);
}

}  // namespace exl2
