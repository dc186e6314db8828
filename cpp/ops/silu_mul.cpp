// ops::silu_mul: checks (gate, up, out: same act dtype and shape) and dispatch.
#include "backend/kernels.h"
#include "ops/check.h"
#include "ops/ops.h"

namespace exl2::ops {

void silu_mul(const Tensor& gate, const Tensor& up, Tensor& out) {
  detail::check_gated("silu_mul", gate, up, out);
  if (gate.numel() == 0) return;
  EXL2_OPS_DISPATCH(gate.device(), silu_mul, gate.data(), up.data(), out.data(), gate.numel(), gate.dtype());
}

}  // namespace exl2::ops
