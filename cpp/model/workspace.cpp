// The model step's persistent buffers (see workspace.h).
#include "model/workspace.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "backend/cpu/thread_pool.h"
#include "core/device_api.h"
#include "ops/ops.h"

#ifdef EXL2_WITH_CUDA
#include "cuda/graph_exec.h"
#include "cuda/multi_device.h"
#endif

namespace exl2 {

namespace {

// A CPU tensor in page-locked memory on CUDA builds for a CUDA device (plain host memory otherwise).
Tensor host_buffer(const Shape& shape, DType dtype, Device device) {
#ifdef EXL2_WITH_CUDA
  if (device.is_cuda()) {
    const size_t bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
    void* p = cuda::pinned_alloc(bytes, device.index);
    std::shared_ptr<void> hold(p, [](void* q) { cuda::pinned_free(q); });
    return Tensor::from_blob(p, shape, dtype, Device::cpu(), hold);
  }
#endif
  return Tensor::empty(shape, dtype, Device::cpu());
}

int64_t round_up(int64_t x, int64_t m) {
  return (x + m - 1) / m * m;
}

// Checks argmax->rows against the m logit rows, resets its outputs (-1 / 0) and says whether any row is flagged.
bool argmax_wanted(DeviceArgmax* argmax, int64_t m) {
  if (!argmax) return false;
  EXL2_CHECK(static_cast<int64_t>(argmax->rows.size()) == m, "forward: DeviceArgmax.rows holds ", argmax->rows.size(),
             " flags, expected one per logit row (", m, "); size it like Batch::logit_rows");
  EXL2_CHECK(argmax->params.empty() || static_cast<int64_t>(argmax->params.size()) == m,
             "forward: DeviceArgmax.params holds ", argmax->params.size(), " entries, expected none or one per logit ",
             "row (", m, ")");
  argmax->index.assign(static_cast<size_t>(m), -1);
  argmax->logprob.assign(static_cast<size_t>(m), 0.0f);
  for (uint8_t f : argmax->rows)
    if (f) return true;
  return false;
}

// fn(b, e) for each maximal run [b, e) of rows in [0, m) whose flag is `flagged` (flags null: nothing flagged).
template <typename Fn>
void for_runs(const DeviceArgmax* argmax, int64_t m, bool flagged, Fn fn) {
  int64_t b = 0;
  while (b < m) {
    auto is = [&](int64_t r) { return (argmax && argmax->rows[static_cast<size_t>(r)] != 0) == flagged; };
    if (!is(b)) {
      ++b;
      continue;
    }
    int64_t e = b + 1;
    while (e < m && is(e)) ++e;
    fn(b, e);
    b = e;
  }
}

// ops::sample_logprob (ops::argmax_logprob without params) over the flagged rows of logits32, into the same rows
// of index / logprob ([>= m], on logits32's device); params: u8 [>= m, sizeof(SampleParams)] on that device, or
// undefined when argmax.params is empty. CUDA: one launch per run of flagged rows, with that device current. CPU:
// the flagged rows spread over the pool (scattered rows would otherwise run one at a time, where the host sampler
// ran them in parallel).
void launch_argmax(const Tensor& logits32, int64_t m, const DeviceArgmax& argmax, const Tensor& params,
                   const Tensor& index, const Tensor& logprob) {
  auto one = [&](int64_t b, int64_t e) {
    Tensor i = index.slice(b, e), l = logprob.slice(b, e);
    if (params.defined())
      ops::sample_logprob(logits32.slice(b, e), params.slice(b, e), i, l);
    else
      ops::argmax_logprob(logits32.slice(b, e), i, l);
  };
  if (logits32.device().is_cpu()) {
    std::vector<int64_t> rows;
    for (int64_t r = 0; r < m; ++r)
      if (argmax.rows[static_cast<size_t>(r)]) rows.push_back(r);
    cpu::parallel_for(static_cast<int64_t>(rows.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; ++k) one(rows[k], rows[k] + 1);  // the op's own pool use runs inline here
    });
    return;
  }
#ifdef EXL2_WITH_CUDA
  cuda::ScopedDevice scope(logits32.device().index);
#endif
  for_runs(&argmax, m, true, one);
}

// argmax.params as a u8 [m, sizeof(SampleParams)] view of host memory (undefined when empty).
Tensor host_params(DeviceArgmax& argmax, int64_t m) {
  if (argmax.params.empty()) return Tensor();
  return Tensor::from_blob(argmax.params.data(), {m, static_cast<int64_t>(sizeof(SampleParams))}, DType::U8,
                           Device::cpu());
}

// After the device work: unflagged rows back to -1 / 0 (their slots of the copied buffers are stale).
void clear_unflagged(DeviceArgmax& argmax) {
  for (size_t r = 0; r < argmax.rows.size(); ++r)
    if (!argmax.rows[r]) argmax.index[r] = -1, argmax.logprob[r] = 0.0f;
}

}  // namespace

