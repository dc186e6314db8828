// GptqLayerEval (cpp/quant/gptq.h): the converter's layer forward over device-resident calibration states, built
// from the ops:: contracts, plus the fp64 row error sums (gptq_sqdiff) and Hessians of the resident buffers.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/device_api.h"
#include "exl2/errors.h"
#include "ops/ops.h"
#include "quant/gptq.h"

namespace exl2 {

namespace {

constexpr int64_t kSqdiffParts = 64;  // parts per calibration row of the error sums

Tensor alloc(const Shape& s, Device d) {
  return Tensor::empty(s, DType::F32, d);
}

}  // namespace

GptqLayerEval::GptqLayerEval(const Tensor& x, const Tensor& cos_sin, const LayerEvalConfig& cfg, Device device)
    : c_(cfg), dev_(device) {
  EXL2_CHECK(c_.rows > 0 && c_.tokens > 0 && c_.hidden > 0, "GptqLayerEval: rows, tokens and hidden must be > 0, got ",
             c_.rows, ", ", c_.tokens, ", ", c_.hidden);
  n_ = c_.rows * c_.tokens;
  EXL2_CHECK(x.defined() && x.dtype() == DType::F32 && x.numel() == n_ * c_.hidden,
             "GptqLayerEval: states must be f32 with rows*tokens*hidden = ", n_ * c_.hidden, " values, got ",
             x.describe());
  x_ = x.view({n_, c_.hidden}).to(dev_);
  xn_ = alloc({n_, c_.hidden}, dev_);
  y_ = alloc({n_, c_.hidden}, dev_);
  if (c_.n_heads > 0) {
    EXL2_CHECK(c_.n_kv > 0 && c_.n_heads % c_.n_kv == 0 && c_.head_dim > 0 && c_.head_dim % 2 == 0,
               "GptqLayerEval: bad attention shape: ", c_.n_heads, " heads, ", c_.n_kv, " KV heads, head_dim ",
               c_.head_dim);
    EXL2_CHECK(cos_sin.defined() && cos_sin.dtype() == DType::F32 && cos_sin.dim() == 2 &&
                   cos_sin.size(0) >= c_.tokens && cos_sin.size(1) == c_.head_dim,
               "GptqLayerEval: cos_sin must be f32 [>= ", c_.tokens, ", ", c_.head_dim, "], got ", cos_sin.describe());
    cos_sin_ = cos_sin.to(dev_);
    std::vector<int32_t> pos(static_cast<size_t>(n_)), seq(static_cast<size_t>(n_)), table(c_.rows);
    for (int64_t i = 0; i < n_; ++i) {
      pos[i] = static_cast<int32_t>(i % c_.tokens);
      seq[i] = static_cast<int32_t>(i / c_.tokens);
    }
    for (int64_t r = 0; r < c_.rows; ++r) table[r] = static_cast<int32_t>(r);
    positions_ = Tensor::from_vector(pos, DType::I32).to(dev_);
    seq_ = Tensor::from_vector(seq, DType::I32).to(dev_);
    table_ = Tensor::from_vector(table, DType::I32).view({c_.rows, 1}).to(dev_);
  }
}

Tensor GptqLayerEval::up(const Tensor& t) const {
  if (!t.defined()) return t;
  EXL2_CHECK(t.dtype() == DType::F32, "GptqLayerEval: weights must be f32, got ", t.describe());
  return t.device() == dev_ ? t : t.to(dev_);
}

void GptqLayerEval::norm(const Tensor& w) {
  EXL2_CHECK(w.defined() && w.numel() == c_.hidden, "GptqLayerEval::norm: weight must have ", c_.hidden,
             " values, got ", w.describe());
  ops::rms_norm(x_, up(w), c_.eps, xn_);
}

void GptqLayerEval::attention(const Tensor& wq, const Tensor& wk, const Tensor& wv, const Tensor& bq, const Tensor& bk,
                              const Tensor& bv, const Tensor& q_norm, const Tensor& k_norm) {
  EXL2_CHECK(c_.n_heads > 0, "GptqLayerEval::attention: made without an attention shape (n_heads = 0)");
  const int64_t H = c_.n_heads, Hk = c_.n_kv, d = c_.head_dim;
  EXL2_CHECK(wq.defined() && wq.dim() == 2 && wq.size(0) == H * d && wq.size(1) == c_.hidden && wk.defined() &&
                 wk.dim() == 2 && wk.size(0) == Hk * d && wk.size(1) == c_.hidden && wv.defined() && wv.dim() == 2 &&
                 wv.size(0) == Hk * d && wv.size(1) == c_.hidden,
             "GptqLayerEval::attention: q/k/v weights must be [", H * d, "|", Hk * d, ", ", c_.hidden, "], got ",
             wq.describe(), ", ", wk.describe(), ", ", wv.describe());
  if (!tmp_q_.defined()) {
    tmp_q_ = alloc({n_, H * d}, dev_);
    tmp_k_ = alloc({n_, Hk * d}, dev_);
    tmp_v_ = alloc({n_, Hk * d}, dev_);
  }
  if (!mid_.defined() || mid_.size(1) != H * d) mid_ = alloc({n_, H * d}, dev_);
  ops::matmul_nt(xn_, up(wq), up(bq), tmp_q_);
  ops::matmul_nt(xn_, up(wk), up(bk), tmp_k_);
  ops::matmul_nt(xn_, up(wv), up(bv), tmp_v_);
  Tensor q = tmp_q_.view({n_, H, d}), k = tmp_k_.view({n_, Hk, d});
  if (q_norm.defined()) {
    Tensor qf = tmp_q_.view({n_ * H, d}), kf = tmp_k_.view({n_ * Hk, d});
    ops::rms_norm(qf, up(q_norm), c_.eps, qf);
    ops::rms_norm(kf, up(k_norm), c_.eps, kf);
  }
  ops::rope(q, positions_, cos_sin_);
  ops::rope(k, positions_, cos_sin_);
  Tensor o = mid_.view({n_, H, d});
  ops::attention_paged(q, tmp_k_.view({c_.rows, c_.tokens, Hk, d}), tmp_v_.view({c_.rows, c_.tokens, Hk, d}),
                       positions_, seq_, table_, 1.0f / std::sqrt(static_cast<float>(d)), o);
}

void GptqLayerEval::mlp(const Tensor& wg, const Tensor& wu, const Tensor& bg, const Tensor& bu) {
  EXL2_CHECK(wg.defined() && wu.defined() && wg.dim() == 2 && wu.dim() == 2 && wg.size(1) == c_.hidden &&
                 wu.shape() == wg.shape(),
             "GptqLayerEval::mlp: gate/up weights must be [inter, ", c_.hidden, "], got ", wg.describe(), ", ",
             wu.describe());
  const int64_t inter = wg.size(0);
  if (!tmp_g_.defined() || tmp_g_.size(1) != inter) {
    tmp_g_ = alloc({n_, inter}, dev_);
    tmp_u_ = alloc({n_, inter}, dev_);
  }
  if (!mid_.defined() || mid_.size(1) != inter) mid_ = alloc({n_, inter}, dev_);
  ops::matmul_nt(xn_, up(wg), up(bg), tmp_g_);
  ops::matmul_nt(xn_, up(wu), up(bu), tmp_u_);
  ops::silu_mul(tmp_g_, tmp_u_, mid_);
}

void GptqLayerEval::out(const Tensor& wo, const Tensor& bo) {
  EXL2_CHECK(mid_.defined(), "GptqLayerEval::out: call attention() or mlp() first");
  EXL2_CHECK(wo.defined() && wo.dim() == 2 && wo.size(0) == c_.hidden && wo.size(1) == mid_.size(1),
             "GptqLayerEval::out: weight must be [", c_.hidden, ", ", mid_.size(1), "], got ", wo.describe());
  ops::matmul_nt(mid_, up(wo), up(bo), y_);
  ops::add(y_, x_, y_);  // x + f(x), as (x + f) in fp32 either order
}

std::vector<double> GptqLayerEval::row_sums(const Tensor& a, const Tensor& b) const {
  const int64_t cols = c_.tokens * c_.hidden, cnt = c_.rows * kSqdiffParts;
  std::vector<double> part(static_cast<size_t>(cnt));
  if (dev_.is_cpu()) {
    cpu::gptq_sqdiff(a.data_as<float>(), b.defined() ? b.data_as<float>() : nullptr, c_.rows, cols, kSqdiffParts,
                     part.data());
  } else {
#ifdef EXL2_WITH_CUDA
    Tensor pd = Tensor::empty({2 * cnt}, DType::F32, dev_);  // fp64 as f32 pairs (Tensor has no f64)
    cuda::gptq_sqdiff(a.data_as<float>(), b.defined() ? b.data_as<float>() : nullptr, c_.rows, cols, kSqdiffParts,
                      static_cast<double*>(pd.data()));
    device::copy(part.data(), Device::cpu(), pd.data(), dev_, static_cast<size_t>(cnt) * sizeof(double));
#else
    EXL2_FAIL(Unsupported, "GptqLayerEval: device ", dev_.str(), " needs a build with the CUDA backend");
#endif
  }
  std::vector<double> sums(static_cast<size_t>(c_.rows), 0.0);
  for (int64_t r = 0; r < c_.rows; ++r)
    for (int64_t p = 0; p < kSqdiffParts; ++p) sums[r] += part[r * kSqdiffParts + p];
  return sums;
}

void GptqLayerEval::set_ref() {
  if (!ref_.defined()) ref_ = alloc({n_, c_.hidden}, dev_);
  ref_.copy_from(y_);
  den_ = row_sums(ref_, Tensor());
}

double GptqLayerEval::rel_err() const {
  EXL2_CHECK(ref_.defined() && !den_.empty(), "GptqLayerEval::rel_err: call set_ref() first");
  const std::vector<double> num = row_sums(y_, ref_);
  double s = 0.0;
  for (int64_t r = 0; r < c_.rows; ++r) s += std::sqrt(num[r]) / std::max(std::sqrt(den_[r]), 1e-30);
  return s / static_cast<double>(c_.rows);
}

void GptqLayerEval::commit(bool from_ref) {
  EXL2_CHECK(!from_ref || ref_.defined(), "GptqLayerEval::commit: no reference set");
  x_.copy_from(from_ref ? ref_ : y_);
}

Tensor GptqLayerEval::hessian(bool of_mid) const {
  const Tensor& a = of_mid ? mid_ : xn_;
  EXL2_CHECK(a.defined(), "GptqLayerEval::hessian: ", of_mid ? "mid" : "xn", " is not computed yet");
  const int64_t in = a.size(1);
  Tensor h = Tensor::empty({in, in}, DType::F32);
  if (dev_.is_cpu()) {
    cpu::gptq_hessian(a.data_as<float>(), n_, in, h.data_as<float>(), false);
    return h;
  }
#ifdef EXL2_WITH_CUDA
  Tensor hd = Tensor::empty({in, in}, DType::F32, dev_);
  cuda::gptq_hessian(a.data_as<float>(), n_, in, hd.data_as<float>(), false);
  h.copy_from(hd);
  return h;
#else
  EXL2_FAIL(Unsupported, "GptqLayerEval: device ", dev_.str(), " needs a build with the CUDA backend");
#endif
}

Tensor GptqLayerEval::states() const {
  return x_.to(Device::cpu());
}

Tensor GptqLayerEval::mid() const {
  EXL2_CHECK(mid_.defined(), "GptqLayerEval::mid: not computed yet");
  return mid_.to(Device::cpu());
}

Tensor GptqLayerEval::xn() const {
  return xn_.to(Device::cpu());
}

void GptqLayerEval::sync() const {
  if (dev_.is_cuda()) device::cuda_synchronize(dev_.index);
}

}  // namespace exl2
