// ops::gelu_tanh_mul: checks (gate, up, out: same act dtype and shape) and dispatch.
#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void gelu_tanh_mul(const Tensor& gate, const Tensor& up, Tensor& out) {
  const char* op = "gelu_tanh_mul";
  detail::check_defined_same_device(op, {{"gate", &gate}, {"up", &up}, {"out", &out}});
  detail::check_act(op, "gate", gate);
  detail::check_same_dtype(op, "up", up, "gate", gate);
  detail::check_same_dtype(op, "out", out, "gate", gate);
  detail::check_shape(op, "up", up, gate.shape());
  detail::check_shape(op, "out", out, gate.shape());
  if (gate.numel() == 0) return;
  EXL2_OPS_DISPATCH(gate.device(), gelu_tanh_mul, gate.data(), up.data(), out.data(), gate.numel(), gate.dtype());
}

}  // namespace exl2::ops
