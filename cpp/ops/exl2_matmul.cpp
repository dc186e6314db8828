// ops::exl2_matmul: the planner (pure), the checks of x / y against the layer, and the dispatch to the CPU reference
// or the planned CUDA kernels.
#include "ops/exl2_matmul.h"

#include <algorithm>

#include "backend/cpu/exl2_matmul.h"
#include "exl2/options.h"
#include "ops/check.h"

#if defined(EXL2_WITH_CUDA)
#include "cuda/exl2_gemm.h"
#endif

namespace exl2::ops {

// ---- planner ------------------------------------------------------------------------------------------------------

Exl2GpuInfo exl2_tuned_gpu() { return {"NVIDIA H200", 90, 132}; }

const char* exl2_kernel_name(Exl2Kernel k) {
  switch (k) {
    case Exl2Kernel::none: return "none";
    case Exl2Kernel::gemv_v4: return "gemv_v4";
    case Exl2Kernel::dequant_cublas: return "dequant_cublas";
  }
  return "?";
}

namespace {

// The v4 kernel's template rows for m rows of x (cuda/exl2_gemv_v4.cuh instantiates 1, 2, 4, 8, 16, 32).
int v4_m_tile(int64_t m) {
  for (int t : {1, 2, 4, 8, 16}) {
    if (m <= t) return t;
  }
  return 32;
}

std::string gpu_str(const Exl2GpuInfo& g) {
  return g.name + " (sm_" + std::to_string(g.cc) + ", " + std::to_string(g.sm_count) + " SMs)";
}

}  // namespace

Exl2MatmulPlan plan_exl2_matmul(const Exl2MatmulShape& s, const Exl2GpuInfo& gpu, const Exl2MatmulTuning& t) {
  Exl2MatmulPlan p;
  p.tuning = t;
  const Exl2GpuInfo tuned = exl2_tuned_gpu();
  p.tuned_on = gpu_str(tuned);
  p.tuned = gpu.cc == tuned.cc;
  auto note = [&p](const std::string& s) { p.note += (p.note.empty() ? "" : "; ") + s; };
  if (!p.tuned) note("not tuned for " + gpu_str(gpu) + ": the " + tuned.name + "'s choices");
  if (s.rows < 1) {
    note("no rows");
    return p;
  }
  // Rows of x one v4 launch takes.
  const int64_t per_launch = t.m32 ? 32 : 16;
  const bool gemv_ok = s.f16 && s.rows <= t.gemv_max_rows && !t.reference;

  if (s.n_layers > 1 || s.fused) {  // one launch for all layers, or none
    const char* why = nullptr;
    if (s.n_layers < 1 || s.n_layers > 3) why = "groups take 1..3 layers";
    else if (s.n_layers >= 2 && !t.group) why = "gemv_group is off";
    else if (!s.f16) why = "f32 activations";
    else if (t.reference) why = "cuda_reference is on";
    else if (s.rows > per_launch || s.rows > t.gemv_max_rows) why = "more rows than one GEMV launch takes";
    if (why) {
      note(why);
      return p;
    }
    p.kernel = Exl2Kernel::gemv_v4;
    p.launches.push_back({0, s.rows, p.kernel, v4_m_tile(s.rows)});
    return p;
  }

  if (!gemv_ok) {
    p.kernel = Exl2Kernel::dequant_cublas;
    p.launches.push_back({0, s.rows, p.kernel, 0});
    if (t.reference) note("cuda_reference is on");
    return p;
  }
  p.kernel = Exl2Kernel::gemv_v4;
  for (int64_t r0 = 0; r0 < s.rows; r0 += per_launch) {
    const int64_t m = std::min(per_launch, s.rows - r0);
    p.launches.push_back({r0, m, p.kernel, v4_m_tile(m)});
  }
  return p;
}

// ---- the op -------------------------------------------------------------------------------------------------------

Exl2MatmulTuning exl2_tuning_from_options() {
  const RuntimeOptions& o = runtime_options();
  Exl2MatmulTuning t;
  t.gemv_max_rows = o.gemv_max_rows;
  t.m32 = o.gemv_m32;
  t.group = o.gemv_group;
  t.reference = o.cuda_reference;
  t.slices = o.gemv_slices;
  t.chunks_per_slice = o.gemv_chunks;
  t.blocks_per_sm = o.gemv_blocks_per_sm;
  t.prefetch_bytes = o.gemv_prefetch;
  t.prefetch_ahead = o.gemv_prefetch_ahead;
  return t;
}

namespace {

constexpr const char* kOp = "exl2_matmul";

// x, y against a layer of in -> out features on `device` (InvalidArgument naming what differs). Returns the rows.
int64_t check_x_y(const char* op, const Tensor& x, const Tensor& y, Device device, int64_t in, int64_t out) {
  EXL2_CHECK(x.defined() && y.defined(), op, ": x and y must be defined");
  EXL2_CHECK(x.device() == device && y.device() == device, op, ": x (", x.describe(), ") and y (", y.describe(),
             ") must be on the layer's device ", device.str());
  EXL2_CHECK(x.dtype() == DType::F16 || x.dtype() == DType::F32, op, ": x must be f16 or f32, got ", x.describe());
  EXL2_CHECK(y.dtype() == x.dtype(), op, ": y must have x's dtype, got x ", x.describe(), ", y ", y.describe());
  EXL2_CHECK(x.dim() >= 1 && x.size(-1) == in, op, ": x's last dim must be in_features = ", in, ", got ",
             x.describe());
  const int64_t n = in ? x.numel() / in : 0;
  EXL2_CHECK(y.dim() == x.dim() && y.size(-1) == out && y.numel() == n * out, op, ": y must be [..., ", out,
             "] with x's leading dims, got x ", x.describe(), ", y ", y.describe());
  detail::check_no_overlap(op, "y", y, "x", x);
  return n;
}

#if defined(EXL2_WITH_CUDA)
bool overlaps(const Tensor& a, const Tensor& b) {
  const char* pa = static_cast<const char*>(a.data());
  const char* pb = static_cast<const char*>(b.data());
  return !(pa + a.nbytes() <= pb || pb + b.nbytes() <= pa);
}

Exl2MatmulShape shape_of(const cuda::Exl2DeviceWeights& w, int64_t rows, bool f16) {
  Exl2MatmulShape s;
  s.rows = rows;
  s.in = w.in;
  s.out = w.out;
  s.f16 = f16;
  return s;
}

// The layers of a group / fused launch: one device, one in_features (else the caller composes).
bool same_family(const std::vector<const cuda::Exl2DeviceWeights*>& ws) {
  for (const cuda::Exl2DeviceWeights* w : ws)
    if (w == nullptr || w->device != ws[0]->device || w->in != ws[0]->in) return false;
  return true;
}
#endif

}  // namespace

void exl2_matmul(const Tensor& x, const Exl2MatmulWeights& w, Tensor& y) {
  const int64_t n = check_x_y(kOp, x, y, w.device, w.in, w.out);
  if (n == 0 || w.out == 0) return;
  if (w.device.is_cpu()) {
    EXL2_CHECK(w.packed != nullptr && w.layout != nullptr, kOp, ": a CPU layer needs its packed tensors and layout");
    const float* bias = nullptr;
    if (w.bias != nullptr && w.bias->defined()) {
      detail::check_dtype(kOp, "bias", *w.bias, DType::F32);
      detail::check_shape(kOp, "bias", *w.bias, {w.out});
      bias = w.bias->data_as<float>();
    }
    cpu::exl2_matmul(x.data(), x.dtype(), n, *w.packed, *w.layout, bias, y.data());
    return;
  }
#if defined(EXL2_WITH_CUDA)
  EXL2_CHECK(w.cuda != nullptr, kOp, ": a CUDA layer needs its device weights");
  const Exl2MatmulPlan plan = plan_exl2_matmul(shape_of(*w.cuda, n, x.dtype() == DType::F16),
                                               cuda::exl2_gpu_info(w.device.index), exl2_tuning_from_options());
  cuda::exl2_gemm(x.data(), x.dtype(), n, *w.cuda, y.data(), plan);
#else
  detail::no_cuda_backend(kOp);
#endif
}

bool exl2_matmul_group(const Tensor& x, const std::vector<const cuda::Exl2DeviceWeights*>& ws,
                       const std::vector<Tensor*>& ys) {
  EXL2_CHECK(ws.size() == ys.size(), "exl2_matmul_group: ", ws.size(), " layers but ", ys.size(), " outputs");
#if defined(EXL2_WITH_CUDA)
  if (ws.size() < 2 || !same_family(ws)) return false;
  if (!x.defined() || x.dtype() != DType::F16 || x.device() != ws[0]->device) return false;
  int64_t n = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    EXL2_CHECK(ys[i] != nullptr, "exl2_matmul_group: output ", i, " is null");
    n = check_x_y("exl2_matmul_group", x, *ys[i], ws[i]->device, ws[i]->in, ws[i]->out);
  }
  Exl2MatmulShape s = shape_of(*ws[0], n, true);
  s.n_layers = static_cast<int>(ws.size());
  const Exl2MatmulPlan plan =
      plan_exl2_matmul(s, cuda::exl2_gpu_info(ws[0]->device.index), exl2_tuning_from_options());
  if (plan.kernel == Exl2Kernel::none) return false;
  for (size_t i = 0; i < ys.size(); ++i)
    for (size_t j = i + 1; j < ys.size(); ++j)
      EXL2_CHECK(!overlaps(*ys[i], *ys[j]), "exl2_matmul_group: outputs ", i, " and ", j, " overlap");
  std::vector<void*> yp;
  for (Tensor* y : ys) yp.push_back(y->data());
  cuda::exl2_gemm_group(x.data(), n, ws, yp, plan);
  return true;
#else
  (void)x;
  return false;
#endif
}

