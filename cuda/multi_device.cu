// Current-device switching, peer access and stream-ordered GPU-to-GPU copies for layer-split models
// (see cuda/multi_device.h).
#include <mutex>

#include "cuda/check.h"
#include "cuda/multi_device.h"
#include "cuda/stream.h"

namespace exl2::cuda {

namespace {

constexpr int kMaxDevices = 64;
std::mutex g_mutex;
cudaEvent_t g_events[kMaxDevices] = {};  // per source device: marks "src stream reached the copy"

cudaEvent_t event_for(int device) {
  EXL2_CHECK_KIND(Cuda, device >= 0 && device < kMaxDevices, "CUDA device index ", device, " out of range");
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_events[device]) {
    DeviceGuard guard(device);
    EXL2_CUDA_CHECK(cudaEventCreateWithFlags(&g_events[device], cudaEventDisableTiming));
  }
  return g_events[device];
}

}  // namespace

ScopedDevice::ScopedDevice(int device) {
  EXL2_CUDA_CHECK(cudaGetDevice(&prev_));
  if (prev_ != device) EXL2_CUDA_CHECK(cudaSetDevice(device));
}

ScopedDevice::~ScopedDevice() {
  int now = -1;
  if (cudaGetDevice(&now) == cudaSuccess && now != prev_ && prev_ >= 0) cudaSetDevice(prev_);
}

bool can_access_peer(int device, int peer) {
  if (device == peer) return false;
  int ok = 0;
  EXL2_CUDA_CHECK(cudaDeviceCanAccessPeer(&ok, device, peer));
  return ok != 0;
}

void enable_peer_access(const std::vector<int>& devices) {
  for (int a : devices) {
    for (int b : devices) {
      if (a == b || !can_access_peer(a, b)) continue;
      DeviceGuard guard(a);
      cudaError_t err = cudaDeviceEnablePeerAccess(b, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // not sticky: clear it
      } else if (err != cudaSuccess) {
        fail_cuda(err, __FILE__, __LINE__, "cudaDeviceEnablePeerAccess");
      }
    }
  }
}

void copy_peer_async(void* dst, int dst_device, const void* src, int src_device, size_t bytes) {
  if (bytes == 0) return;
  cudaEvent_t ev = event_for(src_device);
  {
    DeviceGuard guard(src_device);
    EXL2_CUDA_CHECK(cudaEventRecord(ev, current_stream(src_device)));
  }
  DeviceGuard guard(dst_device);
  cudaStream_t s = current_stream(dst_device);
  EXL2_CUDA_CHECK(cudaStreamWaitEvent(s, ev, 0));
  if (dst_device == src_device) {
    EXL2_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
  } else {
    EXL2_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_device, src, src_device, bytes, s));
  }
}

}  // namespace exl2::cuda
