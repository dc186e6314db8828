// MoeExperts (linear/moe_linear.h): loading the experts of one projection, the choice of path, and the
// expert-by-expert path (the reference); the grouped CUDA kernels are in cuda/moe_exl2.cu.
#include "linear/moe_linear.h"

#include <algorithm>
#include <cstring>

#include "linear/exl2_linear.h"
#include "ops/ops.h"

#if defined(EXL2_WITH_CUDA)
#include "cuda/exl2_gemm.h"
#include "cuda/moe_exl2.h"
#endif

namespace exl2 {

#if defined(EXL2_WITH_CUDA)
static_assert(MoeExperts::kGroupedMaxRows == cuda::kMoeGroupedMaxRows, "one row limit for the grouped kernels");
#endif

struct MoeExperts::CudaState {
#if defined(EXL2_WITH_CUDA)
  cuda::MoeExl2Table exl2;  // defined table: every expert qualifies for the grouped EXL2 kernel
  Tensor dense_ptrs;        // u8: device array of the dense experts' weight pointers, or undefined
  Tensor part;              // the grouped EXL2 kernel's slice partials (grown on demand)
#endif
};

MoeExperts::~MoeExperts() = default;

std::unique_ptr<MoeExperts> MoeExperts::load(const TensorMap& tm, const std::vector<std::string>& prefixes, int64_t in,
                                             int64_t out, Device device, int64_t c0, int64_t c1) {
  EXL2_CHECK(!prefixes.empty(), "MoeExperts: at least one expert expected");
  if (c1 < 0) c1 = out;
  std::unique_ptr<MoeExperts> m(new MoeExperts());
  m->in_ = in;
  m->out_ = c1 - c0;
  m->device_ = device;
  bool all_exl2 = true, all_dense = true;
  for (const std::string& p : prefixes) {
    Expert e;
    e.exl2 = tm.contains(p + ".q_weight");
    e.lin = load_linear_cols(tm, p, in, out, false, device, c0, c1);
    (e.exl2 ? all_dense : all_exl2) = false;
    m->experts_.push_back(std::move(e));
  }
  m->cuda_ = std::make_unique<CudaState>();
#if defined(EXL2_WITH_CUDA)
  if (device.is_cuda() && all_exl2) {
    std::vector<const cuda::Exl2DeviceWeights*> ws;
    for (const Expert& e : m->experts_) ws.push_back(exl2_cuda_weights(*e.lin));
    cuda::moe_exl2_table(ws, m->cuda_->exl2);  // leaves it undefined where a layer does not qualify
  }
  if (device.is_cuda() && all_dense) {
    std::vector<const void*> ptrs;
    for (const Expert& e : m->experts_) ptrs.push_back(dense_linear_weight(*e.lin)->data());
    Tensor h = Tensor::empty({static_cast<int64_t>(ptrs.size() * sizeof(void*))}, DType::U8);
    std::memcpy(h.data(), ptrs.data(), ptrs.size() * sizeof(void*));
    m->cuda_->dense_ptrs = h.to(device);
  }
#else
  (void)all_exl2;
  (void)all_dense;
#endif
  return m;
}

std::unique_ptr<MoeExperts> MoeExperts::from_linears(std::vector<std::unique_ptr<Linear>> linears, Device device) {
  EXL2_CHECK(!linears.empty() && linears[0], "MoeExperts: at least one expert expected");
  std::unique_ptr<MoeExperts> m(new MoeExperts());
  m->in_ = linears[0]->in_features();
  m->out_ = linears[0]->out_features();
  m->device_ = device;
  for (auto& l : linears) {
    EXL2_CHECK(l && l->in_features() == m->in_ && l->out_features() == m->out_, "MoeExperts: every expert must be [",
               m->out_, ", ", m->in_, "]");
    m->experts_.push_back(Expert{std::move(l), false});
  }
  m->cuda_ = std::make_unique<CudaState>();  // no grouped tables: the per-expert path
  return m;
}

const Linear& MoeExperts::expert(int64_t e) const {
  EXL2_CHECK(e >= 0 && e < n_experts(), "MoeExperts: expert ", e, " outside [0, ", n_experts(), ")");
  return *experts_[static_cast<size_t>(e)].lin;
}

int64_t MoeExperts::weight_bytes(int64_t e) const {
  EXL2_CHECK(e >= 0 && e < n_experts(), "MoeExperts: expert ", e, " outside [0, ", n_experts(), ")");
#if defined(EXL2_WITH_CUDA)
  if (cuda_->exl2.table.defined()) return cuda_->exl2.weight_bytes[static_cast<size_t>(e)];
#endif
  const Expert& x = experts_[static_cast<size_t>(e)];
  return static_cast<int64_t>(x.exl2 ? x.lin->device_nbytes() : x.lin->nbytes());
}

MoeExperts::Path MoeExperts::plan(int64_t rows) const {
#if defined(EXL2_WITH_CUDA)
  if (device_.is_cuda() && rows >= 1 && rows <= kGroupedMaxRows) {
    if (cuda_->exl2.table.defined()) return Path::grouped_exl2;
    if (cuda_->dense_ptrs.defined()) return Path::grouped_dense;
  }
#else
  (void)rows;
#endif
  return Path::per_expert;
}

namespace {

void add_bytes(const Tensor& bytes_read, int64_t n) {
  if (!bytes_read.defined() || n == 0) return;
  Tensor h = bytes_read.device().is_cpu() ? bytes_read : bytes_read.to(Device::cpu());
  uint64_t v = 0;
  std::memcpy(&v, h.data(), sizeof(v));
  v += static_cast<uint64_t>(n);
  std::memcpy(h.data(), &v, sizeof(v));
  if (!bytes_read.device().is_cpu()) const_cast<Tensor&>(bytes_read).copy_from(h);
}

}  // namespace

MoeExperts::Path MoeExperts::forward(const Tensor& x, int64_t k, bool gather, const MoeGrouping& g, Tensor& y,
                                     const Tensor& bytes_read) {
  const char* op = "MoeExperts::forward";
  EXL2_CHECK(x.defined() && y.defined() && x.dim() == 2 && x.size(1) == in_, op, ": x must be [rows, ", in_, "], got ",
             x.defined() ? x.describe() : std::string("undefined"));
  EXL2_CHECK(x.device() == device_ && y.device() == device_, op, ": x and y must be on ", device_.str());
  EXL2_CHECK(x.dtype() == DType::F32 || x.dtype() == DType::F16, op, ": x must be f32 or f16, got ", x.describe());
  EXL2_CHECK(k >= 1 && k <= n_experts(), op, ": k must be in [1, ", n_experts(), "], got ", k);
  EXL2_CHECK(gather || x.size(0) % k == 0, op, ": x in position order must have rows * k rows, got ", x.size(0),
             " for k = ", k);
  const int64_t rows = gather ? x.size(0) : x.size(0) / k, n_pairs = rows * k;
  EXL2_CHECK(y.dtype() == x.dtype() && y.dim() == 2 && y.size(0) == n_pairs && y.size(1) == out_, op, ": y must be ",
             dtype_name(x.dtype()), "[", n_pairs, ", ", out_, "], got ", y.describe());
  const Tensor* parts[] = {&g.offsets, &g.perm, &g.active};
  const int64_t sizes[] = {n_experts() + 1, n_pairs, n_experts() + 1};
  const char* names[] = {"offsets", "perm", "active"};
  for (int i = 0; i < 3; ++i)
    EXL2_CHECK(parts[i]->defined() && parts[i]->dtype() == DType::I32 && parts[i]->numel() == sizes[i] &&
                   parts[i]->device() == device_,
               op, ": grouping ", names[i], " must be i32 [", sizes[i], "] on ", device_.str(),
               " (ops::moe_group), got ", parts[i]->defined() ? parts[i]->describe() : std::string("undefined"));
  EXL2_CHECK(bytes_read.numel() == 2 || !bytes_read.defined(), op, ": bytes_read must be i32 [2] (a u64), got ",
             bytes_read.describe());
  if (n_pairs == 0) return plan(rows);
#if defined(EXL2_WITH_CUDA)
  const Path path = plan(rows);
  auto* counter = bytes_read.defined() ? static_cast<uint64_t*>(const_cast<void*>(bytes_read.data())) : nullptr;
  if (path != Path::per_expert && x.dtype() == DType::F16 &&
      (!bytes_read.defined() || bytes_read.device() == device_)) {
    const int32_t *off = g.offsets.data_as<int32_t>(), *perm = g.perm.data_as<int32_t>();
    const int32_t* act = g.active.data_as<int32_t>();
    if (path == Path::grouped_exl2)
      cuda::moe_exl2_forward(cuda_->exl2, x.data(), gather ? k : 0, off, perm, act, n_pairs, rows, y.data(),
                             cuda_->part, counter);
    else
      cuda::moe_dense_forward(reinterpret_cast<const void* const*>(cuda_->dense_ptrs.data()), n_experts(), in_, out_,
                              x.data(), gather ? k : 0, off, perm, act, n_pairs, rows, y.data(), counter);
    return path;
  }
#endif
  forward_per_expert(x, k, gather, g, y, bytes_read);
  return Path::per_expert;
}

void MoeExperts::forward_per_expert(const Tensor& x, int64_t k, bool gather, const MoeGrouping& g, Tensor& y,
                                    const Tensor& bytes_read) {
  const Tensor off = g.offsets.device().is_cpu() ? g.offsets : g.offsets.to(Device::cpu());
  const Tensor perm = g.perm.device().is_cpu() ? g.perm : g.perm.to(Device::cpu());
  const int32_t* o = off.data_as<int32_t>();
  const int32_t* pm = perm.data_as<int32_t>();
  const int64_t n_pairs = perm.numel(), rows = gather ? x.size(0) : n_pairs;
  int64_t bytes = 0;
  for (int64_t e = 0; e < n_experts(); ++e) {
    const int64_t b = o[e], n = o[e + 1] - b;
    if (n <= 0) continue;
    EXL2_CHECK(b >= 0 && o[e + 1] <= n_pairs, "MoeExperts::forward: grouping offsets[", e, "..", e + 1, "] = ", b, "..",
               o[e + 1], " outside [0, ", n_pairs, "]");
    Tensor xe;
    if (gather) {
      Tensor idx = Tensor::empty({n}, DType::I32);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t src = pm[b + i] / k;
        EXL2_CHECK(src >= 0 && src < rows, "MoeExperts::forward: perm[", b + i, "] = ", pm[b + i],
                   " is not a pair of the ", rows, " rows");
        idx.data_as<int32_t>()[i] = static_cast<int32_t>(src);
      }
      xe = Tensor::empty({n, in_}, x.dtype(), device_);
      ops::gather_rows(x, device_.is_cpu() ? idx : idx.to(device_), xe);
    } else {
      xe = x.slice(b, b + n);
    }
    Tensor ye = y.slice(b, b + n);
    experts_[static_cast<size_t>(e)].lin->forward(xe, ye);
    bytes += weight_bytes(e);
  }
  add_bytes(bytes_read, bytes);
}

}  // namespace exl2
