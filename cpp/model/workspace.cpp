// The model step's persistent buffers (see workspace.h).
#include "model/workspace.h"

#include <algorithm>
#include <cstring>
#include <memory>

#ifdef EXL2_WITH_CUDA
#include "cuda/graph_exec.h"
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

}  // namespace

Workspace::Workspace(Device device, DType act, const WorkspaceDims& dims) : device_(device), act_(act), dims_(dims) {}

Workspace::~Workspace() {
  try {
    finish_step();
  } catch (...) {  // a destructor never throws; the stream error resurfaces on the next call
  }
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
    rows_ = r;
    moved = true;
  }
  if (device_.is_cuda() && !logits_.defined()) {
    logit_rows_ = kKeptLogitRows;
    logits_ = Tensor::empty({logit_rows_, dims_.vocab}, act_, device_);
    logits32_ = Tensor::empty({logit_rows_, dims_.vocab}, DType::F32, device_);
    host_logits_ = host_buffer({logit_rows_, dims_.vocab}, DType::F32, device_);
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

Tensor Workspace::download_logits(int64_t m) {
  EXL2_CHECK_KIND(Internal, device_.is_cuda() && m <= logit_rows_, "workspace: download of ", m, " logit rows, kept ",
                  logit_rows_);
  Tensor out = Tensor::empty({m, dims_.vocab}, DType::F32, Device::cpu());
#ifdef EXL2_WITH_CUDA
  in_flight_ = true;
  cuda::copy_to_host_async(host_logits_.data(), logits32_.data(), out.nbytes(), device_.index);
  cuda::synchronize_stream(device_.index);
  in_flight_ = false;
  std::memcpy(out.data(), host_logits_.data(), out.nbytes());
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
