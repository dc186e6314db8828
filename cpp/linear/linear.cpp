// Dense linear layers and the loader that picks dense or EXL2 from the tensors present.
#include "linear/linear.h"

#include "linear/exl2_linear.h"
#include "exl2/options.h"
#include "ops/ops.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

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
  const Tensor& weight() const { return w_; }

 private:
  Tensor w_;  // [out, in]
  Tensor b_;  // [out] f32, or undefined
};

}  // namespace

bool gemv_fuse_enabled() { return runtime_options().gemv_fuse; }

void forward_composed(const std::vector<Linear*>& linears, const Tensor& src, const LinearPrologue& pro,
                      const std::vector<Tensor*>& ys, bool add_into, Tensor& scratch) {
  EXL2_CHECK(!linears.empty() && linears.size() == ys.size(), "forward_fused: ", linears.size(), " linears but ",
             ys.size(), " outputs");
  EXL2_CHECK(!add_into || linears.size() == 1, "forward_fused: add_into takes exactly one linear, got ",
             linears.size());
  EXL2_CHECK(linears[0] != nullptr && ys[0] != nullptr, "forward_fused: linear or output 0 is null");
  const int64_t in = linears[0]->in_features();
  EXL2_CHECK(src.defined() && src.dim() >= 1 && src.size(-1) == in, "forward_fused: src must be [..., ", in,
             "], got ", src.defined() ? src.describe() : std::string("undefined"));
  const int64_t n = src.numel() / std::max<int64_t>(1, in);
  // [n, cols] of scratch from element `at` on (the product follows a normed x when both are needed).
  auto scratch_of = [&](int64_t at, int64_t cols, const char* what) {
    EXL2_CHECK(scratch.defined() && scratch.dtype() == src.dtype() && scratch.device() == src.device() &&
                   scratch.numel() >= at + n * cols,
               "forward_fused: scratch for ", what, " must hold ", at + n * cols, " elements (", n, " rows) of ",
               dtype_name(src.dtype()), " on ", src.device().str(), ", got ",
               scratch.defined() ? scratch.describe() : std::string("undefined"));
    Shape shape = src.shape();
    shape.back() = cols;
    return scratch.view({scratch.numel()}).slice(at, at + n * cols).view(shape);
  };
  Tensor a = src;
  switch (pro.kind) {
    case LinearPrologue::Kind::none:
      break;
    case LinearPrologue::Kind::rms_norm:
      a = scratch_of(0, in, "the normed x");
      ops::rms_norm(src, pro.w, pro.eps, a);
      break;
    case LinearPrologue::Kind::silu_mul:
      ops::silu_mul(src, pro.up, a);  // in place: src becomes silu(src) * up
      break;
  }
  if (!add_into) {
    forward_group(linears, a, ys);
    return;
  }
  Tensor& y = *ys[0];
  const int64_t at = pro.kind == LinearPrologue::Kind::rms_norm ? n * in : 0;
  Tensor t = scratch_of(at, linears[0]->out_features(), "the product");
  linears[0]->forward(a, t);
  ops::add(y, t, y);
}

std::unique_ptr<Linear> make_dense_linear(Tensor weight, Tensor bias, Device device) {
  // CPU keeps the file's dtype (zero-copy from the mapping; the matmul converts panels). CUDA computes in f16.
  if (!device.is_cpu()) weight = weight.to_dtype(DType::F16).to(device);
  if (bias.defined()) bias = bias.to_dtype(DType::F32).to(device);
  return std::make_unique<DenseLinear>(std::move(weight), std::move(bias));
}

const Tensor* dense_linear_weight(const Linear& l) {
  const auto* d = dynamic_cast<const DenseLinear*>(&l);
  return d ? &d->weight() : nullptr;
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

std::unique_ptr<Linear> load_linear_rows(const TensorMap& tm, const std::string& prefix, int64_t in, int64_t out,
                                         bool with_bias, Device device, const std::vector<int64_t>& rows) {
  for (int64_t r : rows)
    EXL2_CHECK(r >= 0 && r < out, "linear '", prefix, "': output ", r, " is not inside its ", out, " outputs");
  if (tm.contains(prefix + ".q_weight")) return make_exl2_linear_rows(tm, prefix, in, out, device, rows);
  const auto gather = [&](const Tensor& t, int64_t width) {  // rows of t [out, width] in order
    const size_t row_bytes = static_cast<size_t>(width) * dtype_size(t.dtype());
    std::vector<int64_t> shape = {static_cast<int64_t>(rows.size())};
    if (t.dim() == 2) shape.push_back(width);
    Tensor g = Tensor::empty(shape, t.dtype());
    for (size_t i = 0; i < rows.size(); ++i)
      std::memcpy(static_cast<char*>(g.data()) + i * row_bytes,
                  static_cast<const char*>(t.data()) + static_cast<size_t>(rows[i]) * row_bytes, row_bytes);
    return g;
  };
  const Tensor w = tm.get_checked(prefix + ".weight", {out, in}, {DType::F16, DType::BF16, DType::F32});
  Tensor b;
  if (with_bias) b = gather(tm.get_checked(prefix + ".bias", {out}, {DType::F16, DType::BF16, DType::F32}), 1);
  return make_dense_linear(gather(w, in), std::move(b), device);
}

}  // namespace exl2
