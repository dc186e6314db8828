// Per-device streams, cuBLAS handles, workspaces and the error helpers declared in check.h.
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "cuda/check.h"
#include "cuda/graph_exec.h"
#include "cuda/stream.h"
#include "exl2/options.h"

namespace exl2::cuda {

namespace {

constexpr int kMaxDevices = 64;
constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;  // 32 MiB: cuBLAS's recommendation for Hopper

struct DeviceState {
  bool init = false;
  cudaStream_t default_stream = nullptr;
  cudaStream_t current = nullptr;
  cublasHandle_t cublas = nullptr;
  cudaStream_t cublas_stream = nullptr;  // the stream last given to cublasSetStream
  void* cublas_ws = nullptr;
  void* ws = nullptr;
  size_t ws_bytes = 0;
  cudaDeviceProp prop{};
  size_t smem_optin = 0;
};

// One mutex per device, never one for all: a tensor-parallel rank thread that grows its workspace (cudaFree
// synchronizes its device, which may be waiting in an NCCL collective for another rank) must not block the other
// ranks' threads from reaching that collective.
std::mutex g_mutex[kMaxDevices];
DeviceState g_state[kMaxDevices];

int current_device() {
  int d = 0;
  EXL2_CUDA_CHECK(cudaGetDevice(&d));
  EXL2_CHECK_KIND(Cuda, d >= 0 && d < kMaxDevices, "CUDA device index ", d, " beyond the ", kMaxDevices,
                  " devices exl2cpp supports");
  return d;
}

// Caller holds g_mutex[device].
DeviceState& state_locked(int device) {
  DeviceState& s = g_state[device];
  if (!s.init) {
    DeviceGuard guard(device);
    EXL2_CUDA_CHECK(cudaStreamCreateWithFlags(&s.default_stream, cudaStreamNonBlocking));
    s.current = s.default_stream;
    EXL2_CUDA_CHECK(cudaGetDeviceProperties(&s.prop, device));
    int optin = 0;
    EXL2_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    s.smem_optin = static_cast<size_t>(optin);
    s.init = true;
  }
  return s;
}

DeviceState& state(int device) {
  std::lock_guard<std::mutex> lock(g_mutex[device]);
  return state_locked(device);
}

thread_local int t_defer_frees = 0;
std::mutex g_deferred_mutex;
std::vector<std::pair<int, void*>> g_deferred;  // (device, pointer) freed by release_deferred_frees

}  // namespace

DeferFrees::DeferFrees() { ++t_defer_frees; }
DeferFrees::~DeferFrees() { --t_defer_frees; }

void free_device(void* ptr, int device) {
  if (!ptr) return;
  if (t_defer_frees > 0) {
    std::lock_guard<std::mutex> lock(g_deferred_mutex);
    g_deferred.emplace_back(device, ptr);
    return;
  }
  int prev = -1;
  cudaGetDevice(&prev);
  if (prev != device) cudaSetDevice(device);
  cudaFree(ptr);  // synchronizes the device: kernels still using the buffer finish first
  cudaGetLastError();
  if (prev != device && prev >= 0) cudaSetDevice(prev);
}

void release_deferred_frees() {
  std::vector<std::pair<int, void*>> queue;
  {
    std::lock_guard<std::mutex> lock(g_deferred_mutex);
    queue.swap(g_deferred);
  }
  for (const auto& [device, ptr] : queue) free_device(ptr, device);
}

[[noreturn]] void fail_cuda(cudaError_t err, const char* file, int line, const char* what) {
  cudaGetLastError();  // clear a non-sticky error so later calls are not blamed for it
  EXL2_FAIL(Cuda, file, ":", line, ": ", cudaGetErrorString(err), " (", cudaGetErrorName(err), ") in ", what);
}

[[noreturn]] void fail_cublas(cublasStatus_t st, const char* file, int line, const char* what) {
  EXL2_FAIL(Cuda, file, ":", line, ": cuBLAS error ", static_cast<int>(st), " (", cublasGetStatusString(st),
            ") in ", what);
}

bool sync_check_enabled() { return runtime_options().sync_check; }

bool ref_kernels_enabled() { return runtime_options().cuda_reference; }

void after_launch(const char* file, int line, const char* kernel) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) fail_cuda(err, file, line, kernel);
  if (sync_check_enabled()) {
    cudaStream_t s = current_stream();
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    EXL2_CUDA_CHECK(cudaStreamIsCapturing(s, &cap));
    if (cap == cudaStreamCaptureStatusNone) {
      err = cudaStreamSynchronize(s);
      if (err != cudaSuccess) fail_cuda(err, file, line, kernel);
    }
  }
}