Tensor logits_to_host(const Tensor& logits32, int64_t m, DeviceArgmax* argmax) {
  const bool pick = argmax_wanted(argmax, m);
  const Device dev = logits32.device();
  if (dev.is_cpu()) {
    if (pick) {
      Tensor index = Tensor::from_blob(argmax->index.data(), {m}, DType::I32, dev);
      Tensor logprob = Tensor::from_blob(argmax->logprob.data(), {m}, DType::F32, dev);
      launch_argmax(logits32, m, *argmax, host_params(*argmax, m), index, logprob);
    }
    return logits32.size(0) == m ? logits32 : logits32.slice(0, m);
  }
  const int64_t vocab = logits32.size(1);
  Tensor out = Tensor::empty({m, vocab}, DType::F32, Device::cpu());
  if (!pick) {
    device::copy(out.data(), Device::cpu(), logits32.data(), dev, out.nbytes());
    return out;
  }
  Tensor index = Tensor::empty({m}, DType::I32, dev), logprob = Tensor::empty({m}, DType::F32, dev);
  Tensor params;
  if (!argmax->params.empty()) {
    params = Tensor::empty({m, static_cast<int64_t>(sizeof(SampleParams))}, DType::U8, dev);
    device::copy(params.data(), dev, argmax->params.data(), Device::cpu(), params.nbytes());
  }
  launch_argmax(logits32, m, *argmax, params, index, logprob);
  const size_t row = static_cast<size_t>(vocab) * sizeof(float);
  for_runs(argmax, m, false, [&](int64_t b, int64_t e) {
    device::copy(static_cast<char*>(out.data()) + b * row, Device::cpu(),
                 static_cast<const char*>(logits32.data()) + b * row, dev, (e - b) * row);
  });
  device::copy(argmax->index.data(), Device::cpu(), index.data(), dev, m * sizeof(int32_t));
  device::copy(argmax->logprob.data(), Device::cpu(), logprob.data(), dev, m * sizeof(float));
  clear_unflagged(*argmax);
  return out;
}

Workspace::Workspace(Device device, DType act, const WorkspaceDims& dims) : device_(device), act_(act), dims_(dims) {}

Workspace::~Workspace() {
  try {
    finish_step();
  } catch (...) {  // a destructor never throws; the stream error resurfaces on the next call
  }
}

MoeBuffers Workspace::moe(int64_t n) const {
  MoeBuffers b;
  if (!moe_.logits.defined()) return b;
  const int64_t P = n * dims_.moe.top_k;
  auto rows = [](const Tensor& t, int64_t k) { return t.defined() ? t.slice(0, k) : Tensor(); };
  b.logits = rows(moe_.logits, n);
  b.ids = rows(moe_.ids, n);
  b.weights = rows(moe_.weights, n);
  b.g.offsets = moe_.g.offsets;
  b.g.active = moe_.g.active;
  b.g.perm = rows(moe_.g.perm, P);
  b.g.inv = rows(moe_.g.inv, P);
  b.eg = rows(moe_.eg, P);
  b.eu = rows(moe_.eu, P);
  b.eg_full = moe_.eg_full.defined() ? rows(moe_.eg_full, P) : b.eg;
  b.eo = rows(moe_.eo, P);
  b.sg = rows(moe_.sg, n);
  b.su = rows(moe_.su, n);
  b.sg_full = moe_.sg_full.defined() ? rows(moe_.sg_full, n) : b.sg;
  b.so = rows(moe_.so, n);
  b.sgate = rows(moe_.sgate, n);
  return b;
}

