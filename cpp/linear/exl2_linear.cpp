// The EXL2 quantized Linear: loads and validates the tensors; on the CPU dequantizes them once (bit-exact,
// act-order permutation folded into the weight) for ops::matmul_nt with fp32 accumulation, on CUDA uploads them and
// runs ops::exl2_matmul; and forward_group / forward_fused (linear.h), which need to see which linears are EXL2 layers
// on CUDA.
#include "linear/exl2_linear.h"

#include <cstring>
#include <vector>

#include "ops/exl2_matmul.h"
#include "ops/ops.h"
#include "quant/exl2_format.h"

// ---- CUDA hook -----------------------------------------------------------------------------------------------
// The CUDA EXL2 GEMM (cuda/exl2_gemm.h) defines EXL2_HAVE_CUDA_EXL2_GEMM and provides exl2::cuda::exl2_upload
// (ops::exl2_matmul runs it); CPU-only builds raise Unsupported for EXL2 layers on a CUDA device.
#if defined(EXL2_WITH_CUDA)
#include "cuda/exl2_gemm.h"
#endif

namespace exl2 {

namespace {

class Exl2Linear final : public Linear {
 public:
  // cols: the file's output columns this layer takes, in its order (empty: all).
  Exl2Linear(const TensorMap& tensors, const std::string& prefix, int64_t in_features, int64_t out_features,
             Device device, const std::vector<int64_t>& cols = {})
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
    if (!cols.empty()) {  // a tensor-parallel shard, or rows reordered (interleaved RoPE)
      select_columns(cols);
      layout_ = quant::validate(view(), prefix, in_features, static_cast<int64_t>(cols.size()));
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
    ops::Exl2MatmulWeights w;
    w.device = device_;
    w.in = layout_.in;
    w.out = layout_.out;
    w.cuda = &dev_;
    ops::exl2_matmul(x, w, y);
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
  // Replaces the host tensors by output columns `cols` of the file's (copies; the file's q_groups/q_perm/
  // q_scale_max stay): q_weight columns, q_scale nibbles (8 columns per word), bias entries.
  void select_columns(const std::vector<int64_t>& cols) {
    const int64_t w = static_cast<int64_t>(cols.size());
    for (int64_t c : cols)
      EXL2_CHECK(c >= 0 && c < layout_.out, "EXL2 layer '", prefix_, "': output column ", c, " is not inside its ",
                 layout_.out, " outputs");
    const Tensor qw = host_.q_weight, qs = host_.q_scale;
    const int64_t rows = qw.size(0), n = qw.size(1), groups = qs.size(0), sn = qs.size(1);
    host_.q_weight = Tensor::empty({rows, w}, qw.dtype());
    host_.q_scale = Tensor::empty({groups, w / 8}, qs.dtype());
    const uint32_t* src = qw.data_as<uint32_t>();
    uint32_t* dst = host_.q_weight.data_as<uint32_t>();
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < w; ++i) dst[r * w + i] = src[r * n + cols[static_cast<size_t>(i)]];
    const uint32_t* ssrc = qs.data_as<uint32_t>();
    uint32_t* sdst = host_.q_scale.data_as<uint32_t>();
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t j = 0; j < w / 8; ++j) {
        uint32_t word = 0;
        for (int64_t k = 0; k < 8; ++k) {
          const int64_t c = cols[static_cast<size_t>(8 * j + k)];
          word |= ((ssrc[g * sn + c / 8] >> (4 * (c % 8))) & 15u) << (4 * k);
        }
        sdst[g * (w / 8) + j] = word;
      }
    if (bias_host_.defined()) {  // in the file's dtype
      const Tensor b = bias_host_;
      const size_t es = b.nbytes() / static_cast<size_t>(b.numel());
      bias_host_ = Tensor::empty({w}, b.dtype());
      const char* bsrc = static_cast<const char*>(b.data());
      char* bdst = static_cast<char*>(bias_host_.data());
      for (int64_t i = 0; i < w; ++i) std::memcpy(bdst + i * es, bsrc + cols[static_cast<size_t>(i)] * es, es);
    }
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
  if (ws.size() == linears.size() && ws.size() >= 2 && ops::exl2_matmul_group(x, ws, ys)) return true;
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
    if (ops::exl2_matmul_fused(src, ws, ys, kind, pro.w, pro.eps, pro.up, add_into)) return true;
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
  EXL2_CHECK(col_begin % 32 == 0 && (col_end - col_begin) % 32 == 0, "EXL2 layer '", prefix,
             "': a tensor-parallel shard must start and span multiples of 32 output columns (EXL2 pads outputs to 32), "
             "got columns [", col_begin, ", ", col_end, "); use fewer GPUs or a model whose widths divide by 32 * GPUs");
  std::vector<int64_t> cols;
  for (int64_t c = col_begin; c < col_end; ++c) cols.push_back(c);
  return make_exl2_linear_rows(tensors, prefix, in_features, out_features, device, cols);
}

std::unique_ptr<Linear> make_exl2_linear_rows(const TensorMap& tensors, const std::string& prefix, int64_t in_features,
                                              int64_t out_features, Device device, const std::vector<int64_t>& cols) {
  EXL2_CHECK(!cols.empty() && cols.size() % 32 == 0, "EXL2 layer '", prefix, "': a layer of ", cols.size(),
             " of its output columns: EXL2 layers hold a positive multiple of 32 outputs");
  return std::make_unique<Exl2Linear>(tensors, prefix, in_features, out_features, device, cols);
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