DeviceGuard::DeviceGuard(int device) {
  EXL2_CUDA_CHECK(cudaGetDevice(&prev_));
  if (prev_ != device) EXL2_CUDA_CHECK(cudaSetDevice(device));
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (cudaGetDevice(&now) == cudaSuccess && now != prev_ && prev_ >= 0) cudaSetDevice(prev_);
}

cudaStream_t current_stream(int device) {
  EXL2_CHECK_KIND(Cuda, device >= 0 && device < kMaxDevices, "CUDA device index ", device, " out of range");
  return state(device).current;
}

cudaStream_t current_stream() { return current_stream(current_device()); }

void set_current_stream(int device, cudaStream_t stream) {
  EXL2_CHECK_KIND(Cuda, device >= 0 && device < kMaxDevices, "CUDA device index ", device, " out of range");
  std::lock_guard<std::mutex> lock(g_mutex[device]);
  DeviceState& s = state_locked(device);
  s.current = stream ? stream : s.default_stream;
}

cublasHandle_t cublas_handle() {
  int d = current_device();
  std::lock_guard<std::mutex> lock(g_mutex[d]);
  DeviceState& s = state_locked(d);
  if (!s.cublas) {
    EXL2_CUBLAS_CHECK(cublasCreate(&s.cublas));
    EXL2_CUDA_CHECK(cudaMalloc(&s.cublas_ws, kCublasWorkspaceBytes));
    note_device_malloc();
    // Tensor-core math with fp32 accumulation is chosen per call (CUBLAS_COMPUTE_32F); no TF32 for f32 GEMMs.
    EXL2_CUBLAS_CHECK(cublasSetMathMode(s.cublas, CUBLAS_DEFAULT_MATH));
    EXL2_CUBLAS_CHECK(cublasSetStream(s.cublas, s.current));
    s.cublas_stream = s.current;
    EXL2_CUBLAS_CHECK(cublasSetWorkspace(s.cublas, s.cublas_ws, kCublasWorkspaceBytes));
  }
  if (s.cublas_stream != s.current) {
    // cublasSetStream resets the workspace to cuBLAS's default pool, which may allocate (not allowed while
    // capturing a CUDA graph): give it ours again after every stream change.
    EXL2_CUBLAS_CHECK(cublasSetStream(s.cublas, s.current));
    s.cublas_stream = s.current;
    EXL2_CUBLAS_CHECK(cublasSetWorkspace(s.cublas, s.cublas_ws, kCublasWorkspaceBytes));
  }
  return s.cublas;
}

void* workspace(size_t bytes) {
  int d = current_device();
  std::lock_guard<std::mutex> lock(g_mutex[d]);
  DeviceState& s = state_locked(d);
  if (bytes > s.ws_bytes) {
    size_t grow = bytes + bytes / 4 + (size_t(1) << 20);
    free_device(s.ws, d);  // synchronizes (or is deferred): kernels still reading the old buffer finish
    s.ws = nullptr;
    s.ws_bytes = 0;
    cudaError_t err = cudaMalloc(&s.ws, grow);
    if (err != cudaSuccess) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      EXL2_FAIL(OutOfMemory, "CUDA workspace of ", grow, " bytes could not be allocated on cuda:", d, " (free ",
                free_b, " of ", total_b, " bytes): reduce the batch size or the context length");
    }
    s.ws_bytes = grow;
    note_device_malloc();
    bump_scratch_generation();  // CUDA graphs captured with the old buffer are stale
  }
  return s.ws;
}

int sm_count() { return state(current_device()).prop.multiProcessorCount; }

int compute_capability() {
  const cudaDeviceProp& p = state(current_device()).prop;
  return p.major * 10 + p.minor;
}

size_t max_smem_per_block_optin() { return state(current_device()).smem_optin; }

}  // namespace exl2::cuda