void Workspace::reserve(int64_t rows, int64_t meta_ints) {
  EXL2_CHECK(rows > 0 && meta_ints > 0, "workspace: rows and metadata size must be positive, got ", rows, ", ",
             meta_ints);
  bool moved = false;
  if (rows > rows_ || !h_.defined()) {
    finish_step();  // kernels of an unfinished step may still use the old buffers
    const int64_t r = round_up(std::max<int64_t>(rows, device_.is_cuda() ? kKeptLogitRows : 1), 64);
    const WorkspaceDims& d = dims_;
    // Free the old buffers first so peak memory stays at the new size.
    h_ = x_ = q_ = k_ = v_ = attn_ = gate_ = up_ = picked_ = normed_ = Tensor();
    moe_ = MoeBuffers();
    h_ = Tensor::empty({r, d.hidden}, act_, device_);
    x_ = Tensor::empty({r, d.hidden}, act_, device_);
    q_ = Tensor::empty({r, d.q_width}, act_, device_);
    k_ = Tensor::empty({r, d.kv_width}, act_, device_);
    v_ = Tensor::empty({r, d.kv_width}, act_, device_);
    attn_ = Tensor::empty({r, d.q_width}, act_, device_);
    gate_ = Tensor::empty({r, d.intermediate}, act_, device_);
    up_ = Tensor::empty({r, d.intermediate}, act_, device_);
    picked_ = Tensor::empty({r, d.hidden}, act_, device_);
    normed_ = Tensor::empty({r, d.hidden}, act_, device_);
    if (d.moe.experts > 0) {
      const MoeDims& m = d.moe;
      const int64_t P = r * m.top_k;
      moe_.logits = Tensor::empty({r, m.experts}, act_, device_);
      moe_.ids = Tensor::empty({r, m.top_k}, DType::I32, device_);
      moe_.weights = Tensor::empty({r, m.top_k}, DType::F32, device_);
      moe_.g.offsets = Tensor::empty({m.experts + 1}, DType::I32, device_);
      moe_.g.active = Tensor::empty({m.experts + 1}, DType::I32, device_);
      moe_.g.perm = Tensor::empty({P}, DType::I32, device_);
      moe_.g.inv = Tensor::empty({P}, DType::I32, device_);
      moe_.eg = Tensor::empty({P, m.expert_cols}, act_, device_);
      moe_.eu = Tensor::empty({P, m.expert_cols}, act_, device_);
      if (m.expert_full != m.expert_cols) moe_.eg_full = Tensor::empty({P, m.expert_full}, act_, device_);
      moe_.eo = Tensor::empty({P, m.hidden_cols}, act_, device_);
      if (m.shared_full > 0) {
        moe_.sg = Tensor::empty({r, m.shared_cols}, act_, device_);
        moe_.su = Tensor::empty({r, m.shared_cols}, act_, device_);
        if (m.shared_full != m.shared_cols) moe_.sg_full = Tensor::empty({r, m.shared_full}, act_, device_);
        moe_.so = Tensor::empty({r, m.hidden_cols}, act_, device_);
        moe_.sgate = Tensor::empty({r, 1}, act_, device_);
      }
    }
    rows_ = r;
    moved = true;
  }
  if (device_.is_cuda() && !logits_.defined()) {
    logit_rows_ = kKeptLogitRows;
    logits_ = Tensor::empty({logit_rows_, dims_.vocab}, act_, device_);
    logits32_ = Tensor::empty({logit_rows_, dims_.vocab}, DType::F32, device_);
    host_logits_ = host_buffer({logit_rows_, dims_.vocab}, DType::F32, device_);
    pick_index_ = Tensor::empty({logit_rows_}, DType::I32, device_);
    pick_logprob_ = Tensor::empty({logit_rows_}, DType::F32, device_);
    const int64_t pbytes = static_cast<int64_t>(sizeof(SampleParams));
    pick_params_ = Tensor::empty({logit_rows_, pbytes}, DType::U8, device_);
    pick_params_host_ = host_buffer({logit_rows_, pbytes}, DType::U8, device_);
    moved = true;
  }
  if (meta_ints > meta_ints_) {
    finish_step();
    const int64_t cap = round_up(std::max<int64_t>(meta_ints, 2 * meta_ints_), 1024);
    staging_ = host_buffer({cap}, DType::I32, device_);
    meta_ = device_.is_cuda() ? Tensor::empty({cap}, DType::I32, device_) : staging_;
    meta_ints_ = cap;
    moved = true;
  }
  if (moved) ++generation_;
}

