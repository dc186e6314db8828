// The CPU reference of the EXL2 matmul (backend/cpu/exl2_matmul.h).
#include "backend/cpu/exl2_matmul.h"

#include <vector>

#include "exl2/errors.h"

namespace exl2::cpu {

void exl2_matmul(const void* x, DType act, int64_t n, const quant::Exl2Tensors& t, const quant::Exl2Layout& layout,
                 const float* bias, void* y) {
  EXL2_CHECK(act == DType::F32 || act == DType::F16, "exl2_matmul (CPU): f32 or f16 activations expected");
  const int64_t in = layout.in, out = layout.out;
  std::vector<uint16_t> w(static_cast<size_t>(in * out));  // f16 bits [in, out]
  quant::dequantize_into(t, layout, 1.0, w.data(), /*transpose=*/false);
  std::vector<float> wf(w.size());
  for (size_t i = 0; i < w.size(); ++i) wf[i] = f16_to_f32(w[i]);
  std::vector<float> xr(static_cast<size_t>(in));
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t k = 0; k < in; ++k)
      xr[size_t(k)] = act == DType::F32 ? static_cast<const float*>(x)[r * in + k]
                                        : f16_to_f32(static_cast<const uint16_t*>(x)[r * in + k]);
    for (int64_t o = 0; o < out; ++o) {
      float s = 0.f;
      for (int64_t k = 0; k < in; ++k) s += xr[size_t(k)] * wf[size_t(k * out + o)];
      if (bias) s += bias[o];
      if (act == DType::F32)
        static_cast<float*>(y)[r * out + o] = s;
      else
        static_cast<uint16_t*>(y)[r * out + o] = f32_to_f16(s);
    }
  }
}

}  // namespace exl2::cpu
