// The EXL2 quantized Linear: loads and validates the tensors, and on the CPU dequantizes them once (bit-exact,
// act-order permutation folded into the weight) for ops::matmul_nt with fp32 accumulation; and forward_group
// (linear.h), which needs to see which linears are EXL2 layers on CUDA.
#include "linear/exl2_linear.h"

#include <cstring>
#include <vector>

#include "ops/ops.h"
#include "quant/exl2_format.h"

// ---- CUDA hook -----------------------------------------------------------------------------------------------
// The CUDA EXL2 GEMM (cuda/exl2_gemm.h) defines EXL2_HAVE_CUDA_EXL2_GEMM and provides exl2::cuda::exl2_upload /
// exl2_gemm; CPU-only builds raise Unsupported for EXL2 layers on a CUDA device.
#if defined(EXL2_WITH_CUDA)
#include "cuda/exl2_gemm.h"
#endif

namespace exl2 {

namespace {

class Exl2Linear final : public Linear {
 public:
  Exl2Linear(const TensorMap& tensors, const std::string& prefix, int64_t in_features, int64_t out_features,
             Device device, int64_t col_begin = 0, int64_t col_end = -1)
      : prefix_(prefix), device_(device) {
    auto fetch = [&](const char* suffix, bool required) -> Tensor {
      const std::string key = prefix + "." + suffix;
      if (!required && !tensors.contains(key)) return Tensor();
      return tensors.get(key);  // ModelFormatError "missing tensor" when absent
    };
    host_.q_weight = fetch("q_weight", true);
    host_.q_scale = fetch("q_scale", true);
    host_.q_scale_max = fetch("q_scale_max", true);
    host_.q_groups = fetch("q_groups", true);
    host_.q_invperm = fetch("q_invperm", true);
    host_.q_perm = fetch("q_perm", false);
    bias_host_ = fetch("bias", false);
    layout_ = quant::validate(view(), prefix, in_features, out_features);
    if (col_end >= 0 && (col_begin != 0 || col_end != out_features)) {  // a tensor-parallel shard
      slice_columns(col_begin, col_end);
      layout_ = quant::validate(view(), prefix, in_features, col_end - col_begin);
    }

    if (device.is_cpu()) {
      // Dequantize once into the HF layout [out, in], original input order: the permutation is folded in.
      weight_ = Tensor::empty({layout_.out, layout_.in}, DType::F16);
      quant::dequantize_into(view(), layout_, 1.0, weight_.data_as<uint16_t>(), /*transpose=*/true);
      if (bias_host_.defined()) bias_ = bias_host_.to_dtype(DType::F32);
    } else {
      // Keep the quantized tensors on the device for the CUDA kernels.
#if defined(EXL2_WITH_CUDA) && defined(EXL2_HAVE_CUDA_EXL2_GEMM)
      std::vector<uint16_t> msc(layout_.groups.size());
      const uint16_t* qsm = host_.q_scale_max.data_as<uint16_t>();
      for (size_t g = 0; g < msc.size(); ++g) msc[g] = f32_to_f16(f16_to_f32(qsm[g]) * (1.0f / 256.0f));
      Tensor bias_f32;
      if (bias_host_.defined()) bias_f32 = bias_host_.to_dtype(DType::F32);
      dev_ = cuda::exl2_upload(layout_, host_.q_weight, host_.q_scale, msc, bias_f32, device);
#else
      EXL2_FAIL(Unsupported, "EXL2 layer '", prefix_, "' on ", device_.str(),
                ": this build has no CUDA EXL2 GEMM kernel; load the model with device=\"cpu\"");
#endif
    }
  }

  int64_t in_features() const override { return layout_.in; }
  int64_t out_features() const override { return layout_.out; }

  void forward(const Tensor& x, Tensor& y) override {
    if (device_.is_cpu()) {
      ops::matmul_nt(x, weight_, bias_, y);
      return;
    }
#if defined(EXL2_WITH_CUDA) && defined(EXL2_HAVE_CUDA_EXL2_GEMM)
    cuda::exl2_gemm(x, dev_, y);
#else
    EXL2_FAIL(Unsupported, "EXL2 layer '", prefix_, "' on ", device_.str(),
              ": this build has no CUDA EXL2 GEMM kernel yet; load the model with device=\"cpu\"");
#endif
  }

  Tensor weight_f32() const override {
    if (weight_.defined()) return weight_.to_dtype(DType::F32);
    Tensor w = Tensor::empty({layout_.out, layout_.in}, DType::F16);
    quant::dequantize_into(view(), layout_, 1.0, w.data_as<uint16_t>(), /*transpose=*/true);
    return w.to_dtype(DType::F32);
  }

  std::string kind() const override { return "exl2"; }