bool exl2_matmul_fused(const Tensor& src, const std::vector<const cuda::Exl2DeviceWeights*>& ws,
                       const std::vector<Tensor*>& ys, int prologue, const Tensor& norm_w, float eps, const Tensor& up,
                       bool add_into) {
  EXL2_CHECK(ws.size() == ys.size(), "exl2_matmul_fused: ", ws.size(), " layers but ", ys.size(), " outputs");
  EXL2_CHECK(prologue >= 0 && prologue <= 2, "exl2_matmul_fused: prologue must be 0, 1 or 2, got ", prologue);
#if defined(EXL2_WITH_CUDA)
  if (ws.empty() || !same_family(ws) || (add_into && ws.size() != 1)) return false;
  const cuda::Exl2DeviceWeights& w0 = *ws[0];
  if (!src.defined() || src.dtype() != DType::F16 || src.device() != w0.device) return false;
  int64_t n = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
    EXL2_CHECK(ys[i] != nullptr, "exl2_matmul_fused: output ", i, " is null");
    n = check_x_y("exl2_matmul_fused", src, *ys[i], ws[i]->device, ws[i]->in, ws[i]->out);
  }
  Exl2MatmulShape s = shape_of(w0, n, true);
  s.n_layers = static_cast<int>(ws.size());
  s.fused = true;
  const Exl2MatmulPlan plan = plan_exl2_matmul(s, cuda::exl2_gpu_info(w0.device.index), exl2_tuning_from_options());
  if (plan.kernel == Exl2Kernel::none) return false;
  cuda::Exl2Prologue pro;
  pro.kind = prologue;
  pro.add_into = add_into;
  if (prologue == 1) {
    if (!norm_w.defined() || norm_w.device() != w0.device || norm_w.numel() != w0.in ||
        !(norm_w.dtype() == DType::F32 || norm_w.dtype() == DType::F16 || norm_w.dtype() == DType::BF16))
      return false;
    pro.norm_w = norm_w.data();
    pro.norm_dtype = norm_w.dtype();
    pro.eps = eps;
    pro.vec = w0.in % 8 == 0 && reinterpret_cast<uintptr_t>(src.data()) % 16 == 0;
  } else if (prologue == 2) {
    if (!up.defined() || up.dtype() != DType::F16 || up.device() != w0.device || up.numel() != src.numel())
      return false;
    pro.up = up.data();
  }
  for (size_t i = 0; i < ys.size(); ++i) {
    if ((prologue == 1 && overlaps(*ys[i], norm_w)) || (prologue == 2 && overlaps(*ys[i], up))) return false;
    for (size_t j = i + 1; j < ys.size(); ++j)
      EXL2_CHECK(!overlaps(*ys[i], *ys[j]), "exl2_matmul_fused: outputs ", i, " and ", j, " overlap");
  }
  std::vector<void*> yp;
  for (Tensor* y : ys) yp.push_back(y->data());
  cuda::exl2_gemm_fused(src.data(), n, ws, yp, plan, pro);
  return true;
#else
  (void)src;
  (void)norm_w;
  (void)eps;
  (void)up;
  return false;
#endif
}

}  // namespace exl2::ops
