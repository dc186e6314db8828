// Per-device execution state of the CUDA backend: the current stream (default: one non-blocking stream created
// per device on first use), the cuBLAS handle (bound to the current stream, with its own workspace so it can
// be captured into CUDA graphs), a grow-only scratch workspace, and cached device properties.
// All functions act on the current CUDA device (cudaGetDevice) unless a device index is given.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>

namespace exl2::cuda {

cudaStream_t current_stream();
cudaStream_t current_stream(int device);
// Make `stream` the current stream of `device` (nullptr: back to the default non-blocking stream). The engine
// uses this to run steps on a capture stream for CUDA graphs.
void set_current_stream(int device, cudaStream_t stream);

// RAII: switch the current device (and back).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

// cuBLAS handle of the current device, set to the current stream before it is returned.
cublasHandle_t cublas_handle();

// Scratch memory of the current device, at least `bytes`, valid until the next call on this device (kernels
// on the current stream may use it; growing it frees the old buffer, which synchronizes the device). Grow it
// once before graph capture (a warm-up step): allocation is not allowed while capturing. Growing bumps
// scratch_generation() (cuda/graph_exec.h), so graphs that captured the old buffer get recaptured.
void* workspace(size_t bytes);

// Deferred frees for threads that must not call cudaFree: while a DeferFrees is alive on a thread, device memory
// that thread frees (Tensor deleters, workspace and accumulator growth) is queued instead. Tensor-parallel rank
// threads use it: cudaFree synchronizes its device while holding the driver's allocation lock, and that device may
// be waiting in an NCCL collective for another rank whose thread is blocked on that lock in cudaMalloc (deadlock).
// release_deferred_frees() frees the queue (each buffer's device synchronizes first); call it when no rank thread
// is inside a step.
class DeferFrees {
 public:
  DeferFrees();
  ~DeferFrees();
  DeferFrees(const DeferFrees&) = delete;
  DeferFrees& operator=(const DeferFrees&) = delete;
};
void free_device(void* ptr, int device);  // cudaFree on `device`, or queued under a DeferFrees; never throws
void release_deferred_frees();

int sm_count();                  // multiprocessors of the current device
int compute_capability();        // major*10 + minor
size_t max_smem_per_block_optin();  // opt-in dynamic shared memory limit (bytes)

}  // namespace exl2::cuda