void Workspace::begin_step() {
  finish_step();
}

void Workspace::upload(int64_t ints) {
  EXL2_CHECK_KIND(Internal, ints <= meta_ints_, "workspace: upload of ", ints, " ints but only ", meta_ints_,
                  " reserved");
  if (!device_.is_cuda()) return;
#ifdef EXL2_WITH_CUDA
  in_flight_ = true;
  cuda::copy_to_device_async(meta_.data(), staging_.data(), static_cast<size_t>(ints) * sizeof(int32_t), device_.index);
#endif
}

Tensor Workspace::download_logits(int64_t m, DeviceArgmax* argmax) {
  EXL2_CHECK_KIND(Internal, device_.is_cuda() && m <= logit_rows_, "workspace: download of ", m, " logit rows, kept ",
                  logit_rows_);
  const bool pick = argmax_wanted(argmax, m);
  Tensor out = Tensor::empty({m, dims_.vocab}, DType::F32, Device::cpu());
  (void)pick;  // a CPU-only build never gets here (CUDA workspaces only)
#ifdef EXL2_WITH_CUDA
  in_flight_ = true;
  if (pick) {
    Tensor params;  // through page-locked memory: a pageable source would sync the stream before the copy
    if (!argmax->params.empty()) {
      const size_t bytes = static_cast<size_t>(m) * sizeof(SampleParams);
      std::memcpy(pick_params_host_.data(), argmax->params.data(), bytes);
      cuda::copy_to_device_async(pick_params_.data(), pick_params_host_.data(), bytes, device_.index);
      params = pick_params_.slice(0, m);
    }
    launch_argmax(logits32_, m, *argmax, params, pick_index_, pick_logprob_);
  }
  // The rows not picked on the device (all of them without argmax): one async copy per run, one sync.
  const size_t row = static_cast<size_t>(dims_.vocab) * sizeof(float);
  for_runs(pick ? argmax : nullptr, m, false, [&](int64_t b, int64_t e) {
    cuda::copy_to_host_async(static_cast<char*>(host_logits_.data()) + b * row,
                             static_cast<const char*>(logits32_.data()) + b * row, (e - b) * row, device_.index);
  });
  if (pick) {
    cuda::copy_to_host_async(argmax->index.data(), pick_index_.data(), m * sizeof(int32_t), device_.index);
    cuda::copy_to_host_async(argmax->logprob.data(), pick_logprob_.data(), m * sizeof(float), device_.index);
  }
  cuda::synchronize_stream(device_.index);
  in_flight_ = false;
  for_runs(pick ? argmax : nullptr, m, false, [&](int64_t b, int64_t e) {
    std::memcpy(static_cast<char*>(out.data()) + b * row, static_cast<const char*>(host_logits_.data()) + b * row,
                (e - b) * row);
  });
  if (pick) clear_unflagged(*argmax);
#endif
  return out;
}

void Workspace::finish_step() {
  if (!in_flight_) return;
#ifdef EXL2_WITH_CUDA
  in_flight_ = false;
  cuda::synchronize_stream(device_.index);
#endif
}

}  // namespace exl2