  size_t nbytes() const override {
    size_t n = host_.q_weight.nbytes() + host_.q_scale.nbytes() + host_.q_scale_max.nbytes() +
               host_.q_groups.nbytes() + host_.q_invperm.nbytes();
    if (bias_host_.defined()) n += bias_host_.nbytes();
    return n;
  }

  size_t device_nbytes() const override {
#if defined(EXL2_WITH_CUDA) && defined(EXL2_HAVE_CUDA_EXL2_GEMM)
    if (device_.is_cuda()) return static_cast<size_t>(cuda::exl2_device_bytes(dev_));
#endif
    return weight_.defined() ? weight_.nbytes() : nbytes();
  }

  double bits_per_weight() const override { return quant::bits_per_weight(layout_); }

#if defined(EXL2_WITH_CUDA) && defined(EXL2_HAVE_CUDA_EXL2_GEMM)
  // The device weights (forward_group), or null on the CPU.
  const cuda::Exl2DeviceWeights* cuda_weights() const { return device_.is_cuda() ? &dev_ : nullptr; }
#endif
  std::string bits_desc() const override { return quant::bits_desc(layout_); }

 private:
  // Replaces the host tensors by output columns [c0, c1) (copies; the file's q_groups/q_perm/q_scale_max stay).
  void slice_columns(int64_t c0, int64_t c1) {
    EXL2_CHECK(c0 >= 0 && c0 < c1 && c1 <= layout_.out, "EXL2 layer '", prefix_, "': column slice [", c0, ", ", c1,
               ") is not inside its ", layout_.out, " outputs");
    EXL2_CHECK(c0 % 32 == 0 && (c1 - c0) % 32 == 0, "EXL2 layer '", prefix_, "': a tensor-parallel shard must start",
               " and span multiples of 32 output columns (EXL2 pads outputs to 32), got columns [", c0, ", ", c1,
               "); use fewer GPUs or a model whose widths divide by 32 * GPUs");
    auto cols = [](const Tensor& t, int64_t b, int64_t e) {  // i32 [rows, cols] -> [rows, e - b]
      const int64_t rows = t.size(0), n = t.size(1), w = e - b;
      Tensor out = Tensor::empty({rows, w}, t.dtype());
      const int32_t* src = t.data_as<int32_t>();
      int32_t* dst = out.data_as<int32_t>();
      for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * w, src + r * n + b, static_cast<size_t>(w) * 4);
      return out;
    };
    host_.q_weight = cols(host_.q_weight, c0, c1);
    host_.q_scale = cols(host_.q_scale, c0 / 8, c1 / 8);
    if (bias_host_.defined()) bias_host_ = bias_host_.slice(c0, c1);
  }

  struct HostTensors {
    Tensor q_weight, q_scale, q_scale_max, q_groups, q_invperm, q_perm;
  };

  quant::Exl2Tensors view() const {
    quant::Exl2Tensors t;
    t.q_weight = quant::Exl2Array::of(host_.q_weight);
    t.q_scale = quant::Exl2Array::of(host_.q_scale);
    t.q_scale_max = quant::Exl2Array::of(host_.q_scale_max);
    t.q_groups = quant::Exl2Array::of(host_.q_groups);
    t.q_invperm = quant::Exl2Array::of(host_.q_invperm);
    t.q_perm = quant::Exl2Array::of(host_.q_perm);
    t.bias = quant::Exl2Array::of(bias_host_);
    return t;
  }

  std::string prefix_;
  Device device_;
  quant::Exl2Layout layout_;
  HostTensors host_;  // zero-copy views of the file (kept for weight_f32 and accounting)
  Tensor bias_host_;
  Tensor weight_;  // CPU: f16 [out, in] dequantized, original input order
  Tensor bias_;    // f32 [out] on device_, or undefined
#if defined(EXL2_WITH_CUDA) && defined(EXL2_HAVE_CUDA_EXL2_GEMM)
  cuda::Exl2DeviceWeights dev_;  // CUDA only
#endif
};

}  // namespace

#if defined(EXL2_WITH_CUDA) && defined(EXL2_HAVE_CUDA_EXL2_GEMM)
namespace {
// The CUDA EXL2 weights of the leading linears that have them (stops at the first that is not an EXL2 linear on CUDA;
// the caller compares the size with linears.size()).
std::vector<const cuda::Exl2DeviceWeights*> cuda_weights_of(const std::vector<Linear*>& linears) {
  std::vector<const cuda::Exl2DeviceWeights*> ws;
  for (Linear* l : linears) {
    const auto* e = dynamic_cast<const Exl2Linear*>(l);
    if (e == nullptr || e->cuda_weights() == nullptr) break;
    ws.push_back(e->cuda_weights());
  }
  return ws;
}
}  // namespace
#endif

bool forward_group(const std::vector<Linear*>& linears, const Tensor& x, const std::vector<Tensor*>& ys) {
  EXL2_CHECK(linears.size() == ys.size(), "forward_group: ", linears.size(), " linears but ", ys.size(), " outputs");
  for (size_t i = 0; i < linears.size(); ++i)
    EXL2_CHECK(linears[i] != nullptr && ys[i] != nullptr, "forward_group: linear or output ", i, " is null");
#if defined(EXL2_WITH_CUDA) && defined(EXL2_HAVE_CUDA_EXL2_GEMM)
  const std::vector<const cuda::Exl2DeviceWeights*> ws = cuda_weights_of(linears);
  if (ws.size() == linears.size() && ws.size() >= 2 && cuda::exl2_gemm_group(x, ws, ys)) return true;
#endif
  for (size_t i = 0; i < linears.size(); ++i) linears[i]->forward(x, *ys[i]);
  return false;
}

bool forward_fused(const std::vector<Linear*>& linears, const Tensor& src, const LinearPrologue& pro,
                   const std::vector<Tensor*>& ys, bool add_into, Tensor& scratch) {
  EXL2_CHECK(!linears.empty() && linears.size() == ys.size(), "forward_fused: ", linears.size(), " linears but ",
             ys.size(), " outputs");
  for (size_t i = 0; i < linears.size(); ++i)
    EXL2_CHECK(linears[i] != nullptr && ys[i] != nullptr, "forward_fused: linear or output ", i, " is null");
#if defined(EXL2_WITH_CUDA) && defined(EXL2_HAVE_CUDA_EXL2_GEMM)
  const std::vector<const cuda::Exl2DeviceWeights*> ws = cuda_weights_of(linears);
  if (ws.size() == linears.size()) {
    const int kind = pro.kind == LinearPrologue::Kind::rms_norm ? 1 : pro.kind == LinearPrologue::Kind::silu_mul ? 2 : 0;
    if (cuda::exl2_gemm_fused(src, ws, ys, kind, pro.w, pro.eps, pro.up, add_into)) return true;
  }
#endif
  forward_composed(linears, src, pro, ys, add_into, scratch);
  return false;
}

int64_t exl2_linear_cuda_bytes(const TensorMap& tensors, const std::string& prefix) {
#if defined(EXL2_WITH_CUDA) && defined(EXL2_HAVE_CUDA_EXL2_GEMM)
  auto get = [&](const char* suffix) {
    const std::string key = prefix + "." + suffix;
    return tensors.contains(key) ? tensors.get(key) : Tensor();
  };
  const Tensor q_weight = get("q_weight"), q_scale = get("q_scale"), q_scale_max = get("q_scale_max");
  const Tensor q_groups = get("q_groups"), q_invperm = get("q_invperm"), q_perm = get("q_perm"), bias = get("bias");
  quant::Exl2Tensors t;
  t.q_weight = quant::Exl2Array::of(q_weight);
  t.q_scale = quant::Exl2Array::of(q_scale);
  t.q_scale_max = quant::Exl2Array::of(q_scale_max);
  t.q_groups = quant::Exl2Array::of(q_groups);
  t.q_invperm = quant::Exl2Array::of(q_invperm);
  t.q_perm = quant::Exl2Array::of(q_perm);
  t.bias = quant::Exl2Array::of(bias);
  const quant::Exl2Layout layout = quant::validate(t, prefix, -1, bias.defined() ? bias.numel() : -1);
  return cuda::exl2_upload_bytes(layout);
#else
  (void)tensors;
  (void)prefix;
  return -1;
#endif
}

std::unique_ptr<Linear> make_exl2_linear(const TensorMap& tensors, const std::string& prefix, int64_t in_features,
                                         int64_t out_features, Device device) {
  return std::make_unique<Exl2Linear>(tensors, prefix, in_features, out_features, device);
}

std::unique_ptr<Linear> make_exl2_linear_cols(const TensorMap& tensors, const std::string& prefix, int64_t in_features,
                                              int64_t out_features, Device device, int64_t col_begin, int64_t col_end) {
  return std::make_unique<Exl2Linear>(tensors, prefix, in_features, out_features, device, col_begin, col_end);
}

const cuda::Exl2DeviceWeights* exl2_cuda_weights(const Linear& l) {
#if defined(EXL2_WITH_CUDA) && defined(EXL2_HAVE_CUDA_EXL2_GEMM)
  const auto* e = dynamic_cast<const Exl2Linear*>(&l);
  return e != nullptr ? e->cuda_weights() : nullptr;
#else
  (void)l;
  return nullptr;
#endif
}

}  // namespace exl2
